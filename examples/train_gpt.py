r"""Train a small GPT on text that ships with Python, data-parallel with torchshard.

The corpus is Python's own help text (``pydoc_data.topics``, ~0.5 MB, part of
every CPython install), modelled byte by byte. Nothing is downloaded. It is cut
into sequences that a DataLoader serves through torchshard.GlobalBatchSampler:
the global batches are the same at any world size, and the checkpoint records
how many of the epoch's the loop received, so a resume at another world size
continues the epoch exactly (docs/data.md).

    # two processes on this machine (gloo on CPU, NCCL on GPUs)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

    # a world of one, no launcher
    python examples/train_gpt.py --steps 50

    # continue from the latest checkpoint, at another world size (--steps is the
    # schedule's length: a larger value on resume stretches the cosine decay)
    torchrun --standalone --nproc-per-node 3 examples/train_gpt.py --steps 400 --resume

    # start again, deleting the earlier run's checkpoints (without it: an error)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --overwrite

    # FSDP-lite: optimizer state and gradients sharded, bf16 weights with an fp32 master
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --shard --bf16

    # fully sharded (ZeRO-3): weights, gradients and optimizer state sharded; each block's
    # weights gathered for its forward and backward only
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --shard full --bf16

    # two machines (the same command on each; HOST0 is one of them)
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29500 --rdzv-id my-run examples/train_gpt.py

Rank 0 logs the loss (mean over ranks), tokens per second and the time spent
waiting for gradient communication.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, init_gpt_weights

import torchshard
import torchshard.checkpoint

log = logging.getLogger("train_gpt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small", help="model size: tiny, small, 125m, ... (gpt.py)")
    p.add_argument("--n-layer", type=int, help="override the preset's layers")
    p.add_argument("--n-embd", type=int, help="override the preset's width")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--batch-size",
        type=int,
        default=24,
        help="sequences per micro-batch, all ranks together (the global batch; the world\n"
        "size must divide it). Was per rank before the data position became\n"
        "world-size free: 16 per rank at 2 ranks is --batch-size 32",
    )
    p.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches (global batches) per step"
    )
    p.add_argument(
        "--num-workers", type=int, default=1, help="DataLoader worker processes per rank (0: none)"
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument(
        "--bucket-mb",
        type=float,
        help="gradient bucket size (MiB; default: 25 on CUDA, as DDP, and 1 on the CPU)",
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default="runs/train_gpt", help="checkpoint root ('' to disable)")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint (if any); a worker that torchrun\n"
        "restarted (--max-restarts) always does",
    )
    p.add_argument(
        "--stop-at",
        type=int,
        help="stop (and checkpoint) after this step; the schedule spans --steps",
    )
    p.add_argument(
        "--fail-at",
        type=int,
        help="simulate a crash: the last rank SIGKILLs itself after this step, on the\n"
        "first attempt only (see --max-restarts in the README)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete the checkpoints of an earlier run first"
    )
    p.add_argument(
        "--shard",
        nargs="?",
        const="optimizer",
        choices=["optimizer", "full"],
        help="--shard: FSDP-lite, optimizer state and gradients sharded; --shard full:\n"
        "fully sharded (ZeRO-3), the weights too, one transformer block gathered at a time",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 weights (with --shard: fp32 master)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)"
    )
    return p.parse_args(argv)


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    text = "\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n = int(0.9 * len(data))
    return data[:n], data[n:]


class TextBlocks(Dataset):
    """Sample i: bytes ``i * block`` to ``(i + 1) * block`` as input, the same shifted by one
    as target (non-overlapping sequences: an epoch reads the text once)."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block : (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


def make_loader(
    data: torch.Tensor, block: int, global_batch: int, seed: int, workers: int, device
) -> tuple[torchshard.GlobalBatchSampler, DataLoader]:
    """This rank's part of each global batch of ``global_batch`` sequences, in an order that
    is the same at any world size. Exits with the reason if the world size does not divide
    ``global_batch``."""
    dataset = TextBlocks(data, block)
    try:
        sampler = torchshard.GlobalBatchSampler(len(dataset), global_batch, seed=seed)
    except torchshard.DataError as e:
        dist.barrier()  # every rank fails alike; none leaves while a peer still connects
        raise SystemExit(f"--batch-size {global_batch} (the global batch): {e}") from e
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,  # start them once, not every epoch
        pin_memory=torch.device(device).type == "cuda",
    )
    return sampler, loader


