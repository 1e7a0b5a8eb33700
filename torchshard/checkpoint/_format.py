"""The on-disk format of a checkpoint: names, ``metadata.json`` (sealed by its own SHA-256),
and the validation of every value read from it, by the rules of torch's optimizers for their
hyperparameters and state (no I/O of tensors)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError, LayoutError
from .._layout import FlatLayout, dtype_name
from .._reshard import element_ranges, weight_shards
from ._safetensors import FileRecord, SafetensorsReader, TensorEntry

__all__ = [
    "FORMAT_VERSION",
    "MASTER",
    "OPTIMIZER_RULES",
    "Metadata",
    "OptimMeta",
    "OptimRules",
    "Readers",
    "build_metadata",
    "commit",
    "complete_checkpoints",
    "model_file",
    "optim_file",
    "read_metadata",
    "seal",
    "step_dir",
]

FORMAT_VERSION = 2  # 2: metadata.json ends with its own SHA-256; the index's is recorded
METADATA = "metadata.json"
INDEX = "model.safetensors.index.json"
MASTER = "master"  # the flat state key of fp32 master weights (_ckpt_optim.MASTER)
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def model_file(rank: int, world: int) -> str:
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def optim_file(rank: int, world: int) -> str:
    return f"optim-{rank + 1:05d}-of-{world:05d}.safetensors"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every committed checkpoint under ``root``, oldest first.

    Committed means: the directory has its final name (the rename is the
    commit) and holds ``metadata.json``, written last.
    """
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / METADATA).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def resolve(path: Path) -> Path:
    """A checkpoint directory as given, or the latest complete one under a root."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or checkpoint root")
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: holds no complete checkpoint (step-*/{METADATA})")
    return found[-1][1]


# -- checking values read from metadata.json ----------------------------------------------
_MISSING = object()
_ADVICE = "the file is corrupt or was edited; restore it or load an earlier checkpoint"


class _Invalid(Exception):
    """A value a reader cannot accept: its key path, what was expected, what was found."""

    def __init__(self, path: str, expected: str, got: Any = _MISSING) -> None:
        super().__init__(path)
        self.path, self.expected, self.got = path, expected, got

    def message(self, file: Path) -> str:
        return f"{file}: {self.path}: expected {self.expected}, got {_show(self.got)}; {_ADVICE}"


def _show(v: Any) -> str:
    if v is _MISSING:
        return "nothing (the key is missing)"
    try:
        text = json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 200 else f"{text[:197]}..."


def _at(path: str, key: str | int) -> str:
    """``path`` extended by a key: ``a.b``, ``a[0]``, ``a["model-00001.safetensors"]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}[{json.dumps(key)}]"
    return f"{path}.{key}" if path else key


def _key(d: dict[str, Any], key: str, path: str) -> Any:
    if key not in d:
        raise _Invalid(_at(path, key), "a value")
    return d[key]


