"""Tensor-parallel checkpoints, the save: the files stay the one-process (TP=1) picture.

A module split over ``tp`` ranks (``fm.tp``) lays out its local pieces; its checkpoint is
written as a save of the whole layout (``fm.tp.whole``) at ``dp x tp`` ranks: rank ``g`` of
the mesh writes run ``g`` of whole named tensors and range ``g`` of the whole layout's flat
optimizer state (``_plan``), so ``consolidate``, ``reshard``, ``inspect`` and a TP=1 load read
it as any other. ``metadata.json`` adds ``"tp"``: the degree, the plan, each split slot's
split (``fm.tp.to_json()``). The load is ``_tp_load``.

The save goes slot by slot, every rank alike (collectives): the local slot is assembled on
every data-parallel rank (from the local shards' stripes, when the trainer shards them), the
tp group all-gathers its pieces into the whole slot, and each rank keeps what its files hold.
One whole slot per tensor (the weights, each optimizer state) is transient at a time. It is
synchronous (an ``async_save`` of a split module returns a finished future); the ranks meet
by collectives over the mesh's world, not through the store.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._dist import exchange_bytes
from .._errors import CheckpointError
from .._flat.hf import transformers_config
from .._flat.tp import TensorParallel
from ._format import build_metadata, commit, prepare, rotate, step_dir, tmp_dir
from ._optim import OptimizerView
from ._plan import SharePlan, overlap, state_ranges, stored_parts, trainable_only, weight_runs
from ._share import Share
from ._streams import Stream
from ._target import Target

__all__ = ["save_tp"]


def _mesh(t: Target) -> Any:
    mesh = getattr(t.trainer, "mesh", None)
    if mesh is None or t.trainer is None:
        raise CheckpointError(
            "trainer: a tensor-parallel FlatParamModule is saved and loaded through its "
            "DistributedTrainer(fm, mesh=mesh), which knows the ranks holding its pieces"
        )
    if mesh.shape[0] > 1:
        raise CheckpointError(
            f"trainer: mesh {mesh.shape}: checkpoints of a tensor-parallel module with "
            "dp_replicate > 1 are not supported yet; use init_mesh(tp=T) (dp_shard only)"
        )
    return mesh


def _dp_whole(t: Target, a: int, b: int, dtype: torch.dtype, fill: Any) -> torch.Tensor:
    """Local flat ``[a, b)`` on every data-parallel rank: assembled on dp rank 0 from every
    rank's stripes (``fill(dest, out)``, a collective), then broadcast over the dp group."""
    dest = [(a, b)] + [(b, b)] * (t.world - 1)
    out = torch.empty(b - a if t.rank == 0 else 0, dtype=dtype)
    fill(dest, out)
    if t.world == 1:
        return out.to(t.device)
    full = out.to(t.device) if t.rank == 0 else torch.empty(b - a, dtype=dtype, device=t.device)
    dist.broadcast(full, src=t.dp.global_rank(0), group=t.group)
    return full


def _local_weights(t: Target, i: int, frozen: bool) -> torch.Tensor:
    """Local slot ``i``'s weights, whole on this rank (shaped)."""
    slot = t.fm.layout.slots[i]
    flat = t.fm.flat_param
    if flat is not None:
        return slot.view(flat.detach())
    stripes, kept = t.stripes, t.frozen
    assert stripes is not None

    def fill(dest: list[tuple[int, int]], out: torch.Tensor) -> None:
        stripes.assemble(dest, out, None)
        if kept is not None:
            kept.assemble(dest, out, None)

    return _dp_whole(t, slot.offset, slot.end, slot.torch_dtype, fill).view(slot.shape)


def _local_state(t: Target, view: OptimizerView, stream: Stream, i: int) -> torch.Tensor:
    """Local slot ``i``'s state of ``stream``, whole on this rank (shaped; zeros where the
    optimizer holds none)."""
    slot = t.fm.layout.slots[i]
    if t.owns_state(view.optimizer):  # the trainer's sharding optimizer: its stripes
        assert t.stripes is not None
        parts = [(s.start, s.end, view.source(s, stream)) for s in view.segments]
        stripes = t.stripes

        def fill(dest: list[tuple[int, int]], out: torch.Tensor) -> None:
            stripes.assemble(dest, out, parts)

        return _dp_whole(t, slot.offset, slot.end, stream.dtype, fill).view(slot.shape)
    seg = next((s for s in view.segments if s.slot == i), None)
    src = view.source(seg, stream) if seg is not None else None
    if src is None:
        return torch.zeros(slot.shape, dtype=stream.dtype, device=t.device)
    return src.view(slot.shape)


