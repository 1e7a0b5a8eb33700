"""Sharded-optimizer mode (FSDP-lite: ZeRO-1 memory, ZeRO-2 communication).

Each rank owns one contiguous, equal slice of the padded flat buffer. A bucket
never crosses a slice boundary, and is reduced to its slice's owner during
backward; the optimizer updates the pieces of the rank's slice (in an fp32
master copy when the buffer is lower precision); after its step every rank's
slice is all-gathered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buckets import Bucket
from .comm import BucketComm, ReduceToOwner
from .mode import Context, Mode, Segment
from .shards import LocalShards

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(Mode):
    """Optimizer state, master weights and the reduced gradient for this rank's slice only."""

    sharded = True
    pads = True
    comm_type = ReduceToOwner

    def __init__(self, master_dtype: torch.dtype = torch.float32) -> None:
        self.master_dtype = master_dtype
        self._master: torch.Tensor | None = None
        self._master_grad: torch.Tensor | None = None
        self._pieces: list[tuple[int, int, int, torch.nn.Parameter]] = []
        self.bytes_gathered = 0

    def bucket_cuts(self, ctx: Context) -> tuple[int, ...]:
        return tuple(a for a, _ in ctx.geometry.ranges())

    def setup(self, ctx: Context, buckets: tuple[Bucket, ...]) -> None:
        if ctx.fm.dtype != self.master_dtype:
            s0, e0 = ctx.geometry.range(ctx.rank)
            self._master = ctx.flat[s0:e0].to(self.master_dtype, copy=True)
            self._master_grad = torch.zeros_like(self._master)

    def make_comm(self, ctx: Context) -> BucketComm:
        """Each bucket reduced to the owner of its slice (a bucket never crosses a slice)."""
        geometry = ctx.geometry
        return ReduceToOwner(ctx.mesh, lambda b: geometry.owner(b.start))

    def finish(self, ctx: Context) -> None:
        s0, e0 = ctx.geometry.range(ctx.rank)
        mine = ctx.grad[s0:e0]
        if self._master_grad is not None:
            # reduced across ranks in the buffer's dtype (half the traffic in bf16); a sum
            # is divided here, in the master dtype
            self._master_grad.copy_(mine)
            mine = self._master_grad
        ctx.spec.scale_after(mine)

    # -- the rank's slice -----------------------------------------------------------------
    def _slice(self, ctx: Context, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of the flat buffer, in ``t``, a tensor over this rank's slice."""
        s0 = ctx.geometry.range(ctx.rank)[0]
        return t[a - s0 : b - s0]

    def _params(self, ctx: Context) -> torch.Tensor:
        s0, e0 = ctx.geometry.range(ctx.rank)
        return self._master if self._master is not None else ctx.flat[s0:e0]

    def local_grad(self, ctx: Context) -> torch.Tensor:
        s0, e0 = ctx.geometry.range(ctx.rank)
        return self._master_grad if self._master_grad is not None else ctx.grad[s0:e0]

    def optimizer_tensors(self, ctx: Context) -> list[Segment]:
        s0, e0 = ctx.geometry.range(ctx.rank)
        if not self._pieces:
            for i in ctx.trainable:
                s = ctx.fm.layout.slots[i]
                a, b = max(s.offset, s0), min(s.end, e0)
                if a < b:
                    piece = torch.nn.Parameter(self._slice(ctx, self._params(ctx), a, b))
                    self._pieces.append((i, a, b, piece))
        return list(self._pieces)

    def attach_grads(self, ctx: Context, used: dict[int, bool]) -> None:
        grad = self.local_grad(ctx)
        for i, a, b, piece in self._pieces:
            piece.grad = self._slice(ctx, grad, a, b) if used[i] else None

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
        """Copy the master slice into the flat buffer and all-gather every rank's slice."""
        flat = ctx.flat
        s0, e0 = ctx.geometry.range(ctx.rank)
        if self._master is not None:
            flat[s0:e0].copy_(self._master)
        if ctx.world_size == 1:
            return
        # In place, one call on every backend (gloo implements it too since torch 2.x, at
        # the speed of a list all_gather): rank r's slice is input and output at offset
        # r * per_rank, NCCL's in-place condition. all_gather_single is its 2.13 name.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(flat[: ctx.geometry.total], flat[s0:e0], group=ctx.group)
        self.bytes_gathered += ctx.geometry.total * flat.element_size()

    def zero_grad(self) -> None:
        for *_, piece in self._pieces:
            piece.grad = None

    @torch.no_grad()
    def refresh_master(self, ctx: Context) -> None:
        if self._master is not None:
            s0, e0 = ctx.geometry.range(ctx.rank)
            self._master.copy_(ctx.flat[s0:e0])

    def local_shards(self, ctx: Context) -> LocalShards:
        numel = ctx.fm.layout.numel
        every = ctx.geometry.clipped(numel)
        return LocalShards.of(self._params(ctx), [(0, numel)], [every], ctx.rank, [0])

    def master_bytes(self) -> int:
        tensors = (self._master, self._master_grad)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
