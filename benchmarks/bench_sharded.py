"""Sharded training (FSDP-lite) against DDP, torchshard replicated and FSDP2, 2 ranks on gloo (CPU).

    python benchmarks/bench_sharded.py [--steps 30] [--warmup 3] [--bucket-mb 25]
                                       [--out benchmarks/results/sharded.json]

Six configurations side by side in ONE pair of processes (fresh, gloo, ``torch.set_num_threads(1)``
per rank), built from the same weights, on the example's "small" GPT (byte vocab 256), its
corpus and ``get_batch`` (16 x 128 tokens per rank, rank-specific batches from
``batch_generator``: every configuration sees the same data), AdamW as in the example:

  ddp            torch DDP (defaults: 25 MiB buckets), ``opt = AdamW(ddp.parameters())``
  ts_repl        ``DistributedTrainer(fm)`` + ``make_optimizer``; ``trainer.step()``
  ts_shard       ``DistributedTrainer(fm, shard=True)``: reduce to the slice owner, all-gather
  ts_shard_bf16  ``FlatParamModule(model, dtype=bfloat16)``, ``shard=True``, fp32 master slice
  fsdp2_keep     ``fully_shard(..., reshard_after_forward=False)`` on each transformer block,
                 then the root: full parameters kept from forward through backward (no
                 re-gather in backward), the same memory class as ``shard=True``
  fsdp2_zero3    ``fully_shard`` with its default (ZeRO-3: non-root blocks reshard after
                 forward and all-gather again in backward); AdamW on DTensors

The steps are interleaved: every step index runs one step of each configuration, in an
order rotated every step (none is always first). A step is zero_grad + forward + backward +
gradient reduction + optimizer step (+ all-gather), after a barrier, timed in wall-clock and
process CPU time (CPU time cannot see waiting for communication, which is what sharding
changes); phases: fwd+bwd (DDP/FSDP2 communicate inside it), the exposed reduction
(``trainer.average_gradients()``) and the update (``opt.step()`` / ``trainer.step()``). Per
step, the max over ranks; "paired" ratios are a/b of the same step index, one per step:
their median and p10-p90 are reported. Memory: optimizer state bytes per rank (torchshard:
its optimizer's tensors; DDP/FSDP2: ``opt.state`` tensors, DTensors counted by their local
shard), torchshard's ``memory_bytes()`` beside ``plan_memory()``. At this model size the RSS
is dominated by activations, so no RSS is reported here (bench_trainer.py measures gradient
storage on a model whose gradients dominate). A configuration that fails to build (FSDP2
on an old torch, say) is reported with its error instead of numbers. Losses of every step
are compared with DDP's (same weights and data).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist
from _common import (
    add_examples_to_path,
    fmt_bytes,
    format_table,
    machine_info,
    run_ranks,
    write_json,
)
from summary import spread_text, verdict
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule, plan_memory

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # older torch
    try:
        from torch.distributed._composable.fsdp import fully_shard
    except ImportError:
        fully_shard = None
try:
    from torch.distributed.tensor import DTensor
except ImportError:  # older torch
    from torch.distributed._tensor import DTensor

add_examples_to_path()
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import batch_generator, get_batch, load_corpus  # noqa: E402

WORLD, BATCH, BLOCK, PRESET = 2, 16, 128, "small"
CONFIGS = ("ddp", "ts_repl", "ts_shard", "ts_shard_bf16", "fsdp2_keep", "fsdp2_zero3")
PAIRS = (
    ("ts_repl", "ddp"),
    ("ts_shard", "ddp"),
    ("ts_shard_bf16", "ddp"),
    ("fsdp2_keep", "ddp"),
    ("fsdp2_zero3", "ddp"),
    ("ts_shard", "ts_repl"),
    ("ts_shard", "fsdp2_keep"),
    ("ts_shard", "fsdp2_zero3"),
)
PHASES = ("step", "fwd_bwd", "reduce", "update", "wait")
ADAMW = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
TARGET = 0.55  # sharded optimizer state / replicated, at 2 ranks
now = time.perf_counter


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (a DTensor counts its local shard)."""
    total = 0
    for state in opt.state.values():
        for v in state.values():
            v = v.to_local() if isinstance(v, DTensor) else v
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


