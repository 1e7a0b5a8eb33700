"""PowerSGD over replicated buckets: low-rank compression with error feedback (Vogels et
al., NeurIPS 2019; torch's ``powerSGD_hook``), on views of the one flat gradient.

Per bucket, each compressible matrix parameter (``shape[0] x rest``), with this rank's
error ``e`` and gradient ``g``: ``M = g + e`` (in the error buffer, in place); ``P = M Q``;
all-reduce ``P`` (with the bucket's dense parts, pre-divided, in the same buffer);
orthogonalize ``P``; ``Q = M^T P``; all-reduce ``Q`` and divide by the world size; the mean
is ``M^ = P Q^T``, written into the gradient; ``e = M - M^``. Everything the ranks hold
alike (``P`` after its all-reduce, ``Q``) depends on their inputs only through their sum,
so the mean error resumes the run at any world size. ``Q`` is one flat buffer by slot,
drawn once from a fixed seed (the same on every rank) and warm-started from step to step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from .buckets import Bucket
from .comm import BucketComm, ReduceSpec, settled
from .feedback import ErrorFeedback, done

__all__ = ["PowerSGDComm", "compressed_shape", "orthogonalize"]

SEED = 0
"""The seed of the first ``Q`` (a CPU generator: the same draw on every rank and device)."""


def compressed_shape(shape: tuple[int, ...], rank: int, min_compression: float) -> tuple[int, ...]:
    """``(n, m, r)`` when a parameter of ``shape`` is compressed (a matrix view ``n x m``
    whose ``n * m`` exceeds ``min_compression`` times ``(n + m) * r``, ``r = min(rank, n,
    m)``); ``()`` when it travels densely (vectors, scalars, and matrices too small).

    Example::

        compressed_shape((384, 128), 4, 2.0)   # (384, 128, 4)
        compressed_shape((128,), 4, 2.0)       # ()
    """
    if len(shape) < 2:
        return ()
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    r = min(rank, n, m)
    return (n, m, r) if n * m > min_compression * (n + m) * r else ()


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormalize the columns of ``p`` (``n x r``) in place by Gram-Schmidt, as torch's
    hook; a zero column stays zero (no NaN when a gradient vanishes).

    Example::

        p = orthogonalize(torch.randn(10, 2, dtype=torch.float64))
        torch.allclose(p.T @ p, torch.eye(2, dtype=torch.float64))   # True
    """
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(torch.linalg.vector_norm(col).clamp_min(tiny))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(torch.sum(col * rest, dim=0, keepdim=True) * col)
    return p