def load_data_state(sampler: torchshard.GlobalBatchSampler, extra: dict) -> None:
    """Continue the data where the checkpoint's loop stopped receiving it (at any world size)."""
    if "data" not in extra:
        log.info("the checkpoint holds no data position: the data starts at epoch 0")
        return
    try:
        sampler.load_state_dict(extra["data"])
    except torchshard.DataError as e:
        raise SystemExit(
            f"the checkpoint's data position does not fit this run: {e} "
            "(--batch-size, --block-size and --seed must be the saved run's)"
        ) from e
    log.info(
        "data: epoch %d, global batch %d of %d",
        sampler.epoch,
        extra["data"]["consumed"],
        len(sampler),
    )


def decided_by_rank0(decide, device):
    """``decide()``, called on rank 0 only; its answer, on every rank.

    Decisions that read the filesystem ("is there a checkpoint?") or the environment must
    be taken once for all ranks. On a shared directory over NFS, attribute caching can show
    one node a checkpoint that another does not see yet (a non-shared directory differs
    for good); ranks that branch on their own look then part ways, some entering a
    collective (a barrier, a load) that the others never join, and the job hangs until
    the collective timeout. ``device``: where the backend's tensors live (the trainer's).
    The answer travels as JSON in a byte tensor (paths become strings): no pickle."""
    data = json.dumps(decide(), default=str).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], device=device)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=device)  # once per run
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().tolist()))


def forever(batches):
    """Pass after pass (epoch after epoch) over ``batches``."""
    while True:
        yield from batches


def batch_generator(seed: int, rank: int, step: int, micro: int) -> torch.Generator:
    """Random windows that depend only on (seed, rank, step, micro), for the benchmarks (the
    example reads sequences through make_loader)."""
    return torch.Generator().manual_seed(
        ((seed * 1_000_003 + rank) * 1_000_003 + step) * 64 + micro
    )


