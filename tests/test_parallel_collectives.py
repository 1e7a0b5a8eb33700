"""The collective log: every rank issues the same collectives, in the same order, with the same
sizes and dtypes, on contiguous tensors on the trainer's device, from the main thread.

Gloo tolerates what NCCL does not: a collective one rank skips, or issues with another count,
can pass unnoticed on gloo (or fail far from its cause) where NCCL hangs until its watchdog.
So each rank records every ``torch.distributed`` collective it calls, by monkeypatching the
``torch.distributed`` module (torchshard calls ``dist.all_reduce`` etc. through
``import torch.distributed as dist``), over a replicated, a sharded and a fully sharded run:
steps, a parameter used on one rank only, accumulation (in ``no_sync``, or without it in the
fully sharded mode, whose hooks gather and reduce-scatter each unit as the forward and backward
reach it), a blocking and an async checkpoint save and a load. The logs are compared with each
other, never with a hard-coded list: which collective torchshard uses for a job (``all_gather``
or ``all_gather_into_tensor``) may change; that every rank calls the same one may not. Only an
``all_to_all_single``'s sizes may differ by rank (a save's exchange is uneven); they must agree
pairwise: what rank p sends rank r is what rank r expects from rank p.

What it catches, for example: a rank that sends the used-parameter mask in its own all-reduce
only when it has a parameter without a gradient (rank 0 logs ``all_reduce(n=24)``, rank 1 logs
nothing there: NCCL deadlocks), a bucket cut that depends on the rank's slice, a checkpoint
exchange issued from the background writer thread, or a tensor left on the CPU under NCCL.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cases import Cases
from gpt import GPTConfig
from models import GPTWithAux
from multiprocess import run_distributed
from probes import OBJECT_COLLECTIVES, Call, CollectiveLog

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, checkpoint

CFG = GPTConfig.preset("tiny")
BUCKET_MB = 0.01  # ~10 KB: the tiny GPT spreads over several buckets


def comparable(call: Call | None) -> Call | None:
    """The call as every rank must issue it: an ``all_to_all_single``'s sizes differ by rank
    (a save's exchange sends each rank what it holds), so only its dtypes and layout count
    there; :func:`split_mismatch` checks the sizes against each other."""
    if call is None or call.op != "all_to_all_single":
        return call
    tensors = tuple((arg, (None, *d[1:])) for arg, d in call.tensors)
    return call._replace(tensors=tensors, splits=None)


def first_divergence(logs: list[list[Call]]) -> str | None:
    """Where the ranks' logs first differ (``None``: identical), with a little context."""
    for rank, log in enumerate(logs[1:], 1):
        for i, (a, b) in enumerate(itertools.zip_longest(logs[0], log)):
            if comparable(a) != comparable(b):
                before = logs[0][max(0, i - 2) : i]
                return (
                    f"call {i}: rank 0 {a} vs rank {rank} {b}"
                    f"\n(the calls before, on rank 0: {before})"
                )
    return None


def split_mismatch(logs: list[list[Call]]) -> str | None:
    """Where an ``all_to_all_single`` sends what its peer does not expect (``None``: nowhere):
    rank p's ``input_split_sizes[r]`` must be rank r's ``output_split_sizes[p]``, and each
    list must add up to its tensor's length."""
    exchanges = [[c for c in log if c.op == "all_to_all_single"] for log in logs]
    for k, calls in enumerate(zip(*exchanges)):
        for p, call in enumerate(calls):
            sent, received = call.splits or (None, None)
            if sent is None or received is None:
                return f"exchange {k}, rank {p}: even splits, expected explicit sizes"
            sizes = dict(call.tensors)
            if sum(received) != sizes["output"][0] or sum(sent) != sizes["input"][0]:
                return f"exchange {k}, rank {p}: splits {call.splits} vs tensors {sizes}"
            for r, peer in enumerate(calls):
                if sent[r] != peer.splits[1][p]:
                    return f"exchange {k}: rank {p} sends {sent[r]} to rank {r}, which expects {peer.splits[1][p]}"  # fmt: skip
    return None


def flat_descriptions(call: Call) -> list[tuple[int, str, bool, str]]:
    out = []
    for _, d in call.tensors:
        out += list(d) if isinstance(d[0], tuple) else [d]
    return out


# -- the workers --------------------------------------------------------------------------------
def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def build(shard: bool | str, seed: int = 0) -> tuple[FlatParamModule, DistributedTrainer, Any]:
    torch.manual_seed(seed)
    fm = FlatParamModule(GPTWithAux(CFG))
    trainer = DistributedTrainer(fm, bucket_mb=BUCKET_MB, shard=shard)
    opt = trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    return fm, trainer, opt


def step(fm, trainer, step_no: int, use_aux: bool = True, micro: int = 1) -> None:
    rank = dist.get_rank()
    trainer.zero_grad()
    # the fully sharded mode has no no_sync: every backward reduce-scatters into the stripes
    accumulate = contextlib.nullcontext() if trainer.shard == "full" else trainer.no_sync()
    with accumulate:
        for m in range(micro - 1):
            fm(*batch(rank, 100 * step_no + m), use_aux=use_aux)[1].backward()
    fm(*batch(rank, 100 * step_no + micro), use_aux=use_aux)[1].backward()
    trainer.average_gradients()
    trainer.clip_grad_norm_(0.5)
    trainer.step()


SHARD = {"replicated": False, "sharded": True, "full": "full"}


def _scenarios(mode: str, root: str) -> dict[str, Any]:
    shard = SHARD[mode]
    rank = dist.get_rank()
    log = CollectiveLog()
    log.install()
    try:
        log.phase = "build"
        fm, trainer, opt = build(shard)
        log.phase = "step, every parameter used"
        for i in range(2):
            step(fm, trainer, i)
        log.phase = "step, aux used on rank 0 only"
        step(fm, trainer, 2, use_aux=rank == 0)
        log.phase = "step, aux used nowhere"
        step(fm, trainer, 3, use_aux=False)
        log.phase = "accumulation"
        step(fm, trainer, 4, micro=3)
        step(fm, trainer, 5, use_aux=rank == 1, micro=2)
        log.phase = "save"
        checkpoint.save(root, trainer, step=6, optimizer=opt)
        log.phase = "async_save, a step while it writes"
        future = checkpoint.async_save(root, trainer, step=7, optimizer=opt)
        step(fm, trainer, 7)
        future.wait()
        log.phase = "load: build"
        fm2, trainer2, opt2 = build(shard, seed=1)
        log.phase = "load"
        checkpoint.load(root, trainer2, optimizer=opt2)
        log.phase = "step after load"
        step(fm2, trainer2, 8)
        log.phase = "assert_in_sync"
        trainer2.assert_in_sync()
    finally:
        log.uninstall()
    device = str(trainer.device)
    trainer.close()
    trainer2.close()
    return {"log": log.calls, "device": device}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", list(SHARD))
def test_every_rank_issues_the_same_collectives(mode, world_size, tmp_path):
    results = run_distributed(_scenarios, world_size, mode, str(tmp_path / "ckpt"), timeout=240)
    logs = [r["log"] for r in results]
    problem = first_divergence(logs) or split_mismatch(logs)
    assert problem is None, problem
    for rank, r in enumerate(results):
        for call in r["log"]:
            where = f"rank {rank}, {call.phase}: {call.op}"
            assert call.op not in OBJECT_COLLECTIVES, f"{where}: an object (pickle) collective"
            assert call.thread == threading.main_thread().name, f"{where}: from {call.thread}"
            for numel, dtype, contiguous, device in flat_descriptions(call):
                assert contiguous, f"{where}: a non-contiguous {dtype} tensor of {numel}"
                assert device == r["device"], f"{where}: on {device}, the trainer on {r['device']}"
    # The wrapper sees torchshard's calls (else the comparison above proves nothing).
    phases = {call.phase for call in logs[0]}
    for phase in ("build", "step, every parameter used", "accumulation", "load"):
        assert phase in phases, f"no collective logged in {phase!r}: {sorted(phases)}"
    if mode == "full":  # and the unit gathers its hooks issue
        ops = {c.op for c in logs[0] if c.phase == "step, every parameter used"}
        assert ops & {"broadcast", "all_gather_single", "all_gather_into_tensor"}, ops


def test_first_divergence_names_the_call():
    """The comparison itself can fail: a mask all-reduce on one rank only, a count that differs."""
    bucket = Call("step", "all_reduce", (("tensor", (128, "torch.float32", True, "cpu")),), (), "default", "MainThread")  # fmt: skip
    mask = bucket._replace(tensors=(("tensor", (24, "torch.int32", True, "cpu")),))
    assert first_divergence([[bucket, mask], [bucket, mask]]) is None
    assert "call 1: rank 0" in first_divergence([[bucket, mask], [bucket]])
    other = bucket._replace(tensors=(("tensor", (112, "torch.float32", True, "cpu")),))
    assert "rank 2" in first_divergence([[bucket], [bucket], [other]])


def test_an_exchange_may_differ_in_sizes_only_where_its_peers_agree():
    """``all_to_all_single``: sizes differ by rank and pass the comparison; a dtype does not;
    a rank that sends more than its peer expects is named."""

    def exchange(sent: tuple[int, ...], received: tuple[int, ...], dtype: str = "torch.float32"):
        tensors = (
            ("output", (sum(received), dtype, True, "cpu")),
            ("input", (sum(sent), dtype, True, "cpu")),
        )
        return Call("save", "all_to_all_single", tensors, (), "default", "MainThread", (sent, received))  # fmt: skip

    good = [[exchange((1, 2), (1, 3))], [exchange((3, 4), (2, 4))]]
    assert first_divergence(good) is None and split_mismatch(good) is None
    other_dtype = [good[0], [exchange((3, 4), (2, 4), "torch.bfloat16")]]
    assert "call 0: rank 0" in first_divergence(other_dtype)
    too_much = [good[0], [exchange((5, 4), (2, 4))]]
    assert first_divergence(too_much) is None
    assert "rank 1 sends 5 to rank 0, which expects 3" in split_mismatch(too_much)
    even = [[exchange((1, 2), (1, 3))._replace(splits=(None, None))], good[1]]
    assert "even splits" in split_mismatch(even)


# -- in-place all_gather_into_tensor on gloo -------------------------------------------------------
def _gather_in_place(numel: int, dtype_name: str, op: str) -> list[float]:
    """``gather(out, out[r*n:(r+1)*n])``: the input is this rank's part of the output."""
    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.full((world * numel,), -1, dtype=dtype)
    mine = out[rank * numel : (rank + 1) * numel]
    mine.copy_(torch.arange(numel, dtype=dtype) + 1000 * (rank + 1))
    getattr(dist, op)(out, mine)
    expected = torch.cat([torch.arange(numel, dtype=dtype) + 1000 * (r + 1) for r in range(world)])
    assert torch.equal(out, expected), (out, expected)
    assert mine.data_ptr() == out.data_ptr() + rank * numel * out.element_size()
    return out.tolist()


OPS = [op for op in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, op)]
IN_PLACE = Cases(_gather_in_place, params=["numel", "dtype", "op"], timeout=60)  # a spawn per world


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    ("world_size", "numel", "dtype"),
    [
        pytest.param(2, 7, "float32", marks=IN_PLACE.marks(2, cases=len(OPS))),
        pytest.param(3, 16, "int64", marks=IN_PLACE.marks(3, cases=2 * len(OPS))),
        pytest.param(3, 5, "bfloat16", marks=IN_PLACE.marks(3, cases=2 * len(OPS))),
    ],
)
def test_all_gather_into_tensor_works_in_place_on_gloo(request, world_size, numel, dtype, op):
    results = IN_PLACE.results(request)
    assert all(r == results[0] for r in results)


# -- the suite is hermetic --------------------------------------------------------------------------
def _backend_from_the_environment() -> tuple[str, str | None, bool]:
    info = torchshard.init_distributed()
    return dist.get_backend(), os.environ.get("CUDA_VISIBLE_DEVICES"), info.device.type == "cpu"


def test_workers_see_no_gpu_in_the_cpu_suite(request):
    """tests/conftest.py hides CUDA, so init_distributed() picks gloo even on a GPU box."""
    if request.config.getoption("--gpu"):
        pytest.skip("--gpu: this session keeps the GPUs visible")
    results = run_distributed(
        _backend_from_the_environment, 2, init_process_group=False, timeout=60
    )
    assert results == [("gloo", "", True)] * 2
