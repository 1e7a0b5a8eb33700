"""PowerSGD (``torchshard.comm.PowerSGD``) against a one-process reimplementation (float64).

Each step, every rank's local gradient is gathered and the oracle (``comm_oracle``) computes
the mean the trainer must produce, each rank's error feedback ``M - M^`` and the shared
``Q``: dense (bitwise the pre-divided mean) before ``start_step``, compressed after. Also:
the bytes a step sends, counted (and at least 15x fewer than dense on the example GPT);
``no_sync()`` sends nothing and leaves the error alone; and the update depends on the
ranks' inputs only through their sum: resumed with the mean error at another world size,
on the same global batches, the run goes on within 1e-12 (and, with the error reset, not).
"""

from __future__ import annotations

import introspect
import pytest
import torch
import torch.distributed as dist
from comm_oracle import PowerSGDOracle, batch, build, grad_slots, local_then_mean, loss_of
from gpt import GPT, GPTConfig
from multiprocess import run_distributed

from torchshard import DistributedTrainer, FlatParamModule
from torchshard.comm import PowerSGD

BUCKET_MB = 0.004  # ~4 KB of float64: the test model spreads over several buckets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _matches_the_oracle(rank_r: int, start: int, steps: int, frozen: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    fm = build(frozen=frozen)
    trainer = DistributedTrainer(
        fm, comm=PowerSGD(rank=rank_r, start_step=start), bucket_mb=BUCKET_MB
    )
    trainer.make_optimizer(torch.optim.SGD, lr=0.05)
    state = trainer.comm_state()
    oracle = PowerSGDOracle(fm, world, rank_r, start, state["powersgd_q"])
    out: dict = dict(dense_bitwise=[], mean=[], error=[], q=[], lossy=[], payload=[], steps=[])
    for step in range(steps):
        before = trainer.stats.payload_bytes
        every, mean = local_then_mean(trainer, fm, batch(rank, step))
        want = oracle.step(every)
        state = trainer.comm_state()
        if step < start:
            out["dense_bitwise"].append(torch.equal(mean, want))
        else:
            out["mean"].append(_rel(mean, want))
            out["error"].append(_rel(state["error"], oracle.error[rank]))
            out["q"].append(_rel(state["powersgd_q"], oracle.q))
            out["lossy"].append(_rel(mean, every.mean(0)))  # compression did something
        out["payload"].append(trainer.stats.payload_bytes - before)
        out["steps"].append(int(state["steps"]))
        trainer.step()
    out["buckets"] = trainer.stats.buckets
    out["error_numel"] = trainer.comm_state()["error"].numel()  # only what trains
    out["grad_numel"] = fm.layout.grad_layout.numel
    out["flat_numel"] = fm.layout.numel
    out["reduced"] = trainer.stats.bytes_reduced
    out["expected_payload"] = _payload(fm, rank_r) if world > 1 else 0
    out["dense_payload"] = fm.flat_grad.numel() * 8 if world > 1 else 0  # type: ignore[union-attr]
    trainer.close()
    return out


def _payload(fm: FlatParamModule, r: int, min_compression: float = 2.0) -> int:
    """Bytes of one compressed step, from the layout: P and Q of each compressed matrix, the
    rest at full size (alignment gaps not sent)."""
    total = 0
    for _, shape in grad_slots(fm):
        numel = int(torch.tensor(shape).prod()) if shape else 1
        if len(shape) >= 2:
            n, m = shape[0], numel // shape[0]
            k = min(r, n, m)
            if n * m > min_compression * (n + m) * k:
                total += (n + m) * k
                continue
        total += numel
    return total * fm.flat_grad.element_size()  # type: ignore[union-attr]


@pytest.mark.parametrize(("world_size", "frozen"), [(1, False), (2, False), (3, False), (2, True)])
def test_powersgd_equals_the_one_process_oracle(world_size, frozen):
    for r in run_distributed(_matches_the_oracle, world_size, 2, 2, 5, frozen, timeout=240):
        assert r["dense_bitwise"] == [True, True] or world_size > 2, r["dense_bitwise"]
        assert r["error_numel"] == r["grad_numel"] < r["flat_numel"] or not frozen
        assert len(r["mean"]) == 3 and max(r["mean"]) <= 1e-12, r["mean"]
        assert max(r["error"]) <= 1e-12 and max(r["q"]) <= 1e-12, (r["error"], r["q"])
        assert min(r["lossy"]) > 1e-6  # a rank-2 approximation, not the exact mean
        assert r["steps"] == [1, 2, 3, 4, 5]
        assert r["buckets"] >= 3
        # dense steps send the gradient; compressed ones P, Q and the vectors, counted
        assert r["payload"] == [r["dense_payload"]] * 2 + [r["expected_payload"]] * 3
        if world_size > 1:
            assert r["expected_payload"] < r["dense_payload"]


