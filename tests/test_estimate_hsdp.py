"""``torchshard estimate --dp-replicate R [--gpus-per-node G]``: hybrid sharding's memory and
per-step communication (issue 23), against ``plan_memory`` and ``plan_comm``, and the
issue's Llama-3 targets at 512 ranks on 80 GiB devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchshard import plan_comm, plan_memory
from torchshard._cli import main
from torchshard._estimate import EstimateError, build_hf_model, estimate_memory, layout_of
from torchshard._parallel.units import resolve_units

CONFIGS = Path(__file__).resolve().parent.parent / "docs" / "configs"
TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
GiB = 2**30


@pytest.fixture
def tiny(tmp_path: Path) -> str:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_estimate_is_the_plans(tiny, capsys):
    model = build_hf_model(tiny, {}, torch.bfloat16)
    layout = layout_of(model, None)
    units = resolve_units(model, layout)
    for world, replicas in ((8, 2), (8, 4), (8, 8), (12, 3)):
        args = [tiny, "--world-size", str(world), "--dp-replicate", str(replicas)]
        est = _json(capsys, *args, "--gpus-per-node", "4")
        assert (est["dp_replicate"], est["dp_shard"]) == (replicas, world // replicas)
        for name, shard in (("replicated", False), ("sharded", True), ("full", "full")):
            kw = {"units": units} if shard == "full" else {}
            plan = plan_memory(layout, world, shard=shard, dp_replicate=replicas, **kw)
            worst = max(plan, key=lambda r: r.total)
            got = est[name]
            assert (got["rank"], got["total"]) == (worst.rank, worst.total), (name, world)
            assert {k: got[k] for k in worst.as_dict()} == worst.as_dict()
            comm = plan_comm(layout, world, shard=shard, dp_replicate=replicas,
                             gpus_per_node=4, **kw)  # fmt: skip
            assert got["comm"] == comm.to_dict(), (name, world)
        assert est["sharded"]["comm"]["bytes_across_replicas"] > 0
        assert est["replicated"]["comm"]["dp_replicate"] == 1  # DDP over every rank


def test_one_replica_prints_what_it_printed(tiny, capsys):
    argv = ["estimate", tiny, "--world-size", "8"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--dp-replicate", "1"]) == 0
    assert capsys.readouterr().out == plain
    assert not any(line.startswith(("hsdp", "per step")) for line in plain.splitlines())


def test_the_hsdp_lines(tiny, capsys):
    argv = ["estimate", tiny, "--world-size", "16", "--dp-replicate", "4", "--gpus-per-node", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    hsdp = next(line for line in out if line.startswith("hsdp"))
    assert "dp_replicate 4 x dp_shard 4" in hsdp
    assert "shard groups: 4 consecutive ranks, within a node" in hsdp
    assert "replicate groups: 4 ranks, 2 nodes" in hsdp
    at = out.index(next(line for line in out if line.startswith("per step")))
    block = out[at + 1 : at + 6]
    assert block[0].startswith("  replicated: data-parallel group (16 ranks, 2 nodes): all-reduce")
    assert block[1].startswith("  sharded:    shard group (4 ranks, within a node): reduce ")
    assert "all-gather" in block[1] and "(ring: " in block[1]
    assert block[2].lstrip().startswith("replicate group (4 ranks, 2 nodes): all-reduce")
    assert block[3].startswith("  full:       shard group (4 ranks, within a node): all-gather")
    assert "stripe all-reduced across replicas" in next(x for x in out if x.startswith("transient"))
    # no replicas, a node size: the block alone, every mode over the data-parallel group
    assert main(["estimate", tiny, "--world-size", "16", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert not any(line.startswith("hsdp") for line in out.splitlines())
    assert "  sharded:    data-parallel group (16 ranks, 2 nodes)" in out


def test_smallest_dp_shard_is_the_first_divisor_that_fits(tiny, capsys):
    model = build_hf_model(tiny, {}, torch.bfloat16)
    layout = layout_of(model, None)
    units = resolve_units(model, layout)
    world = 24
    for shard, name in ((True, "sharded"), ("full", "full")):
        kw = {"units": units} if shard == "full" else {}
        totals = {
            n: max(r.total for r in plan_memory(layout, world, shard=shard,
                                                dp_replicate=world // n, **kw))
            for n in range(1, world + 1) if world % n == 0
        }  # fmt: skip
        assert len(set(totals.values())) == len(totals)  # each divisor a different total
        for budget in [*totals.values(), min(totals.values()) - 1]:
            for replicas in (1, 4):
                est = estimate_memory(layout, world_size=world, modes=(shard,), units=units,
                                      device_memory=budget, dp_replicate=replicas)  # fmt: skip
                first = next((n for n, t in totals.items() if t <= budget), None)
                m = est.modes[0]
                assert m.min_shard_size == first, (name, budget)
                assert m.min_shard_total == (None if first is None else totals[first])
        budget = totals[4]  # fits from dp_shard 4: printed with and without --dp-replicate
        assert totals[1] > totals[2] > budget
        flag = "--shard" if shard is True else "--full"
        argv = ["estimate", tiny, "--world-size", str(world), flag]
        for extra in ([], ["--dp-replicate", "12", "--gpus-per-node", "2"]):
            assert main([*argv, "--device-memory", str(budget), *extra]) == 0
            out = capsys.readouterr().out
            said = f"the smallest dp_shard that fits at world size {world} is 4"
            assert said in out, out
            assert ("does not fit at world size 24 (dp_shard 2, dp_replicate 12)" in out) == (
                bool(extra)
            )
            assert ("shard groups span 2 nodes" in out) == bool(extra)


def test_dp_replicate_must_divide_the_world_size(tiny, capsys):
    assert main(["estimate", tiny, "--world-size", "8", "--dp-replicate", "3"]) == 2
    err = capsys.readouterr().err
    assert "--dp-replicate 3: expected a divisor of --world-size 8" in err
    assert "one of 1, 2, 4, 8" in err
    for bad in ("0", "-1", "two"):
        for flag in ("--dp-replicate", "--gpus-per-node"):
            assert main(["estimate", tiny, "--world-size", "8", flag, bad]) == 2
            err = capsys.readouterr().err
            assert flag in err and f"expected a positive integer, got {bad!r}" in err
    layout = layout_of(build_hf_model(tiny, {}, torch.bfloat16), None)
    for bad in (3, 0, True, 16):
        with pytest.raises(EstimateError, match="dp_replicate: expected a positive divisor"):
            estimate_memory(layout, world_size=8, dp_replicate=bad)
    with pytest.raises(EstimateError, match="gpus per node"):
        estimate_memory(layout, world_size=8, gpus_per_node=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "params", "smallest"),
    [("llama-3-70b.json", 70_553_706_496, 32), ("llama-3.1-405b.json", 405_853_388_800, 256)],
)
def test_llama3_at_512_ranks_on_80gib(config, params, smallest, capsys):
    """The issue's targets (the design study computes 32 and 256): fully sharded, 64 x 8 does
    not fit; the smallest dp_shard that does is the first divisor of 512 whose plan fits."""
    path = str(CONFIGS / config)
    argv = [path, "--world-size", "512", "--full", "--device-memory", "80GiB"]
    est = _json(capsys, *argv, "--dp-replicate", "64", "--gpus-per-node", "8")
    assert est["parameters"] == params
    full = est["full"]
    assert full["total"] > 80 * GiB  # at dp_shard 8
    assert full["min_shard_size"] == smallest and full["min_shard_total"] <= 80 * GiB
    model = build_hf_model(path, {}, torch.bfloat16)
    layout = layout_of(model, None)
    units = resolve_units(model, layout)
    below = plan_memory(layout, 512, shard="full", dp_replicate=1024 // smallest, units=units)
    assert max(r.total for r in below) > 80 * GiB  # half the shard size: over
    comm = full["comm"]  # node-local shard groups; only the replicas' all-reduce crosses
    assert (comm["group_size"], comm["group_nodes"], comm["replica_nodes"]) == (8, 1, 64)
    assert main(["estimate", *argv, "--dp-replicate", "64", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    nodes = smallest // 8
    assert (
        f"full:       does not fit at world size 512 (dp_shard 8, dp_replicate 64); the smallest "
        f"dp_shard that fits at world size 512 is {smallest} ("
    ) in out
    assert f"dp_replicate {512 // smallest}; shard groups span {nodes} nodes)" in out
