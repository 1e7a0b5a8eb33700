"""Per-rank training memory of a model, before any GPU is involved (``torchshard estimate``).

The model's flat layout goes through :func:`plan_memory`, the rules the trainer allocates
by, in each mode of the registry (``_parallel/modes.py``); the fully sharded mode's unit
buffers are counted at their peak as ``transient``. With a device's memory, the smallest
world size that fits comes from :func:`bounds` and exact plans, the same memory model, and
so does the smallest ``dp_shard`` (a divisor of the world size) at which hybrid sharding fits.
With ``dp_replicate`` the sharded modes are planned at the shard size, and each mode's
per-step communication (:func:`plan_comm`) is split into the shard group's and the replicas'.
With ``tp`` each rank plans the local layout of the split model (:func:`tp_layout`) over
``world_size // tp`` data-parallel ranks.
Activations, temporary buffers, the CUDA context and allocator fragmentation are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._flat.layout import FlatLayout, dtype_name
from .._parallel.footprint import PlanError
from .._parallel.memory import OPTIMIZER_STATES, RankMemory, bounds, floor, plan_memory
from .._parallel.modes import ALIASES, ModeEntry, entry_for, is_alias, listing
from .._parallel.tpcost import TPTraffic, tp_layout, tp_traffic
from .._parallel.traffic import CommPlan, plan_comm
from .._parallel.units import Unit, layout_units
from .model import EstimateError
from .trainable import EVERY_PARAMETER, Trainable

__all__ = [
    "DTYPES",
    "MAX_WORLD_SIZE",
    "NOT_COUNTED",
    "OPTIMIZERS",
    "MemoryEstimate",
    "ModeEstimate",
    "estimate_memory",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_WORLD_SIZE = 65536
OPTIMIZERS = tuple(OPTIMIZER_STATES)
NOT_COUNTED = (
    "activations",
    "temporary buffers",
    "the CUDA context",
    "allocator fragmentation",
)
MASTER_DTYPE = torch.float32  # the trainer's default master_dtype


@dataclass(frozen=True, kw_only=True)
class ModeEstimate:
    """One mode at the requested world size.

    Example::

        m = estimate_memory(layout, world_size=8).modes[0]
        m.name, m.worst.total, m.spread, m.min_world_size
    """

    shard: bool | str  # the trainer's shard= alias of the mode (what trainer.shard reports)
    worst: RankMemory  # the rank that holds the most (ranks differ only slightly)
    spread: int  # bytes between the worst and the best rank's totals
    min_world_size: int | None  # smallest world size that fits the budget; None: none does
    floor: int = 0  # below the worst rank's total at every world size
    # hybrid sharding at the world size: the smallest dp_shard (a divisor of it) whose worst
    # rank fits the budget, and that rank's total; None: none does, or not divided, or no budget
    min_shard_size: int | None = None
    min_shard_total: int | None = None
    comm: CommPlan | None = None  # bytes per rank and step, in the shard group and across

    @property
    def entry(self) -> ModeEntry:
        """The mode's line in the registry."""
        return entry_for(self.shard)

    @property
    def name(self) -> str:
        return self.entry.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.worst.rank,
            **self.worst.as_dict(),
            "total": self.worst.total,
            "spread": self.spread,
            "min_world_size": self.min_world_size,
            "min_shard_size": self.min_shard_size,
            "min_shard_total": self.min_shard_total,
            **({"comm": self.comm.to_dict()} if self.comm is not None else {}),
        }


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-rank training memory of one model at one world size, in each requested mode.

    Example::

        est = estimate_memory(layout, world_size=8, device_memory=80 * 2**30)
        json.dumps(est.to_dict())
    """

    model: str  # what the user named
    model_class: str
    tensors: int  # unique parameters
    parameters: int  # their elements
    numel: int  # a rank's flat buffer (with alignment padding): bytes, with several dtypes
    trainable_tensors: int  # the parameters that train (requires_grad)
    trainable_parameters: int  # their elements: what has gradients and optimizer state
    dtype: torch.dtype  # the parameters'; with several, the one most of them have
    optimizer: str
    world_size: int
    modes: tuple[ModeEstimate, ...]
    device_memory: int | None
    reserve: float  # fraction of device_memory kept for what is not counted
    units: tuple[Unit, ...] = ()  # the units of the mode that gathers them (empty without)
    prefetch: int = 1
    reshard_after_forward: bool = True
    trainable: Trainable = EVERY_PARAMETER  # how the model was told what trains
    # (dtype, parameter bytes, trainable bytes) for each of the parameters' dtypes, in layout
    # order; empty: every parameter is of ``dtype``
    dtype_bytes: tuple[tuple[torch.dtype, int, int], ...] = ()
    dp_replicate: int = 1  # hybrid sharding: replicas of each shard group
    gpus_per_node: int | None = None  # ranks per node: which groups cross nodes
    tp: int = 1  # tensor-parallel ranks: world_size // tp data-parallel ranks
    tp_activations: TPTraffic = field(
        default_factory=TPTraffic
    )  # the split layers' activation bytes per token
    whole_numel: int = 0  # the whole model's flat buffer (numel: a tp rank's)

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: ``world_size // tp``."""
        return self.world_size // self.tp

    @property
    def dp_shard(self) -> int:
        """The ranks a sharded mode cuts its state over: ``dp_size // dp_replicate``."""
        return self.dp_size // self.dp_replicate

    @property
    def dp_per_node(self) -> int | None:
        """Data-parallel ranks a node holds (``gpus_per_node // tp``; None without it)."""
        return None if self.gpus_per_node is None else self.gpus_per_node // self.tp

    @property
    def trainable_bytes(self) -> int:
        """The trainable parameters' bytes, each in its dtype (one gradient's worth)."""
        if self.dtype_bytes:
            return sum(t for *_, t in self.dtype_bytes)
        return self.trainable_parameters * self.dtype.itemsize

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The parameters' dtypes, in layout order (several: a mixed layout, in bytes)."""
        return tuple(d for d, *_ in self.dtype_bytes) or (self.dtype,)

    @property
    def parameter_bytes(self) -> dict[str, int]:
        """The parameters' bytes by dtype name (alignment padding not counted).

        Example::

            est.parameter_bytes   # {"bfloat16": 13476831232, "float32": 2162688}
        """
        if self.dtype_bytes:
            return {dtype_name(d): b for d, b, _ in self.dtype_bytes}
        return {dtype_name(self.dtype): self.parameters * self.dtype.itemsize}

    @property
    def budget(self) -> int | None:
        """Bytes per device for what is counted: ``device_memory * (1 - reserve)``."""
        if self.device_memory is None:
            return None
        return int(self.device_memory * (1.0 - self.reserve))

    def to_dict(self) -> dict[str, Any]:
        modes = {m.name: m.to_dict() for m in self.modes}
        for m in self.modes:
            if m.entry.gathers:
                gathered = [u.numel for u in self.units if not u.kept]
                modes[m.name].update(
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
            "trainable_tensors": self.trainable_tensors,
            "trainable_parameters": self.trainable_parameters,
            "trainable_bytes": self.trainable_bytes,
            **self.trainable.to_dict(),
            "dtype": dtype_name(self.dtype),
            "parameter_bytes": self.parameter_bytes,
            "master_dtype": dtype_name(MASTER_DTYPE),
            "optimizer": self.optimizer,
            "world_size": self.world_size,
            "tp": self.tp,
            "dp_size": self.dp_size,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "whole_numel": self.whole_numel,
            "tp_forward_per_token": self.tp_activations.forward,
            "tp_backward_per_token": self.tp_activations.backward,
            "gpus_per_node": self.gpus_per_node,
            "device_memory": self.device_memory,
            "reserve": self.reserve,
            "budget": self.budget,
            **modes,
            "not_counted": list(NOT_COUNTED),
        }


