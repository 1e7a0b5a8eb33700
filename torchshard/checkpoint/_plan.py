"""Which part of a checkpoint each rank holds: pure arithmetic on a layout, no tensors.

A save at world size W writes from rank r its run of whole parameters
(:func:`weight_runs`) to one model file, and its range of the flat optimizer
state (:func:`state_ranges`) to one optimizer file. That range is cut into
pieces: parts of the tensors the optimizer updates, and zeros between them
(alignment padding, frozen parameters). :func:`plan_share` computes one
rank's share from element offsets alone, so it is unit-tested without a
process group; load and the offline tools use the same ranges, intersected
with :func:`overlap`. Positions are the flat buffer's: bytes when the parameters have
several dtypes (``layout.mixed``; what each range holds of each dtype: ``_streams``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._flat.geometry import Geometry, overlap, weight_shards
from .._flat.layout import FlatLayout

__all__ = [
    "Piece",
    "SharePlan",
    "exchange_splits",
    "gather_ranges",
    "overlap",
    "plan_share",
    "spread_ranges",
    "state_ranges",
    "stored_parts",
    "trainable_only",
    "weight_runs",
    "weight_tiles",
]


def weight_runs(layout: FlatLayout, world_size: int) -> list[tuple[int, int]]:
    """Each rank's run ``[lo, hi)`` of whole parameters (slot indices) in the model files."""
    return weight_shards(layout, world_size)


def weight_tiles(layout: FlatLayout, world_size: int) -> list[tuple[int, int]]:
    """Each rank's run of whole parameters as elements ``[start, end)`` of the flat buffer,
    widened to tile ``[0, layout.numel)``: from its first parameter to the next rank's (the
    alignment gap after its last parameter, or the whole tail, comes with it; an empty run is
    an empty tile). What a fully sharded save gathers each model file's weights into."""
    return _tiles(layout, weight_runs(layout, world_size))


