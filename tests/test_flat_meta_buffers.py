"""Build on meta, wrap, load a checkpoint, train: models whose buffers are computed at construction.

A persistent ``scale``, a persistent causal ``mask`` and a non-persistent lookup ``table``.
Built on meta they are zeros; the check that says so fires when forward first reads one,
so a checkpoint load (persistent buffers) or the user (non-persistent ones) can write
them first. The oracle is the run that built the model for real and never stopped. Replicated
and fully sharded (whose trainer materializes the buffers itself, as it shards the weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_distributed
from torch import nn

import torchshard
from torchshard import TorchShardError, checkpoint


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))
        self.register_buffer("table", table(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 4, 8)
        h = self.lin(x) * self.scale + self.table
        return self.out(self.mask @ h)


def table() -> torch.Tensor:
    return torch.arange(8.0).sin()


def loss(fm: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return fm(torch.randn(3, 4, 8, generator=g)).square().mean()


def train(fm, trainer, opt, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss(fm, step, trainer.rank).backward()
        trainer.step()  # average, the optimizer's step, and (fully sharded) free the units


def trainer_of(fm: torchshard.FlatParamModule, shard: bool | str):
    trainer = torchshard.DistributedTrainer(fm, shard=shard)
    return trainer, trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)


def _meta_build_load_train(root: str, shard: bool | str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    fm = torchshard.FlatParamModule(Masked())
    trainer, opt = trainer_of(fm, shard)
    train(fm, trainer, opt, range(3))
    checkpoint.save(root, trainer, step=3, optimizer=opt)

    with torch.device("meta"):
        model = Masked()
    meta = torchshard.FlatParamModule(model)
    resumed, opt2 = trainer_of(meta, shard)  # initializes: the buffers are still zeros
    assert meta.unwritten_buffers() == ["scale", "mask", "table"]
    checkpoint.load(root, resumed, optimizer=opt2)
    assert meta.unwritten_buffers() == ["table"]  # non-persistent: no checkpoint holds it
    out = {}
    try:
        loss(meta, 3, rank)
    except TorchShardError as e:
        out["error"] = str(e)
    model.table.copy_(table())  # the user's part, as the message says
    train(fm, trainer, opt, range(3, 6))
    train(meta, resumed, opt2, range(3, 6))
    with trainer.gathered(), resumed.gathered():
        out["same"] = all(
            torch.equal(a, b) for a, b in zip(fm.state_dict().values(), meta.state_dict().values())
        )
    out["same_buffers"] = all(
        torch.equal(a, b) for a, b in zip(fm.module.buffers(), model.buffers())
    )
    # the meta check's hook is gone: only the trainer's own are left (as on the oracle's)
    out["hooks_left"] = len(model._forward_pre_hooks) - len(fm.module._forward_pre_hooks)
    trainer.close()
    resumed.close()
    return out


@pytest.mark.parametrize("shard", [False, "full"], ids=["replicated", "full"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_meta_built_model_with_buffers_resumes_from_a_checkpoint(tmp_path, world_size, shard):
    args = (str(tmp_path), shard)
    for out in run_distributed(_meta_build_load_train, world_size, *args, timeout=90):
        # every rank raises at the same forward (no rank left waiting in a collective)
        assert "buffer 'table' was built on the meta device" in out["error"], out
        assert "non-persistent" in out["error"] and "scale" not in out["error"], out
        assert out["same"] and out["same_buffers"], out
        assert out["hooks_left"] == 0, out


def _never_written(shard: bool | str) -> str:
    with torch.device("meta"):
        model = Masked()
    fm = torchshard.FlatParamModule(model)
    trainer = torchshard.DistributedTrainer(fm, shard=shard)  # src's zeros: not a write
    try:
        fm(torch.ones(1, 4, 8))
    except TorchShardError as e:
        message = str(e)
    else:
        message = ""
    trainer.close()
    return message


@pytest.mark.parametrize("shard", [False, "full"], ids=["replicated", "full"])
def test_buffers_nothing_wrote_raise_at_the_first_read_on_every_rank(shard):
    for message in run_distributed(_never_written, 2, shard, timeout=60):
        # the first read (forward reads scale first) names it, and the others not yet read
        assert "buffer 'scale' was built on the meta device" in message, message
        assert "also unwritten so far: ['mask', 'table']" in message, message
        assert "load a checkpoint that holds it" in message, message


def test_load_state_dict_counts_as_writing_the_buffers():
    torch.manual_seed(0)
    real = Masked()
    with torch.device("meta"):
        model = Masked()
    fm = torchshard.FlatParamModule(model).bind(
        torch.empty(torchshard.FlatParamModule(Masked()).numel)
    )
    fm.init_weights()
    fm.load_state_dict(real.state_dict())  # persistent buffers written; table is not
    with pytest.raises(TorchShardError, match="buffer 'table'"):
        fm(torch.ones(1, 4, 8))
    model.table.copy_(table())
    x = torch.randn(2, 4, 8)
    assert torch.equal(fm(x), real(x))
