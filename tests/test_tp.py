"""Tensor parallelism on the flat layout: a split GPT against one process (float64), in
every data-parallel mode, its init, norm and sync, and the errors of a bad plan."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, TP_PLAN, GPTConfig, init_gpt_weights
from multiprocess import run_distributed
from torch import nn

import torchshard
from torchshard._flat.tp_plan import Split, local_layout, matches, resolve_plan

CFG = GPTConfig.preset("tiny")


def _reference(dropout: float = 0.0) -> GPT:
    """The one-process model, initialized from seed 0 as a meta-built one is."""
    torch.manual_seed(0)
    ref = GPT(
        GPTConfig.preset("tiny") if not dropout else GPTConfig(**{**vars(CFG), "dropout": dropout})
    )
    torch.manual_seed(0)
    ref.apply(init_gpt_weights)
    return ref


def _batches(n: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 64, (rows, 16), generator=g),
            torch.randint(0, 64, (rows, 16), generator=g),
        )
        for _ in range(n)
    ]


def _gathered(fm: torchshard.FlatParamModule, of: str = "param") -> dict[str, torch.Tensor]:
    out = {}
    for i, s in enumerate(fm.layout.slots):
        p = fm.module.get_parameter(s.name)
        t = p.detach() if of == "param" else p.grad
        out[s.name] = fm.tp.gather(i, t)
    return out


def _tp2_forward_backward() -> dict[str, float]:
    torch.set_default_dtype(torch.float64)
    ref = _reference()
    mesh = torchshard.init_mesh(tp=2)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(CFG)
    fm = torchshard.FlatParamModule(model, tp_plan=TP_PLAN, mesh=mesh)
    fm.bind(torch.empty(fm.numel))
    torch.manual_seed(0)
    fm.init_weights(init_gpt_weights)
    init_equal = all(torch.equal(w, ref.get_parameter(n)) for n, w in _gathered(fm).items())
    ((x, y),) = _batches(1, 3)
    logits_ref, loss_ref = ref(x, y)
    loss_ref.backward()
    logits, loss = fm(x, y)
    loss.backward()
    grads = _gathered(fm, "grad")
    return {
        "init_equal": init_equal,
        "logits": (logits - logits_ref).abs().max().item(),
        "loss": (loss - loss_ref).abs().item(),
        "grads": max((g - ref.get_parameter(n).grad).abs().max().item() for n, g in grads.items()),
        "local": fm.layout.numel,
        "whole": fm.tp.whole.numel,
        "layout_pure": local_layout(fm.tp.whole, fm.tp.split_map(), 2) == fm.layout,
    }


def test_tp2_matches_one_process_and_inits_its_slices() -> None:
    for got in run_distributed(_tp2_forward_backward, 2, timeout=120):
        assert got["init_equal"]  # meta init at TP=2: slices of the one-process init, bitwise
        assert got["logits"] <= 1e-12 and got["loss"] <= 1e-12 and got["grads"] <= 1e-12
        assert got["layout_pure"]
        assert got["local"] < got["whole"]  # each rank lays out its pieces only


def _dp2_tp2(shard: object, steps: int, replicas: int = 1) -> dict[str, object]:
    torch.set_default_dtype(torch.float64)
    ref = _reference()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mesh = torchshard.init_mesh(dp_replicate=replicas, tp=2)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(CFG)
    fm = torchshard.FlatParamModule(model, tp_plan=TP_PLAN, mesh=mesh)
    units = ["blocks.0", "blocks.1"] if shard == "full" else "auto"
    trainer = torchshard.DistributedTrainer(
        fm,
        mesh=mesh,
        shard=shard,
        master_dtype=torch.float64,
        init_fn=init_gpt_weights,
        units=units,
    )
    opt = trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    d, norms = mesh.dp_rank, []
    for x, y in _batches(steps, 4):  # the global batch: 4 rows, 2 per data-parallel rank
        ropt.zero_grad()
        ref(x, y)[1].backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()
        opt.zero_grad()
        fm(x[2 * d : 2 * d + 2], y[2 * d : 2 * d + 2])[1].backward()
        trainer.average_gradients()
        norms.append((trainer.clip_grad_norm_(0.5) - ref_norm).abs().item())
        trainer.step()
    with trainer.gathered():
        diff = max((w - ref.get_parameter(n)).abs().max().item() for n, w in _gathered(fm).items())
    trainer.assert_in_sync()  # over dp, and what the tp ranks replicate
    replicated = {
        s.name: s.view(fm.flat_param).clone()
        for s, split in zip(fm.layout.slots, fm.tp.splits)
        if split is None and fm.flat_param is not None
    }
    per_step = trainer.stats.bytes_reduced / trainer.stats.steps
    local = fm.layout.numel * 8
    trainer.close()
    return {
        "diff": diff,
        "norm": max(norms),
        "replicated": replicated,
        "bytes": per_step,
        "local": local,
    }


@pytest.mark.parametrize("shard", [False, True, "full"])
def test_dp2_tp2_matches_one_process_in_every_mode(shard: object) -> None:
    got = run_distributed(_dp2_tp2, 4, shard, 5, timeout=180)
    for r in got:
        assert r["diff"] <= 1e-10  # 5 AdamW steps on the global batch
        assert r["norm"] <= 1e-12  # clip_grad_norm_: split pieces over tp, replicated once
        # data-parallel bytes per step: the local flat buffer's (about half the whole model's)
        assert r["bytes"] <= r["local"]
    if shard is False:  # replicated weights bitwise alike on both tp ranks (ranks 0 and 1)
        for name, w in got[0]["replicated"].items():
            assert torch.equal(w, got[1]["replicated"][name]), name


@pytest.mark.parametrize("shard", [True, "full"])
def test_hybrid_sharding_composes_with_tp(shard: object) -> None:
    for r in run_distributed(_dp2_tp2, 4, shard, 3, 2, timeout=180):  # 2 replicas x tp 2
        assert r["diff"] <= 1e-10 and r["norm"] <= 1e-12


def test_replicated_slots_stay_bitwise_in_sync_after_ten_steps() -> None:
    got = run_distributed(_dp2_tp2, 4, True, 10, timeout=180)
    assert got[0]["replicated"]  # ln, wpe, rowwise biases
    for a, b in ((0, 1), (2, 3), (0, 2)):  # tp pairs, and across dp
        for name, w in got[a]["replicated"].items():
            assert torch.equal(w, got[b]["replicated"][name]), (a, b, name)


def _dropout_alike() -> list[float]:
    """Ranks seeded differently: the trainer gives the tp ranks tp rank 0's random state."""
    mesh = torchshard.init_mesh(tp=2)
    torch.manual_seed(100 + dist.get_rank())
    with torch.device("meta"):
        model = GPT(CFG)
    fm = torchshard.FlatParamModule(model, tp_plan=TP_PLAN, mesh=mesh)
    trainer = torchshard.DistributedTrainer(fm, mesh=mesh)
    mask = torch.nn.functional.dropout(torch.ones(8), 0.5).tolist()
    trainer.close()
    return mask


