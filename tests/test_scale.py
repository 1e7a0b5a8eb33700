"""A 70B Llama layout (transformers, built on meta) at 8 to 1024 ranks: pure arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from scale import WORLD_SIZES, llama_layout, metadata_bytes

from torchshard import plan_memory
from torchshard._flat.geometry import element_ranges
from torchshard._parallel.memory import padded_numel


@pytest.fixture(scope="module")
def layout():
    layout = llama_layout()
    assert 70.0e9 < layout.param_numel < 71.0e9 and layout.dtype == "bfloat16"
    return layout


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_slices_are_equal_contiguous_and_padded_minimally(layout, world):
    align = layout.align_bytes // 2
    padded = padded_numel(layout, world, shard=True)
    slices = element_ranges(padded, world, align)
    assert padded % (world * align) == 0 and 0 <= padded - layout.numel < world * align
    assert slices[0][0] == 0 and slices[-1][1] == padded
    assert all(a == prev for (a, _), (_, prev) in zip(slices[1:], slices))
    assert len({b - a for a, b in slices}) == 1  # every rank owns the same amount


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_per_rank_memory_is_what_the_formula_says(layout, world):
    plan = plan_memory(layout, world, shard=True, optimizer="adamw")
    padded = padded_numel(layout, world, shard=True)
    size = padded // world
    trainable = sum(s.numel for s in layout if s.requires_grad)
    for r in plan:
        assert r.parameters == r.gradients == 2 * padded  # full bf16 buffers on every rank
        assert r.master == 2 * 4 * size  # fp32 master slice and its gradient
        # AdamW: 8 bytes per element of the slice (+ a 4-byte step per parameter piece)
        assert 8 * (size - (padded - layout.numel)) <= r.optimizer - 4 * pieces(
            layout, r.rank, size
        )
        assert r.optimizer - 4 * pieces(layout, r.rank, size) <= 8 * size
    elementwise = sum(r.optimizer - 4 * pieces(layout, r.rank, size) for r in plan)
    assert elementwise == 8 * trainable  # each element's state on exactly one rank
    # 12 bytes per parameter / N instead of 12 per parameter (fp32 state + master)
    worst = max(r.optimizer + r.master // 2 for r in plan)
    assert worst <= 12 * layout.param_numel / world * 1.01


def pieces(layout, rank: int, size: int) -> int:
    a, b = rank * size, (rank + 1) * size
    return sum(1 for s in layout if s.requires_grad and s.offset < b and s.end > a)


def test_checkpoint_metadata_grows_with_ranks_plus_parameters_not_their_product(layout):
    half = llama_layout(num_hidden_layers=40)
    for lay in (layout, half):
        for world in WORLD_SIZES:
            size = metadata_bytes(lay, world)
            # a fixed part, ~200 bytes per parameter (layout, groups, scalar state) and a few
            # hundred per rank (its files and their records): no parameters-times-ranks term
            assert size <= 16 * 1024 + 200 * len(lay) + 400 * world, (len(lay), world, size)
    assert metadata_bytes(layout, 1024) < 1024 * 1024  # under 1 MB for 70B at 1024 ranks