def _tiles(layout: FlatLayout, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """:func:`weight_tiles` of the runs :func:`weight_runs` gave."""
    n, slots = layout.numel, layout.slots
    starts = [slots[lo].offset if lo < len(slots) else n for lo, _ in runs]
    starts[0] = 0
    return [(a, starts[q + 1] if q + 1 < len(runs) else n) for q, a in enumerate(starts)]


def state_ranges(layout: FlatLayout, world_size: int) -> list[tuple[int, int]]:
    """Each rank's range ``[start, end)`` of flat optimizer state, in elements (aligned):
    the sharded trainer's slices, cut at the end of the layout. With frozen parameters the
    trainer slices the trainable parameters alone (``layout.grad_layout``): the ranges are
    those slices' cuts, carried to the flat buffer, so that each holds the state of one
    slice (and the frozen parameters around it, which have none)."""
    grads = layout.grad_layout
    if grads is layout:
        return Geometry.of(layout, world_size, pad=True).clipped(layout.numel)
    cuts = [a for a, _ in Geometry.of(grads, world_size, pad=True).clipped(grads.numel)]
    starts = [0, *(_flat_of(layout, c) for c in cuts[1:])]
    return [
        (a, starts[r + 1] if r + 1 < world_size else layout.numel) for r, a in enumerate(starts)
    ]


def _flat_of(layout: FlatLayout, g: int) -> int:
    """The flat element of gradient-space element ``g`` (in a gap: the next run's start)."""
    for a, b, c in layout.trainable_runs():
        if g < c + b - a:
            return a + max(0, g - c)
    return layout.numel


def trainable_only(layout: FlatLayout) -> bool:
    """Whether a save of ``layout`` stores optimizer state for the trainable parameters only
    (it has frozen ones; ``metadata.json``'s ``"stored": "trainable"``)."""
    return layout.grad_layout is not layout


def stored_parts(
    layout: FlatLayout, start: int, end: int, only_trainable: bool | None = None
) -> list[tuple[int, int, int]]:
    """The parts of flat optimizer state ``[start, end)`` that an optimizer file stores, as
    ``(a, b, at)``: flat ``[a, b)`` is the file tensor's ``[at, at + b - a)``. Every element
    (one part), unless ``only_trainable`` (default: :func:`trainable_only`): then the
    trainable runs' elements only (a LoRA checkpoint holds no zeros for its frozen base).

    Example::

        stored_parts(layout, *state_ranges(layout, 2)[1])   # [(a, b, 0), ...]
    """
    if not (trainable_only(layout) if only_trainable is None else only_trainable):
        return [(start, end, 0)] if end > start else []
    out, at = [], 0
    for ra, rb, _ in layout.trainable_runs():
        a, b = max(ra, start), min(rb, end)
        if a < b:
            out.append((a, b, at))
            at += b - a
    return out


def gather_ranges(numel: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    """What rank ``rank`` reads of a tensor of ``numel`` elements that every rank ends up
    holding whole: its equal part ``[rank * b, (rank + 1) * b)``, ``b = numel // world_size``,
    then the tail ``[world_size * b, numel)`` (fewer than ``world_size`` elements) that every
    rank reads itself. The equal parts are what one in-place all-gather of
    ``[0, world_size * b)`` exchanges: one collective per tensor, whatever the world size.

    Example::

        gather_ranges(10, 3, 1)  # [(3, 6), (9, 10)]
    """
    b = numel // world_size
    out = [(rank * b, (rank + 1) * b)] if b else []
    return out + ([(world_size * b, numel)] if world_size * b < numel else [])


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of the flat buffer: of segment ``segment`` (an index into the
    segments planned with), or zeros where it is ``None``."""

    start: int
    end: int
    segment: int | None


@dataclass(frozen=True)
class SharePlan:
    """What one rank writes in a save at ``world`` ranks, and every cut of the files that a
    save needs, computed once: a rank that holds no range of the files assembles its share
    from every rank's (``tiles``, ``state_ranges``)."""

    rank: int
    world: int
    slots: tuple[int, int]  # its run of whole parameters, [lo, hi) in slot indices
    span: tuple[int, int]  # those parameters' elements in the flat buffer; (0, 0) for none
    state_range: tuple[int, int]  # its range of flat optimizer state; (0, 0) when none is saved
    pieces: tuple[Piece, ...]  # what the file stores of state_range, cut at segments, in order
    tiles: tuple[tuple[int, int], ...] = ()  # every rank's weight tile (:func:`weight_tiles`)
    state_ranges: tuple[tuple[int, int], ...] = ()  # every rank's state range; () when none

    @property
    def tile(self) -> tuple[int, int]:
        """This rank's weight tile: its run of whole parameters widened to tile the buffer."""
        return self.tiles[self.rank]


def plan_share(
    layout: FlatLayout,
    world_size: int,
    rank: int,
    segments: Sequence[tuple[int, int]] | None = None,
) -> SharePlan:
    """Rank ``rank``'s share of a save at ``world_size``.

    Args:
        layout: the flat module's layout.
        world_size: ranks saving.
        rank: the rank whose share this is.
        segments: ``(start, end)`` in the flat buffer of each tensor the optimizer updates
            (a whole parameter, or the part of one in a rank's slice), in any order; ``None``
            when no flat optimizer state is saved.

    Example::

        # Linear(3, 5), LayerNorm(5), Linear(5, 2) in float32, 16-byte aligned: 56 elements
        plan = plan_share(layout, 2, 1, [(s.offset, s.end) for s in layout.slots])
        plan.slots, plan.span, plan.state_range  # (2, 6), (24, 54), (28, 56)
        plan.pieces[:2]  # Piece(28, 29, segment=2), then Piece(29, 32, None): padding
    """
    runs = weight_runs(layout, world_size)
    lo, hi = runs[rank]
    span = (layout.slots[lo].offset, layout.slots[hi - 1].end) if hi > lo else (0, 0)
    tiles = tuple(_tiles(layout, runs))
    if segments is None:
        return SharePlan(rank, world_size, (lo, hi), span, (0, 0), (), tiles)
    ranges = tuple(state_ranges(layout, world_size))
    s0, e0 = ranges[rank]
    pieces: list[Piece] = []
    order = sorted(range(len(segments)), key=lambda i: segments[i][0])
    for p0, p1, _ in stored_parts(layout, s0, e0):  # what the file stores, in order
        pos = p0
        for i in order:
            a, b = max(segments[i][0], p0), min(segments[i][1], p1)
            if a >= b:
                continue
            if a > pos:
                pieces.append(Piece(pos, a, None))  # padding, parameters without state
            pieces.append(Piece(a, b, i))
            pos = b
        if pos < p1:
            pieces.append(Piece(pos, p1, None))
    return SharePlan(rank, world_size, (lo, hi), span, (s0, e0), tuple(pieces), tiles, ranges)


def exchange_splits(
    stripes: Sequence[tuple[int, int]], dest: Sequence[tuple[int, int]], rank: int
) -> tuple[list[int], list[int]]:
    """For one unit of a save: how many elements ``rank`` sends to each rank (its stripe's
    overlap with their range) and receives from each (their stripes' overlap with its
    range), as ``all_to_all_single``'s input and output split sizes.

    ``stripes``: every rank's ``[a, b)`` of the unit, in rank order, tiling it; ``dest``:
    every rank's range to fill, in rank order, tiling one block of the buffer: at least the
    unit, or (hybrid sharding: a replica's ranges) a part of it, of which each rank then sends
    its stripe's part in the block. Both are runs in rank order, so what a rank sends is its
    stripe's part in the block, in order, and what it receives its range's part of the unit.

    Example::

        exchange_splits([(0, 6), (6, 10)], [(0, 4), (4, 10)], 0)  # ([4, 2], [4, 0])
        exchange_splits([(0, 6), (6, 10)], [(5, 7), (7, 8)], 0)  # ([1, 0], [1, 1])
    """

    def size(a: tuple[int, int], b: tuple[int, int]) -> int:
        ov = overlap(a, b)
        return 0 if ov is None else ov[1] - ov[0]

    mine, target = stripes[rank], dest[rank]
    send = [size(mine, d) for d in dest]
    if sum(send) != size(mine, (dest[0][0], dest[-1][1])):
        raise ValueError(
            f"dest: expected ranges that cover the stripe {mine} where they reach, got {list(dest)}"
        )
    return send, [size(s, target) for s in stripes]


def spread_ranges(
    numel: int, shards: int, shard: int, replicas: int, replica: int
) -> list[tuple[int, int]]:
    """:func:`gather_ranges` for a hybrid group of ``replicas x shards`` ranks: what rank
    ``(replica, shard)`` reads of a tensor that every rank ends up holding whole. Its shard
    rank's equal part of the tensor is cut again in equal parts over the replicas: it reads
    its replica's, then that part's tail and the tensor's tail (fewer than ``replicas``
    and ``shards`` elements, read by each rank that needs them). One all-gather across the
    replicas completes the shard rank's part, one inside the shard group the rest.

    Example::

        spread_ranges(10, 2, 1, 2, 0)  # [(5, 7), (9, 10)]: [5, 10) is shard 1's, [9, 10) its tail
    """
    b = numel // shards
    inner = [(shard * b + x, shard * b + y) for x, y in gather_ranges(b, replicas, replica)]
    return inner + ([(shards * b, numel)] if shards * b < numel else [])
