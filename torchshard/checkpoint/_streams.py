"""Flat optimizer state as *streams*: an optimizer file holds one 1-D tensor per stream.

In a layout of one dtype each state key is one stream over the whole flat buffer, named by
the key (``exp_avg``): its elements are the buffer's. In a layout of several dtypes (its
buffer is bytes: ``layout.mixed``) each state key and parameter dtype is one stream,
named ``key/dtype`` (``exp_avg/bfloat16``: the ``exp_avg`` of the bfloat16 parameters),
over that dtype's *space*: the layout's regions of that dtype one after another, counted
in its elements (alignment gaps included). A stream's own dtype is the state's (``float32``
moments of bfloat16 parameters that an fp32 master updates).

Every cut a checkpoint makes of the buffer (the files' ranges, the trainable runs, the
regions) is a multiple of ``align_bytes``, hence an element boundary of every dtype: a
piece ``[a, b)`` of a region of dtype P holds ``(b - a) // width`` of its elements, where
``width`` is P's item size (1 in a layout of one dtype, whose positions are elements).
Pure arithmetic on a layout, and the JSON of ``optimizer.flat_state``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._flat.layout import FlatLayout, dtype_name
from ._plan import stored_parts
from ._rules import Invalid, at, expect_dict, expect_dtype

__all__ = [
    "MASTER",
    "Held",
    "Space",
    "Stream",
    "canonical",
    "parse_flat_state",
    "stream_parts",
    "streams_json",
    "typed",
    "width",
]

MASTER = "master"  # the state key under which master weights (e.g. fp32 of bf16) are saved

Parts = list[tuple[int, int, int]]
"""``(a, b, at)``: flat positions ``[a, b)`` are elements ``[at, at + (b - a) // width)``."""


def width(layout: FlatLayout, param: torch.dtype) -> int:
    """Buffer positions per element of a parameter of dtype ``param``: its item size in a
    layout of several dtypes (bytes), else 1."""
    return param.itemsize if layout.mixed else 1


@dataclass(frozen=True)
class Stream:
    """The flat state ``key`` of the parameters of dtype ``param`` (in a layout of one dtype:
    of every parameter), held in ``dtype``; ``mixed``: the layout has several dtypes.

    Example::

        Stream("exp_avg", torch.bfloat16, torch.float32, mixed=True).name  # 'exp_avg/bfloat16'
    """

    key: str
    param: torch.dtype
    dtype: torch.dtype
    mixed: bool = False

    @property
    def name(self) -> str:
        """Its tensor's name in the optimizer files."""
        return f"{self.key}/{dtype_name(self.param)}" if self.mixed else self.key

    @property
    def width(self) -> int:
        """Buffer positions per element (see :func:`width`)."""
        return self.param.itemsize if self.mixed else 1


def typed(
    layout: FlatLayout, spans: Sequence[tuple[int, int]], param: torch.dtype
) -> list[tuple[int, int, int, int]]:
    """The parts of ``spans`` (sorted, disjoint flat ranges) in regions of dtype ``param``,
    numbered one after another in its elements: ``(i, a, b, at)``, flat ``[a, b)`` being
    part of ``spans[i]`` and elements ``[at, at + (b - a) // width)``. In a layout of one
    dtype, every span whole.

    Example::

        typed(layout, [(0, layout.numel)], torch.float32)  # the float32 space, region by region
    """
    w = width(layout, param)
    regions = [(r.start, r.end) for r in layout.regions if r.dtype == param]
    out, pos, k = [], 0, 0
    for i, (a, b) in enumerate(spans):
        while k < len(regions) and regions[k][1] <= a:
            k += 1
        j = k
        while j < len(regions) and regions[j][0] < b:
            lo, hi = max(a, regions[j][0]), min(b, regions[j][1])
            if lo < hi:
                out.append((i, lo, hi, pos))
                pos += (hi - lo) // w
            j += 1
    return out


def stream_parts(
    layout: FlatLayout, start: int, end: int, only_trainable: bool, param: torch.dtype
) -> Parts:
    """What an optimizer file of flat range ``[start, end)`` stores of a stream of
    parameters of dtype ``param``: ``(a, b, at)``, flat ``[a, b)`` being its tensor's
    elements ``[at, ...)`` (:func:`~._plan.stored_parts`, in the stream's space)."""
    stored = stored_parts(layout, start, end, only_trainable)
    if not layout.mixed:
        return stored
    return [(a, b, pos) for _, a, b, pos in typed(layout, [(a, b) for a, b, _ in stored], param)]


@dataclass(frozen=True)
class Held:
    """A stream's state as a load holds it whole for an optimizer over whole parameters:
    the trainable parameters' part of its space (with frozen ones, their runs alone), one
    piece after another. ``parts``: ``(a, b, at)``; ``numel``: its elements.

    Example::

        held = Held.of(layout, torch.bfloat16)
        held.reads(0, held.numel)   # every flat piece of it, with its position
    """

    parts: tuple[tuple[int, int, int], ...]
    numel: int
    width: int

    @classmethod
    def of(cls, layout: FlatLayout, param: torch.dtype) -> Held:
        grads = layout.grad_layout
        if not layout.mixed:  # the gradient space's elements (a layout of one dtype)
            runs = [(0, layout.numel, 0)] if grads is layout else layout.trainable_runs()
            return cls(tuple(runs), grads.numel, 1)
        spans = [(0, layout.numel)] if grads is layout else layout.trainable_runs()
        parts = [(a, b, pos) for _, a, b, pos in typed(layout, [s[:2] for s in spans], param)]
        w = width(layout, param)
        return cls(tuple(parts), sum((b - a) // w for a, b, _ in parts), w)

    def reads(self, x: int, y: int) -> Parts:
        """The flat pieces of its elements ``[x, y)``: ``(a, b, at)``, flat ``[a, b)`` being
        elements ``[at, ...)``."""
        out, w = [], self.width
        for a, b, c in self.parts:
            lo, hi = max(x, c), min(y, c + (b - a) // w)
            if lo < hi:
                out.append((a + (lo - c) * w, a + (hi - c) * w, lo))
        return out

    def position(self, a: int) -> int:
        """Where flat position ``a`` (of a trainable parameter) lies in it."""
        k = bisect.bisect_right(self.parts, (a, math.inf)) - 1  # the part starting at or before
        if k >= 0 and a < self.parts[k][1]:
            return self.parts[k][2] + (a - self.parts[k][0]) // self.width
        raise ValueError(f"a: expected a position of a trainable parameter, got {a}")


@dataclass(frozen=True)
class Space:
    """A stream's space seen from the buffer: which element of it each flat position of a
    region of dtype ``param`` is (its regions one after another, in their elements).

    Example::

        space = Space.of(layout, torch.float32)
        space.element(layout.regions[1].start)   # 0: the first fp32 region's first element
    """

    param: torch.dtype
    starts: tuple[int, ...]  # the dtype's regions, flat
    ends: tuple[int, ...]
    ats: tuple[int, ...]  # where each begins in the space
    width: int

    @classmethod
    def of(cls, layout: FlatLayout, param: torch.dtype) -> Space:
        parts = typed(layout, [(0, layout.numel)], param)
        return cls(
            param,
            tuple(a for _, a, _, _ in parts),
            tuple(b for _, _, b, _ in parts),
            tuple(at for *_, at in parts),
            width(layout, param),
        )

    def element(self, a: int) -> int:
        """The element at flat position ``a`` (inside or at the end of a region of the
        dtype), or the next region's first one (elsewhere: before it)."""
        k = bisect.bisect_right(self.starts, a) - 1
        if k >= 0 and a <= self.ends[k]:
            return self.ats[k] + (a - self.starts[k]) // self.width
        if k + 1 < len(self.starts):
            return self.ats[k + 1]
        return self.ats[-1] + (self.ends[-1] - self.starts[-1]) // self.width if self.ats else 0


# -- optimizer.flat_state in metadata.json ------------------------------------------------------
def canonical(streams: Sequence[Stream], layout: FlatLayout) -> list[Stream]:
    """``streams`` in the order the files hold them and ``flat_state`` lists them: by key
    (in the order given), each key's by parameter dtype in the order of ``layout.dtypes``."""
    keys = list(dict.fromkeys(s.key for s in streams))
    return sorted(streams, key=lambda s: (keys.index(s.key), layout.dtypes.index(s.param)))


def streams_json(streams: Sequence[Stream], layout: FlatLayout) -> dict[str, Any]:
    """``optimizer.flat_state``: each key's dtype (one dtype), or each key's dtype per
    parameter dtype (several: ``{"exp_avg": {"bfloat16": "float32", ...}}``), in
    :func:`canonical` order."""
    if not layout.mixed:
        return {s.key: dtype_name(s.dtype) for s in streams}
    out: dict[str, dict[str, str]] = {}
    for s in canonical(streams, layout):
        out.setdefault(s.key, {})[dtype_name(s.param)] = dtype_name(s.dtype)
    return out


def parse_flat_state(v: Any, layout: FlatLayout) -> tuple[Stream, ...]:
    """The streams ``optimizer.flat_state`` describes, strictly typed (:class:`Invalid`)."""
    path = "optimizer.flat_state"
    streams = []
    for key, spec in expect_dict(v, path).items():
        where = at(path, key)
        if not layout.mixed:
            streams.append(Stream(str(key), layout.torch_dtype, expect_dtype(spec, where)))
            continue
        names = [dtype_name(d) for d in layout.dtypes]
        spec = expect_dict(spec, where)
        if not spec or set(spec) - set(names):
            raise Invalid(where, f"an object of state dtypes by parameter dtype ({names})", spec)
        for p in names:
            if p in spec:
                dtype = expect_dtype(spec[p], at(where, p))
                streams.append(Stream(str(key), expect_dtype(p, where), dtype, mixed=True))
    return tuple(streams)
