"""trainer.gather_slices(): after a rank's own part changed other than by step(), every rank's
whole weights show every rank's change, in both sharded modes (it raised TypeError with
shard="full": FullyShard.gather had another signature than Mode.gather)."""

from __future__ import annotations

import pytest
import torch
from models import Blocks
from multiprocess import run_distributed

import torchshard


def _edit_own_part_then_gather(shard: bool | str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    trainer = torchshard.DistributedTrainer(
        torchshard.FlatParamModule(Blocks(4, 8, 3)), shard=shard
    )
    fm = trainer.module
    with trainer.gathered():  # whole before the change: gather_slices must refresh them
        with torch.no_grad():
            for *_, piece in trainer.optimizer_segments():  # this rank's part only
                piece.fill_(float(trainer.rank + 1))
        trainer.gather_slices()
        weights = [p.detach().clone() for p in fm.parameters()]
    trainer.close()
    return weights


@pytest.mark.parametrize("shard", [True, "full"], ids=["sharded", "full"])
def test_gather_slices_shows_every_ranks_change_on_every_rank(shard):
    world = 3
    results = run_distributed(_edit_own_part_then_gather, world, shard)
    for got in results[1:]:
        for a, b in zip(results[0], got):
            assert torch.equal(a, b)
    values = torch.cat([w.flatten() for w in results[0]]).unique().tolist()
    assert values == [1.0, 2.0, 3.0]  # every rank's part, and nothing else
