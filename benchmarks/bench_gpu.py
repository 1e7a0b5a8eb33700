"""torchshard on CUDA against DDP: step time, host syncs per step, pinned bytes after a save.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_gpu.py [--preset 125m] [--batch 8]
        [--block 1024] [--rounds 20] [--steps-per-round 5] [--warmup 3] [--bucket-mb 25]
        [--autocast bf16] [--clip 1.0] [--ckpt-dir runs/bench_gpu]
        [--out benchmarks/results/gpu.json]
    python benchmarks/bench_gpu.py ...       # a world of one on GPU 0

Needs CUDA (exits with a message otherwise); under torchrun, NCCL with one GPU per rank
(``torchshard.init_distributed()``). Three configurations live side by side in each process,
built from the same weights (the example's GPT, ``examples/gpt.py``, preset ``--preset``) and
fed the same batches (random tokens, made on the GPU beforehand, different per rank):

  ddp               ``DDP(model, device_ids=[local rank], gradient_as_bucket_view=True,
                    bucket_cap_mb=--bucket-mb)``, ``AdamW(ddp.parameters())``
  ts_replicated     ``DistributedTrainer(fm, bucket_mb=--bucket-mb)`` + ``make_optimizer(AdamW)``
  ts_sharded        the same with ``shard=True`` (reduce to the slice owner, all-gather after)

A step is zero_grad, forward (under ``torch.autocast`` unless ``--autocast none``), backward,
gradient clipping to ``--clip`` (``clip_grad_norm_``; 0: none) and the optimizer step (for
torchshard ``trainer.step()``, which finishes the gradient reduction first), AdamW(lr=3e-4,
betas=(0.9, 0.95), weight_decay=0.1) everywhere.

1. Step time, paired and interleaved. Each round runs ``--steps-per-round`` back-to-back steps
   of every configuration, in an order rotated every round (none is always first). Each block
   of steps starts after ``torch.cuda.synchronize()`` and a barrier and ends with
   ``torch.cuda.synchronize()``: its wall time / steps is one sample, so host work that the GPU
   queue would hide is not billed, and a host sync inside a step (which empties that queue)
   is. Per round, the max over ranks; then each configuration's median (p10-p90) over rounds,
   and the paired ratio to DDP (per round ts/ddp, then median and p10-p90 over rounds, which
   cancels drift of clocks and neighbours).
2. Host syncs per step: ``torch.cuda.set_sync_debug_mode("warn")`` over ``--sync-steps``
   steps of each configuration, counting the "synchronizing CUDA operation" warnings (those
   raised on the autograd thread are replayed on the main one), with the Python source line
   of each. Expected: 0 for DDP and for torchshard with every parameter used.
3. Pinned host memory after a save: ``torchshard.checkpoint.save`` of each torchshard
   configuration (with its optimizer) into ``--ckpt-dir`` (removed afterwards); pinned bytes
   are the caching host allocator's blocks (``torch.cuda.host_memory_stats()``,
   ``allocated_bytes.current``: rounded sizes, cached blocks too) plus whatever is registered
   through ``torch.cuda.cudart().cudaHostRegister`` during the save (counted by a wrapper),
   compared with this rank's share (the tensor bytes of its model and optim files). The
   staging memory is reused across saves and grows only, so after the second save it is the
   larger of the two shares.

Rank 0 prints the tables and writes every sample to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import statistics
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import add_examples_to_path, fmt_bytes, format_table, machine_info, write_json
from torch.nn.parallel import DistributedDataParallel as DDP

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, checkpoint

add_examples_to_path()
from gpt import GPT, GPTConfig  # noqa: E402

CONFIGS = ("ddp", "ts_replicated", "ts_sharded")
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
SYNC_WARNING = "synchroniz"  # "called a synchronizing CUDA operation"
now = time.perf_counter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="125m", help="GPTConfig preset (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument(
        "--block", type=int, default=None, help="tokens per sequence (default: preset's)"
    )
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (after --warmup)")
    p.add_argument("--steps-per-round", type=int, default=5, help="back-to-back steps per sample")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--sync-steps", type=int, default=3, help="steps counted in sync-debug mode")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP and torchshard buckets")
    p.add_argument("--autocast", choices=("bf16", "fp16", "none"), default="bf16")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0: no clipping")
    p.add_argument("--ckpt-dir", default="runs/bench_gpu", help="scratch checkpoints (removed)")
    p.add_argument("--out", default="benchmarks/results/gpu.json")
    return p.parse_args(argv)


# -- the three configurations ---------------------------------------------------------------------
class Config:
    """One model, its optimizer and (for torchshard) its trainer, and how it steps."""

    def __init__(self, name: str, cfg: GPTConfig, device: torch.device, args: argparse.Namespace):
        self.name, self.args = name, args
        torch.manual_seed(0)  # the same weights for every configuration
        model = GPT(cfg)
        self.trainer: DistributedTrainer | None = None
        if name == "ddp":
            self.net = DDP(
                model.to(device),
                device_ids=[device.index],
                gradient_as_bucket_view=True,
                bucket_cap_mb=args.bucket_mb,
            )
            self.opt = torch.optim.AdamW(self.net.parameters(), **ADAMW)
        else:
            self.net = FlatParamModule(model)
            self.trainer = DistributedTrainer(
                self.net, device=device, bucket_mb=args.bucket_mb, shard=name == "ts_sharded"
            )
            self.opt = self.trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
        self.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.autocast)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t = self.trainer
        if t is None:
            self.opt.zero_grad(set_to_none=True)
        else:
            t.zero_grad()
        with self.forward_context():
            loss = self.net(x, y)[1]
        loss.backward()
        if t is None:
            if self.args.clip:
                torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.args.clip)
            self.opt.step()
        else:
            if self.args.clip:
                t.clip_grad_norm_(self.args.clip)
            t.step()


# -- measurements ---------------------------------------------------------------------------------
def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_rounds(
    runs: dict[str, Config], batches: list[tuple[torch.Tensor, torch.Tensor]], args, device
) -> dict[str, list[float]]:
    """Seconds per step of each configuration, per timed round (max over ranks)."""
    k = args.steps_per_round
    samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for rnd in range(-args.warmup, args.rounds):
        seconds = {}
        for j in range(len(CONFIGS)):
            name = CONFIGS[(rnd + j) % len(CONFIGS)]
            torch.cuda.synchronize()
            dist.barrier()
            t0 = now()
            for i in range(k):
                runs[name].step(*batches[(rnd * k + i) % len(batches)])
            torch.cuda.synchronize()
            seconds[name] = (now() - t0) / k
        slowest = max_over_ranks([seconds[n] for n in CONFIGS], device)
        if rnd >= 0:
            for name, s in zip(CONFIGS, slowest):
                samples[name].append(s)
    return samples


def count_syncs(run: Config, batches, steps: int) -> tuple[float, dict[str, int]]:
    """Host syncs per step, and how many at each Python source line."""
    run.step(*batches[0])  # not the first step: optimizer state and caches exist
    torch.cuda.synchronize()
    where: collections.Counter[str] = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(steps):
                run.step(*batches[i % len(batches)])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for w in caught:
        if SYNC_WARNING in str(w.message):
            where[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return sum(where.values()) / steps, dict(where.most_common())


class PinnedBytes:
    """This process's pinned host bytes: the caching host allocator's blocks (rounded, cached
    ones included) plus what is registered through ``torch.cuda.cudart().cudaHostRegister``
    while installed (exact pinning; counted by wrapping it and ``cudaHostUnregister``)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self._cudart = torch.cuda.cudart()
        self._real = (self._cudart.cudaHostRegister, self._cudart.cudaHostUnregister)
        register, unregister = self._real

        def counted_register(ptr: int, size: int, flags: int) -> Any:
            result = register(ptr, size, flags)
            self.registered[int(ptr)] = int(size)
            return result

        def counted_unregister(ptr: int) -> Any:
            result = unregister(ptr)
            self.registered.pop(int(ptr), None)
            return result

        self._cudart.cudaHostRegister = counted_register
        self._cudart.cudaHostUnregister = counted_unregister

    def caching(self) -> int:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))

    def now(self) -> int:
        return self.caching() + sum(self.registered.values())

    def close(self) -> None:
        self._cudart.cudaHostRegister, self._cudart.cudaHostUnregister = self._real


