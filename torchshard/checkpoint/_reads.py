"""Reads of a checkpoint's flat tensors into host memory: ranges packed one after another,
what no read wrote zeroed, and flat optimizer state read from what its files store."""

from __future__ import annotations

import torch

from ._metadata import Metadata, Readers
from ._plan import overlap, stored_parts

__all__ = ["Parts", "packed", "read_state", "zero_gaps"]

Parts = list[tuple[int, int, int]]
"""``(start, end, at)``: flat elements ``[start, end)`` are ``[at, at + end - start)`` of what
is read."""


def packed(ranges: list[tuple[int, int]]) -> Parts:
    """``ranges`` read one after the other into one tensor."""
    out, at = [], 0
    for a, b in ranges:
        out.append((a, b, at))
        at += b - a
    return out


def zero_gaps(into: torch.Tensor, written: list[tuple[int, int]]) -> None:
    """Zero what no read wrote (alignment gaps, a stripe's padding), range by range: the rest
    was read, so the buffer is allocated empty rather than zeroed whole."""
    pos = 0
    for a, b in sorted(written):
        if a > pos:
            into[pos:a].zero_()
        pos = max(pos, b)
    if pos < into.numel():
        into[pos:].zero_()


def read_state(
    readers: Readers, meta: Metadata, key: str, parts: Parts, into: torch.Tensor
) -> list[tuple[int, int]]:
    """Read flat state ``key``'s ``parts`` from the optimizer files into ``into``; the ranges
    of ``into`` written (what the files store of them: all, or the trainable parameters')."""
    assert meta.optim is not None
    written = []
    for file, fs, fe in meta.optim.files:
        for ps, pe, pos in stored_parts(meta.layout, fs, fe, meta.optim.trainable_only):
            for rs, re, at in parts:
                ov = overlap((ps, pe), (rs, re))
                if ov is not None:
                    a, b = ov
                    dst = into[at + a - rs : at + b - rs]
                    readers[file].read_into(key, pos + a - ps, pos + b - ps, dst)
                    written.append((at + a - rs, at + b - rs))
    return written
