"""Geometry: alignment, padding to the world size and each rank's range, in one pure object.

The oracle is the arithmetic it replaced, written out here as the trainer, the memory
planner and the checkpoint each had it.
"""

from __future__ import annotations

import itertools

import pytest

from torchshard import TorchShardError
from torchshard._flat.geometry import Geometry, element_ranges


def old_element_ranges(numel: int, world: int, align: int) -> list[tuple[int, int]]:
    per = -(-numel // world)
    per = -(-per // align) * align
    return [(min(r * per, numel), min((r + 1) * per, numel)) for r in range(world)]


def old_padded_numel(numel: int, world: int, align: int, shard: bool) -> int:
    unit = align * (world if shard else 1)
    return -(-numel // unit) * unit


CASES = list(
    itertools.product([0, 1, 7, 64, 1001, 11545], [1, 2, 3, 4, 7], [1, 2, 4, 8], [False, True])
)


@pytest.mark.parametrize(("numel", "world", "align", "pad"), CASES)
def test_geometry_is_the_arithmetic_it_replaced(numel, world, align, pad):
    g = Geometry(numel, world, align, pad)
    total = old_padded_numel(numel, world, align, pad)
    assert g.total == total
    # the trainer sliced the padded buffer; the checkpoint cut the unpadded layout
    assert g.ranges() == old_element_ranges(total, world, align)
    assert g.clipped(numel) == old_element_ranges(numel, world, align)
    assert element_ranges(numel, world, align) == old_element_ranges(numel, world, align)
    ranges = g.ranges()
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a % align == 0 for a, _ in ranges)
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(ranges))  # contiguous tiling
    if pad:
        assert len({b - a for a, b in ranges}) == 1  # equal slices: one all-gather
    assert [g.range(r) for r in range(world)] == ranges
    for offset in range(total):
        r = g.owner(offset)
        assert ranges[r][0] <= offset < ranges[r][1]


def test_units_are_padded_stripes_at_their_own_offsets():
    # a fully sharded mode cuts the buffer into units, each padded to the world size
    units = [(0, 10), (10, 27), (27, 28)]
    stripes = []
    start = 0
    for a, b in units:
        g = Geometry(b - a, 3, align=2, pad=True, start=start)
        stripes.append(g.ranges())
        start += g.total
    assert stripes == [
        [(0, 4), (4, 8), (8, 12)],
        [(12, 18), (18, 24), (24, 30)],
        [(30, 32), (32, 34), (34, 36)],
    ]
    assert Geometry(17, 3, 2, pad=True, start=12).owner(25) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(numel=-1, world_size=2), "numel: expected >= 0"),
        (dict(numel=4, world_size=0), "world_size: expected >= 1"),
        (dict(numel=4, world_size=2, align=0), "align: expected >= 1"),
    ],
)
def test_bad_geometry_names_the_field(kwargs, match):
    with pytest.raises(TorchShardError, match=match):
        Geometry(**kwargs)


def test_owner_outside_the_buffer_is_an_error():
    with pytest.raises(TorchShardError, match=r"offset: expected one in \[0, 8\), got 8"):
        Geometry(7, 2, align=2, pad=True).owner(8)
