"""The memory planner for the fully sharded mode (``plan_memory(shard="full")``): the
persistent rows against real trainers, the transient bound against the trainer's peak, the
formulas against the ZeRO paper's Table 1. (Llama-2-70B on 80 GiB devices, and the smallest
world size that fits: tests/test_estimate.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import introspect
import pytest
import torch
import torch.distributed as dist
from models import batch, gpt, tiny_hf_config
from multiprocess import run_distributed

from torchshard import DistributedTrainer, FlatLayout, FlatParamModule, TorchShardError, plan_memory
from torchshard._parallel.memory import PlanError, RankMemory, transient_bytes
from torchshard._parallel.units import (
    Unit,
    layout_units,
    resolve_units,
    stripe_parts,
    unit_geometry,
    unit_pieces,
)

ROOT = Path(__file__).resolve().parent.parent
LLAMA_70B = ROOT / "docs" / "configs" / "llama-2-70b.json"
GB = 10**9  # the ZeRO paper's unit


def _layout(
    blocks: list[int],
    *,
    root: tuple[int, ...] = (),
    dtype: str = "bfloat16",
    frozen: tuple[int, ...] = (),
    align_bytes: int = 16,
) -> FlatLayout:
    """A layout of one weight per block ``layers.<i>.w`` (the "auto" units), then ``root``
    slots ``head.<j>`` (a root unit); the blocks in ``frozen`` do not train."""
    align = align_bytes // torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    slots, at = [], 0
    names = [(f"layers.{i}.w", n, i not in frozen) for i, n in enumerate(blocks)]
    names += [(f"head.{j}", n, True) for j, n in enumerate(root)]
    for name, n, trains in names:
        slots.append([name, [n], at, n, trains, []])
        at += -(-n // align) * align
    return FlatLayout.from_dict(
        {"format": 1, "dtype": dtype, "align_bytes": align_bytes, "numel": at, "slots": slots}
    )


# -- the persistent rows: a rank's stripes -------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_persistent_rows_are_the_stripes(world, dtype):
    layout = _layout([1000, 37, 4096, 999], root=(5, 70), dtype=dtype, frozen=(1,))
    units = layout_units(layout)
    assert [u.kept for u in units] == [False] * 4 + [True]
    plan = plan_memory(layout, world, shard="full", optimizer="adamw")
    geoms = [unit_geometry(u, world, layout.align) for u in units]
    stripe = sum(g.per_rank for g in geoms)
    assert all(g.total == g.per_rank * world for g in geoms)
    # AdamW: 8 bytes of state per trainable element of the rank's stripes (every element is
    # in one rank's), and a 4-byte step for each (parameter, rank holding part of it)
    elements = [0] * world
    pieces = [0] * world
    for u, g in zip(units, geoms):
        for s in layout.slots[u.lo : u.hi]:
            if s.requires_grad:
                for e in range(s.offset, s.end):
                    elements[g.owner(e)] += 1
                for q in range(g.owner(s.offset), g.owner(s.end - 1) + 1):
                    pieces[q] += 1
    assert sum(elements) == sum(s.numel for s in layout if s.requires_grad)
    assert [r.optimizer for r in plan] == [8 * e + 4 * p for e, p in zip(elements, pieces)]
    # what trains is held in fp32 with its gradient: the layout's runs of trainable slots
    # (the gap to the next trainable slot too) cut by the units; the rest of the stripes
    # (frozen weights, other gaps, padding) in the buffer's dtype only (issue 21: no master
    # copy of a frozen weight)
    trained = [0] * world
    for u, g in zip(units, geoms):
        for i in range(u.lo, u.hi):
            s = layout.slots[i]
            if not s.requires_grad:
                continue
            nxt = layout.slots[i + 1] if i + 1 < len(layout.slots) else None
            end = min(nxt.offset, u.end) if nxt is not None and nxt.requires_grad else s.end
            for e in range(s.offset, end):
                trained[g.owner(e)] += 1
    assert sum(trained) < world * stripe
    for r in plan:
        m, rest = trained[r.rank], stripe - trained[r.rank]
        if dtype == "float32":  # the shard is the weights the optimizer updates
            assert (r.parameters, r.gradients, r.master) == (4 * stripe, 4 * m, 0)
        else:  # the fp32 master of what trains and its gradient; the frozen part in bf16
            assert (r.parameters, r.gradients, r.master) == (2 * rest, 0, 8 * m)
        assert r.persistent == r.parameters + r.gradients + r.optimizer + r.master
        assert r.total == r.persistent + r.transient
        assert r.as_dict()["transient"] == r.transient > 0


@pytest.mark.parametrize("frozen", [(), (1,), (0, 2, 3)])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_ranks_parts_and_rests_tile_each_unit(world, frozen):
    """Every position of a padded unit is in exactly one rank's stripe, either in a part
    (the master's: every trainable element, of its dtype) or in the rest (never a trainable
    element); without frozen parameters there is no rest."""
    layout = _layout([1000, 37, 4096, 999], root=(5, 70), frozen=frozen)
    for u in layout_units(layout):
        g = unit_geometry(u, world, layout.align)
        pieces = unit_pieces(layout, u, g)
        seen = [0] * g.total
        master = set()
        for q in range(world):
            parts, rest = stripe_parts(pieces, *g.range(q))
            assert parts == sorted(parts) and all(d == torch.bfloat16 for *_, d in parts)
            for a, b in [(a, b) for a, b, _ in parts] + rest:
                for e in range(a, b):
                    seen[e - g.start] += 1
            master |= {e for a, b, _ in parts for e in range(a, b)}
            assert rest == [] or frozen, (q, rest)
        assert seen == [1] * g.total, u.name
        trains = {
            e for s in layout.slots[u.lo : u.hi] if s.requires_grad for e in range(s.offset, s.end)
        }
        frozen_elements = {
            e
            for s in layout.slots[u.lo : u.hi]
            if not s.requires_grad
            for e in range(s.offset, s.end)
        }
        assert trains <= master and not frozen_elements & master, u.name


def test_one_rank_holds_every_piece():
    layout = _layout([100, 200], root=(8,), dtype="float32", frozen=(0,))
    (r,) = plan_memory(layout, 1, shard="full", optimizer="adamw")
    assert r.optimizer == 8 * (200 + 8) + 4 * 2  # two trainable parameters, one piece each
    (r,) = plan_memory(layout, 1, shard="full", optimizer="sgd")
    assert r.optimizer == 4 * (200 + 8)
    (r,) = plan_memory(layout, 1, shard="full", optimizer="sgd-nomomentum")
    assert r.optimizer == 0


def test_the_other_modes_hold_nothing_transient():
    layout = _layout([100, 200], root=(8,))
    for shard in (False, True):
        for r in plan_memory(layout, 3, shard=shard):
            assert r.transient == 0 and r.total == r.persistent
            assert list(r.as_dict()) == [
                "parameters",
                "gradients",
                "optimizer",
                "master",
                "transient",
            ]


# -- the transient bound ---------------------------------------------------------------------
def test_transient_formula():
    layout = _layout([1000, 3000, 2000], root=(500,), dtype="bfloat16")  # align 8 elements
    units = layout_units(layout)
    world = 4
    p = [unit_geometry(u, world, layout.align).total for u in units]
    assert p == [1024, 3008, 2016, 512]  # each padded to a multiple of 4 * 8
    largest, kept = 3008, 512
    for prefetch in (0, 1, 2):
        expected = 2 * ((3 + prefetch) * largest + 2 * kept)
        assert transient_bytes(units, world, layout.align, 2, prefetch=prefetch) == expected
        plan = plan_memory(layout, world, shard="full", prefetch=prefetch)
        assert {r.transient for r in plan} == {expected}
    # kept gathered from forward to backward: every unit, two unit gradients, kept gradients
    expected = 2 * (sum(p) + 2 * largest + kept)
    plan = plan_memory(layout, world, shard="full", reshard_after_forward=False)
    assert {r.transient for r in plan} == {expected}
    # no unit to gather in turn: only the kept ones, weights and gradients
    (only,) = [Unit(0, "<root>", 0, len(layout), 0, layout.numel, root=True, kept=True)]
    (r,) = plan_memory(layout, 1, shard="full", units=[only])
    assert r.transient == 2 * 2 * layout.numel


def test_auto_units_from_names_are_the_trainers():
    """``units=None`` plans with the units ``DistributedTrainer(shard="full")`` resolves."""
    from transformers import AutoModelForCausalLM

    models = {"gpt": gpt()}
    for arch in ("gpt2", "llama"):
        with torch.device("meta"):
            models[arch] = AutoModelForCausalLM.from_config(tiny_hf_config(arch))
    for name, model in models.items():
        layout = FlatLayout.from_module(model)
        assert layout_units(layout) == resolve_units(model, layout), name
        assert sum(not u.kept for u in layout_units(layout)) == 2, name


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"shard": "fully"}, "shard"),
        ({"shard": 1}, "shard"),
        ({"shard": "full", "prefetch": -1}, "prefetch"),
        ({"shard": "full", "reshard_after_forward": None}, "reshard_after_forward"),
        ({"shard": "full", "optimizer": "lion"}, "optimizer"),
        ({"shard": True, "optimizer": "lion"}, "optimizer"),
        ({"shard": "full", "units": []}, "units"),
    ],
)
def test_bad_arguments(kw, match):
    layout = _layout([100, 200], root=(8,))
    with pytest.raises(PlanError, match=match) as e:
        plan_memory(layout, 2, **kw)
    assert isinstance(e.value, TorchShardError) and isinstance(e.value, ValueError)
    with pytest.raises(PlanError, match="world_size"):
        plan_memory(layout, 0, shard="full")


# -- against real trainers ---------------------------------------------------------------------
CASES = [
    # dtype, optimizer, prefetch, reshard_after_forward
    (torch.float32, "adamw", 1, True),
    (torch.bfloat16, "adamw", 1, True),
    (torch.float32, "sgd", 0, True),
    (torch.float32, "adamw", 2, False),
]


def _measured(cases: list) -> list[dict]:
    out = []
    for dtype, optimizer, prefetch, reshard in cases:
        model = gpt()
        model.wpe.weight.requires_grad_(False)  # a frozen parameter: no state, no piece
        trainer = DistributedTrainer(
            FlatParamModule(model, dtype=dtype),
            shard="full",
            prefetch=prefetch,
            reshard_after_forward=reshard,
        )
        if optimizer == "adamw":
            trainer.make_optimizer(torch.optim.AdamW, lr=1e-3)
        else:
            trainer.make_optimizer(torch.optim.SGD, lr=1e-3, momentum=0.9)
        for step in range(2):  # the optimizer's state exists after a step
            trainer.zero_grad()
            x, y = batch(step + 10 * dist.get_rank())
            trainer.module(x, y)[1].backward()
            trainer.step()
        out.append(
            {
                "memory": trainer.memory_bytes(),
                "peak": trainer.memory_stats().peak_transient,
                "units": trainer.units,
                # what the unit buffers hold in storage (the counter above is the mode's own)
                "stored": introspect.unit_storage_bytes(trainer),
            }
        )
        trainer.close()
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_is_what_the_trainer_holds(world):
    ranks = run_distributed(_measured, world, CASES, timeout=240)
    model = gpt()
    model.wpe.weight.requires_grad_(False)
    for k, (dtype, optimizer, prefetch, reshard) in enumerate(CASES):
        layout = FlatLayout.from_module(model, dtype=dtype)
        plan = plan_memory(
            layout,
            world,
            shard="full",
            optimizer=optimizer,
            prefetch=prefetch,
            reshard_after_forward=reshard,
        )
        assert list(ranks[0][k]["units"]) == layout_units(layout)
        for rank, r in enumerate(ranks):
            measured, planned = r[k]["memory"], plan[rank].as_dict()
            case = (rank, dtype, optimizer, prefetch, reshard)
            # persistent: to the byte; transient: the unit buffers are freed between steps
            assert measured == {**planned, "transient": 0} and r[k]["stored"] == 0, case
            # and during the step they never took more than the bound
            assert 0 < r[k]["peak"] <= planned["transient"], case


# -- the ZeRO paper, Table 1 / Figure 1 ----------------------------------------------------------
PSI = 7_500_000_000  # 60 blocks of 125M elements: at 64 ranks of 8-element (16-byte) alignment
# neither a block nor the whole is a multiple of 512 elements, so the planner pads a little.


def _zero_layout(dtype: str = "bfloat16") -> FlatLayout:
    layout = _layout([PSI // 60] * 60, dtype=dtype)
    assert layout.param_numel == PSI and layout.numel == PSI
    return layout


@pytest.mark.parametrize(
    ("world", "full_gb"),
    [(4, 30.0), (16, 7.5), (64, 1.875), (1024, 0.1171875)],  # 16 Psi / N
)
def test_zero_table_1_fully_sharded(world, full_gb):
    """P_os+g+p of the ZeRO paper (Rajbhandari et al. 2020, Table 1 / Figure 1, Psi = 7.5B,
    mixed-precision Adam, K = 12): 16 Psi / N bytes of model states per device; 1.875 GB at
    64 devices. Ours: the fp32 master stripes and their gradient (8 bytes) and AdamW's two
    fp32 states (8 bytes) of the trainable elements, plus a 4-byte step per piece."""
    worst = max(plan_memory(_zero_layout(), world, shard="full"), key=lambda r: r.total)
    assert worst.parameters == worst.gradients == 0  # no bf16 shard persists
    assert math.isclose(worst.persistent / GB, full_gb, rel_tol=0.02)
    assert math.isclose(worst.persistent, 16 * PSI / world, rel_tol=1e-4)  # padding only
    # the unsharded unit buffers come on top: four 125M-element bf16 buffers (prefetch 1)
    block = unit_geometry(layout_units(_zero_layout())[0], world, 8).total
    assert worst.transient == 2 * 4 * block


def test_zero_table_1_optimizer_sharding():
    """P_os of the ZeRO paper at 64 devices: 4 Psi + K Psi / N = 31.4 GB (2 + 2 bytes of fp16
    weights and gradients everywhere, the 12 bytes of fp32 weights, momentum and variance
    sharded). Our ``shard=True`` also keeps the fp32 gradient of the master slice (4 bytes
    more per sharded element): 4 Psi + 16 Psi / N = 31.875 GB at 64, which is still within 2%
    of the paper's 31.4 (1.5% over) but is our own figure, not the paper's formula: the gap
    is 4 Psi / N (at 4 devices 60 GB against the paper's 52.5)."""
    layout = _zero_layout()
    worst = max(plan_memory(layout, 64, shard=True), key=lambda r: r.total)
    padded = -(-PSI // 512) * 512  # the flat buffer, padded to 64 equal aligned slices
    assert worst.parameters == worst.gradients == 2 * padded  # bf16, on every rank
    assert worst.master == 2 * 4 * padded // 64  # the fp32 slice and its gradient
    assert math.isclose(worst.total, 4 * PSI + 16 * PSI / 64, rel_tol=1e-6)
    assert math.isclose(worst.total / GB, 31.875, rel_tol=1e-6)
    paper = (4 * PSI + 12 * PSI / 64) / GB
    assert round(paper, 1) == 31.4
    assert math.isclose(worst.total / GB, paper, rel_tol=0.02)
    # the baseline (2 + 2 + K) Psi = 120 GB is what our replicated mode holds in fp32 (16 Psi:
    # weights, gradients, two Adam states); in bf16 it keeps the state in bf16 (8 Psi, 60 GB)
    (fp32,) = plan_memory(_zero_layout("float32"), 1, shard=False)
    assert math.isclose(fp32.total / GB, 120, rel_tol=1e-6)
    (bf16,) = plan_memory(layout, 1, shard=False)
    assert math.isclose(bf16.total / GB, 60, rel_tol=1e-6)


def test_unknown_unit_names_are_all_counted():
    with torch.device("meta"):
        model = gpt()
    layout = FlatLayout.from_module(model)
    names = [f"blocks.{i}" for i in range(7, 12)]
    with pytest.raises(TorchShardError) as e:
        resolve_units(model, layout, ["blocks.0", *names])
    assert "no module named 'blocks.10', 'blocks.11', 'blocks.7' and 2 more;" in str(e.value)


def test_rank_memory_stays_positional():
    """The four persistent fields keep their positions; ``transient`` defaults to 0."""
    r = RankMemory(0, 1, 2, 3, 4)
    assert r.transient == 0 and r.total == r.persistent == 10
