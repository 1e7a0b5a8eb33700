"""Who owns what, at any world size: pure range arithmetic on a layout, no process group.

:class:`Geometry` is the one owner of alignment, padding to the world size and each
rank's element range: the trainer allocates and slices by it, the memory planner
counts by it and the checkpoint cuts optimizer files by it, so they agree by
construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import TorchShardError
from .layout import FlatLayout

__all__ = ["Geometry", "element_ranges", "overlap", "sliced_numel", "weight_shards"]


@dataclass(frozen=True)
class Geometry:
    """How ``numel`` elements starting at ``start`` are cut into ``world_size`` rank ranges.

    Every boundary is a multiple of ``align`` elements past ``start``. With
    ``pad``, the region is padded to ``total`` so that every rank's range has
    the same length (what one all-gather or reduce-scatter needs); without it,
    ``total`` only rounds up to ``align``. A fully sharded mode describes each
    unit of the buffer by its own padded geometry (``start`` = the unit's offset).

    Example::

        g = Geometry.of(layout, world_size=4, pad=True)
        flat = torch.empty(g.total)
        a, b = g.range(rank)          # this rank's slice
        g.clipped(layout.numel)       # the same cuts over the unpadded layout
    """

    numel: int
    world_size: int
    align: int = 1
    pad: bool = False
    start: int = 0

    def __post_init__(self) -> None:
        for name in ("numel", "start"):
            if getattr(self, name) < 0:
                raise TorchShardError(f"Geometry.{name}: expected >= 0, got {getattr(self, name)}")
        for name in ("world_size", "align"):
            if getattr(self, name) < 1:
                raise TorchShardError(f"Geometry.{name}: expected >= 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, layout: FlatLayout, world_size: int, *, pad: bool) -> Geometry:
        """The geometry of ``layout``'s whole flat buffer over ``world_size`` ranks."""
        return cls(layout.numel, world_size, layout.align, pad)

    @property
    def per_rank(self) -> int:
        """Elements in each rank's range (the last ranges may be shorter unless ``pad``)."""
        per = -(-self.numel // self.world_size)
        return -(-per // self.align) * self.align

    @property
    def total(self) -> int:
        """The buffer length: ``numel`` padded to ``align`` (``pad``: to ``world_size`` equal ranges)."""
        unit = self.align * (self.world_size if self.pad else 1)
        return -(-self.numel // unit) * unit

    def ranges(self) -> list[tuple[int, int]]:
        """Each rank's ``[a, b)`` within ``[start, start + total)``."""
        return self.clipped(self.total)

    def range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s ``[a, b)``, without building every rank's (called per step)."""
        if not 0 <= rank < self.world_size:
            raise TorchShardError(f"rank: expected one in [0, {self.world_size}), got {rank}")
        per, n, s = self.per_rank, self.total, self.start
        return (s + min(rank * per, n), s + min((rank + 1) * per, n))

    def clipped(self, n: int) -> list[tuple[int, int]]:
        """The same cuts over ``[start, start + n)``: e.g. the checkpoint's ranges of the
        unpadded layout, which are the trainer's slices cut at ``layout.numel``."""
        per, s = self.per_rank, self.start
        return [(s + min(r * per, n), s + min((r + 1) * per, n)) for r in range(self.world_size)]

    def owner(self, offset: int) -> int:
        """The rank whose range holds element ``offset``."""
        if not self.start <= offset < self.start + self.total:
            raise TorchShardError(
                f"offset: expected one in [{self.start}, {self.start + self.total}), got {offset}"
            )
        return min((offset - self.start) // self.per_rank, self.world_size - 1)


def sliced_numel(layout: FlatLayout, world_size: int) -> int:
    """Elements of a sharded optimizer's flat buffer: padded to ``world_size`` equal slices;
    with a trainable suffix (:attr:`FlatLayout.trainable_suffix`), long enough that the
    padded gradient space fits from the suffix on, so the optimizer slices the buffer in
    place.

    Example::

        sliced_numel(layout, 4) >= Geometry.of(layout, 4, pad=True).total
    """
    n = Geometry.of(layout, world_size, pad=True).total
    a = layout.trainable_suffix
    if a is None:
        return n
    return max(n, a + Geometry.of(layout.grad_layout, world_size, pad=True).total)


def element_ranges(numel: int, world_size: int, align: int = 1) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into ``world_size`` contiguous ranges of (nearly) equal size.

    Every boundary is a multiple of ``align``; the last ranges may be shorter
    or empty when ``numel`` does not divide.

    Example::

        element_ranges(10, 3)  # [(0, 4), (4, 8), (8, 10)]
    """
    return Geometry(numel, world_size, align).clipped(numel)


def weight_shards(layout: FlatLayout, world_size: int) -> list[tuple[int, int]]:
    """Split the layout's slots into ``world_size`` contiguous runs of about equal bytes.

    Returns ``[lo, hi)`` slot-index ranges, one per rank (possibly empty when
    one parameter outweighs a rank's share). Whole parameters only: each
    run becomes one standard safetensors file.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    total = sum(s.span for s in layout.slots)
    owner, start = [], 0
    for s in layout.slots:
        # The rank whose byte share contains the parameter's middle.
        owner.append(min(world_size - 1, (2 * start + s.span) * world_size // (2 * total)))
        start += s.span
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
