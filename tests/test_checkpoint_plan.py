"""Which part of a checkpoint each rank writes (``checkpoint/_plan.py``): pure arithmetic, no processes.

The oracle is element by element: every element of a rank's state range
belongs to the one segment that covers it, or to none (zeros), and the
pieces are exactly the maximal runs of the same owner.
"""

from __future__ import annotations

import random

import pytest
import torch
from gpt import GPT, GPTConfig
from torch import nn

import torchshard
from torchshard import FlatLayout
from torchshard.checkpoint._plan import Piece, plan_share, state_ranges, weight_runs


def layout_of(model: nn.Module, align_bytes: int = 16) -> FlatLayout:
    return torchshard.FlatParamModule(model, align_bytes=align_bytes).layout


def small() -> FlatLayout:
    with torch.device("meta"):
        return layout_of(nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 2)))


def gpt(align_bytes: int) -> FlatLayout:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=24))
    return layout_of(model, align_bytes)


LAYOUTS = {"small": small, "gpt-16": lambda: gpt(16), "gpt-4": lambda: gpt(4), "gpt-256": lambda: gpt(256)}  # fmt: skip


def whole(layout: FlatLayout) -> list[tuple[int, int]]:
    """An optimizer over every parameter: one segment per slot."""
    return [(s.offset, s.end) for s in layout.slots]


def sliced(layout: FlatLayout, world: int) -> list[tuple[int, int]]:
    """The sharded trainer's: each rank's part of each trainable parameter in its range."""
    out = []
    for s0, e0 in state_ranges(layout, world):
        for s in layout.slots:
            a, b = max(s.offset, s0), min(s.end, e0)
            if a < b and s.requires_grad:
                out.append((a, b))
    return out


def oracle(segments: list[tuple[int, int]], s0: int, e0: int) -> list[Piece]:
    owner = [None] * (e0 - s0)
    for i, (a, b) in enumerate(segments):
        for x in range(max(a, s0), min(b, e0)):
            assert owner[x - s0] is None, "segments overlap"
            owner[x - s0] = i
    runs: list[Piece] = []
    for x, o in enumerate(owner, start=s0):
        if runs and runs[-1].segment == o:
            runs[-1] = Piece(runs[-1].start, x + 1, o)
        else:
            runs.append(Piece(x, x + 1, o))
    return runs


def test_a_small_layout_by_hand():
    layout = (
        small()
    )  # 0.weight [0, 15), 0.bias [16, 21), 1.* [24, 29) [32, 37), 2.* [40, 50) [52, 54)
    plan = plan_share(layout, 2, 1, whole(layout))
    assert (plan.rank, plan.world, plan.slots, plan.span) == (1, 2, (2, 6), (24, 54))
    assert plan.state_range == (28, 56)
    assert plan.pieces == (
        Piece(28, 29, 2),
        Piece(29, 32, None),
        Piece(32, 37, 3),
        Piece(37, 40, None),
        Piece(40, 50, 4),
        Piece(50, 52, None),
        Piece(52, 54, 5),
        Piece(54, 56, None),
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 64])
@pytest.mark.parametrize("kind", ["whole", "sliced", "frozen"])
def test_pieces_are_the_runs_of_who_owns_each_element(name, world, kind):
    layout = LAYOUTS[name]()
    rng = random.Random(f"{name}-{world}-{kind}")
    segments = whole(layout) if kind != "sliced" else sliced(layout, world)
    if kind == "frozen":  # parameters the optimizer does not hold: zeros in the file
        segments = [s for s in segments if rng.random() < 0.6]
    rng.shuffle(segments)  # in the optimizer's order, not the layout's
    ranges = state_ranges(layout, world)
    covered = []
    for rank in range(world):
        plan = plan_share(layout, world, rank, segments)
        s0, e0 = plan.state_range
        assert (s0, e0) == ranges[rank]
        assert list(plan.pieces) == oracle(segments, s0, e0)
        covered += [(p.start, p.end) for p in plan.pieces]
    # the ranks' pieces tile the flat buffer once, in order
    assert [a for a, _ in covered] == [0, *(b for _, b in covered[:-1])]
    assert covered[-1][1] == layout.numel


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 100])
def test_weight_runs_and_spans_tile_the_slots(world):
    layout = gpt(16)
    runs = weight_runs(layout, world)
    assert len(runs) == world
    assert [lo for lo, _ in runs] == [0, *(hi for _, hi in runs[:-1])]
    assert runs[-1][1] == len(layout.slots)
    for rank in range(world):
        plan = plan_share(layout, world, rank)
        lo, hi = plan.slots
        assert (lo, hi) == runs[rank]
        if hi > lo:
            assert plan.span == (layout.slots[lo].offset, layout.slots[hi - 1].end)
        else:  # more ranks than parameters
            assert plan.span == (0, 0)


def test_without_flat_optimizer_state_nothing_is_planned_for_it():
    layout = small()
    for rank in range(3):
        plan = plan_share(layout, 3, rank)
        assert plan.state_range == (0, 0)
        assert plan.pieces == ()


def test_state_ranges_are_aligned():
    for align_bytes in (4, 16, 256):
        layout = gpt(align_bytes)
        align = align_bytes // layout.torch_dtype.itemsize
        for world in (2, 3, 4):
            assert all(s % align == 0 for s, _ in state_ranges(layout, world))
