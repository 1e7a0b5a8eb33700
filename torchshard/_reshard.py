"""Who owns what, at any world size: pure range arithmetic on a layout, no process group."""

from __future__ import annotations

from ._layout import FlatLayout

__all__ = ["element_ranges", "overlap", "weight_shards"]


def element_ranges(numel: int, world_size: int, align: int = 1) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into ``world_size`` contiguous ranges of (nearly) equal size.

    Every boundary is a multiple of ``align``; the last ranges may be shorter
    or empty when ``numel`` does not divide.

    Example::

        element_ranges(10, 3)  # [(0, 4), (4, 8), (8, 10)]
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    per = -(-numel // world_size)
    per = -(-per // align) * align
    return [(min(r * per, numel), min((r + 1) * per, numel)) for r in range(world_size)]


def weight_shards(layout: FlatLayout, world_size: int) -> list[tuple[int, int]]:
    """Split the layout's slots into ``world_size`` contiguous runs of about equal bytes.

    Returns ``[lo, hi)`` slot-index ranges, one per rank (possibly empty when
    one parameter outweighs a rank's share). Whole parameters only: each
    run becomes one standard safetensors file.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    total = layout.param_numel
    owner, start = [], 0
    for s in layout.slots:
        # The rank whose byte share contains the parameter's middle.
        owner.append(min(world_size - 1, (2 * start + s.numel) * world_size // (2 * total)))
        start += s.numel
    bounds = []
    for r in range(world_size):
        idx = [i for i, o in enumerate(owner) if o == r]
        lo = idx[0] if idx else (bounds[-1][1] if bounds else 0)
        bounds.append((lo, idx[-1] + 1 if idx else lo))
    return bounds


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The intersection of two half-open ranges, or ``None`` when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None
