"""Pipeline checkpoints are asynchronous (issue 26): ``async_save`` stages its copies and
returns while a background thread writes (held back here by a test hook), training goes
on, and the files hold the step saved, bitwise a blocking save of it; the checkpoint loads
bitwise (continuing from it is the uninterrupted run). ``Checkpointer(keep_last=2)`` rotates
several async saves; a save that fails on one rank raises on every rank and commits
nothing; a damaged newest checkpoint is skipped by ``fallback=True``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_harness import flip_byte
from multiprocess import run_distributed
from test_checkpoint_pipeline import NO_DECAY, _batches, _mine, _picture, _pipe, _same, _train

from torchshard import checkpoint
from torchshard.checkpoint import _save


def _held(gate: threading.Event):
    """``_save._tp_files``, waiting for ``gate`` before it writes anything."""
    write = _save._tp_files

    def slow(*args: object) -> dict:
        assert gate.wait(120), "the test never opened the gate"
        return write(*args)

    return slow


def _async(root: Path, shard: bool) -> dict:
    torch.set_default_dtype(torch.float32)
    batches = _batches(4)
    pipe = _pipe(2, shard=shard)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    _train(pipe, opt, batches[:2])
    checkpoint.save(root / "sync", pipe, step=2, optimizer=opt)  # the oracle
    at_save = _mine(pipe)
    gate, write = threading.Event(), _save._tp_files
    _save._tp_files = _held(gate)
    try:
        future = checkpoint.async_save(root / "async", pipe, step=2, optimizer=opt)
        pending = not future.done() and not (root / "async" / "step-00000002").exists()
        _train(pipe, opt, batches[2:])  # the weights and the optimizer state change
        still = not future.done()
        gate.set()
        path = future.wait()
    finally:
        _save._tp_files = write
    uninterrupted = _mine(pipe)
    pipe.close()
    pipe = _pipe(2, seed=7, shard=shard)  # load it, and go on to step 4
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    info = checkpoint.load(path, pipe, optimizer=opt)
    loaded = _mine(pipe)
    _train(pipe, opt, batches[2:])
    resumed = _mine(pipe)
    pipe.close()
    return {
        "pending": pending and still,
        "step": info.step,
        "at_save": at_save,
        "loaded": loaded,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
    }


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(x, b[n]) for n, x in a.items())


@pytest.mark.parametrize("shard", [True, False])
def test_async_save_writes_in_the_background_the_step_saved(tmp_path: Path, shard: bool) -> None:
    got = run_distributed(_async, 4, tmp_path, shard, timeout=300)
    _same(_picture(tmp_path / "sync"), _picture(tmp_path / "async"))  # not step 4's bytes
    for rank in got:
        assert rank["pending"] and rank["step"] == 2
        assert _equal(rank["at_save"], rank["loaded"])
        assert not _equal(rank["at_save"], rank["uninterrupted"])  # training went on
        assert _equal(rank["uninterrupted"], rank["resumed"])  # optimizer state bitwise


def _failing(write, rank: int):
    """``write``, failing on global rank ``rank`` as a full disk does."""

    def fail(*args: object) -> dict:
        if dist.get_rank() == rank:
            raise OSError(28, "No space left on device (a test hook)")
        return write(*args)

    return fail


def _rotate(root: Path) -> dict:
    torch.set_default_dtype(torch.float32)
    batches = _batches(3)
    pipe = _pipe(2, shard=True)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    snaps, errors = {}, []
    with checkpoint.Checkpointer(root, keep_last=2) as saver:
        for step in (1, 2, 3):
            _train(pipe, opt, batches[step - 1 : step])
            snaps[step] = _mine(pipe)
            saver.save(pipe, step=step, optimizer=opt)  # waits for the one before
        write = _save._tp_files
        _save._tp_files = _failing(write, 3)
        try:
            future = saver.save(pipe, step=4, optimizer=opt)
            try:
                future.wait()
            except checkpoint.CheckpointError as e:
                errors.append(str(e))
        finally:
            _save._tp_files = write
    dist.barrier()  # every rank's save is over
    after = sorted(p.name for p in root.iterdir())
    dist.barrier()
    if dist.get_rank() == 0:  # damage the newest: its metadata's checksum fails
        flip_byte(root / "step-00000003" / "metadata.json", 40)
    dist.barrier()
    info = checkpoint.Checkpointer(root).load(pipe, optimizer=opt, fallback=True)
    loaded = _mine(pipe)
    pipe.close()
    return {
        "after": after,
        "errors": errors,
        "step": info.step,
        "skipped": [Path(p).name for p, _ in info.skipped],
        "same": _equal(loaded, snaps[2]),
    }


def test_checkpointer_rotates_async_saves_and_a_failed_save_commits_nothing(
    tmp_path: Path,
) -> None:
    got = run_distributed(_rotate, 4, tmp_path, timeout=300)
    for rank in got:
        assert rank["after"] == ["step-00000002", "step-00000003"], rank["after"]
        assert len(rank["errors"]) == 1 and "No space left" in rank["errors"][0], rank["errors"]
        assert rank["step"] == 2 and rank["skipped"] == ["step-00000003"], rank
        assert rank["same"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003.bad"]
    assert checkpoint.inspect_checkpoint(tmp_path / "step-00000002").ok
