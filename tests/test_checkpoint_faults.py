"""Faults, survived: workers killed under torchrun, dead ranks, concurrent groups saving.

The restart tests run the real launcher (``python -m torch.distributed.run
--max-restarts N``) on ``fault_worker.py``, which SIGKILLs one rank at a chosen point on
each of the first N attempts (a chain of N faults, one launch per mode); the oracle is the
same run never interrupted, compared bitwise: every parameter and every optimizer state
tensor of every rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from multiprocess import free_port, run_distributed, run_python

import torchshard
from torchshard import checkpoint
from torchshard.checkpoint._format import complete_checkpoints

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "fault_worker.py")
STEPS, SAVE_EVERY = 12, 3


def clean_env() -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "ROLE_", "TORCHELASTIC")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(out: Path, *args: str, restarts: int = 1) -> subprocess.CompletedProcess:
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", "2", "--max-restarts", str(restarts), "--monitor-interval", "0.1"),
        *(WORKER, str(out), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *args),
    ]
    out.mkdir(parents=True)
    # the agent: a preloaded fork (tests/multiprocess.py); torchrun starts its workers afresh
    return run_python(cmd[1:], HERE, clean_env())


def final_state(out: Path) -> dict[str, bytes]:
    files = sorted(out.glob("final-rank*/*.bin"))
    assert files, f"{out}: no final state written"
    return {str(f.relative_to(out)): f.read_bytes() for f in files}


def attempts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "attempts.log").read_text().splitlines()]


def shard_args(shard: bool | str) -> list[str]:
    """fault_worker.py's flag for a mode: none, ``--shard``, or ``--shard full``."""
    return {False: [], True: ["--shard"], "full": ["--shard", "full"]}[shard]


def _uninterrupted(out: str, shard: bool | str) -> None:
    import fault_worker

    fault_worker.main(
        [out, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *shard_args(shard)]
    )


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Callable[[bool | str], dict[str, bytes]]:
    """The uninterrupted run of a mode (each run once, when a test first asks for it):
    fault_worker.py's main on the ranks of run_distributed, which start in a fraction of a
    second where a torchrun launch takes seconds. The launcher does not enter the final
    state; if it did, the restarted runs would differ from this one and fail."""
    states: dict[bool | str, dict[str, bytes]] = {}

    def state(shard: bool | str) -> dict[str, bytes]:
        if shard not in states:
            out = tmp_path_factory.mktemp("oracle") / "run"
            out.mkdir()
            run_distributed(_uninterrupted, 2, str(out), shard, timeout=120)
            states[shard] = final_state(out)
        return states[shard]

    return state


# (kill, mode, the steps the attempt after it may resume from: the last committed). The kills
# of one mode make one chain, in one torchrun launch: attempt k dies of the mode's k-th kill
# and attempt k + 1 resumes (a launch per kill costs a launcher and two more fresh workers).
# In the chain every step-6 kill starts from step 3 (the one before lost step 6), so the
# kill between saves comes last, one step after step 9's save began.
FAULTS = [
    ("6:1:during-save", False, {3}),  # rank 1 dies with half a file written: step 6 is lost
    ("6:0:during-save", False, {3}),  # rank 0, which commits, dies while writing
    ("6:0:in-commit", False, {3}),  # every file durable, rank 0 dies before the rename
    ("6:1:after-save", False, {6}),  # right after step 6 was committed
    ("10:1:before-save", False, {6, 9}),  # between saves; step 9's async save may be unfinished
    ("6:1:during-save", True, {3}),  # FSDP-lite: optimizer state sharded
    ("6:1:during-save", "full", {3}),  # fully sharded: the save's all-to-all, a stripe load
]
WHY = {
    "before-save": "at step {}",
    "during-save": "while writing step {}",
    "in-commit": "before committing step {}",
    "after-save": "after step {} was committed",
}


def chain(shard: bool | str) -> list[str]:
    return [k for k, s, _ in FAULTS if s == shard]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Callable[[bool | str], tuple[Path, int, str]]:
    """A mode's chain of kills under torchrun (launched once, when a test first asks for
    it): the run directory, the launcher's exit status and its output."""
    runs: dict[bool | str, tuple[Path, int, str]] = {}

    def run(shard: bool | str) -> tuple[Path, int, str]:
        if shard not in runs:
            kills = chain(shard)
            out = tmp_path_factory.mktemp("chain") / "run"
            done = torchrun(out, "--kill", ",".join(kills), *shard_args(shard), restarts=len(kills))
            runs[shard] = out, done.returncode, done.stdout + done.stderr
        return runs[shard]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kill", "shard", "resume_at"), FAULTS, ids=[f"{k}-{s}" for k, s, _ in FAULTS]
)
def test_killed_worker_restarted_by_torchrun_ends_bitwise_as_uninterrupted(
    launched, oracle, kill, shard, resume_at
):
    out, returncode, log = launched(shard)
    assert returncode == 0, log
    attempt = chain(shard).index(kill)
    step, rank, when = kill.split(":")
    killed = f"fault_worker: rank {rank} killed on attempt {attempt} {WHY[when].format(step)} at"
    assert killed in log, log
    runs = attempts(out)
    n = len(chain(shard)) + 1  # every kill restarted the job once
    assert sorted((a["restart"], a["rank"]) for a in runs) == [(r, k) for r in range(n) for k in (0, 1)]  # fmt: skip
    starts = {a["start"] for a in runs if a["restart"] == attempt + 1}
    assert len(starts) == 1 and starts <= resume_at, runs
    assert final_state(out) == oracle(shard)
    # the aborted saves left nothing behind; rotation kept the two newest
    names = sorted(p.name for p in (out / "ckpt").iterdir())
    assert names == ["step-00000009", "step-00000012"], names


