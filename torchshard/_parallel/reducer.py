"""The bucket reducer: bucket launches during backward, in the same order on every rank.

Mode-free: how a bucket travels is the comm's (:class:`BucketComm`); the reducer
decides *when*. A bucket starts as soon as every parameter in it has its gradient,
but only after every bucket before it has started: a collective issued out of
order on one rank deadlocks (NCCL) or mixes up buckets (gloo). Each launch returns
a future; :meth:`BucketReducer.finish` waits on them. The reducer also carries the
used-parameter mask: in the last bucket's buffer when the comm allows it, else in
one small all-reduce of its own.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.futures import Future

from .._errors import TorchShardError
from .._flat.layout import FlatLayout
from .buckets import Bucket
from .comm import BucketComm, fill_mask, settled
from .seam import CommStats, Context, UpdateShard

__all__ = ["BucketReducer", "CommStats", "mask_room"]


def mask_room(layout: FlatLayout) -> int:
    """Elements to keep just before the flat gradient for the used-parameter mask to ride
    in the bucket at offset 0: one per trainable parameter, rounded up to the alignment.

    Example::

        store = torch.zeros(mask_room(fm.layout) + n)   # [mask | padding | gradient]
    """
    n = sum(s.requires_grad for s in layout.slots)
    return -(-n // layout.align) * layout.align


class BucketReducer:
    """Hears each trainable parameter's gradient (through the module's one hook per
    parameter); launches buckets in order through ``comm``; finishes the mean with
    ``update``.

    ``store``: ``[mask room | flat gradient]`` (:func:`mask_room`), when the gradient was
    allocated with room for the mask (``None``: the mask travels on its own).

    With every parameter used, a step makes no host synchronization: the
    used-parameter mask is filled on the device and read back only when this
    rank has a parameter without a gradient (DDP pays that read only with
    ``find_unused_parameters=True``).
    """

    def __init__(
        self,
        ctx: Context,
        update: UpdateShard,
        buckets: tuple[Bucket, ...],
        comm: BucketComm,
        store: torch.Tensor | None = None,
    ) -> None:
        self.ctx, self.update, self.buckets, self.comm = ctx, update, buckets, comm
        layout = ctx.fm.layout
        self.in_grad = dict(zip(layout.trainable, layout.grad_layout.slots))
        """Each trainable slot's place in the gradient."""
        self.slot_buckets: list[list[int]] = [[] for _ in layout.slots]
        for b in buckets:
            for i in b.slots:
                self.slot_buckets[i].append(b.index)
        self.sync = True
        """False inside ``no_sync()``: gradients accumulate locally."""
        self.averaged = False
        """Whether the gradients are the mean since the last backward."""
        self.futures: list[Future[torch.Tensor]] = []
        self.stats = CommStats(buckets=sum(b.trainable > 0 for b in buckets))
        fuse = store is not None and comm.fuses_mask
        self._store = store if fuse else None
        self._fused = store[: len(ctx.trainable)] if fuse and store is not None else None
        self._sent = False
        self._flush = getattr(comm, "flush", None)  # a two-stage comm's second stage
        # a lossy comm runs in a world of one too: its update must not depend on the world
        self._alone = bool(getattr(comm, "runs_alone", False))
        # The mask's own all-reduce, for comms whose buckets cannot carry it: persistent,
        # on the device, so filling it is a kernel and not a host-to-device copy.
        self._mask = torch.zeros(len(ctx.trainable), dtype=torch.int32, device=ctx.device)
        self._reset_step()
        ctx.fm._set_grad_listener(self._on_grad_ready)

    def _reset_step(self) -> None:
        self.ready = [False] * len(self.ctx.fm.layout)
        self.pending = [b.trainable for b in self.buckets]
        self.next = 0
        self.launched_in_backward = 0

    def _on_grad_ready(self, i: int) -> None:
        self.averaged = False
        if not self.sync:
            return
        if self.ready[i]:
            name = self.ctx.fm.layout.slots[i].name
            raise TorchShardError(
                f"parameter {name!r} received a second gradient before average_gradients(); "
                "call trainer.average_gradients() after every backward, or accumulate "
                "inside `with trainer.no_sync():`"
            )
        self.ready[i] = True
        for b in self.slot_buckets[i]:
            self.pending[b] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.buckets[self.next], in_backward=True)
            self.next += 1

    def _launch(self, bucket: Bucket, *, in_backward: bool) -> None:
        if bucket.trainable == 0:
            return
        ctx = self.ctx
        grad = ctx.grad
        if not in_backward:
            # Parameters without a gradient on this rank contribute zeros.
            for i in bucket.slots:
                s = self.in_grad.get(i)
                if s is not None and ctx.params[i].grad is None:
                    grad[s.offset : s.end].zero_()
        if ctx.world_size > 1 or self._alone:
            view = bucket.view(grad)
            if ctx.world_size > 1:
                self.stats.bytes_reduced += view.numel() * view.element_size()
            if self._store is not None and bucket.start == 0:
                view = self._with_mask(bucket)
            self.futures.append(self.comm.launch(view, ctx.spec, bucket))
        self.launched_in_backward += in_backward

    def _with_mask(self, bucket: Bucket) -> torch.Tensor:
        """The bucket at 0 widened to ``[mask | padding | bucket]``. Buckets launch in order
        and the one at 0 is the last: every parameter that gets a gradient this step has it
        now, so the mask is final."""
        assert self._store is not None and self._fused is not None
        ctx = self.ctx
        # all used (a kernel, no host sync) whenever launched inside backward; otherwise
        # from average_gradients(), which reads the mask back anyway
        fill_mask(self._fused, [ctx.params[i].grad is not None for i in ctx.trainable])
        # Reduced with the bucket's spec: scaled, or averaged, each entry is a fraction, not
        # a count; only "nonzero" (some rank used it) is ever read.
        self._sent = True
        return self._store[: self._store.numel() - ctx.grad.numel() + bucket.end]

    def finish(self) -> None:
        """Launch what backward did not, wait for everything, make the gradient the mean."""
        ctx = self.ctx
        while self.next < len(self.buckets):
            self._launch(self.buckets[self.next], in_backward=False)
            self.next += 1
        used = [ctx.params[i].grad is not None for i in ctx.trainable]
        everywhere = all(used)  # then the global mask is all ones: nothing to read back
        if ctx.world_size == 1 and self._alone:
            self._second_stage()
        if ctx.world_size > 1:
            t0 = time.perf_counter()
            # The second stage first: its collectives precede the mask's on every rank,
            # even where a replicate group is the data-parallel group (shard groups of 1).
            self._second_stage()
            # Which parameters have a gradient anywhere: in a bucket already, or in one
            # small all-reduce, always issued last so the order is the same on every rank.
            if self._sent:
                assert self._fused is not None
                mask, self._sent = self._fused, False
            else:
                mask = self._mask
                fill_mask(mask, used)
                work = dist.all_reduce(mask, group=ctx.group, async_op=True)
                self.futures.append(settled(work, mask))
            for fut in self.futures:
                fut.wait()  # on NCCL: the current stream waits, the host does not
            self.stats.wait_seconds += time.perf_counter() - t0
            if not everywhere:
                used = [bool(n) for n in mask.tolist()]
        self.futures.clear()
        self.update.finish(ctx)
        globally_used = dict(zip(ctx.trainable, used))
        for i in ctx.trainable:
            p = ctx.params[i]
            if globally_used[i] and p.grad is None:
                s = self.in_grad[i]
                p.grad = s.view(ctx.grad)
        self.update.attach_grads(ctx, globally_used)
        self.stats.steps += 1
        self.stats.launched_during_backward = self.launched_in_backward
        self.averaged = True
        self._reset_step()

    def _second_stage(self) -> None:
        """A two-stage comm's second stage (once every launch completed), and the bytes."""
        if self._flush is not None:
            for fut in self.futures:
                fut.wait()
            self.stats.bytes_across_replicas += self._flush()
        self.stats.payload_bytes = getattr(self.comm, "payload_bytes", self.stats.bytes_reduced)

    def close(self) -> None:
        self.ctx.fm._set_grad_listener(None)
        for fut in self.futures:
            fut.wait()
        self.futures.clear()
