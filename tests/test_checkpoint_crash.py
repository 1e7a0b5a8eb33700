"""Saves that fail or die leave the previous checkpoint the latest one, intact and loadable.

A full disk (``RLIMIT_FSIZE``) in a blocking save, an async save and a
``Checkpointer``; a process SIGKILLed in the middle of an async write; ranks
that save to different directories; and the store connection a save reuses.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_harness import (
    MODEL,
    OPTIM,
    build,
    same_bits,
    target,
    tree_diff,
)
from multiprocess import run_distributed, run_python

import torchshard
from torchshard import checkpoint

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


pytestmark = pytest.mark.usefixtures("single_thread")


# -- subprocess scripts: a full disk, a SIGKILL ----------------------------------------------------
_PRELUDE = r"""
import json, os, resource, signal, sys, threading, time
from pathlib import Path
import torch
import torchshard
from gpt import GPT, GPTConfig
from torchshard import checkpoint
from torchshard.checkpoint import CheckpointError

torch.set_num_threads(1)
torch.manual_seed(0)
fm = torchshard.FlatParamModule(GPT(GPTConfig.preset("tiny")))
fm.bind(torch.empty(fm.numel))
opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)


def train(step):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 64, (2, 17), generator=g)
    opt.zero_grad()
    fm(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()


root, expected = Path(sys.argv[1]), sys.argv[2]
"""

_DISK = (
    _PRELUDE
    + r"""
report = {}


def attempt(what, fn):
    try:
        fn()
        report[what] = None
    except BaseException as e:
        report[what] = {"type": type(e).__name__, "checkpoint_error": isinstance(e, CheckpointError),
                        "message": str(e)}
    report["dirs after " + what] = sorted(os.listdir(root))


signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)


def disk_full(full):
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 if full else soft, hard))  # shard: 34 KB


train(0)
"""
)

_FULL_DISK = (
    _DISK
    + r"""
checkpoint.save(root, fm, step=1, optimizer=opt)
torch.save({"flat": fm.flat_param.clone(), "optim": opt.state_dict()}, expected)
disk_full(True)
train(1)
future = checkpoint.async_save(root, fm, step=2, optimizer=opt)
train(2)  # training goes on while the save fails in the background
attempt("async", future.wait)
attempt("blocking", lambda: checkpoint.save(root, fm, step=3, optimizer=opt))
future = checkpoint.async_save(root, fm, step=4, optimizer=opt)
while not future.done():  # fails in the background; nobody calls wait()
    time.sleep(0.01)
disk_full(False)
attempt("next save", lambda: checkpoint.async_save(root, fm, step=5, optimizer=opt))
attempt("a later save", lambda: checkpoint.save(root, fm, step=6, optimizer=opt))
train(3)
print("REPORT " + json.dumps(report))
"""
)

_FULL_DISK_CHECKPOINTER = (
    _DISK
    + r"""
ckpt = checkpoint.Checkpointer(root, keep_last=2)
ckpt.save(fm, step=1, optimizer=opt, blocking=True)
torch.save({"flat": fm.flat_param.clone(), "optim": opt.state_dict()}, expected)
disk_full(True)
train(1)
attempt("async", ckpt.save(fm, step=2, optimizer=opt).wait)
attempt("blocking", lambda: ckpt.save(fm, step=3, optimizer=opt, blocking=True))
disk_full(False)
report["latest"] = ckpt.latest().name
# roll back to the last good checkpoint: the failures above were seen and handled
attempt("load", lambda: report.update(loaded=ckpt.load(fm, optimizer=opt).step))
attempt("close after seen failures", ckpt.close)

ckpt = checkpoint.Checkpointer(root, keep_last=2)
disk_full(True)
future = ckpt.save(fm, step=4, optimizer=opt)
while not future.done():  # fails in the background; nobody calls wait()
    time.sleep(0.01)
disk_full(False)
attempt("close after an unseen failure", ckpt.close)
print("REPORT " + json.dumps(report))
"""
)

_KILLED = (
    _PRELUDE
    + r"""
kill_at = sys.argv[3]
ckpt = checkpoint.Checkpointer(root, keep_last=1)
train(0)
ckpt.save(fm, step=1, optimizer=opt, blocking=True)
torch.save({"flat": fm.flat_param.clone(), "optim": opt.state_dict()}, expected)
main = threading.main_thread()


def die_mid_write(event, args):
    # SIGKILL this process when the background writer opens `kill_at` in .tmp-step-*
    if event != "open" or threading.current_thread() is main or not args:
        return
    if isinstance(args[0], (str, bytes, os.PathLike)):
        p = Path(os.fsdecode(args[0]))
        if p.parent.name.startswith(".tmp-step-") and p.name.startswith(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)


sys.addaudithook(die_mid_write)
for step in range(2, 20):
    train(step - 1)  # the save of the previous step is still being written
    ckpt.save(fm, step=step, optimizer=opt)
