"""Tensor-parallel checkpoints, the save: the files stay the one-process (TP=1) picture.

A module split over ``tp`` ranks (``fm.tp``) lays out its local pieces; its checkpoint is
written as a save of the whole layout (``fm.tp.whole``) at ``dp x tp`` ranks: rank ``g`` of
the mesh writes run ``g`` of whole named tensors and range ``g`` of the whole layout's flat
optimizer state (``_plan``), so ``consolidate``, ``reshard``, ``inspect`` and a TP=1 load read
it as any other. ``metadata.json`` adds ``"tp"``: the degree, the plan, each split slot's
split (``fm.tp.to_json()``). The load is ``_tp_load``.

The save goes slot by slot, every rank alike (collectives), to the rank that writes it (for
a slot whose optimizer state two files share, to each): the local slot is assembled on the
writer's data-parallel rank (from the local shards' stripes, when the trainer shards them;
else every rank holds it), then the writer's tp group gathers the pieces to the writer. Each
element crosses the network about once per tensor (the weights, each optimizer state; a
shared slot once per writer); a writer holds one whole slot per tensor transiently, besides
its share of the files (about 1 / (dp x tp) of them). It is
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
from ._comm_meta import with_comm
from ._comm_state import snapshot_comm
from ._format import build_metadata, commit, prepare, rotate, step_dir, tmp_dir
from ._optim import OptimizerView
from ._plan import SharePlan, overlap, state_ranges, stored_parts, trainable_only, weight_runs
from ._share import Share
from ._streams import Stream
from ._target import Target

__all__ = ["local_state", "local_weights", "save_tp"]


def _mesh(t: Target) -> Any:
    mesh = getattr(t.trainer, "mesh", None)
    if mesh is None or t.trainer is None:
        raise CheckpointError(
            "trainer: a tensor-parallel FlatParamModule is saved and loaded through its "
            "DistributedTrainer(fm, mesh=mesh), which knows the ranks holding its pieces"
        )
    return mesh


def _on_dp_rank(t: Target, d: int, a: int, b: int, dtype: torch.dtype, fill: Any) -> Any:
    """Local flat ``[a, b)`` on data-parallel rank ``d`` (``None`` on the others), assembled
    from every rank's stripes by ``fill(dest, out)`` (a collective over the dp group)."""
    dest = [(a, a)] * d + [(a, b)] + [(b, b)] * (t.world - 1 - d)
    out = torch.empty(b - a if t.rank == d else 0, dtype=dtype)
    fill(dest, out)
    return out.to(t.device) if t.rank == d else None


def local_weights(t: Target, i: int, d: int) -> torch.Tensor | None:
    """Local slot ``i``'s weights (shaped) on data-parallel rank ``d``; where every rank holds
    them (a flat buffer), on every rank; else ``None``."""
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

    got = _on_dp_rank(t, d, slot.offset, slot.end, slot.torch_dtype, fill)
    return None if got is None else got.view(slot.shape)


def local_state(
    t: Target, view: OptimizerView, stream: Stream, i: int, d: int
) -> torch.Tensor | None:
    """:func:`local_weights` for the optimizer's state of ``stream`` (zeros where it holds
    none)."""
    slot = t.fm.layout.slots[i]
    if t.owns_state(view.optimizer):  # the trainer's sharding optimizer: its stripes
        assert t.stripes is not None
        parts = [(s.start, s.end, view.source(s, stream)) for s in view.segments]
        stripes = t.stripes

        def fill(dest: list[tuple[int, int]], out: torch.Tensor) -> None:
            stripes.assemble(dest, out, parts)

        got = _on_dp_rank(t, d, slot.offset, slot.end, stream.dtype, fill)
        return None if got is None else got.view(slot.shape)
    seg = next((s for s in view.segments if s.slot == i), None)
    src = view.source(seg, stream) if seg is not None else None
    if src is None:
        return torch.zeros(slot.shape, dtype=stream.dtype, device=t.device)
    return src.view(slot.shape)


