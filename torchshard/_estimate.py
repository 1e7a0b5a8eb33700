"""Per-rank training memory of a model, before any GPU is involved (``torchshard estimate``).

The model is built on the meta device (no storage) from a transformers config or a
factory; its flat layout goes through :func:`plan_memory`, the rules the trainer allocates
by, in each mode: replicated, sharded (``shard=True``) and fully sharded (``shard="full"``,
whose unit buffers are counted at their peak as ``transient``). Activations, temporary
buffers, the CUDA context and allocator fragmentation are not counted.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._errors import TorchShardError
from ._flat.layout import FlatLayout, dtype_name
from ._flat.module import FlatParamModule
from ._log import get_logger
from ._parallel.memory import (
    OPTIMIZER_STATES,
    RankMemory,
    check_shard,
    padded_numel,
    plan_memory,
    transient_of_sizes,
)
from ._parallel.units import Unit, layout_units

__all__ = [
    "DTYPES",
    "MAX_WORLD_SIZE",
    "MODES",
    "NOT_COUNTED",
    "OPTIMIZERS",
    "EstimateError",
    "MemoryEstimate",
    "ModeEstimate",
    "build_hf_model",
    "estimate_memory",
    "format_estimate",
    "is_factory",
    "layout_of",
    "parse_bytes",
    "parse_override",
]

logger = get_logger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES: dict[bool | str, str] = {False: "replicated", True: "sharded", "full": "full"}
"""The trainer's ``shard=`` values and the estimate's name for each."""
MAX_WORLD_SIZE = 65536
OPTIMIZERS = tuple(OPTIMIZER_STATES)
NOT_COUNTED = (
    "activations",
    "temporary buffers",
    "the CUDA context",
    "allocator fragmentation",
)
_MASTER_DTYPE = torch.float32  # the trainer's default master_dtype
_HF_HINT = "pip install transformers accelerate (or pip install -e '.[hf]' in a clone)"


class EstimateError(TorchShardError, ValueError):
    """A bad input to the estimator: model, override, size, world size or missing extra."""


# -- parsing ------------------------------------------------------------------------------
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}  # bare letters: binary
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"80GiB"`` / ``"24G"`` (binary), ``"80GB"`` (decimal), ``"1e9"`` / ``"1000"`` (bytes)."""
    m = _SIZE.fullmatch(text)
    if m is None:
        try:
            value = float(text)  # 1e9
        except ValueError:
            value = -1.0
        if not (value > 0 and math.isfinite(value)):
            raise EstimateError(
                f"device memory: expected a size such as 80GiB, 80GB, 24G or a number of "
                f"bytes, got {text!r}"
            ) from None
        return int(value)
    number, prefix, binary, b = m.groups()
    prefix = prefix.lower()
    if binary and not prefix:
        raise EstimateError(f"device memory: expected a unit such as GiB, got {text!r}")
    unit = _UNITS[prefix] if binary or not b else 1000 ** "_kmgt".index(prefix)
    value = int(float(number) * unit)
    if value <= 0:
        raise EstimateError(f"device memory: expected a positive size, got {text!r}")
    return value


def parse_override(item: str) -> tuple[str, Any]:
    """``"num_hidden_layers=80"`` -> ``("num_hidden_layers", 80)``: JSON values, else strings."""
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not key.isidentifier():
        raise EstimateError(f"--set: expected key=value (e.g. num_hidden_layers=80), got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


# -- building the model on meta -----------------------------------------------------------
def is_factory(spec: str) -> bool:
    """``module:callable`` (and not an existing file whose name happens to hold a colon)."""
    return ":" in spec and not Path(spec).exists()


def _import_hf() -> tuple[Any, Any]:
    try:
        import transformers
        from accelerate import init_empty_weights
    except ImportError as e:
        raise EstimateError(
            f"transformers models: expected transformers and accelerate, got {e}; run {_HF_HINT}"
        ) from e
    return transformers, init_empty_weights


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}"