class Config:
    """One configuration: its model, optimizer, trainer (torchshard) and how it steps."""

    def __init__(self, name: str, bucket_mb: float) -> None:
        self.name, self.trainer = name, None
        torch.manual_seed(0)  # the same weights for every configuration
        model = GPT(GPTConfig.preset(PRESET))
        self.reduce = lambda: None
        if name == "ddp":
            self.net = DDP(model)
            self.opt = torch.optim.AdamW(self.net.parameters(), **ADAMW)
            self.zero, self.update = self.opt.zero_grad, self.opt.step
        elif name.startswith("fsdp2"):
            if fully_shard is None:
                raise ImportError(
                    "fully_shard: neither torch.distributed.fsdp nor _composable.fsdp"
                )
            kw = {"reshard_after_forward": False} if name == "fsdp2_keep" else {}
            for block in model.blocks:
                fully_shard(block, **kw)
            fully_shard(model, **kw)
            self.net = model
            self.opt = torch.optim.AdamW(model.parameters(), **ADAMW)
            self.zero, self.update = self.opt.zero_grad, self.opt.step
        else:
            dtype = torch.bfloat16 if name == "ts_shard_bf16" else None
            fm = FlatParamModule(model, dtype=dtype)
            self.trainer = DistributedTrainer(fm, bucket_mb=bucket_mb, shard=name != "ts_repl")
            self.net = fm
            self.opt = self.trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
            self.zero, self.reduce = self.trainer.zero_grad, self.trainer.average_gradients
            self.update = self.trainer.step

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list[tuple[float, float]], float]:
        """One step after a barrier: (wall, cpu) per phase of :data:`PHASES`, and the loss."""
        dist.barrier()
        w0 = self.trainer.stats.wait_seconds if self.trainer is not None else 0.0
        c0, t0 = time.process_time(), now()
        self.zero()
        loss = self.net(x, y)[1]
        loss.backward()
        c1, t1 = time.process_time(), now()
        self.reduce()
        c2, t2 = time.process_time(), now()
        self.update()
        c3, t3 = time.process_time(), now()
        wait = self.trainer.stats.wait_seconds - w0 if self.trainer is not None else 0.0
        phases = [(t3 - t0, c3 - c0), (t1 - t0, c1 - c0), (t2 - t1, c2 - c1), (t3 - t2, c3 - c2)]
        return [*phases, (wait, 0.0)], loss.item()  # the loss is read after the timing


def run(opts: argparse.Namespace) -> dict:
    """Every configuration on this rank, interleaved step by step: times, losses, memory."""
    rank = dist.get_rank()
    train, _ = load_corpus()
    batches = [
        get_batch(train, BATCH, BLOCK, batch_generator(0, rank, i, 0), "cpu")
        for i in range(opts.warmup + opts.steps)
    ]
    configs, errors = {}, {}
    for name in CONFIGS:
        try:
            configs[name] = Config(name, opts.bucket_mb)
        except Exception as e:  # reported instead of numbers
            errors[name] = f"{type(e).__name__}: {e}".strip() + "\n" + traceback.format_exc()
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, sorted(errors))  # drop a config that failed on any rank
    for name in {n for failed in everyone for n in failed}:
        configs.pop(name, None)
        errors.setdefault(name, "failed on another rank")
    names = list(configs)
    wall: dict[str, list[float]] = {f"{n}.{p}": [] for n in names for p in PHASES}
    cpu: dict[str, list[float]] = {f"{n}.{p}": [] for n in names for p in PHASES}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for i, (x, y) in enumerate(batches):
        k = i % len(names)
        for name in names[k:] + names[:k]:  # rotated every step
            phases, loss = configs[name].step(x, y)
            losses[name].append(loss)
            if i >= opts.warmup:
                for p, (w, c) in zip(PHASES, phases):
                    wall[f"{name}.{p}"].append(w)
                    cpu[f"{name}.{p}"].append(c)
    memory = {}
    for name, c in configs.items():
        memory[name] = {"optimizer_state_bytes": state_bytes(c.opt)}
        if c.trainer is not None:
            fm = c.trainer.module
            plan = plan_memory(fm.layout, WORLD, shard=c.trainer.shard)[rank].as_dict()
            memory[name].update(memory_bytes=c.trainer.memory_bytes(), plan_memory=plan)
            memory[name].update(padded_numel=c.trainer.padded_numel, flat_numel=fm.numel)
            memory[name].update(buckets=c.trainer.stats.buckets)
            memory[name]["launched_during_backward"] = c.trainer.stats.launched_during_backward
            c.trainer.close()
    return {"wall": wall, "cpu": cpu, "losses": losses, "memory": memory, "errors": errors}


