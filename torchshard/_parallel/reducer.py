"""The gradient reducer: bucket launches during backward, in the same order on every rank.

Mode-free: each bucket's collective is the mode's (:meth:`Mode.launch`); the
reducer decides *when*. A bucket starts as soon as every parameter in it has its
gradient, but only after every bucket before it has started: a collective issued
out of order on one rank deadlocks (NCCL) or mixes up buckets (gloo).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._errors import TorchShardError
from .buckets import Bucket
from .mode import Context, Mode

__all__ = ["CommStats", "Reducer"]


@dataclass
class CommStats:
    """Counters of the gradient communication (for logs and tests).

    Example::

        s = trainer.stats
        print(f"{s.launched_during_backward}/{s.buckets} buckets started in backward, "
              f"{1e3 * s.wait_seconds / s.steps:.1f} ms/step waiting")
    """

    steps: int = 0
    """``average_gradients()`` calls so far."""
    buckets: int = 0
    """Buckets that carry gradients."""
    launched_during_backward: int = 0
    """Buckets of the last step whose all-reduce started inside backward (from a gradient
    hook). Not a measure of overlap: with the whole model compiled, backward is one graph
    and every hook runs after its last kernel, yet each launch still counts here."""
    wait_seconds: float = 0.0
    """Total time ``average_gradients()`` spent waiting for communication (host time:
    meaningful on gloo; on NCCL ``wait()`` only orders the streams and returns at once)."""
    bytes_reduced: int = 0
    """Bytes of gradient buffers handed to reductions (all-reduce, reduce, reduce-scatter),
    counted at their full size, since the trainer was built."""
    bytes_gathered: int = 0
    """Bytes of weight buffers all-gathered (sharded: after each step; fully sharded: each
    unit before its forward and again before its backward), at their full size."""


class Reducer:
    """Hears each trainable parameter's gradient (through the module's one hook per
    parameter); launches buckets in order; finishes the mean.

    With every parameter used, a step makes no host synchronization: the
    used-parameter mask is filled on the device and read back only when this
    rank has a parameter without a gradient (DDP pays that read only with
    ``find_unused_parameters=True``).
    """

    def __init__(self, ctx: Context, mode: Mode, buckets: tuple[Bucket, ...]) -> None:
        self.ctx, self.mode, self.buckets = ctx, mode, buckets
        self.slot_buckets: list[list[int]] = [[] for _ in ctx.fm.layout.slots]
        for b in buckets:
            for i in b.slots:
                self.slot_buckets[i].append(b.index)
        self.sync = True
        """False inside ``no_sync()``: gradients accumulate locally."""
        self.averaged = False
        """Whether the gradients are the mean since the last backward."""
        self.works: list[dist.Work] = []
        self.stats = CommStats(buckets=sum(b.trainable > 0 for b in buckets))
        # The mask's own all-reduce, for modes whose buckets cannot carry it: persistent,
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
                s = ctx.fm.layout.slots[i]
                if s.requires_grad and ctx.params[i].grad is None:
                    grad[s.offset : s.end].zero_()
        if ctx.world_size > 1:
            view = grad[bucket.start : bucket.end]
            if ctx.divide_first:
                view.mul_(1.0 / ctx.world_size)  # DDP's: times the reciprocal, not a division
            self.works.append(self.mode.launch(ctx, bucket, view))
            self.stats.bytes_reduced += view.numel() * view.element_size()
        self.launched_in_backward += in_backward

    def finish(self) -> None:
        """Launch what backward did not, wait for everything, make the gradient the mean."""
        ctx = self.ctx
        while self.next < len(self.buckets):
            self._launch(self.buckets[self.next], in_backward=False)
            self.next += 1
        used = [ctx.params[i].grad is not None for i in ctx.trainable]
        everywhere = all(used)  # then the global mask is all ones: nothing to read back
        if ctx.world_size > 1:
            # Which parameters have a gradient anywhere: in a bucket already, or in one
            # small all-reduce, always issued last so the order is the same on every rank.
            mask = self.mode.sent_mask()
            if mask is None:
                mask = self._mask
                if everywhere:
                    mask.fill_(1)
                else:
                    mask.copy_(torch.tensor(used, dtype=mask.dtype))
                self.works.append(dist.all_reduce(mask, group=ctx.group, async_op=True))
            t0 = time.perf_counter()
            for work in self.works:
                work.wait()  # on NCCL: the current stream waits, the host does not
            self.stats.wait_seconds += time.perf_counter() - t0
            if not everywhere:
                used = [bool(n) for n in mask.tolist()]
        self.mode.finish(ctx)
        globally_used = dict(zip(ctx.trainable, used))
        for i in ctx.trainable:
            p = ctx.params[i]
            if globally_used[i] and p.grad is None:
                s = ctx.fm.layout.slots[i]
                p.grad = ctx.grad[s.offset : s.end].view(s.shape)
        self.mode.attach_grads(ctx, globally_used)
        self.works.clear()
        self.stats.steps += 1
        self.stats.launched_during_backward = self.launched_in_backward
        self.averaged = True
        self._reset_step()

    def close(self) -> None:
        self.ctx.fm._set_grad_listener(None)
        for work in self.works:
            work.wait()
        self.works.clear()
