"""The real launchers: torchrun on one node, two torchrun "nodes" on loopback, and no launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from multiprocess import free_port, run_distributed, run_python

import torchshard

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "train_gpt.py")


def small(steps: int = 30, log_every: int = 10) -> list[str]:
    """Small enough for a test, big enough to see the loss fall."""
    return [
        *("--preset", "tiny", "--block-size", "16", "--batch-size", "12", "--lr", "1e-2"),
        *("--threads", "1", "--steps", str(steps), "--log-every", str(log_every)),
    ]


SMALL = small()


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_",
                "MASTER_",
                "GROUP_",
                "ROLE_",
                "TORCHELASTIC",
                "PYTEST_XDIST",
            )
        )
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def check_run(out: subprocess.CompletedProcess, world: int) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"world {world} on cpu" in text, text
    assert "done: first logged loss" in text, text
    # \bhang: a hang report, not "change"/"exchange" in some warning
    for bad in (r"Traceback", r"\babort", r"NOT been destroyed", r"\bhang"):
        assert not re.search(bad, text), (bad, text)
    losses = [
        float(line.split("loss")[1].split()[0]) for line in text.splitlines() if "step " in line
    ]
    assert len(losses) == 3 and losses[-1] < losses[0], text


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@pytest.mark.slow
def test_two_torchrun_nodes_over_loopback(tmp_path):
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = torchrun(
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "loopback-test",
            "--rdzv-conf",
            f"is_host={node == 0}".lower(),
            EXAMPLE,
            *SMALL,
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
        )
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
            )
        )
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    node0 = subprocess.CompletedProcess([], procs[0].returncode, *results[0])
    check_run(node0, world=2)
    assert procs[1].returncode == 0, results[1]


@pytest.mark.slow
def test_without_a_launcher_it_is_a_world_of_one(tmp_path):
    cmd = [sys.executable, EXAMPLE, *SMALL, "--ckpt-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env())
    check_run(out, world=1)


@pytest.mark.slow
def test_example_stops_and_resumes_at_another_world_size(tmp_path):
    ckpt = ["--ckpt-dir", str(tmp_path), "--save-every", "10"]
    first = torchrun("--standalone", "--nproc-per-node", "2", EXAMPLE, *SMALL, *ckpt)
    out = run_python(first[1:], ROOT, clean_env())
    check_run(out, world=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000020", "step-00000030"]
    longer = small(steps=40, log_every=5)
    # at 3 ranks, and sharded (FSDP-lite): a replicated checkpoint resumes in either mode
    again = torchrun(
        "--standalone", "--nproc-per-node", "3", EXAMPLE, *longer, *ckpt, "--resume", "--shard"
    )
    out = run_python(again[1:], ROOT, clean_env())
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "resumed from" in text and "step-00000030 (saved at world size 2" in text, text
    assert "data: epoch 0, global batch 30 of" in text, text  # the data continues there too
    steps = [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]
    assert steps == [35, 40], text


def _init_from_torchrun_env() -> dict:
    first = torchshard.init_distributed()
    again = torchshard.init_distributed()
    assert first == again
    fm = torchshard.FlatParamModule(__import__("torch").nn.Linear(3, 3))
    trainer = torchshard.DistributedTrainer(fm)
    trainer.assert_in_sync()
    trainer.close()
    trainer.close()  # idempotent
    # the group init_distributed made outlives close() (torn down at exit), so that a
    # user's own destroy_process_group() after close() works
    kept = dist.is_initialized()
    dist.destroy_process_group()
    return dict(
        rank=first.rank,
        world=first.world_size,
        local=first.local_rank,
        device=str(first.device),
        kept=kept,
    )


def test_init_distributed_reads_the_torchrun_environment():
    infos = run_distributed(_init_from_torchrun_env, 3, init_process_group=False, timeout=60)
    for rank, info in enumerate(infos):
        assert info == dict(rank=rank, world=3, local=rank, device="cpu", kept=True)


def _group_created_by_the_user_is_left_alone() -> bool:
    fm = torchshard.FlatParamModule(__import__("torch").nn.Linear(3, 3))
    with torchshard.DistributedTrainer(fm):
        pass
    return dist.is_initialized()


def test_trainer_leaves_a_user_created_group_alone():
    assert run_distributed(_group_created_by_the_user_is_left_alone, 2, timeout=60) == [True, True]


@pytest.mark.slow
def test_a_second_run_refuses_to_delete_the_first_runs_checkpoints(tmp_path):
    cmd = [EXAMPLE, *small(steps=4, log_every=2), "--ckpt-dir", str(tmp_path)]
    cmd += ["--save-every", "2"]
    first = run_python(cmd, tmp_path, clean_env())  # a preloaded fork (tests/multiprocess.py)
    assert first.returncode == 0, first.stderr
    again = run_python(cmd, tmp_path, clean_env())
    assert again.returncode == 2
    assert "holds checkpoints" in again.stderr and "--overwrite" in again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.jsonl",
        "step-00000002",
        "step-00000004",
    ]
    out = run_python([*cmd, "--overwrite", "--steps", "2"], tmp_path, clean_env())
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002"]


@pytest.mark.slow
def test_example_fully_sharded_in_bf16_resumes_sharded_at_another_world_size(tmp_path):
    ckpt = ["--ckpt-dir", str(tmp_path), "--save-every", "10"]
    full = ["--shard", "full", "--bf16"]
    first = torchrun("--standalone", "--nproc-per-node", "2", EXAMPLE, *SMALL, *ckpt, *full)
    out = run_python(first[1:], ROOT, clean_env())
    check_run(out, world=2)
    assert "fully sharded" in out.stdout + out.stderr
    longer = small(steps=40, log_every=5)
    again = torchrun(
        "--standalone",
        "--nproc-per-node",
        "3",
        EXAMPLE,
        *longer,
        *ckpt,
        "--resume",
        "--shard",
        "--bf16",
    )
    out = run_python(again[1:], ROOT, clean_env())
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "step-00000030 (saved at world size 2" in text, text
    steps = [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]
    assert steps == [35, 40], text