def share_bytes(path: Path, rank: int, world: int) -> int:
    """Tensor bytes of this rank's files in a checkpoint (from the safetensors headers)."""
    total = 0
    for kind in ("model", "optim"):
        f = path / f"{kind}-{rank + 1:05d}-of-{world:05d}.safetensors"
        if not f.is_file():
            continue
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(
            e["data_offsets"][1] - e["data_offsets"][0]
            for k, e in header.items()
            if k != "__metadata__"
        )
    return total


def pinned_after_saves(runs: dict[str, Config], args, rank: int, world: int) -> dict[str, Any]:
    root = Path(args.ckpt_dir)
    if rank == 0 and root.exists():
        shutil.rmtree(root)
    dist.barrier()
    torch.cuda.synchronize()
    pinned = PinnedBytes()
    out: dict[str, Any] = {"baseline": pinned.now()}
    try:
        for step, name in enumerate(("ts_replicated", "ts_sharded")):
            run = runs[name]
            path = checkpoint.save(root / name, run.trainer, step=step, optimizer=run.opt)
            out[name] = {
                "pinned": pinned.now() - out["baseline"],
                "caching_allocator": pinned.caching(),
                "registered": sum(pinned.registered.values()),
                "share": share_bytes(path, rank, world),
            }
    finally:
        pinned.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def stats(xs: list[float]) -> dict[str, float]:
    if len(xs) < 2:
        return {"median": xs[0], "p10": xs[0], "p90": xs[0]}
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return {"median": statistics.median(xs), "p10": q[0], "p90": q[-1]}


