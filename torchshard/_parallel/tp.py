"""What a trainer does for a tensor-parallel flat module (``fm.tp``), beside its data-parallel
mode: agree with the mesh, start every tp rank alike, count the gradient norm over the tp
group, and check that what the tp ranks replicate stays equal.

The data-parallel mode itself never sees the tp group: each rank's flat module lays out its
own pieces, and the mode runs over ``mesh.dp`` as it always does.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from .._dist import exchange_bytes
from .._errors import MeshError, RankMismatchError, TorchShardError
from .._flat.module import FlatParamModule
from .mode import Mode, Segment
from .seam import Context
from .setup import assert_in_sync

__all__ = ["agree_tp", "check_tp", "clip_tp", "sync_replicated", "tp_in_sync"]


def check_tp(fm: FlatParamModule, mesh: Any) -> None:
    """A mesh with ``tp > 1`` needs a flat module split over that mesh's tp group, and a
    split module needs that mesh."""
    tp = fm.tp
    size = getattr(mesh, "tp_size", 1) if mesh is not None else 1
    if tp is None and size > 1:
        raise MeshError(
            f"mesh: tp={size}, but the FlatParamModule is not split: build it with "
            "FlatParamModule(model, tp_plan=..., mesh=mesh)"
        )
    if tp is not None and (mesh is None or tp.size != size or tp.group is not mesh.tp):
        raise MeshError(
            f"mesh: the FlatParamModule is split over tp={tp.size} ranks; pass the trainer the "
            "same mesh (DistributedTrainer(fm, mesh=mesh)) that the module was built with"
        )


def _root(fm: FlatParamModule) -> int:
    assert fm.tp is not None
    return dist.get_global_rank(fm.tp.group, 0)


@torch.no_grad()
def agree_tp(fm: FlatParamModule, device: torch.device) -> None:
    """The tp ranks check that they split the same model by the same plan (else
    :class:`RankMismatchError` on each of them, before a collective could hang on
    mismatched pieces), then take tp rank 0's random state (CPU, and ``device``'s if CUDA):
    a meta-built model initializes alike on all of them, and dropout outside the split
    layers draws the same masks. Nothing without tensor parallelism."""
    tp = fm.tp
    if tp is None:
        return
    mine = json.dumps([tp.to_json(), fm.layout.to_json()], sort_keys=True).encode()
    digest = hashlib.sha256(mine).hexdigest().encode()
    everyone = exchange_bytes(digest, tp.group, device)
    odd = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if odd:
        raise RankMismatchError(
            f"tensor parallelism: tp ranks {odd} split another model or plan than tp rank 0 "
            "(their layouts or plans differ); build the same model with the same tp_plan "
            "on every rank"
        )
    state = torch.get_rng_state().to(device)  # NCCL serves no CPU tensor
    dist.broadcast(state, _root(fm), group=tp.group)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device).to(device)
        dist.broadcast(cuda, _root(fm), group=tp.group)
        torch.cuda.set_rng_state(cuda.cpu(), device)


@torch.no_grad()
def sync_replicated(fm: FlatParamModule, params: tuple[torch.Tensor, ...], whole: bool) -> None:
    """Tp rank 0's values of every replicated parameter and module buffer, on every tp
    rank (each split parameter is already its own rank's piece). Nothing without tensor
    parallelism, or without ``whole`` weights (a fully sharded mode's stripes: there the
    tp ranks' alike random state made them alike)."""
    tp = fm.tp
    if tp is None or not whole:
        return
    root = _root(fm)
    for split, p in zip(tp.splits, params):
        if split is None and p.numel():
            dist.broadcast(p.data, root, group=tp.group)
    for b in fm.module.buffers():
        dist.broadcast(b, root, group=tp.group)


def _norm_sum(segments: list[Segment], fm: FlatParamModule, p: float) -> torch.Tensor:
    """Sum over this rank's gradient pieces of ``|g|^p``, a replicated piece weighted by
    ``1/T`` (so the sum over the tp group counts it once); the max for ``p = inf``."""
    tp = fm.tp
    assert tp is not None
    terms = []
    for slot, _, _, tensor in segments:
        g = tensor.grad
        if g is None or not g.numel():
            continue
        g = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
        if p == float("inf"):
            terms.append(g.abs().max())
        else:
            term = torch.linalg.vector_norm(g, p).pow(p)
            terms.append(term if tp.splits[slot] is not None else term / tp.size)
    if not terms:
        return torch.zeros((), dtype=torch.float32)
    stacked = torch.stack([t.to(terms[0].dtype) for t in terms])
    return stacked.max() if p == float("inf") else stacked.sum()


@torch.no_grad()
def clip_tp(
    mode: Mode, ctx: Context, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """``trainer.clip_grad_norm_`` for a split module: split pieces summed over the tp group,
    replicated parameters counted once, then over the data-parallel ranks as the mode
    holds its part (the same norm a one-process model would have)."""
    fm = ctx.fm
    assert fm.tp is not None
    p = float(norm_type)
    local = _norm_sum(mode.optimizer_tensors(ctx), fm, p).to(ctx.device)
    op = dist.ReduceOp.MAX if p == float("inf") else dist.ReduceOp.SUM
    dist.all_reduce(local, op=op, group=fm.tp.group)
    if mode.sharded and ctx.mesh.size > 1:
        dist.all_reduce(local, op=op, group=ctx.mesh.group)
        if op == dist.ReduceOp.SUM and ctx.replica_count > 1:
            local /= ctx.replica_count
    total = local if p == float("inf") else local.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise TorchShardError(
            f"the total gradient norm is {total.item()}; set error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in mode.local_grads(ctx):
        grad.mul_(coef.to(grad.dtype))
    return total


def tp_in_sync(fm: FlatParamModule, device: torch.device, params: tuple[torch.Tensor, ...]) -> None:
    """Raise :class:`RankMismatchError` on every tp rank if a replicated parameter or a
    module buffer differs between them (nothing without tensor parallelism)."""
    tp = fm.tp
    if tp is None:
        return
    keep = [i for i, s in enumerate(tp.splits) if s is None]
    assert_in_sync(fm, tp.group, device, tp.size, params, slots=keep, what="tp ranks")
