"""TopK (``torchshard.comm.TopK``, experimental) against a one-process oracle, bitwise: each
rank sends the ``ceil(ratio * n)`` entries of each bucket's ``g + e`` largest in magnitude
and keeps the rest as error; every rank sums the ranks' entries in rank order and divides by
the world size. The bytes: ``world * k * (itemsize + 4)`` per bucket, what each rank sends
and receives in the all-gathers of values and int32 indices. Before ``start_step``: the dense
mean, bitwise, with the error still zero."""

from __future__ import annotations

import math

import introspect
import pytest
import torch
import torch.distributed as dist
from comm_oracle import TopKOracle, batch, build, local_then_mean
from multiprocess import run_distributed

from torchshard import DistributedTrainer
from torchshard.comm import TopK

RATIO = 0.1


def _matches_the_oracle(feedback: bool = True, start: int = 0, steps: int = 4) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    fm = build()
    comm = TopK(ratio=RATIO, error_feedback=feedback, start_step=start)
    trainer = DistributedTrainer(fm, comm=comm, bucket_mb=0.004)
    trainer.make_optimizer(torch.optim.SGD, lr=0.05)
    plan = [
        (b.start, b.end, max(1, math.ceil(RATIO * (b.end - b.start))))
        for b in introspect.buckets_of(trainer)
    ]
    numel = fm.flat_grad.numel()  # type: ignore[union-attr]
    oracle = TopKOracle(plan, world, numel, torch.float64, feedback, start)
    out: dict = dict(mean=[], error=[], payload=[], sparse=[])
    for step in range(steps):
        before = trainer.stats.payload_bytes
        every, mean = local_then_mean(trainer, fm, batch(rank, step))
        want = oracle.step(every)
        out["mean"].append(torch.equal(mean, want))
        error = trainer.comm_state()["error"]
        sent = feedback and step >= start  # an error only once it compresses
        out["error"].append(torch.equal(error, oracle.error[rank]) and error.any() == sent)
        out["sparse"].append(int((mean != 0).sum()))
        out["payload"].append(trainer.stats.payload_bytes - before)
        trainer.step()
    sent = sum(k for *_, k in plan)
    out["expected_payload"] = world * sent * (8 + 4) if world > 1 else 0
    out["dense_payload"] = numel * 8 if world > 1 else 0
    out["most_nonzero"] = world * sent
    out["buckets"] = len(plan)
    trainer.close()
    return out


@pytest.mark.parametrize(
    ("world_size", "feedback", "start"),
    [(1, True, 0), (2, True, 0), (3, True, 0), (2, False, 0), (2, True, 2), (1, True, 2)],
)
def test_topk_equals_the_one_process_oracle_bitwise(world_size, feedback, start):
    for r in run_distributed(_matches_the_oracle, world_size, feedback, start, timeout=180):
        assert all(r["mean"]) and all(r["error"]), r
        assert r["buckets"] >= 3
        assert r["payload"] == [r["dense_payload"]] * start + [r["expected_payload"]] * (4 - start)
        sparse = r["sparse"][start:]  # the dense steps reach every entry with a gradient
        assert all(0 < n <= r["most_nonzero"] for n in sparse), r["sparse"]
        assert all(n > r["most_nonzero"] for n in r["sparse"][:start]), r["sparse"]
