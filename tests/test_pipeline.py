"""Pipeline parallelism (issue 26): the plan and the pruned stages (pure), then pipelines
on gloo against a one-process run of the same microbatches: bitwise in fp32 untied, a tied
embedding in float64, one global norm, and the errors of bad input on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig, init_gpt_weights
from multiprocess import run_distributed
from torch import nn

import torchshard

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)
SPLIT = [["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "lm_head"]]
M = 4  # microbatches


def _meta(tied: bool) -> GPT:
    with torch.device("meta"):
        model = GPT(CFG)
        if not tied:
            model.lm_head.weight = nn.Parameter(torch.empty(CFG.vocab_size, CFG.n_embd))
    return model


def _loss(out: object, y: torch.Tensor) -> torch.Tensor:
    logits = out[0] if isinstance(out, tuple) else out
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 64, (rows, 16), generator=g),
            torch.randint(0, 64, (rows, 16), generator=g),
        )
        for _ in range(steps)
    ]


def _reference(tied: bool) -> torchshard.FlatParamModule:
    """The whole model, initialized in one process from seed 0 as the pipeline is."""
    ref = torchshard.FlatParamModule(_meta(tied))
    ref.bind(torch.empty(ref.numel))
    torch.manual_seed(0)
    ref.init_weights(init_gpt_weights)
    return ref


def _ref_backward(ref: torchshard.FlatParamModule, x: torch.Tensor, y: torch.Tensor) -> None:
    """The same microbatches, in order, each loss divided by their count."""
    for xs, ys in zip(x.chunk(M), y.chunk(M)):
        (_loss(ref(xs), ys) / M).backward()


def _mine(pipe: torchshard.Pipeline, of: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in pipe.fm.module.named_parameters(remove_duplicate=False):
        t = p.detach() if of == "param" else p.grad
        out[name] = t.clone()
    return out


def _parity(schedule: str, tied: bool, dtype: torch.dtype, clip: float | None) -> dict:
    """pp=2, dp=1: per step, every stage's grads and weights against the one-process run."""
    torch.set_default_dtype(dtype)
    ref = _reference(tied)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    pipe = torchshard.Pipeline(
        _meta(tied),
        pp=2,
        microbatches=M,
        loss_fn=_loss,
        stages=SPLIT,
        schedule=schedule,
        init_fn=init_gpt_weights,
    )
    pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False)
    report: dict = {"init": _diffs(pipe, ref, "param"), "grads": [], "weights": [], "norms": []}
    for x, y in _batches(3, 8):
        pipe.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.forward_backward(x, target=y)
        _ref_backward(ref, x, y)
        report.setdefault("losses", []).append((float(loss), float(_ref_loss(ref, x, y))))
        if clip is not None:
            norm = pipe.clip_grad_norm_(clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            report["norms"].append((norm.clone(), ref_norm.clone()))
        else:
            pipe._finish()
        report["grads"].append(_diffs(pipe, ref, "grad"))
        pipe.step()
        ref_opt.step()
        report["weights"].append(_diffs(pipe, ref, "param"))
    report["final"] = _mine(pipe, "param")
    pipe.close()
    return report


@torch.no_grad()
def _ref_loss(ref: torchshard.FlatParamModule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return sum(_loss(ref(xs), ys) / M for xs, ys in zip(x.chunk(M), y.chunk(M)))


def _diffs(pipe: torchshard.Pipeline, ref: torchshard.FlatParamModule, of: str) -> dict:
    """Per parameter of this stage: the largest relative difference to the reference."""
    out = {}
    for name, t in _mine(pipe, of).items():
        r = ref.module.get_parameter(name)
        r = r.detach() if of == "param" else r.grad
        d, scale = float((t - r).abs().max()), float(r.abs().max())
        out[name] = d / scale if scale else d
    return out


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pp2_matches_one_process_bitwise(schedule: str) -> None:
    for rank, got in enumerate(run_distributed(_parity, 2, schedule, False, torch.float32, None)):
        assert got["init"] and all(v == 0 for v in got["init"].values()), (rank, got["init"])
        for step, (g, w) in enumerate(zip(got["grads"], got["weights"])):
            assert all(v == 0 for v in g.values()), (rank, step, g)
            assert all(v == 0 for v in w.values()), (rank, step, w)
        assert all(a == b for a, b in got["losses"]), got["losses"]


def test_tied_embedding_across_stages_float64() -> None:
    s0, s1 = run_distributed(_parity, 2, "1F1B", True, torch.float64, None)
    for got in (s0, s1):
        assert all(v == 0 for v in got["init"].values()), got["init"]
        for g, w in zip(got["grads"], got["weights"]):
            assert max(g.values()) <= 1e-12 and max(w.values()) <= 1e-12, (g, w)
    assert "wte.weight" in s0["final"] and "lm_head.weight" in s1["final"]
    assert torch.equal(s0["final"]["wte.weight"], s1["final"]["lm_head.weight"])
    # first step: only the tied slot may differ by rounding (Σh + Σe against Σ(h + e))
    tied = {"wte.weight", "lm_head.weight"}
    for got in (s0, s1):
        assert all(v == 0 for n, v in got["grads"][0].items() if n not in tied), got["grads"][0]


def test_one_global_norm_matches_torch_float64() -> None:
    s0, s1 = run_distributed(_parity, 2, "1F1B", True, torch.float64, 0.1)
    for (a, ref), (b, _) in zip(s0["norms"], s1["norms"]):
        assert torch.equal(a, b)  # bitwise on every rank
        assert abs(float(a) - float(ref)) <= 1e-12 * float(ref), (float(a), float(ref))
        assert float(ref) > 0.1  # the clip acted
    for got in (s0, s1):
        for w in got["weights"]:
            assert max(w.values()) <= 1e-12, w