def test_tp_ranks_draw_alike_dp_ranks_do_not() -> None:
    got = run_distributed(_dropout_alike, 4, timeout=120)
    assert got[0] == got[1] and got[2] == got[3]  # tp pairs (0,1) and (2,3)
    assert got[0] != got[2]  # the data-parallel ranks keep their own streams


def _unsplit_module_on_tp_mesh() -> str:
    mesh = torchshard.init_mesh(tp=2)
    fm = torchshard.FlatParamModule(GPT(CFG))
    try:
        torchshard.DistributedTrainer(fm, mesh=mesh)
    except torchshard.MeshError as e:
        return str(e)
    return "no error"


def test_a_tp_mesh_needs_a_split_module() -> None:
    for msg in run_distributed(_unsplit_module_on_tp_mesh, 2, timeout=60):
        assert "tp_plan" in msg


# -- plans, on one process: a stand-in mesh (resolution needs no collective) --------------
class _Mesh:
    def __init__(self, tp: int) -> None:
        self.tp, self.tp_rank, self.tp_size = None, 0, tp


def _plan_error(plan: object, tp: int = 2, cfg: GPTConfig = CFG) -> str:
    with torch.device("meta"):
        model = GPT(cfg)
    with pytest.raises(torchshard.TPPlanError) as e:
        torchshard.FlatParamModule(model, tp_plan=plan, mesh=_Mesh(tp))
    return str(e.value)