def _first_q(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The first ``Q`` buffer: ``numel`` normal draws from :data:`SEED` on a CPU generator."""
    draw = torch.Generator().manual_seed(SEED)
    return torch.randn(numel, generator=draw, dtype=dtype).to(device)


@dataclass(frozen=True)
class _Matrix:
    """One compressed parameter of a bucket: at ``at`` of the bucket's view, ``n x m``,
    rank ``r``; its ``Q`` at ``q`` of the ``Q`` buffer, its ``P`` at ``p`` of the pack."""

    at: int
    n: int
    m: int
    r: int
    q: int
    p: int


@dataclass(frozen=True)
class _Plan:
    """A bucket's matrices, its dense ranges (of its view) and its range of ``Q``."""

    matrices: tuple[_Matrix, ...]
    dense: tuple[tuple[int, int], ...]
    p_numel: int
    dense_numel: int
    q: tuple[int, int]


class PowerSGDComm(ErrorFeedback):
    """The bucket comm of :class:`torchshard.comm.PowerSGD` (replicated buckets, which hold
    whole parameters). ``dense``: the comm of the steps before ``start_step``.

    Two all-reduces per bucket on the trainer's group, issued from the launching thread in
    one order on every rank: the launch of bucket ``k`` issues ``k``'s ``P``, then ``Q`` of
    bucket ``k - 1`` (waiting for its ``P``); :meth:`flush` issues the last ``Q``, waits for
    all, and decompresses.

    Example::

        comm = PowerSGDComm(ctx, buckets, AllReduce(ctx.mesh), rank=4, start_step=10)
    """

    def __init__(
        self,
        ctx: Any,
        buckets: tuple[Bucket, ...],
        dense: BucketComm,
        rank: int,
        start_step: int,
        min_compression: float = 2.0,
    ) -> None:
        super().__init__(ctx, dense, start_step)
        layout = ctx.fm.layout
        in_grad = dict(zip(layout.trainable, layout.grad_layout.slots))
        shapes = {i: compressed_shape(g.shape, rank, min_compression) for i, g in in_grad.items()}
        q_of, q_at = {}, 0  # each compressed slot's Q, in layout order
        for i, nmr in shapes.items():
            if nmr:
                q_of[i], q_at = q_at, q_at + nmr[1] * nmr[2]
        self.plans: dict[int, _Plan] = {}
        for b in buckets:
            mats, ranges, p_at = [], [], 0
            for i in (i for i in b.slots if i in in_grad):
                g = in_grad[i]
                if not (b.start <= g.offset and g.offset + g.numel <= b.end):
                    raise AssertionError(f"bucket {b.index} cuts parameter {g.name!r}")
                at = g.offset - b.start
                if not shapes[i]:
                    ranges.append((at, at + g.numel))
                    continue
                n, m, r = shapes[i]
                mats.append(_Matrix(at, n, m, r, q_of[i], p_at))
                p_at += n * r
            d = sum(y - x for x, y in ranges)
            # a bucket's slots are consecutive in layout order: so are their Qs
            q0 = min((x.q for x in mats), default=0)
            q1 = max((x.q + x.m * x.r for x in mats), default=0)
            self.plans[b.index] = _Plan(tuple(mats), tuple(ranges), p_at, d, (q0, q1))
        self.q = _first_q(q_at, ctx.grad.dtype, ctx.device)
        """Every compressed parameter's ``Q`` (``m x r``, row-major), by slot."""
        # P all-reduced, not Q yet: (work, pack, view, error, plan, spec); then Q's
        self._p: list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, _Plan, ReduceSpec]] = []
        self._q: list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, _Plan, ReduceSpec]] = []

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {"powersgd_q": self.q}

    def overflowed(self) -> None:
        """The error and ``Q`` took in a skipped step's inf or NaN: both start over (``Q``
        from its first draw, the same on every rank)."""
        super().overflowed()
        self.q.copy_(_first_q(self.q.numel(), self.q.dtype, self.q.device))

    @torch.no_grad()
    def launch(self, view: torch.Tensor, spec: ReduceSpec, bucket: Bucket) -> Future[torch.Tensor]:
        """Dense before ``start_step``; else ``M = g + e``, ``P = M Q``, and the all-reduce of
        ``P`` and the dense parts (the second stage of the bucket before it follows)."""
        if (dense := self.launch_dense(view, spec, bucket)) is not None:
            return dense
        alone = self.mesh.size == 1
        plan = self.plans[bucket.index]
        error = self.error[bucket.start : bucket.end]
        pack = torch.empty(plan.p_numel + plan.dense_numel, dtype=view.dtype, device=view.device)
        for x in plan.matrices:
            m = error[x.at : x.at + x.n * x.m]
            m.add_(view[x.at : x.at + x.n * x.m])  # M = g + e, kept where e was
            q = self.q[x.q : x.q + x.m * x.r].view(x.m, x.r)
            torch.matmul(m.view(x.n, x.m), q, out=pack[x.p : x.p + x.n * x.r].view(x.n, x.r))
        k = plan.p_numel
        for a, b in plan.dense:
            pack[k : k + b - a].copy_(view[a:b])
            k += b - a
        spec.scale_before(pack[plan.p_numel :])  # as the dense all-reduce: the mean
        work = None
        if not alone:
            work = dist.all_reduce(pack, op=spec.op, group=self.mesh.group, async_op=True)
            self.payload_bytes += pack.numel() * pack.element_size()
        self._p.append((work, pack, view, error, plan, spec))
        while len(self._p) > 1:
            self._second(*self._p.pop(0))
        return done(view) if work is None else settled(work, view)

    def _second(
        self,
        work: Any,
        pack: torch.Tensor,
        view: torch.Tensor,
        error: torch.Tensor,
        plan: _Plan,
        spec: ReduceSpec,
    ) -> None:
        """The dense parts land; ``P`` orthogonalized; ``Q = M^T P``; Q's all-reduce."""
        if work is not None:
            work.wait()
        k = plan.p_numel
        for a, b in plan.dense:
            view[a:b].copy_(pack[k : k + b - a])
            k += b - a
        for x in plan.matrices:
            p = orthogonalize(pack[x.p : x.p + x.n * x.r].view(x.n, x.r))
            m = error[x.at : x.at + x.n * x.m].view(x.n, x.m)
            torch.matmul(m.T, p, out=self.q[x.q : x.q + x.m * x.r].view(x.m, x.r))
        q = self.q[plan.q[0] : plan.q[1]]
        work = None
        if q.numel() and self.mesh.size > 1:
            work = dist.all_reduce(q, op=spec.op, group=self.mesh.group, async_op=True)
            self.payload_bytes += q.numel() * q.element_size()
        self._q.append((work, pack, view, error, plan, spec))

    @torch.no_grad()
    def flush(self) -> int:
        """Issue the last ``Q``, wait for all; ``M^ = P Q^T`` into the gradient, ``e = M -
        M^``. 0: no bytes cross replicas."""
        if (sent := self.flush_dense()) is not None:
            return sent
        while self._p:
            self._second(*self._p.pop(0))
        for work, pack, view, error, plan, spec in self._q:
            if work is not None:
                work.wait()
                if spec.op == dist.ReduceOp.SUM:  # else the backend's average
                    self.q[plan.q[0] : plan.q[1]].div_(self.mesh.size)
            for x in plan.matrices:
                p = pack[x.p : x.p + x.n * x.r].view(x.n, x.r)
                q = self.q[x.q : x.q + x.m * x.r].view(x.m, x.r)
                mean = view[x.at : x.at + x.n * x.m]
                torch.matmul(p, q.T, out=mean.view(x.n, x.m))
                error[x.at : x.at + x.n * x.m].sub_(mean)  # e = M - M^
        self._q.clear()
        self.steps += 1
        return 0