def _worst(plan: list[RankMemory]) -> RankMemory:
    return max(plan, key=lambda r: r.total)


def _min_world_size(
    layout: FlatLayout, lowest: int, budget: int, max_world_size: int, how: dict[str, Any]
) -> int | None:
    """The smallest world size in [1, max_world_size] whose worst rank fits ``budget``.

    Not a binary search: the padding (of the full buffers every rank holds when sharded,
    of each unit when fully sharded) grows with the world size, so the total is not
    monotone. Each world size is first bracketed by :func:`bounds` in O(units); only
    ambiguous ones are planned exactly. ``lowest`` is below every world size's total.
    """
    if lowest > budget:
        return None
    for n in range(1, max_world_size + 1):
        low, high = bounds(layout, n, **how)
        if low > budget:
            continue
        if high <= budget or _worst(plan_memory(layout, n, **how)).total <= budget:
            return n
    return None


def _min_shard_size(
    layout: FlatLayout, world_size: int, budget: int, how: dict[str, Any]
) -> tuple[int, int] | None:
    """The smallest ``dp_shard`` dividing ``world_size`` whose worst rank fits ``budget`` under
    hybrid sharding (``dp_replicate = world_size // dp_shard``), and that rank's total; each
    divisor bracketed by :func:`bounds` first, as :func:`_min_world_size` does."""
    for n in (d for d in range(1, world_size + 1) if world_size % d == 0):
        kw = {**how, "dp_replicate": world_size // n}
        if bounds(layout, world_size, **kw)[0] > budget:
            continue
        worst = _worst(plan_memory(layout, world_size, **kw)).total
        if worst <= budget:
            return n, worst
    return None


def estimate_memory(
    layout: FlatLayout,
    *,
    world_size: int,
    modes: tuple[bool | str, ...] = ALIASES,
    optimizer: str = "adamw",
    device_memory: int | None = None,
    reserve: float = 0.0,
    model: str = "",
    model_class: str = "",
    max_world_size: int = MAX_WORLD_SIZE,
    units: Sequence[Unit] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    trainable: Trainable = EVERY_PARAMETER,
    dp_replicate: int = 1,
    gpus_per_node: int | None = None,
    tp: int = 1,
    tp_plan: Mapping[str, str] | None = None,
) -> MemoryEstimate:
    """Per-rank bytes for training ``layout`` at ``world_size`` in each of ``modes`` (the
    trainer's ``shard`` aliases, by default every mode of the registry), with fp32 master
    weights when sharded in a lower precision; with ``device_memory``, the smallest world
    size at which each mode fits.

    ``units``, ``prefetch`` and ``reshard_after_forward`` are the fully sharded trainer's
    (``units=None``: those of ``units="auto"``, found from the slot names). What trains is
    the layout's ``requires_grad``; ``trainable`` only says how it was chosen (for the report).

    ``dp_replicate``: hybrid sharding, ``init_mesh(dp_replicate=R)`` over ``world_size``
    data-parallel ranks: the sharded modes planned at ``dp_shard = world_size // R`` (the
    replicated mode is DDP over every rank). ``gpus_per_node``: ranks per node, for which
    groups cross nodes. With ``device_memory``, each sharded mode also names the smallest
    ``dp_shard`` that fits at ``world_size``.

    ``tp``, ``tp_plan``: tensor parallelism, ``init_mesh(tp=T)``: ``layout`` is the whole
    model's, each rank holds the local layout ``tp_plan`` (module names or globs to styles)
    gives at ``tp`` ranks, and ``world_size`` counts every rank: ``world_size // tp`` of them
    data-parallel (``dp_replicate`` divides that). A tp group must fit in a node: ``tp``
    divides ``gpus_per_node``. ``units`` are the local layout's.

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
    if not modes or not all(map(is_alias, modes)):
        raise EstimateError(
            f"modes: expected shard values among {listing(ALIASES, 'and')}, got {modes!r}"
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
    g = gpus_per_node
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
        raise EstimateError(f"gpus per node: expected a positive integer, got {g!r}")
    whole, layout, dp = layout, _local(layout, world_size, tp, tp_plan, g), world_size // tp
    r = dp_replicate
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or dp % r:
        size = "world size" if tp == 1 else f"data-parallel size {world_size} / tp {tp} ="
        raise EstimateError(
            f"dp_replicate: expected a positive divisor of the {size} {dp}, got {r!r}"
        )
    gathers = any(entry_for(m).gathers for m in modes)
    chosen = tuple(layout_units(layout) if units is None else units) if gathers else ()
    budget = None if device_memory is None else int(device_memory * (1.0 - reserve))
    out = []
    for shard in dict.fromkeys(modes):
        how = {
            "shard": shard,
            "optimizer": optimizer,
            "master_dtype": MASTER_DTYPE,
            "units": chosen,
            "prefetch": prefetch,
            "reshard_after_forward": reshard_after_forward,
        }
        plan = plan_memory(layout, dp, dp_replicate=dp_replicate, **how)
        worst, least = _worst(plan), min(r.total for r in plan)
        low = floor(layout, **how)
        fit = None
        if budget is not None:
            fit = _min_world_size(layout, low, budget, max_world_size // tp, how)
        hybrid = None
        if budget is not None and entry_for(shard).memory.divided and low <= budget:
            hybrid = _min_shard_size(layout, dp, budget, how)
        comm = plan_comm(
            whole,
            dp,
            shard=shard,
            dp_replicate=dp_replicate,
            units=chosen if entry_for(shard).gathers else None,
            reshard_after_forward=reshard_after_forward,
            gpus_per_node=gpus_per_node,
            tp=tp,
            tp_plan=tp_plan,
        )
        out.append(
            ModeEstimate(
                shard=shard,
                worst=worst,
                spread=worst.total - least,
                min_world_size=None if fit is None else fit * tp,
                floor=low,
                min_shard_size=None if hybrid is None else hybrid[0],
                min_shard_total=None if hybrid is None else hybrid[1],
                comm=comm,
            )
        )
    return MemoryEstimate(
        model=model,
        model_class=model_class,
        tensors=len(whole),
        parameters=whole.param_numel,
        numel=layout.numel,
        trainable_tensors=len(whole.trainable),
        trainable_parameters=sum(whole.slots[i].numel for i in whole.trainable),
        dtype=max(whole.dtypes, key=lambda d: sum(s.numel for s in whole if s.torch_dtype == d)),
        optimizer=optimizer,
        world_size=world_size,
        modes=tuple(out),
        device_memory=device_memory,
        reserve=reserve,
        units=chosen,
        prefetch=prefetch,
        reshard_after_forward=reshard_after_forward,
        trainable=trainable,
        dtype_bytes=_dtype_bytes(whole),
        dp_replicate=dp_replicate,
        gpus_per_node=gpus_per_node,
        tp=tp,
        tp_activations=tp_traffic(whole, tp, tp_plan),
        whole_numel=whole.numel,
    )


def _local(
    layout: FlatLayout,
    world_size: int,
    tp: int,
    tp_plan: Mapping[str, str] | None,
    gpus_per_node: int | None,
) -> FlatLayout:
    """The layout a tp rank holds, ``tp`` checked to divide the world size and the node."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise EstimateError(
            f"tp: expected a positive divisor of the world size {world_size} (world size = "
            f"data-parallel x tensor-parallel ranks), got {tp!r}"
        )
    if gpus_per_node is not None and gpus_per_node % tp:
        raise EstimateError(
            f"tp: expected a divisor of gpus per node {gpus_per_node} (a tensor-parallel group "
            f"stays inside a node), got {tp}"
        )
    try:
        return tp_layout(layout, tp, tp_plan)
    except PlanError as e:
        raise EstimateError(str(e)) from None


def _dtype_bytes(layout: FlatLayout) -> tuple[tuple[torch.dtype, int, int], ...]:
    """(dtype, parameter bytes, trainable bytes) per dtype of ``layout``, in layout order."""
    out = []
    for d in layout.dtypes:
        slots = [s for s in layout if s.torch_dtype == d]
        total = sum(s.numel for s in slots) * d.itemsize
        out.append((d, total, sum(s.numel for s in slots if s.requires_grad) * d.itemsize))
    return tuple(out)
