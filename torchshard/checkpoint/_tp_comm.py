"""A lossy comm's state in a tensor-parallel checkpoint (issue 25; the format: ``_comm_meta``).

A split module's comm compresses each tp rank's local gradients over the data-parallel
group (``mesh.dp``): its error feedback is laid out like the local gradient space, and
PowerSGD's ``Q`` holds one ``m x r`` block per local matrix. The files stay the one-process
picture where there is one:

- ``"error"``: the mean over the data-parallel ranks, gathered over the tp group into the
  whole model's gradient space (``fm.tp.whole.grad_layout``), as the weights are: the file is
  what a TP=1 save of the same run would hold, and a load at any degree takes its pieces.
- ``"powersgd_q"``: no such picture (a split matrix's ``Q`` is of its piece, not of the whole
  matrix): the tp ranks' ``Q`` one after another, in tp-rank order (the same on every
  data-parallel rank). A load at the degree it was saved at (``metadata.json``'s ``"tp"``;
  the plan is checked alike) takes its rank's block; at another degree the trainer keeps
  its own ``Q`` (a fresh one in a new trainer) and says so: the error and the step count
  still load. PowerSGD warm-starts ``Q`` and recovers in a few steps.

Each rank writes its equal part (``comm_ranges``) of each flat tensor at the mesh's world
size, as a plain save does at its world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._comm_meta import ERROR, comm_json, comm_ranges
from ._metadata import Metadata, Readers
from ._plan import overlap
from ._target import Target

__all__ = ["saved_tp", "tp_numel", "tp_read", "tp_snapshot"]


def saved_tp(meta: Metadata) -> int:
    """The tensor-parallel degree a checkpoint was saved at (1: none recorded)."""
    section = meta.raw.get("tp")
    return section.get("tp", 1) if isinstance(section, dict) else 1


def _degree(t: Target) -> int:
    return t.tp.size if t.tp is not None else 1


def tp_numel(t: Target, name: str, live: torch.Tensor) -> int:
    """How many elements a save of this trainer at its degree stores for flat tensor ``name``
    (``live``: this rank's): the whole gradient space for the error, the tp ranks' blocks
    one after another for the others."""
    tp = t.tp
    if tp is None:
        return live.numel()
    return tp.whole.grad_layout.numel if name == ERROR else live.numel() * tp.size


@torch.no_grad()
def tp_snapshot(
    t: Target, cls: str, settings: dict[str, Any], state: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], tuple[tuple[str, torch.Tensor], ...]]:
    """The ``"comm"`` section and this mesh rank's part of each flat tensor (host copies) of
    a split module's save: collectives over the data-parallel group (the error's mean) and
    over the tp group (its pieces, each ``Q``); every rank calls it alike."""
    tp, mesh = t.tp, t.trainer.mesh  # type: ignore[union-attr]
    assert tp is not None
    g, world = mesh.rank, mesh.world_size
    flat = {n: x.detach() for n, x in sorted(state.items()) if x.dim() == 1}
    tensors, shapes = [], {}
    for name, x in flat.items():
        numel = tp_numel(t, name, x)
        shapes[name] = (x.dtype, numel)
        a, b = comm_ranges(numel, world)[g]
        if name == ERROR:
            mean = x.clone()
            if t.world > 1:
                dist.all_reduce(mean, group=t.group)
                mean.div_(t.world)
            part = _whole_error(t, mean, comm_ranges(numel, world))
        else:  # the tp ranks' blocks, in order (alike on every data-parallel rank)
            blocks = [torch.empty_like(x) for _ in range(tp.size)]
            dist.all_gather(blocks, x.contiguous(), group=tp.group)
            part = torch.cat(blocks)[a:b]
        if b > a:
            tensors.append((name, part.to("cpu", copy=True)))
    scalars = {n: int(x.item()) for n, x in sorted(state.items()) if x.dim() == 0}
    return comm_json(cls, settings, scalars, shapes, world), tuple(tensors)


def _whole_error(t: Target, mean: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """This mesh rank's range of the whole gradient space's error, from every tp rank's
    local ``mean``: slot by slot, the tp groups whose ranks write part of a slot gather it
    (a collective inside each such group; the others skip it alike)."""
    tp = t.tp
    assert tp is not None
    g = t.trainer.mesh.rank  # type: ignore[union-attr]
    a, b = ranges[g]
    out = mean.new_zeros(b - a)
    local, whole = t.fm.layout.grad_layout, tp.whole.grad_layout
    for i, ls, ws in zip(t.fm.layout.trainable, local.slots, whole.slots):
        span = (ws.offset, ws.offset + ws.numel)
        needed = {q // tp.size for q, r in enumerate(ranges) if overlap(r, span) is not None}
        if t.rank not in needed:  # no rank of this tp group writes any of it
            continue
        piece = mean[ls.offset : ls.offset + ls.numel].view(ls.shape)
        full = tp.gather(i, piece).reshape(-1)
        ov = overlap((a, b), span)
        if ov is not None:
            out[ov[0] - a : ov[1] - a].copy_(full[ov[0] - span[0] : ov[1] - span[0]])
    return out


def _read_whole(
    meta: Metadata, readers: Readers, name: str, start: int, end: int, dst: torch.Tensor
) -> None:
    """Flat ``[start, end)`` of the saved tensor ``name`` into host tensor ``dst``."""
    assert meta.comm is not None
    dtype, _ = meta.comm.flat[name]
    held = {file: ranges[name] for file, ranges in meta.comm.files if name in ranges}
    for file, x, y, at in meta.comm.pieces(name, start, end):
        readers.entry(file, name, dtype, (held[file][1] - held[file][0],))
        readers[file].read_into(name, x, y, dst[at : at + y - x])


def tp_read(
    meta: Metadata, readers: Readers, t: Target, name: str, live: torch.Tensor
) -> torch.Tensor:
    """This tp rank's ``live``-sized host tensor ``name``, complete: of the error, its local
    pieces of each whole slot (a replicated or dim-0 split slot: its rows; another split:
    the whole slot read, its piece taken); of the others, its rank's block."""
    tp = t.tp
    assert tp is not None and meta.comm is not None
    dtype, _ = meta.comm.flat[name]
    host = torch.zeros(live.numel(), dtype=dtype)
    if name != ERROR:
        n = live.numel()
        _read_whole(meta, readers, name, tp.rank * n, (tp.rank + 1) * n, host)
        return host
    local, whole = t.fm.layout.grad_layout, tp.whole.grad_layout
    for i, ls, ws in zip(t.fm.layout.trainable, local.slots, whole.slots):
        dst, split = host[ls.offset : ls.offset + ls.numel], tp.splits[i]
        if split is None or split.dim == 0:
            row, at = ws.numel // ws.shape[0] if ws.shape else 1, 0
            rows = [(0, ws.shape[0] if ws.shape else 1)] if split is None else None
            for r0, r1 in rows or split.pieces(ws.shape[0], tp.rank, tp.size):
                n = (r1 - r0) * row
                _read_whole(
                    meta,
                    readers,
                    name,
                    ws.offset + r0 * row,
                    ws.offset + r1 * row,
                    dst[at : at + n],
                )
                at += n
            continue
        full = torch.empty(ws.numel, dtype=dtype)
        _read_whole(meta, readers, name, ws.offset, ws.offset + ws.numel, full)
        dst.copy_(tp.take(i, full.view(ws.shape)).reshape(-1))
    return host