def _no_sync_sends_nothing() -> dict:
    rank = dist.get_rank()
    fm = build()
    trainer = DistributedTrainer(fm, comm=PowerSGD(rank=2, start_step=0), bucket_mb=BUCKET_MB)
    trainer.zero_grad()
    with trainer.no_sync():
        loss_of(fm, batch(rank, 0)).backward()
    quiet = trainer.stats.payload_bytes == 0 and not trainer.comm_state()["error"].any()
    loss_of(fm, batch(rank, 1)).backward()  # accumulates, then synchronizes
    trainer.average_gradients()
    sent = trainer.stats.payload_bytes > 0 and bool(trainer.comm_state()["error"].any())
    trainer.close()
    return dict(quiet=quiet, sent=sent)


def test_no_sync_compresses_nothing_until_gradients_synchronize():
    assert (
        run_distributed(_no_sync_sends_nothing, 2, timeout=120) == [dict(quiet=True, sent=True)] * 2
    )


# -- bytes on the example GPT ------------------------------------------------------------------
def _example_gpt_bytes() -> dict:
    # examples/train_gpt.py's defaults: the small preset over bytes (vocab 256), 128 tokens,
    # float32, buckets of 1 MiB on the CPU
    cfg = GPTConfig(**{**GPTConfig.preset("small").__dict__, "block_size": 128, "vocab_size": 256})
    torch.manual_seed(0)
    fm = FlatParamModule(GPT(cfg))
    trainer = DistributedTrainer(fm, comm=PowerSGD(rank=4, start_step=0), bucket_mb=1.0)
    g = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.randint(0, 256, (2, 129), generator=g)
    fm(idx[:, :-1], idx[:, 1:])[1].backward()
    trainer.average_gradients()
    out = dict(
        reduced=trainer.stats.bytes_reduced,
        payload=trainer.stats.payload_bytes,
        expected=_payload(fm, 4),
        buckets=len(introspect.buckets_of(trainer)),
    )
    trainer.close()
    return out


def test_powersgd_rank_4_sends_at_least_15x_fewer_bytes_on_the_example_gpt():
    for r in run_distributed(_example_gpt_bytes, 2, timeout=180):
        assert r["payload"] == r["expected"] and r["buckets"] > 1
        assert r["reduced"] >= 15 * r["payload"], r["reduced"] / r["payload"]


# -- the update depends on the ranks' inputs only through their sum ----------------------------
ROWS = 12  # a global batch, split evenly over 1, 2, 3 or 4 ranks


def _global(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(0, step, rows=ROWS)


def _part(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _global(step)
    n = ROWS // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _run(trainer: DistributedTrainer, fm: FlatParamModule, steps: range) -> list[torch.Tensor]:
    flats = []
    for step in steps:
        trainer.zero_grad()
        loss_of(fm, _part(step, trainer.rank, trainer.world_size)).backward()
        trainer.step()
        flats.append(fm.flat_param.clone())  # type: ignore[union-attr]
    return flats


SAVE, END = 4, 8


def _first_run() -> dict:
    fm = build()
    trainer = DistributedTrainer(fm, comm=PowerSGD(rank=2, start_step=1), bucket_mb=BUCKET_MB)
    trainer.make_optimizer(torch.optim.SGD, lr=0.05)
    _run(trainer, fm, range(SAVE))
    state = {k: v.clone() for k, v in trainer.comm_state().items()}
    dist.all_reduce(state["error"])
    state["error"] /= trainer.world_size  # the mean error: what a checkpoint keeps
    saved = dict(flat=fm.flat_param.clone(), state=state)  # type: ignore[union-attr]
    saved["after"] = _run(trainer, fm, range(SAVE, END))
    trainer.close()
    return saved


def _resumed(saved: dict, reset: bool) -> float:
    fm = build()
    trainer = DistributedTrainer(fm, comm=PowerSGD(rank=2, start_step=1), bucket_mb=BUCKET_MB)
    trainer.make_optimizer(torch.optim.SGD, lr=0.05)
    with torch.no_grad():
        fm.flat_param.copy_(saved["flat"])  # type: ignore[union-attr]
    trainer.load_comm_state(saved["state"])
    if reset:
        trainer.reset_comm_error()
    after = _run(trainer, fm, range(SAVE, END))
    trainer.close()
    return max(float((a - b).abs().max()) for a, b in zip(after, saved["after"]))


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_mean_error_resumes_powersgd_at_another_world_size(world_size):
    saved = run_distributed(_first_run, 2, timeout=180)[0]
    kept = run_distributed(_resumed, world_size, saved, False, timeout=180)
    assert max(kept) <= 1e-12, kept
    dropped = run_distributed(_resumed, world_size, saved, True, timeout=180)
    assert min(dropped) > 1e-6, dropped  # without the error the run goes elsewhere
