"""A 70B Llama layout (transformers, built on meta) at 8 to 1024 ranks: pure arithmetic, and
scale.py's metadata.json size against what real saves write."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import torch
from multiprocess import run_distributed
from scale import ADAMW, WORLD_SIZES, llama, llama_layout, metadata_bytes

from torchshard import DistributedTrainer, checkpoint, plan_memory
from torchshard._flat.geometry import element_ranges
from torchshard._parallel.memory import padded_numel


@pytest.fixture(scope="module")
def layout():
    layout = llama_layout()
    assert 70.0e9 < layout.param_numel < 71.0e9 and layout.dtype == "bfloat16"
    return layout


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_slices_are_equal_contiguous_and_padded_minimally(layout, world):
    align = layout.align_bytes // 2
    padded = padded_numel(layout, world, shard=True)
    slices = element_ranges(padded, world, align)
    assert padded % (world * align) == 0 and 0 <= padded - layout.numel < world * align
    assert slices[0][0] == 0 and slices[-1][1] == padded
    assert all(a == prev for (a, _), (_, prev) in zip(slices[1:], slices))
    assert len({b - a for a, b in slices}) == 1  # every rank owns the same amount


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_per_rank_memory_is_what_the_formula_says(layout, world):
    plan = plan_memory(layout, world, shard=True, optimizer="adamw")
    padded = padded_numel(layout, world, shard=True)
    size = padded // world
    trainable = sum(s.numel for s in layout if s.requires_grad)
    for r in plan:
        assert r.parameters == r.gradients == 2 * padded  # full bf16 buffers on every rank
        assert r.master == 2 * 4 * size  # fp32 master slice and its gradient
        # AdamW: 8 bytes per element of the slice (+ a 4-byte step per parameter piece)
        assert 8 * (size - (padded - layout.numel)) <= r.optimizer - 4 * pieces(
            layout, r.rank, size
        )
        assert r.optimizer - 4 * pieces(layout, r.rank, size) <= 8 * size
    elementwise = sum(r.optimizer - 4 * pieces(layout, r.rank, size) for r in plan)
    assert elementwise == 8 * trainable  # each element's state on exactly one rank
    # 12 bytes per parameter / N instead of 12 per parameter (fp32 state + master)
    worst = max(r.optimizer + r.master // 2 for r in plan)
    assert worst <= 12 * layout.param_numel / world * 1.01


def pieces(layout, rank: int, size: int) -> int:
    a, b = rank * size, (rank + 1) * size
    return sum(1 for s in layout if s.requires_grad and s.offset < b and s.end > a)


def test_checkpoint_metadata_grows_with_ranks_plus_parameters_not_their_product():
    full, half = llama(), llama(num_hidden_layers=40)
    for fm in (full, half):
        lay = fm.layout
        for world in WORLD_SIZES:
            size = metadata_bytes(fm, world)
            # a fixed part, ~200 bytes per parameter (layout, groups, scalar state) and a few
            # hundred per rank (its files and their records): no parameters-times-ranks term
            assert size <= 16 * 1024 + 200 * len(lay) + 400 * world, (len(lay), world, size)
    assert metadata_bytes(full, 1024) < 1024 * 1024  # under 1 MB for 70B at 1024 ranks


SMALL = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
)


def _save_small_llama(root: str) -> dict:
    """A real save of a sharded bf16 trainer (fp32 master) with scale.py's AdamW, one step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fm = llama(**SMALL)  # on meta; the trainer initializes it
    trainer = DistributedTrainer(fm, shard=True)  # initialized the model's own way
    opt = trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
    assert isinstance(fm.module, LlamaForCausalLM) and isinstance(fm.module.config, LlamaConfig)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    fm(input_ids=ids, labels=ids).loss.backward()
    trainer.step()
    path = checkpoint.save(root, trainer, step=1, optimizer=opt)
    trainer.close()
    meta = (path / "metadata.json").read_bytes()
    return {"size": len(meta), "files": len(json.loads(meta)["files"])}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_metadata_bytes_is_what_a_real_save_writes(tmp_path, world):
    # scale.py builds metadata.json with the save path's own functions; only the files' sizes
    # (data bytes, no safetensors header: the same number of digits or one fewer) and
    # checksums are stand-ins. A real save of a small Llama must agree to within those.
    real = run_distributed(_save_small_llama, world, str(tmp_path), timeout=180)[0]
    computed = metadata_bytes(llama(**SMALL), world, step=1)
    assert 0 <= real["size"] - computed <= 2 * real["files"], (real, computed)
