"""The buffers a trainer allocates: every element that is no parameter is defined.

Alignment gaps and padding are all-gathered, broadcast and compared; left as
``torch.empty`` found them, a buffer differed bitwise before a save and after its load
(which writes zeros there) even with every parameter equal.
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_distributed

import torchshard


def _non_parameter_elements(shard: bool) -> list[float]:
    n = 4096
    junk = torch.full((n,), float("nan"), dtype=torch.bfloat16)  # leave garbage behind
    del junk
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    fm = torchshard.FlatParamModule(model, dtype=torch.bfloat16, align_bytes=64)
    trainer = torchshard.DistributedTrainer(fm, shard=shard)
    flat = fm.flat_param
    gaps = torch.ones(flat.numel(), dtype=torch.bool)
    for s in fm.layout.slots:
        gaps[s.offset : s.end] = False
    assert gaps.sum() > 0  # the layout has gaps at this alignment
    values = flat[gaps].float()
    trainer.close()
    return [values.abs().max().item(), float(values.isnan().any())]


@pytest.mark.parametrize("shard", [False, True])
def test_gaps_and_padding_of_a_trainer_s_buffer_are_zeros(shard):
    assert run_distributed(_non_parameter_elements, 2, shard, timeout=60) == [[0.0, 0.0]] * 2
