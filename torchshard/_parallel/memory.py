"""Per-rank memory of a training run, computed from the layout alone (no process group)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._errors import TorchShardError
from .._flat.geometry import Geometry
from .._flat.layout import FlatLayout
from .units import Unit, layout_units, unit_geometry

__all__ = [
    "OPTIMIZER_STATES",
    "PlanError",
    "RankMemory",
    "check_shard",
    "padded_numel",
    "plan_memory",
    "transient_bytes",
    "transient_of_sizes",
]

# Elementwise state tensors per parameter element, and scalar tensors per parameter.
OPTIMIZER_STATES = {
    "adamw": (2, 1),  # exp_avg, exp_avg_sq; step
    "adam": (2, 1),
    "sgd": (1, 0),  # momentum_buffer (with momentum > 0)
    "sgd-nomomentum": (0, 0),
}


class PlanError(TorchShardError, ValueError):
    """A bad argument to :func:`plan_memory`: mode, optimizer, world size, prefetch or units."""


def check_shard(shard: object) -> bool | str:
    """``shard`` as the trainer reads it: ``False``, ``True`` or ``"full"``; anything else raises."""
    if shard is True or shard is False or shard == "full":
        return shard  # type: ignore[return-value]
    raise PlanError(f"shard: expected True, False or 'full', got {shard!r}")


def padded_numel(layout: FlatLayout, world_size: int, shard: bool) -> int:
    """The flat buffers' length: in sharded mode a multiple of ``world_size`` alignment units."""
    return Geometry.of(layout, world_size, pad=shard).total


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds for training (what :meth:`DistributedTrainer.memory_bytes` reports).

    ``parameters``, ``gradients``, ``optimizer`` and ``master`` are held for the whole
    run; ``transient`` is the most the fully sharded mode's unit buffers take at once
    during a step (0 in the other modes). ``total`` counts both.

    Example::

        for m in torchshard.plan_memory(fm.layout, world_size=8, shard="full"):
            print(m.rank, m.persistent / 2**30, m.total / 2**30, "GiB")
    """

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    master: int
    transient: int = 0

    @property
    def persistent(self) -> int:
        """Bytes held between steps: everything but ``transient``."""
        return self.parameters + self.gradients + self.optimizer + self.master

    @property
    def total(self) -> int:
        return self.persistent + self.transient

    def as_dict(self) -> dict[str, int]:
        """The fields by name, as :meth:`DistributedTrainer.memory_bytes` returns them."""
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "master": self.master,
            "transient": self.transient,
        }


def transient_bytes(
    units: Sequence[Unit],
    world_size: int,
    align: int,
    itemsize: int,
    *,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
) -> int:
    """The most the fully sharded mode's unit buffers take at once on a rank.

    With ``P_u`` a unit padded to ``world_size * align`` elements, ``b`` the model's
    item size, ``max`` over the units that are not kept (0 if none) and ``kept``
    the sum over the kept ones (root units, units holding a tied weight):

    - ``reshard_after_forward=True``: ``b * ((3 + prefetch) * max + 2 * kept)``: the
      running unit's and ``prefetch`` gathered units' weights, two unit gradients
      (one filling, one reduce-scatter in flight), and the kept units' weights and
      gradients;
    - ``False``: ``b * (sum + 2 * max + kept)``: every unit stays gathered from its
      forward to its backward (``sum`` over all units), two unit gradients, and the
      kept units' gradients.

    Example::

        transient_bytes(layout_units(layout), 64, layout.align, 2)  # bf16, prefetch 1
    """
    sizes = [(unit_geometry(u, world_size, align).total, u.kept) for u in units]
    return transient_of_sizes(sizes, itemsize, prefetch, reshard_after_forward)


def transient_of_sizes(
    sizes: Sequence[tuple[int, bool]], itemsize: int, prefetch: int, reshard_after_forward: bool
) -> int:
    """:func:`transient_bytes` from ``(P_u, kept)`` pairs (also a floor at every world size
    when given the unpadded unit sizes: padding only adds).

    Example::

        transient_of_sizes([(u.numel, u.kept) for u in units], 2, 1, True)
    """
    largest = max((p for p, kept in sizes if not kept), default=0)
    kept = sum(p for p, k in sizes if k)
    if reshard_after_forward:
        return itemsize * ((3 + prefetch) * largest + 2 * kept)
    return itemsize * (sum(p for p, _ in sizes) + 2 * largest + kept)


def plan_memory(
    layout: FlatLayout,
    world_size: int,
    *,
    shard: bool | str,
    optimizer: str = "adamw",
    master_dtype: torch.dtype = torch.float32,
    units: Sequence[Unit] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
) -> list[RankMemory]:
    """What each rank will hold, by the trainer's own slicing rules.

    Args:
        layout: the flat layout (of a model built on meta: nothing is allocated).
        world_size: the number of ranks.
        shard: ``False`` (replicated), ``True`` (sharded optimizer) or ``"full"``
            (fully sharded), as ``DistributedTrainer(shard=...)``.
        optimizer: a key of :data:`OPTIMIZER_STATES`.
        master_dtype: the trainer's ``master_dtype``.
        units: ``shard="full"``: the units the trainer resolved; ``None``: those of
            ``units="auto"`` found from the slot names (:func:`layout_units`).
        prefetch, reshard_after_forward: ``shard="full"``: as the trainer's; they
            set ``transient`` (:func:`transient_bytes`).

    Replicated and sharded: parameters and gradients are one padded flat buffer each
    (the sharded buffer padded to ``world_size`` equal slices). Optimizer: the
    elementwise state for every trainable element the rank updates (all of them when
    replicated, its slice's when sharded), in the dtype of what it updates, plus a
    4-byte scalar (Adam's ``step``) per parameter or piece. Master (sharded, when the
    buffer's dtype is not ``master_dtype``): the fp32 slice and its gradient.

    Fully sharded: the rank's stripe of every unit (``S = sum_u P_u / world_size``
    elements) and its gradient, in ``master_dtype`` when the model's dtype differs
    (reported as ``master``: ``2 * S`` elements; ``parameters = gradients = 0``), else
    in the model's dtype (``parameters = gradients = S`` elements); the optimizer's
    state for the trainable elements of the stripes, one piece per parameter and
    stripe; ``transient`` the unit buffers. With AdamW, bf16 and an fp32 master that
    is ``16 * S`` bytes, about 16 bytes per parameter over the world size.

    Example::

        with torch.device("meta"):
            fm = FlatParamModule(model, dtype=torch.bfloat16)
        worst = max(plan_memory(fm.layout, 64, shard="full"), key=lambda r: r.total)
    """
    shard = check_shard(shard)
    if optimizer not in OPTIMIZER_STATES:
        raise PlanError(f"optimizer: expected one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size: expected a positive integer, got {world_size!r}")
    if shard == "full":
        return _plan_full(
            layout,
            world_size,
            optimizer,
            master_dtype,
            layout_units(layout) if units is None else units,
            prefetch,
            reshard_after_forward,
        )
    per_element, scalars = OPTIMIZER_STATES[optimizer]
    dtype = layout.torch_dtype
    geometry = Geometry.of(layout, world_size, pad=shard)
    flat_bytes = geometry.total * dtype.itemsize
    master = shard and dtype != master_dtype
    state_item = master_dtype.itemsize if master else dtype.itemsize
    trainable = [s for s in layout if s.requires_grad]
    out = []
    for rank, (a, b) in enumerate(geometry.ranges()):
        if shard:
            parts = [min(s.end, b) - max(s.offset, a) for s in trainable]
            parts = [p for p in parts if p > 0]
            slice_master = 2 * (b - a) * master_dtype.itemsize if master else 0
        else:
            parts = [s.numel for s in trainable]
            slice_master = 0
        opt = per_element * sum(parts) * state_item + scalars * 4 * len(parts)
        out.append(RankMemory(rank, flat_bytes, flat_bytes, opt, slice_master))
    return out


def _plan_full(
    layout: FlatLayout,
    world_size: int,
    optimizer: str,
    master_dtype: torch.dtype,
    units: Sequence[Unit],
    prefetch: int,
    reshard_after_forward: bool,
) -> list[RankMemory]:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise PlanError(f"prefetch: expected an int >= 0, got {prefetch!r}")
    if reshard_after_forward not in (True, False):
        raise PlanError(
            f"reshard_after_forward: expected True or False, got {reshard_after_forward!r}"
        )
    _check_units(layout, units)
    per_element, scalars = OPTIMIZER_STATES[optimizer]
    dtype = layout.torch_dtype
    shard_dtype = master_dtype if dtype != master_dtype else dtype
    geoms = [unit_geometry(u, world_size, layout.align) for u in units]
    stripe = sum(g.per_rank for g in geoms) * shard_dtype.itemsize
    own = shard_dtype == dtype
    transient = transient_of_sizes(
        [(g.total, u.kept) for u, g in zip(units, geoms)],
        dtype.itemsize,
        prefetch,
        reshard_after_forward,
    )
    slots = layout.slots
    out = []
    for rank in range(world_size):
        elements = pieces = 0
        for u, g in zip(units, geoms):
            a, b = g.range(rank)
            a, b = min(a, u.end), min(b, u.end)
            for s in slots[u.lo : u.hi]:
                n = min(s.end, b) - max(s.offset, a)
                if s.requires_grad and n > 0:
                    elements += n
                    pieces += 1
        opt = per_element * elements * shard_dtype.itemsize + scalars * 4 * pieces
        held = stripe if own else 0
        out.append(RankMemory(rank, held, held, opt, 0 if own else 2 * stripe, transient))
    return out


def _check_units(layout: FlatLayout, units: Sequence[Unit]) -> None:
    """Units must tile the layout: slots ``[0, len)`` and elements ``[0, numel)`` in order."""
    at_slot = at = 0
    for u in units:
        if (u.lo, u.start) != (at_slot, at) or u.hi < u.lo or u.end < u.start:
            raise PlanError(
                f"units: expected units that tile the layout in order, got {u.name!r} at slots "
                f"[{u.lo}, {u.hi}) elements [{u.start}, {u.end}) after slot {at_slot} element "
                f"{at}; pass the trainer's own units or None"
            )
        at_slot, at = u.hi, u.end
    if (at_slot, at) != (len(layout), layout.numel):
        raise PlanError(
            f"units: expected units covering {len(layout)} slots and {layout.numel} elements, "
            f"got {at_slot} and {at}; pass the trainer's own units or None"
        )
