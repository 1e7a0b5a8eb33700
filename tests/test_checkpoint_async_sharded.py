"""An async save of a sharded trainer (fp32, and bf16 with fp32 master slices) while training
goes on: the checkpoint holds exactly the weights, master weights and optimizer state of the
save step, bitwise, though the live model moved on; resumed, it continues bitwise as the run
that never stopped.

With an optimizer, an async save copies the weights and the state into host memory in its
background thread, and only ``optimizer.step()`` waits for that copy (the fence, a step
pre-hook). To make a missing fence show, the background copy here starts only once the main
thread has entered the next ``optimizer.step()`` (a step pre-hook registered before the
save's, so it runs first): without the fence the step would update the tensors under the
copy. The gate waits on the main thread's progress, never on time.
"""

from __future__ import annotations

import threading

import pytest
import torch
from multiprocess import run_distributed
from sharded_harness import differences, flat_state, new_trainer, train

from torchshard import checkpoint
from torchshard.checkpoint import _staging

SAVE_AT, MORE = 2, 3


def gate_background_staging(optimizer: torch.optim.Optimizer) -> threading.Event:
    """Hold the save's background staging copy until ``optimizer.step()`` has begun."""
    stepping = threading.Event()
    optimizer.register_step_pre_hook(lambda *_: stepping.set())
    assert hasattr(_staging, "_stage_cpu"), "the staging copy was renamed: update this gate"
    real = _staging._stage_cpu

    def gated(copies):
        background = threading.current_thread() is not threading.main_thread()
        if background and not stepping.wait(timeout=120):  # a safety net, not a sync
            raise RuntimeError("the test's gate: no optimizer.step() came")
        real(copies)

    _staging._stage_cpu = gated
    return stepping


def _save_while_training(root: str, dtype_name: str, api: str) -> dict:
    dtype = getattr(torch, dtype_name)
    trainer = new_trainer(shard=True, dtype=dtype)
    opt = trainer.optimizer
    train(trainer, range(SAVE_AT))
    stepping = gate_background_staging(opt)
    saved = flat_state(trainer)  # what the checkpoint must hold
    ckpt = checkpoint.Checkpointer(root) if api == "Checkpointer" else None
    if ckpt is not None:
        future = ckpt.save(trainer, step=SAVE_AT, optimizer=opt)
    else:
        future = checkpoint.async_save(root, trainer, step=SAVE_AT, optimizer=opt)
    train(trainer, range(SAVE_AT, SAVE_AT + MORE))  # training goes on
    path = future.wait()
    if ckpt is not None:
        ckpt.close()
    live = flat_state(trainer)
    out = {
        "gated": stepping.is_set(),
        "moved": [k for k in saved if not torch.equal(saved[k], live[k])],
        "keys": sorted(saved),
    }
    trainer.close()

    fresh = new_trainer(shard=True, dtype=dtype, seed=1)
    info = checkpoint.load(path, fresh, optimizer=fresh.optimizer)
    out["step"] = info.step
    out["loaded"] = differences(flat_state(fresh), saved)
    train(fresh, range(SAVE_AT, SAVE_AT + MORE))
    out["continued"] = differences(flat_state(fresh), live)
    fresh.close()
    return out


@pytest.mark.parametrize("api", ["async_save", "Checkpointer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_save_of_a_sharded_trainer_holds_the_save_step_bitwise(tmp_path, dtype, api):
    results = run_distributed(_save_while_training, 2, str(tmp_path), dtype, api, timeout=180)
    for rank, r in enumerate(results):
        assert r["gated"] and r["step"] == SAVE_AT, r
        expected = {"weights", "exp_avg", "exp_avg_sq", "step/slot"}
        assert set(r["keys"]) == expected | ({"master"} if dtype == "bfloat16" else set()), r
        # every tensor the checkpoint holds changed in the live run after the save ...
        assert sorted(r["moved"]) == r["keys"], f"rank {rank}: unchanged: {r}"
        # ... and the checkpoint holds the save step's, bitwise
        assert not r["loaded"], f"rank {rank}: the checkpoint differs from step {SAVE_AT}: {r}"
        assert not r["continued"], f"rank {rank}: the resumed run differs: {r['continued']}"
    assert [p.name for p in tmp_path.iterdir()] == [f"step-{SAVE_AT:08d}"]
