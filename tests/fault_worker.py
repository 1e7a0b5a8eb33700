"""A training script for the fault tests, run under the real launcher.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \
        tests/fault_worker.py OUT_DIR --steps 12 --save-every 3 --kill 7:1:during-save

Deterministic data per step, AdamW, replicated (default), sharded (``--shard``) or fully
sharded (``--shard full``: each Linear a unit), a ``Checkpointer`` saving asynchronously every
``--save-every`` steps and resuming from the latest checkpoint on start. ``--kill
STEP:RANK:WHEN`` SIGKILLs that rank on the first attempt only (``TORCHELASTIC_RESTART_COUNT``
is 0); a comma-separated list of them kills on attempt k with the k-th (a chain of faults,
each attempt resuming from what the ones before left; later attempts run on). A kill is at
``before-save`` (the step a save would start), ``during-save`` (inside the
background write of that step's checkpoint, after part of a file is written),
``after-save`` (once that checkpoint is committed) or ``in-commit`` (rank 0 between the
last rank's files and the commit). At the end each rank writes every parameter and
optimizer state tensor as raw bytes under ``OUT_DIR/final-rankR/``, and each attempt appends
a line to ``OUT_DIR/attempts.log``: the oracle is the same run never interrupted
(``main([OUT_DIR, ...])`` on ranks that a test harness started: no launcher needed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import torchshard
import torchshard.checkpoint._save as _ckpt
from torchshard import checkpoint

GLOBAL_BATCH = 12


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument(
        "--kill",
        default="",
        help="STEP:RANK:WHEN, first attempt only; or K of them, comma-"
        "separated: attempt k (TORCHELASTIC_RESTART_COUNT) dies of the k-th",
    )
    p.add_argument(
        "--shard",
        nargs="?",
        const=True,
        default=False,
        type=shard_mode,
        help="shard=True, or with 'full' shard='full'",
    )
    p.add_argument("--blocking", action="store_true", help="wait for each save's commit")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0)
    return p.parse_args(argv)


def shard_mode(value: str) -> str:
    if value != "full":
        raise argparse.ArgumentTypeError(f"expected nothing or 'full', got {value!r}")
    return value


UNITS = ["0", "2", "4"]  # shard="full": each Linear a unit (the default makes one root unit)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(13, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5)
    )


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the global batch of ``step``: the same data at any world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 13, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def die(why: str) -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(
        f"fault_worker: rank {dist.get_rank()} killed on attempt {attempt} {why} "
        f"at {time.time():.3f}",
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kills = args.kill.split(",") if args.kill else []
    kill_step, kill_rank, when = -1, -1, ""
    if attempt < len(kills):
        s, r, when = kills[attempt].split(":")
        kill_step, kill_rank = int(s), int(r)

    fm = torchshard.FlatParamModule(model())
    units = {"units": UNITS} if args.shard == "full" else {}
    trainer = torchshard.DistributedTrainer(fm, shard=args.shard, **units)
    rank, world = trainer.rank, trainer.world_size
    if args.shard:
        opt = trainer.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(fm.parameters(), lr=1e-2, weight_decay=0.1)

    if rank == kill_rank and when in ("during-save", "in-commit"):
        # Fault injection inside the background writer of the chosen step's save.
        write_files, commit = _ckpt._write_files, _ckpt.commit

        def dying_write(t, share, tmp, *rest):
            if share.step == kill_step and when == "during-save":
                name = next(iter(write_files(t, share, tmp, *rest)))  # this rank's files, durable
                with open(tmp / name, "r+b") as f:  # then half of one is lost
                    f.truncate(f.seek(0, 2) // 2)
                die(f"while writing step {share.step}")
            return write_files(t, share, tmp, *rest)

        def dying_commit(tmp, path, *a, **kw):
            if path.name == f"step-{kill_step:08d}":
                die(f"before committing step {kill_step}")
            return commit(tmp, path, *a, **kw)

        _ckpt._write_files, _ckpt.commit = dying_write, dying_commit

    ckpt = checkpoint.Checkpointer(
        args.out / "ckpt", keep_last=2, heartbeat_timeout=args.heartbeat_timeout
    )
    start = 0
    if ckpt.latest() is not None:
        start = ckpt.load(trainer, optimizer=opt).step
    with open(args.out / "attempts.log", "a") as f:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        f.write(json.dumps({"rank": rank, "restart": int(restarts), "start": start}) + "\n")

    for step in range(start, args.steps):
        if step == kill_step and rank == kill_rank and when == "before-save":
            die(f"at step {step}")
        opt.zero_grad()
        x, y = batch(step, rank, world)
        nn.functional.mse_loss(fm(x), y).backward()
        if args.shard:
            trainer.step()
        else:
            trainer.average_gradients()
            opt.step()
        done = step + 1
        if done % args.save_every == 0:
            try:
                future = ckpt.save(trainer, step=done, optimizer=opt, blocking=args.blocking)
            except checkpoint.CheckpointError as e:
                # A survivor of a dead rank, without a launcher to tear it down.
                print(f"fault_worker: rank {rank} CheckpointError at {time.time():.3f}: {e}")
                sys.exit(3)
            if done == kill_step and rank == kill_rank and when == "after-save":
                future.wait()
                die(f"after step {done} was committed")
    ckpt.close()

    # The final state, bitwise: the weights and this rank's optimizer state (fully sharded:
    # the gathered weights, and the optimizer state of this rank's stripes).
    out = args.out / f"final-rank{rank}"
    out.mkdir(exist_ok=True)
    with trainer.gathered():  # (a copy: numpy() would pin the unit's storage, not freed after)
        for name, p in fm.state_dict().items():
            p.clone().numpy().tofile(out / f"param-{name}.bin")
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            torch.as_tensor(v).reshape(-1).numpy().tofile(out / f"opt-{i}-{k}.bin")
    dist.barrier()
    trainer.close()
    print(f"fault_worker: rank {rank} done at step {args.steps}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