@pytest.mark.slow
@pytest.mark.parametrize("dead", [1, 0])
def test_survivor_of_a_rank_killed_mid_save_fails_in_seconds(tmp_path, dead):
    """No launcher to tear the survivor down: the heartbeat is what tells it."""
    out = tmp_path / "run"
    out.mkdir()
    port, procs = free_port(), []
    for rank in (0, 1):
        env = clean_env() | {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
        }
        cmd = [sys.executable, WORKER, str(out), "--kill", f"6:{dead}:during-save", "--blocking"]
        cmd += ["--heartbeat-timeout", "2"]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = [p.communicate(timeout=120)[0] for p in procs]
    survivor = 1 - dead
    assert procs[dead].returncode == -9, logs[dead]
    assert procs[survivor].returncode == 3, logs[survivor]
    line = next(x for x in logs[survivor].splitlines() if "CheckpointError" in x)
    # the survivor names the dead rank: its heartbeat stopped, or (rank 0 hosts the store
    # without torchrun) the store went with it; not the 600 s timeout
    if dead == 1:
        assert "rank 1 stopped responding" in line, line
    else:
        assert "store is unreachable" in line and "global rank 0" in line, line
    assert "earlier checkpoints are untouched" in line, line
    killed_at = float(re.search(r"killed .* at ([\d.]+)", logs[dead]).group(1))
    failed_at = float(re.search(r"CheckpointError at ([\d.]+)", line).group(1))
    # in seconds: the heartbeat timeout is 2 s (the save's own timeout is 600 s)
    assert failed_at - killed_at < 30, f"rank {dead}'s death noticed after {failed_at - killed_at:.1f} s"  # fmt: skip
    # the previous checkpoint is intact and loads; the interrupted one is gone
    assert [s for s, _ in complete_checkpoints(out / "ckpt")] == [3]
    if dead == 1:  # rank 0 cleans up its temporary directory; a dead rank 0 cannot
        assert not list((out / "ckpt").glob(".tmp-*"))
    fm = torchshard.FlatParamModule(
        torch.nn.Sequential(
            torch.nn.Linear(13, 32),
            torch.nn.GELU(),
            torch.nn.Linear(32, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 5),
        )
    )
    fm.bind(torch.zeros(fm.numel))
    assert checkpoint.load(out / "ckpt" / "step-00000003", fm).step == 3


