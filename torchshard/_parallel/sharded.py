"""Sharded-optimizer mode (FSDP-lite: ZeRO-1 memory, ZeRO-2 communication).

Each rank owns one contiguous, equal slice of the padded gradient space (the trainable
parameters, ``layout.grad_layout``; the flat buffer itself when every parameter trains).
A bucket never crosses a slice boundary, and is reduced to its slice's owner during
backward; the optimizer updates the pieces of the rank's slice (in an fp32 master copy
when the buffer is lower precision, or holds several dtypes); after its step every rank's
slice is all-gathered. Frozen parameters are broadcast once and never reduced, updated or
gathered.

Hybrid sharding (a mesh with replicas): the slices are cut over the rank's shard group
(``ctx.shards``); each bucket is reduced to its owner there and then all-reduced by the
owners across the replicate group (``ctx.replicas``), so every replica holds the same
reduced slice and takes the same step; the gather stays inside the shard group. The mean,
the used-parameter mask and the norm are over the whole data-parallel group (``ctx.mesh``).

With parameters of several dtypes the gradient space is bytes: the rank's slice is cut into
typed parts where the dtype changes, and one fp32 master holds every part's elements back
to back (the fp32 parts too: a copy, for the norms and routers such models keep in fp32).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .._flat.geometry import sliced_numel
from .._flat.layout import FlatLayout, as_dtype
from .._flat.module import FlatParamModule
from .buckets import Bucket
from .comm import BucketComm, ReduceAcrossReplicas, ReduceToOwner
from .mode import Context, Mode, Segment
from .setup import resolve_master_dtype
from .shards import LocalShards

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(Mode):
    """Optimizer state, master weights and the reduced gradient for this rank's slice only."""

    sharded = True
    pads = True
    comm_type = ReduceToOwner
    hybrid = True  # slices over a shard group, each reduced slice all-reduced across replicas
    comm_kinds = frozenset({"dense", "cast", "star"})
    comm_refusal = (
        "its buckets are cut at slice boundaries, inside parameters, and each is reduced to "
        "its slice's owner only; PowerSGD() and TopK() need whole parameters and the result "
        "on every rank: use shard=False, or BF16()/FP16() to halve the bytes"
    )

    def __init__(self, master_dtype: torch.dtype = torch.float32) -> None:
        self.master_dtype = master_dtype
        self._master: torch.Tensor | None = None
        self._master_grad: torch.Tensor | None = None
        # the rank's slice by dtype: (start, end, dtype, at): gradient-space [start, end) is
        # the master's elements from at on (one part, at 0, unless the layout is mixed)
        self._parts: list[tuple[int, int, torch.dtype, int]] = []
        self._unit = 1  # bytes per gradient-space position (setup)
        self._weights: torch.Tensor | None = None  # the trainable weights, when some are frozen
        self._runs: list[tuple[int, int, int]] = []  # flat [a, b) = weights [c, c + b - a)
        self._at: int | None = None  # where the gradient space starts in the flat buffer
        self._pieces: list[tuple[int, int, int, torch.nn.Parameter]] = []  # gradient space
        self._segments: list[Segment] = []  # the same pieces, in flat-buffer coordinates
        self.bytes_gathered = 0

    def prepare(self, fm: FlatParamModule) -> None:
        self.master_dtype = resolve_master_dtype(fm.layout, self.master_dtype)
        super().prepare(fm)

    def flat_numel(self, layout: FlatLayout, world_size: int) -> int:
        return sliced_numel(layout, world_size)

    def bucket_cuts(self, ctx: Context) -> tuple[int, ...]:
        return tuple(a for a, _ in ctx.geometry.ranges())

    def setup(self, ctx: Context, buckets: tuple[Bucket, ...]) -> None:
        layout = ctx.fm.layout
        self._at = layout.trainable_suffix  # frozen ones first only: slice the buffer there
        if layout.grad_layout is not layout and self._at is None:
            # Frozen parameters lie between trainable ones: the optimizer's slices are cut
            # from a copy of the trainable weights alone, laid out like their gradients.
            self._runs = layout.trainable_runs()
            self._weights = torch.zeros(ctx.geometry.total, dtype=ctx.flat.dtype, device=ctx.device)
            self._copy_in(ctx)
        s0, e0 = ctx.geometry.range(ctx.shards.rank)
        self._unit = ctx.fm.dtype.itemsize  # bytes per gradient-space position
        self._parts = _parts(layout.grad_layout, s0, e0, ctx.geometry.total, ctx.fm.dtype)
        if ctx.fm.dtype != self.master_dtype:
            n = sum((b - a) * self._unit // d.itemsize for a, b, d, _ in self._parts)
            self._master = torch.empty(n, dtype=self.master_dtype, device=ctx.device)
            self._master_grad = torch.zeros_like(self._master)
            self._copy_master(ctx, into_master=True)

    def _in_master(self, a: int, b: int) -> tuple[int, int]:
        """Where gradient-space ``[a, b)`` (inside one part of the rank's slice) lies in the
        master or, without one, in the rank's slice."""
        for x, y, d, at in self._parts:
            if x <= a and b <= y:
                w = d.itemsize // self._unit
                return at + (a - x) // w, at + (b - x) // w
        raise AssertionError(f"[{a}, {b}) is not inside one part of {self._parts}")

    @torch.no_grad()
    def _copy_master(self, ctx: Context, *, into_master: bool) -> None:
        """The slice's weights into the master (or back), part by part."""
        assert self._master is not None
        space = self._space(ctx)
        for a, b, d, at in self._parts:
            typed = as_dtype(space[a:b], d)
            master = self._master[at : at + typed.numel()]
            (master.copy_(typed) if into_master else typed.copy_(master))

    def _space(self, ctx: Context) -> torch.Tensor:
        """The weights laid out like the gradient: the flat buffer (from the trainable
        suffix on, when frozen parameters come first), or the trainable copy."""
        if self._weights is not None:
            return self._weights
        return ctx.flat if self._at is None else ctx.flat[self._at : self._at + ctx.geometry.total]

    @torch.no_grad()
    def _copy_in(self, ctx: Context) -> None:
        assert self._weights is not None
        for a, b, c in self._runs:
            self._weights[c : c + b - a].copy_(ctx.flat[a:b])

    def make_comm(self, ctx: Context) -> BucketComm:
        """Each bucket reduced to the owner of its slice (a bucket never crosses a slice);
        with replicas, then all-reduced across them by its owners."""
        geometry = ctx.geometry
        master = self._master_grad
        sink = None
        if master is not None and ctx.spec.dtype == master.dtype:  # reduce_dtype=master's
            sink = lambda b: master[slice(*self._in_master(b.start, b.end))]  # noqa: E731
        owner = lambda b: geometry.owner(b.start)  # noqa: E731
        if ctx.replicas is not None:
            return ReduceAcrossReplicas(ctx.shards, ctx.replicas, owner, sink)
        return ReduceToOwner(ctx.mesh, owner, sink)

    def finish(self, ctx: Context) -> None:
        s0, e0 = ctx.geometry.range(ctx.shards.rank)
        mine = ctx.grad[s0:e0]
        if self._master_grad is not None:
            # reduced across ranks in the buffer's dtype (half the traffic in bf16), or in
            # the master's (reduce_dtype) straight into it, where it travelled in a copy; a
            # sum is divided here, in the master dtype
            wire = ctx.spec.dtype
            for a, b, d, at in self._parts:
                if wire != self._master_grad.dtype or wire == d:  # not landed there
                    typed = as_dtype(ctx.grad[a:b], d)
                    self._master_grad[at : at + typed.numel()].copy_(typed)
            mine = self._master_grad
        ctx.spec.scale_after(mine)

    # -- the rank's slice -----------------------------------------------------------------
    def _slice(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Gradient-space ``[a, b)`` (one slot's piece), in ``t``: the master, its gradient, or
        without a master a tensor over this rank's slice."""
        return t[slice(*self._in_master(a, b))]

    def _params(self, ctx: Context) -> torch.Tensor:
        s0, e0 = ctx.geometry.range(ctx.shards.rank)
        return self._master if self._master is not None else self._space(ctx)[s0:e0]

    def local_grad(self, ctx: Context) -> torch.Tensor:
        s0, e0 = ctx.geometry.range(ctx.shards.rank)
        return self._master_grad if self._master_grad is not None else ctx.grad[s0:e0]

    def local_grads(self, ctx: Context) -> list[torch.Tensor]:
        return [self.local_grad(ctx)]  # a mixed layout's has a master, in one dtype

    def optimizer_tensors(self, ctx: Context) -> list[Segment]:
        s0, e0 = ctx.geometry.range(ctx.shards.rank)
        layout = ctx.fm.layout
        if not self._pieces:
            for i, g in zip(layout.trainable, layout.grad_layout.slots):
                a, b = max(g.offset, s0), min(g.end, e0)
                if a < b:
                    piece = torch.nn.Parameter(self._slice(self._params(ctx), a, b))
                    self._pieces.append((i, a, b, piece))
                    # what the optimizer updates, as a range of the flat buffer
                    shift = layout.slots[i].offset - g.offset
                    self._segments.append((i, a + shift, b + shift, piece))
        return list(self._segments)

    def attach_grads(self, ctx: Context, used: dict[int, bool]) -> None:
        grad = self.local_grad(ctx)
        for i, a, b, piece in self._pieces:
            piece.grad = self._slice(grad, a, b) if used[i] else None

    @torch.no_grad()
    def after_step(self, ctx: Context) -> None:
        self.gather(ctx)
        # The full-size gradient was consumed by the reduction (FSDP frees it too). The
        # optimizer holds slice pieces, so `optimizer.zero_grad()` cannot reach the
        # module's `.grad`: left set, the next backward would add to this step's.
        for i in ctx.trainable:
            ctx.params[i].grad = None

    @torch.no_grad()
    def gather(self, ctx: Context) -> None:
        """Copy the master slice into the weights and all-gather every rank's slice."""
        space = self._space(ctx)
        s0, e0 = ctx.geometry.range(ctx.shards.rank)
        if self._master is not None:
            self._copy_master(ctx, into_master=False)
        if ctx.shards.size > 1:
            # In place, one call on every backend (gloo implements it too since torch 2.x,
            # at the speed of a list all_gather): rank r's slice is input and output at
            # offset r * per_rank, NCCL's in-place condition. all_gather_single is its 2.13
            # name.
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(space[: ctx.geometry.total], space[s0:e0], group=ctx.shards.group)
            self.bytes_gathered += ctx.geometry.total * space.element_size()
        for a, b, c in self._runs:  # the trainable copy back into the module's weights
            ctx.flat[a:b].copy_(space[c : c + b - a])

    def zero_grad(self) -> None:
        for *_, piece in self._pieces:
            piece.grad = None

    @torch.no_grad()
    def refresh_master(self, ctx: Context) -> None:
        if self._weights is not None:
            self._copy_in(ctx)
        if self._master is not None:
            self._copy_master(ctx, into_master=True)

    def local_shards(self, ctx: Context) -> LocalShards:
        layout = ctx.fm.layout
        # the buffer itself (from 0 or from the trainable suffix), or the trainable copy's runs
        runs = [(self._at or 0, layout.numel, 0)] if self._weights is None else self._runs
        if layout.mixed:  # runs of one dtype each: the master's elements, back to back
            cuts = [r.start for r in layout.grad_layout.regions[1:]]
            runs = [
                (a + x - c, a + y - c, x) for a, b, c in runs for x, y in _cut(c, c + b - a, cuts)
            ]
        # each run is a region of the flat buffer, cut where the ranks' slices of the
        # gradient space cut it
        ranges = ctx.geometry.ranges()
        s0, e0 = ranges[ctx.shards.rank]
        regions, every, offsets = [], [], []
        for a, b, c in runs:
            cuts = []
            for x, y in ranges:
                lo, hi = max(x, c), min(y, c + b - a)
                cuts.append((a + lo - c, a + hi - c) if lo < hi else (a, a) if y <= c else (b, b))
            regions.append((a, b))
            every.append(cuts)
            lo, hi = max(s0, c), min(e0, c + b - a)
            offsets.append(self._in_master(lo, hi)[0] if lo < hi else 0)
        return LocalShards.of(self._params(ctx), regions, every, ctx.shards.rank, offsets)

    def master_bytes(self) -> int:
        """The master copy and its gradient, and the trainable weights' copy (if any)."""
        tensors = (self._master, self._master_grad, self._weights)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _parts(
    grads: FlatLayout, s0: int, e0: int, total: int, dtype: torch.dtype
) -> list[tuple[int, int, torch.dtype, int]]:
    """The rank's slice ``[s0, e0)`` of the gradient space cut where the dtype changes:
    ``(start, end, dtype, at)``, ``at`` counting the elements of the parts before it (the
    padding past the last region is the last region's). One part when the layout has one
    dtype (``dtype``, the buffer's)."""
    if not grads.mixed:
        return [(s0, e0, dtype, 0)]
    parts, at = [], 0
    regions = grads.regions
    for k, r in enumerate(regions):
        a, b = max(r.start, s0), min(total if k == len(regions) - 1 else r.end, e0)
        if a < b:
            parts.append((a, b, r.dtype, at))
            at += (b - a) // r.dtype.itemsize
    return parts


def _cut(a: int, b: int, cuts: list[int]) -> list[tuple[int, int]]:
    """``[a, b)`` cut at each of ``cuts`` inside it."""
    return list(itertools.pairwise([a, *(c for c in cuts if a < c < b), b]))