def test_bad_plans_raise_naming_what_is_wrong() -> None:
    assert "'blocks.*.nope' names no module" in _plan_error({**TP_PLAN, "blocks.*.nope": "colwise"})
    assert "unknown style 'diagonal'" in _plan_error({"lm_head": "diagonal"})
    assert "is a Embedding" in _plan_error({**TP_PLAN, "wpe": "colwise"})
    fused = _plan_error({**TP_PLAN, "blocks.*.attn.qkv": "colwise"})
    assert "blocks.0.attn.qkv" in fused and "packed_colwise" in fused
    tied = _plan_error({k: v for k, v in TP_PLAN.items() if k != "wte"})
    assert "tied parameter" in tied and "wte.weight: replicated" in tied
    heads = _plan_error(
        TP_PLAN, tp=4, cfg=GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    )
    assert "n_head = 2 heads do not divide over tp=4" in heads
    vocab = _plan_error(
        TP_PLAN, cfg=GPTConfig(vocab_size=63, block_size=16, n_layer=2, n_head=2, n_embd=16)
    )
    assert "vocabulary (63)" in vocab and "multiple of 2" in vocab
    with pytest.raises(torchshard.TPPlanError, match="needs mesh="):
        torchshard.FlatParamModule(GPT(CFG), tp_plan=TP_PLAN)


def test_a_plan_splits_what_it_names_and_nothing_else() -> None:
    with torch.device("meta"):
        model = GPT(CFG)
    r = resolve_plan(model, TP_PLAN, 2)
    assert r.splits["blocks.0.attn.qkv.weight"] == Split(0, 3)
    assert r.splits["blocks.1.attn.proj.weight"] == Split(1)
    assert "blocks.1.attn.proj.bias" not in r.splits  # a rowwise bias: added once, replicated
    assert r.splits["wte.weight"] == r.splits["lm_head.weight"] == Split(0)  # tied: alike
    assert not any(n.startswith(("wpe", "ln_f", "blocks.0.ln_")) for n in r.splits)


def test_a_resolved_plan_resolves_to_itself_and_a_miss_shows_the_names() -> None:
    """A plan of literal module names (what ``Resolved.styles`` holds, and what the
    planners take) names what its globs named, in the trainer and in the planners alike."""
    with torch.device("meta"):
        model = GPT(CFG)
    r = resolve_plan(model, TP_PLAN, 2)
    assert len(r.styles) > len(TP_PLAN) and not any("*" in m for m in r.styles)
    assert resolve_plan(model, r.styles, 2) == r
    whole = torchshard.FlatLayout.from_module(model)
    plans = [
        torchshard.plan_memory(whole, 2, shard=True, tp=2, tp_plan=p) for p in (r.styles, TP_PLAN)
    ]
    assert plans[0] == plans[1]
    miss = _plan_error({**r.styles, "blocks.0.nope": "colwise"})  # a literal: looked up
    assert "'blocks.0.nope' names no module of GPT" in miss
    assert "(module names look like wte, wpe, blocks and " in miss  # the first 3, and a count
    assert matches("blocks.*.mlp.0", "blocks.1.mlp.0") and not matches("blocks.*", "blocks.1.mlp.0")


def test_split_pieces_and_put_invert_take() -> None:
    full = torch.arange(24.0).view(12, 2)
    s = Split(0, 3)  # q, k, v of 4 rows each, over 2 ranks
    assert s.pieces(12, 1, 2) == [(2, 4), (6, 8), (10, 12)]
    back = torch.zeros_like(full)
    for r in range(2):
        s.put(back, s.take(full, r, 2), r, 2)
    assert torch.equal(back, full)


def _row_embedding() -> float:
    """A vocabulary-parallel embedding with a padding row, against nn.Embedding."""
    torch.set_default_dtype(torch.float64)
    mesh = torchshard.init_mesh(tp=2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(10, 4, padding_idx=7))
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=7))
    model.load_state_dict(ref.state_dict())
    fm = torchshard.FlatParamModule(model, tp_plan={"0": "embedding_rowwise"}, mesh=mesh)
    fm.bind(torch.empty(fm.numel))
    ids = torch.tensor([[0, 4, 5, 7, 9, 7]])
    out, want = fm(ids), ref(ids)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    g = fm.tp.gather(0, fm.module[0].weight.grad)
    return max((out - want).abs().max().item(), (g - ref[0].weight.grad).abs().max().item())


