"""``reduce_dtype``: bf16 gradients summed over the ranks in fp32 (issue 21, pytorch#106395).

The oracle, computed in each rank alone: every rank's local bf16 gradient (the same model on
that rank's batch), summed in fp32 and divided by the world size. With
``reduce_dtype=torch.float32`` the gradient the optimizer steps equals it bitwise at 2 ranks:
in fp32 where there is an fp32 master gradient (``shard=True``, ``shard="full"``), rounded
once to bf16 where there is none (replicated). Without it, the bf16 sum rounds on the wire:
the test checks that the master gradient then differs, so it tells the two apart.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from cases import Cases
from models import Blocks

from torchshard import DistributedTrainer, FlatParamModule, TorchShardError

MODES = [False, True, "full"]
MODE_IDS = ["replicated", "sharded", "full"]


def batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(8, 16, generator=g).to(torch.bfloat16)


def _loss(model: torch.nn.Module, rank: int) -> torch.Tensor:
    return model(batch(rank)).float().pow(2).mean()


def _reduced_like_the_oracle(
    shard: bool | str, reduce_dtype: torch.dtype | None, frozen: bool
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Blocks(n=3).to(torch.bfloat16)
    if frozen:  # frozen before and between trainable ones: the full mode reduces runs
        ref.embed.requires_grad_(False)
        ref.blocks[1].requires_grad_(False)
    fm = FlatParamModule(copy.deepcopy(ref))
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.004, reduce_dtype=reduce_dtype)
    trainer.make_optimizer(torch.optim.SGD, lr=0.0)
    _loss(fm, rank).backward()
    trainer.average_gradients()
    # the oracle: every rank's bf16 gradient, summed in fp32, divided by the world size
    layout = fm.layout
    oracle = torch.zeros(layout.numel, dtype=torch.float32)
    names = dict(ref.named_parameters())
    for r in range(world):
        ref.zero_grad()
        _loss(ref, r).backward()
        for s in layout.slots:
            if s.requires_grad:
                oracle[s.offset : s.end] += names[s.name].grad.reshape(-1).float()
    oracle /= world
    bitwise, rounded = [], []
    for slot, a, b, t in trainer.optimizer_segments():
        got = t.grad.reshape(-1)
        want = oracle[a:b] if got.dtype == torch.float32 else oracle[a:b].to(got.dtype)
        rounded.append(got.dtype != torch.float32)
        if not torch.equal(got, want):
            bitwise.append(layout.slots[slot].name)
    trainer.close()
    return {"differ": bitwise, "rounded": rounded, "pieces": len(rounded)}


REDUCE = Cases(
    _reduced_like_the_oracle,
    params=["shard", "reduce_dtype", "frozen"],
    timeout=120,
    world_size=2,
)


@pytest.mark.parametrize("frozen", [False, True], ids=["all", "some-frozen"])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shard", MODES, ids=MODE_IDS)
@REDUCE.mark(cases=12)
def test_bf16_gradients_reduced_in_fp32_are_the_fp32_mean(request, shard, reduce_dtype, frozen):
    ranks = REDUCE.results(request)
    assert sum(r["pieces"] for r in ranks) > 0
    for r in ranks:
        # fp32 master gradients in the sharded modes; rounded once to bf16 when replicated
        assert all(r["rounded"]) == (shard is False), r
    if reduce_dtype is torch.float32:
        assert all(r["differ"] == [] for r in ranks), ranks
    elif shard:  # summed in bf16 on the wire: the fp32 master gradient shows the rounding
        assert any(r["differ"] for r in ranks), ranks
    else:  # replicated at 2 ranks: two bf16 halves summed round once, as the oracle's cast
        assert all(r["differ"] == [] for r in ranks), ranks


def test_reduce_dtype_must_be_a_floating_dtype():
    fm = FlatParamModule(Blocks())
    with pytest.raises(TorchShardError, match="reduce_dtype: expected a floating point"):
        DistributedTrainer(fm, reduce_dtype=torch.int32)