def per_step(ranks: list[dict], kind: str, key: str) -> list[float]:
    """One sample per step: the max over ranks."""
    return [max(x) for x in zip(*(r[kind][key] for r in ranks))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25, help="torchshard bucket size (DDP: 25)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    p.add_argument("--comm-timeout", type=float, default=120, help="gloo collective timeout (s)")
    p.add_argument("--out", default="benchmarks/results/sharded.json")
    opts = p.parse_args()
    t_start, machine = now(), machine_info()
    ranks = run_ranks(run, WORLD, opts, timeout_s=opts.timeout, comm_timeout_s=opts.comm_timeout)
    errors = {n: e for r in ranks for n, e in r["errors"].items()}
    names = [n for n in CONFIGS if n not in errors]

    def ms(kind: str, key: str) -> str:
        return spread_text([1e3 * v for v in per_step(ranks, kind, key)], digits=1, unit="")

    rows = []
    for name in CONFIGS:
        if name in errors:
            rows.append((name, "ERROR: " + errors[name].splitlines()[0], *["-"] * 5))
            continue
        cells = [ms(kind, f"{name}.step") for kind in ("wall", "cpu")]
        cells += [ms("wall", f"{name}.{ph}") for ph in ("fwd_bwd", "reduce", "wait", "update")]
        rows.append((name, *cells))
    title = (
        f"\n{WORLD} ranks, gloo, 1 thread/rank, {PRESET} GPT, {BATCH}x{BLOCK} tokens/rank, AdamW; "
        f"{opts.steps} steps (+{opts.warmup} warm-up) of each, interleaved; per step the max over "
        "ranks, median (p10-p90)\nreduce: exposed average_gradients() (wait: its comm wait); "
        "update: opt.step() / trainer.step() (+all-gather)"
    )
    headers = ["step time (ms)", "wall", "CPU", "fwd+bwd", "reduce", "(wait)", "update"]
    print(format_table(headers, rows, title))

    paired = {}
    for a, b in PAIRS:
        if a in names and b in names:
            paired[f"{a}.step / {b}.step"] = {
                kind: [x / y for x, y in zip(per_step(ranks, kind, f"{a}.step"),
                                             per_step(ranks, kind, f"{b}.step"))]
                for kind in ("wall", "cpu")
            }  # fmt: skip
    rows = [(k, spread_text(v["wall"]), spread_text(v["cpu"])) for k, v in paired.items()]
    print(format_table(["paired step ratio", "wall", "CPU"], rows, "\nmedian (p10-p90) over steps"))

    summary: dict = {name: {"error": errors[name]} for name in errors}
    repl = (
        max(r["memory"]["ts_repl"]["optimizer_state_bytes"] for r in ranks)
        if "ts_repl" in names
        else None
    )
    rows = []
    for name in names:
        s = summary[name] = {
            "optimizer_state_bytes": max(r["memory"][name]["optimizer_state_bytes"] for r in ranks),
            "median_seconds": {
                f"{kind}.{ph}": statistics.median(per_step(ranks, kind, f"{name}.{ph}"))
                for kind in ("wall", "cpu")
                for ph in PHASES
            },
        }
        s["opt_state_vs_repl"] = s["optimizer_state_bytes"] / repl if repl else None
        if "ddp" in names and name != "ddp":
            s["max_abs_loss_diff_vs_ddp"] = max(
                abs(a - b) for r in ranks for a, b in zip(r["losses"][name], r["losses"]["ddp"])
            )
        mb = ranks[0]["memory"][name].get("memory_bytes")
        rows.append((name, fmt_bytes(s["optimizer_state_bytes"]),
                     "-" if s["opt_state_vs_repl"] is None else f"{s['opt_state_vs_repl']:.3f}",
                     fmt_bytes(sum(mb.values())) if mb else "-",
                     f"{s.get('max_abs_loss_diff_vs_ddp', 0.0):.2e}"))  # fmt: skip
    headers = ["memory per rank (max)", "opt state", "/repl", "memory_bytes()", "max |loss - DDP|"]
    print(format_table(headers, rows, "\noptimizer state tensors; torchshard's memory_bytes()"))
    rows = []
    for name in ("ts_repl", "ts_shard", "ts_shard_bf16"):
        for r, res in enumerate(ranks):
            m = res["memory"].get(name)
            if not m:
                continue
            mb, plan = m["memory_bytes"], m["plan_memory"]
            cells = [fmt_bytes(mb[k]) for k in ("parameters", "gradients", "optimizer", "master")]
            same = "yes" if mb == plan else f"no: {plan}"
            rows.append((f"{name} r{r}", *cells, fmt_bytes(sum(mb.values())), same))
    headers = [
        "memory_bytes()",
        "parameters",
        "gradients",
        "optimizer",
        "master",
        "total",
        "= plan",
    ]
    print(format_table(headers, rows, "\ntorchshard memory_bytes() vs plan_memory()"))
    targets = {}
    for name in ("ts_shard", "ts_shard_bf16"):
        frac = summary.get(name, {}).get("opt_state_vs_repl")
        ok = "n/a" if frac is None else "PASS" if frac <= TARGET else "FAIL"
        targets[name] = {"ratio": frac, "target": TARGET, "verdict": ok}
        print(f"{name}: optimizer state per rank / replicated = {frac} (<= {TARGET}): {ok}")
    for key in ("ts_shard.step / ddp.step", "ts_shard.step / fsdp2_keep.step"):
        if key in paired:
            print(f"{key} (wall, <= 1.0): {verdict(paired[key]['wall'], 1.0)}")
    load, total = os.getloadavg(), now() - t_start
    print(f"\ntotal {total:.0f} s; 1-min load {machine['loadavg'][0]:.1f} at start, "
          f"{load[0]:.1f} at end ({os.cpu_count()} CPUs)")  # fmt: skip
    results = {
        "benchmark": "sharded",
        "machine": machine,
        "args": vars(opts),
        "threads_per_rank": 1,
    }
    results.update(world_size=WORLD, preset=PRESET, batch=BATCH, block=BLOCK, adamw=ADAMW)
    results.update(summary=summary, targets=targets, paired=paired, loadavg_end=list(load))
    results.update(total_s=total, samples_by_rank=ranks)
    print(f"wrote {write_json(opts.out, results)}")


if __name__ == "__main__":
    main()
