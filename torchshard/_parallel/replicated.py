"""Replicated mode (DDP's): every bucket all-reduced, every rank updates every parameter."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buckets import Bucket
from .mode import Context, Mode

__all__ = ["Replicated"]


class Replicated(Mode):
    """All-reduce each bucket; the used-parameter mask rides in the last bucket launched."""

    divides_first = True  # as DDP: each bucket times 1/world as it launches, bitwise DDP's

    def __init__(self) -> None:
        self._store: torch.Tensor | None = None  # [used mask | padded | flat gradient]
        self._mask: torch.Tensor | None = None
        self._sent = False

    def mask_elements(self, n_trainable: int, world_size: int, align: int) -> int:
        return 0 if world_size == 1 else -(-n_trainable // align) * align

    def bind(self, store: torch.Tensor, k: int, n_trainable: int) -> None:
        if k:
            self._store, self._mask = store, store[:n_trainable]

    def fingerprint(self) -> str:
        return "m" if self._store is not None else "-"

    def launch(self, ctx: Context, bucket: Bucket, view: torch.Tensor) -> dist.Work:
        if self._store is not None and bucket.start == 0:
            # Buckets launch in order and the one at 0 is the last: every parameter that
            # gets a gradient this step has it now, so the mask is final.
            assert self._mask is not None
            used = [ctx.params[i].grad is not None for i in ctx.trainable]
            if all(used):  # always so when launched inside backward: a kernel, no host sync
                self._mask.fill_(1)
            else:  # from average_gradients(), which reads the mask back anyway
                self._mask.copy_(torch.tensor(used, dtype=self._mask.dtype))
            # Reduced with the bucket's op: with AVG each entry is a fraction, not a count;
            # only "nonzero" (some rank used it) is ever read.
            view = self._store[: self._store.numel() - ctx.grad.numel() + bucket.end]
            self._sent = True
        op = ctx.mean_op or dist.ReduceOp.SUM
        return dist.all_reduce(view, op=op, group=ctx.group, async_op=True)

    def sent_mask(self) -> torch.Tensor | None:
        mask, self._sent = (self._mask if self._sent else None), False
        return mask

    def finish(self, ctx: Context) -> None:
        if ctx.divides_after:
            ctx.grad.div_(ctx.world_size)
