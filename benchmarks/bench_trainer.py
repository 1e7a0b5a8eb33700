"""Benchmark DistributedTrainer against a raw all-reduce and torch DDP, 2 ranks on gloo (CPU).

    python benchmarks/bench_trainer.py [--preset small] [--steps 50] [--mem-steps 10]
                                       [--out benchmarks/results/trainer.json]

Launches itself at 2 ranks (torch.multiprocessing.spawn, gloo, a TCPStore the parent binds
to port 0, ``torch.set_num_threads(1)`` per rank) on the example's GPT and data
(``examples/gpt.py`` preset, ``examples/train_gpt.py``'s corpus and ``get_batch``,
16 x 128 tokens per rank, no clipping). Every config steps the same
``AdamW(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)`` over all parameters (the example's
``trainer.make_optimizer`` groups only exempt some parameters from weight decay).

1. Gradient communication. Each repetition first runs a backward inside ``trainer.no_sync()``
   for both torchshard configs (so every bucket launches inside ``average_gradients()``), then
   times, in an order rotated every repetition (so none is always first after the backward):
   ``average_gradients()`` for bucket_mb 25 and 1; one raw ``dist.all_reduce`` of as many
   float32 elements as the flat gradient (the limit), also followed by ``div_`` (the mean);
   the same all-reduce + ``div_`` by hand on the flat gradient of a plain FlatParamModule
   just written by a backward (no trainer); one all-reduce per parameter gradient,
   async-then-wait and synchronous; and one of an int32 tensor of n_params elements (the
   used-parameter mask that average_gradients() also reduces). The "exposed" time of
   average_gradients() in a real step (buckets launched during backward) comes from part 2;
   its barrier is before the forward, so it also holds any wait for the slower rank.
2. Training step (zero_grad, forward, backward, gradient averaging, AdamW step) for DDP
   (defaults), DDP(gradient_as_bucket_view=True), torchshard bucket_mb 25 and 1: all four
   models in one process pair, same weights and batch, the config order rotated every step.
   Peak memory: one fresh process pair per config (``MALLOC_MMAP_THRESHOLD_=131072``, so freed
   tensors leave RSS); per-rank peak-RSS increase from after the plain model is built
   (wrapping, optimizer and ``--mem-steps`` steps included), beside the analytic bytes of
   gradient storage.

Every timed region starts after a barrier; each rank takes the median (p10, p90) of its
samples and the tables show the max over ranks; ratios are of those medians, and "paired"
ratios are the median over repetitions of a/b within one repetition (each the max over
ranks), which cancels slow drift of a shared machine. All samples go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import (
    PeakRSS,
    add_examples_to_path,
    fmt_bytes,
    format_table,
    machine_info,
    rss_bytes,
    write_json,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule

add_examples_to_path()
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import get_batch, load_corpus  # noqa: E402

WORLD, BATCH, BLOCK = 2, 16, 128
CONFIGS = ("ddp", "ddp_bucket_view", "torchshard_25mb", "torchshard_1mb")
TORCHSHARD = CONFIGS[2:]
PHASES = ("step", "fwd_bwd", "avg_exposed", "opt_step")
ANALYTIC = (
    "DDP default: .grad tensors + bucket copies, 2 x n_params x 4 B; DDP gradient_as_bucket_view"
    " and torchshard (one flat gradient, flat_numel incl. padding): 1 x"
)
now = time.perf_counter


def build(name: str, model: torch.nn.Module):
    """Wrap ``model`` for config ``name``: (callable net, optimizer, trainer or None)."""
    trainer = None
    if name.startswith("ddp"):
        net = DDP(model, gradient_as_bucket_view=name == "ddp_bucket_view")
    else:
        net = FlatParamModule(model)
        trainer = DistributedTrainer(net, bucket_mb=25 if name == "torchshard_25mb" else 1)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return net, opt, trainer


def make_model(preset: str) -> GPT:
    torch.manual_seed(0)  # the same weights for every config
    return GPT(GPTConfig.preset(preset))


def timed_step(net, opt, trainer, x, y) -> tuple[float, float, float, float]:
    """One training step after a barrier: (total, forward+backward, average_gradients, opt.step)."""
    dist.barrier()
    t0 = now()
    opt.zero_grad()
    net(x, y)[1].backward()
    t1 = now()
    if trainer is not None:
        trainer.average_gradients()
    t2 = now()
    opt.step()
    t3 = now()
    return t3 - t0, t1 - t0, t2 - t1, t3 - t2


def timed(fn) -> float:
    dist.barrier()
    t0 = now()
    fn()
    return now() - t0


def main_task(opts: argparse.Namespace) -> dict:
    """Parts 1 and 2 (times): all configs side by side in this process pair."""
    rank = dist.get_rank()
    runs = {name: build(name, make_model(opts.preset)) for name in CONFIGS}
    ts = {name: runs[name][2] for name in CONFIGS if runs[name][2] is not None}
    fm = runs["torchshard_25mb"][0]
    n = fm.flat_grad.numel()  # what the trainer all-reduces (fm.numel plus any padding)
    params = [p for _, p in fm.named_flat_views() if p.requires_grad]
    flat = torch.randn(n)  # gradient-like values (no denormals)
    per_param = [torch.randn_like(p) for p in params]
    mask = torch.ones(len(params), dtype=torch.int32)

    def per_param_async() -> None:
        for w in [dist.all_reduce(g, async_op=True) for g in per_param]:
            w.wait()

    def per_param_sync() -> None:
        for g in per_param:
            dist.all_reduce(g)

    # The floor for average_gradients() after a backward: the same all-reduce + div_ by hand,
    # on the flat gradient of a plain FlatParamModule (no trainer) just written by a backward.
    plain = FlatParamModule(make_model(opts.preset))
    plain.bind(torch.empty(n))

    def plain_mean() -> None:
        dist.all_reduce(plain.flat_grad)
        plain.flat_grad.div_(WORLD)

    comm = {
        "raw_all_reduce": lambda: dist.all_reduce(flat),
        "raw_all_reduce_div": lambda: (dist.all_reduce(flat), flat.div_(WORLD)),
        "plain_flat_grad_mean": plain_mean,
        "mask_all_reduce": lambda: dist.all_reduce(mask),
        "per_param_async": per_param_async,
        "per_param_sync": per_param_sync,
        **{f"{name}.avg_no_sync": trainer.average_gradients for name, trainer in ts.items()},
    }
    train, _ = load_corpus()
    gen = torch.Generator().manual_seed(1000 + rank)  # different data per rank, as the example
    s: dict[str, list[float]] = {}
    launched = {}  # buckets launched inside backward, in a real step
    for rep in range(-opts.warmup, opts.steps):
        x, y = get_batch(train, BATCH, BLOCK, gen, "cpu")
        samples = {}
        for k in range(len(CONFIGS)):
            name = CONFIGS[(rep + k) % len(CONFIGS)]  # rotate the order against drift
            phases = timed_step(*runs[name], x, y)
            samples.update({f"{name}.{key}": v for key, v in zip(PHASES, phases)})
            if name in ts:
                launched[name] = ts[name].stats.launched_during_backward
        for name in ts:  # backward without communication: every bucket waits for average_gradients
            net, opt, trainer = runs[name]
            opt.zero_grad()
            with trainer.no_sync():
                net(x, y)[1].backward()
        plain.zero_grad()
        plain(x, y)[1].backward()
        keys = list(comm)
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:  # none always first
            samples[key] = timed(comm[key])
        flat.div_(WORLD)  # keep the sums from growing rep after rep (untimed): x2 x1 /2
        torch._foreach_div_(per_param, WORLD * WORLD)  # reduced twice
        mask.fill_(1)
        for key, v in samples.items():
            if rep >= 0:
                s.setdefault(key, []).append(v)
    info = {
        "flat_numel": n,
        "param_numel": fm.layout.param_numel,
        "n_params": len(params),
        "buckets": {name: t.stats.buckets for name, t in ts.items()},
        "launched_during_backward": launched,
    }
    for _, _, trainer in runs.values():
        if trainer is not None:
            trainer.close()
    return {"info": info, "samples": s}


def mem_task(opts: argparse.Namespace) -> dict:
    """Part 2 (memory): one config in a fresh process pair; peak RSS from after model construction."""
    model = make_model(opts.preset)
    n_param = sum(p.numel() for p in model.parameters())
    train, _ = load_corpus()
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [get_batch(train, BATCH, BLOCK, gen, "cpu") for _ in range(opts.mem_steps)]
    with PeakRSS() as m:
        net, opt, trainer = build(opts.config, model)
        del model
        for x, y in batches:
            timed_step(net, opt, trainer, x, y)
    if trainer is not None:
        trainer.close()
    grad_numel = net.flat_grad.numel() if trainer is not None else n_param
    copies = 2 if opts.config == "ddp" else 1  # DDP default: .grad tensors + bucket copies
    return {
        "peak_rss_increase": m.increase,
        "rss_after": rss_bytes(),
        "rss_increase_after": m.after - m.before,
        "exact": m.exact,
        "grad_storage_analytic": copies * grad_numel * 4,
    }


def worker(rank: int, port: int, task: str, opts: argparse.Namespace, outdir: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    dist.barrier()
    result = main_task(opts) if task == "main" else mem_task(opts)
    dist.barrier()
    dist.destroy_process_group()
    Path(outdir, f"{task}.{rank}.json").write_text(json.dumps(result))


def launch(task: str, opts: argparse.Namespace) -> list[dict]:
    """Run ``task`` at WORLD ranks in fresh processes; each rank's result, by rank."""
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(store.port, task, opts, tmp), nprocs=WORLD)
        return [json.loads(Path(tmp, f"{task}.{r}.json").read_text()) for r in range(WORLD)]


