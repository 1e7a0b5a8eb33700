"""``torchshard estimate --tp T [--tp-plan PLAN]``: tensor parallelism's per-rank memory (issue
25), against the layout a split ``FlatParamModule`` lays out (built on meta: a stand-in mesh,
no collective) and ``plan_memory`` / ``plan_comm``, and Llama-3 70B at tp=8 over 64 GPUs.

``--world-size`` counts every rank: ``N / T`` of them data-parallel. ``T`` must divide the
world size, the node (``--gpus-per-node``), the heads and the kv heads.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from gpt import GPT, TP_PLAN, GPTConfig

from torchshard import FlatParamModule, plan_comm, plan_memory
from torchshard._cli import main
from torchshard._estimate import EstimateError, build_hf_model, estimate_memory, layout_of
from torchshard._parallel.units import resolve_units

pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parent.parent / "docs" / "configs"
TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
MODES = (("replicated", False), ("sharded", True), ("full", "full"))


@pytest.fixture
def tiny(tmp_path: Path) -> str:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _split(model: torch.nn.Module, tp: int, plan: object = "auto") -> FlatParamModule:
    """``model`` (on meta) split as a tp rank of a ``tp``-rank mesh splits it."""
    mesh = types.SimpleNamespace(tp=None, tp_rank=0, tp_size=tp)
    return FlatParamModule(model, tp_plan=plan, mesh=mesh)


def test_the_estimate_is_the_split_modules_plan(tiny, capsys):
    for world, tp, replicas in ((4, 2, 1), (8, 2, 2), (8, 4, 1)):
        fm = _split(build_hf_model(tiny, {}, torch.bfloat16), tp)
        layout, dp = fm.layout, world // tp
        units = resolve_units(fm.module, layout)
        args = [tiny, "--world-size", str(world), "--tp", str(tp), "--dp-replicate", str(replicas)]
        est = _json(capsys, *args, "--gpus-per-node", "4")
        assert (est["tp"], est["dp_size"], est["dp_shard"]) == (tp, dp, dp // replicas)
        assert est["numel"] == layout.numel < est["whole_numel"]
        for name, shard in MODES:
            kw = {"units": units} if shard == "full" else {}
            plan = plan_memory(layout, dp, shard=shard, dp_replicate=replicas, **kw)
            worst = max(plan, key=lambda r: r.total)
            got = est[name]
            assert (got["rank"], got["total"]) == (worst.rank, worst.total), (name, world, tp)
            assert {k: got[k] for k in worst.as_dict()} == worst.as_dict()
            comm = plan_comm(fm.tp.whole, dp, shard=shard, dp_replicate=replicas, tp=tp,
                             tp_plan=fm.tp.plan, gpus_per_node=4, **kw)  # fmt: skip
            assert got["comm"] == comm.to_dict(), (name, world, tp)
            assert comm.to_dict()["tp_backward_per_token"] > 0


def test_a_factory_with_its_plan(capsys, monkeypatch):
    examples = Path(__file__).resolve().parent.parent / "examples"
    monkeypatch.chdir(examples)
    est = _json(capsys, "gpt:gpt_small", "--world-size", "4", "--tp", "2",
                "--tp-plan", "gpt:TP_PLAN", "--dtype", "fp32")  # fmt: skip
    with torch.device("meta"):
        fm = _split(GPT(GPTConfig.preset("small")), 2, TP_PLAN)
    assert est["numel"] == fm.layout.numel
    got = est["sharded"]
    worst = max(plan_memory(fm.layout, 2, shard=True), key=lambda r: r.total)
    assert {k: got[k] for k in worst.as_dict()} == worst.as_dict()
    # the factory's GPT declares no plan of its own: "auto" has nothing to take
    assert main(["estimate", "gpt:gpt_small", "--world-size", "4", "--tp", "2"]) == 2
    assert "--tp 2: tp_plan='auto': GPT declares no tensor-parallel plan" in capsys.readouterr().err


def test_llama_3_70b_at_tp_8_over_64_gpus(capsys):
    config = str(CONFIGS / "llama-3-70b.json")
    args = ["--world-size", "64", "--gpus-per-node", "8", "--replicated"]
    one = _json(capsys, config, *args)
    eight = _json(capsys, config, *args, "--tp", "8")
    # the estimate's local layout is the one the split module lays out
    with torch.device("meta"):
        fm = _split(build_hf_model(config, {}, torch.bfloat16), 8)
    assert eight["numel"] == fm.layout.numel and eight["whole_numel"] == one["numel"]
    assert (eight["dp_size"], eight["replicated"]["comm"]["group_nodes"]) == (8, 8)
    # every parameter the plan names costs 1/8; norms (and what the plan leaves) all of it
    split = {fm.tp.whole.slots[i].name for i, s in enumerate(fm.tp.splits) if s is not None}
    kept = sum(s.numel for s in fm.tp.whole if s.name not in split)
    assert 0 < kept < one["parameters"] // 1000  # the norms, replicated
    p1, p8 = one["replicated"]["parameters"], eight["replicated"]["parameters"]
    padding = 2 * len(fm.layout) * fm.layout.align  # bytes, bf16
    assert abs(8 * p8 - p1 - 7 * 2 * kept) <= 8 * padding
    print(f"llama-3-70b replicated parameters per rank: tp1 {p1 / 2**30:.2f} GiB, "
          f"tp8 {p8 / 2**30:.2f} GiB ({p1 / p8:.3f}x)")  # fmt: skip


def test_tp_must_divide_the_world_the_node_and_the_heads(tiny, capsys):
    config = str(CONFIGS / "llama-3-70b.json")  # 64 heads, 8 kv heads
    cases = [
        ([tiny, "--world-size", "8", "--tp", "3"], "--tp 3: expected a divisor of --world-size 8"),
        ([tiny, "--world-size", "16", "--tp", "16", "--gpus-per-node", "8"],
         "--tp 16: expected a divisor of --gpus-per-node 8: a tensor-parallel group stays"),
        ([config, "--world-size", "64", "--tp", "16"],
         "num_key_value_heads = 8 heads do not divide over tp=16"),
        ([tiny, "--world-size", "16", "--tp", "16"],
         "num_attention_heads = 8 heads do not divide over tp=16"),
        ([tiny, "--world-size", "8", "--tp", "8"],
         "num_key_value_heads = 4 heads do not divide over tp=8"),
        ([tiny, "--world-size", "8", "--tp", "2", "--dp-replicate", "3"],
         "--dp-replicate 3: expected a divisor of --world-size 8 / --tp 2 = 4"),
        ([tiny, "--world-size", "4", "--tp", "2", "--lora-rank", "4"],
         "--tp 2: expected no --lora-rank with it"),
        ([tiny, "--world-size", "4", "--tp", "2", "--tp-plan", "/nonexistent.json"],
         "--tp-plan '/nonexistent.json': expected 'auto', a JSON file"),
        ([tiny, "--world-size", "4", "--tp", "0"], "expected a positive integer, got '0'"),
    ]  # fmt: skip
    for argv, said in cases:
        assert main(["estimate", *argv]) != 0, argv
        err = capsys.readouterr().err
        assert said in err, (argv, err)
    layout = layout_of(build_hf_model(tiny, {}, torch.bfloat16), None)
    for bad in (3, 0, True):
        with pytest.raises(EstimateError, match="tp: expected a positive divisor"):
            estimate_memory(layout, world_size=8, tp=bad, tp_plan={"lm_head": "colwise"})
    with pytest.raises(EstimateError, match="tp: expected a divisor of gpus per node 6"):
        estimate_memory(layout, world_size=8, tp=4, tp_plan={"lm_head": "colwise"}, gpus_per_node=6)
    with pytest.raises(EstimateError, match="tp_plan: tp=2 needs the plan"):
        estimate_memory(layout, world_size=8, tp=2)


def test_the_table_says_the_mesh_and_the_tp_traffic(tiny, capsys):
    argv = [tiny, "--world-size", "8", "--tp", "2", "--gpus-per-node", "4"]
    assert main(["estimate", *argv]) == 0
    out = capsys.readouterr().out
    assert "at world size 8 (tp 2 x data-parallel 4)" in out
    assert "per tp rank (whole model: " in out
    assert "tp group (2 ranks, within a node), per token of a rank's micro-batch" in out
    # 4 data-parallel ranks, 2 a node
    assert "data-parallel group (4 ranks, 2 nodes)" in out
    assert main(["estimate", *argv, "--dp-replicate", "2"]) == 0
    out = capsys.readouterr().out  # shard group {0, 1} of dp ranks: global {0, 2}, one node
    assert (
        "dp_replicate 2 x dp_shard 2 (shard groups: 2 data-parallel ranks, 2 apart, within a node"
        in out
    )
