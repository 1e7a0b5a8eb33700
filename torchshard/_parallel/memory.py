"""Per-rank memory of a training run, computed from the layout alone (no process group).

The faces :func:`plan_memory` and :func:`bounds` read the mode registry (``modes.py``);
each mode's arithmetic is its memory model in ``footprint.py``. Hybrid sharding
(``dp_replicate=R``) plans the sharded modes at the shard size ``world_size // R``
(:func:`shard_size`), with the fully sharded mode's all-reduce stripe in flight on top
(:func:`replica_stripe_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from .._flat.geometry import Geometry
from .._flat.layout import FlatLayout
from .footprint import (
    OPTIMIZER_STATES,
    PlanError,
    RankMemory,
    Request,
    master_dtype_for,
    transient_bytes,
    transient_of_sizes,
)
from .modes import Choice, ModeEntry, ModeError, choose, entry_for
from .tpcost import tp_layout
from .units import Unit, layout_units, unit_geometry

__all__ = [
    "OPTIMIZER_STATES",
    "PlanError",
    "RankMemory",
    "asked",
    "bounds",
    "floor",
    "padded_numel",
    "plan_memory",
    "replica_stripe_bytes",
    "shard_size",
    "transient_bytes",
    "transient_of_sizes",
]


def padded_numel(layout: FlatLayout, world_size: int, shard: bool) -> int:
    """The flat buffers' length: in sharded mode a multiple of ``world_size`` alignment units."""
    return Geometry.of(layout, world_size, pad=shard).total


