"""transformers models that keep some modules in fp32 (``_keep_in_fp32_modules``,
``_keep_in_fp32_modules_strict``): built on meta in bf16 or fp16, they keep those modules in
fp32 as ``from_pretrained`` does, bind as typed views of one byte buffer, initialize
transformers' way and train.

transformers 5 applies its fp32 plan only as ``from_pretrained`` loads (``_get_dtype_plan``);
``from_config`` builds everything in the requested dtype, except what a model's code
creates in fp32 itself (an MoE router's weight). :func:`keep_in_fp32` applies the plan on
meta, so the two ways give one layout.
"""

from __future__ import annotations

import pytest
import torch
from models import tiny_hf_config
from torch import nn

import torchshard
from torchshard._flat.hf import clear_init_flags, keep_in_fp32, model_dtype, transformers_config
from torchshard._flat.layout import FlatLayout

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
NORMS = [f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in LAYER_NORMS]
NORMS.append("model.norm.weight")


class StrictLlama(transformers.LlamaForCausalLM):
    """Norms kept in fp32 in bf16 and fp16 (``"norm"`` is searched for: every norm)."""

    _keep_in_fp32_modules_strict = ("norm",)


class LooseLlama(transformers.LlamaForCausalLM):
    """Norms kept in fp32 in fp16 only, as transformers reads ``_keep_in_fp32_modules``."""

    _keep_in_fp32_modules = ("norm",)


def on_meta(cls, config, dtype):
    """The documented path: ``with torch.device("meta"): from_config(config, dtype=...)``
    (``AutoModelForCausalLM.from_config`` calls the class's ``_from_config``)."""
    with torch.device("meta"):
        return cls._from_config(config, dtype=dtype)


def dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {n: p.dtype for n, p in model.named_parameters()}


def fp32_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dtype == FP32]


@pytest.mark.parametrize(
    ("cls", "dtype", "kept"),
    [(StrictLlama, BF16, NORMS), (StrictLlama, FP16, NORMS), (LooseLlama, FP16, NORMS),
     (LooseLlama, BF16, [])],
    ids=["strict-bf16", "strict-fp16", "loose-fp16", "loose-bf16"],
)  # fmt: skip
def test_meta_model_keeps_what_from_pretrained_keeps(cls, dtype, kept, tmp_path):
    config = tiny_hf_config("llama")
    cls(config).save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path, dtype=dtype)
    assert fp32_names(loaded) == kept  # transformers' plan, as it loads
    model = on_meta(cls, config, dtype)
    assert fp32_names(model) == []  # from_config does not apply it
    assert keep_in_fp32(model) == kept and dtypes(model) == dtypes(loaded)
    assert keep_in_fp32(model) == []  # done: nothing more to cast
    fm = torchshard.FlatParamModule(model)
    assert fm.layout == FlatLayout.from_module(loaded)  # rank 0's loaded model, the same
    assert fm.layout.mixed == bool(kept) and model_dtype(model) == dtype


def _afmoe_config():
    return transformers.AutoConfig.for_model(
        "afmoe", num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, head_dim=8, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
    )  # fmt: skip


def test_a_real_class_keeps_its_norms_in_fp16_like_from_pretrained(tmp_path):
    """AfmoeForCausalLM declares ``_keep_in_fp32_modules`` (its norms) and creates its expert
    bias in fp32 itself."""
    config = _afmoe_config()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=FP16)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=FP16)
    assert fp32_names(model) == ["model.layers.1.mlp.expert_bias"]
    kept = keep_in_fp32(model)
    assert "model.norm.weight" in kept and "model.layers.0.self_attn.q_norm.weight" in kept
    assert dtypes(model) == dtypes(loaded) and len(fp32_names(model)) == 14
    # (from_pretrained makes the frozen expert bias trainable: compare places and dtypes)
    place = lambda layout: [(s.name, s.dtype, s.offset) for s in layout]  # noqa: E731
    assert place(torchshard.FlatParamModule(model).layout) == place(FlatLayout.from_module(loaded))


