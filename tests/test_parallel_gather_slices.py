"""trainer.gather_slices(): after a rank's own part changed other than by step(), every rank's
whole weights show every rank's change, in both sharded modes (it raised TypeError with
shard="full": FullyShard.gather had another signature than Mode.gather)."""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_distributed
from torch import nn

import torchshard


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _edit_own_part_then_gather(shard: bool | str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    trainer = torchshard.DistributedTrainer(torchshard.FlatParamModule(Net()), shard=shard)
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
