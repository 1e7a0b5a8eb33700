"""One-process oracles of the comm choices (``torchshard.comm``), and the small model their
tests train: each rank's local gradient is taken inside ``no_sync()`` (nothing travels),
gathered to every rank, and the oracle computes from all of them what the trainer's
``average_gradients()`` must produce, independently of the library's code.

Usage::

    from comm_oracle import Net, batch, local_then_mean

    every, mean = local_then_mean(trainer, model, batch(rank, step))
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchshard import DistributedTrainer, FlatParamModule

__all__ = [
    "Net",
    "PowerSGDOracle",
    "TopKOracle",
    "batch",
    "grad_slots",
    "local_then_mean",
]


class Net(nn.Module):
    """Two matrices PowerSGD compresses at rank 2, one too small to (3 x 24), and vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 24)
        self.c = nn.Linear(24, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


def batch(
    rank: int, step: int, dtype: torch.dtype = torch.float64, rows: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: ``rows`` inputs and targets."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(rows, 16, generator=g, dtype=dtype), torch.randn(
        rows, 3, generator=g, dtype=dtype
    )


def build(
    dtype: torch.dtype = torch.float64, seed: int = 0, frozen: bool = False
) -> FlatParamModule:
    """The test model, wrapped; ``frozen``: ``a.weight`` (a compressed matrix) and ``b.bias``
    do not train, so the gradient space is a strict part of the flat buffer."""
    torch.manual_seed(seed)
    net = Net().to(dtype)
    if frozen:
        net.a.weight.requires_grad_(False)
        net.b.bias.requires_grad_(False)
    return FlatParamModule(net)


def loss_of(fm: FlatParamModule, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = xy
    return ((fm(x) - y) ** 2).mean()


def local_then_mean(
    trainer: DistributedTrainer, fm: FlatParamModule, xy: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's local gradient (``world x numel``, by rank) and what the trainer made of
    them (``fm.flat_grad`` after ``average_gradients()``, a copy)."""
    trainer.zero_grad()
    with trainer.no_sync():
        loss_of(fm, xy).backward()
    assert fm.flat_grad is not None
    local = fm.flat_grad.clone()
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    trainer.zero_grad()
    loss_of(fm, xy).backward()
    trainer.average_gradients()
    return torch.stack(every), fm.flat_grad.clone()


def grad_slots(fm: FlatParamModule) -> list[tuple[int, tuple[int, ...]]]:
    """``(offset, shape)`` of each trainable parameter in the gradient space."""
    return [(s.offset, tuple(s.shape)) for s in fm.layout.grad_layout.slots]


def _gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns, written out column by column (not the library's function)."""
    cols: list[torch.Tensor] = []
    for j in range(p.shape[1]):
        v = p[:, j].clone()
        norm = v.norm()
        v = v / norm if norm > 0 else v
        cols.append(v)
        for k in range(j + 1, p.shape[1]):
            p[:, k] = p[:, k] - (v @ p[:, k]) * v
    return torch.stack(cols, dim=1)


class PowerSGDOracle:
    """PowerSGD (Vogels et al.) over every rank's gradients in one process: per matrix
    parameter ``M_w = g_w + e_w``; ``P = sum_w M_w Q``, orthonormalized; ``Q = sum_w M_w^T P
    / N``; ``M^ = P Q^T``; ``e_w = M_w - M^``. Dense parameters: the mean, pre-divided."""

    def __init__(
        self, fm: FlatParamModule, world: int, rank: int, start: int, q: torch.Tensor
    ) -> None:
        self.slots = grad_slots(fm)
        self.world, self.rank, self.start = world, rank, start
        numel = fm.flat_grad.numel()  # type: ignore[union-attr]
        self.error = torch.zeros(world, numel, dtype=fm.flat_grad.dtype)  # type: ignore[union-attr]
        self.q = q.clone()  # the first Q: what the trainer drew (the same on every rank)
        self.steps = 0

    def compressed(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        if len(shape) < 2:
            return None
        n = shape[0]
        m = int(torch.tensor(shape[1:]).prod())
        r = min(self.rank, n, m)
        return (n, m, r) if n * m > 2.0 * (n + m) * r else None

    def step(self, every: torch.Tensor) -> torch.Tensor:
        n_w = self.world
        mean = torch.zeros_like(every[0])
        dense = self.steps < self.start
        q_at = 0
        for at, shape in self.slots:
            numel = int(torch.tensor(shape).prod()) if shape else 1
            nmr = self.compressed(shape)
            if dense or nmr is None:
                for w in range(n_w):
                    mean[at : at + numel] += every[w, at : at + numel] * (1.0 / n_w)
                if nmr is not None:
                    q_at += nmr[1] * nmr[2]
                continue
            n, m, r = nmr
            q = self.q[q_at : q_at + m * r].view(m, r)
            ms = [
                (self.error[w, at : at + numel] + every[w, at : at + numel]).view(n, m)
                for w in range(n_w)
            ]
            p = sum(mw @ q for mw in ms)
            p = _gram_schmidt(p)
            q_new = sum(mw.T @ p for mw in ms) / n_w
            approx = p @ q_new.T
            mean[at : at + numel] = approx.reshape(-1)
            for w in range(n_w):
                self.error[w, at : at + numel] = (ms[w] - approx).reshape(-1)
            self.q[q_at : q_at + m * r] = q_new.reshape(-1)
            q_at += m * r
        self.steps += 1
        return mean


class TopKOracle:
    """Top-k with error feedback over every rank's gradients, bucket by bucket: each rank
    sends its ``k`` largest ``|g + e|``, keeps the rest; the sum in rank order over N. The
    first ``start`` steps: the mean, pre-divided, and no error."""

    def __init__(
        self,
        buckets: list[tuple[int, int, int]],
        world: int,
        numel: int,
        dtype: torch.dtype,
        feedback: bool = True,
        start: int = 0,
    ) -> None:
        self.buckets, self.world, self.feedback = buckets, world, feedback  # (start, end, k)
        self.error = torch.zeros(world, numel, dtype=dtype)
        self.start, self.steps = start, 0

    def step(self, every: torch.Tensor) -> torch.Tensor:
        mean = torch.zeros_like(every[0])
        self.steps += 1
        if self.steps <= self.start:
            for w in range(self.world):
                mean += every[w] * (1.0 / self.world)
            return mean
        for a, b, k in self.buckets:
            out = torch.zeros(b - a, dtype=every.dtype)
            for w in range(self.world):
                m = self.error[w, a:b] + every[w, a:b]
                idx = torch.topk(m.abs(), k, sorted=False).indices
                out.index_add_(0, idx, m[idx])
                m[idx] = 0
                self.error[w, a:b] = m if self.feedback else 0
            mean[a:b] = out / self.world if self.world > 1 else out
        return mean
