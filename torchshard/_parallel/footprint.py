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

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .._errors import TorchShardError
from .._flat.geometry import Geometry, sliced_numel
from .._flat.layout import FlatLayout, ParamSlot
from .units import Unit, stripe_parts, unit_geometry, unit_pieces

__all__ = [
    "OPTIMIZER_STATES",
    "MemoryModel",
    "PlanError",
    "RankMemory",
    "Request",
    "Slices",
    "Stripes",
    "Whole",
    "master_dtype_for",
    "transient_bytes",
    "transient_of_sizes",
    "typed",
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
        """The dtype the optimizer's state is kept in for parameters of ``dtype`` in the
        sharded modes: ``master_dtype``, in their own or in a master copy."""
        return self.master_dtype if dtype != self.master_dtype else dtype


def master_dtype_for(layout: FlatLayout, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype the sharded modes keep what the optimizer updates in: ``master_dtype``, or
    the parameters' own where it is wider (a float64 model keeps float64: a master that
    rounds the weights at every step would be a silent loss, not a copy).

    Example::

        master_dtype_for(fm.layout, torch.float32)   # torch.float64 for a float64 model
    """
    dtype = layout.torch_dtype
    if layout.mixed or not dtype.is_floating_point or dtype.itemsize <= master_dtype.itemsize:
        return master_dtype
    return dtype


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


def typed(
    layout: FlatLayout, a: int, b: int, end: int | None = None
) -> list[tuple[torch.dtype, int]]:
    """Buffer positions ``[a, b)`` of ``layout`` as ``(dtype, elements)``, a pair per region
    they cross; positions from ``end`` (default ``layout.numel``) on are padding, counted in
    the dtype before it (a gap belongs to the run before it). Every parameter of the
    layout's dtype: one pair, ``b - a`` elements.

    Example::

        typed(layout, 0, layout.numel)   # [(torch.bfloat16, 2048), (torch.float32, 64), ...]
    """
    return _Typed(layout)(a, b, end)


class _Typed:
    """:func:`typed` for many ranges of one layout: each in O(log regions + regions crossed)."""

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout
        self.regions = layout.regions if layout.mixed else ()
        self.starts = [r.start for r in self.regions]

    def __call__(self, a: int, b: int, end: int | None = None) -> list[tuple[torch.dtype, int]]:
        if b <= a:
            return []
        if not self.regions:
            return [(self.layout.torch_dtype, b - a)]
        stop = self.layout.numel if end is None else end
        out = []
        for r in self.regions[max(0, bisect.bisect_right(self.starts, a) - 1) :]:
            if r.start >= min(b, stop):
                break
            n = min(r.end, b, stop) - max(r.start, a)
            if n > 0:
                out.append((r.dtype, n // r.dtype.itemsize))
        if b > stop:  # padding: the dtype at stop - 1
            d = self.regions[bisect.bisect_right(self.starts, stop - 1) - 1].dtype
            out.append((d, (b - max(a, stop)) // d.itemsize))
        return out


def _width(layout: FlatLayout) -> Callable[[torch.dtype], int]:
    """Buffer positions per element of dtype ``d``: its bytes in a mixed layout, else 1."""
    return (lambda d: d.itemsize) if layout.mixed else (lambda d: 1)


def _part(s: ParamSlot, a: int, b: int) -> int:
    """Elements of ``s`` at buffer positions ``[a, b)``."""
    return max(0, min(s.end, b) - max(s.offset, a)) // s.width


def _flat_plan(layout: FlatLayout, world_size: int, req: Request, sliced: bool) -> list[RankMemory]:
    """One flat buffer on every rank, and a gradient for the trainable parameters alone
    (``layout.grad_layout``); the state of every trainable element, in its dtype, or
    (``sliced``) of the rank's padded slice of the gradient space, with a master copy and its
    gradient for the slice's elements not in ``master_dtype`` (and, when some parameters are
    frozen, a copy of the trainable weights laid out like the gradient)."""
    per_element, scalars = OPTIMIZER_STATES[req.optimizer]
    itemsize = layout.torch_dtype.itemsize  # a mixed layout's positions are bytes
    grads = layout.grad_layout
    flat = sliced_numel(layout, world_size) if sliced else Geometry.of(layout, 1, pad=False).total
    space = Geometry.of(grads, world_size, pad=sliced)
    grad_bytes = space.total * itemsize if grads.slots else 0
    # the trainable weights' copy, unless they are the buffer's own (none frozen, or all
    # frozen ones first: sliced in place)
    in_place = grads is layout or layout.trainable_suffix is not None
    copy = grad_bytes if sliced and not in_place else 0
    # the state's bytes per element of dtype d: in master_dtype (sliced), else in d
    item = (lambda d: req.state_dtype(d).itemsize) if sliced else (lambda d: d.itemsize)
    of = _Typed(grads)
    out = []
    for rank, (a, b) in enumerate(space.ranges()):
        parts = [(s, _part(s, a, b) if sliced else s.numel) for s in grads]
        parts = [(s, n) for s, n in parts if n > 0]
        state = sum(n * item(s.torch_dtype) for s, n in parts)
        opt = per_element * state + scalars * 4 * len(parts)
        master = _master_bytes(req, of(a, b), layout.mixed) if sliced else 0
        out.append(RankMemory(rank, flat * itemsize, grad_bytes, opt, master + copy))
    return out


def _master_bytes(req: Request, elements: list[tuple[torch.dtype, int]], mixed: bool) -> int:
    """A master copy and its gradient (``master_dtype``) of the elements not in that dtype;
    of every element in a ``mixed`` layout, whose rank part one master holds whole (the
    sharded modes keep its few fp32 norms and routers there too)."""
    master = req.master_dtype
    return sum(2 * k * master.itemsize for d, k in elements if mixed or d != master)


def _bracket(
    layout: FlatLayout,
    req: Request,
    n: int,
    fixed: int,
    varying: tuple[int, int, Callable[[torch.dtype], int]],
) -> tuple[int, int]:
    """``fixed`` (on each of the ``n`` ranks) plus what varies by rank, ``varying = (total,
    size, rate)``: its ``total`` over the ranks averaged (below), or ``size`` buffer
    positions all of the dtype costing the most, ``rate(d)`` bytes per element of ``d``, and
    a scalar for every trainable parameter (above): the worst rank lies between."""
    _, scalars = OPTIMIZER_STATES[req.optimizer]
    total, size, rate = varying
    width = _width(layout)
    most = max(-(-size * rate(d) // width(d)) for d in layout.grad_layout.dtypes or layout.dtypes)
    return fixed + -(-total // n), fixed + most + scalars * 4 * len(layout.trainable)


def _trainable_bytes(layout: FlatLayout, item: Callable[[torch.dtype], int]) -> int:
    """``item(d)`` bytes for every trainable element of dtype ``d``."""
    return sum(s.numel * item(s.torch_dtype) for s in layout.grad_layout)


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
    state (and a master copy in ``master_dtype`` of what is not in it) for the rank's slice
    of the gradient space padded to equal slices."""

    divided = True
    floor_note = "the full parameters and gradients, which every rank holds, take"

    def plan(self, layout: FlatLayout, world_size: int, req: Request) -> list[RankMemory]:
        return _flat_plan(layout, world_size, req, sliced=True)

    def bounds(self, layout: FlatLayout, world_size: int, req: Request) -> tuple[int, int]:
        itemsize = layout.torch_dtype.itemsize
        grads = layout.grad_layout
        padded = Geometry.of(grads, world_size, pad=True).total
        fixed = sliced_numel(layout, world_size) * itemsize
        in_place = grads is layout or layout.trainable_suffix is not None
        fixed += (1 if in_place else 2) * padded * itemsize if grads.slots else 0
        # the state and the master copy vary by rank
        per_element, _ = OPTIMIZER_STATES[req.optimizer]
        state = lambda d: per_element * req.state_dtype(d).itemsize  # noqa: E731
        master = lambda d: _master_bytes(req, [(d, 1)], layout.mixed)  # noqa: E731
        total = _trainable_bytes(layout, state)
        total += _master_bytes(req, typed(grads, 0, padded), layout.mixed)
        size = padded // world_size  # every slice has this length
        return _bracket(
            layout, req, world_size, fixed, (total, size, lambda d: state(d) + master(d))
        )

    def floor(self, layout: FlatLayout, req: Request) -> int:
        # padding only adds; the parameters and the trainable ones' gradients
        return (layout.numel + layout.grad_layout.numel) * layout.torch_dtype.itemsize


