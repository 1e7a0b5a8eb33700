"""Reads of a checkpoint's flat tensors into host memory: ranges packed one after another,
what no read wrote zeroed, and flat optimizer state read, stream by stream, from what its
files store into the place the live optimizer holds it (:class:`Holding`).

Each byte is read once across the ranks, then spread. A tensor every rank holds whole is read
in equal parts (:func:`whole_ranges`) and all-gathered (:func:`gather_whole`). What a rank
holds alone (its local shards) it reads itself; with hybrid sharding every replica holds the
same local shards, so each reads its equal part of them (:func:`alike_ranges`) and one
all-gather across the replicas (:func:`gather_alike`) completes them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._flat.layout import ParamSlot
from ._metadata import Metadata, Readers
from ._optim import OptimizerView
from ._plan import gather_ranges, overlap, spread_ranges
from ._streams import Held, Stream, stream_parts
from ._target import Ranks, Target

__all__ = [
    "BROADCAST_BACKENDS",
    "Holding",
    "Parts",
    "alike_ranges",
    "gather_alike",
    "gather_parts",
    "gather_whole",
    "into_shards",
    "live_weights",
    "packed",
    "packed_bytes",
    "read_buffers",
    "read_state",
    "restrict",
    "shard_runs",
    "to_shards",
    "weight_reads",
    "whole_ranges",
    "zero_gaps",
]

Parts = list[tuple[int, int, int]]
"""``(start, end, at)``: flat positions ``[start, end)`` are elements ``[at, ...)`` of what is
read (as many as they hold of its dtype: ``end - start`` in a layout of one dtype)."""

# Backends whose all-gather goes through a temporary: gloo's all-gathers into a new tensor
# of the whole output and copies it out (an extra pass over every byte, and its page faults:
# at 1 GB saved at 2, 3x the CPU of the broadcasts it replaced), while its broadcast receives
# in place. There the ranks' parts go by broadcast, all started at once.
BROADCAST_BACKENDS = frozenset({"gloo"})


def packed(ranges: list[tuple[int, int]]) -> Parts:
    """``ranges`` read one after the other into one tensor."""
    out, at = [], 0
    for a, b in ranges:
        out.append((a, b, at))
        at += b - a
    return out


def zero_gaps(
    into: torch.Tensor,
    written: list[tuple[int, int]],
    within: list[tuple[int, int]] | None = None,
) -> None:
    """Zero what no read wrote (alignment gaps, a stripe's padding), range by range: the rest
    was read, so the buffer is allocated empty rather than zeroed whole. ``within``: only
    there (what this rank read a part of; the rest comes from other ranks)."""
    if within is not None:
        pos, written = 0, list(written)
        for a, b in sorted(within):
            written.append((pos, a))
            pos = b
        written.append((pos, into.numel()))
    pos = 0
    for a, b in sorted(written):
        if a > pos:
            into[pos:a].zero_()
        pos = max(pos, b)
    if pos < into.numel():
        into[pos:].zero_()


def read_state(
    readers: Readers, meta: Metadata, stream: Stream, parts: Parts, into: torch.Tensor
) -> list[tuple[int, int]]:
    """Read ``stream``'s ``parts`` from the optimizer files into ``into``; the ranges of
    ``into`` written (what the files store of them: all, or the trainable parameters')."""
    assert meta.optim is not None
    written, w = [], stream.width
    parts = sorted(parts)  # in file order: a chunk that two reads cut is read once
    starts = [rs for rs, _, _ in parts]
    for file, fs, fe in meta.optim.files:
        stored = stream_parts(meta.layout, fs, fe, meta.optim.trainable_only, stream.param)
        for ps, pe, pos in stored:
            for rs, re, at in parts[max(0, bisect.bisect_right(starts, ps) - 1) :]:
                if rs >= pe:
                    break
                ov = overlap((ps, pe), (rs, re))
                if ov is not None:
                    a, b = ov
                    dst = into[at + (a - rs) // w : at + (b - rs) // w]
                    readers[file].read_into(
                        stream.name, pos + (a - ps) // w, pos + (b - ps) // w, dst
                    )
                    written.append((at + (a - rs) // w, at + (b - rs) // w))
    return written


@dataclass(frozen=True)
class Holding:
    """Where this rank holds a stream's state for the live optimizer, and what it reads.

    Whole (``whole``: an optimizer over whole parameters): the trainable parameters' part
    of the stream's space (:class:`~._streams.Held`), of which each rank reads its equal
    part (``parts``, ``numel`` elements) and an all-gather completes the rest. Otherwise
    (the trainer's sharding optimizer) exactly what this rank's optimizer updates: its
    local shards' runs, laid out like their tensor (a layout of one dtype), or its
    segments one after another (several dtypes). ``position``: where the state of a
    segment starting at flat position ``a`` begins.

    Example::

        h = Holding.of(t, view, own=False, stream=stream)
        host = torch.empty(h.numel, dtype=stream.dtype)
        read_state(readers, meta, stream, h.parts, host)
    """

    parts: Parts
    numel: int
    whole: int | None  # elements of the state held whole; None: as read
    position: Callable[[int], int]
    direct: Parts = field(default_factory=list)  # whole: ``parts`` placed in the whole
    within: list[tuple[int, int]] | None = None  # not whole: the part this rank reads (of
    # local shards its replicas hold alike), the rest gathered; None: all of it

    @classmethod
    def of(cls, t: Target, view: OptimizerView, own: bool, stream: Stream) -> Holding:
        layout, w = t.fm.layout, stream.width
        if own and not layout.mixed:  # the local shards' runs, laid out like their tensor
            assert t.stripes is not None
            shards, n = t.stripes, t.stripes.tensor.numel()
            mine = alike_ranges(t, n)
            return cls(restrict(list(shards.runs), mine), n, None, shards.position, within=mine)
        if own:  # the segments of the stream's dtype, one after another
            at, parts, where = 0, [], {}
            for seg in view.segments:
                if layout.slots[seg.slot].torch_dtype == stream.param:
                    parts.append((seg.start, seg.end, at))
                    where[seg.start] = at
                    at += (seg.end - seg.start) // w
            mine = alike_ranges(t, at)
            return cls(restrict(parts, mine, w), at, None, where.__getitem__, within=mine)
        held = Held.of(layout, stream.param)  # equal parts of it, gathered after
        equal = packed(whole_ranges(t, held.numel))
        parts = [(a, b, at + pos - x) for x, y, at in equal for a, b, pos in held.reads(x, y)]
        direct = [(a, b, pos) for x, y, _ in equal for a, b, pos in held.reads(x, y)]
        return cls(parts, sum(y - x for x, y, _ in equal), held.numel, held.position, direct)


def read_buffers(t: Target, meta: Metadata, readers: Readers) -> dict[str, torch.Tensor]:
    """The module buffers the checkpoint holds, read whole into host tensors by name."""
    buffers = {}
    for name, want in t.buffers().items():
        file = meta.buffers[name]
        readers.entry(file, name, want.dtype, tuple(want.shape))
        host = torch.empty(want.shape, dtype=want.dtype)
        readers[file].read_into(name, 0, host.numel(), host.view(-1))
        buffers[name] = host
    return buffers


def packed_bytes(runs: Sequence[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], int]:
    """Local shards' runs of a buffer of several dtypes (bytes), laid out one after another
    in bytes (their tensor holds elements): ``(a, b, at)`` and the bytes in all."""
    out, at = [], 0
    for a, b, _ in runs:
        out.append((a, b, at))
        at += b - a
    return out, at


def shard_runs(t: Target) -> tuple[Parts, int]:
    """What a load reads of the weights for local shards without a flat buffer: their runs
    laid out like their tensor (a buffer of several dtypes: the runs' bytes, one after
    another), then the frozen weights' runs, laid out like theirs; and the elements in all
    (:func:`into_shards` puts them in place)."""
    if t.stripes is None:
        return [], 0
    if t.fm.layout.mixed:
        runs, n = packed_bytes(t.stripes.runs)
    else:
        runs, n = list(t.stripes.runs), t.stripes.tensor.numel()
    if t.frozen is not None:
        runs += [(a, b, n + at) for a, b, at in t.frozen.runs]
        n += t.frozen.tensor.numel()
    return runs, n


def weight_reads(t: Target) -> tuple[Parts, Parts, int, list[tuple[int, int]] | None]:
    """What a load reads of the weights: where they go in what is read (equal parts of the
    buffer held whole, or :func:`shard_runs`), what of it this rank reads (all of that, or
    with hybrid sharding its replica's part of the local shards, gathered after), the
    elements in all, and the range it reads them within (``None``: all of them)."""
    if t.fm.is_bound:
        mine = packed(whole_ranges(t, t.fm.layout.numel))
        return mine, mine, sum(b - a for a, b, _ in mine), None
    mine, numel = shard_runs(t)
    within = alike_ranges(t, numel)
    return mine, restrict(mine, within), numel, within


@torch.no_grad()
def into_shards(t: Target, weights: torch.Tensor, runs: Parts) -> None:
    """The weights read by :func:`shard_runs`' ``runs`` into the local shards' tensors: each
    run's elements in its region's dtype (in the master dtype, where there is one), then
    the frozen weights as they are."""
    assert t.stripes is not None
    if t.fm.layout.mixed:
        t.stripes.copy_from_bytes(weights, runs[: len(t.stripes.runs)])
    else:
        t.stripes.tensor.copy_(weights[: t.stripes.tensor.numel()])
    if t.frozen is not None:  # read after them
        kept = t.frozen.tensor
        kept.copy_(weights[weights.numel() - kept.numel() :])


def live_weights(
    t: Target, live: torch.Tensor, slot: ParamSlot, a: int, b: int, shift: int
) -> torch.Tensor:
    """Flat ``[a, b)`` of ``slot`` as the live model holds it (a checkpoint saved without its
    frozen weights keeps the model's own): in the buffer, or in the local shards' tensor
    (``shift``: from a flat position to its place there; a buffer of several dtypes: its
    elements, cast to the slot's dtype, as bytes)."""
    if t.fm.is_bound:
        return live[a:b]
    if t.frozen is not None and not slot.requires_grad:  # held as the buffer holds it
        at = t.frozen.position(a)
        return t.frozen.tensor[at : at + b - a]
    if not t.fm.layout.mixed:
        return live[a + shift : b + shift]
    assert t.stripes is not None
    at = t.stripes.position(a)
    return live[at : at + (b - a) // slot.width].to(slot.torch_dtype).view(torch.uint8)


def restrict(parts: Parts, ranges: list[tuple[int, int]], width: int = 1) -> Parts:
    """What of ``parts`` lies at ``ranges`` of what is read (``width`` positions per element).

    Example::

        restrict([(10, 20, 0), (30, 40, 10)], [(5, 15)])  # [(15, 20, 5), (30, 35, 10)]
    """
    out = []
    for a, b, at in parts:
        end = at + (b - a) // width
        for x, y in ranges:
            lo, hi = max(at, x), min(end, y)
            if lo < hi:
                out.append((a + (lo - at) * width, a + (hi - at) * width, lo))
    return out


def whole_ranges(t: Target, numel: int) -> list[tuple[int, int]]:
    """What this rank reads of a tensor of ``numel`` elements that every rank ends up holding
    whole: :func:`~._plan.gather_ranges` over the ranks, or with hybrid sharding
    :func:`~._plan.spread_ranges` (completed by :func:`gather_whole`)."""
    if t.across is None:
        return gather_ranges(numel, t.world, t.rank)
    return spread_ranges(numel, t.cut.size, t.cut.rank, t.across.size, t.across.rank)


def alike_ranges(t: Target, numel: int) -> list[tuple[int, int]]:
    """What this rank reads of its local shards' tensor (``numel`` elements): all of it, or
    with hybrid sharding, where the replicas hold the same, its replica's equal part and
    the tail (completed by :func:`gather_alike`)."""
    if t.across is None:
        return [(0, numel)] if numel else []
    return gather_ranges(numel, t.across.size, t.across.rank)


def gather_whole(
    full: torch.Tensor, numel: int, t: Target, *, by_broadcast: bool
) -> list[dist.Work]:
    """Start completing ``full[:numel]`` from every rank's :func:`whole_ranges`: one
    all-gather over the ranks; with hybrid sharding one across the replicas first (of the
    shard rank's part; waited for: cross-node, ``1 / dp_shard`` of the bytes), then one
    inside the shard group. The handles not waited for."""
    if t.across is None:
        return gather_parts(full, numel // t.world, t.dp, by_broadcast=by_broadcast)
    b = numel // t.cut.size
    part = full[t.cut.rank * b : (t.cut.rank + 1) * b]
    for work in gather_parts(part, b // t.across.size, t.across, by_broadcast=by_broadcast):
        work.wait()
    return gather_parts(full, b, t.cut, by_broadcast=by_broadcast)


def gather_alike(full: torch.Tensor, t: Target, *, by_broadcast: bool) -> list[dist.Work]:
    """Start completing local shards' ``full`` from every replica's :func:`alike_ranges`
    (one all-gather across the replicas; nothing without them)."""
    if t.across is None:
        return []
    return gather_parts(full, full.numel() // t.across.size, t.across, by_broadcast=by_broadcast)


def gather_parts(
    full: torch.Tensor, b: int, ranks: Ranks, *, by_broadcast: bool
) -> list[dist.Work]:
    """Start exchanging every rank's part ``[r * b, (r + 1) * b)`` of ``full``, so that every
    rank of ``ranks`` holds ``full[:size * b]``: one in-place all-gather (NCCL's in-place
    condition), or one broadcast per rank; their handles, not waited for."""
    if ranks.size == 1 or b == 0:
        return []
    if by_broadcast:
        return [
            dist.broadcast(
                full[q * b : (q + 1) * b], ranks.global_rank(q), group=ranks.group, async_op=True
            )
            for q in range(ranks.size)
        ]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    mine = full[ranks.rank * b : (ranks.rank + 1) * b]
    return [gather(full[: ranks.size * b], mine, group=ranks.group, async_op=True)]


def to_shards(t: Target, view: OptimizerView | None = None) -> None:
    """The flat buffer was loaded: the local shards' tensor, if one of its own, follows. With
    parameters of several dtypes, each tensor the optimizers update (``view``'s, the
    trainer's) that is not a view of the buffer (a master piece) is refreshed from it."""
    flat = t.fm.flat_param
    if flat is not None and t.fm.layout.mixed:
        slots = t.fm.layout.slots
        mine = [(s.slot, s.start, s.end, s.tensor) for s in view.segments] if view else []
        for i, a, b, tensor in mine + t.own_segments():
            weights = flat[a:b].view(slots[i].torch_dtype)
            if tensor.data_ptr() != weights.data_ptr():
                tensor.copy_(weights.view(tensor.shape))
        return
    if t.stripes is not None and flat is not None:
        t.stripes.copy_from(flat)