def _to_writer(
    t: Target, tp: TensorParallel, i: int, w: int, local: Callable[[int], torch.Tensor | None]
) -> torch.Tensor | None:
    """Whole slot ``i`` on global rank ``w`` (``None`` elsewhere): ``local(d)`` assembles the
    local slot on dp rank ``d`` (the writer's; a collective over the dp group, which the dp
    groups of every tp rank holding a piece run), then the writer's tp group gathers it."""
    size, split = tp.size, tp.splits[i]
    d, r = divmod(w, size)  # the writer's dp and tp coordinates (tp innermost: mesh_ranks)
    if split is None and tp.rank != r:
        return None  # the writer's own dp group holds all of it
    piece = local(d)
    if t.rank != d:
        return None
    assert piece is not None
    if split is None:
        return piece
    piece, me = piece.contiguous(), d * size + tp.rank
    got = [torch.empty_like(piece) for _ in range(size)] if me == w else None
    dist.gather(piece, got, dst=w, group=tp.group)
    if got is None:
        return None
    full = piece.new_empty(tp.whole_shape(i))
    for q, x in enumerate(got):
        split.put(full, x, q, size)
    return full


def _collect(
    t: Target, tp: TensorParallel, g: int, world: int, optimizer: Any, frozen: bool
) -> tuple[Share, dict[str, Any] | None]:
    """Rank ``g``'s share of the files of the whole layout at ``world`` ranks, and (rank 0)
    the optimizer section of the metadata."""
    whole = tp.whole
    view = OptimizerView.of(optimizer, t) if optimizer is not None else None
    scalars = view.agree(t) if view is not None else ({}, "")  # over the dp group
    runs = weight_runs(whole, world)
    lo, hi = runs[g]
    span = (whole.slots[lo].offset, whole.slots[hi - 1].end) if hi > lo else (0, 0)
    ranges = state_ranges(whole, world) if view is not None and view.streams else []
    s0, e0 = ranges[g] if ranges else (0, 0)
    share = Share(Path(), 0, SharePlan(g, world, (lo, hi), span, (s0, e0), ()))
    stored = stored_parts(whole, s0, e0) if e0 > s0 else []
    streams = view.streams if view is not None else []
    n = sum(b - a for a, b, _ in stored)
    hosts = [torch.zeros(n, dtype=s.dtype) for s in streams]
    sparse = trainable_only(whole)
    for i, slot in enumerate(whole.slots):  # every rank, every slot, alike: collectives
        if frozen or slot.requires_grad:
            w = next(q for q, (a, b) in enumerate(runs) if a <= i < b)
            full = _to_writer(t, tp, i, w, lambda d, i=i: local_weights(t, i, d))
            if full is not None:
                share.weights.append((slot.name, full.detach().to("cpu", copy=True)))
        if view is None or (sparse and not slot.requires_grad):
            continue  # no rank's file stores state of it
        span = (slot.offset, slot.end)
        writers = [q for q, r in enumerate(ranges) if overlap(r, span) is not None]
        for stream, host in zip(streams, hosts):
            for w in writers:
                full = _to_writer(
                    t, tp, i, w, lambda d, i=i, s=stream: local_state(t, view, s, i, d)
                )
                if full is None:
                    continue
                flat = full.reshape(-1)
                for a, b, at in stored:
                    ov = overlap((a, b), span)
                    if ov is not None:
                        x, y = ov
                        host[at + x - a : at + y - a].copy_(flat[x - slot.offset : y - slot.offset])
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
            "checkpointed yet; cast the model to one dtype (bfloat16 weights keep a float32 "
            "master with master_dtype=torch.float32), or train it at tp=1"
        )
    g, world = mesh.rank, mesh.world_size
    share, optim_meta = _collect(t, tp, g, world, optimizer, frozen)
    comm = snapshot_comm(t)  # a lossy comm's state, in the whole picture: _tp_comm
    share.comm = list(comm.tensors)
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
        meta = with_comm(meta, comm.section)
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
