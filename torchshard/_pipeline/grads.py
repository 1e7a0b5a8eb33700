"""The end of a pipeline's gradient: tied weights summed across stages, and one global
norm over every stage and replica, counted once per element."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._flat.module import FlatParamModule
from .._parallel.trainer import grad_pieces

if TYPE_CHECKING:
    from .runner import Pipeline, StageHandle

__all__ = ["global_norm_", "tie_grads", "tie_weights"]


@torch.no_grad()
def tie_grads(pipe: Pipeline) -> None:
    """A weight tied across stages gets the sum of its owner's and its replica's gradient
    on both, over the tie group (the two stages' ranks of one data-parallel index; two
    operands, so both get the same bits). Replicated stages sum the data-parallel means
    (after the reduction); sharded ones sum the local gradients before it (their slices
    of the slot differ), which the reduction then averages."""
    for tie, group in zip(pipe.plan.ties, pipe._tie_groups):
        if group is None:
            continue
        h = next(h for h in pipe.stages if h.index in (tie.owner, tie.holder))
        name = tie.name if h.index == tie.owner else tie.alias
        p = h.fm.module.get_parameter(name)
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            continue
        got = torch.zeros_like(p)  # unused on this stage: zeros, and the other stage's sum
        dist.all_reduce(got, group=group)
        if got.any():  # used on the other: take the gradient into the flat view
            p.grad = _grad_view(h.fm, name).copy_(got)


@torch.no_grad()
def tie_weights(pipe: Pipeline) -> None:
    """After a sharded step: the replica takes the owner's updated weight (the owner's and
    the holder's reductions may round differently; the owner's bits are the weight)."""
    grid = pipe._grid
    for tie, group in zip(pipe.plan.ties, pipe._tie_groups):
        if group is None:
            continue
        h = next(h for h in pipe.stages if h.index in (tie.owner, tie.holder))
        p = h.fm.module.get_parameter(tie.name if h.index == tie.owner else tie.alias)
        dist.broadcast(p.data, grid.ranks[tie.owner % grid.pp][grid.dp_rank], group=group)


def _grad_view(fm: FlatParamModule, name: str) -> torch.Tensor:
    layout, flat_grad = fm.layout, fm.flat_grad
    assert flat_grad is not None
    slot = next(i for i, s in enumerate(layout.slots) if name in s.names)
    grad_slot = dict(zip(layout.trainable, layout.grad_layout.slots))[slot]
    return grad_slot.view(flat_grad)


@torch.no_grad()
def global_norm_(pipe: Pipeline, max_norm: float, norm_type: float) -> torch.Tensor:
    """Scale every rank's gradient to one total ``norm_type`` norm of at most ``max_norm``;
    the norm before. Each rank adds the power of the elements it counts (sharded: its slice;
    replicated: data-parallel rank 0 counts the stage; replicas: never), the ranks gather the
    scalars and each sums them in rank order: the same bits everywhere."""
    inf = norm_type == float("inf")
    flat = [g for h in pipe.stages for _, g in grad_pieces(h.trainer)]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in flat) else torch.float32
    power = torch.zeros((), dtype=dtype, device=pipe.stages[0].trainer.device)
    for h in pipe.stages:
        for g in _counted(pipe, h):
            n = torch.linalg.vector_norm(g, norm_type, dtype=dtype)
            power = torch.maximum(power, n) if inf else power + n**norm_type
    world = dist.get_world_size(pipe._world)
    parts = [torch.empty_like(power) for _ in range(world)]
    dist.all_gather(parts, power, group=pipe._world)
    total = torch.zeros_like(power)
    for part in parts:  # rank order, on every rank
        total = torch.maximum(total, part) if inf else total + part
    if not inf:
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in flat:
        g.mul_(coef.to(g.dtype))
    return total


def _counted(pipe: Pipeline, h: StageHandle) -> list[torch.Tensor]:
    """The gradients this rank counts for stage ``h``: the pieces it updates (sharded: its
    slice; replicated: the whole stage, on data-parallel rank 0 only), but never a replica
    of a weight another stage owns."""
    if not h.trainer.shard and pipe.dp_rank:
        return []
    skip = set(pipe.plan.replicas[h.index])
    slots = h.fm.layout.slots
    return [g for i, g in grad_pieces(h.trainer) if not skip & set(slots[i].names)]
