"""Reading a checkpoint: ``metadata.json`` verified against its SHA-256, then every value
validated before anything uses it (:func:`read_metadata`); its files opened on demand
(:class:`Readers`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError, LayoutError
from .._flat.layout import FlatLayout, dtype_name
from ._comm_meta import CommMeta, parse_comm
from ._format import FORMAT_VERSION, METADATA, MIXED_VERSION, step_of, unseal
from ._rules import (
    ADVICE,
    MISSING,
    OPTIMIZER_RULES,
    Invalid,
    OptimRules,
    at,
    check_group,
    check_layout,
    expect_choice,
    expect_dict,
    expect_dtype,
    expect_file_name,
    expect_flag,
    expect_int,
    expect_key,
    expect_list,
    expect_str,
)
from ._safetensors import FileRecord, SafetensorsReader, TensorEntry
from ._streams import MASTER, Stream, parse_flat_state

__all__ = ["Metadata", "OptimMeta", "Readers", "layout_difference", "read_metadata"]


# -- metadata.json ------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimMeta:
    """The optimizer section of ``metadata.json``, parsed."""

    cls: str
    streams: tuple[Stream, ...]  # the flat state, as the optimizer files hold it
    scalar_state: dict[str, Any]
    param_groups: list[dict[str, Any]]
    stateful: str
    files: list[tuple[str, int, int]]  # (file, start, end) in flat-buffer elements
    trainable_only: bool = False
    """The files store the trainable parameters' state alone (``"stored": "trainable"``):
    their parts of each range are :func:`~._plan.stored_parts`."""

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
    o = expect_dict(o, path)
    n, names = len(layout.slots), {s.name for s in layout.slots}
    cls = expect_str(expect_key(o, "class", path), at(path, "class"))
    rules = OPTIMIZER_RULES.get(cls)
    groups = expect_list(expect_key(o, "param_groups", path), at(path, "param_groups"))
    if not groups:
        raise Invalid(at(path, "param_groups"), "at least one param group", groups)
    seen: set[str] = set()
    for g, group in enumerate(groups):
        where = at(at(path, "param_groups"), g)
        group = expect_dict(group, where)
        params = expect_list(expect_key(group, "params", where), at(where, "params"))
        for i, name in enumerate(params):
            if name not in names or name in seen:
                what = "a parameter of the layout" + (", in one group only" if seen else "")
                raise Invalid(at(at(where, "params"), i), what, name)
            seen.add(name)
        check_group(group, where, rules)
    streams = parse_flat_state(expect_key(o, "flat_state", path), layout)
    stateful = expect_key(o, "stateful", path)
    if not isinstance(stateful, str) or len(stateful) != n or set(stateful) - {"0", "1"}:
        raise Invalid(at(path, "stateful"), f"{n} characters 0 or 1, one per parameter", stateful)
    scalar_state = expect_dict(expect_key(o, "scalar_state", path), at(path, "scalar_state"))
    for key, spec in scalar_state.items():
        where = at(at(path, "scalar_state"), key)
        spec = expect_dict(spec, where)
        values = expect_list(expect_key(spec, "values", where), at(where, "values"), n)
        if spec.get("dtype") != "python":
            expect_dtype(expect_key(spec, "dtype", where), at(where, "dtype"))
        for i, v in enumerate(values):
            if v is not None and not isinstance(v, (int, float)):
                raise Invalid(at(at(where, "values"), i), "a number or null", v)
            if v is not None and stateful[i] != "1":
                raise Invalid(at(at(where, "values"), i), "null (the parameter has no state)", v)
    files = []
    for i, f in enumerate(expect_list(expect_key(o, "files", path), at(path, "files"))):
        where = at(at(path, "files"), i)
        f = expect_dict(f, where)
        start, end = expect_list(expect_key(f, "range", where), at(where, "range"), 2)
        start, end = (
            expect_int(start, at(at(where, "range"), 0)),
            expect_int(end, at(at(where, "range"), 1)),
        )
        files.append(
            (expect_file_name(expect_key(f, "file", where), at(where, "file")), start, end)
        )
    stored = expect_choice(o.get("stored", "all"), at(path, "stored"), ("all", "trainable"))
    meta = OptimMeta(cls, streams, scalar_state, groups, stateful, files, stored == "trainable")
    where_group = meta.slot_groups(layout)
    for i, flag in enumerate(stateful):
        if flag == "1" and where_group[i] is None:
            raise Invalid(
                at(path, "stateful"), f"0 for {layout.slots[i].name!r}, in no param group", "1"
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
    have = {s.key for s in meta.streams} - {MASTER}
    if have != want:
        raise Invalid(at(path, "flat_state"), f"the keys {sorted(want)}", sorted(have))
    want_scalars = set(rules.scalars) if active else set()
    if set(meta.scalar_state) != want_scalars:
        raise Invalid(
            at(path, "scalar_state"), f"the keys {sorted(want_scalars)}", sorted(meta.scalar_state)
        )
    for key, spec in meta.scalar_state.items():
        where = at(at(path, "scalar_state"), key)
        rules.scalars[key](spec, where)
        for i, v in enumerate(spec["values"]):
            if v is None and meta.stateful[i] == "1":
                what = f"a value ({layout.slots[i].name!r} has state)"
                raise Invalid(at(at(where, "values"), i), what, None)


def layout_difference(saved: FlatLayout, live: FlatLayout) -> str | None:
    """The first difference of a checkpoint's layout from the live model's, or ``None``: a
    parameter of another dtype by name (before the offsets it moved), else
    :meth:`FlatLayout.first_difference`.

    Example::

        layout_difference(meta.layout, fm.layout)  # "parameter 'w': bfloat16 in the ..."
    """
    for a, b in zip(saved.slots, live.slots):
        if a.name == b.name and a.dtype != b.dtype:
            return f"parameter {a.name!r}: {a.dtype} in the checkpoint, {b.dtype} in this model"
    return saved.first_difference(live)


def _coverage(meta: Metadata) -> None:
    """Every slot in exactly one weight file, every flat element in exactly one optimizer file."""
    n, pos = len(meta.layout.slots), 0
    for i, w in enumerate(meta.weights):
        lo, hi = w["slots"]
        if lo != pos or hi <= lo:
            raise Invalid(f"weights.shards[{i}].slots", f"[{pos}, ...) (slots in order)", [lo, hi])
        pos = hi
    if pos != n:
        raise Invalid("weights.shards", f"files holding all {n} slots, [0, {n})", f"[0, {pos})")
    opt = meta.optim
    if opt is None:
        return
    if not opt.streams:
        if opt.files:
            raise Invalid("optimizer.files", "[] (there is no flat state)", len(opt.files))
        return
    pos = 0
    for i, (_, start, end) in enumerate(opt.files):
        if start != pos or end <= start:
            raise Invalid(f"optimizer.files[{i}].range", f"[{pos}, ...)", [start, end])
        pos = end
    if pos != meta.layout.numel:
        raise Invalid("optimizer.files", f"ranges covering [0, {meta.layout.numel})", f"[0, {pos})")


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
    comm: CommMeta | None = None  # a lossy comm's state (format 5), when saved with one

    def optim_for(self, optimizer: torch.optim.Optimizer) -> OptimMeta:
        """The saved optimizer section, checked to be of ``optimizer``'s class.

        Example::

            saved = meta.optim_for(opt)   # CheckpointError: no state, or another class
        """
        if self.optim is None:
            raise CheckpointError(
                f"{self.path}: holds no optimizer state; load with optimizer=None"
            )
        cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        if self.optim.cls != cls:
            raise CheckpointError(
                f"{self.path}: optimizer: checkpoint has {self.optim.cls}, got {cls}"
            )
        return self.optim

    def file_path(self, name: str) -> Path:
        return self.path / name


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
        raise CheckpointError(f"{meta_path}: not valid JSON ({e}); {ADVICE}") from e


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
    protected = unseal(meta_path, data)
    raw = _read_json(meta_path, data)
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{meta_path}: expected a JSON object, got {type(raw).__name__}; {ADVICE}"
        )
    raw.pop("sha256", None)
    version = raw.get("format_version", MISSING)
    if type(version) is not int or version < 1:
        raise CheckpointError(
            Invalid("format_version", "an integer >= 1", version).message(meta_path)
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: format_version {version} is newer than this torchshard reads "
            f"({FORMAT_VERSION}); upgrade torchshard to load it"
        )
    if version >= 2 and not protected:
        raise CheckpointError(
            f"{meta_path}: checksum missing: format {version} ends with "
            f'\',"sha256":"<64 hex digits>"}}\', this file does not; {ADVICE}'
        )
    try:
        meta = _parse(path, raw, protected)
    except Invalid as e:
        raise CheckpointError(e.message(meta_path)) from None
    except LayoutError as e:
        raise CheckpointError(f"{meta_path}: {e}; {ADVICE}") from e
    return meta


def _parse(path: Path, raw: dict[str, Any], protected: bool) -> Metadata:
    step = expect_int(expect_key(raw, "step", ""), "step")
    named = step_of(path)
    if named is not None and named != step:
        raise Invalid("step", f"{named} (the directory is {path.name})", step)
    world = expect_int(expect_key(raw, "world_size", ""), "world_size", 1)
    layout = FlatLayout.from_dict(check_layout(expect_key(raw, "layout", "")))
    if layout.mixed and raw["format_version"] < MIXED_VERSION:  # its optimizer state differs
        what = f"{MIXED_VERSION} or more (the layout has several dtypes)"
        raise Invalid("format_version", what, raw["format_version"])
    files = {}
    for name, rec in expect_dict(expect_key(raw, "files", ""), "files").items():
        where = at("files", name)
        expect_file_name(name, "files", "keys that are plain file names")
        try:
            files[name] = FileRecord.from_dict(rec)
        except ValueError as e:
            raise Invalid(
                where, '{"size": <integer >= 8>, "header_crc32": <8 hex digits>}', rec
            ) from e
    w = expect_dict(expect_key(raw, "weights", ""), "weights")
    expect_flag(w.get("frozen", True), "weights.frozen")  # False: saved without frozen weights
    weights = []
    for i, shard in enumerate(expect_list(expect_key(w, "shards", "weights"), "weights.shards")):
        where = f"weights.shards[{i}]"
        shard = expect_dict(shard, where)
        lo, hi = expect_list(expect_key(shard, "slots", where), f"{where}.slots", 2)
        slots = [expect_int(lo, f"{where}.slots[0]"), expect_int(hi, f"{where}.slots[1]")]
        file = expect_file_name(expect_key(shard, "file", where), f"{where}.file")
        weights.append({"file": file, "slots": slots})
    buffers = {
        expect_str(k, "weights.buffers"): expect_file_name(v, at("weights.buffers", k))
        for k, v in expect_dict(expect_key(w, "buffers", "weights"), "weights.buffers").items()
    }
    o = expect_key(raw, "optimizer", "")
    optim = None if o is None else _parse_optim(o, layout)
    extra = expect_dict(expect_key(raw, "extra", ""), "extra")
    model_config = raw.get("model_config")
    if model_config is not None:
        expect_dict(model_config, "model_config")
    index = raw.get("index")
    if index is not None or raw["format_version"] >= 2:
        index = expect_dict(expect_key(raw, "index", ""), "index")
        expect_int(expect_key(index, "size", "index"), "index.size")
        digest = expect_key(index, "sha256", "index")
        if not isinstance(digest, str) or not re.fullmatch("[0-9a-f]{64}", digest):
            raise Invalid("index.sha256", "64 lowercase hex digits", digest)
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
        comm=parse_comm(raw.get("comm"), layout, raw["format_version"]),
    )
    _coverage(meta)
    comm = [f for f, _ in meta.comm.files] if meta.comm is not None else []
    shards = max(len(weights), len(optim.files) if optim is not None else 0, len(comm))
    if world < shards:
        raise Invalid("world_size", f"at least {shards} (one file per saving rank)", world)
    referenced = [w["file"] for w in weights] + list(buffers.values())
    referenced += [f for f, _, _ in optim.files] if optim is not None else []
    referenced += comm
    missing = sorted(set(referenced) - set(files))
    if missing:
        raise Invalid("files", f"a size/checksum record for {missing}", sorted(files))
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
