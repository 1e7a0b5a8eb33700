"""Pipelines of a transformers decoder (issue 26): a tiny ``LlamaForCausalLM`` (random init
from a ``LlamaConfig``, nothing downloaded) cut between its ``model.layers``, each stage run
by ``hf_stage_forward``, against the whole model in one process (a ``FlatParamModule``,
the same init, the same microbatches): the init, the logits, the losses and the weights
after AdamW steps bitwise in fp32, tied and untied; and its checkpoint exported for
``from_pretrained``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multiprocess import run_distributed

import torchshard
from torchshard import checkpoint
from torchshard._pipeline.hf import set_stage_forward
from torchshard._pipeline.plan import parameterless_units
from torchshard._pipeline.split import whole_order_init

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(240)

VOCAB, M, STEPS = 128, 4, 2


def llama(tie: bool) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def one_process(tie: bool) -> torchshard.FlatParamModule:
    """The whole model, initialized transformers' way from seed 0."""
    ref = torchshard.FlatParamModule(llama(tie))
    ref.bind(torch.empty(ref.numel))
    torch.manual_seed(0)
    ref.init_weights()
    return ref


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (8, 16), generator=g),
            torch.randint(0, VOCAB, (8, 16), generator=g),
        )
        for _ in range(STEPS)
    ]


def test_auto_plan_cuts_between_decoder_layers() -> None:
    plan = torchshard.plan_stages(llama(False), 2, pp=2)
    assert plan.modules[0][:2] == ("model.embed_tokens", "model.layers.0")
    assert plan.modules[1][-3:] == ("model.norm", "model.rotary_emb", "lm_head")
    tied = torchshard.plan_stages(llama(True), 4, pp=2)
    assert [t.alias for t in tied.ties] == ["lm_head.weight"]
    assert all(any(n.startswith("model.layers.") for n in names) for names in tied.modules)
    assert parameterless_units(llama(True)) == ["model.rotary_emb"]


@pytest.mark.parametrize("tie", [False, True])
def test_stages_init_and_logits_equal_the_whole_model_bitwise(tie: bool) -> None:
    """Split by hand in one process: every stage's weights and rotary buffers are the
    whole model's bits, and the stages chained give the whole model's logits."""
    ref = one_process(tie)
    whole = llama(tie)
    plan = torchshard.plan_stages(whole, 2, pp=2)
    want_p = dict(ref.module.named_parameters(remove_duplicate=False))
    want_b = dict(ref.module.named_buffers())
    fms = []
    for st in torchshard.split_stages(whole, plan, [0, 1], parameterless_units(whole)):
        fm = torchshard.FlatParamModule(st)
        fm.bind(torch.empty(fm.numel))
        torch.manual_seed(0)
        fm.init_weights(lambda m, st=st: whole_order_init(whole, st, None) if m is st else None)
        for n, p in st.named_parameters(remove_duplicate=False):
            assert torch.equal(p, want_p[n]), n
        for n, b in st.named_buffers():
            assert torch.equal(b, want_b[n]), n  # inv_freq real on every stage
        set_stage_forward(st, torchshard.hf_stage_forward)
        fms.append(fm)
    x = batches()[0][0]
    with torch.no_grad():
        assert torch.equal(fms[1](fms[0](x)), ref(x).logits)


def _parity(schedule: str, tie: bool, dtype: torch.dtype, save_to: str | None) -> dict:
    torch.set_default_dtype(dtype)
    ref = one_process(tie)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    pipe = torchshard.Pipeline(llama(tie), pp=2, microbatches=M, loss_fn=loss_fn, schedule=schedule)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False)
    report: dict = {"init": _diffs(pipe, ref), "losses": [], "weights": []}
    for x, y in batches():
        pipe.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.forward_backward(x, target=y)
        ref_loss = torch.zeros(())
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            piece = loss_fn(ref(xs).logits, ys) / M
            piece.backward()
            ref_loss += piece.detach()
        pipe.step()
        ref_opt.step()
        report["losses"].append((float(loss), float(ref_loss)))
        report["weights"].append(_diffs(pipe, ref))
    report["plan"] = pipe.plan.modules
    report["final"] = {
        n: p.detach().clone()
        for h in pipe.stages
        for n, p in h.fm.module.named_parameters(remove_duplicate=False)
    }
    if save_to is not None:
        checkpoint.save(save_to, pipe, step=STEPS, optimizer=opt)
    pipe.close()
    return report


