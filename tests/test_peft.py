"""PEFT LoRA on a transformers Llama (issue 21): built on meta and wrapped by
``peft.get_peft_model``, it trains in every mode bitwise like DDP on the same PEFT model at
2 ranks, the frozen base stays bitwise what it was, each rank's gradient is the adapters'
size, and the adapters export in PEFT's own format (``PeftModel.from_pretrained`` loads
them). Initialized by torchshard, the adapters start PEFT's way: ``lora_B`` zeros.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cases import Cases
from models import tiny_hf_config

from torchshard import DistributedTrainer, FlatParamModule

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MODES = [False, True, "full"]
MODE_IDS = ["replicated", "sharded", "full"]


def lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * step + rank)
    return torch.randint(0, 96, (2, 12), generator=g)


def _peft_vs_ddp(shard: bool | str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = lora(transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")))
    # the adapters moved off PEFT's zeros, so that the first step already trains them all
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    base = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    fm = FlatParamModule(copy.deepcopy(ref))
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.004)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    for step in range(3):
        x = batch(rank, step)
        trainer.zero_grad()
        fm(input_ids=x, labels=x).loss.backward()
        trainer.step()
        ref_opt.zero_grad()
        ddp(input_ids=x, labels=x).loss.backward()
        ref_opt.step()
    stats = trainer.memory_stats()
    exported = {}
    with trainer.gathered():
        got = {n: p.detach().clone() for n, p in fm.module.named_parameters()}
        if rank == 0:
            with tempfile.TemporaryDirectory() as export:
                fm.module.save_pretrained(export)  # PEFT's own adapter format
                exported = {f.name: f.read_bytes() for f in Path(export).iterdir()}
    trainer.close()
    want = dict(ref.named_parameters())
    return {
        "differ": [n for n in got if not torch.equal(got[n], want[n])],
        "base_changed": [n for n in base if not torch.equal(got[n], base[n])],
        "gradients": stats.gradients,
        "trainable": sum(p.numel() * 4 for p in ref.parameters() if p.requires_grad),
        "adapters": {n: got[n] for n in got if "lora_" in n},
        "exported": exported,
    }


PEFT = Cases(_peft_vs_ddp, params=["shard"], timeout=180, world_size=2)


@pytest.mark.parametrize("shard", MODES, ids=MODE_IDS)
@PEFT.mark(cases=3)
def test_peft_lora_trains_bitwise_like_ddp_and_exports_in_peft_format(request, shard, tmp_path):
    ranks = PEFT.results(request)
    for r in ranks:
        assert r["differ"] == [] and r["base_changed"] == [], r
        if shard == "full":
            continue
        assert r["trainable"] <= r["gradients"] <= 1.01 * r["trainable"], r
    if shard == "full":
        assert sum(r["gradients"] for r in ranks) == ranks[0]["trainable"]
    assert "adapter_model.safetensors" in ranks[0]["exported"], ranks[0]["exported"].keys()
    for name, data in ranks[0]["exported"].items():
        (tmp_path / name).write_bytes(data)
    base = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama"))
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path))
    adapters = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert adapters.keys() == ranks[0]["adapters"].keys()
    for n, p in adapters.items():
        assert torch.equal(p, ranks[0]["adapters"][n]), n


def test_adapters_built_on_meta_start_the_peft_way():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = lora(transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")))
    fm = FlatParamModule(model)
    fm.bind(torch.empty(fm.numel))
    fm.init_weights()
    named = dict(fm.module.named_parameters())
    b = [p for n, p in named.items() if "lora_B" in n]
    a = [p for n, p in named.items() if "lora_A" in n]
    assert b and all(bool((p == 0).all()) for p in b)  # the adapter adds nothing yet
    assert a and all(p.abs().sum() > 0 for p in a)
    assert fm.grad_numel == sum(p.numel() for p in named.values() if p.requires_grad)