class Stripes:
    """The rank's stripe of every unit and its gradient (a master copy in ``master_dtype``
    of what is not in it), their optimizer state, and the unit buffers gathered during a
    step."""

    divided = True
    floor_note = "the unit buffers alone take"

    def plan(self, layout: FlatLayout, world_size: int, req: Request) -> list[RankMemory]:
        _check_units(layout, req.units)
        per_element, scalars = OPTIMIZER_STATES[req.optimizer]
        geoms = [unit_geometry(u, world_size, layout.align) for u in req.units]
        pieces = [unit_pieces(layout, u, g) for u, g in zip(req.units, geoms)]
        transient = self._transient(layout, req, [g.total for g in geoms])
        width = _width(layout)
        out = []
        for rank in range(world_size):
            held: list[tuple[torch.dtype, int]] = []  # (dtype, elements) of the stripes' pieces
            parts: list[tuple[torch.dtype, int]] = []  # of the trainable parameters
            rest = 0  # positions held as the buffer holds them (frozen, with frozen ones)
            for u, g, mine in zip(req.units, geoms, pieces):
                a, b = g.range(rank)
                typed, others = stripe_parts(mine, a, b)
                held += [(d, (y - x) // width(d)) for x, y, d in typed]
                rest += sum(y - x for x, y in others)
                for s in layout.slots[u.lo : u.hi]:
                    n = _part(s, a, b) if s.requires_grad else 0
                    if n > 0:
                        parts.append((s.torch_dtype, n))
            own, master = self._split(req, held, layout.mixed)
            state = sum(k * req.state_dtype(d).itemsize for d, k in parts)
            opt = per_element * state + scalars * 4 * len(parts)
            params = own + rest * layout.torch_dtype.itemsize
            # the gradients are laid out like the pieces' weights
            out.append(RankMemory(rank, params, own, opt, 2 * master, transient))
        return out

    @staticmethod
    def _split(
        req: Request, elements: list[tuple[torch.dtype, int]], mixed: bool
    ) -> tuple[int, int]:
        """Bytes of ``(dtype, elements)`` held in ``master_dtype``: in their own dtype (that
        one), and as a master copy (any other; every one in a ``mixed`` layout, whose stripes
        are masters whole)."""
        held = [k * req.master_dtype.itemsize for d, k in elements]
        own = sum(n for n, (d, _) in zip(held, elements) if d == req.master_dtype and not mixed)
        return own, sum(held) - own

    def bounds(self, layout: FlatLayout, world_size: int, req: Request) -> tuple[int, int]:
        _check_units(layout, req.units)
        geoms = [unit_geometry(u, world_size, layout.align) for u in req.units]
        size = sum(g.per_rank for g in geoms)  # the rank's stripes
        per_element, _ = OPTIMIZER_STATES[req.optimizer]
        item = lambda d: req.state_dtype(d).itemsize  # noqa: E731
        width = _width(layout)
        # the stripes' pieces (twice: their gradients), the rest as the buffer holds it, and
        # the state vary by rank
        total = 0
        for u, g in zip(req.units, geoms):
            pieces = unit_pieces(layout, u, g)
            total += sum(2 * (y - x) // width(d) * item(d) for x, y, d in pieces)
            rest = g.total - sum(y - x for x, y, _ in pieces)
            total += rest * layout.torch_dtype.itemsize
        total += per_element * _trainable_bytes(layout, item)
        fixed = self._transient(layout, req, [g.total for g in geoms])
        rate = lambda d: (2 + per_element) * item(d)  # noqa: E731
        return _bracket(layout, req, world_size, fixed, (total, size, rate))

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
