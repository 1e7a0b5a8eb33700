"""Sharded training (FSDP-lite) against DDP, torchshard replicated and FSDP2, 2 ranks on gloo (CPU).

    python benchmarks/bench_sharded.py [--steps 20] [--warmup 3] [--rounds 2] [--bucket-mb 25]
                                       [--out benchmarks/results/sharded.json]

Five configurations, each in a FRESH pair of processes (torch.multiprocessing, gloo, a TCPStore
the parent binds to port 0, ``torch.set_num_threads(1)`` per rank), on the example's "small" GPT
(byte vocab 256), its corpus and ``get_batch`` (16 x 128 tokens per rank, rank-specific batches
from ``batch_generator``: every configuration sees the same data), AdamW as in the example:

  ddp           torch DDP (defaults), ``opt = AdamW(ddp.parameters())``
  ts_repl       ``DistributedTrainer(fm)`` + ``make_optimizer``; ``trainer.step()``
  ts_shard      ``DistributedTrainer(fm, shard=True)``: reduce to the slice owner, all-gather
  ts_shard_bf16 ``FlatParamModule(model, dtype=bfloat16)``, ``shard=True``, fp32 master slice
  fsdp2         ``fully_shard`` on each transformer block, then the root; AdamW on DTensors

Step = zero_grad + forward + backward + grad reduction + optimizer step (+ all-gather), after a
barrier; phases: fwd+bwd (DDP/FSDP2 communicate inside it), the exposed reduction
(``trainer.average_gradients()``), and the update (``opt.step()`` / ``trainer.step()``, which
all-gathers when sharded), plus the process CPU time of the step (less sensitive than wall time
to other jobs on a shared machine). The configurations run ``--rounds`` times, every other pass
in reverse order (cancels a linear drift); each rank takes the median of its timed steps pooled
over the rounds; tables show the max over ranks. Memory: optimizer state bytes per rank
(torchshard: ``memory_bytes()``; DDP/FSDP2: ``opt.state`` tensors, DTensors counted by their
local shard), torchshard's full ``memory_bytes()`` beside ``plan_memory()``, and the peak-RSS
increase of each rank over a baseline taken after imports, corpus and batches (model build
included). A configuration that fails (FSDP2 on CPU/gloo, say) is reported with its error
instead of numbers. The first round's losses are compared with DDP's (same weights and data).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import PeakRSS, add_examples_to_path, fmt_bytes, format_table, machine_info, write_json
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
CONFIGS = ("ddp", "ts_repl", "ts_shard", "ts_shard_bf16", "fsdp2")
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


def build(name: str, model: GPT, bucket_mb: float):
    """(net, zero_grad, reduce, update, trainer or None, optimizer) for configuration ``name``."""
    if name == "ddp":
        net = DDP(model)
        opt = torch.optim.AdamW(net.parameters(), **ADAMW)
        return net, opt.zero_grad, lambda: None, opt.step, None, opt
    if name == "fsdp2":
        if fully_shard is None:
            raise ImportError("fully_shard: neither torch.distributed.fsdp nor _composable.fsdp")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        return model, opt.zero_grad, lambda: None, opt.step, None, opt
    dtype = torch.bfloat16 if name == "ts_shard_bf16" else None
    fm = FlatParamModule(model, dtype=dtype)
    trainer = DistributedTrainer(fm, bucket_mb=bucket_mb, shard=name != "ts_repl")
    opt = trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
    return fm, trainer.zero_grad, trainer.average_gradients, trainer.step, trainer, opt


def run_config(opts: argparse.Namespace) -> dict:
    """One configuration on this rank: times, losses, memory."""
    rank, out = dist.get_rank(), {}
    train, _ = load_corpus()
    batches = [
        get_batch(train, BATCH, BLOCK, batch_generator(0, rank, i, 0), "cpu")
        for i in range(opts.warmup + opts.steps)
    ]
    samples: dict[str, list[float]] = {
        k: [] for k in ("step", "fwd_bwd", "reduce", "update", "wait", "cpu")
    }
    losses: list[float] = []
    with PeakRSS() as m:
        torch.manual_seed(0)  # the same weights for every configuration
        net, zero, reduce, update, trainer, opt = build(
            opts.config, GPT(GPTConfig.preset(PRESET)), opts.bucket_mb
        )
        for i, (x, y) in enumerate(batches):
            dist.barrier()
            w0 = trainer.stats.wait_seconds if trainer is not None else 0.0
            c0, t0 = time.process_time(), now()
            zero()
            loss = net(x, y)[1]
            loss.backward()
            t1 = now()
            reduce()
            t2 = now()
            update()
            t3, c3 = now(), time.process_time()
            losses.append(loss.item())
            wait = trainer.stats.wait_seconds - w0 if trainer is not None else 0.0
            if i >= opts.warmup:
                for k, v in zip(samples, (t3 - t0, t1 - t0, t2 - t1, t3 - t2, wait, c3 - c0)):
                    samples[k].append(v)
    out.update(samples=samples, losses=losses, optimizer_state_bytes=state_bytes(opt))
    out.update(peak_rss_increase=m.increase, rss_increase_end=m.after - m.before, rss_base=m.before)
    if trainer is not None:
        fm = trainer.module
        plan = plan_memory(fm.layout, WORLD, shard=trainer.shard)[rank].as_dict()
        out.update(memory_bytes=trainer.memory_bytes(), plan_memory=plan, flat_numel=fm.numel)
        out.update(padded_numel=trainer.padded_numel, buckets=trainer.stats.buckets)
        out["launched_during_backward"] = trainer.stats.launched_during_backward
        trainer.close()
    return out


def worker(rank: int, port: int, opts: argparse.Namespace, outdir: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    timeout = datetime.timedelta(seconds=opts.comm_timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        result = run_config(opts)
    except Exception as e:  # reported instead of numbers (the other rank may time out)
        result = {"error": f"{type(e).__name__}: {e}".strip(), "traceback": traceback.format_exc()}
    Path(outdir, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(opts: argparse.Namespace) -> list[dict]:
    """Run ``opts.config`` at WORLD ranks in fresh processes; each rank's result (or its error)."""
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.spawn(worker, args=(store.port, opts, tmp), nprocs=WORLD, join=False)
        deadline, error = now() + opts.config_timeout, None
        try:
            while not ctx.join(timeout=1.0):
                if now() > deadline:
                    error = f"timed out after {opts.config_timeout} s"
                    for p in ctx.processes:
                        p.terminate()
                    break
        except Exception as e:  # a rank died outside run_config
            error = f"{type(e).__name__}: {e}".strip()
        files = [Path(tmp, f"{r}.json") for r in range(WORLD)]
        return [json.loads(f.read_text()) if f.exists() else {"error": error} for f in files]


