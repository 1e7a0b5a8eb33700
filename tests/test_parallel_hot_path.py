"""The step's hot path as a GPU sees it, checked on CPU (review: GPU readiness #3, #4, #7, #10).

- No host reads in a step with every parameter used, from ``zero_grad`` through the forward
  (where the fully sharded mode gathers its units, from hooks) to ``step``: a
  ``TorchDispatchMode`` (``probes.HostReads``) counts ``aten._local_scalar_dense``
  (``.item()``, ``bool()``, ``int()``), ``aten.is_nonzero``, ``aten.lift_fresh``
  (``torch.tensor`` of Python data), ``equal``, ``nonzero``, ``masked_select`` and the
  ``unique`` ops, and ``Tensor.tolist`` is counted by patching it (it does not dispatch). On
  CUDA each is a host synchronization. Controls: a read the step needs (an unused parameter)
  is seen, and so is one in a forward hook.
- One Python hook per parameter.
- ``ReduceOp.AVG`` where the backend has it: gloo has none, so the op is emulated (a sum,
  then a division, as NCCL's average computes it at two ranks); the result must still equal
  DDP's bitwise, which fails if the mean is divided twice or not at all.
"""

from __future__ import annotations

import copy
import gc
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cases import Cases
from gpt import GPT, GPTConfig
from models import GPTWithAux
from multiprocess import run_distributed
from probes import HostReads
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule, TorchShardError

CFG = GPTConfig.preset("tiny")


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _count_host_reads(
    shard: bool | str, dtype: str, unused: bool = False, read_in_a_hook: bool = False
) -> dict[str, int]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    fm = FlatParamModule(GPTWithAux(CFG), dtype=getattr(torch, dtype))
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.01)
    # SGD reads nothing back (torch's single-tensor AdamW reads its step with .item())
    trainer.make_optimizer(torch.optim.SGD, lr=1e-2, momentum=0.9)
    if read_in_a_hook:  # the control: a read where the fully sharded mode gathers a block

        def read(_m: nn.Module, args: tuple[Any, ...]) -> None:
            bool(args[0].isfinite().all())

        fm.module.blocks[1].register_forward_pre_hook(read)
    total: Counter[str] = Counter()
    for step in range(3):
        counter = HostReads()
        with counter:
            trainer.zero_grad()
            # the aux head: used everywhere, or (unused=True) skipped by rank 1
            loss = fm(*batch(rank, step), use_aux=not (unused and rank == 1))[1]
            loss.backward()
            trainer.average_gradients()
            trainer.clip_grad_norm_(1.0)
            trainer.step()
        if step > 0:  # step 0 builds the optimizer's state
            total.update(counter.seen)
    trainer.close()
    return dict(total)


def _reads_with_an_unused_parameter(shard: bool | str) -> dict[str, int]:
    return _count_host_reads(shard, "float32", unused=True)


def _reads_with_a_read_in_a_hook(shard: bool | str) -> dict[str, int]:
    return _count_host_reads(shard, "float32", read_in_a_hook=True)


# each test's cases in one spawn of 2 ranks
EVERY_PARAMETER_USED = Cases(
    _count_host_reads, params=["shard", "dtype"], timeout=120, world_size=2
)
UNUSED = Cases(_reads_with_an_unused_parameter, params=["shard"], timeout=120, world_size=2)
IN_A_HOOK = Cases(_reads_with_a_read_in_a_hook, params=["shard"], timeout=120, world_size=2)