def plan_memory(
    layout: FlatLayout,
    world_size: int,
    *,
    shard: bool | str | Choice,
    dp_replicate: int = 1,
    optimizer: str = "adamw",
    master_dtype: torch.dtype = torch.float32,
    units: Sequence[Unit] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    tp: int = 1,
    tp_plan: Mapping[str, str] | None = None,
) -> list[RankMemory]:
    """What each rank will hold, by the trainer's own slicing rules.

    Args:
        layout: the flat layout (of a model built on meta: nothing is allocated).
        world_size: the number of ranks (the data-parallel size: ``mesh.dp_size``).
        shard: as ``DistributedTrainer(shard=...)``: a mode choice (:class:`Replicate`,
            :class:`ShardOptimizer`, :class:`FullShard`) or its alias (``False``,
            ``True``, the fully sharded one).
        dp_replicate: hybrid sharding, as ``init_mesh(dp_replicate=R)``: the sharded modes
            cut their state over shard groups of ``S = world_size // R`` ranks (``R`` must
            divide ``world_size``); see below. ``1``: today's plan, exactly.
        optimizer: a key of :data:`OPTIMIZER_STATES`.
        master_dtype: the trainer's ``master_dtype`` (with an alias; a choice holds its own).
        units: fully sharded: the units the trainer resolved; ``None``: those of
            ``units="auto"`` found from the slot names (:func:`layout_units`).
        prefetch, reshard_after_forward: fully sharded, with an alias: as the trainer's;
            they set ``transient`` (:func:`transient_bytes`).
        tp, tp_plan: tensor parallelism, as ``init_mesh(tp=T)`` and
            ``FlatParamModule(model, tp_plan=..., mesh=mesh)``: ``layout`` is the whole
            model's, and each rank plans the local layout ``tp_plan`` (globs to styles)
            gives at ``T`` ranks (:func:`tp_layout`): a split parameter costs ``1/T`` of its
            bytes, a replicated one all of them. Or pass ``fm.layout`` of a split module
            with ``tp=1``: it is already local. ``world_size`` stays the data-parallel size.

    Replicated and sharded: parameters are one padded flat buffer; gradients one for the
    trainable parameters alone (``layout.grad_layout``; the sharded ones padded to
    ``world_size`` equal slices of it). Optimizer: the elementwise state for every
    trainable element the rank updates (all of them when replicated, its slice's when
    sharded), in the dtype of what it updates, plus a 4-byte scalar (Adam's ``step``) per
    parameter or piece. Master (sharded, when the buffer's dtype is not
    ``master_dtype``): the fp32 slice and its gradient; with frozen parameters, also a
    copy of the trainable weights laid out like their gradient (what is all-gathered).

    Fully sharded: the rank's stripe of every unit (``S = sum_u P_u / world_size``
    elements) and its gradient, in ``master_dtype`` when the model's dtype differs
    (reported as ``master``: ``2 * S`` elements; ``parameters = gradients = 0``), else
    in the model's dtype (``parameters = gradients = S`` elements); with frozen
    parameters the gradient covers the stripes' trainable elements only; the optimizer's
    state for the trainable elements of the stripes, one piece per parameter and
    stripe; ``transient`` the unit buffers. With AdamW, bf16 and an fp32 master that
    is ``16 * S`` bytes, about 16 bytes per parameter over the world size.

    Parameters of several dtypes (``layout.mixed``: the buffers are bytes) count by
    dtype region (:attr:`FlatLayout.regions`): parameter and gradient bytes as they lie in
    the buffers; replicated, the state of each element in its own dtype; sharded and
    fully sharded, the state in ``master_dtype`` and a master copy (and its gradient) of the
    elements not already in it only (fp32 norms in a bf16 model need none); padding counts
    in the dtype of the region it follows.

    Hybrid sharding (``dp_replicate=R > 1``): one entry per data-parallel rank ``q``, each
    rank holding what shard rank ``q % S`` holds in a plain run at world size ``S``: its
    persistent bytes are exactly that plan's (replicas hold the same cut). Fully sharded,
    ``transient`` gains one all-reduce stripe in flight across the replicas,
    :func:`replica_stripe_bytes`: ``b * max_u P_u / S`` (``P_u`` a unit with trainable
    parameters, kept ones included, padded to ``S`` times the alignment; ``b`` the model's
    item size, as for the rest of ``transient``), an upper bound: the reduced stripe of one
    unit is held while its all-reduce runs, one unit behind the reduce-scatters. The
    replicated mode is DDP over all ``world_size`` ranks whatever the mesh: its plan does
    not change with ``dp_replicate``.

    Example::

        with torch.device("meta"):
            fm = FlatParamModule(model, dtype=torch.bfloat16)
        plan = plan_memory(fm.layout, 64, shard=torchshard.FullShard())
        worst = max(plan, key=lambda r: r.total)
        hybrid = plan_memory(fm.layout, 512, shard="full", dp_replicate=16)  # 16 x 32
        split = plan_memory(whole, 8, shard=True, tp=8, tp_plan=plan)  # 8 dp x 8 tp ranks
    """
    layout = tp_layout(layout, tp, tp_plan)
    how = (master_dtype, units, prefetch, reshard_after_forward)
    entry, req = asked(layout, world_size, shard, optimizer, *how)
    cut = shard_size(world_size, dp_replicate, shard)
    plan = entry.memory.plan(layout, cut, req)
    if cut == world_size:
        return plan
    extra = replica_stripe_bytes(layout, req.units, cut) if entry.gathers else 0
    return [
        replace(plan[q % cut], rank=q, transient=plan[q % cut].transient + extra)
        for q in range(world_size)
    ]


def bounds(
    layout: FlatLayout,
    world_size: int,
    *,
    shard: bool | str | Choice,
    dp_replicate: int = 1,
    optimizer: str = "adamw",
    master_dtype: torch.dtype = torch.float32,
    units: Sequence[Unit] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
) -> tuple[int, int]:
    """``(low, high)`` around the worst rank's total of :func:`plan_memory` (same
    arguments), in O(units) instead of O(ranks x parameters).

    Both hold everything but the optimizer state exactly (with parameters of several
    dtypes, also but the masters and the stripes, whose dtypes differ by rank); ``low`` adds
    the average rank's, ``high`` a whole slice's (or stripes') at the costliest dtype and a
    scalar for every parameter. The estimator brackets each world size with them and plans
    exactly only where the budget falls between.

    With ``dp_replicate``, the bounds of the plan at the shard size, the all-reduce stripe
    (fully sharded) added to both, as :func:`plan_memory` adds it.

    Example::

        low, high = bounds(layout, 8, shard=torchshard.ShardOptimizer())
        if high <= budget:
            ...   # fits at 8 ranks without planning every rank
    """
    how = (master_dtype, units, prefetch, reshard_after_forward)
    entry, req = asked(layout, world_size, shard, optimizer, *how)
    cut = shard_size(world_size, dp_replicate, shard)
    low, high = entry.memory.bounds(layout, cut, req)
    if cut == world_size or not entry.gathers:
        return low, high
    extra = replica_stripe_bytes(layout, req.units, cut)
    return low + extra, high + extra