# -- concurrent groups -------------------------------------------------------------------------
def _two_groups_save_concurrently(root: str) -> list[bool]:
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    torch.manual_seed(rank // 2)  # each group its own model
    fm = torchshard.FlatParamModule(
        torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    )
    trainer = torchshard.DistributedTrainer(fm, process_group=mine, shard=rank // 2 == 1)
    if trainer.shard:
        opt = trainer.make_optimizer(torch.optim.AdamW, lr=0.1)
    else:
        opt = torch.optim.AdamW(fm.parameters(), lr=0.1)
    ckpt = checkpoint.Checkpointer(f"{root}/group{rank // 2}", keep_last=None)
    saved = {}
    for step in range(1, 6):
        opt.zero_grad()
        fm(
            torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 10 + rank))
        ).sum().backward()
        if trainer.shard:
            trainer.step()
        else:
            trainer.average_gradients()
            opt.step()
        ckpt.save(trainer, step=step, optimizer=opt, extra={"group": rank // 2})
        saved[step] = {k: v.clone() for k, v in fm.state_dict().items()}
    ckpt.close()
    same = []
    for step, state in saved.items():
        fresh = torchshard.FlatParamModule(
            torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
        )
        t2 = torchshard.DistributedTrainer(fresh, process_group=mine)
        info = checkpoint.load(f"{root}/group{rank // 2}/step-{step:08d}", t2)
        same.append(
            info.extra == {"group": rank // 2}
            and all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())
        )
        t2.close()
    trainer.close()
    return same


@pytest.mark.slow
def test_two_groups_save_concurrently_and_each_loads_back_what_it_saved(tmp_path):
    out = run_distributed(_two_groups_save_concurrently, 4, str(tmp_path), timeout=120)
    assert out == [[True] * 5] * 4
    for g in (0, 1):
        assert [s for s, _ in complete_checkpoints(tmp_path / f"group{g}")] == [1, 2, 3, 4, 5]


def _keys_are_private() -> list[str]:
    # one module per live trainer (a module's gradients feed one trainer)
    a = torchshard.DistributedTrainer(torchshard.FlatParamModule(torch.nn.Linear(2, 2)))
    b = torchshard.DistributedTrainer(torchshard.FlatParamModule(torch.nn.Linear(2, 2)))
    out = [a.coordinator.prefix, b.coordinator.prefix]
    a.close()
    b.close()
    return out


def test_each_trainer_agrees_its_own_key_namespace():
    (a0, b0), (a1, b1), (a2, b2) = run_distributed(_keys_are_private, 3, timeout=60)
    assert a0 == a1 == a2 and b0 == b1 == b2  # agreed across the group
    assert a0 != b0  # two trainers (or two run attempts) never share keys


def _one_rank_never_saves(root: str) -> str:
    fm = torchshard.FlatParamModule(torch.nn.Linear(2, 2))
    trainer = torchshard.DistributedTrainer(fm)
    ckpt = checkpoint.Checkpointer(root, timeout=1.5)
    message = ""
    if trainer.rank == 0:
        try:
            ckpt.save(trainer, step=1, blocking=True)
        except checkpoint.CheckpointError as e:
            message = str(e)
    dist.barrier()
    trainer.close()
    return message


def test_a_rank_that_is_alive_but_never_saves_is_a_timeout_naming_the_step(tmp_path):
    message = run_distributed(_one_rank_never_saves, 2, str(tmp_path), timeout=60)[0]
    assert "not done after 2 s" in message and "rank 1's files of checkpoint step 1" in message, (
        message
    )
    assert "every rank must call save() at the same step" in message, message
    assert not complete_checkpoints(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(120 + 180 + 60)  # its own limits: A's first checkpoint, then both nodes'
def test_elastic_node_joins_and_the_job_resumes_at_the_new_world_size(tmp_path):
    """torchrun --nnodes 1:2 on loopback: node A trains alone, node B joins, both restart at
    world size 2 from A's latest checkpoint, data position included. torch's shared agent
    store fails this re-rendezvous on its own (role_info wait timeout); hence the
    README's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for elastic runs.

    A runs train_gpt.py through elastic_worker.py, which waits at world size 1 once step
    100 is committed: B joins a world of one that has a checkpoint, whatever the timing,
    and world 2 trains steps 101 to 200 only."""
    port = free_port()
    cmd = [
        *(
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "1",
        ),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "el"),
        *("--rdzv-conf", "last_call_timeout=1", "--max-restarts", "3", "--monitor-interval", "0.1"),
        str(HERE / "elastic_worker.py"),
        *("--preset", "tiny", "--block-size", "32", "--batch-size", "12", "--steps", "200"),
        *("--save-every", "100", "--log-every", "1000", "--threads", "1", "--num-workers", "0"),
        *("--ckpt-dir", str(tmp_path / "ckpt"), "--resume"),
    ]
    env = clean_env() | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = []
    try:
        with open(logs[0], "w") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        # A trained alone and committed step 100: now B joins
        while "waiting for a node to join" not in logs[0].read_text():
            assert procs[0].poll() is None and time.monotonic() < deadline, logs[0].read_text()
            time.sleep(0.2)
        with open(logs[1], "w") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 180
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, logs[0].read_text() + logs[1].read_text()
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
    finally:
        for p in procs:
            p.kill()
    text = logs[0].read_text() + logs[1].read_text()
    assert codes == [0, 0], text
    assert "world 1 on cpu" in text, text
    assert re.search(r"resumed from \S+/step-00000100 \(saved at world size 1", text), text
    assert "world 2 on cpu" in text and "data: epoch 0, global batch 100 of" in text, text
    assert "done: first logged loss" in text, text


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_heartbeat_timeout_must_be_positive(tmp_path, bad):
    with pytest.raises(checkpoint.CheckpointError, match="heartbeat_timeout: expected a positive"):
        checkpoint.Checkpointer(tmp_path, heartbeat_timeout=bad)


def _heartbeat_stops_with_its_trainer() -> list[bool]:
    import gc
    import threading

    def beating() -> int:
        return sum(t.name.startswith("torchshard-heartbeat") for t in threading.enumerate())

    closed = torchshard.DistributedTrainer(torchshard.FlatParamModule(torch.nn.Linear(2, 2)))
    dropped = torchshard.DistributedTrainer(torchshard.FlatParamModule(torch.nn.Linear(2, 2)))
    alive = beating()
    closed.close()
    del dropped  # never closed: collected, it must not beat on forever
    gc.collect()
    deadline = time.monotonic() + 10
    while beating() and time.monotonic() < deadline:
        time.sleep(0.05)
    return [alive == 2, beating() == 0]


def test_heartbeats_stop_at_close_and_when_a_trainer_is_dropped():
    assert run_distributed(_heartbeat_stops_with_its_trainer, 2, timeout=60) == [[True, True]] * 2