def _dict(v: Any, path: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _Invalid(path, "a JSON object", v)
    return v


def _list(v: Any, path: str, n: int | None = None) -> list[Any]:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise _Invalid(path, "a list" if n is None else f"a list of {n}", v)
    return v


def _int(v: Any, path: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise _Invalid(path, f"an integer >= {lo}", v)
    return v


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise _Invalid(path, "a non-empty string", v)
    return v


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _real(v: Any) -> bool:
    """A JSON number that a float32 kernel can take as a scalar (torch raises on overflow)."""
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and abs(v) <= _FLOAT32_MAX
    )


def _file_name(v: Any, path: str, what: str = "a plain file name") -> str:
    if not isinstance(v, str) or not v or Path(v).name != v or v in (".", ".."):
        raise _Invalid(path, f"{what} (no path that could point outside the checkpoint)", v)
    return v


def _dtype(v: Any, path: str) -> torch.dtype:
    dtype = getattr(torch, v, None) if isinstance(v, str) else None
    if not isinstance(dtype, torch.dtype):
        raise _Invalid(path, "a torch dtype name such as 'float32'", v)
    return dtype


# -- what torch's optimizers accept, class by class ---------------------------------------
Rule = Callable[[Any, str], None]


@dataclass(frozen=True)
class _Number:
    """A finite number in a range (``floats``: a JSON float, as torch's Adam demands of betas)."""

    lo: float | None = 0.0
    hi: float | None = None
    hi_open: bool = False
    floats: bool = False

    def __call__(self, v: Any, path: str) -> None:
        ok = _real(v) and (isinstance(v, float) or not self.floats)
        ok = ok and (self.lo is None or v >= self.lo)
        if ok and (self.hi is None or v < self.hi or (v == self.hi and not self.hi_open)):
            return
        kind = "a float" if self.floats else "a number"
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if self.lo is None or (number and not _real(v)):  # finite, beyond float32
            raise _Invalid(path, f"{kind} within float32's range (|x| <= {_FLOAT32_MAX:.4g})", v)
        span = (
            f">= {self.lo:g}"
            if self.hi is None
            else f"in [{self.lo:g}, {self.hi:g}" + (")" if self.hi_open else "]")
        )
        raise _Invalid(path, f"{kind} {span}", v)


@dataclass(frozen=True)
class _Pair:
    item: _Number

    def __call__(self, v: Any, path: str) -> None:
        for i, x in enumerate(_list(v, path, 2)):
            self.item(x, _at(path, i))


def _flag(v: Any, path: str) -> None:
    if not isinstance(v, bool):
        raise _Invalid(path, "true or false", v)


def _maybe_flag(v: Any, path: str) -> None:
    if v is not None and not isinstance(v, bool):
        raise _Invalid(path, "true, false or null", v)


@dataclass(frozen=True)
class _Scalar:
    """Per-parameter scalar state (Adam's ``step``): a tensor of a float dtype, each value a
    finite number in ``[lo, hi]`` (``whole``: integral) that the dtype holds exactly."""

    lo: float = 0.0
    hi: float | None = None
    whole: bool = False

    def __call__(self, spec: dict[str, Any], path: str) -> None:
        name = _key(spec, "dtype", path)
        if name not in ("float32", "float64"):
            raise _Invalid(_at(path, "dtype"), '"float32" or "float64"', name)
        what = "a whole number" if self.whole else "a number"
        what += f" >= {self.lo:g}" if self.hi is None else f" in [{self.lo:g}, {self.hi:g}]"
        for i, v in enumerate(spec["values"]):
            if v is None:
                continue
            ok = _real(v) and v >= self.lo and (self.hi is None or v <= self.hi)
            if not ok or (self.whole and v != int(v)):
                raise _Invalid(_at(_at(path, "values"), i), f"null or {what}", v)
            held = struct.unpack("<f", struct.pack("<f", v))[0] if name == "float32" else float(v)
            if held != v:
                raise _Invalid(_at(_at(path, "values"), i), f"a value that {name} holds", v)


@dataclass(frozen=True)
class OptimRules:
    """What one torch optimizer accepts: its hyperparameters' types and ranges (as its
    constructor checks them), and the state it keeps per parameter."""

    hyper: dict[str, Rule]
    required: tuple[str, ...]  # the keys torch's load_state_dict does not fill in when missing
    flat: Callable[[dict[str, Any]], set[str]]  # state shaped like the parameter, per group
    scalars: dict[str, _Scalar]  # per-parameter scalar state


_GE0 = _Number()
_COMMON: dict[str, Rule] = {
    "lr": _GE0,
    "weight_decay": _GE0,
    "maximize": _flag,
    "foreach": _maybe_flag,
    "differentiable": _flag,
}
_ADAM_LIKE: dict[str, Rule] = {
    **_COMMON,
    "eps": _GE0,
    "betas": _Pair(_Number(0.0, 1.0, hi_open=True)),
    "capturable": _flag,
    "decoupled_weight_decay": _flag,
}
# Torch creates this state in the step that first updates the parameter, and counts that
# step: a saved count is >= 1 (Adagrad alone creates its state, at step 0, in its constructor).
_STEP = {"step": _Scalar(lo=1.0, whole=True)}
_ADAM = OptimRules(
    {
        **_ADAM_LIKE,
        "betas": _Pair(_Number(0.0, 1.0, hi_open=True, floats=True)),
        "amsgrad": _flag,
        "fused": _maybe_flag,
    },
    ("lr", "betas", "eps", "weight_decay"),
    lambda g: {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if g.get("amsgrad") else set()),
    _STEP,
)
OPTIMIZER_RULES: dict[str, OptimRules] = {
    "torch.optim.sgd.SGD": OptimRules(
        {
            **_COMMON,
            "momentum": _GE0,
            "dampening": _Number(lo=None),
            "nesterov": _flag,
            "fused": _maybe_flag,
        },
        ("lr", "momentum", "dampening", "weight_decay"),
        lambda g: {"momentum_buffer"} if g["momentum"] != 0 else set(),
        {},
    ),
    "torch.optim.adam.Adam": _ADAM,
    "torch.optim.adamw.AdamW": _ADAM,
    "torch.optim.adamax.Adamax": OptimRules(
        _ADAM_LIKE,
        ("lr", "betas", "eps", "weight_decay"),
        lambda g: {"exp_avg", "exp_inf"},
        _STEP,
    ),
    "torch.optim.nadam.NAdam": OptimRules(
        {**_ADAM_LIKE, "momentum_decay": _GE0},
        ("lr", "betas", "eps", "weight_decay", "momentum_decay"),
        lambda g: {"exp_avg", "exp_avg_sq"},
        {**_STEP, "mu_product": _Scalar(0.0, 1.0)},
    ),
    "torch.optim.radam.RAdam": OptimRules(
        _ADAM_LIKE,
        ("lr", "betas", "eps", "weight_decay"),
        lambda g: {"exp_avg", "exp_avg_sq"},
        _STEP,
    ),
    "torch.optim.rmsprop.RMSprop": OptimRules(
        {
            **_COMMON,
            "eps": _GE0,
            "alpha": _GE0,
            "momentum": _GE0,
            "centered": _flag,
            "capturable": _flag,
        },
        ("lr", "alpha", "eps", "weight_decay"),
        lambda g: (
            {"square_avg"}
            | ({"momentum_buffer"} if g.get("momentum", 0) > 0 else set())
            | ({"grad_avg"} if g.get("centered") else set())
        ),
        _STEP,
    ),
    "torch.optim.adagrad.Adagrad": OptimRules(
        {
            **_COMMON,
            "eps": _GE0,
            "lr_decay": _GE0,
            "initial_accumulator_value": _GE0,
            "fused": _maybe_flag,
        },
        ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"),
        lambda g: {"sum"},
        {"step": _Scalar(whole=True)},
    ),
    "torch.optim.adadelta.Adadelta": OptimRules(
        {**_COMMON, "eps": _GE0, "rho": _Number(0.0, 1.0), "capturable": _flag},
        ("lr", "rho", "eps", "weight_decay"),
        lambda g: {"square_avg", "acc_delta"},
        _STEP,
    ),
}
"""The optimizers whose checkpointed values are checked against torch's own rules. Any
other optimizer's values are checked against the live optimizer's types at load."""


def _check_group(g: dict[str, Any], path: str, rules: OptimRules | None) -> None:
    """One param group's hyperparameters, by the rules of its optimizer class."""
    if rules is None:
        return
    for key in rules.required:
        _key(g, key, path)
    for key, value in g.items():
        if key in rules.hyper:
            rules.hyper[key](value, _at(path, key))
    if "nesterov" in rules.hyper and g.get("nesterov") and (g["momentum"] <= 0 or g["dampening"]):
        raise _Invalid(
            _at(path, "nesterov"), "false unless momentum > 0 and dampening == 0", g["nesterov"]
        )
    if g.get("fused") and (g.get("differentiable") or g.get("foreach")):
        raise _Invalid(_at(path, "fused"), "false or null with differentiable or foreach", True)


# -- metadata.json ------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimMeta:
    """The optimizer section of ``metadata.json``, parsed."""

    cls: str
    flat_state: dict[str, torch.dtype]
    scalar_state: dict[str, Any]
    param_groups: list[dict[str, Any]]
    stateful: str
    files: list[tuple[str, int, int]]  # (file, start, end) in flat-buffer elements

    @property
    def rules(self) -> OptimRules | None:
        return OPTIMIZER_RULES.get(self.cls)

    def slot_groups(self, layout: FlatLayout) -> list[int | None]:
        """Each slot's param group (``None``: in none)."""
        index = {s.name: i for i, s in enumerate(layout.slots)}
        out: list[int | None] = [None] * len(layout.slots)
        for g, group in enumerate(self.param_groups):
            for name in group["params"]:
                out[index[name]] = g
        return out


def _parse_optim(o: Any, layout: FlatLayout) -> OptimMeta:
    path = "optimizer"
    o = _dict(o, path)
    n, names = len(layout.slots), {s.name for s in layout.slots}
    cls = _str(_key(o, "class", path), _at(path, "class"))
    rules = OPTIMIZER_RULES.get(cls)
    groups = _list(_key(o, "param_groups", path), _at(path, "param_groups"))
    if not groups:
        raise _Invalid(_at(path, "param_groups"), "at least one param group", groups)
    seen: set[str] = set()
    for g, group in enumerate(groups):
        where = _at(_at(path, "param_groups"), g)
        group = _dict(group, where)
        params = _list(_key(group, "params", where), _at(where, "params"))
        for i, name in enumerate(params):
            if name not in names or name in seen:
                what = "a parameter of the layout" + (", in one group only" if seen else "")
                raise _Invalid(_at(_at(where, "params"), i), what, name)
            seen.add(name)
        _check_group(group, where, rules)
    flat_state = {
        str(k): _dtype(v, _at(_at(path, "flat_state"), k))
        for k, v in _dict(_key(o, "flat_state", path), _at(path, "flat_state")).items()
    }
    stateful = _key(o, "stateful", path)
    if not isinstance(stateful, str) or len(stateful) != n or set(stateful) - {"0", "1"}:
        raise _Invalid(_at(path, "stateful"), f"{n} characters 0 or 1, one per parameter", stateful)
    scalar_state = _dict(_key(o, "scalar_state", path), _at(path, "scalar_state"))
    for key, spec in scalar_state.items():
        where = _at(_at(path, "scalar_state"), key)
        spec = _dict(spec, where)
        values = _list(_key(spec, "values", where), _at(where, "values"), n)
        if spec.get("dtype") != "python":
            _dtype(_key(spec, "dtype", where), _at(where, "dtype"))
        for i, v in enumerate(values):
            if v is not None and not isinstance(v, (int, float)):
                raise _Invalid(_at(_at(where, "values"), i), "a number or null", v)
            if v is not None and stateful[i] != "1":
                raise _Invalid(_at(_at(where, "values"), i), "null (the parameter has no state)", v)
    files = []
    for i, f in enumerate(_list(_key(o, "files", path), _at(path, "files"))):
        where = _at(_at(path, "files"), i)
        f = _dict(f, where)
        start, end = _list(_key(f, "range", where), _at(where, "range"), 2)
        start, end = (
            _int(start, _at(_at(where, "range"), 0)),
            _int(end, _at(_at(where, "range"), 1)),
        )
        files.append((_file_name(_key(f, "file", where), _at(where, "file")), start, end))
    meta = OptimMeta(cls, flat_state, scalar_state, groups, stateful, files)
    where_group = meta.slot_groups(layout)
    for i, flag in enumerate(stateful):
        if flag == "1" and where_group[i] is None:
            raise _Invalid(
                _at(path, "stateful"), f"0 for {layout.slots[i].name!r}, in no param group", "1"
            )
    if rules is not None:
        _check_state(meta, layout, rules, where_group)
    return meta


def _check_state(
    meta: OptimMeta, layout: FlatLayout, rules: OptimRules, where_group: list[int | None]
) -> None:
    """The state a known optimizer keeps: its keys, and every stateful parameter's scalars."""
    path = "optimizer"
    active = {where_group[i] for i, f in enumerate(meta.stateful) if f == "1"}
    want: set[str] = set()
    for g in active:
        want |= rules.flat(meta.param_groups[g])  # type: ignore[index]
    have = set(meta.flat_state) - {MASTER}
    if have != want:
        raise _Invalid(_at(path, "flat_state"), f"the keys {sorted(want)}", sorted(have))
    want_scalars = set(rules.scalars) if active else set()
    if set(meta.scalar_state) != want_scalars:
        raise _Invalid(
            _at(path, "scalar_state"), f"the keys {sorted(want_scalars)}", sorted(meta.scalar_state)
        )
    for key, spec in meta.scalar_state.items():
        where = _at(_at(path, "scalar_state"), key)
        rules.scalars[key](spec, where)
        for i, v in enumerate(spec["values"]):
            if v is None and meta.stateful[i] == "1":
                what = f"a value ({layout.slots[i].name!r} has state)"
                raise _Invalid(_at(_at(where, "values"), i), what, None)


def _check_layout(v: Any) -> dict[str, Any]:
    """The layout's JSON, strictly typed, before :class:`FlatLayout` checks how it adds up."""
    d = _dict(v, "layout")
    _int(_key(d, "format", "layout"), "layout.format", 1)
    itemsize = _dtype(_key(d, "dtype", "layout"), "layout.dtype").itemsize
    align = _int(_key(d, "align_bytes", "layout"), "layout.align_bytes", 1)
    if align % itemsize:
        raise _Invalid("layout.align_bytes", f"a multiple of {itemsize}", align)
    _int(_key(d, "numel", "layout"), "layout.numel")
    for i, slot in enumerate(_list(_key(d, "slots", "layout"), "layout.slots")):
        where = f"layout.slots[{i}]"
        name, shape, offset, numel, requires_grad, aliases = _list(slot, where, 6)
        _str(name, f"{where}[0]")
        for j, dim in enumerate(_list(shape, f"{where}[1]")):
            _int(dim, f"{where}[1][{j}]")
        _int(offset, f"{where}[2]")
        _int(numel, f"{where}[3]")
        _flag(requires_grad, f"{where}[4]")
        for j, alias in enumerate(_list(aliases, f"{where}[5]")):
            _str(alias, f"{where}[5][{j}]")
    return d


def _coverage(meta: Metadata) -> None:
    """Every slot in exactly one weight file, every flat element in exactly one optimizer file."""
    n, pos = len(meta.layout.slots), 0
    for i, w in enumerate(meta.weights):
        lo, hi = w["slots"]
        if lo != pos or hi <= lo:
            raise _Invalid(f"weights.shards[{i}].slots", f"[{pos}, ...) (slots in order)", [lo, hi])
        pos = hi
    if pos != n:
        raise _Invalid("weights.shards", f"files holding all {n} slots, [0, {n})", f"[0, {pos})")
    opt = meta.optim
    if opt is None:
        return
    if not opt.flat_state:
        if opt.files:
            raise _Invalid("optimizer.files", "[] (there is no flat state)", len(opt.files))
        return
    pos = 0
    for i, (_, start, end) in enumerate(opt.files):
        if start != pos or end <= start:
            raise _Invalid(f"optimizer.files[{i}].range", f"[{pos}, ...)", [start, end])
        pos = end
    if pos != meta.layout.numel:
        raise _Invalid(
            "optimizer.files", f"ranges covering [0, {meta.layout.numel})", f"[0, {pos})"
        )


@dataclass(frozen=True)
class Metadata:
    """A parsed, validated ``metadata.json``."""

    path: Path
    step: int
    world_size: int
    layout: FlatLayout
    files: dict[str, FileRecord]
    weights: list[dict[str, Any]]  # [{"file", "slots": [lo, hi]}], one per saving rank with weights
    buffers: dict[str, str]  # buffer name -> file
    optim: OptimMeta | None
    extra: dict[str, Any]
    raw: dict[str, Any]  # the parsed JSON, without its checksum
    model_config: dict[str, Any] | None = (
        None  # a transformers model's config.json, when saved from one
    )
    protected: bool = True  # metadata.json carries a checksum (format 2 on), and it matched
    index: dict[str, Any] | None = None  # size and SHA-256 of model.safetensors.index.json

    def file_path(self, name: str) -> Path:
        return self.path / name


# -- the checksum of metadata.json --------------------------------------------------------
_SEAL = b',"sha256":"'
_SEAL_LEN = len(_SEAL) + 64 + 2  # the marker, 64 hex digits, '"}'


def seal(content: dict[str, Any]) -> bytes:
    """``content`` as compact JSON, ending with ``"sha256"``: the SHA-256 of every byte before
    ``,"sha256":"``. A flipped bit anywhere, the checksum included, no longer matches."""
    if "sha256" in content:
        raise ValueError("metadata: 'sha256' is the checksum's key")
    body = json.dumps(content, separators=(",", ":")).encode()
    head = body[:-1]  # without the closing brace
    return head + _SEAL + hashlib.sha256(head).hexdigest().encode() + b'"}'


def _unseal(meta_path: Path, data: bytes) -> bool:
    """Whether ``data`` ends with a checksum (then verified); raise if it does not match."""
    tail = data[-_SEAL_LEN:]
    if len(data) <= _SEAL_LEN or not tail.startswith(_SEAL) or not tail.endswith(b'"}'):
        return False
    recorded = tail[len(_SEAL) : -2]
    actual = hashlib.sha256(data[:-_SEAL_LEN]).hexdigest().encode()
    if recorded != actual:
        raise CheckpointError(
            f"{meta_path}: checksum mismatch: its content hashes to sha256 {actual.decode()}, "
            f"the file records {recorded.decode(errors='replace')!r}; {_ADVICE}"
        )
    return True


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice in one object")
        out[k] = v
    return out


def _read_json(meta_path: Path, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError too
        raise CheckpointError(f"{meta_path}: not valid JSON ({e}); {_ADVICE}") from e


def read_metadata(path: Path) -> Metadata:
    """Read, verify and validate ``path/metadata.json``; raise :class:`CheckpointError` on
    anything wrong, naming the key path and the value."""
    meta_path = path / METADATA
    try:
        data = meta_path.read_bytes()
    except FileNotFoundError as e:
        raise CheckpointError(f"{meta_path}: missing; {path} is not a complete checkpoint") from e
    except OSError as e:
        raise CheckpointError(f"{meta_path}: cannot read ({e.strerror or e})") from e
    protected = _unseal(meta_path, data)
    raw = _read_json(meta_path, data)
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{meta_path}: expected a JSON object, got {type(raw).__name__}; {_ADVICE}"
        )
    raw.pop("sha256", None)
    version = raw.get("format_version", _MISSING)
    if type(version) is not int or version < 1:
        raise CheckpointError(
            _Invalid("format_version", "an integer >= 1", version).message(meta_path)
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: format_version {version} is newer than this torchshard reads "
            f"({FORMAT_VERSION}); upgrade torchshard to load it"
        )
    if version >= 2 and not protected:
        raise CheckpointError(
            f"{meta_path}: checksum missing: format {version} ends with "
            f'\',"sha256":"<64 hex digits>"}}\', this file does not; {_ADVICE}'
        )
    try:
        meta = _parse(path, raw, protected)
    except _Invalid as e:
        raise CheckpointError(e.message(meta_path)) from None
    except LayoutError as e:
        raise CheckpointError(f"{meta_path}: {e}; {_ADVICE}") from e
    return meta


def _parse(path: Path, raw: dict[str, Any], protected: bool) -> Metadata:
    step = _int(_key(raw, "step", ""), "step")
    m = _STEP_RE.match(path.name)
    if m and int(m.group(1)) != step:
        raise _Invalid("step", f"{int(m.group(1))} (the directory is {path.name})", step)
    world = _int(_key(raw, "world_size", ""), "world_size", 1)
    layout = FlatLayout.from_dict(_check_layout(_key(raw, "layout", "")))
    files = {}
    for name, rec in _dict(_key(raw, "files", ""), "files").items():
        where = _at("files", name)
        _file_name(name, "files", "keys that are plain file names")
        try:
            files[name] = FileRecord.from_dict(rec)
        except ValueError as e:
            raise _Invalid(
                where, '{"size": <integer >= 8>, "header_crc32": <8 hex digits>}', rec
            ) from e
    w = _dict(_key(raw, "weights", ""), "weights")
    weights = []
    for i, shard in enumerate(_list(_key(w, "shards", "weights"), "weights.shards")):
        where = f"weights.shards[{i}]"
        shard = _dict(shard, where)
        lo, hi = _list(_key(shard, "slots", where), f"{where}.slots", 2)
        slots = [_int(lo, f"{where}.slots[0]"), _int(hi, f"{where}.slots[1]")]
        weights.append(
            {"file": _file_name(_key(shard, "file", where), f"{where}.file"), "slots": slots}
        )
    buffers = {
        _str(k, "weights.buffers"): _file_name(v, _at("weights.buffers", k))
        for k, v in _dict(_key(w, "buffers", "weights"), "weights.buffers").items()
    }
    o = _key(raw, "optimizer", "")
    optim = None if o is None else _parse_optim(o, layout)
    extra = _dict(_key(raw, "extra", ""), "extra")
    model_config = raw.get("model_config")
    if model_config is not None:
        _dict(model_config, "model_config")
    index = raw.get("index")
    if index is not None or raw["format_version"] >= 2:
        index = _dict(_key(raw, "index", ""), "index")
        _int(_key(index, "size", "index"), "index.size")
        digest = _key(index, "sha256", "index")
        if not isinstance(digest, str) or not re.fullmatch("[0-9a-f]{64}", digest):
            raise _Invalid("index.sha256", "64 lowercase hex digits", digest)
    meta = Metadata(
        path=path,
        step=step,
        world_size=world,
        layout=layout,
        files=files,
        weights=weights,
        buffers=buffers,
        optim=optim,
        extra=extra,
        raw=raw,
        model_config=model_config,
        protected=protected,
        index=index,
    )
    _coverage(meta)
    shards = max(len(weights), len(optim.files) if optim is not None else 0)
    if world < shards:
        raise _Invalid("world_size", f"at least {shards} (one file per saving rank)", world)
    referenced = [w["file"] for w in weights] + list(buffers.values())
    referenced += [f for f, _, _ in optim.files] if optim is not None else []
    missing = sorted(set(referenced) - set(files))
    if missing:
        raise _Invalid("files", f"a size/checksum record for {missing}", sorted(files))
    return meta


class Readers:
    """Opens a checkpoint's files on demand, a few at a time; counts the bytes read."""

    def __init__(self, meta: Metadata, max_open: int = 8) -> None:
        self.meta = meta
        self.max_open = max_open
        self._open: dict[str, SafetensorsReader] = {}  # in order of last use
        self.bytes_read = 0

    def __getitem__(self, name: str) -> SafetensorsReader:
        reader = self._open.pop(name, None)
        if reader is None:
            if len(self._open) >= self.max_open:
                self._close(next(iter(self._open)))
            reader = SafetensorsReader(self.meta.file_path(name), self.meta.files[name])
        self._open[name] = reader
        return reader

    def entry(
        self, file: str, name: str, dtype: torch.dtype | None, shape: tuple[int, ...] | None
    ) -> TensorEntry:
        """Tensor ``name`` of ``file``; raise :class:`CheckpointError` unless it is as expected."""
        reader = self[file]
        e = reader.entries.get(name)
        if e is None or (dtype is not None and e.dtype != dtype) or shape not in (None, e.shape):
            want = f"{dtype_name(dtype) if dtype else 'a tensor'} {list(shape or ())}"
            found = "nothing" if e is None else f"{dtype_name(e.dtype)} {list(e.shape)}"
            raise CheckpointError(f"{reader.path}: tensor {name!r}: expected {want}, found {found}")
        return e

    def _close(self, name: str) -> None:
        reader = self._open.pop(name)
        self.bytes_read += reader.bytes_read
        reader.close()

    def close(self) -> None:
        while self._open:
            self._close(next(iter(self._open)))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def index_json(metadata: dict[str, Any], buffer_bytes: int) -> dict[str, Any]:
    """``model.safetensors.index.json`` of a checkpoint whose ``metadata.json`` is ``metadata``
    (``buffer_bytes``: the module buffers' bytes, for ``total_size``)."""
    layout = FlatLayout.from_dict(metadata["layout"])
    weight_map, total = {}, buffer_bytes
    for shard in metadata["weights"]["shards"]:
        lo, hi = shard["slots"]
        for s in layout.slots[lo:hi]:
            weight_map[s.name] = shard["file"]
            total += s.numel * layout.torch_dtype.itemsize
    weight_map.update(metadata["weights"]["buffers"])
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def commit(
    tmp: Path, final: Path, metadata: dict[str, Any], files: dict[str, Any], buffer_bytes: int
) -> None:
    """Write the index and ``metadata.json`` (last) into ``tmp``, then rename it to ``final``.

    ``metadata`` is everything but ``"files"``, which is ``files`` (name ->
    record dict); ``buffer_bytes`` counts the module buffers for the index's
    ``total_size``. ``metadata.json`` records the index's size and SHA-256 and
    ends with its own (:func:`seal`). The rename is the commit; both
    directories are fsynced.
    """
    index = json.dumps(index_json(metadata, buffer_bytes), separators=(",", ":")).encode()
    write_bytes(tmp / INDEX, index)
    content = {k: v for k, v in metadata.items() if k not in ("files", "index", "sha256")}
    content["format_version"] = FORMAT_VERSION
    content["index"] = {"size": len(index), "sha256": hashlib.sha256(index).hexdigest()}
    content["files"] = files
    write_bytes(tmp / METADATA, seal(content))  # last: its presence means complete
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def build_metadata(
    layout: FlatLayout,
    world_size: int,
    step: int,
    buffers: list[str],
    optimizer: dict[str, Any] | None,
    extra: dict[str, Any],
    model_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``metadata.json`` of a save at ``world_size``, without ``files`` (pure: no tensors).

    ``optimizer`` holds ``class``, ``param_groups``, ``flat_state``,
    ``scalar_state`` and ``stateful``; the file list is derived here.
    """
    shards = weight_shards(layout, world_size)
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "layout": layout.to_dict(),
        "weights": {
            "shards": [
                {"file": model_file(r, world_size), "slots": [a, b]}
                for r, (a, b) in enumerate(shards)
                if b > a
            ],
            "buffers": {n: model_file(0, world_size) for n in buffers},
        },
        "optimizer": None,
        "extra": extra,
        "model_config": model_config,
    }
    if optimizer is not None:
        align = layout.align_bytes // layout.torch_dtype.itemsize
        ranges = element_ranges(layout.numel, world_size, align)
        files = [
            {"file": optim_file(r, world_size), "range": [a, b]}
            for r, (a, b) in enumerate(ranges)
            if b > a and optimizer["flat_state"]
        ]
        meta["optimizer"] = {**optimizer, "files": files}
    return meta
