"""One rank of 2 or 3 fails in the middle of writing a checkpoint, after the prepare phase:
every rank raises CheckpointError, nothing is committed, the previous checkpoint still loads
bitwise, and the next save of the same step commits.

The failure is that rank's alone: a full disk (``RLIMIT_FSIZE`` set in that process, with
SIGXFSZ ignored so that ``write`` fails with EFBIG) on its first file, or an I/O error
(EIO, from an audit hook) when it opens its optimizer-state file, its model file written.
The other ranks write their files normally; they learn of the failure through the store.
Sharded trainers (every rank writes weights and optimizer state), and fully sharded ones,
whose save first moves the stripes into the files' ranges (an all-to-all inside ``save``).
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from multiprocess import run_distributed
from sharded_harness import differences, flat_state, new_trainer, train

from torchshard import checkpoint
from torchshard.checkpoint import CheckpointError

_armed = threading.Event()  # the audit hook's switch (a hook cannot be removed)


def _eio_on_optimizer_file(event: str, args: tuple) -> None:
    if event != "open" or not _armed.is_set() or not args:
        return
    if isinstance(args[0], (str, bytes, os.PathLike)):
        path = Path(os.fsdecode(args[0]))
        if path.parent.name.startswith(".tmp-step-") and path.name.startswith("optim-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))


def arm(how: str) -> tuple[int, int] | None:
    if how == "efbig":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))  # a shard: ~20 KB
        return limit
    sys.addaudithook(_eio_on_optimizer_file)
    _armed.set()
    return None


def disarm(limit: tuple[int, int] | None) -> None:
    _armed.clear()
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)


def _one_rank_fails_mid_write(
    root: str, failing: int, how: str, use_async: bool, shard: bool | str
) -> dict:
    rank = dist.get_rank()
    trainer = new_trainer(shard=shard)  # every rank writes weights and optimizer state
    opt = trainer.optimizer
    train(trainer, range(1))
    checkpoint.save(root, trainer, step=1, optimizer=opt)
    good = flat_state(trainer)
    train(trainer, range(1, 2))
    limit = arm(how) if rank == failing else None
    error = None
    try:
        if use_async:
            future = checkpoint.async_save(root, trainer, step=2, optimizer=opt)
            train(trainer, range(2, 3))  # training goes on while the save fails
            future.wait()
        else:
            checkpoint.save(root, trainer, step=2, optimizer=opt)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # reported: the test fails on it
        error = f"not a CheckpointError: {type(e).__name__}: {e}"
    finally:
        disarm(limit)
    dist.barrier()  # every rank's save is over
    out = {"error": error, "steps": [p.name for p in sorted(Path(root).glob("step-*"))]}
    fresh = new_trainer(shard=shard, seed=1)
    info = checkpoint.load(root, fresh, optimizer=fresh.optimizer)  # the latest: step 1
    out["loaded_step"], out["loaded"] = info.step, differences(flat_state(fresh), good)
    fresh.close()
    # the writer is usable again, and the step that failed can be saved after all
    out["resaved"] = checkpoint.save(root, trainer, step=2, optimizer=opt).name
    trainer.close()
    return out


CASES = [  # (world size, failing rank, how, async, shard)
    (2, 1, "efbig", False, True),
    (2, 0, "efbig", True, True),
    (3, 1, "eio", True, True),
    (3, 0, "eio", False, True),
    (3, 2, "efbig", True, True),
    (3, 1, "efbig", True, "full"),
    (2, 0, "eio", False, "full"),
]


@pytest.mark.parametrize(
    ("world_size", "failing", "how", "use_async", "shard"),
    CASES,
    ids=[
        f"{w}ranks-rank{f}-{h}-{'async' if a else 'blocking'}{'-full' if s == 'full' else ''}"
        for w, f, h, a, s in CASES
    ],
)
def test_one_rank_failing_mid_write_fails_the_save_on_every_rank(
    tmp_path, world_size, failing, how, use_async, shard
):
    root = tmp_path / "ckpt"
    args = (str(root), failing, how, use_async, shard)
    results = run_distributed(_one_rank_fails_mid_write, world_size, *args, timeout=180)
    reason = os.strerror(errno.EFBIG if how == "efbig" else errno.EIO)
    for rank, r in enumerate(results):
        message = r["error"]
        assert message is not None, f"rank {rank}: the save did not fail"
        assert not message.startswith("not a CheckpointError"), (rank, message)
        if rank == failing:  # its own error names the file it could not write
            assert reason in message and ".tmp-step-00000002" in message, (rank, message)
            assert ("model-" if how == "efbig" else "optim-") in message, (rank, message)
        elif rank == 0:  # rank 0 learns it from the failing rank before it commits
            assert f"rank {failing}: " in message and reason in message, (rank, message)
        # (another rank learns it from rank 0's failed commit, unless rank 0 removed the
        # directory under its files first: then its own write fails; either way it raises)
        # nothing was committed, and the latest checkpoint loads bitwise as saved
        assert r["steps"] == ["step-00000001"], (rank, r["steps"])
        assert r["loaded_step"] == 1 and not r["loaded"], (rank, r["loaded"])
        assert r["resaved"] == "step-00000002", rank
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]
