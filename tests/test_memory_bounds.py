"""``bounds`` and ``floor`` beside ``plan_memory``: the estimator's bracketing of a world size
comes from the same memory model as the plan, and holds the plan at every world size."""

from __future__ import annotations

import itertools

import pytest
import torch

from torchshard import FlatLayout, FullShard, Replicate, ShardOptimizer, plan_memory
from torchshard._parallel.memory import PlanError, bounds, floor
from torchshard._parallel.modes import ALIASES, MODES

N = 40  # every world size up to here


def _layout(sizes: list[int], *, dtype: str, frozen: tuple[int, ...] = (), align_bytes: int = 16):
    """``layers.<i>.w`` (the "auto" units), then two root slots ``head.<j>``."""
    align = align_bytes // torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    slots, at = [], 0
    names = [(f"layers.{i}.w", n, i not in frozen) for i, n in enumerate(sizes)]
    names += [("head.0", 5, True), ("head.1", 70, True)]
    for name, n, trains in names:
        slots.append([name, [n], at, n, trains, []])
        at += -(-n // align) * align
    return FlatLayout.from_dict(
        {"format": 1, "dtype": dtype, "align_bytes": align_bytes, "numel": at, "slots": slots}
    )


LAYOUTS = {
    "uneven fp32": _layout([1000, 37, 4096, 999], dtype="float32", frozen=(1,)),
    "uneven bf16": _layout([1000, 37, 4096, 999], dtype="bfloat16"),
    "tiny bf16": _layout([3, 1, 2], dtype="bfloat16", frozen=(0,)),
    "odd align": _layout([333, 777], dtype="float16", align_bytes=64),
}
HOW = [
    {},
    {"optimizer": "sgd"},
    {"optimizer": "sgd-nomomentum"},
    {"prefetch": 0},
    {"prefetch": 3, "reshard_after_forward": False},
    {"master_dtype": torch.bfloat16},
]


@pytest.mark.parametrize("name", LAYOUTS)
def test_bounds_hold_the_plan_at_every_world_size(name):
    layout = LAYOUTS[name]
    checked = 0
    for shard, how in itertools.product(ALIASES, HOW):
        lowest = floor(layout, shard=shard, **how)
        for n in range(1, N + 1):
            worst = max(r.total for r in plan_memory(layout, n, shard=shard, **how))
            low, high = bounds(layout, n, shard=shard, **how)
            assert lowest <= low <= worst <= high, (name, shard, how, n, lowest, low, worst, high)
            checked += 1
    assert checked == len(ALIASES) * len(HOW) * N


def test_replicated_bounds_are_exact_and_the_same_everywhere():
    layout = LAYOUTS["uneven bf16"]
    (only,) = plan_memory(layout, 1, shard=Replicate())
    for n in (1, 2, 7, 64):
        assert bounds(layout, n, shard=False) == (only.total, only.total)
    assert floor(layout, shard=False) == only.total


def test_bounds_are_exact_without_optimizer_state():
    layout = LAYOUTS["uneven bf16"]  # no state, no scalars: nothing left to bracket
    for shard, n in itertools.product(ALIASES, (1, 2, 5)):
        worst = max(
            r.total for r in plan_memory(layout, n, shard=shard, optimizer="sgd-nomomentum")
        )
        assert bounds(layout, n, shard=shard, optimizer="sgd-nomomentum") == (worst, worst)


def test_floors_say_what_they_count():
    layout = LAYOUTS["uneven bf16"]
    assert floor(layout, shard=True) == 2 * layout.numel * 2  # bf16 weights and gradients
    full = [e for e in MODES if e.gathers]
    assert [e.memory.floor_note for e in full] == ["the unit buffers alone take"]
    assert floor(layout, shard=FullShard(prefetch=0)) < floor(layout, shard=FullShard(prefetch=2))


@pytest.mark.parametrize("world", [1, 3, 8])
def test_a_choice_plans_as_its_alias(world):
    layout = LAYOUTS["uneven bf16"]
    pairs = [
        (Replicate(), {"shard": False}),
        (ShardOptimizer(), {"shard": True}),
        (
            ShardOptimizer(master_dtype=torch.bfloat16),
            {"shard": True, "master_dtype": torch.bfloat16},
        ),
        (FullShard(), {"shard": "full"}),
        (
            FullShard(prefetch=2, reshard_after_forward=False),
            {"shard": "full", "prefetch": 2, "reshard_after_forward": False},
        ),
    ]
    for choice, alias in pairs:
        assert plan_memory(layout, world, shard=choice) == plan_memory(layout, world, **alias)
        assert bounds(layout, world, shard=choice) == bounds(layout, world, **alias)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"shard": FullShard(), "prefetch": 2}, "prefetch: .*pass FullShard\\(prefetch=...\\)"),
        ({"shard": Replicate(), "master_dtype": torch.bfloat16}, "Replicate takes no master"),
        ({"shard": FullShard(units=["layers.0"])}, "units: expected the units the trainer"),
        ({"shard": "fully"}, "shard: expected True, False or 'full', got 'fully'"),
        ({"shard": 1}, "got 1$"),
    ],
)
def test_bad_choices_are_plan_errors(kw, match):
    layout = LAYOUTS["uneven fp32"]
    for fn in (plan_memory, bounds):
        with pytest.raises(PlanError, match=match):
            fn(layout, 2, **kw)
    with pytest.raises(PlanError, match=match):
        floor(layout, **kw)
