"""Top-k sparsification with error feedback over replicated buckets (experimental).

Dense (the all-reduce) for the first ``start_step`` synchronized steps; then, per bucket:
``M = g + e`` (in the error buffer, in place); this rank picks the ``k`` entries
of ``M`` largest in magnitude, keeps the rest as its error (``e = M`` with those entries
zeroed), and all-gathers values and indices; every rank sums the ranks' entries in rank
order and divides by the world size. Unlike PowerSGD the result depends on each rank's
input, not only on their sum: resuming with the mean error is an approximation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from .buckets import Bucket
from .comm import BucketComm, ReduceSpec, settled
from .feedback import ErrorFeedback, done

__all__ = ["TopKComm", "topk_count"]


def topk_count(elements: int, ratio: float) -> int:
    """Entries a bucket of ``elements`` sends: ``ceil(ratio * elements)``, at least one.

    Example::

        topk_count(1000, 0.01)   # 10
    """
    return min(elements, max(1, math.ceil(ratio * elements)))


class TopKComm(ErrorFeedback):
    """The bucket comm of :class:`torchshard.comm.TopK`: per bucket, two all-gathers (the
    values, in the gradient's dtype, and their indices in the bucket, int32) issued in
    the launch; the sum lands at :meth:`flush`. Bytes per bucket: ``world * k * (itemsize
    + 4)``, what each rank sends and receives. ``dense``: the comm of the steps before
    ``start_step``.

    Example::

        comm = TopKComm(ctx, buckets, AllReduce(ctx.mesh), ratio=0.01)
    """

    def __init__(
        self,
        ctx: Any,
        buckets: tuple[Bucket, ...],
        dense: BucketComm,
        ratio: float,
        error_feedback: bool = True,
        start_step: int = 0,
    ) -> None:
        super().__init__(ctx, dense, start_step)
        self.error_feedback = error_feedback
        self.k = {b.index: topk_count(b.elements, ratio) for b in buckets}
        big = max((b.elements for b in buckets), default=0) >= 2**31
        self.index_dtype = torch.int64 if big else torch.int32
        # gathered, not summed yet: (works, values, indices, view, k)
        self._gathered: list[tuple[list[Any], torch.Tensor, torch.Tensor, torch.Tensor, int]] = []

    @torch.no_grad()
    def launch(self, view: torch.Tensor, spec: ReduceSpec, bucket: Bucket) -> Future[torch.Tensor]:
        """Dense before ``start_step``; else ``M = g + e``; pick, keep the rest as error;
        all-gather values and indices."""
        if (dense := self.launch_dense(view, spec, bucket)) is not None:
            return dense
        error = self.error[bucket.start : bucket.end]
        error.add_(view)  # M = g + e, kept where e was
        k = self.k[bucket.index]
        picked = torch.topk(error.abs(), k, sorted=False).indices
        values = error[picked]
        if self.error_feedback:
            error.index_fill_(0, picked, 0)  # e = M - what was sent
        else:
            error.zero_()  # what was not sent is dropped
        indices = picked.to(self.index_dtype)
        n = self.mesh.size
        if n == 1:
            self._gathered.append(([], values, indices, view, k))
            return done(view)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        every_value = values.new_empty(n * k)
        every_index = indices.new_empty(n * k)
        works = [
            gather(out, t, group=self.mesh.group, async_op=True)
            for out, t in ((every_value, values), (every_index, indices))
        ]
        self.payload_bytes += n * k * (values.element_size() + indices.element_size())
        self._gathered.append((works, every_value, every_index, view, k))
        return settled(works[-1], view)

    @torch.no_grad()
    def flush(self) -> int:
        """Wait for the gathers; each bucket's gradient is the ranks' entries summed in rank
        order, divided by the world size (before ``start_step``: the dense comm's flush).
        0: no bytes cross replicas."""
        if (sent := self.flush_dense()) is not None:
            return sent
        n = self.mesh.size
        for works, values, indices, view, k in self._gathered:
            for work in works:
                work.wait()
            view.zero_()
            for r in range(n):  # one rank at a time: no index twice, a fixed order
                view.index_add_(0, indices[r * k : (r + 1) * k], values[r * k : (r + 1) * k])
            if n > 1:
                view.div_(n)
        self._gathered.clear()
        self.steps += 1
        return 0
