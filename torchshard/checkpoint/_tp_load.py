"""Tensor-parallel checkpoints, the load: a split module reads its pieces of the whole tensors.

A checkpoint's files are the one-process picture (``_tp_save``; a TP=1 save's alike). A load
at any degree reads, for each slot its rank holds, its local piece from the whole tensors (a
dim-0 split: its rows only; a dim-1 split: an equal block of rows per tp rank, exchanged for
the columns once the ranks agreed), laid out as the TP=1 load lays out what it reads:
``_load._apply`` then runs unchanged. A checkpoint
saved split must have been split alike (:func:`check_plan`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._dist import exchange_bytes
from .._errors import CheckpointError
from .._flat.layout import FlatLayout
from .._flat.tp import TensorParallel
from ._metadata import Metadata, Readers
from ._optim import MASTER, OptimizerView
from ._plan import overlap
from ._reads import (
    Holding,
    Parts,
    live_weights,
    read_buffers,
    read_state,
    weight_reads,
    zero_gaps,
)
from ._streams import Stream
from ._target import Target

__all__ = ["check_plan", "read_pieces", "read_share_tp", "spread_error"]


def check_plan(meta: Metadata, t: Target) -> None:
    """A checkpoint saved split (``"tp"`` in its metadata) loads into a split module only if
    each parameter is split alike (the files are whole: any degree fits)."""
    saved, tp = meta.raw.get("tp"), t.tp
    if saved is None or tp is None:
        return
    splits = saved.get("splits") if isinstance(saved, dict) else None
    if not isinstance(splits, dict) or not isinstance(saved.get("tp"), int):
        raise CheckpointError(
            f"{meta.path}: metadata.json: tp: expected {{'tp': int, 'tp_plan': ..., "
            f"'splits': {{name: [dim, parts]}}}}, got {saved!r}"
        )
    if saved["tp"] == 1:
        return
    mine = {k: v.to_json() for k, v in tp.split_map().items()}

    def said(s: Any) -> str:
        return "replicated" if s is None else f"split along dim {s[0]} in {s[1]} part(s)"

    for slot in tp.whole.slots:
        theirs = splits.get(slot.name)
        if (list(theirs) if theirs is not None else None) != mine.get(slot.name):
            raise CheckpointError(
                f"{meta.path}: parameter {slot.name!r}: the checkpoint's tensor-parallel plan "
                f"has it {said(theirs)}, this module's {said(mine.get(slot.name))}; load with "
                f"the plan it was saved with ({saved.get('tp_plan')})"
            )


def spread_error(t: Target, error: str | None) -> str | None:
    """This rank's error, or one of its tp group's (an exchange over the tp group, which every
    rank of a split module calls): the dp group's agreement after it then reaches every rank."""
    tp = t.tp
    if tp is None:
        return error
    replies = exchange_bytes((error or "").encode(), tp.group, t.device)
    for r, reply in enumerate(replies):
        if reply and error is None:
            return f"tp rank {r} failed to load: {reply.decode()}"
    return error


