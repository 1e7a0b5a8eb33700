"""The planners under tensor parallelism (issue 25): ``plan_memory(..., tp=T, tp_plan=...)`` and
``plan_comm``, against split modules and a real dp2 x tp2 run on gloo.

- The whole layout split by a plan, by name (:func:`tp_layout`), is the layout a split
  ``FlatParamModule`` lays out (a GPT with a fused qkv and a tied head, a transformers Llama
  with ``tp_plan="auto"``); a split parameter costs ``1/T`` of its bytes.
- In a dp2 x tp2 run, every mode: ``trainer.memory_stats()`` is ``plan_memory``'s rank to the
  byte, ``trainer.stats`` is ``plan_comm``'s data-parallel bytes per step (the local flat
  buffer's), and the bytes the split layers hand to the tp group are ``tp_activations`` per
  token.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, TP_PLAN, GPTConfig, init_gpt_weights
from multiprocess import run_distributed

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, plan_comm, plan_memory
from torchshard._flat import tp_layers
from torchshard._parallel.footprint import PlanError
from torchshard._parallel.tpcost import tp_dims, tp_layout, tp_traffic

MODES = (False, True, "full")
CFG = GPTConfig.preset("tiny")  # vocab 64, 2 blocks, 2 heads, n_embd 16
B, T = 2, 16  # per data-parallel rank


def _split(model_fn, tp: int, plan) -> tuple:
    """The whole layout and a split module's, built on meta (a stand-in mesh: building
    runs no collective)."""
    with torch.device("meta"):
        whole = FlatParamModule(model_fn()).layout
        mesh = types.SimpleNamespace(tp=None, tp_rank=0, tp_size=tp)
        fm = FlatParamModule(model_fn(), tp_plan=plan, mesh=mesh)
    return whole, fm


def _llama():
    from models import tiny_hf_config
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_hf_config("llama"))


@pytest.mark.parametrize("tp", [1, 2])
def test_the_split_layout_is_the_split_modules(tp):
    whole, fm = _split(lambda: GPT(CFG), tp, TP_PLAN)
    local = tp_layout(whole, tp, TP_PLAN)
    assert local == fm.layout
    assert tp_layout(whole) is whole  # tp=1, no plan: the layout itself
    if tp == 1:  # a mesh without tensor parallelism splits nothing
        assert fm.tp is None
        split = {}
    else:
        assert fm.tp.whole == whole
        split = fm.tp.split_map()
        assert tp_dims(whole, tp, TP_PLAN) == {n: p.dim for n, p in split.items()}
        assert split and "blocks.0.attn.proj.bias" not in split  # added once, after the sum
    for a, b in zip(whole.slots, local.slots):
        assert b.numel == (a.numel // tp if a.name in split else a.numel), a.name
    # the planner on the whole layout with the plan is the planner on the split module's
    for shard in MODES:
        got = plan_memory(whole, 4, shard=shard, tp=tp, tp_plan=TP_PLAN)
        assert got == plan_memory(fm.layout, 4, shard=shard)
        comm = plan_comm(whole, 4, shard=shard, tp=tp, tp_plan=TP_PLAN)
        plain = plan_comm(fm.layout, 4, shard=shard)
        assert (comm.bytes_reduced, comm.bytes_gathered) == (
            plain.bytes_reduced,
            plain.bytes_gathered,
        )


def test_a_transformers_llamas_auto_plan():
    pytest.importorskip("transformers")
    whole, fm = _split(_llama, 2, "auto")
    assert tp_layout(whole, 2, fm.tp.plan) == fm.layout
    split = fm.tp.split_map()
    assert any(".q_proj." in n for n in split) and "model.norm.weight" not in split
    assert "lm_head.weight" in split and "model.layers.0.input_layernorm.weight" not in split
    # the embedding is split exactly when the model's own plan names it
    assert ("model.embed_tokens.weight" in split) == ("model.embed_tokens" in fm.tp.plan)
    with pytest.raises(PlanError, match=r"tp_plan: 'auto' needs the model"):
        tp_layout(whole, 2, "auto")


def test_split_parameters_cost_one_tp_th():
    whole, fm = _split(lambda: GPT(CFG), 2, TP_PLAN)
    split = fm.tp.split_map()
    itemsize = whole.torch_dtype.itemsize
    one = plan_memory(whole, 1, shard=False)[0]
    two = plan_memory(whole, 1, shard=False, tp=2, tp_plan=TP_PLAN)[0]
    saved = sum(s.numel for s in whole if s.name in split) // 2 * itemsize
    # the buffer: whole minus half of every split parameter, up to the alignment padding
    assert one.parameters - two.parameters > 0
    assert abs(one.parameters - two.parameters - saved) < len(whole) * whole.align * itemsize
    assert one.optimizer - two.optimizer == 2 * saved  # AdamW's two moments, exactly


def test_bad_plans_raise():
    with torch.device("meta"):
        whole = FlatParamModule(GPT(CFG)).layout
    cases = [
        (dict(tp=2), r"tp_plan: tp=2 needs the plan"),
        (dict(tp=0, tp_plan=TP_PLAN), r"tp: expected a positive integer"),
        (dict(tp=True, tp_plan=TP_PLAN), r"tp: expected a positive integer"),
        (dict(tp=2, tp_plan={"blocks.*.nope": "colwise"}), r"'blocks.\*.nope' names no module"),
        (dict(tp=2, tp_plan={"lm_head": "sideways"}), r"unknown style 'sideways'"),
        (dict(tp=2, tp_plan=["lm_head"]), r"tp_plan: expected a dict"),
        (dict(tp=3, tp_plan=TP_PLAN), r"does not divide over tp=3"),
        # wte and lm_head share their weight: one split under both names
        (dict(tp=2, tp_plan={"lm_head": "colwise"}), r"tied parameter wte.weight gets"),
    ]
    for kw, match in cases:
        for call in (plan_memory, plan_comm):
            with pytest.raises(PlanError, match=match):
                call(whole, 2, shard=True, **kw)
    with pytest.raises(PlanError, match=r"gpus_per_node: tp=4 must divide the node size 6"):
        plan_comm(whole, 2, shard=True, tp=4, tp_plan={"blocks.*.mlp.0": "colwise"},
                  gpus_per_node=6)  # fmt: skip


def test_nodes_hold_gpus_per_node_over_tp_data_parallel_ranks():
    with torch.device("meta"):
        whole = FlatParamModule(GPT(CFG)).layout
    # 16 dp x 2 tp ranks, 8 a node: 4 dp ranks a node; shard groups of 8 span 2 nodes
    plan = plan_comm(whole, 16, shard=True, dp_replicate=2, tp=2, tp_plan=TP_PLAN,
                     gpus_per_node=8)  # fmt: skip
    assert (plan.group_nodes, plan.replica_nodes, plan.tp) == (2, 2, 2)
    assert plan.to_dict()["tp_forward_per_token"] == plan.tp_activations.forward > 0


def test_activation_traffic_counts_each_split_layer():
    with torch.device("meta"):
        whole = FlatParamModule(GPT(CFG)).layout
    c, v, b, n = CFG.n_embd, CFG.vocab_size, 4, CFG.n_layer
    got = tp_traffic(whole, 2, TP_PLAN)
    # forward: the embedding and each rowwise output all-reduced, the logits all-gathered
    assert (got.forward, got.forward_calls) == ((c + 2 * n * c + v) * b, 2 + 2 * n)
    # backward: the input gradient of qkv, mlp.0 and the head all-reduced
    assert (got.backward, got.backward_calls) == ((2 * n * c + c) * b, 2 * n + 1)
    assert tp_traffic(whole, 1, None).step_bytes(1000) == 0


# -- against a real dp2 x tp2 run ---------------------------------------------------------------
class _Counting:
    """``torch.distributed`` as tp_layers sees it, counting the bytes of each collective."""

    def __init__(self) -> None:
        self.bytes, self.calls = 0, 0

    def all_reduce(self, t, *a, **kw):
        self.bytes, self.calls = self.bytes + t.numel() * t.element_size(), self.calls + 1
        return dist.all_reduce(t, *a, **kw)

    def all_gather(self, out, t, *a, **kw):
        self.bytes += sum(o.numel() * o.element_size() for o in out)
        self.calls += 1
        return dist.all_gather(out, t, *a, **kw)

    def __getattr__(self, name):
        return getattr(dist, name)


def _stats(trainer):
    s = trainer.stats
    return s.bytes_reduced, s.bytes_gathered


def _dp2_tp2() -> dict:
    mesh = torchshard.init_mesh(tp=2)
    out = {}
    for shard in MODES:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(CFG)
        fm = FlatParamModule(model, tp_plan=TP_PLAN, mesh=mesh)
        trainer = DistributedTrainer(fm, mesh=mesh, shard=shard, init_fn=init_gpt_weights)
        trainer.make_optimizer(torch.optim.AdamW, lr=1e-3)
        counter = _Counting()
        seen, traffic = [_stats(trainer)], []
        g = torch.Generator().manual_seed(mesh.dp_rank)
        for _ in range(2):
            x, y = (torch.randint(0, CFG.vocab_size, (B, T), generator=g) for _ in range(2))
            trainer.zero_grad()
            tp_layers.dist, before = counter, (counter.bytes, counter.calls)
            try:
                loss = fm(x, y)[1]
                mid = (counter.bytes, counter.calls)
                loss.backward()
            finally:
                tp_layers.dist = dist
            after = (counter.bytes, counter.calls)
            traffic.append((mid[0] - before[0], mid[1] - before[1], after[0] - mid[0],
                            after[1] - mid[1]))  # fmt: skip
            trainer.step()
            seen.append(_stats(trainer))
        units = trainer.units or None
        whole = fm.tp.whole
        memory = plan_memory(whole, mesh.dp_size, shard=shard, tp=2, tp_plan=TP_PLAN, units=units)
        comm = plan_comm(whole, mesh.dp_size, shard=shard, tp=2, tp_plan=TP_PLAN, units=units)
        stats = trainer.memory_stats()
        mine = memory[mesh.dp_rank]
        out[str(shard)] = {
            "held": (stats.parameters, stats.gradients, stats.optimizer, stats.master),
            "planned": (mine.parameters, mine.gradients, mine.optimizer, mine.master),
            "peak": stats.peak_transient,
            "transient": mine.transient,
            "steps": [tuple(b - a for a, b in zip(p, q)) for p, q in itertools.pairwise(seen)],
            "plan": comm.stats(mesh.dp_rank),
            "traffic": traffic,
            "planned traffic": comm.tp_activations,
            "whole buffer": plan_comm(whole, mesh.dp_size, shard=shard, units=None)
            if shard != "full"
            else None,
        }
        trainer.close()
    return out


def test_dp2_tp2_is_its_plans_to_the_byte():
    for rank, got in enumerate(run_distributed(_dp2_tp2, 4, timeout=240)):
        for shard, r in got.items():
            where = f"rank {rank}, shard={shard}"
            assert r["held"] == r["planned"], where
            if shard == "full":
                assert 0 < r["peak"] <= r["transient"], where
            else:
                assert r["peak"] == r["transient"] == 0, where
            plan = r["plan"]
            expected = (plan["bytes_reduced"], plan["bytes_gathered"])
            assert expected[0] > 0 and r["steps"] == [expected] * 2, where
            if r["whole buffer"] is not None:  # the local buffer's bytes: less than the whole's
                assert plan["bytes_reduced"] < r["whole buffer"].bytes_reduced, where
            t = r["planned traffic"]
            tokens = B * T
            want = (t.forward * tokens, t.forward_calls, t.backward * tokens, t.backward_calls)
            assert r["traffic"] == [want] * 2, where


def test_a_plan_of_module_names_plans_like_its_globs():
    """The CLI passes a resolved plan, one literal module name per entry (562 for a
    Llama-3-70B): it plans exactly as the globs it came from, and a literal name that names
    no module still raises."""
    from torchshard._flat.tp_plan import matches

    with torch.device("meta"):
        whole = FlatParamModule(GPT(CFG)).layout
    modules = dict.fromkeys(n.rpartition(".")[0] for s in whole for n in s.names)
    literal = {}
    for glob, style in TP_PLAN.items():
        for m in modules:
            if m and matches(glob, m):
                literal.setdefault(m, style)
    assert len(literal) > len(TP_PLAN)  # the globs were expanded
    for call in (plan_memory, plan_comm):
        assert call(whole, 2, shard=True, tp=2, tp_plan=literal) == call(
            whole, 2, shard=True, tp=2, tp_plan=TP_PLAN
        )
        with pytest.raises(PlanError, match=r"'blocks.0.nope' names no module"):
            call(whole, 2, shard=True, tp=2, tp_plan={**literal, "blocks.0.nope": "colwise"})
