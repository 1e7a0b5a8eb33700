"""``torchshard estimate`` of a transformers model that keeps some modules in fp32: built on
meta in ``--dtype`` as ``from_config(config, dtype=...)`` builds it, with what transformers
keeps in fp32 in fp32 (as ``from_pretrained`` loads it), and reported per dtype."""

from __future__ import annotations

import json

import pytest
import torch

from torchshard import FlatParamModule, plan_memory
from torchshard._cli import main
from torchshard._flat.hf import keep_in_fp32

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

# AfmoeForCausalLM declares _keep_in_fp32_modules (its norms: fp16 only) and builds its
# expert bias (a frozen parameter) in fp32 itself
AFMOE = {
    "model_type": "afmoe", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "head_dim": 8,
    "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 64,
}  # fmt: skip
NORMS = 2 * (8 + 8 + 4 * 32) + 32  # per layer q_norm, k_norm (head_dim) and 4 norms; the last
BIAS = 4  # the expert bias of the one MoE layer: 4 experts, frozen


def documented(dtype: torch.dtype):
    """The model as the docs build it: on meta, in ``dtype``, wrapped by FlatParamModule."""
    values = dict(AFMOE)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    keep_in_fp32(model)  # what FlatParamModule(model) does for a transformers model
    return model, FlatParamModule(model).layout


def estimate(tmp_path, capsys, *args: str) -> tuple[dict, str]:
    path = tmp_path / "afmoe.json"
    path.write_text(json.dumps(AFMOE))
    argv = ["estimate", str(path), "--world-size", "2", *args]
    assert main([*argv, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    return est, capsys.readouterr().out


def test_fp16_keeps_the_norms_in_fp32(tmp_path, capsys):
    est, table = estimate(tmp_path, capsys, "--dtype", "fp16")
    model, layout = documented(torch.float16)
    n = sum(p.numel() for p in model.parameters())
    fp32 = NORMS + BIAS
    assert est["parameter_bytes"] == {"float16": 2 * (n - fp32), "float32": 4 * fp32}
    assert est["dtype"] == "float16" and est["parameters"] == n
    assert est["numel"] == layout.numel and layout.mixed  # bytes
    tensors = est["tensors"]
    assert est["trainable_tensors"] == tensors - 1 and est["trainable_parameters"] == n - BIAS
    assert est["trainable_bytes"] == 2 * (n - fp32) + 4 * NORMS
    # replicated: the buffers' bytes, AdamW's two states in each parameter's dtype, a step each
    grads = layout.grad_layout.numel
    state = 2 * (2 * (n - fp32) + 4 * NORMS) + 4 * (tensors - 1)
    rep = est["replicated"]
    assert (rep["parameters"], rep["gradients"], rep["optimizer"], rep["master"]) == (
        layout.numel, grads, state, 0
    )  # fmt: skip
    # sharded: the same plan as the layout's
    worst = max(plan_memory(layout, 2, shard=True), key=lambda r: r.total)
    assert {k: est["sharded"][k] for k in worst.as_dict()} == worst.as_dict()
    # over the ranks, a state in fp32 for every trainable element once (SGD: one, no step)
    plan = plan_memory(layout, 2, shard=True, optimizer="sgd")
    assert sum(r.optimizer for r in plan) == 4 * (n - BIAS)
    assert (
        f"35 tensors: float16 58.25 KiB, float32 1.27 KiB; flat buffer {layout.numel:,} bytes"
        in table
    )
    assert "(float16 58.25 KiB, float32 1.25 KiB): the rest frozen" in table  # the bias frozen
    assert "sharded and full: fp32 master of the fp16 parameters and state" in table
    assert "parameters (fp16+fp32)" in table and "replicated: state in fp16 and fp32" in table


def test_bf16_keeps_what_the_model_builds_in_fp32(tmp_path, capsys):
    """``_keep_in_fp32_modules`` is for fp16 alone: in bf16 the norms are bf16, and the expert
    bias the model builds in fp32 stays so."""
    est, _ = estimate(tmp_path, capsys)
    model, _ = documented(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert est["parameter_bytes"] == {"bfloat16": 2 * (n - BIAS), "float32": 4 * BIAS}
    assert est["trainable_bytes"] == 2 * (n - BIAS)  # the fp32 bias is frozen


def test_fp32_is_one_dtype(tmp_path, capsys):
    est, table = estimate(tmp_path, capsys, "--dtype", "fp32")
    assert est["parameter_bytes"] == {"float32": 4 * est["parameters"]}
    assert "elements of float32" in table and "parameters (fp32)" in table
