"""Gradient buckets: contiguous ranges of the flat gradient, planned from the layout alone.

Pure arithmetic on a :class:`FlatLayout`; no tensors, no process group.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .._flat.layout import FlatLayout

__all__ = ["Bucket", "plan_buckets"]


@dataclass(frozen=True)
class Bucket:
    """``[start, end)`` of the flat gradient, holding the slots ``slots`` (indices into the layout).

    ``trainable`` counts the slots that receive gradients; a bucket with none is
    never communicated. ``dtype``: the bucket's gradients' dtype in a mixed layout, whose
    buffer is bytes (a bucket never spans two regions); ``None``: the buffer's.
    """

    index: int
    start: int
    end: int
    slots: tuple[int, ...]
    trainable: int
    dtype: torch.dtype | None = None

    def view(self, grad: torch.Tensor) -> torch.Tensor:
        """The bucket's range of the flat gradient ``grad``, typed."""
        piece = grad[self.start : self.end]
        return piece if self.dtype is None else piece.view(self.dtype)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def elements(self) -> int:
        """Elements of :meth:`view` (``numel`` in the buffer's units; fewer when typed)."""
        return self.numel if self.dtype is None else self.numel // self.dtype.itemsize


def plan_buckets(
    layout: FlatLayout, bucket_bytes: float, *, total: int | None = None, cuts: tuple[int, ...] = ()
) -> tuple[Bucket, ...]:
    """Cut the flat gradient into buckets of about ``bucket_bytes``, on parameter boundaries.

    Buckets are numbered in reverse layout order, the order in which backward
    produces gradients (the last layers first), like DDP's. Together they tile
    ``[0, total)`` exactly (default ``layout.numel``), padding included, so
    reducing every bucket reduces the whole buffer. A parameter larger than
    ``bucket_bytes`` gets a bucket of its own. ``cuts`` are extra boundaries
    (the sharded trainer's slice starts): a bucket never spans one, so a
    parameter that straddles a cut belongs to the buckets on both sides.

    Example::

        buckets = plan_buckets(fm.layout, 25 * 2**20)
        buckets[0].end == fm.layout.numel   # the last parameters come first
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: expected a positive size, got {bucket_bytes}")
    total = layout.numel if total is None else total
    if total < layout.numel:
        raise ValueError(f"total: expected at least layout.numel ({layout.numel}), got {total}")
    itemsize = layout.torch_dtype.itemsize
    groups: list[list[int]] = []
    size = 0
    for i in reversed(range(len(layout.slots))):
        nbytes = layout.slots[i].span * itemsize
        if groups and size + nbytes <= bucket_bytes:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
    bounds = {0, total, *(c for c in cuts if 0 < c < total)}
    bounds |= {layout.slots[g[-1]].offset for g in groups[:-1]}
    mixed = layout.mixed
    if mixed:  # one dtype per bucket: each is reduced as one typed tensor
        bounds |= {r.start for r in layout.regions}
    edges = sorted(bounds, reverse=True)
    buckets = []
    for end, start in itertools.pairwise(edges):
        slots = tuple(i for i, s in enumerate(layout.slots) if s.offset < end and s.end > start)
        trainable = sum(layout.slots[i].requires_grad for i in slots)
        dtype = layout.region_of(min(start, layout.numel - 1)).dtype if mixed and slots else None
        buckets.append(Bucket(len(buckets), start, end, slots, trainable, dtype))
    return tuple(buckets)