def test_vocabulary_parallel_embedding_masks_foreign_ids_and_padding() -> None:
    for diff in run_distributed(_row_embedding, 2, timeout=60):
        assert diff == 0.0


def _sampler_place() -> tuple[int, int, list[int]]:
    mesh = torchshard.init_mesh(tp=2)
    sampler = torchshard.GlobalBatchSampler(16, 8, seed=0)  # no rank given: the mesh's dp
    del mesh
    return sampler.rank, sampler.world_size, next(iter(sampler))


def test_the_sampler_defaults_to_the_data_parallel_place() -> None:
    got = run_distributed(_sampler_place, 4, timeout=60)
    assert [g[:2] for g in got] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert got[0][2] == got[1][2] and got[2][2] == got[3][2] and got[0][2] != got[2][2]


def _local_init() -> dict[str, object]:
    torch.set_default_dtype(torch.float64)
    mesh = torchshard.init_mesh(tp=2)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(CFG)
    fm = torchshard.FlatParamModule(model, tp_plan=TP_PLAN, mesh=mesh, tp_init="local")
    trainer = torchshard.DistributedTrainer(fm, mesh=mesh, init_fn=init_gpt_weights)
    whole = _gathered(fm)
    ref = GPT(CFG)
    ref.load_state_dict(whole, strict=False)
    ((x, y),) = _batches(1, 2)
    diff = (fm(x, y)[0] - ref(x, y)[0]).abs().max().item()
    ref_init = _reference()
    sliced = torch.equal(
        whole["blocks.0.mlp.0.weight"], ref_init.get_parameter("blocks.0.mlp.0.weight")
    )
    trainer.close()
    return {"diff": diff, "sliced": sliced}


def test_a_local_init_trains_the_model_its_pieces_make() -> None:
    for got in run_distributed(_local_init, 2, timeout=60):
        assert got["diff"] <= 1e-12  # the split model computes what its gathered weights do
        assert not got["sliced"]  # but they are not the one-process init's slices


def test_a_plan_is_checked_at_tp_1_too_and_splits_nothing() -> None:
    with torch.device("meta"):
        model = GPT(CFG)
    fm = torchshard.FlatParamModule(model, tp_plan=TP_PLAN, mesh=_Mesh(1))
    assert fm.tp is None and fm.layout == torchshard.FlatLayout.from_module(GPT(CFG))
    assert "names no module" in _plan_error({"nope": "colwise"}, tp=1)


def _plans_differ() -> str:
    mesh = torchshard.init_mesh(tp=2)
    plan = dict(TP_PLAN)
    if mesh.tp_rank == 1:  # this rank leaves the MLP whole
        del plan["blocks.*.mlp.0"], plan["blocks.*.mlp.2"]
    fm = torchshard.FlatParamModule(GPT(CFG), tp_plan=plan, mesh=mesh)
    try:
        torchshard.DistributedTrainer(fm, mesh=mesh)
    except torchshard.RankMismatchError as e:
        return str(e)
    return "no error"


def test_tp_ranks_that_split_differently_raise_on_every_rank() -> None:
    for msg in run_distributed(_plans_differ, 2, timeout=60):
        assert "tp ranks [1] split another model or plan" in msg


def _whole_state_dict_in() -> float:
    torch.set_default_dtype(torch.float64)
    mesh = torchshard.init_mesh(tp=2)
    ref = _reference()
    with torch.device("meta"):
        model = GPT(CFG)
    fm = torchshard.FlatParamModule(model, tp_plan=TP_PLAN, mesh=mesh)
    fm.bind(torch.full((fm.numel,), float("nan")))
    fm.load_state_dict(ref.state_dict())  # whole pretrained tensors: each rank its piece
    ((x, y),) = _batches(1, 2)
    return (fm(x, y)[0] - ref(x, y)[0]).abs().max().item()


def test_a_whole_state_dict_loads_into_the_pieces() -> None:
    for diff in run_distributed(_whole_state_dict_in, 2, timeout=60):
        assert diff <= 1e-12
