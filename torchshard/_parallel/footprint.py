"""What one rank holds in each memory model, from the layout alone: pure arithmetic.

Three models, one per way of holding the weights: :class:`Whole` (every rank holds
everything), :class:`Slices` (the optimizer's state for one padded slice of the flat
buffer) and :class:`Stripes` (a stripe of every unit, the units gathered in turn). Each
answers three questions: the exact plan at a world size, bounds on its worst rank in
O(units), and a floor below every world size. The mode registry (``modes.py``) names
which model each mode uses; the geometry (padding, ranges) comes from ``Geometry`` and
``unit_geometry`` only, so the planner and the trainer agree by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .._errors import TorchShardError
from .._flat.geometry import Geometry, sliced_numel
from .._flat.layout import FlatLayout
from .units import Unit, unit_geometry

__all__ = [
    "OPTIMIZER_STATES",
    "MemoryModel",
    "PlanError",
    "RankMemory",
    "Request",
    "Slices",
    "Stripes",
    "Whole",
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


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds for training (what :meth:`DistributedTrainer.memory_bytes` reports).

    ``parameters``, ``gradients``, ``optimizer`` and ``master`` are held for the whole
    run; ``transient`` is the most the fully sharded mode's unit buffers take at once
    during a step (0 in the other modes). ``total`` counts both.

    Example::

        for m in torchshard.plan_memory(fm.layout, world_size=8, shard=torchshard.FullShard()):
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


@dataclass(frozen=True, kw_only=True)
class Request:
    """What a memory model is asked: the optimizer, and the mode's settings that size memory.

    ``units`` are the units the trainer resolved (only :class:`Stripes` reads them);
    ``prefetch`` and ``reshard_after_forward`` set its transient unit buffers.
    """

    optimizer: str = "adamw"
    master_dtype: torch.dtype = torch.float32
    units: tuple[Unit, ...] = ()
    prefetch: int = 1
    reshard_after_forward: bool = True

    def state_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the optimizer's state is kept in for a buffer of ``dtype`` (sharded modes)."""
        return self.master_dtype if dtype != self.master_dtype else dtype


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


class MemoryModel(Protocol):
    """How a mode's memory is planned: what the registry's ``memory`` holds."""

    divided: bool
    """Whether anything is divided among the ranks (else the world size changes nothing)."""
    floor_note: str
    """What :meth:`floor` counts, for a message."""

    def plan(self, layout: FlatLayout, world_size: int, req: Request) -> list[RankMemory]:
        """What each rank holds, exactly."""
        ...

    def bounds(self, layout: FlatLayout, world_size: int, req: Request) -> tuple[int, int]:
        """Below and above the worst rank's total of :meth:`plan`, in O(units)."""
        ...

    def floor(self, layout: FlatLayout, req: Request) -> int:
        """Below the worst rank's total at every world size."""
        ...


def _flat_plan(layout: FlatLayout, world_size: int, req: Request, sliced: bool) -> list[RankMemory]:
    """One flat buffer on every rank, and a gradient for the trainable parameters alone
    (``layout.grad_layout``); the state of every trainable element, or (``sliced``) of the
    rank's padded slice of the gradient space with its master copy (and, when some
    parameters are frozen, a copy of the trainable weights laid out like the gradient)."""
    per_element, scalars = OPTIMIZER_STATES[req.optimizer]
    dtype = layout.torch_dtype
    grads = layout.grad_layout
    flat = sliced_numel(layout, world_size) if sliced else Geometry.of(layout, 1, pad=False).total
    flat_bytes = flat * dtype.itemsize
    space = Geometry.of(grads, world_size, pad=sliced)
    grad_bytes = space.total * dtype.itemsize if grads.slots else 0
    master = sliced and dtype != req.master_dtype
    state_item = req.master_dtype.itemsize if master else dtype.itemsize
    # the trainable weights' copy, unless they are the buffer's own (none frozen, or all
    # frozen ones first: sliced in place)
    in_place = grads is layout or layout.trainable_suffix is not None
    copy = grad_bytes if sliced and not in_place else 0
    out = []
    for rank, (a, b) in enumerate(space.ranges()):
        if sliced:
            parts = [min(s.end, b) - max(s.offset, a) for s in grads]
            parts = [p for p in parts if p > 0]
            slice_master = 2 * (b - a) * req.master_dtype.itemsize if master else 0
        else:
            parts = [s.numel for s in grads]
            slice_master = 0
        opt = per_element * sum(parts) * state_item + scalars * 4 * len(parts)
        out.append(RankMemory(rank, flat_bytes, grad_bytes, opt, slice_master + copy))
    return out