class _Whole:
    """Ranges of each slot's local piece, read from the whole tensors of a checkpoint. A
    replicated or dim-0 split slot's piece is runs of rows: exactly the elements asked for
    are read. Of another split each tp rank reads an equal block of rows, whole, and once
    every rank has read its share (:meth:`finish`, after the ranks agreed), one all-to-all
    inside the tp group hands each rank its columns of every block: each byte is read once
    across the tp group."""

    def __init__(self, meta: Metadata, readers: Readers, tp: TensorParallel) -> None:
        self.meta, self.readers, self.tp = meta, readers, tp
        self.file = {i: w["file"] for w in meta.weights for i in range(*w["slots"])}
        # per (tensor, slot) read by blocks: this rank's block, and where its piece goes
        self.blocks: dict[tuple[Any, int], torch.Tensor] = {}
        self.pending: dict[tuple[Any, int], list[tuple[torch.Tensor, int, int]]] = {}

    def _rows(self, i: int) -> list[tuple[int, int]] | None:
        """Element ranges of whole slot ``i`` that are this rank's piece, in order; ``None``
        where the piece is no run of rows."""
        split, slot = self.tp.splits[i], self.tp.whole.slots[i]
        if split is None:
            return [(0, slot.numel)]
        if split.dim != 0:
            return None
        row = slot.numel // slot.shape[0]
        return [
            (a * row, b * row) for a, b in split.pieces(slot.shape[0], self.tp.rank, self.tp.size)
        ]

    def _block(self, i: int, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s equal block of whole slot ``i``'s rows (the last ones may be short)."""
        n = self.tp.whole.slots[i].shape[0]
        return n * rank // self.tp.size, n * (rank + 1) // self.tp.size

    def _range(
        self, key: Any, i: int, lo: int, hi: int, dtype: torch.dtype, read: Any, dst: Any
    ) -> None:
        """Elements ``[lo, hi)`` of slot ``i``'s local piece into ``dst`` (now, or at
        :meth:`finish`); ``read(parts, out)`` reads ``(a, b, at)``: whole slot elements
        ``[a, b)`` into ``out[at:]``."""
        slot, rows = self.tp.whole.slots[i], self._rows(i)
        if rows is None:
            if (key, i) not in self.blocks:
                r0, r1 = self._block(i, self.tp.rank)
                row = slot.numel // slot.shape[0]
                block = torch.empty((r1 - r0) * row, dtype=dtype)
                read([(r0 * row, r1 * row, 0)], block)
                self.blocks[(key, i)] = block
            self.pending.setdefault((key, i), []).append((dst, lo, hi))
            return
        parts, at = [], 0
        for a, b in rows:  # local elements [at, at + b - a) are whole [a, b)
            x, y = max(lo, at), min(hi, at + b - a)
            if x < y:
                parts.append((a + x - at, a + y - at, x - lo))
            at += b - a
        read(parts, dst)

    def weights(self, i: int, lo: int, hi: int, dst: torch.Tensor) -> None:
        slot = self.tp.whole.slots[i]
        file = self.file[i]
        self.readers.entry(file, slot.name, slot.torch_dtype, slot.shape)

        def read(parts: Parts, out: torch.Tensor) -> None:
            for a, b, at in parts:
                self.readers[file].read_into(slot.name, a, b, out[at : at + b - a])

        self._range("weights", i, lo, hi, slot.torch_dtype, read, dst)

    def state(self, stream: Stream, i: int, lo: int, hi: int, dst: torch.Tensor) -> None:
        off = self.tp.whole.slots[i].offset

        def read(parts: Parts, out: torch.Tensor) -> None:
            moved = [(off + a, off + b, at) for a, b, at in parts]
            zero_gaps(out, read_state(self.readers, self.meta, stream, moved, out))

        self._range(stream, i, lo, hi, stream.dtype, read, dst)

    @torch.no_grad()
    def finish(self, device: torch.device) -> None:
        """Each pending slot's piece from every tp rank's block (one all-to-all each, in the
        same order on every rank of the tp group: they hold the same local layout and
        data-parallel rank, so they read alike), into the places waiting for it."""
        tp, size = self.tp, self.tp.size
        for (key, i), waiting in self.pending.items():
            slot, split = tp.whole.slots[i], tp.splits[i]
            assert split is not None
            rows = [self._block(i, q) for q in range(size)]
            shape = (rows[tp.rank][1] - rows[tp.rank][0], *slot.shape[1:])
            block = self.blocks.pop((key, i)).view(shape)
            send = torch.cat([split.take(block, p, size).reshape(-1) for p in range(size)])
            width = slot.numel // slot.shape[0] // size  # a row's elements in one piece
            sizes = [(b - a) * width for a, b in rows]
            recv = torch.empty(sum(sizes), dtype=send.dtype, device=device)
            dist.all_to_all_single(
                recv, send.to(device), sizes, [block.shape[0] * width] * size, group=tp.group
            )
            piece = recv.cpu()  # rows in order: the local piece, flat
            for dst, lo, hi in waiting:
                dst.copy_(piece[lo:hi])
        self.pending.clear()


def _fill(
    layout: FlatLayout, parts: Parts, into: torch.Tensor, piece: Any
) -> list[tuple[int, int]]:
    """Local flat ``parts`` into ``into``: ``piece(slot, a, b, shift, dst)`` fills ``dst`` with
    flat ``[a, b)`` of a slot (``shift``: from a flat position to its place in ``into``); the
    ranges written (alignment gaps are not)."""
    starts, written = [s.offset for s in layout.slots], []
    for rs, re, at in sorted(parts):
        i = max(0, bisect.bisect_right(starts, rs) - 1)
        for slot in layout.slots[i:]:
            if slot.offset >= re:
                break
            ov = overlap((slot.offset, slot.end), (rs, re))
            if ov is None:
                continue
            a, b = ov
            piece(slot, a, b, at - rs, into[at + a - rs : at + b - rs])
            written.append((at + a - rs, at + b - rs))
    return written


def read_share_tp(
    meta: Metadata, t: Target, optimizer: torch.optim.Optimizer | None, readers: Readers
) -> tuple[tuple[Any, ...], Callable[[], None]]:
    """``_load._read_share`` for a split module: the same reads, laid out alike, of this
    rank's local pieces of the whole tensors: ``(weights, parts, buffers, state, holdings)``,
    and what completes them once every rank has read its share (a collective in the tp
    group; nothing changed before it)."""
    tp = t.tp
    assert tp is not None
    if t.fm.layout.mixed:
        raise CheckpointError(
            "trainer: a tensor-parallel module with parameters of several dtypes cannot load "
            "a checkpoint yet; load it at tp=1, or cast the model to one dtype"
        )
    src = _Whole(meta, readers, tp)
    return read_pieces(meta, t, optimizer, readers, src), lambda: src.finish(t.device)


def read_pieces(
    meta: Metadata, t: Target, optimizer: torch.optim.Optimizer | None, readers: Readers, src: Any
) -> tuple[Any, ...]:
    """This rank's reads, laid out as ``_load._read_share`` lays them out, slot by slot
    from ``src``: ``src.file`` (whole slot -> its model file), ``src.weights(i, lo, hi,
    dst)`` and ``src.state(stream, i, lo, hi, dst)`` (elements ``[lo, hi)`` of local slot
    ``i``'s piece of the whole tensors; a pipeline stage's slots are whole ones, see
    ``_pp_load``)."""
    layout = t.fm.layout
    index = {id(s): i for i, s in enumerate(layout.slots)}
    saved = {n for i in src.file for n in meta.layout.slots[i].names}  # a replica: an alias
    if meta.raw["weights"].get("frozen", True) is False:
        saved = {n for s in meta.layout.slots if s.requires_grad for n in s.names} & saved
    mine, reads, numel, within = weight_reads(t)
    weights = torch.empty(numel, dtype=layout.torch_dtype)
    live = t.fm.flat_param if t.fm.is_bound else t.stripes.tensor if t.stripes else None

    def weight(slot: Any, a: int, b: int, shift: int, dst: torch.Tensor) -> None:
        if slot.name in saved:
            src.weights(index[id(slot)], a - slot.offset, b - slot.offset, dst)
            return
        assert live is not None  # saved with frozen=False: the model's own stays
        dst.copy_(live_weights(t, live, slot, a, b, shift))

    zero_gaps(weights, _fill(layout, reads, weights, weight), within)
    buffers = read_buffers(t, meta, readers)
    state, holdings = {}, {}
    if optimizer is not None:
        assert meta.optim is not None
        view, own = OptimizerView.of(optimizer, t), t.owns_state(optimizer)
        for stream in meta.optim.streams:
            if stream.key == MASTER and stream.param not in view.masters:
                continue
            hold = Holding.of(t, view, own, stream)

            def piece(slot: Any, a: int, b: int, _: int, dst: Any, s: Stream = stream) -> None:
                src.state(s, index[id(slot)], a - slot.offset, b - slot.offset, dst)

            if t.device.type == "cpu" and hold.whole is not None:
                host = torch.empty(hold.whole, dtype=stream.dtype)
                _fill(layout, hold.direct, host, piece)
            else:
                host = torch.empty(hold.numel, dtype=stream.dtype)
                zero_gaps(host, _fill(layout, hold.parts, host, piece), hold.within)
            state[stream], holdings[stream] = host, hold
    return weights, mine, buffers, state, holdings
