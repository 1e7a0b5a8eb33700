"""Tensor-parallel forwards: Megatron's mappings as autograd functions over the tp group,
and the forward each plan style gives its module (no DTensor: plain local tensors).

``f`` (:class:`_Copy`) is the identity forward and an all-reduce of the input gradient
backward (before a column-split layer); ``g`` (:class:`_Reduce`) all-reduces forward and is
the identity backward (after a row-split layer); :class:`_Gather` all-gathers the last
dimension forward and takes this rank's slice backward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["install_forward"]


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        n = dist.get_world_size(group)
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(out, x, group=group)
        return torch.cat(out, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def _colwise(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(_Copy.apply(x, self._tp_group), self.weight, self.bias)


def _gather_output(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(_colwise(self, x), self._tp_group)


def _rowwise(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = _Reduce.apply(F.linear(x, self.weight), self._tp_group)
    return y if self.bias is None else y + self.bias  # once, after the sum


def _embedding(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    rows = self.weight.shape[0]
    start = self._tp_rank * rows
    foreign = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(foreign, 0)
    pad = self.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + rows else None
    out = F.embedding(local, self.weight, pad, None, 2.0, self.scale_grad_by_freq, False)
    out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
    return _Reduce.apply(out, self._tp_group)


_FORWARDS = {
    "colwise": _colwise,
    "packed_colwise": _colwise,
    "colwise_gather_output": _gather_output,
    "rowwise": _rowwise,
    "embedding_rowwise": _embedding,
}


def install_forward(m: nn.Module, style: str, group: dist.ProcessGroup, rank: int) -> None:
    """Give module ``m`` the forward of ``style`` over ``group`` (``rank``: this rank in it)."""
    m._tp_group, m._tp_rank, m._tp_style = group, rank, style
    m.forward = types.MethodType(_FORWARDS[style], m)