def _bracket(
    layout: FlatLayout, req: Request, fixed: int, size: int, n: int, grad_item: int = 0
) -> tuple[int, int]:
    """``fixed`` plus the state (and, ``grad_item`` bytes each, the gradients) of the average
    rank's trainable elements (below) or of a whole slice of ``size`` elements with a scalar
    for every parameter (above): the worst rank lies between."""
    per_element, scalars = OPTIMIZER_STATES[req.optimizer]
    per = per_element * req.state_dtype(layout.torch_dtype).itemsize + grad_item
    trainable = [s.numel for s in layout if s.requires_grad]
    low = fixed + -(-per * sum(trainable) // n)
    high = fixed + per * size + scalars * 4 * len(trainable)
    return low, high


class Whole:
    """Every rank holds the whole buffer, the trainable parameters' gradient and the state
    of every trainable element: nothing depends on the world size (the replicated mode)."""

    divided = False
    floor_note = ""  # none: the floor is the total, at every world size

    def plan(self, layout: FlatLayout, world_size: int, req: Request) -> list[RankMemory]:
        return _flat_plan(layout, world_size, req, sliced=False)

    def bounds(self, layout: FlatLayout, world_size: int, req: Request) -> tuple[int, int]:
        total = self.floor(layout, req)
        return total, total

    def floor(self, layout: FlatLayout, req: Request) -> int:
        return _flat_plan(layout, 1, req, sliced=False)[0].total


class Slices:
    """The whole buffer and the trainable parameters' gradient on every rank; optimizer
    state (and its master copy in ``master_dtype``) for the rank's slice of the gradient
    space padded to equal slices."""

    divided = True
    floor_note = "the full parameters and gradients, which every rank holds, take"

    def plan(self, layout: FlatLayout, world_size: int, req: Request) -> list[RankMemory]:
        return _flat_plan(layout, world_size, req, sliced=True)

    def bounds(self, layout: FlatLayout, world_size: int, req: Request) -> tuple[int, int]:
        dtype = layout.torch_dtype
        grads = layout.grad_layout
        padded = Geometry.of(grads, world_size, pad=True).total
        size = padded // world_size  # every slice has this length
        fixed = sliced_numel(layout, world_size) * dtype.itemsize
        in_place = grads is layout or layout.trainable_suffix is not None
        fixed += (1 if in_place else 2) * padded * dtype.itemsize if grads.slots else 0
        fixed += 2 * size * req.master_dtype.itemsize if dtype != req.master_dtype else 0
        return _bracket(layout, req, fixed, size, world_size)

    def floor(self, layout: FlatLayout, req: Request) -> int:
        # padding only adds; the parameters and the trainable ones' gradients
        return (layout.numel + layout.grad_layout.numel) * layout.torch_dtype.itemsize


class Stripes:
    """The rank's stripe of every unit and its gradient (in ``master_dtype`` when the model's
    dtype differs), their optimizer state, and the unit buffers gathered during a step."""

    divided = True
    floor_note = "the unit buffers alone take"

    def plan(self, layout: FlatLayout, world_size: int, req: Request) -> list[RankMemory]:
        _check_units(layout, req.units)
        per_element, scalars = OPTIMIZER_STATES[req.optimizer]
        dtype = layout.torch_dtype
        shard_dtype = req.state_dtype(dtype)
        geoms = [unit_geometry(u, world_size, layout.align) for u in req.units]
        stripe = sum(g.per_rank for g in geoms) * shard_dtype.itemsize
        own = shard_dtype == dtype
        transient = self._transient(layout, req, [g.total for g in geoms])
        slots = layout.slots
        out = []
        for rank in range(world_size):
            elements = pieces = 0
            for u, g in zip(req.units, geoms):
                a, b = g.range(rank)
                a, b = min(a, u.end), min(b, u.end)
                for s in slots[u.lo : u.hi]:
                    n = min(s.end, b) - max(s.offset, a)
                    if s.requires_grad and n > 0:
                        elements += n
                        pieces += 1
            opt = per_element * elements * shard_dtype.itemsize + scalars * 4 * pieces
            # with frozen parameters, gradients for the trainable parts of the stripes only
            grads = elements * shard_dtype.itemsize if layout.grad_layout is not layout else stripe
            held = (stripe, grads) if own else (0, 0)
            out.append(RankMemory(rank, *held, opt, 0 if own else stripe + grads, transient))
        return out

    def bounds(self, layout: FlatLayout, world_size: int, req: Request) -> tuple[int, int]:
        _check_units(layout, req.units)
        geoms = [unit_geometry(u, world_size, layout.align) for u in req.units]
        size = sum(g.per_rank for g in geoms)  # the rank's stripes
        state_item = req.state_dtype(layout.torch_dtype).itemsize
        fixed = size * state_item + self._transient(layout, req, [g.total for g in geoms])
        if layout.grad_layout is layout:  # gradients for the whole stripes
            return _bracket(layout, req, fixed + size * state_item, size, world_size)
        # gradients for the stripes' trainable parts only
        return _bracket(layout, req, fixed, size, world_size, grad_item=state_item)

    def floor(self, layout: FlatLayout, req: Request) -> int:
        return self._transient(layout, req, [u.numel for u in req.units])  # unpadded

    @staticmethod
    def _transient(layout: FlatLayout, req: Request, sizes: list[int]) -> int:
        kept = [(p, u.kept) for p, u in zip(sizes, req.units)]
        itemsize = layout.torch_dtype.itemsize
        return transient_of_sizes(kept, itemsize, req.prefetch, req.reshard_after_forward)


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
