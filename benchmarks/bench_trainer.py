"""Benchmark DistributedTrainer against a raw all-reduce and torch DDP, 2 ranks on gloo (CPU).

    python benchmarks/bench_trainer.py [--preset small] [--steps 40] [--warmup 3]
                                       [--sync-steps 3] [--mem-steps 3]
                                       [--out benchmarks/results/trainer.json]

Launches itself at 2 ranks (fresh processes, gloo, ``torch.set_num_threads(1)`` per rank) on
the example's GPT and data (``examples/gpt.py`` preset, ``examples/train_gpt.py``'s corpus and
``get_batch``, 16 x 128 tokens per rank, no clipping). Every timed config steps the same
``AdamW(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)`` over all parameters.

1. Gradient communication. Each repetition first runs a backward inside ``trainer.no_sync()``
   for both torchshard configs (so every bucket launches inside ``average_gradients()``), then
   times, in an order rotated every repetition (none is always first after the backward):
   ``average_gradients()`` for bucket_mb 25 and 1; one raw ``dist.all_reduce`` of as many
   float32 elements as the flat gradient (the limit), also followed by ``div_`` (the mean);
   the same all-reduce + ``div_`` by hand on the flat gradient of a plain FlatParamModule
   just written by a backward (no trainer); one all-reduce per parameter gradient,
   async-then-wait and synchronous; and one of an int32 tensor of n_params elements.
2. Training step (zero_grad, forward, backward, gradient averaging, AdamW step) of DDP at
   25 MiB buckets (its default), DDP(bucket_cap_mb=1), DDP(gradient_as_bucket_view=True),
   torchshard at bucket_mb 25 and 1: all five models in one process pair, the same weights
   and batch, the config order rotated every step. torchshard at 1 MiB is paired with
   DDP(bucket_cap_mb=1), at 25 MiB with DDP's default.
3. Host reads per step (a host synchronization each on CUDA), counted with a
   ``TorchDispatchMode`` (``aten._local_scalar_dense``, ``aten.is_nonzero``,
   ``aten.lift_fresh``, ``Tensor.tolist``): around backward + ``average_gradients()`` +
   ``clip_grad_norm_(1.0)`` + ``trainer.step()`` for torchshard (replicated and sharded) and
   around backward + ``opt.step()`` for DDP (no ``find_unused_parameters``), SGD with momentum
   (which reads nothing back itself), every parameter used, ``--sync-steps`` steps after one
   untimed step.
4. Gradient storage, measured: one fresh process pair per config, a model whose gradients
   dominate memory (16 x ``Linear(1024, 1024)``, 64 MiB of fp32 gradients, one row of
   input), plain SGD (no optimizer state), ``MALLOC_MMAP_THRESHOLD_=131072`` (freed tensors
   leave RSS). "held": RSS after ``--mem-steps`` steps (gradients still alive, before the
   next ``zero_grad``) minus RSS after the model was built: what wrapping and training keep
   beyond the weights (gradients, buckets, anything else). Printed beside the analytic
   gradient bytes (DDP default: ``.grad`` + bucket copies, 2 x; the others 1 x) and the
   same for the plain model trained without communication (its ``.grad`` tensors and what
   any training process holds).

Every timed region starts after a barrier and records wall-clock and process CPU time (CPU
time cannot see waiting for a collective, which is what the configs do differently). Per
repetition, the max over ranks of each; a "paired" ratio is a/b within one repetition, one
per repetition: the tables show their median and p10-p90. Every sample goes to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from _common import (
    Clock,
    HostReads,
    PeakRSS,
    add_examples_to_path,
    fmt_bytes,
    format_table,
    machine_info,
    rss_bytes,
    run_ranks,
    write_json,
)
from report.freshness import hashes
from report.stats import spread_text, verdict
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule

add_examples_to_path()
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import get_batch, load_corpus  # noqa: E402

WORLD, BATCH, BLOCK = 2, 16, 128
CONFIGS = ("ddp_25mb", "ddp_1mb", "ddp_bucket_view", "ts_25mb", "ts_1mb")
TORCHSHARD = ("ts_25mb", "ts_1mb")
BASELINE = {"ts_25mb": "ddp_25mb", "ts_1mb": "ddp_1mb"}  # like for like: the same bucket size
PHASES = ("step", "fwd_bwd", "avg_exposed", "opt_step")
MEM_CONFIGS = ("plain", "ddp_25mb", "ddp_bucket_view", "ts_25mb")
MEM_LAYERS, MEM_WIDTH = 16, 1024
ANALYTIC = (
    "DDP default: .grad tensors + bucket copies, 2 x n_params x 4 B; DDP gradient_as_bucket_view"
    " and torchshard (one flat gradient, flat_numel incl. padding): 1 x"
)
TARGETS = {"avg_vs_raw": 1.05, "step_vs_ddp": 1.0}
now = time.perf_counter


def build(name: str, model: torch.nn.Module, optimizer=None):
    """Wrap ``model`` for config ``name``: (callable net, optimizer, trainer or None)."""
    optimizer = optimizer or (
        lambda params: torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    )
    trainer = None
    if name == "plain":  # no wrapper, no communication: the memory part's reference
        net = model
    elif name.startswith("ddp"):
        net = DDP(
            model,
            bucket_cap_mb=1 if name == "ddp_1mb" else 25,
            gradient_as_bucket_view=name == "ddp_bucket_view",
        )
    else:
        net = FlatParamModule(model)
        trainer = DistributedTrainer(net, bucket_mb=1 if name == "ts_1mb" else 25)
    return net, optimizer(net.parameters()), trainer


def make_model(preset: str) -> GPT:
    torch.manual_seed(0)  # the same weights for every config
    return GPT(GPTConfig.preset(preset))


def timed_step(net, opt, trainer, x, y) -> list[tuple[float, float]]:
    """One training step after a barrier: (wall, cpu) of total, forward+backward,
    average_gradients, opt.step."""
    dist.barrier()
    c0, t0 = time.process_time(), now()
    opt.zero_grad()
    net(x, y)[1].backward()
    c1, t1 = time.process_time(), now()
    if trainer is not None:
        trainer.average_gradients()
    c2, t2 = time.process_time(), now()
    opt.step()
    c3, t3 = time.process_time(), now()
    return [(t3 - t0, c3 - c0), (t1 - t0, c1 - c0), (t2 - t1, c2 - c1), (t3 - t2, c3 - c2)]


def timed(fn) -> tuple[float, float]:
    dist.barrier()
    with Clock() as c:
        fn()
    return c.wall, c.cpu


def main_task(opts: argparse.Namespace) -> dict:
    """Parts 1 and 2 (times): all configs side by side in this process pair."""
    rank = dist.get_rank()
    runs = {name: build(name, make_model(opts.preset)) for name in CONFIGS}
    ts = {name: runs[name][2] for name in TORCHSHARD}
    fm = runs["ts_25mb"][0]
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

    # The same all-reduce + div_ by hand, on the flat gradient of a plain FlatParamModule
    # (no trainer) just written by a backward.
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
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    launched = {}  # buckets launched inside backward, in a real step
    for rep in range(-opts.warmup, opts.steps):
        x, y = get_batch(train, BATCH, BLOCK, gen, "cpu")
        samples: dict[str, tuple[float, float]] = {}
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
        if rep >= 0:
            for key, (w, c) in samples.items():
                wall.setdefault(key, []).append(w)
                cpu.setdefault(key, []).append(c)
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
    return {"info": info, "wall": wall, "cpu": cpu, "host_reads": host_reads(opts)}


def host_reads(opts: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Part 3: host reads counted per config over ``--sync-steps`` steps (SGD); first, as a
    control, what the counter sees around one ``.item()`` (it must see it)."""
    rank = dist.get_rank()
    train, _ = load_corpus()
    gen = torch.Generator().manual_seed(2000 + rank)
    with HostReads() as control:  # the counter must see a read: one .item()
        torch.ones(2).sum().item()
    out = {"control_item": dict(control.seen)}
    for name in ("ddp", "ts_replicated", "ts_sharded"):
        model = make_model(opts.preset)
        trainer = None
        if name == "ddp":
            net = DDP(model)  # find_unused_parameters=False: DDP's default
            opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
        else:
            net = FlatParamModule(model)
            trainer = DistributedTrainer(net, shard=name == "ts_sharded")
            opt = trainer.make_optimizer(torch.optim.SGD, lr=1e-2, momentum=0.9)
        total: dict[str, int] = {}
        for step in range(1 + opts.sync_steps):  # step 0 builds the optimizer's state
            opt.zero_grad()
            loss = net(*get_batch(train, BATCH, BLOCK, gen, "cpu"))[1]
            with HostReads() as counter:
                loss.backward()
                if trainer is not None:
                    trainer.average_gradients()
                    trainer.clip_grad_norm_(1.0)
                    trainer.step()
                else:
                    opt.step()
            if step > 0:
                for k, v in counter.seen.items():
                    total[k] = total.get(k, 0) + v
        if trainer is not None:
            trainer.close()
        out[name] = total
    return out


