"""Which part of a checkpoint each rank holds: pure arithmetic on a layout, no tensors.

A save at world size W writes from rank r its run of whole parameters
(:func:`weight_runs`) to one model file, and its range of the flat optimizer
state (:func:`state_ranges`) to one optimizer file. That range is cut into
pieces: parts of the tensors the optimizer updates, and zeros between them
(alignment padding, frozen parameters). :func:`plan_share` computes one
rank's share from element offsets alone, so it is unit-tested without a
process group; load and the offline tools use the same ranges, intersected
with :func:`overlap`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._flat.geometry import Geometry, overlap, weight_shards
from .._flat.layout import FlatLayout

__all__ = ["Piece", "SharePlan", "overlap", "plan_share", "state_ranges", "weight_runs"]


def weight_runs(layout: FlatLayout, world_size: int) -> list[tuple[int, int]]:
    """Each rank's run ``[lo, hi)`` of whole parameters (slot indices) in the model files."""
    return weight_shards(layout, world_size)


def state_ranges(layout: FlatLayout, world_size: int) -> list[tuple[int, int]]:
    """Each rank's range ``[start, end)`` of flat optimizer state, in elements (aligned):
    the sharded trainer's slices, cut at the end of the layout."""
    return Geometry.of(layout, world_size, pad=True).clipped(layout.numel)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of the flat buffer: of segment ``segment`` (an index into the
    segments planned with), or zeros where it is ``None``."""

    start: int
    end: int
    segment: int | None


@dataclass(frozen=True)
class SharePlan:
    """What one rank writes in a save at ``world`` ranks."""

    rank: int
    world: int
    slots: tuple[int, int]  # its run of whole parameters, [lo, hi) in slot indices
    span: tuple[int, int]  # those parameters' elements in the flat buffer; (0, 0) for none
    state_range: tuple[int, int]  # its range of flat optimizer state; (0, 0) when none is saved
    pieces: tuple[Piece, ...]  # state_range, cut where segments begin and end, in order


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
    lo, hi = weight_runs(layout, world_size)[rank]
    span = (layout.slots[lo].offset, layout.slots[hi - 1].end) if hi > lo else (0, 0)
    if segments is None:
        return SharePlan(rank, world_size, (lo, hi), span, (0, 0), ())
    s0, e0 = state_ranges(layout, world_size)[rank]
    pieces: list[Piece] = []
    pos = s0
    for i in sorted(range(len(segments)), key=lambda i: segments[i][0]):
        a, b = max(segments[i][0], s0), min(segments[i][1], e0)
        if a >= b:
            continue
        if a > pos:
            pieces.append(Piece(pos, a, None))  # padding, frozen parameters
        pieces.append(Piece(a, b, i))
        pos = b
    if pos < e0:
        pieces.append(Piece(pos, e0, None))
    return SharePlan(rank, world_size, (lo, hi), span, (s0, e0), tuple(pieces))
