"""A bf16 buffer trained with ``shard=True`` (fp32 master slices): saved at 4 ranks, resumed
replicated at 2, sharded at 3, and at 4 bitwise as the run that never stopped.

The fp32 master must come back bit for bit, including the low 16 bits of the mantissa that
the bf16 weights cannot hold: a load that rebuilt the master from the bf16 weights
(``refresh_master()``) and did not then restore the saved ``master`` state would lose them.
The oracle is the uninterrupted run of the saving processes, carried with ``torch.save``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multiprocess import run_distributed
from sharded_harness import differences, flat_state, new_trainer, train

from torchshard import checkpoint

SAVE_AT, MORE = 3, 3  # steps before the save, and after it

# Four processes save and resume, two and three resume: ~6 s of CPU per process before the
# first step (torch.optim imports torch._dynamo), over 30 s on a busy 2-core box.
pytestmark = pytest.mark.slow


def _save_at_4_then_resume(root: str, expected: str) -> dict:
    """Save at step 3 and go on to step 6 (the oracle); then a fresh trainer of other weights,
    in the same 4 processes, loads step 3 and goes on to step 6 too."""
    trainer = new_trainer(shard=True, dtype=torch.bfloat16)
    train(trainer, range(SAVE_AT))
    checkpoint.save(root, trainer, step=SAVE_AT, optimizer=trainer.optimizer)
    state = flat_state(trainer)
    train(trainer, range(SAVE_AT, SAVE_AT + MORE))  # the uninterrupted run goes on
    final = flat_state(trainer)
    state["final/weights"], state["final/master"] = final["weights"], final["master"]
    if trainer.rank == 0:
        torch.save(state, expected)
    trainer.close()
    return _resume(root, expected, shard=True)


def _resume(root: str, expected: str, shard: bool) -> dict:
    trainer = new_trainer(shard=shard, dtype=torch.bfloat16, seed=1)  # other weights
    info = checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    want = torch.load(expected, weights_only=True)
    saved = {k: v for k, v in want.items() if not k.startswith("final/")}
    got = flat_state(trainer)
    if not shard:
        # No master to restore into: the bf16 weights are what the sharded run gathered
        # (its master rounded), and the fp32 moments become the bf16 parameters' dtype,
        # as torch's Optimizer.load_state_dict casts them.
        saved.pop("master")
        saved = {k: v if k.endswith("/slot") else v.to(torch.bfloat16) for k, v in saved.items()}
    out = {"step": info.step, "after_load": differences(got, saved)}
    train(trainer, range(SAVE_AT, SAVE_AT + MORE))
    trainer.assert_in_sync()
    out["finite"] = bool(torch.isfinite(trainer.module.flat_param).all())
    if shard:
        final = flat_state(trainer)
        out["continued"] = differences(
            {"weights": final["weights"], "master": final["master"]},
            {"weights": want["final/weights"], "master": want["final/master"]},
        )
    trainer.close()
    return out


def check(results: list[dict], bitwise_continuation: bool) -> None:
    for rank, r in enumerate(results):
        assert r["step"] == SAVE_AT
        assert not r["after_load"], f"rank {rank}: differs from the saved state: {r['after_load']}"
        assert r["finite"], rank
        if bitwise_continuation:  # the same run as the uninterrupted one
            assert not r["continued"], f"rank {rank}: the continuation differs: {r['continued']}"


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("bf16-master")
    root, expected = tmp / "ckpt", tmp / "expected.pt"
    resumed = run_distributed(_save_at_4_then_resume, 4, str(root), str(expected), timeout=180)
    return root, expected, resumed


def test_saved_master_holds_bits_that_bf16_weights_cannot(saved_at_4):
    root, expected, _ = saved_at_4
    want = torch.load(expected, weights_only=True)
    master, weights = want["master"], want["weights"]
    assert weights.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert torch.equal(master.to(torch.bfloat16), weights)  # the weights: the master, rounded
    # the load test below is only a test if the master carries more than the weights
    lost = (master != weights.float()).sum().item()
    assert lost > 0.9 * master.numel(), f"only {lost} of {master.numel()} master values differ"
    meta = json.loads((root / f"step-{SAVE_AT:08d}" / "metadata.json").read_text())
    assert meta["world_size"] == 4 and meta["layout"]["dtype"] == "bfloat16", meta["layout"]
    assert meta["optimizer"]["flat_state"]["master"] == "float32", meta["optimizer"]["flat_state"]


def test_resumed_sharded_at_4_continues_bitwise_as_the_uninterrupted_run(saved_at_4):
    check(saved_at_4[2], bitwise_continuation=True)


def test_resumed_replicated_at_2(saved_at_4):
    root, expected, _ = saved_at_4
    check(run_distributed(_resume, 2, str(root), str(expected), False, timeout=180), False)


def test_resumed_sharded_at_3_restores_the_master_bitwise(saved_at_4):
    root, expected, _ = saved_at_4
    check(run_distributed(_resume, 3, str(root), str(expected), True, timeout=180), False)