def _collect(
    t: Target, tp: TensorParallel, g: int, world: int, optimizer: Any, frozen: bool
) -> tuple[Share, dict[str, Any] | None]:
    """Rank ``g``'s share of the files of the whole layout at ``world`` ranks, and (rank 0)
    the optimizer section of the metadata."""
    whole = tp.whole
    view = OptimizerView.of(optimizer, t) if optimizer is not None else None
    scalars = view.agree(t) if view is not None else ({}, "")  # over the dp group
    lo, hi = weight_runs(whole, world)[g]
    span = (whole.slots[lo].offset, whole.slots[hi - 1].end) if hi > lo else (0, 0)
    s0, e0 = state_ranges(whole, world)[g] if view is not None and view.streams else (0, 0)
    share = Share(Path(), 0, SharePlan(g, world, (lo, hi), span, (s0, e0), ()))
    stored = stored_parts(whole, s0, e0) if e0 > s0 else []
    streams = view.streams if view is not None else []
    n = sum(b - a for a, b, _ in stored)
    hosts = [torch.zeros(n, dtype=s.dtype) for s in streams]
    sparse = trainable_only(whole)
    for i, slot in enumerate(whole.slots):  # every rank, every slot: collectives
        if frozen or slot.requires_grad:
            full = tp.gather(i, _local_weights(t, i, frozen))
            if lo <= i < hi:
                share.weights.append((slot.name, full.detach().to("cpu", copy=True)))
        if view is None or (sparse and not slot.requires_grad):
            continue  # no rank's file stores state of it
        for stream, host in zip(streams, hosts):
            full = tp.gather(i, _local_state(t, view, stream, i)).reshape(-1)
            for a, b, at in stored:
                ov = overlap((a, b), (slot.offset, slot.end))
                if ov is not None:
                    x, y = ov
                    host[at + x - a : at + y - a].copy_(full[x - slot.offset : y - slot.offset])
    share.optim = [(s.name, s.dtype, [h]) for s, h in zip(streams, hosts) if n]
    return share, (view.metadata(scalars) if view is not None and g == 0 else None)


def _agree(mesh: Any, t: Target, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``payload`` (JSON) over the mesh's world; raise on every rank if one
    holds an ``"error"``."""
    replies = [
        json.loads(r) for r in exchange_bytes(json.dumps(payload).encode(), mesh.world, t.device)
    ]
    for r, reply in enumerate(replies):
        if reply.get("error"):
            raise CheckpointError(
                reply["error"] if r == mesh.rank else f"rank {r}: {reply['error']}"
            )
    return replies


def save_tp(
    t: Target,
    root: Path,
    step: int,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    keep_last: int | None,
    frozen: bool,
    write: Callable[[int, int, Share, Path], dict[str, Any]],
) -> concurrent.futures.Future[Path]:
    """Save a split module's checkpoint as its TP=1 picture (see the module docstring);
    ``write(rank, world, share, tmp)`` writes one rank's files and returns their records."""
    tp, mesh = t.tp, _mesh(t)
    assert tp is not None
    if tp.whole.mixed:
        raise CheckpointError(
            "trainer: a tensor-parallel module with parameters of several dtypes cannot be "
            "checkpointed yet; cast the model to one dtype"
        )
    g, world = mesh.rank, mesh.world_size
    share, optim_meta = _collect(t, tp, g, world, optimizer, frozen)
    path, tmp = step_dir(root, step), tmp_dir(root, step)
    if g == 0:
        for name, b in t.buffers().items():
            share.weights.append((name, b.detach().to("cpu", copy=True)))
            share.buffer_bytes += b.numel() * b.element_size()
    error = None
    if g == 0:
        try:
            prepare(root, tmp, path)
        except (CheckpointError, OSError) as e:
            error = f"{path}: {e}"
    _agree(mesh, t, {"error": error})
    try:
        records, error = write(g, world, share, tmp), None
    except (CheckpointError, OSError) as e:
        records, error = {}, f"writing {tmp}: {e}"
    try:
        replies = _agree(mesh, t, {"error": error, "files": records})
    except CheckpointError:
        if g == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if g == 0:
        files = {k: v for reply in replies for k, v in reply["files"].items()}
        buffers = list(t.buffers())
        config = transformers_config(t.fm.module, tp.whole.dtypes[0])
        meta = build_metadata(tp.whole, world, step, buffers, optim_meta, extra, config, frozen)
        meta["tp"] = tp.to_json()
        try:
            commit(tmp, path, meta, files, share.buffer_bytes)
            if keep_last is not None:
                rotate(root, keep_last, keep=path)
        except (CheckpointError, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"committing {path}: {e}"
    _agree(mesh, t, {"error": error})
    done: concurrent.futures.Future[Path] = concurrent.futures.Future()
    done.set_result(path)
    return done