def _read_config(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise EstimateError(f"{path}: expected a transformers config.json, got no such file")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EstimateError(f"{path}: expected a transformers config JSON file, got {e}") from e
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise EstimateError(
            f"{path}: expected a JSON object with a 'model_type' (e.g. \"llama\"), got "
            f"{'no model_type' if isinstance(config, dict) else type(config).__name__}"
        )
    return config


def build_hf_model(spec: str, overrides: Mapping[str, Any] | None = None) -> nn.Module:
    """A causal LM built on meta from a config JSON file (or a directory holding config.json)
    or a transformers ``model_type`` with its defaults; ``overrides`` replace config values.

    Never downloads: configs come from local files or transformers' own defaults.
    """
    overrides = dict(overrides or {})
    path = Path(spec)
    if path.exists():
        values = _read_config(path)
        model_type = values.pop("model_type")
        where = str(path)
    elif spec.endswith(".json") or "/" in spec or "\\" in spec:
        raise EstimateError(f"model {spec!r}: expected a config JSON file, got no such file")
    else:
        model_type, values, where = spec, {}, f"model_type {spec!r}"
    transformers, init_empty_weights = _import_hf()
    if model_type not in transformers.CONFIG_MAPPING:
        known = [k for k in transformers.CONFIG_MAPPING if k == k.lower()]
        close = difflib.get_close_matches(model_type, known, cutoff=0.75)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise EstimateError(
            f"model {spec!r}: expected a config JSON file, a transformers model_type such as "
            f"'llama' or 'gpt2', or 'module:callable', got {model_type!r}, none of these{hint}"
        )
    try:
        base = transformers.AutoConfig.for_model(model_type, **values)
    except Exception as e:
        raise EstimateError(f"{where}: bad config: {_one_line(e)}") from e
    for key in overrides:
        if not hasattr(base, key):
            close = difflib.get_close_matches(key, list(base.to_dict()))
            hint = f"did you mean {close[0]!r}?" if close else "check the name"
            raise EstimateError(
                f"--set {key}: expected an attribute of the {model_type} config, got an "
                f"unknown name; {hint}"
            )
    # Overrides go through the constructor, so derived values (head_dim, ...) follow them.
    try:
        config = transformers.AutoConfig.for_model(model_type, **{**values, **overrides})
    except Exception as e:
        sets = " ".join(f"--set {k}={json.dumps(v)}" for k, v in overrides.items())
        raise EstimateError(f"{where} with {sets}: bad config: {_one_line(e)}") from e
    try:
        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:
        if "Unrecognized configuration class" in str(e):  # not a causal LM
            got = f"{type(config).__name__}, which has no causal LM class"
        else:
            got = _one_line(e)
        raise EstimateError(
            f"{where}: expected a config of a causal LM that builds on meta, got {got}"
        ) from e
    logger.debug("built %s from %s on meta", type(model).__name__, where)
    return model


def layout_of(model: nn.Module, dtype: torch.dtype) -> FlatLayout:
    """The flat layout the trainer would use for ``model`` cast to ``dtype`` (allocates nothing
    for a model on meta)."""
    return FlatParamModule(model, dtype=dtype).layout


# -- the estimate -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModeEstimate:
    """One mode (replicated, sharded or fully sharded) at the requested world size."""

    shard: bool | str  # the trainer's shard=: False, True or "full"
    worst: RankMemory  # the rank that holds the most (ranks differ only slightly)
    spread: int  # bytes between the worst and the best rank's totals
    min_world_size: int | None  # smallest world size that fits the budget; None: none does

    @property
    def name(self) -> str:
        return MODES[self.shard]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.worst.rank,
            **self.worst.as_dict(),
            "total": self.worst.total,
            "spread": self.spread,
            "min_world_size": self.min_world_size,
        }


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-rank training memory of one model at one world size, in each requested mode."""

    model: str  # what the user named
    model_class: str
    tensors: int  # unique parameters
    parameters: int  # their elements
    numel: int  # the flat buffer (with alignment padding)
    dtype: torch.dtype
    optimizer: str
    world_size: int
    modes: tuple[ModeEstimate, ...]
    device_memory: int | None
    reserve: float  # fraction of device_memory kept for what is not counted
    units: tuple[Unit, ...] = ()  # the fully sharded mode's units (empty without it)
    prefetch: int = 1
    reshard_after_forward: bool = True

    @property
    def budget(self) -> int | None:
        """Bytes per device for what is counted: ``device_memory * (1 - reserve)``."""
        if self.device_memory is None:
            return None
        return int(self.device_memory * (1.0 - self.reserve))

    def to_dict(self) -> dict[str, Any]:
        modes = {m.name: m.to_dict() for m in self.modes}
        if "full" in modes:
            gathered = [u.numel for u in self.units if not u.kept]
            modes["full"].update(
                units=len(self.units),
                kept_units=len(self.units) - len(gathered),
                largest_unit=max(gathered, default=0),
                prefetch=self.prefetch,
                reshard_after_forward=self.reshard_after_forward,
            )
        return {
            "model": self.model,
            "model_class": self.model_class,
            "tensors": self.tensors,
            "parameters": self.parameters,
            "numel": self.numel,
            "dtype": dtype_name(self.dtype),
            "master_dtype": dtype_name(_MASTER_DTYPE),
            "optimizer": self.optimizer,
            "world_size": self.world_size,
            "device_memory": self.device_memory,
            "reserve": self.reserve,
            "budget": self.budget,
            **modes,
            "not_counted": list(NOT_COUNTED),
        }


def _worst(plan: list[RankMemory]) -> RankMemory:
    return max(plan, key=lambda r: r.total)


def _min_world_size(
    layout: FlatLayout,
    *,
    shard: bool | str,
    optimizer: str,
    budget: int,
    max_world_size: int,
    units: Sequence[Unit] = (),
    prefetch: int = 1,
    reshard_after_forward: bool = True,
) -> int | None:
    """The smallest world size in [1, max_world_size] whose worst rank fits ``budget``.

    Not a binary search: the padding (of the full buffers every rank holds when sharded,
    of each unit when fully sharded) grows with the world size, so the total is not
    monotone. Each world size is first bracketed in O(units) (the average rank's state
    below, a full slice or stripes of state plus a scalar for every parameter above);
    only ambiguous ones are planned exactly.
    """

    def fits(n: int) -> bool:
        plan = plan_memory(
            layout,
            n,
            shard=shard,
            optimizer=optimizer,
            master_dtype=_MASTER_DTYPE,
            units=units,
            prefetch=prefetch,
            reshard_after_forward=reshard_after_forward,
        )
        return _worst(plan).total <= budget

    if shard is False:  # nothing depends on the world size
        return 1 if fits(1) else None
    per_element, scalars = OPTIMIZER_STATES[optimizer]
    dtype = layout.torch_dtype
    master = dtype != _MASTER_DTYPE
    state_item = _MASTER_DTYPE.itemsize if master else dtype.itemsize
    trainable = [s.numel for s in layout if s.requires_grad]
    state_total = per_element * state_item * sum(trainable)
    sizes = [(u.numel, u.kept) for u in units]
    if shard == "full":
        floor = transient_of_sizes(sizes, dtype.itemsize, prefetch, reshard_after_forward)
        if floor > budget:  # the unpadded unit buffers alone: no world size can fit
            return None
    for n in range(1, max_world_size + 1):
        if shard == "full":
            # each unit padded to n * align elements (unit_geometry's total), in O(units)
            step = n * layout.align
            padded = [(-(-m // step) * step, kept) for m, kept in sizes]
            size = sum(p for p, _ in padded) // n  # the rank's stripes
            fixed = 2 * size * state_item + transient_of_sizes(
                padded, dtype.itemsize, prefetch, reshard_after_forward
            )
        else:
            padded_all = padded_numel(layout, n, shard=True)
            size = padded_all // n
            fixed = 2 * padded_all * dtype.itemsize
            fixed += 2 * size * _MASTER_DTYPE.itemsize if master else 0
        if fixed + -(-state_total // n) > budget:
            continue
        if fixed + per_element * state_item * size + scalars * 4 * len(trainable) <= budget:
            return n
        if fits(n):
            return n
    return None


def estimate_memory(
    layout: FlatLayout,
    *,
    world_size: int,
    modes: tuple[bool | str, ...] = (False, True, "full"),
    optimizer: str = "adamw",
    device_memory: int | None = None,
    reserve: float = 0.0,
    model: str = "",
    model_class: str = "",
    max_world_size: int = MAX_WORLD_SIZE,
    units: Sequence[Unit] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
) -> MemoryEstimate:
    """Per-rank bytes for training ``layout`` at ``world_size`` in each of ``modes`` (the
    trainer's ``shard`` values: ``False`` replicated, ``True`` sharded, ``"full"`` fully
    sharded), with fp32 master weights when sharded in a lower precision; with
    ``device_memory``, the smallest world size at which each mode fits.

    ``units``, ``prefetch`` and ``reshard_after_forward`` are the fully sharded trainer's
    (``units=None``: those of ``units="auto"``, found from the slot names).

    Example::

        with torch.device("meta"):
            model = make_model()
        est = estimate_memory(layout_of(model, torch.bfloat16), world_size=8,
                              device_memory=80 * 2**30)
        full = est.modes[2]  # replicated, sharded, full
        full.worst.total, full.worst.transient, full.min_world_size
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise EstimateError(f"world size: expected a positive integer, got {world_size!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise EstimateError(
            f"optimizer: expected one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}"
        )
    if not modes or any(not _is_mode(m) for m in modes):
        raise EstimateError(
            f"modes: expected shard values among False, True and 'full', got {modes!r}"
        )
    if not 0.0 <= reserve < 1.0:
        raise EstimateError(f"reserve: expected a fraction in [0, 1), got {reserve!r}")
    if device_memory is not None and device_memory <= 0:
        raise EstimateError(f"device memory: expected a positive size, got {device_memory!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise EstimateError(f"prefetch: expected an integer >= 0, got {prefetch!r}")
    if reshard_after_forward not in (True, False):
        raise EstimateError(
            f"reshard_after_forward: expected True or False, got {reshard_after_forward!r}"
        )
    full = "full" in modes
    chosen = tuple(layout_units(layout) if units is None else units) if full else ()
    budget = None if device_memory is None else int(device_memory * (1.0 - reserve))
    how = {"units": chosen, "prefetch": prefetch, "reshard_after_forward": reshard_after_forward}
    out = []
    for shard in dict.fromkeys(modes):
        plan = plan_memory(
            layout, world_size, shard=shard, optimizer=optimizer, master_dtype=_MASTER_DTYPE, **how
        )
        worst = _worst(plan)
        least = min(r.total for r in plan)
        fit = None
        if budget is not None:
            fit = _min_world_size(
                layout,
                shard=shard,
                optimizer=optimizer,
                budget=budget,
                max_world_size=max_world_size,
                **how,
            )
        out.append(
            ModeEstimate(shard=shard, worst=worst, spread=worst.total - least, min_world_size=fit)
        )
    return MemoryEstimate(
        model=model,
        model_class=model_class,
        tensors=len(layout),
        parameters=layout.param_numel,
        numel=layout.numel,
        dtype=layout.torch_dtype,
        optimizer=optimizer,
        world_size=world_size,
        modes=tuple(out),
        device_memory=device_memory,
        reserve=reserve,
        units=chosen,
        prefetch=prefetch,
        reshard_after_forward=reshard_after_forward,
    )


def _is_mode(m: object) -> bool:
    try:
        check_shard(m)
    except TorchShardError:
        return False
    return True


_OPTIMIZER_NAMES = {
    "adamw": "AdamW",
    "adam": "Adam",
    "sgd": "SGD with momentum",
    "sgd-nomomentum": "SGD without momentum",
}


def _precision(r: MemoryEstimate, short: str) -> str:
    """Where each mode keeps what the optimizer updates, when the model is not fp32."""
    if r.dtype == torch.float32:
        return ""
    state = OPTIMIZER_STATES[r.optimizer][0] > 0
    replicated = any(m.shard is False for m in r.modes)
    parts = [f"replicated: state in {short}"] if state and replicated else []
    sharded = [m.name for m in r.modes if m.shard is not False]
    if sharded:
        parts.append(f"{' and '.join(sharded)}: fp32 master{' and state' if state else ''}")
    return f" ({'; '.join(parts)})" if parts else ""


def _unit_lines(r: MemoryEstimate, short: str) -> list[str]:
    """What the fully sharded mode gathers, and what its ``transient`` row counts."""
    gathered = [u for u in r.units if not u.kept]
    kept = [u for u in r.units if u.kept]
    parts = []
    if gathered:
        span = gathered[0].name
        if len(gathered) > 1:
            span += f" .. {gathered[-1].name}"
        largest = max(u.numel for u in gathered)
        parts.append(f"{len(gathered)} gathered in turn ({span}, up to {largest:,} elements)")
    if kept:
        numel = sum(u.numel for u in kept)
        parts.append(f"{len(kept)} kept for the step ({numel:,} elements)")
    if r.reshard_after_forward:
        what = f"the running unit, {r.prefetch} prefetched, 2 unit gradients"
    else:
        what = "every unit from its forward to its backward, 2 unit gradients"
    return [
        f"units        full: {', '.join(parts)}",
        f"transient    full: {what}, the kept units and their gradients ({short})",
    ]


def format_estimate(r: MemoryEstimate) -> str:
    """The table ``torchshard estimate`` prints: per-rank bytes by mode, and what fits."""
    lines: list[str] = []
    short = {v: k for k, v in DTYPES.items()}[r.dtype]
    big = max(m.worst.total for m in r.modes) >= 2**30
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    full = any(m.shard == "full" for m in r.modes)
    lines.append(f"model        {r.model} ({r.model_class})")
    lines.append(
        f"parameters   {r.parameters:,} in {r.tensors} tensors; flat buffer {r.numel:,} "
        f"elements of {dtype_name(r.dtype)}"
    )
    lines.append(
        f"training     {_OPTIMIZER_NAMES[r.optimizer]} at world size {r.world_size}"
        f"{_precision(r, short)}"
    )
    if full:
        lines.extend(_unit_lines(r, short))
    lines.append("")
    rows = [
        (f"parameters ({short})", "parameters"),
        (f"gradients ({short})", "gradients"),
        ("optimizer state", "optimizer"),
        ("fp32 master + grad", "master"),
    ]
    if full:
        rows.append((f"transient ({short})", "transient"))
    lines.append(f"{'per rank, ' + unit:<18}" + "".join(f"{m.name:>12}" for m in r.modes))
    for label, key in rows:
        values = [m.worst.as_dict()[key] / scale for m in r.modes]
        lines.append(f"{label:<18}" + "".join(f"{v:>12,.2f}" for v in values))
    lines.append(f"{'total':<18}" + "".join(f"{m.worst.total / scale:>12,.2f}" for m in r.modes))
    lines.append("")
    for m in r.modes:
        if m.shard is False or r.world_size == 1:
            continue
        if m.spread:
            lines.append(
                f"{m.name}: the worst rank (rank {m.worst.rank}); the others hold at most "
                f"{m.spread:,} bytes less"
            )
        else:
            lines.append(f"{m.name}: every rank holds the same")
    if r.budget is not None and r.device_memory is not None:
        size = f"{r.device_memory / scale:,.2f} {unit} ({r.device_memory:,} bytes)"
        if r.reserve:
            size += f", {r.reserve:.0%} reserved: {r.budget / scale:,.2f} {unit} for the above"
        lines.append(f"device       {size}")
        lines.extend(f"  {m.name + ':':<11} {_fit(r, m, r.budget)}" for m in r.modes)
    lines.append(f"not counted: {', '.join(NOT_COUNTED)}; leave headroom for them (--reserve)")
    return "\n".join(lines)


def _fit(r: MemoryEstimate, m: ModeEstimate, budget: int) -> str:
    """Whether mode ``m`` fits ``budget`` now, and at which world size it first does."""
    now = f"{'fits' if m.worst.total <= budget else 'does not fit'} at world size {r.world_size}"
    if m.shard is False:
        if m.min_world_size is not None:
            return f"{now}; fits at any world size (nothing is divided among ranks)"
        return f"{now}; no world size fits (nothing is divided among ranks)"
    if m.min_world_size is not None:
        return f"{now}; the smallest world size that fits is {m.min_world_size}"
    if m.shard is True:
        floor = 2 * r.numel * r.dtype.itemsize  # full parameters and gradients, on every rank
        if floor > budget:
            return (
                f"{now}; no world size fits: the full parameters and gradients, which every "
                f"rank holds, take {floor / 2**30:,.2f} GiB"
            )
    else:
        sizes = [(u.numel, u.kept) for u in r.units]  # unpadded: a floor at any world size
        floor = transient_of_sizes(sizes, r.dtype.itemsize, r.prefetch, r.reshard_after_forward)
        if floor > budget:
            alone = f"the unit buffers alone take {floor / 2**30:,.2f} GiB"
            return f"{now}; no world size fits: {alone}"
    return f"{now}; no world size up to {MAX_WORLD_SIZE:,} fits"