def get_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator, device):
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + block] for s in starts])
    if torch.device(device).type == "cuda":  # page-locked, so that the copies are asynchronous
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    # torchrun restarted this worker after a failure: continue from the last checkpoint.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    args.resume = args.resume or restarted
    info = torchshard.init_distributed()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    if info.rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    ckpt = (
        torchshard.checkpoint.Checkpointer(args.ckpt_dir, keep_last=args.keep_last)
        if args.ckpt_dir
        else None
    )
    # Rank 0 looks for a checkpoint (and whether this is a restart) and every rank acts on
    # its answer: resume it, refuse to start over it, or delete it (--overwrite).
    args.resume, latest = decided_by_rank0(
        lambda: (args.resume, ckpt.latest() if ckpt is not None else None), info.device
    )
    if not args.resume and not args.overwrite and latest is not None:
        if info.rank == 0:  # never lose a run by launching the same command again
            print(
                f"train_gpt: {args.ckpt_dir} holds checkpoints (latest: {latest}); "
                "--resume continues them, --overwrite deletes them and starts again, "
                "--ckpt-dir picks another directory",
                file=sys.stderr,
            )
        sys.exit(2)

    train, val = load_corpus()
    sampler, loader = make_loader(
        train, args.block_size, args.batch_size, args.seed, args.num_workers, info.device
    )
    overrides = {k: v for k, v in dict(n_layer=args.n_layer, n_embd=args.n_embd).items() if v}
    base = GPTConfig.preset(args.preset)
    # bytes are the tokens: vocab_size 256 whatever the preset says
    cfg = GPTConfig(
        **{**base.__dict__, **overrides, "block_size": args.block_size, "vocab_size": 256}
    )
    # Build without storage; the trainer allocates one flat buffer on the device,
    # and every rank starts from rank 0's weights.
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = GPT(cfg)
    fm = torchshard.FlatParamModule(model, dtype=torch.bfloat16 if args.bf16 else None)
    if args.bucket_mb is None:
        args.bucket_mb = 25.0 if info.device.type == "cuda" else 1.0
    trainer = torchshard.DistributedTrainer(
        fm,
        device=info.device,
        bucket_mb=args.bucket_mb,
        init_fn=init_gpt_weights,
        shard={None: False, "optimizer": True, "full": "full"}[args.shard],
    )

    # No weight decay for biases, LayerNorms and position embeddings; the same groups in
    # both modes, so a checkpoint of one resumes in the other.
    def no_decay(name: str) -> bool:
        return name.endswith("bias") or ".ln_" in name or name.startswith(("ln_", "wpe"))

    opt = trainer.make_optimizer(
        torch.optim.AdamW,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        groups=[(no_decay, {"weight_decay": 0.0})],
    )
    start = 0
    if not args.resume and latest is not None:  # --overwrite
        log.info("--overwrite: removing %s's old checkpoints", args.ckpt_dir)
        if info.rank == 0:
            for old in Path(args.ckpt_dir).glob("step-*"):
                shutil.rmtree(old)
        dist.barrier()  # no rank saves into the directory before they are gone
    if args.resume:
        if latest is None:
            log.info("--resume: no checkpoint under %r, starting from scratch", args.ckpt_dir)
        else:
            resumed = ckpt.load(trainer, optimizer=opt, path=latest)  # rank 0's, on every rank
            start = resumed.step
            log.info(
                "resumed from %s (saved at world size %d, loss %s)",
                resumed.path,
                resumed.extra["world_size"],
                "-" if resumed.extra.get("loss") is None else f"{resumed.extra['loss']:.4f}",
            )
            load_data_state(sampler, resumed.extra)
    log.info(
        "world %d on %s, %s: %.2fM parameters, corpus %d bytes, %d %s",
        info.world_size,
        info.device,
        {None: "replicated", "optimizer": "sharded", "full": "fully sharded"}[args.shard],
        fm.layout.param_numel / 1e6,
        len(train) + len(val),
        trainer.stats.buckets,
        "units" if args.shard == "full" else f"buckets of {args.bucket_mb:g} MiB",
    )

    tokens_per_step = args.batch_size * args.block_size * args.grad_accum  # all ranks
    # Counted as the loop receives them (the workers draw ahead): what a checkpoint saves.
    batches = forever(sampler.track(loader))
    t_last, wait_last, n_logged, first_loss = time.perf_counter(), 0.0, 0, None
    # The loss summed on the device since the last log, read (a host sync) only at log steps.
    loss_sum = torch.zeros(1, device=info.device)
    mean_loss = float("nan")
    last = min(args.steps, args.stop_at or args.steps)
    for step in range(start + 1, last + 1):
        lr = args.lr * min(1.0, step / args.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        trainer.zero_grad()
        for micro in range(args.grad_accum):
            # pinned by the DataLoader on CUDA: the host queues the copies and goes on
            x, y = (t.to(info.device, non_blocking=True) for t in next(batches))
            # fully sharded: every backward reduce-scatters (no unsharded gradient to keep)
            sync_later = micro < args.grad_accum - 1 and trainer.shard != "full"
            with trainer.no_sync() if sync_later else contextlib.nullcontext():
                _, loss = fm(x, y)
                (loss / args.grad_accum).backward()
            loss_sum += loss.detach().float() / args.grad_accum
        trainer.clip_grad_norm_(args.max_grad_norm)  # averages (or reduces) the gradients first
        trainer.step()  # the optimizer step; sharded: then all-gathers the updated slices
        n_logged += 1

        if step % args.log_every == 0 or step == args.steps:
            mean = loss_sum / n_logged
            dist.all_reduce(mean)
            mean_loss = mean.item() / info.world_size
            first_loss = first_loss or mean_loss
            now, wait = time.perf_counter(), trainer.stats.wait_seconds
            steps_done, n_logged = n_logged, 0
            log.info(
                "step %4d  loss %.4f  lr %.2e  %6.0f tok/s  comm wait %.1f ms/step",
                step,
                mean_loss,
                lr,
                tokens_per_step * steps_done / (now - t_last),
                1000 * (wait - wait_last) / steps_done,
            )
            t_last, wait_last = now, wait
            loss_sum.zero_()
        if step == args.fail_at and info.rank == info.world_size - 1 and not restarted:
            print(f"train_gpt: --fail-at {step}: rank {info.rank} kills itself", file=sys.stderr)
            os.kill(os.getpid(), signal.SIGKILL)
        if ckpt is not None and (step % args.save_every == 0 or step == last):
            # Returns at once; the weights are staged in the background and written
            # while training goes on (the next optimizer step waits for the staging copy).
            # The data position: world-size free, the same on every rank, JSON.
            extra = {
                "world_size": info.world_size,
                "loss": mean_loss if math.isfinite(mean_loss) else None,  # JSON has no NaN
                "data": sampler.state_dict(),
            }
            ckpt.save(trainer, step=step, optimizer=opt, extra=extra)

    if ckpt is not None:
        ckpt.close()  # waits for the last save to be committed
        log.info(
            "checkpoints: %s", ", ".join(p.name for p in sorted(Path(args.ckpt_dir).glob("step-*")))
        )
    val_loss = evaluate(fm, val, args, info.device)
    log.info(
        "done: first logged loss %.4f, validation loss %.4f", first_loss or float("nan"), val_loss
    )
    trainer.close()
    return val_loss


@torch.no_grad()
def evaluate(fm: torchshard.FlatParamModule, data: torch.Tensor, args, device) -> float:
    fm.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = [
        fm(*get_batch(data, args.batch_size, args.block_size, gen, device))[1] for _ in range(4)
    ]
    fm.train()
    return torch.stack(losses).mean().item()


if __name__ == "__main__":
    main()
