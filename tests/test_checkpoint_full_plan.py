"""The arithmetic of a fully sharded save (``checkpoint/_plan.py``): pure, no processes.

A save moves each unit's stripes to the files' ranges with one all-to-all per unit. The
oracle simulates that all-to-all with the split sizes ``exchange_splits`` computes, element
by element: every rank must end with exactly the elements of its range (the weight tiles of
:func:`weight_tiles`, or the optimizer's :func:`state_ranges`), whatever the world size, the
units and the alignment.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from gpt import GPT, GPTConfig
from torch import nn

import torchshard
from torchshard import FlatLayout
from torchshard._parallel.units import layout_units, unit_geometry
from torchshard.checkpoint._plan import exchange_splits, state_ranges, weight_runs, weight_tiles


def gpt(align_bytes: int, n_layer: int = 3) -> FlatLayout:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=24))
    return torchshard.FlatParamModule(model, align_bytes=align_bytes).layout


def tiny() -> FlatLayout:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    return torchshard.FlatParamModule(model, align_bytes=16).layout


LAYOUTS = {"gpt-4": lambda: gpt(4), "gpt-256": lambda: gpt(256), "gpt-1": lambda: gpt(4, 1), "tiny": tiny}  # fmt: skip
WORLDS = [1, 2, 3, 4, 7, 16]


def test_exchange_splits_example():
    assert exchange_splits([(0, 6), (6, 10)], [(0, 4), (4, 10)], 0) == ([4, 2], [4, 0])
    assert exchange_splits([(0, 6), (6, 10)], [(0, 4), (4, 10)], 1) == ([0, 4], [2, 4])


def test_exchange_splits_refuses_ranges_that_miss_part_of_the_stripe():
    with pytest.raises(ValueError, match="cover the stripe"):
        exchange_splits([(0, 6), (6, 10)], [(0, 4), (5, 10)], 0)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_weight_tiles_tile_the_buffer_and_hold_each_rank_s_run(name, world):
    layout = LAYOUTS[name]()
    tiles = weight_tiles(layout, world)
    assert len(tiles) == world and tiles[0][0] == 0 and tiles[-1][1] == layout.numel
    for (_, b), (c, _) in itertools.pairwise(tiles):
        assert b == c
    for (lo, hi), (a, b) in zip(weight_runs(layout, world), tiles):
        assert a <= b
        if hi > lo:
            assert a <= layout.slots[lo].offset and layout.slots[hi - 1].end <= b
        else:
            assert a == b  # an empty run holds nothing


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("files", ["weights", "state"])
def test_an_all_to_all_per_unit_puts_every_element_in_its_file_range(name, world, files):
    layout = LAYOUTS[name]()
    dest = weight_tiles(layout, world) if files == "weights" else state_ranges(layout, world)
    got: list[list[int]] = [[] for _ in range(world)]  # what each rank receives, in order
    for unit in layout_units(layout):
        stripes = unit_geometry(unit, world, layout.align).clipped(unit.numel)
        assert stripes[0][0] == unit.start and stripes[-1][1] == unit.end
        splits = [exchange_splits(stripes, dest, r) for r in range(world)]
        for r, (send, recv) in enumerate(splits):
            a, b = stripes[r]
            assert sum(send) == b - a
            assert recv == [splits[p][0][r] for p in range(world)]  # what p sends to r
        # all_to_all_single: rank p's input cut by its send splits, in rank order; rank r's
        # output is the pieces from every p, in rank order
        for r in range(world):
            for p in range(world):
                a, _ = stripes[p]
                send = splits[p][0]
                at = a + sum(send[:r])
                got[r] += range(at, at + send[r])
    for r, (a, b) in enumerate(dest):
        assert got[r] == list(range(a, b)), r