def gather(values: Any, world: int) -> list[Any]:
    """Every rank's JSON-able ``values`` (a benchmark may pickle; the library never does)."""
    out: list[Any] = [None] * world
    dist.all_gather_object(out, values)
    return out


def nccl_version() -> str | None:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a build without NCCL
        return None


# -- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(
            "bench_gpu.py: needs CUDA, and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); the CPU benchmarks are bench_*.py"
        )
    info = torchshard.init_distributed()
    if info.device.type != "cuda":
        sys.exit(f"bench_gpu.py: init_distributed() chose {info.device}, expected a GPU (NCCL)")
    torch.cuda.set_device(info.device)
    run(args, info.device, info.rank, info.world_size)


def run(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> None:
    """The three measurements on every rank; rank 0 reports."""
    t_start = now()
    cfg = GPTConfig.preset(args.preset)
    block = args.block or cfg.block_size
    runs = {name: Config(name, cfg, device, args) for name in CONFIGS}
    g = torch.Generator(device=device).manual_seed(1000 + rank)  # different data per rank
    batches = []
    for _ in range(8):
        idx = torch.randint(0, cfg.vocab_size, (args.batch, block + 1), device=device, generator=g)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))

    samples = time_rounds(runs, batches, args, device)
    syncs = {name: count_syncs(runs[name], batches, args.sync_steps) for name in CONFIGS}
    pinned = pinned_after_saves(runs, args, rank, world)
    everyone = gather({"syncs": syncs, "pinned": pinned}, world)
    fm = runs["ts_replicated"].net
    model_info = {
        "preset": args.preset,
        "params": fm.layout.param_numel,
        "flat_numel": fm.numel,
        "buckets": runs["ts_replicated"].trainer.stats.buckets,
    }
    for run in runs.values():
        if run.trainer is not None:
            run.trainer.close()
    if rank != 0:
        return

    summary = {name: stats(samples[name]) for name in CONFIGS}
    ratios = {}
    for name in CONFIGS[1:]:
        paired = [a / b for a, b in zip(samples[name], samples["ddp"])]
        ratios[f"{name} / ddp"] = {"paired": stats(paired), "of_medians": summary[name]["median"] / summary["ddp"]["median"]}  # fmt: skip
    per_step = {name: max(r["syncs"][name][0] for r in everyone) for name in CONFIGS}

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f}"

    rows = []
    for name in CONFIGS:
        s = summary[name]
        r = ratios.get(f"{name} / ddp")
        ratio = "1" if r is None else f"{r['paired']['median']:.3f} ({r['paired']['p10']:.3f}-{r['paired']['p90']:.3f})"  # fmt: skip
        rows.append((name, ms(s["median"]), ms(s["p10"]), ms(s["p90"]), ratio, f"{per_step[name]:g}"))  # fmt: skip
    gpu = torch.cuda.get_device_name(device)
    title = (
        f"\n{world} x {gpu}, NCCL, GPT {args.preset} ({model_info['params'] / 1e6:.1f}M params), "
        f"{args.batch} x {block} tokens per rank, autocast {args.autocast}, clip {args.clip}, "
        f"buckets {args.bucket_mb:g} MiB\nstep ms: max over ranks per round, median/p10/p90 "
        f"over {args.rounds} rounds of {args.steps_per_round} back-to-back steps"
    )
    headers = ["config", "step ms", "p10", "p90", "/ DDP paired (p10-p90)", "host syncs/step"]
    print(format_table(headers, rows, title))
    for name in CONFIGS:
        for r, result in enumerate(everyone):
            where = result["syncs"][name][1]
            if where:
                print(f"  {name} rank {r} syncs at: {where}")
    rows = []
    for name in ("ts_replicated", "ts_sharded"):
        p = max((r["pinned"][name] for r in everyone), key=lambda d: d["pinned"])
        rows.append((name, fmt_bytes(p["pinned"]), fmt_bytes(p["share"]), f"{p['pinned'] / max(p['share'], 1):.3f}"))  # fmt: skip
    title = "\npinned host memory after a save (the rank with the most; staging reused, grown only)"
    print(format_table(["after saving", "pinned", "share", "pinned / share"], rows, title))
    print(f"\ntotal {now() - t_start:.0f} s")

    machine = machine_info()
    machine.update(
        gpu=gpu,
        gpu_count=torch.cuda.device_count(),
        capability=list(torch.cuda.get_device_capability(device)),
        cuda=torch.version.cuda,
        nccl=nccl_version(),
    )
    results = {"machine": machine, "args": vars(args), "world_size": world, "block": block}
    results.update(model=model_info, summary_seconds=summary, ratios=ratios)
    results.update(host_syncs_per_step=per_step, samples_seconds=samples)
    results["per_rank"] = everyone
    out = write_json(args.out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
