"""What a trainer publishes of its state: local_shards() (what this rank's optimizer
updates, by flat range), memory_stats() / reset_peak_memory(), units, after_load(). The
checkpoint layer and the benchmarks read these instead of the trainer's mode."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from models import Blocks
from multiprocess import run_distributed

import torchshard

MODES = [False, True, "full"]
IDS = ["replicated", "sharded", "full"]


def _publish(shard: bool | str, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    fm = torchshard.FlatParamModule(Blocks(4, 8, 3).to(dtype))
    trainer = torchshard.DistributedTrainer(fm, shard=shard)
    with trainer.gathered():
        whole = torch.cat([p.detach().reshape(-1).float() for p in fm.parameters()])
        flat = torch.zeros(fm.layout.numel)
        for s, p in zip(fm.layout.slots, fm.parameters()):
            flat[s.offset : s.end] = p.detach().reshape(-1).float()
    shards = trainer.local_shards()
    out: dict = {"none": shards is None, "units": len(trainer.units)}
    if shards is not None:  # the optimizer's tensor: an fp32 master of a bf16 buffer
        out["tensor_dtype"] = shards.tensor.dtype
    if shards is not None:
        # every rank's runs, put together, are the whole flat buffer, each element once
        mine = torch.full((fm.layout.numel,), float("nan"))
        covered = torch.zeros(fm.layout.numel)
        for a, b, at in shards.runs:
            mine[a:b] = shards.tensor[at : at + b - a].float()
            covered[a:b] += 1
        dist.all_reduce(covered)
        got = torch.nan_to_num(mine, nan=0.0)
        dist.all_reduce(got)
        slots = torch.zeros(fm.layout.numel, dtype=torch.bool)
        for s in fm.layout.slots:
            slots[s.offset : s.end] = True
        out["covered_once"] = bool((covered[slots] == 1).all())
        out["equal"] = torch.equal(got[slots], flat[slots])
        out["every_matches_runs"] = all(
            (e[trainer.rank][0], e[trainer.rank][1]) == (a, b)
            for (a, b, _), e in zip(
                shards.runs, [e for e in shards.every if e[trainer.rank][1] > e[trainer.rank][0]]
            )
        )
        out["regions_tile"] = shards.regions[0][0] == 0 and all(
            r0[1] == r1[0] for r0, r1 in zip(shards.regions, shards.regions[1:])
        )
    del whole
    # memory: the peak since a reset covers one gathered() block, not construction's
    trainer.reset_peak_memory()
    before = trainer.memory_stats()
    with trainer.gathered():
        during = trainer.memory_stats()
    after = trainer.memory_stats()
    out["mem"] = (before.transient, during.transient, after.transient, after.peak_transient)
    out["dict_equal"] = {
        k: getattr(after, k) for k in trainer.memory_bytes()
    } == trainer.memory_bytes()
    # after_load: edit this rank's shard, then after_load(): units live now show it
    if shards is not None:
        with trainer.gathered():
            with torch.no_grad():
                for a, b, at in shards.runs:
                    shards.tensor[at : at + b - a].fill_(trainer.rank + 1)
                if shard is True:
                    trainer.gather_slices()  # ZeRO: the flat buffer is the weights' home
                else:
                    trainer.after_load()
            vals = torch.cat([p.detach().reshape(-1) for p in fm.parameters()]).unique().tolist()
        out["after_load"] = vals
    trainer.close()
    return out


CASES = [(m, torch.float32) for m in MODES] + [(True, torch.bfloat16), ("full", torch.bfloat16)]


@pytest.mark.parametrize(
    ("shard", "dtype"), CASES, ids=[*IDS, "sharded-bf16-master", "full-bf16-master"]
)
def test_local_shards_cover_the_flat_buffer_once_and_memory_stats_track_the_peak(shard, dtype):
    world = 3
    results = run_distributed(_publish, world, shard, dtype)
    for r in results:
        assert r["none"] == (shard is False)
        assert r["units"] == (5 if shard == "full" else 0)  # roots embed and head, 3 blocks
        assert r["dict_equal"]
        if shard is not False:
            assert r["covered_once"] and r["equal"]
            assert r["every_matches_runs"] and r["regions_tile"]
            assert r["after_load"] == [1.0, 2.0, 3.0]
            assert r["tensor_dtype"] == torch.float32
        before, during, after, peak = r["mem"]
        if shard == "full":
            assert during > before and peak == during and after == before
        else:
            assert before == during == after == peak == 0
