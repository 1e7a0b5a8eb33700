"""Tensor parallelism on a transformers model: a tiny ``LlamaForCausalLM`` (random init from
a ``LlamaConfig``, nothing downloaded) split with ``tp_plan="auto"``, against the same model in
one process (float64): its meta-built init bitwise, its logits, loss and gathered gradients
at TP=2, and dp2 x tp2 training for 5 AdamW steps in every data-parallel mode."""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_distributed

import torchshard
from torchshard._flat.tp_plan import Split, auto_plan, resolve_plan

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(240)

VOCAB = 64
# The plan transformers 4 declares on the model class: the head only, no embedding.
HEAD_ONLY = {"lm_head": "colwise_gather_output"}


def llama_config(tie: bool = False):
    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )


def meta_llama(tie: bool = False) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(llama_config(tie))


def one_process(tie: bool) -> torchshard.FlatParamModule:
    """The reference: the whole model in this process, initialized transformers' way from
    seed 0."""
    ref = torchshard.FlatParamModule(meta_llama(tie))
    ref.bind(torch.empty(ref.numel))
    torch.manual_seed(0)
    ref.init_weights()
    return ref


def gathered(fm: torchshard.FlatParamModule, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every slot's whole value from the tp ranks' pieces in ``flat`` (weights or grads)."""
    assert fm.tp is not None
    return {s.name: fm.tp.gather(i, s.view(flat)) for i, s in enumerate(fm.layout.slots)}


def whole_params(trainer: torchshard.DistributedTrainer) -> dict[str, torch.Tensor]:
    """Every parameter's whole value, gathered over the tp ranks (and the units, fully
    sharded), copied out before the units are freed again."""
    fm = trainer.module
    with trainer.gathered():
        return {
            s.name: fm.tp.gather(i, fm.module.get_parameter(s.name).detach()).clone()
            for i, s in enumerate(fm.layout.slots)
        }


def batch(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, 16), generator=torch.Generator().manual_seed(seed))


# -- the plan "auto" makes (no processes) -------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_auto_plan_splits_the_embedding_with_the_head(tie):
    model = meta_llama(tie)
    resolved = resolve_plan(model, "auto", 2)
    assert resolved.styles["model.embed_tokens"] == "embedding_rowwise"
    assert resolved.splits["model.embed_tokens.weight"] == Split(0)
    assert resolved.splits["lm_head.weight"] == Split(0)
    assert resolved.splits["model.layers.1.self_attn.k_proj.weight"] == Split(0)
    assert resolved.splits["model.layers.0.mlp.down_proj.weight"] == Split(1)
    assert "model.norm.weight" not in resolved.splits  # replicated


def test_auto_plan_adds_embedding_rowwise_for_a_head_tied_to_an_unnamed_embedding():
    """A plan that names the head only (transformers 4's): "auto" splits the tied embedding
    by vocabulary too, since the tie leaves no other choice; an untied one stays replicated;
    the same plan given explicitly raises, naming the tie."""
    tied, untied = meta_llama(tie=True), meta_llama(tie=False)
    for model in (tied, untied):
        model._tp_plan = dict(HEAD_ONLY)
    assert auto_plan(tied)["model.embed_tokens"] == "embedding_rowwise"
    assert "model.embed_tokens" not in auto_plan(untied)
    splits = resolve_plan(tied, "auto", 2).splits
    assert splits["model.embed_tokens.weight"] == splits["lm_head.weight"] == Split(0)
    assert "model.embed_tokens.weight" not in resolve_plan(untied, "auto", 2).splits
    explicit = {**auto_plan(untied), **HEAD_ONLY}
    with pytest.raises(torchshard.TPPlanError, match=r"tied parameter .*embed_tokens"):
        resolve_plan(tied, explicit, 2)


def test_auto_plan_refuses_heads_the_degree_does_not_divide():
    with pytest.raises(torchshard.TPPlanError, match="num_key_value_heads = 2 heads"):
        resolve_plan(meta_llama(), "auto", 4)


# -- TP=2 against one process --------------------------------------------------------------------


def _tp2_parity(tie: bool) -> dict[str, float]:
    torch.set_default_dtype(torch.float64)
    mesh = torchshard.init_mesh(tp=2)
    ref = one_process(tie)
    fm = torchshard.FlatParamModule(meta_llama(tie), tp_plan="auto", mesh=mesh)
    assert fm.layout.numel < fm.tp.whole.numel
    fm.bind(torch.empty(fm.numel))
    torch.manual_seed(0)
    fm.init_weights()  # transformers' init, each split parameter whole, then sliced
    init = gathered(fm, fm.flat_param)
    differ = [n for n, w in init.items() if not torch.equal(w, ref.module.get_parameter(n))]
    assert not differ, f"meta init differs from the one-process init: {differ}"
    x = batch(3, 1)
    want = ref(input_ids=x, labels=x)
    want.loss.backward()
    got = fm(input_ids=x, labels=x)
    got.loss.backward()
    grads = gathered(fm, fm.flat_grad)
    ref_grads = {s.name: s.view(ref.flat_grad) for s in ref.layout.slots}
    assert grads.keys() == ref_grads.keys()
    return {
        "logits": (got.logits - want.logits).abs().max().item(),
        "loss": (got.loss - want.loss).abs().item(),
        "grads": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        "tied": float(fm.module.lm_head.weight is fm.module.model.embed_tokens.weight),
    }


@pytest.mark.parametrize("tie", [False, True])
def test_tp2_llama_matches_one_process(tie):
    """Meta init bitwise the one-process init's slices; logits, loss and gathered gradients
    within 1e-12 (float64), with the head tied to the embedding or not."""
    for got in run_distributed(_tp2_parity, 2, tie):
        assert got["tied"] == float(tie)
        assert got["grad_scale"] > 1e-3  # gradients that could differ
        for key in ("logits", "loss", "grads"):
            assert got[key] <= 1e-12, (key, got)


# -- dp2 x tp2 against one process ----------------------------------------------------------------

MODES = {"replicated": False, "sharded": True, "full": "full"}


def _dp2tp2(mode: str) -> dict[str, float]:
    torch.set_default_dtype(torch.float64)
    mesh = torchshard.init_mesh(tp=2)
    assert (mesh.dp_size, mesh.tp_size) == (2, 2)
    ref = one_process(tie=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    start = ref.flat_param.clone()
    torch.manual_seed(0)  # the trainer initializes from here (tp ranks alike, dp rank 0's)
    fm = torchshard.FlatParamModule(meta_llama(), tp_plan="auto", mesh=mesh)
    units = ["model.layers.0", "model.layers.1"] if mode == "full" else "auto"
    trainer = torchshard.DistributedTrainer(
        fm, mesh=mesh, shard=MODES[mode], master_dtype=torch.float64, units=units
    )
    opt = trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    init = whole_params(trainer)
    differ = [n for n, w in init.items() if not torch.equal(w, ref.module.get_parameter(n))]
    assert not differ, f"the trainer's init differs from the one-process init: {differ}"
    norms = []
    d = mesh.dp_rank
    for step in range(5):
        x = batch(4, 10 + step)  # the global batch; this dp rank's half below
        ref_opt.zero_grad()
        ref(input_ids=x, labels=x).loss.backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        opt.zero_grad()
        mine = x[2 * d : 2 * d + 2]
        fm(input_ids=mine, labels=mine).loss.backward()
        trainer.average_gradients()
        norms.append((trainer.clip_grad_norm_(0.5) - want).abs().item())
        trainer.step()
    after = whole_params(trainer)
    trainer.assert_in_sync()
    trainer.close()
    return {
        "params": max(
            (w - ref.module.get_parameter(n)).abs().max().item() for n, w in after.items()
        ),
        "norm": max(norms),
        "moved": (ref.flat_param - start).abs().max().item(),
    }


@pytest.mark.parametrize("mode", list(MODES))
def test_dp2_tp2_llama_trains_as_one_process(mode):
    """4 ranks, (dp 2, tp 2), each dp rank half of the global batch: after 5 AdamW steps
    with clipping every gathered parameter within 1e-10 of one process trained on the whole
    batch; the clipped norm within 1e-12 at every step; replicated parameters in sync."""
    for got in run_distributed(_dp2tp2, 4, mode, timeout=180):
        assert got["params"] <= 1e-10, got
        assert got["norm"] <= 1e-12, got
        assert got["moved"] > 1e-3, got  # the steps changed the weights