def test_parameters_with_values_and_nested_models():
    config = tiny_hf_config("llama")
    real = StrictLlama._from_config(config, dtype=BF16)
    assert keep_in_fp32(real) == [] and fp32_names(real) == []  # values: left as they are
    outer = nn.ModuleDict({"lm": on_meta(StrictLlama, config, BF16), "head": nn.Linear(2, 2)})
    assert keep_in_fp32(outer) == [f"lm.{n}" for n in NORMS]
    assert outer["head"].weight.dtype == FP32  # not a transformers model's: untouched
    # dtype= still casts everything to one
    fm = torchshard.FlatParamModule(outer["lm"], dtype=BF16)
    assert not fm.layout.mixed and fm.dtypes == (BF16,)


def _dots1_config():
    return transformers.AutoConfig.for_model(
        "dots1", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
        max_position_embeddings=64, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, head_dim=8,
    )  # fmt: skip


# (config, dtype): Dots1 declares _keep_in_fp32_modules_strict and builds its router in fp32;
# Afmoe declares _keep_in_fp32_modules, its norms, which keep_in_fp32 casts on meta in fp16
MIXED = {"dots1-bf16": (_dots1_config, BF16), "afmoe-fp16": (_afmoe_config, FP16)}


@pytest.mark.parametrize("arch", list(MIXED))
def test_mixed_model_binds_initializes_and_trains(arch):
    """Low precision weights and fp32 modules, bound as typed views of one byte buffer,
    initialized bitwise as transformers initializes the same model, and training like it."""
    make_config, dtype = MIXED[arch]
    config = make_config()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    kept = keep_in_fp32(model)
    assert bool(kept) == (dtype == FP16)
    fm = torchshard.FlatParamModule(model)
    assert fm.dtype == torch.uint8 and fm.dtypes == (dtype, FP32)
    fm.bind(torch.empty(fm.numel, dtype=fm.dtype))
    torch.manual_seed(5)
    fm.init_weights()
    fm.check_views()
    # the oracle: the same model with values, the same modules in fp32, transformers' init
    oracle = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for n, p in oracle.named_parameters():
        if n in kept:
            p.data = p.data.float()
    clear_init_flags(oracle)
    torch.manual_seed(5)
    oracle.initialize_weights()
    expected = dict(oracle.named_parameters())
    for n, p in model.named_parameters():
        assert p.dtype == expected[n].dtype and torch.equal(p, expected[n]), n
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = fm(input_ids=ids, labels=ids).loss
    ref = oracle(input_ids=ids, labels=ids).loss
    loss.backward()
    ref.backward()
    assert torch.isfinite(loss) and torch.equal(loss, ref)
    base = fm.flat_grad.data_ptr()
    for s in fm.layout.grad_layout:  # each gradient a typed view of the byte buffer
        p = model.get_parameter(s.name)
        assert p.grad.dtype == p.dtype and p.grad.data_ptr() == base + s.offset, s.name
        assert torch.equal(p.grad, expected[s.name].grad), s.name
    fp32 = [model.get_parameter(s.name) for s in fm.layout.grad_layout if s.dtype == "float32"]
    assert fp32 and all(p.grad.abs().sum() > 0 for p in fp32)


def test_config_of_a_mixed_model_names_its_own_dtype():
    model = on_meta(StrictLlama, tiny_hf_config("llama"), BF16)
    keep_in_fp32(model)
    fm = torchshard.FlatParamModule(model)
    assert transformers_config(model, fm.dtype)["dtype"] == "bfloat16"  # not the bytes'
    assert transformers_config(model, FP16)["dtype"] == "float16"


def test_flat_param_module_keeps_what_transformers_keeps_in_fp32():
    fm = torchshard.FlatParamModule(on_meta(StrictLlama, tiny_hf_config("llama"), BF16))
    assert fp32_names(fm.module) == NORMS and fm.dtypes == (BF16, FP32)
    cast = torchshard.FlatParamModule(
        on_meta(StrictLlama, tiny_hf_config("llama"), BF16), dtype=BF16
    )
    assert cast.dtypes == (BF16,)