def _diffs(pipe: torchshard.Pipeline, ref: torchshard.FlatParamModule) -> dict[str, float]:
    """Per parameter of this rank's stages: the largest difference to the reference,
    relative to its largest element."""
    out = {}
    for h in pipe.stages:
        for name, p in h.fm.module.named_parameters(remove_duplicate=False):
            r = ref.module.get_parameter(name).detach()
            d, scale = float((p.detach() - r).abs().max()), float(r.abs().max())
            out[name] = d / scale if scale else d
    return out


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pipeline_llama_matches_one_process_bitwise(schedule: str) -> None:
    """Untied, fp32: init, losses and the weights after each AdamW step, every bit."""
    got = run_distributed(_parity, 2, schedule, False, torch.float32, None, timeout=200)
    for rank, r in enumerate(got):
        assert r["plan"][0][0] == "model.embed_tokens" and r["plan"][-1][-1] == "lm_head"
        assert r["init"] and not any(r["init"].values()), (rank, r["init"])
        for step, (loss, ref_loss) in enumerate(r["losses"]):
            assert loss == ref_loss, (rank, step, loss, ref_loss)
        for step, diffs in enumerate(r["weights"]):
            assert not any(diffs.values()), (rank, step, {k: v for k, v in diffs.items() if v})
    held = set(got[0]["init"]) | set(got[1]["init"])
    assert held == {n for n, _ in llama(False).named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pipeline_tied_llama_matches_one_process_float64(schedule: str) -> None:
    """Tied: the embedding's gradient is the head stage's microbatches summed plus the
    embedding stage's (Σh + Σe), one process sums them microbatch by microbatch
    (Σ(h + e)): the same up to rounding, so float64 and 1e-12 relative. The init and the
    first loss are bitwise; owner and replica stay bitwise equal."""
    got = run_distributed(_parity, 2, schedule, True, torch.float64, None, timeout=200)
    for rank, r in enumerate(got):
        assert not any(r["init"].values()), (rank, r["init"])
        assert r["losses"][0][0] == r["losses"][0][1]
        for loss, ref_loss in r["losses"]:
            assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), (rank, loss, ref_loss)
        for diffs in r["weights"]:
            assert max(diffs.values()) <= 1e-12, (rank, diffs)
    assert "model.embed_tokens.weight" in got[0]["final"] and "lm_head.weight" in got[1]["final"]
    assert torch.equal(
        got[0]["final"]["model.embed_tokens.weight"], got[1]["final"]["lm_head.weight"]
    )


def test_pipeline_llama_checkpoint_exports_for_from_pretrained(tmp_path) -> None:
    """A tied pipeline Llama's checkpoint consolidates to a directory ``from_pretrained``
    loads, holding the pipeline's weights bit for bit, the tie restored."""
    root = tmp_path / "run"
    got = run_distributed(_parity, 2, "1F1B", True, torch.float64, str(root), timeout=200)
    out = tmp_path / "llama-hf"
    checkpoint.consolidate(root, out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float64)
    want = {**got[0]["final"], **got[1]["final"]}
    params = dict(loaded.named_parameters(remove_duplicate=False))
    assert set(params) == set(want)
    for name, p in params.items():
        assert torch.equal(p, want[name]), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def _bad_stage_forward() -> str:
    try:
        torchshard.Pipeline(llama(False), pp=2, microbatches=M, loss_fn=loss_fn, stage_forward=3)
    except torchshard.PipelineError as e:
        return str(e)
    return "no error"


def test_a_stage_forward_that_is_no_callable_is_named_on_every_rank() -> None:
    for msg in run_distributed(_bad_stage_forward, 2, timeout=120):
        assert msg.startswith("stage_forward: expected a callable"), msg