def stats(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return {"median": statistics.median(xs), "p10": q[0], "p90": q[-1]}


def summarize(ranks: list[dict]) -> dict[str, dict[str, float]]:
    """Per metric: each rank's median/p10/p90, then the max over ranks of each."""
    per_rank = [{k: stats(v) for k, v in r["samples"].items()} for r in ranks]
    return {
        k: {q: max(pr[k][q] for pr in per_rank) for q in ("median", "p10", "p90")}
        for k in per_rank[0]
    }


def paired(ranks: list[dict], a: str, b: str) -> float:
    """Median over reps of a/b, each rep's time being the max over ranks (cancels drift)."""
    ta, tb = ([max(x) for x in zip(*(r["samples"][k] for r in ranks))] for k in (a, b))
    return statistics.median(x / y for x, y in zip(ta, tb))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=50, help="timed repetitions (after --warmup)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mem-steps", type=int, default=10, help="steps per fresh memory run")
    p.add_argument("--out", default="benchmarks/results/trainer.json")
    opts = p.parse_args()
    t_start, load_at_start = now(), os.getloadavg()
    main_ranks = launch("main", opts)
    mem = {}
    # glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold resident, so
    # peak RSS would depend on fragmentation; a fixed 128 KiB threshold returns every tensor
    # of 128 KiB or more to the kernel when freed: peak RSS then follows live bytes.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    for name in CONFIGS:
        opts.config = name
        mem[name] = launch("mem", opts)
    del opts.config
    summary, info = summarize(main_ranks), main_ranks[0]["info"]
    med = {k: v["median"] for k, v in summary.items()}

    def ms(k: str) -> list[str]:
        return [f"{summary[k][q] * 1e3:.2f}" for q in ("median", "p10", "p90")]

    n = info["n_params"]
    comm_rows = [
        ("average_gradients() after no_sync bwd, 25 MiB", "torchshard_25mb.avg_no_sync"),
        ("average_gradients() after no_sync bwd, 1 MiB", "torchshard_1mb.avg_no_sync"),
        ("raw all_reduce of flat_numel float32 (limit)", "raw_all_reduce"),
        ("raw all_reduce + div_ (the mean)", "raw_all_reduce_div"),
        ("all_reduce + div_ of a fresh flat grad, no trainer", "plain_flat_grad_mean"),
        (f"per-parameter all_reduce x{n}, async then wait", "per_param_async"),
        (f"per-parameter all_reduce x{n}, synchronous", "per_param_sync"),
        (f"used-mask-sized all_reduce, {n} int32", "mask_all_reduce"),
        ("exposed: average_gradients() in a step, 25 MiB", "torchshard_25mb.avg_exposed"),
        ("exposed: average_gradients() in a step, 1 MiB", "torchshard_1mb.avg_exposed"),
    ]
    rows = [(label, *ms(k), f"{med[k] / med['raw_all_reduce']:.3f}") for label, k in comm_rows]
    title = (
        f"\n{WORLD} ranks, gloo, {opts.preset} GPT: {info['flat_numel']} gradient elements "
        f"({fmt_bytes(4 * info['flat_numel'])}), {n} parameters, buckets {info['buckets']}, "
        f"launched in backward {info['launched_during_backward']}\n"
        f"max over ranks of each rank's median/p10/p90 of {opts.steps} reps"
    )
    print(
        format_table(["gradient communication (ms)", "median", "p10", "p90", "/ raw"], rows, title)
    )
    rows, memory = [], {}
    for name in CONFIGS:
        peak = max(r["peak_rss_increase"] for r in mem[name])
        memory[name] = {"peak_rss_increase_max_over_ranks": peak, "ranks": mem[name]}
        avg = f"{med[name + '.avg_exposed'] * 1e3:.2f}" if name in TORCHSHARD else "in bwd"
        fwd_bwd, opt_step = (f"{med[f'{name}.{k}'] * 1e3:.1f}" for k in ("fwd_bwd", "opt_step"))
        ratio = f"{med[name + '.step'] / med['ddp.step']:.3f}"
        analytic = fmt_bytes(mem[name][0]["grad_storage_analytic"])
        rows.append(
            (name, *ms(f"{name}.step"), fwd_bwd, avg, opt_step, ratio, fmt_bytes(peak), analytic)
        )
    headers = "training step (ms),median,p10,p90,fwd+bwd,grad avg,AdamW,/ DDP,peak RSS +,grad bytes"
    title = (
        f"\nstep = zero_grad + forward + backward + average_gradients + AdamW, {BATCH}x{BLOCK} "
        f"tokens per rank\npeak RSS +: fresh processes, {opts.mem_steps} steps, max over ranks; "
        "grad bytes: gradient storage held after backward (analytic)"
    )
    print(format_table(headers.split(","), rows, title))
    pairs = [(f"{t}.avg_no_sync", "raw_all_reduce") for t in TORCHSHARD]
    pairs += [(f"{t}.avg_no_sync", "plain_flat_grad_mean") for t in TORCHSHARD]
    pairs += [("torchshard_25mb.avg_no_sync", k) for k in ("per_param_async", "per_param_sync")]
    pairs += [("mask_all_reduce", "torchshard_25mb.avg_no_sync")]
    pairs += [(f"{t}.step", f"{d}.step") for t in TORCHSHARD for d in CONFIGS[:2]]
    ratios = {
        f"{a} / {b}": {"of_medians": med[a] / med[b], "paired": paired(main_ranks, a, b)}
        for a, b in pairs
    }
    rows = [(k, f"{v['of_medians']:.3f}", f"{v['paired']:.3f}") for k, v in ratios.items()]
    print(format_table(["ratio", "of medians", "paired"], rows, "\nratios"))
    load = f"{load_at_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end"
    print(f"\ntotal {now() - t_start:.0f} s; 1-min load average {load} ({os.cpu_count()} CPUs)")
    results = {"machine": machine_info(), "args": vars(opts), "threads_per_rank": 1}
    results["machine"]["loadavg_at_start"] = list(load_at_start)
    results.update(world_size=WORLD, batch=BATCH, block=BLOCK, model=info, ratios=ratios)
    results.update(summary_seconds=summary, memory_bytes=memory, grad_storage_analytic=ANALYTIC)
    results["samples_seconds_by_rank"] = [r["samples"] for r in main_ranks]
    out = write_json(opts.out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