def floor(
    layout: FlatLayout,
    *,
    shard: bool | str | Choice,
    optimizer: str = "adamw",
    master_dtype: torch.dtype = torch.float32,
    units: Sequence[Unit] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
) -> int:
    """Bytes below the worst rank's total of :func:`plan_memory` at every world size (same
    arguments but the world size): no world size fits a budget below it.

    Example::

        if floor(layout, shard=torchshard.FullShard()) > 80 * 2**30:
            print("the unit buffers alone do not fit")
    """
    how = (master_dtype, units, prefetch, reshard_after_forward)
    entry, req = asked(layout, 1, shard, optimizer, *how)
    return entry.memory.floor(layout, req)  # hybrid sharding only adds (a stripe in flight)


def shard_size(world_size: int, dp_replicate: int, shard: object) -> int:
    """The ranks a mode cuts its state over at ``world_size`` data-parallel ranks with
    ``dp_replicate`` replicas: ``world_size // dp_replicate`` for a sharded mode, the whole
    ``world_size`` for the replicated one (DDP over the data-parallel group, whatever the
    mesh). Raises :class:`PlanError` unless ``dp_replicate`` is a positive divisor of
    ``world_size``.

    Example::

        shard_size(512, 16, True), shard_size(512, 16, False)   # (32, 512)
    """
    r = dp_replicate
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or world_size % r:
        raise PlanError(
            f"dp_replicate: expected a positive divisor of world_size {world_size} (the "
            f"replicas of init_mesh(dp_replicate=...)), got {r!r}"
        )
    try:
        divided = entry_for(shard).memory.divided
    except ModeError as e:
        raise PlanError(str(e)) from e
    return world_size // r if divided else world_size


def replica_stripe_bytes(layout: FlatLayout, units: Sequence[Unit], shards: int) -> int:
    """Fully sharded hybrid sharding: the most one reduced stripe held for its all-reduce
    across the replicas takes, ``b * max_u P_u / S``: the largest unit with trainable
    parameters (kept ones included), padded to ``S = shards`` stripes of a multiple of
    the alignment, one stripe of it, in the model's item size ``b`` (a mixed layout's
    positions are bytes).

    Example::

        replica_stripe_bytes(layout, layout_units(layout), 32)
    """
    trains = [u for u in units if any(s.requires_grad for s in layout.slots[u.lo : u.hi])]
    stripes = (unit_geometry(u, shards, layout.align).per_rank for u in trains)
    return max(stripes, default=0) * layout.torch_dtype.itemsize


def asked(
    layout: FlatLayout,
    world_size: int,
    shard: object,
    optimizer: str,
    master_dtype: torch.dtype,
    units: Sequence[Unit] | None,
    prefetch: int,
    reshard_after_forward: bool,
) -> tuple[ModeEntry, Request]:
    """The arguments of :func:`plan_memory` checked, as a mode and its memory request."""
    try:
        entry = entry_for(shard)
    except ModeError as e:
        raise PlanError(str(e)) from e
    if optimizer not in OPTIMIZER_STATES:
        raise PlanError(f"optimizer: expected one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size: expected a positive integer, got {world_size!r}")
    loose = {"prefetch": prefetch, "reshard_after_forward": reshard_after_forward}
    try:
        choice = choose(shard, strict=False, master_dtype=master_dtype, **loose)
    except ModeError as e:
        raise PlanError(str(e)) from e
    if entry.master:  # what the trainer keeps: a float64 model keeps float64
        choice = replace(choice, master_dtype=master_dtype_for(layout, choice.master_dtype))
    if not entry.gathers:
        return entry, entry.request(choice, optimizer)
    if units is None and getattr(choice, "units", "auto") != "auto":
        raise PlanError(
            f"units: expected the units the trainer resolved for {choice!r} (trainer.units, "
            "or resolve_units(model, layout, spec)), got None; the planner sees no modules"
        )
    return entry, entry.request(choice, optimizer, layout_units(layout) if units is None else units)
