"""trainer.memory_bytes() counts the state of an optimizer built outside make_optimizer."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from models import Blocks as Net  # the README's fully sharded block's model: 4 units
from multiprocess import run_distributed
from torch import nn

from torchshard import DistributedTrainer, FlatParamModule, TorchShardError


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The oracle: every tensor in the optimizer's state."""
    return sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def hooks_registered() -> int:
    from torch.optim.optimizer import _global_optimizer_post_hooks

    from torchshard import _stepped

    return sum(h is _stepped._remember for h in _global_optimizer_post_hooks.values())


def _counts(shard: bool | str) -> dict:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    fm = FlatParamModule(model)
    trainer = DistributedTrainer(fm, shard=shard)
    # The Quickstart's way; in the sharded modes an optimizer over fm.parameters() is
    # refused (test_sharded_modes_refuse_an_optimizer_over_fm_parameters): one of the user's
    # own steps the pieces the trainer shows instead.
    params = [t for *_, t in trainer.optimizer_segments()] if shard else list(fm.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    out = {"before": trainer.memory_bytes()["optimizer"]}
    for _ in range(3):
        opt.zero_grad()
        trainer.zero_grad()
        fm(torch.randn(8, 16)).pow(2).mean().backward()
        trainer.average_gradients()
        opt.step()
    out["found"] = trainer.memory_bytes()["optimizer"]
    out["given"] = trainer.memory_bytes(opt)["optimizer"]  # the same optimizer: counted once
    out["oracle"] = state_bytes(opt)
    out["states"] = len(opt.state)

    # one that loaded state and never stepped: counted when given (a deep copy: a loaded
    # state dict's tensors are the saved ones, and a tensor held twice is counted once)
    loaded = torch.optim.AdamW(params, lr=1e-3)
    loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    out["loaded_given"] = trainer.memory_bytes(loaded)["optimizer"]
    out["loaded_oracle"] = state_bytes(loaded)
    del loaded

    # held weakly: once the optimizer is gone, so is its count
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    out["collected"] = ref() is None
    out["after_del"] = trainer.memory_bytes()["optimizer"]

    with pytest.raises(TorchShardError, match="over none of them"):
        trainer.memory_bytes(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    trainer.close()
    # a second module and trainer: still one hook in the process
    fm2 = FlatParamModule(nn.Linear(4, 4))
    DistributedTrainer(fm2).close()
    out["hooks"] = hooks_registered()
    return out


@pytest.mark.parametrize("shard", [False, True, "full"])
def test_an_optimizer_built_outside_make_optimizer_is_counted(shard):
    out = run_distributed(_counts, 1, shard, timeout=120)[0]
    assert out["before"] == 0  # no state before the first step
    assert out["states"] == 12 and out["oracle"] > 0  # every parameter (or piece) stepped
    assert out["found"] == out["given"] == out["oracle"]
    assert out["loaded_given"] == out["found"] + out["loaded_oracle"]
    assert out["collected"] and out["after_del"] == 0
    assert out["hooks"] == 1


def _with_make_optimizer() -> dict:
    fm = FlatParamModule(Net())
    trainer = DistributedTrainer(fm, shard=True)
    opt = trainer.make_optimizer(torch.optim.AdamW, lr=1e-3)
    fm(torch.randn(8, 16)).pow(2).mean().backward()
    trainer.step()
    out = {"memory": trainer.memory_bytes()["optimizer"], "oracle": state_bytes(opt)}
    trainer.close()
    return out


def test_make_optimizers_optimizer_is_counted_once():
    out = run_distributed(_with_make_optimizer, 1, timeout=120)[0]
    assert out["memory"] == out["oracle"] > 0


def _refused(shard: bool | str) -> dict:
    fm = FlatParamModule(Net())
    trainer = DistributedTrainer(fm, shard=shard)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)
    fm(torch.randn(8, 16)).pow(2).mean().backward()
    trainer.average_gradients()
    out = {}
    try:
        opt.step()
    except TorchShardError as e:
        out["error"] = str(e)
    try:  # every step, not only the first
        opt.step()
    except TorchShardError:
        out["again"] = True
    trainer.close()  # a closed trainer's parameters are anyone's again
    opt.step()
    out["after_close"] = True
    return out


@pytest.mark.parametrize("shard", [True, "full"], ids=["sharded", "full"])
def test_sharded_modes_refuse_an_optimizer_over_fm_parameters(shard):
    for world in (1, 2):
        for r in run_distributed(_refused, world, shard):
            assert "trainer.make_optimizer" in r["error"] and f"shard={shard!r}" in r["error"]
            assert r["again"] and r["after_close"]