ckpt.close()
print("NOT KILLED")
"""
)


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # a preloaded fork (tests/multiprocess.py): what is tested is the files a killed or
    # starved save leaves, not the interpreter's start
    return run_python(["-c", script, *args], Path.cwd(), env, timeout=90)


def assert_loads_as_saved(root: Path, expected: Path, step: int) -> None:
    state = torch.load(expected, weights_only=True)
    fm, opt = target()
    info = checkpoint.load(root, fm, optimizer=opt)
    assert info.step == step
    assert same_bits(fm.flat_param, state["flat"])
    assert not tree_diff(opt.state_dict(), state["optim"], "optimizer")


# -- 8. a full disk --------------------------------------------------------------------------------
def run_disk_script(script: str, tmp_path: Path) -> tuple[dict[str, Any], Path, Path]:
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    proc = run_script(script, str(root), str(expected))
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT ")), root, expected


def assert_save_failed(report: dict[str, Any], what: str, dirs: list[str]) -> None:
    failure = report[what]
    assert failure is not None, f"{what}: the save into a full disk succeeded"
    assert failure["checkpoint_error"], failure
    assert os.strerror(errno.EFBIG) in failure["message"], failure
    # no step-N directory for the failed step; its .tmp-step-N is removed
    assert report[f"dirs after {what}"] == dirs, (what, report[f"dirs after {what}"])


@pytest.mark.slow
def test_full_disk(tmp_path):
    report, root, expected = run_disk_script(_FULL_DISK, tmp_path)
    only_step1 = ["step-00000001"]
    assert_save_failed(report, "async", only_step1)  # from wait()
    assert_save_failed(report, "blocking", only_step1)  # from save()
    # a failure nobody waited for surfaces from the next save, which does not start
    assert_save_failed(report, "next save", only_step1)
    assert "previous checkpoint save failed" in report["next save"]["message"]
    # ... once: the writer is usable again
    assert report["a later save"] is None
    assert report["dirs after a later save"] == ["step-00000001", "step-00000006"]
    # the previous checkpoint is intact
    assert_loads_as_saved(root / "step-00000001", expected, 1)
    # the messages name the file that could not be written
    for what in ("async", "blocking", "next save"):
        message = report[what]["message"]
        assert MODEL in message, f"{what}: the message does not name the file: {message!r}"


@pytest.mark.slow
def test_full_disk_checkpointer(tmp_path):
    report, root, expected = run_disk_script(_FULL_DISK_CHECKPOINTER, tmp_path)
    only_step1 = ["step-00000001"]
    assert_save_failed(report, "async", only_step1)
    assert_save_failed(report, "blocking", only_step1)
    assert report["latest"] == "step-00000001"
    assert_loads_as_saved(root, expected, 1)
    # a save failure that was seen does not come back: rolling back works, closing works
    assert report["load"] is None, f"Checkpointer.load after a failed save: {report['load']}"
    assert report["loaded"] == 1
    assert report["close after seen failures"] is None, report["close after seen failures"]
    # one nobody saw surfaces from close()
    assert_save_failed(report, "close after an unseen failure", only_step1)


# -- a process killed in the middle of an async write ----------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["model-", "optim-", "metadata.json"])
def test_killed_mid_write(tmp_path, kill_at):
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    proc = run_script(_KILLED, str(root), str(expected), kill_at)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    tmp = root / ".tmp-step-00000002"
    assert tmp.is_dir()  # killed mid-write
    if kill_at == "metadata.json":  # every shard was written: the kill came at the last moment
        assert {MODEL, OPTIM} <= {p.name for p in tmp.iterdir()}
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001"]
    ckpt = checkpoint.Checkpointer(root, keep_last=1)
    assert ckpt.latest() == root / "step-00000001"
    assert_loads_as_saved(root, expected, 1)
    # training resumes: the next save of that step replaces the leftover and commits
    fm = build(seed=2)
    ckpt.save(fm, step=2, blocking=True)
    ckpt.close()
    assert not tmp.exists()
    assert ckpt.latest() == root / "step-00000002"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]


def _save_to_own_directory(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    fm = torchshard.FlatParamModule(torch.nn.Linear(64, 64))
    trainer = torchshard.DistributedTrainer(fm)
    outcome: dict[str, Any] = {"type": None, "message": ""}
    try:
        checkpoint.save(f"{root}/rank{rank}", trainer, step=1)  # a bug: per-rank directories
    except Exception as e:
        outcome = {"type": type(e).__name__, "message": str(e)}
    dist.barrier()  # the group still works after the failed save
    trainer.close()
    return outcome


def test_ranks_saving_to_different_directories_all_raise_naming_it(tmp_path):
    out = run_distributed(_save_to_own_directory, 2, str(tmp_path), timeout=60)
    for rank, o in enumerate(out):
        assert o["type"] == "CheckpointError", (rank, o)
        assert "every rank must save to the same directory" in o["message"], (rank, o)
        assert "rank 1" in o["message"], (rank, o)
    assert not list(tmp_path.glob("*/step-*")), "nothing may be committed"


def _store_connections() -> list[bool]:
    from torchshard.checkpoint._target import Target

    trainer = torchshard.DistributedTrainer(torchshard.FlatParamModule(torch.nn.Linear(4, 4)))
    first, second = Target(trainer).store, Target(trainer).store
    default = dist.distributed_c10d._get_default_store()
    trainer.close()
    return [first is second, first is not default]


def test_saves_reuse_one_extra_store_connection():
    # TCPStore.clone() sometimes takes seconds: one connection per process group, not per save
    assert run_distributed(_store_connections, 2, timeout=60) == [[True, True]] * 2
