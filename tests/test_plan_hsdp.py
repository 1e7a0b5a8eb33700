"""The planners under hybrid sharding (issue 23): ``plan_memory(..., dp_replicate=R)`` and
``plan_comm``, against the plain plans, the trainer's own bucket planner and mesh numbering,
and real trainers on gloo.

- ``dp_replicate=1`` is today's plan, exactly; with ``R`` replicas each rank holds what its
  shard rank holds in a plain plan at ``S = world // R`` (fully sharded: plus one stripe of
  the largest trainable unit, the all-reduce in flight).
- ``plan_comm`` is what ``trainer.stats`` counts per step, to the byte: in every plain mode at
  3 ranks (uneven cuts, an unused head, frozen parameters, bf16 with an fp32 reduce), and in
  a 2 x 2 hybrid ``shard=True`` trainer, whose shard-group bytes equal a plain 2-rank
  trainer's and whose persistent memory equals ``plan_memory(..., dp_replicate=2)``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from models import Blocks
from multiprocess import run_distributed
from sharded_harness import Heads, Model, batch

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, plan_comm, plan_memory
from torchshard._flat.geometry import Geometry
from torchshard._parallel.buckets import plan_buckets
from torchshard._parallel.footprint import PlanError
from torchshard._parallel.memory import bounds, replica_stripe_bytes
from torchshard._parallel.mesh import mesh_ranks
from torchshard._parallel.units import layout_units

MODES = (False, True, "full")
ADAMW = dict(lr=1e-3)


def _layout(model: torch.nn.Module, dtype: torch.dtype = torch.float32, frozen: bool = False):
    if frozen:
        model.blocks[0].requires_grad_(False)
    return FlatParamModule(model, align_bytes=4 * dtype.itemsize, dtype=dtype).layout


def _layouts() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "gpt fp32": _layout(Heads()),
        "gpt bf16": _layout(Heads(), torch.bfloat16),
        "gpt frozen": _layout(Heads(), frozen=True),
        "blocks": FlatParamModule(Blocks()).layout,
        # 6 elements, 16 a slice: at 3 ranks and more, slices of padding alone
        "tiny": FlatParamModule(torch.nn.Linear(5, 1), align_bytes=64).layout,
    }


# -- plan_memory ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shard", MODES)
def test_one_replica_is_todays_plan(shard):
    for name, layout in _layouts().items():
        for world in (1, 2, 3, 4, 8):
            today = plan_memory(layout, world, shard=shard)
            assert plan_memory(layout, world, shard=shard, dp_replicate=1) == today, name
            assert bounds(layout, world, shard=shard, dp_replicate=1) == bounds(
                layout, world, shard=shard
            )
            comm = plan_comm(layout, world, shard=shard, dp_replicate=1)
            assert comm.across == () and comm.group_size == world and comm.dp_replicate == 1


@pytest.mark.parametrize("shard", MODES)
def test_replicas_hold_the_plan_at_the_shard_size(shard):
    for name, layout in _layouts().items():
        units = layout_units(layout)
        for world, replicas in ((8, 2), (8, 4), (8, 8), (6, 3), (12, 2)):
            plan = plan_memory(layout, world, shard=shard, dp_replicate=replicas)
            assert [r.rank for r in plan] == list(range(world))
            if shard is False:  # DDP over every rank, whatever the mesh
                assert plan == plan_memory(layout, world, shard=shard), name
                continue
            n = world // replicas
            plain = plan_memory(layout, n, shard=shard)
            extra = replica_stripe_bytes(layout, units, n) if shard == "full" else 0
            assert shard != "full" or extra > 0
            for q, r in enumerate(plan):
                mine = plain[q % n]
                assert r.as_dict() == {**mine.as_dict(), "transient": mine.transient + extra}
            low, high = bounds(layout, world, shard=shard, dp_replicate=replicas)
            worst = max(r.total for r in plan)
            assert low <= worst <= high, (name, world, replicas)


def test_the_stripe_in_flight_is_the_largest_trainable_units():
    layout = FlatParamModule(Blocks()).layout  # embed (root), 4 blocks, head (root)
    units = layout_units(layout)
    align = layout.align
    for shards in (1, 2, 3, 4, 8):
        # a stripe of a unit: its elements padded to shards * align, one shard of it, fp32
        stripe = [-(-u.numel // (shards * align)) * align * 4 for u in units]
        assert replica_stripe_bytes(layout, units, shards) == max(stripe)
    frozen = Blocks()
    for b in frozen.blocks:
        b.requires_grad_(False)
    layout = FlatParamModule(frozen).layout
    units = layout_units(layout)
    trains = [u for u in units if u.root]  # only the embedding and the head train
    stripe = [-(-u.numel // (2 * align)) * align * 4 for u in trains]
    assert replica_stripe_bytes(layout, units, 2) == max(stripe)
    assert max(stripe) < max(-(-u.numel // (2 * align)) * align * 4 for u in units)


@pytest.mark.parametrize("bad", [3, 0, -2, True, 2.0, "2", 16])
def test_dp_replicate_must_divide_the_world_size(bad):
    layout = _layouts()["gpt fp32"]
    for shard in MODES:
        for call in (plan_memory, bounds, plan_comm):
            with pytest.raises(PlanError, match=r"dp_replicate: expected a positive divisor of "):
                call(layout, 8, shard=shard, dp_replicate=bad)


# -- plan_comm, pure -----------------------------------------------------------------------------
def test_sharded_reduction_is_the_buckets_that_hold_parameters():
    """The trainer's own bucket planner (cut at the slice starts) as the oracle: a bucket of
    padding alone is never reduced."""
    for name, layout in _layouts().items():
        grads = layout.grad_layout
        itemsize = grads.torch_dtype.itemsize
        for world in range(2, 10):
            plan = plan_comm(layout, world, shard=True)
            space = Geometry.of(grads, world, pad=True)
            cuts = tuple(a for a, _ in space.ranges())
            for bucket_bytes in (64, 4096, 2**30):
                buckets = plan_buckets(grads, bucket_bytes, total=space.total, cuts=cuts)
                reduced = sum(b.numel for b in buckets if b.trainable) * itemsize
                assert plan.bytes_reduced == reduced, (name, world, bucket_bytes)
            assert plan.bytes_gathered == space.total * layout.torch_dtype.itemsize


@pytest.mark.parametrize("shard", [True, "full"])
def test_the_shard_group_moves_what_a_plain_run_at_its_size_moves(shard):
    for name, layout in _layouts().items():
        for world, replicas in ((8, 2), (8, 4), (12, 3)):
            n = world // replicas
            hybrid = plan_comm(layout, world, shard=shard, dp_replicate=replicas)
            plain = plan_comm(layout, n, shard=shard)
            assert (hybrid.bytes_reduced, hybrid.bytes_gathered) == (
                plain.bytes_reduced,
                plain.bytes_gathered,
            ), name
            assert (hybrid.group_size, hybrid.dp_replicate, len(hybrid.across)) == (
                n,
                replicas,
                world,
            )
            # replicas of one shard rank send the same; the cuts tile what is reduced
            assert hybrid.across == tuple(hybrid.across[q % n] for q in range(world))
            if shard is True:
                assert sum(hybrid.across[:n]) == plain.bytes_reduced
            else:
                assert sum(hybrid.across[:n]) == hybrid.bytes_reduced


def test_which_groups_cross_nodes_is_the_meshs_numbering():
    for world, replicas, per_node in ((16, 2, 8), (16, 4, 8), (16, 1, 8), (24, 4, 8), (8, 2, 3)):
        n = world // replicas
        plan = plan_comm(_layouts()["blocks"], world, shard=True, dp_replicate=replicas,
                         gpus_per_node=per_node)  # fmt: skip
        groups = mesh_ranks((replicas, n, 1))
        nodes = {dim: max(len({g // per_node for g in ranks}) for ranks in groups[dim])
                 for dim in ("dp_shard", "dp_replicate")}  # fmt: skip
        assert plan.group_nodes == nodes["dp_shard"], (world, replicas, per_node)
        assert plan.replica_nodes == (nodes["dp_replicate"] if replicas > 1 else None)


def test_ring_bytes_sent():
    layout = _layouts()["gpt fp32"]
    full = plan_comm(layout, 8, shard="full", dp_replicate=4)
    assert full.group_sent == (full.bytes_reduced + full.bytes_gathered) * 1 // 2
    assert full.replica_sent == 2 * 3 * full.bytes_across_replicas // 4
    ddp = plan_comm(layout, 8, shard=False, dp_replicate=4)  # DDP over all 8
    assert (ddp.group_size, ddp.dp_replicate, ddp.bytes_across_replicas) == (8, 1, 0)
    assert ddp.group_sent == 2 * 7 * ddp.bytes_reduced // 8 and ddp.replica_sent == 0


# -- against real trainers -----------------------------------------------------------------------
def _stats(trainer: DistributedTrainer) -> tuple[int, int, int]:
    s = trainer.stats
    return s.bytes_reduced, s.bytes_gathered, s.bytes_across_replicas


def _per_step(trainer: DistributedTrainer, steps: int, flags: bool) -> list[tuple[int, ...]]:
    """What ``trainer.stats`` adds at each of ``steps`` steps (the fully sharded mode also
    gathers while it initializes: deltas, not totals)."""
    rank, seen = dist.get_rank(), [_stats(trainer)]
    for step in range(steps):
        trainer.zero_grad()
        kw = dict(use_aux=rank == 0) if flags else {}
        trainer.module(*batch(rank, step), **kw)[1].backward()
        trainer.step()
        seen.append(_stats(trainer))
    return [tuple(b - a for a, b in zip(x, y)) for x, y in itertools.pairwise(seen)]


CASES = {  # dtype, reduce_dtype, frozen
    "fp32": (torch.float32, None, False),
    "bf16 reduced in fp32": (torch.bfloat16, torch.float32, False),
    "frozen block": (torch.float32, None, True),
}


def _plain_modes() -> dict:
    out = {}
    for shard in MODES:
        for case, (dtype, reduce_dtype, frozen) in CASES.items():
            torch.manual_seed(0)
            model = Heads()
            if frozen:
                model.blocks[0].requires_grad_(False)
            fm = FlatParamModule(model, align_bytes=4, dtype=dtype)
            trainer = DistributedTrainer(
                fm, shard=shard, bucket_mb=0.004, reduce_dtype=reduce_dtype
            )
            trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
            got = _per_step(trainer, 3, flags=True)  # aux on rank 0 only: zeros elsewhere
            plan = plan_comm(fm.layout, trainer.world_size, shard=shard,
                             units=trainer.units or None, reduce_dtype=reduce_dtype)  # fmt: skip
            out[f"{shard} {case}"] = (got, plan.stats(trainer.rank))
            trainer.close()
    for shard in MODES:  # 6 elements, 16 a slice: ranks 1 and 2 own padding alone
        torch.manual_seed(0)
        fm = FlatParamModule(torch.nn.Linear(5, 1), align_bytes=64)
        trainer = DistributedTrainer(fm, shard=shard)
        trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
        seen = [_stats(trainer)]
        for step in range(2):
            trainer.zero_grad()
            fm(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).sum().backward()
            trainer.step()
            seen.append(_stats(trainer))
        got = [tuple(b - a for a, b in zip(x, y)) for x, y in itertools.pairwise(seen)]
        plan = plan_comm(fm.layout, 3, shard=shard, units=trainer.units or None)
        out[f"{shard} tiny"] = (got, plan.stats(trainer.rank))
        trainer.close()
    return out


def test_plan_comm_is_what_the_plain_modes_count():
    for rank, got in enumerate(run_distributed(_plain_modes, 3, timeout=240)):
        assert len(got) == len(MODES) * (len(CASES) + 1)
        for case, (steps, plan) in got.items():
            expected = (plan["bytes_reduced"], plan["bytes_gathered"], 0)
            assert expected[0] > 0 and (expected[1] > 0) == (not case.startswith("False"))
            assert steps == [expected] * len(steps), f"rank {rank}, {case}"
        # weight [0, 5), bias [16, 17) of 48: the slices that hold them reduced, all 3 gathered
        assert 3 * got["True tiny"][1]["bytes_reduced"] == 2 * got["True tiny"][1]["bytes_gathered"]


def _hybrid_2x2(shard: object) -> dict:
    mesh = torchshard.init_mesh(dp_replicate=2)
    out = {}
    for case, (dtype, reduce_dtype, frozen) in CASES.items():
        made = []
        for kw in (dict(mesh=mesh), dict(process_group=mesh.dp_shard)):  # hybrid; plain at 2
            torch.manual_seed(0)
            model = Model()  # every parameter used: the optimizer holds state for each
            if frozen:
                model.blocks[0].requires_grad_(False)
            fm = FlatParamModule(model, align_bytes=4, dtype=dtype)
            trainer = DistributedTrainer(
                fm, shard=shard, bucket_mb=0.004, reduce_dtype=reduce_dtype, **kw
            )
            trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
            made.append(trainer)
        hybrid, plain = made
        got = _per_step(hybrid, 3, flags=False), _per_step(plain, 3, flags=False)
        layout, units = hybrid.module.layout, hybrid.units or None
        memory = plan_memory(layout, 4, shard=shard, dp_replicate=2, units=units)[hybrid.rank]
        comm = plan_comm(
            layout, 4, shard=shard, dp_replicate=2, reduce_dtype=reduce_dtype, units=units
        )
        stats = hybrid.memory_stats()
        out[case] = {
            "steps": got,
            "held": (stats.parameters, stats.gradients, stats.optimizer, stats.master),
            "peak": stats.peak_transient,
            "transient": memory.transient,
            "planned": (memory.parameters, memory.gradients, memory.optimizer, memory.master),
            "persistent": (stats.persistent, memory.persistent),
            "plan": comm.stats(hybrid.rank),
            "replicas": hybrid.replicas,
        }
        for trainer in made:
            trainer.close()
    return out


@pytest.mark.parametrize("shard", [True, "full"])
def test_hybrid_2x2_is_its_plans_to_the_byte(shard):
    for rank, got in enumerate(run_distributed(_hybrid_2x2, 4, shard, timeout=240)):
        for case, r in got.items():
            where = f"rank {rank}, {case}"
            assert r["replicas"] == 2
            assert r["held"] == r["planned"], where
            assert r["persistent"][0] == r["persistent"][1], where
            if shard is True:
                assert r["peak"] == r["transient"] == 0
            elif case != "bf16 reduced in fp32":  # the plan's transient: in the model's dtype
                assert 0 < r["peak"] <= r["transient"], where
            hybrid, plain = r["steps"]
            plan = r["plan"]
            # the shard group moves what a plain 2-rank trainer moves, and what plan_comm says
            for (h_red, h_gat, across), (p_red, p_gat, none) in zip(hybrid, plain):
                assert (h_red, h_gat) == (p_red, p_gat), where
                assert (h_red, h_gat) == (plan["bytes_reduced"], plan["bytes_gathered"]), where
                assert none == 0 and across == plan["bytes_across_replicas"] > 0, where