def summarize(rounds: list[list[dict]]) -> dict:
    """Pool each rank's samples over the rounds; per metric the max over ranks of the medians."""
    errors = [
        f"round {i} rank {r}: {x['error']}"
        for i, rs in enumerate(rounds)
        for r, x in enumerate(rs)
        if "error" in x
    ]
    if errors:  # every rank's: the first one is often the other rank's consequence
        return {"error": "; ".join(errors)}
    pooled = [
        {k: [v for rs in rounds for v in rs[r]["samples"][k]] for k in rounds[0][r]["samples"]}
        for r in range(WORLD)
    ]
    s: dict = {
        "median_seconds": {k: max(statistics.median(r[k]) for r in pooled) for k in pooled[0]}
    }
    s["p10_p90_step_seconds"] = [
        max(statistics.quantiles(r["step"], n=10, method="inclusive")[q] for r in pooled)
        for q in (0, -1)
    ]
    s["step_median_by_round"] = [
        max(statistics.median(x["samples"]["step"]) for x in rs) for rs in rounds
    ]
    s["optimizer_state_bytes"] = max(x["optimizer_state_bytes"] for rs in rounds for x in rs)
    s["peak_rss_increase"] = max(x["peak_rss_increase"] for rs in rounds for x in rs)
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="passes over the configs, order reversed")
    p.add_argument("--bucket-mb", type=float, default=25, help="torchshard bucket size (DDP: 25)")
    p.add_argument("--config-timeout", type=float, default=240, help="seconds per configuration")
    p.add_argument("--comm-timeout", type=float, default=90, help="gloo collective timeout (s)")
    p.add_argument("--out", default="benchmarks/results/sharded.json")
    opts = p.parse_args()
    t_start = now()
    raw: dict[str, list] = {n: [] for n in CONFIGS}  # config -> rounds -> ranks
    load: dict[str, list] = {n: [] for n in CONFIGS}
    for rnd in range(opts.rounds):  # ABCDE EDCBA ...: cancels a linear drift of the machine
        for name in CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]:
            load[name].append(os.getloadavg())
            opts.config = name  # one fresh process pair each: clean peaks
            raw[name].append(launch(opts))
    del opts.config
    summary = {name: summarize(raw[name]) for name in CONFIGS}
    ok = {n: s for n, s in summary.items() if "error" not in s}
    ddp = ok.get("ddp", {}).get("median_seconds", {}).get("step")
    ddp_cpu = ok.get("ddp", {}).get("median_seconds", {}).get("cpu")
    repl = ok.get("ts_repl", {}).get("optimizer_state_bytes")
    for s in ok.values():
        s["step_vs_ddp"] = s["median_seconds"]["step"] / ddp if ddp else None
        s["cpu_vs_ddp"] = s["median_seconds"]["cpu"] / ddp_cpu if ddp_cpu else None
        s["opt_state_vs_repl"] = s["optimizer_state_bytes"] / repl if repl else None

    def loads(name: str) -> str:
        return "/".join(f"{x[0]:.1f}" for x in load[name])

    def ratio(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    t_rows, m_rows, notes = [], [], []
    for name in CONFIGS:
        s = summary[name]
        if "error" in s:
            notes.append(f"[{len(notes) + 1}] {name}: {s['error']}")
            t_rows.append((name, f"ERROR [{len(notes)}]", *["-"] * 9, loads(name)))
            m_rows.append((name, f"ERROR [{len(notes)}]", "-", "-", "-"))
            continue
        md, (p10, p90) = s["median_seconds"], s["p10_p90_step_seconds"]
        ms = [f"{md[k] * 1e3:.1f}" for k in ("step", "fwd_bwd", "reduce", "wait", "update", "cpu")]
        if name in ("ddp", "fsdp2"):
            ms[2:4] = ["in bwd", "-"]
        by_round = "/".join(f"{t * 1e3:.0f}" for t in s["step_median_by_round"])
        row = [name, ms[0], f"{p10 * 1e3:.0f}-{p90 * 1e3:.0f}", by_round, *ms[1:5]]
        t_rows.append([*row, ratio(s["step_vs_ddp"]), ms[5], ratio(s["cpu_vs_ddp"]), loads(name)])
        mb = raw[name][0][0].get("memory_bytes")
        row = [name, fmt_bytes(s["optimizer_state_bytes"]), ratio(s["opt_state_vs_repl"], 3)]
        m_rows.append([*row, fmt_bytes(sum(mb.values())) if mb else "-"])
        m_rows[-1].append(fmt_bytes(s["peak_rss_increase"]))
    title = (
        f"\n{WORLD} ranks, gloo, 1 thread/rank, {PRESET} GPT, {BATCH}x{BLOCK} tokens/rank, AdamW; "
        f"{opts.rounds} rounds x {opts.steps} steps (+{opts.warmup} warm-up), max over ranks of "
        "per-rank medians\nreduce: exposed average_gradients() (wait: its comm wait); update: "
        "opt.step() / trainer.step() (+all-gather); cpu: process CPU time per step"
    )
    headers = (
        "step time (ms),step,p10-p90,by round,fwd+bwd,reduce,(wait),update,/DDP,cpu,cpu/DDP,load"
    )
    print(format_table(headers.split(","), t_rows, title))
    headers = "memory per rank (max),opt state,/repl,memory_bytes(),peak RSS +"
    title = "\nopt state: optimizer state tensors; memory_bytes(): torchshard's total (table below)"
    print(format_table(headers.split(","), m_rows, title))
    for note in notes:
        print(note)

    rows = []
    for name in ("ts_repl", "ts_shard", "ts_shard_bf16"):
        for r, res in enumerate(raw[name][0]):
            if "memory_bytes" not in res:
                continue
            mb, plan = res["memory_bytes"], res["plan_memory"]
            cells = [fmt_bytes(mb[k]) for k in ("parameters", "gradients", "optimizer", "master")]
            same = "yes" if mb == plan else f"no: {plan}"
            rows.append((f"{name} r{r}", *cells, fmt_bytes(sum(mb.values())), same))
    headers = "memory_bytes(),parameters,gradients,optimizer,master,total,= plan"
    print(format_table(headers.split(","), rows, "\ntorchshard memory_bytes() vs plan_memory()"))

    targets = {}
    for name in ("ts_shard", "ts_shard_bf16"):
        frac = ok.get(name, {}).get("opt_state_vs_repl")
        verdict = "n/a" if frac is None else "PASS" if frac <= TARGET else "FAIL"
        targets[name] = {"ratio": frac, "target": TARGET, "verdict": verdict}
        print(
            f"{name}: optimizer state per rank / replicated = {ratio(frac, 3)} (<= {TARGET}): "
            + verdict
        )
    first = {n: raw[n][0] for n in CONFIGS}  # losses: the first round's
    ref = first["ddp"][0].get("losses")
    for name in CONFIGS[1:]:
        if ref and "losses" in first[name][0]:
            diff = max(
                abs(a - b)
                for r in range(WORLD)
                for a, b in zip(first[name][r]["losses"], first["ddp"][r]["losses"])
            )
            summary[name]["max_abs_loss_diff_vs_ddp"] = diff
            print(f"{name}: max |loss - DDP loss| over steps and ranks = {diff:.2e}")
    end_load = os.getloadavg()
    print(
        f"\ntotal {now() - t_start:.0f} s; 1-min load {load['ddp'][0][0]:.1f} at start, "
        f"{end_load[0]:.1f} at end ({os.cpu_count()} CPUs)"
    )
    results = {"machine": machine_info(), "args": vars(opts), "threads_per_rank": 1}
    results.update(world_size=WORLD, preset=PRESET, batch=BATCH, block=BLOCK, adamw=ADAMW)
    results.update(loadavg_before_config_by_round=load, loadavg_at_end=list(end_load))
    results.update(summary=summary, targets=targets, raw_by_config_round_rank=raw)
    print(f"wrote {write_json(opts.out, results)}")


if __name__ == "__main__":
    main()