@pytest.mark.parametrize("shard", [False, True, "full"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@EVERY_PARAMETER_USED.mark(cases=6)
def test_no_host_reads_in_a_step_with_every_parameter_used(request, shard, dtype):
    reads = EVERY_PARAMETER_USED.results(request)
    assert reads == [{}, {}]


@pytest.mark.parametrize("shard", [False, True, "full"])
@UNUSED.mark(cases=3)
def test_the_counter_sees_the_read_an_unused_parameter_needs(request, shard):
    # The rank without the aux head's gradient must learn whether another rank has one:
    # it builds the mask from a Python list and reads the reduced mask back. The rank that
    # used everything reads nothing. (Shows the counter would catch a read.)
    reads = UNUSED.results(request)
    assert reads[0] == {}
    assert reads[1].get("tolist", 0) >= 2 and reads[1].get("lift_fresh", 0) >= 2, reads


@pytest.mark.parametrize("shard", [False, True, "full"])
@IN_A_HOOK.mark(cases=3)
def test_the_counter_sees_a_read_in_a_forward_hook(request, shard):
    # A read in a block's forward pre-hook, where the fully sharded mode gathers that block:
    # counted once a step (2 steps counted), on every rank.
    reads = IN_A_HOOK.results(request)
    assert reads == [{"_local_scalar_dense": 2}] * 2, reads


def _hooks_per_parameter() -> list[int]:
    torch.manual_seed(0)
    model = GPT(CFG)
    model.wpe.weight.requires_grad_(False)
    fm = FlatParamModule(model)
    trainer = DistributedTrainer(fm)
    counts = [len(p._post_accumulate_grad_hooks or {}) for p in fm.parameters()]
    with pytest.raises(TorchShardError, match="already has a DistributedTrainer"):
        DistributedTrainer(fm)
    trainer.close()
    DistributedTrainer(fm).close()  # after close() the module is free again
    dropped = DistributedTrainer(fm)
    del dropped  # never closed: once collected, the module is free as well
    gc.collect()
    DistributedTrainer(fm).close()
    return counts


def test_one_hook_per_trainable_parameter_and_one_trainer_per_module():
    counts = run_distributed(_hooks_per_parameter, 1, timeout=60)[0]
    assert counts.count(0) == 1  # the frozen wpe
    assert set(counts) == {0, 1}


class _Done:
    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def _emulate_avg(avg_calls: list[int]) -> None:
    """gloo has no ReduceOp.AVG: stand in for it (sum, then divide) and count its uses."""
    all_reduce, reduce = dist.all_reduce, dist.reduce

    def avg_all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.AVG:
            return all_reduce(t, op=op, group=group, async_op=async_op)
        avg_calls[0] += 1
        all_reduce(t, group=group)
        t.div_(dist.get_world_size(group))
        return _Done() if async_op else None

    def avg_reduce(t, dst, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.AVG:
            return reduce(t, dst, op=op, group=group, async_op=async_op)
        avg_calls[0] += 1
        reduce(t, dst, group=group)
        if dist.get_rank() == dst:
            t.div_(dist.get_world_size(group))
        return _Done() if async_op else None

    dist.all_reduce, dist.reduce = avg_all_reduce, avg_reduce


def _native_mean_matches_ddp(shard: bool | str) -> int:
    from torchshard._parallel import trainer as trainer_module

    rank = dist.get_rank()
    calls = [0]
    _emulate_avg(calls)
    trainer_module.native_mean = lambda group, device: dist.ReduceOp.AVG
    torch.manual_seed(0)
    ref = GPTWithAux(CFG)
    model = copy.deepcopy(ref)
    ddp = DDP(ref, find_unused_parameters=True)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=1e-1)
    fm = FlatParamModule(model)
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.01)
    opt = trainer.make_optimizer(torch.optim.SGD, lr=1e-1)
    for step in range(4):
        use = not (step % 2 and rank == 1)  # the aux head is unused on rank 1 every other step
        for net, o in ((fm, opt), (ddp, ref_opt)):
            o.zero_grad()
            net(*batch(rank, step), use_aux=use)[1].backward()
            trainer.step() if net is fm else o.step()
        with trainer.gathered():  # fully sharded: the weights exist inside this only
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p, q), f"step {step}: {name} differs from DDP"
    trainer.close()
    return calls[0]


@pytest.mark.parametrize("shard", [False, True, "full"])
def test_a_backend_that_averages_is_used_for_the_mean_and_matches_ddp(shard):
    calls = run_distributed(_native_mean_matches_ddp, 2, shard, timeout=120)
    assert min(calls) > 0  # the AVG path ran (gloo itself would have refused the op)