def mem_task(opts: argparse.Namespace) -> dict:
    """Part 4: one config in a fresh process pair, on a model whose gradients dominate memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(MEM_WIDTH, MEM_WIDTH) for _ in range(MEM_LAYERS)))
    n_param = sum(p.numel() for p in model.parameters())
    x = torch.randn(1, MEM_WIDTH)
    base = rss_bytes()
    with PeakRSS() as m:
        net, opt, trainer = build(
            opts.config, model, lambda params: torch.optim.SGD(params, lr=1e-4)
        )
        del model
        for _ in range(opts.mem_steps):
            dist.barrier()
            opt.zero_grad()
            net(x).square().mean().backward()
            if trainer is not None:
                trainer.average_gradients()
            opt.step()
    held = rss_bytes() - base  # gradients alive (no zero_grad since the last step)
    grad_numel = net.flat_grad.numel() if trainer is not None else n_param
    if trainer is not None:
        trainer.close()
    copies = 2 if opts.config == "ddp_25mb" else 1  # DDP default: .grad tensors + bucket copies
    return {
        "held_bytes": held,
        "peak_rss_increase": m.increase,
        "exact": m.exact,
        "n_param": n_param,
        "grad_storage_analytic": copies * grad_numel * 4,
    }


def task(kind: str, opts: argparse.Namespace) -> dict:
    return main_task(opts) if kind == "main" else mem_task(opts)


def per_rep(ranks: list[dict], kind: str, key: str) -> list[float]:
    """One sample per repetition: the max over ranks."""
    return [max(x) for x in zip(*(r[kind][key] for r in ranks))]


def pairs(ranks: list[dict], a: str, b: str) -> dict[str, list[float]]:
    """a/b per repetition (each the max over ranks), wall and CPU."""
    return {
        kind: [x / y for x, y in zip(per_rep(ranks, kind, a), per_rep(ranks, kind, b))]
        for kind in ("wall", "cpu")
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=40, help="timed repetitions (after --warmup)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sync-steps", type=int, default=3, help="steps counted for host reads")
    p.add_argument("--mem-steps", type=int, default=3, help="steps per fresh memory run")
    p.add_argument("--out", default="benchmarks/results/trainer.json")
    opts = p.parse_args()
    t_start, machine, code = now(), machine_info(), hashes("trainer")
    main_ranks = run_ranks(task, WORLD, "main", opts)
    main_s = now() - t_start
    # glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold resident; a
    # fixed 128 KiB threshold returns every tensor of 128 KiB or more to the kernel when freed.
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    mem = {}
    for name in MEM_CONFIGS:
        opts.config = name
        mem[name] = run_ranks(task, WORLD, "mem", opts, env=env)
    del opts.config
    info = main_ranks[0]["info"]

    def ms(kind: str, key: str) -> str:
        return spread_text([1e3 * v for v in per_rep(main_ranks, kind, key)], digits=2, unit="")

    n = info["n_params"]
    comm_rows = [
        ("average_gradients() after no_sync bwd, 25 MiB", "ts_25mb.avg_no_sync"),
        ("average_gradients() after no_sync bwd, 1 MiB", "ts_1mb.avg_no_sync"),
        ("raw all_reduce of flat_numel float32 (limit)", "raw_all_reduce"),
        ("raw all_reduce + div_ (the mean)", "raw_all_reduce_div"),
        ("all_reduce + div_ of a fresh flat grad, no trainer", "plain_flat_grad_mean"),
        (f"per-parameter all_reduce x{n}, async then wait", "per_param_async"),
        (f"per-parameter all_reduce x{n}, synchronous", "per_param_sync"),
        (f"used-mask-sized all_reduce, {n} int32", "mask_all_reduce"),
        ("exposed: average_gradients() in a step, 25 MiB", "ts_25mb.avg_exposed"),
        ("exposed: average_gradients() in a step, 1 MiB", "ts_1mb.avg_exposed"),
    ]
    rows = [(label, ms("wall", k), ms("cpu", k)) for label, k in comm_rows]
    title = (
        f"\n{WORLD} ranks, gloo, {opts.preset} GPT: {info['flat_numel']} gradient elements "
        f"({fmt_bytes(4 * info['flat_numel'])}), {n} parameters, buckets {info['buckets']}, "
        f"launched in backward {info['launched_during_backward']}\n"
        f"per repetition the max over ranks; median (p10-p90) of {opts.steps} repetitions"
    )
    print(format_table(["gradient communication (ms)", "wall", "CPU"], rows, title))
    rows = []
    for name in CONFIGS:
        rows.append(
            (name, *(ms(kind, f"{name}.{ph}") for ph in PHASES for kind in ("wall", "cpu")))
        )
    headers = ["training step (ms)"]
    headers += [
        f"{ph} {kind}" for ph in ("step", "fwd+bwd", "avg", "AdamW") for kind in ("wall", "CPU")
    ]
    title = (
        f"\nstep = zero_grad + forward + backward + average_gradients + AdamW, {BATCH}x{BLOCK} "
        "tokens per rank; the configs interleaved step by step"
    )
    print(format_table(headers, rows, title))

    pair_list = [(f"{t}.avg_no_sync", "raw_all_reduce") for t in TORCHSHARD]
    pair_list += [(f"{t}.avg_no_sync", "plain_flat_grad_mean") for t in TORCHSHARD]
    pair_list += [("ts_25mb.avg_no_sync", k) for k in ("per_param_async", "per_param_sync")]
    pair_list += [(f"{t}.step", f"{BASELINE[t]}.step") for t in TORCHSHARD]
    pair_list += [(f"{t}.step", "ddp_bucket_view.step") for t in TORCHSHARD]
    paired = {f"{a} / {b}": pairs(main_ranks, a, b) for a, b in pair_list}
    rows = [(k, spread_text(v["wall"], 3), spread_text(v["cpu"], 3)) for k, v in paired.items()]
    print(format_table(["paired ratio", "wall", "CPU"], rows, "\npaired ratios, median (p10-p90)"))
    for label, key, target in (
        ("average_gradients() / raw all_reduce", "ts_25mb.avg_no_sync / raw_all_reduce", 1.05),
        ("step / DDP, 25 MiB", "ts_25mb.step / ddp_25mb.step", 1.0),
        ("step / DDP, 1 MiB", "ts_1mb.step / ddp_1mb.step", 1.0),
    ):
        print(f"{label} (wall, <= {target}): {verdict(paired[key]['wall'], target)}")

    reads = [r["host_reads"] for r in main_ranks]
    steps = opts.sync_steps
    print(f"\nhost reads over {steps} steps (SGD), per rank: {reads}")

    rows, memory = [], {}
    for name in MEM_CONFIGS:
        held = max(r["held_bytes"] for r in mem[name])
        peak = max(r["peak_rss_increase"] for r in mem[name])
        memory[name] = {"held_bytes_max_over_ranks": held, "peak_rss_increase_max_over_ranks": peak,
                        "ranks": mem[name]}  # fmt: skip
        analytic = mem[name][0]["grad_storage_analytic"]
        rows.append((name, fmt_bytes(held), fmt_bytes(analytic), fmt_bytes(peak)))
    title = (
        f"\nmemory: {MEM_LAYERS} x Linear({MEM_WIDTH}, {MEM_WIDTH}), "
        f"{mem['ddp_25mb'][0]['n_param'] / 1e6:.1f}M params, plain SGD, fresh process pairs, "
        f"max over ranks;\nheld: RSS after {opts.mem_steps} steps minus RSS after the model was built"
    )
    print(format_table(["gradient storage", "held", "analytic", "peak RSS +"], rows, title))
    load = os.getloadavg()
    total = now() - t_start
    print(f"\ntotal {total:.0f} s; 1-min load average {machine['loadavg'][0]:.1f} at start, "
          f"{load[0]:.1f} at end ({os.cpu_count()} CPUs)")  # fmt: skip
    results = {
        "benchmark": "trainer",
        "machine": machine,
        "measured": code,
        "args": vars(opts),
        "threads_per_rank": 1,
    }
    results.update(world_size=WORLD, batch=BATCH, block=BLOCK, model=info, targets=TARGETS)
    results.update(paired=paired, host_reads={"steps": steps, "by_rank": reads})
    results.update(memory_bytes=memory, grad_storage_analytic=ANALYTIC, memory_model={
        "layers": MEM_LAYERS, "width": MEM_WIDTH, "optimizer": "SGD", "steps": opts.mem_steps})  # fmt: skip
    results.update(
        loadavg_end=list(load), total_s=total, part_s={"main": main_s, "memory": total - main_s}
    )
    results["samples_by_rank"] = [{"wall": r["wall"], "cpu": r["cpu"]} for r in main_ranks]
    print(f"wrote {write_json(opts.out, results)}")


if __name__ == "__main__":
    main()
