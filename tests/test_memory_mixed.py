"""Memory plans of a layout whose parameters keep several dtypes (bf16 linears, fp32 norms)
in one byte buffer: parameter and gradient bytes as they lie in the buffer, optimizer state
per element in its dtype (replicated) or in fp32 (sharded), and in the sharded modes one fp32
master of every element of the rank's part (the trainer keeps the few fp32 ones there too).
Hand-computed; the bounds hold every plan; and the plan is what a trainer holds."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from torchshard import FlatParamModule, plan_memory
from torchshard._parallel.footprint import typed
from torchshard._parallel.memory import bounds, floor
from torchshard._parallel.modes import ALIASES
from torchshard._parallel.units import layout_units

BF16, FP32 = torch.bfloat16, torch.float32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False).to(BF16)  # 64 elements, 128 bytes
        self.norm = nn.LayerNorm(8)  # fp32: weight and bias, 32 bytes each


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 4, bias=False).to(BF16)  # 32 elements, 64 bytes


def layout(frozen: tuple[str, ...] = ()):
    with torch.device("meta"):
        model = Net()
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return FlatParamModule(model).layout


def rows(plan):
    return [(r.parameters, r.gradients, r.optimizer, r.master, r.transient) for r in plan]


def test_the_layout_in_bytes():
    lay = layout()
    assert lay.mixed and lay.numel == 448
    assert [(s.offset, s.end) for s in lay] == [
        (0, 128), (128, 160), (160, 192), (192, 320), (320, 352), (352, 384), (384, 448)
    ]  # fmt: skip
    assert [(r.dtype, r.start, r.end) for r in lay.regions] == [
        (BF16, 0, 128), (FP32, 128, 192), (BF16, 192, 320), (FP32, 320, 384), (BF16, 384, 448)
    ]  # fmt: skip
    # positions as elements of their dtype; padding past the end counts in the last one's
    assert typed(lay, 96, 224) == [(BF16, 16), (FP32, 16), (BF16, 16)]
    assert typed(lay, 416, 480) == [(BF16, 16), (BF16, 16)]


def test_replicated():
    # parameters and gradients: the 448 bytes; AdamW: 2 states per element in its own dtype,
    # (64 + 64 + 32) bf16 * 2 + 32 fp32 * 4 = 448 bytes, and a 4-byte step per parameter
    assert rows(plan_memory(layout(), 3, shard=False)) == [(448, 448, 2 * 448 + 4 * 7, 0, 0)] * 3
    # no momentum: no state; SGD with it: one
    assert rows(plan_memory(layout(), 1, shard=False, optimizer="sgd"))[0][2] == 448


def test_sharded():
    # 3 ranks: the 448 bytes padded to 3 slices of 160 (multiples of 16 bytes)
    # rank 0 [0, 160): layers.0.lin (64 bf16), layers.0.norm.weight (8 fp32)
    # rank 1 [160, 320): layers.0.norm.bias (8 fp32), layers.1.lin (64 bf16)
    # rank 2 [320, 480): layers.1.norm (16 fp32), head (32 bf16), 32 bytes of padding (bf16's)
    # state in fp32 for every element: 2 * 4 bytes each; a master (and its gradient) in fp32
    # of every element of the slice, padding included: 2 * 4 bytes each
    assert rows(plan_memory(layout(), 3, shard=True)) == [
        (480, 480, 8 * 72 + 4 * 2, 8 * 72, 0),
        (480, 480, 8 * 72 + 4 * 2, 8 * 72, 0),
        (480, 480, 8 * 48 + 4 * 3, 8 * (16 + 32 + 16), 0),
    ]
    # a bf16 master: of every element too (state in bf16)
    assert rows(plan_memory(layout(), 3, shard=True, master_dtype=BF16))[0] == (
        480, 480, 4 * 72 + 4 * 2, 2 * 2 * 72, 0
    )  # fmt: skip


def test_fully_sharded():
    # units: layers.0 [0, 192), layers.1 [192, 384), the root head [384, 448) (kept); at 2
    # ranks each unit's stripes are halves: rank 0's are bf16 alone (48 + 48 + 16 elements),
    # rank 1's 48 bf16 elements and 32 fp32 ones
    lay = layout()
    assert [(u.name, u.start, u.end, u.kept) for u in layout_units(lay)] == [
        ("layers.0", 0, 192, False), ("layers.1", 192, 384, False), ("<root head.weight..head.weight>", 384, 448, True)
    ]  # fmt: skip
    # transient: bytes, (3 + 1) * 192 for the largest unit + 2 * 64 for the kept one
    transient = 4 * 192 + 2 * 64
    assert rows(plan_memory(lay, 2, shard="full")) == [
        # the bf16 stripes as fp32 masters, with their gradients: 2 * 112 * 4
        (0, 0, 8 * 112 + 4 * 3, 2 * 112 * 4, transient),
        # the stripes of a mixed layout are fp32 masters whole, their fp32 elements too
        (0, 0, 8 * 80 + 4 * 7, 2 * 80 * 4, transient),
    ]


def test_frozen():
    # the first linear frozen: the gradient space is the other 6 slots, 320 bytes, laid
    # out from offset 128 on like the buffer (sliced in place: no copy)
    lay = layout(frozen=("layers.0.lin.weight",))
    assert lay.grad_layout.numel == 320 and lay.trainable_suffix == 128
    state = 2 * (32 * 4 + 96 * 2)  # 32 fp32 and 96 bf16 elements train
    assert rows(plan_memory(lay, 1, shard=False)) == [(448, 320, state + 4 * 6, 0, 0)]
    # 2 ranks: [0, 160) norm0 (16 fp32) and 48 bf16 of layers.1.lin; [160, 320) its 16 others,
    # norm1 (16 fp32) and head (32 bf16)
    assert rows(plan_memory(lay, 2, shard=True)) == [
        (448, 320, 8 * 64 + 4 * 3, 8 * 64, 0),
        (448, 320, 8 * 64 + 4 * 4, 8 * 64, 0),
    ]


HOW = [
    {},
    {"optimizer": "sgd"},
    {"optimizer": "sgd-nomomentum"},
    {"prefetch": 2, "reshard_after_forward": False},
    {"master_dtype": BF16},
]
FROZEN = {
    "all": (),
    "head": ("head.weight",),
    "middle": ("layers.0.norm.bias", "layers.1.lin.weight"),
    "linears": ("layers.0.lin.weight", "layers.1.lin.weight", "head.weight"),
}


@pytest.mark.parametrize("frozen", list(FROZEN))
def test_bounds_hold_the_plan_at_every_world_size(frozen):
    lay = layout(FROZEN[frozen])
    for shard, how in itertools.product(ALIASES, HOW):
        lowest = floor(lay, shard=shard, **how)
        for n in range(1, 33):
            worst = max(r.total for r in plan_memory(lay, n, shard=shard, **how))
            low, high = bounds(lay, n, shard=shard, **how)
            assert lowest <= low <= worst <= high, (frozen, shard, how, n, lowest, low, worst, high)


def test_every_rank_sums_to_the_whole():
    """Over the ranks, the sharded state and masters add up to every trainable element's once
    (their padding's masters aside)."""
    lay = layout()
    for n in (1, 2, 3, 5, 7):
        plan = plan_memory(lay, n, shard=True, optimizer="sgd")  # one state, no scalar
        assert sum(r.optimizer for r in plan) == 4 * (160 + 32)
        padded = plan[0].gradients
        assert sum(r.master for r in plan) == 8 * (192 + (padded - 448) // 2)
