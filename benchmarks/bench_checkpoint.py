"""Benchmark torchshard checkpoints against safetensors, dd and torch.distributed.checkpoint.

    python benchmarks/bench_checkpoint.py [--size-gb 1.0] [--steps 10] [--repeats 4]
                                          [--train-repeats 4] [--resume-repeats 4]
                                          [--dir /tmp] [--out benchmarks/results/checkpoint.json]

State: a GPT (examples/gpt.py, n_embd 768, vocab 256, n_layer to fit) in fp32 with AdamW's
exp_avg and exp_avg_sq, --size-gb in all, after real AdamW steps on 1 x --block tokens. All
files go to one temporary directory under --dir; before every measurement its outputs are
deleted, then ``sync`` and (where permitted) ``echo 3 > /proc/sys/vm/drop_caches``.

1. Blocking save (world of one): ``checkpoint.save(root, fm, optimizer=opt)`` vs safetensors
   ``save_file`` of the same tensors (cloned before timing) + fsync vs ``dd bs=64M`` of as many
   bytes, ``conv=fsync`` and ``oflag=direct``. A warm-up round, then --repeats rounds in
   rotating order; per round the ratio torchshard / save_file (wall, and CPU time of this
   process and its children). Twice: here (ISA-L's CRC-32: the default install) and in a
   child that cannot import ISA-L (``--no-fast``: zlib's, a platform without its wheel).
2. Training time lost to one save: --steps steps with a save issued after step 2's
   ``opt.step()`` (and, when async, waited for after the last), minus the same steps
   without. Configurations, all of them in each of --train-repeats rounds, rotating:
   no save; ``checkpoint.save`` (blocking) inside the loop, the baseline; torchshard's async
   ``Checkpointer.save``; DCP's ``dcp.async_save({"model", "optim"})`` on a gloo world of
   one, written by a thread (``dcp``) and by DCP's checkpoint process (``dcp_process``,
   ``AsyncCheckpointerType.PROCESS``). blocked = time in the save call + the wait of the next
   ``opt.step()`` (step pre-hooks around torchshard's fence; "step diff": that opt.step()
   minus its no-save twin). cpu+ = CPU seconds over the no-save loop, this process's and its
   running children's (DCP's checkpoint process). One untimed save of each first (torchshard
   then reuses its staging memory; DCP starts its process). Per round, the async save's
   blocked time (and step diff) over the time the blocking save's call held the loop, and
   its lost time over the lost time of the blocking loop (and of each DCP loop), in that
   round.
3. Resume, run first, before this process builds the state of parts 1 and 2 (memory another
   process holds makes fresh pages dearer on the project's VM: benchmarks/README.md): save
   at world 2 (fresh processes, gloo, 1 thread per rank), then --resume-repeats rounds of
   one load at each of world 2, 3, 1 and 4, in an order rotated every round, each in fresh
   processes (a resume starts that way), page cache dropped before it: max over ranks of
   ``checkpoint.load`` (wall and CPU), the CPU of every rank (``process_time``: its gloo
   threads too) and the collectives it issued; bytes_read summed over ranks. Per round, the
   ratios world 3 / world 2, 4 / 2 and 1 / 2; CPU per rank falling with the world size as
   the bytes per rank do is the check (a world-size penalty shows as a slope).
4. Host memory, a fresh process each: peak RSS increase over the RSS before of a blocking
   save, a load into a fresh optimizer, ``save_file``, DCP ``async_save``; the RSS after each
   of 5 async ``Checkpointer`` saves.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import (
    REPO,
    PeakRSS,
    add_examples_to_path,
    fmt_bytes,
    format_table,
    machine_info,
    median,
    rss_bytes,
    run_child,
    run_ranks,
    write_json,
)
from report.freshness import hashes
from report.stats import spread_text, verdict
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

if "--no-fast" in sys.argv:  # a platform without ISA-L's wheel: zlib's CRC-32
    sys.modules["isal"] = sys.modules["isal.isal_zlib"] = None  # type: ignore[assignment]
from torchshard import DistributedTrainer, FlatParamModule, checkpoint

add_examples_to_path()
from gpt import GPT, GPTConfig, init_gpt_weights  # noqa: E402

now = time.perf_counter
SAVE_AT = 2  # the save is issued after this step's opt.step()


def gpt_config(size_gb: float, block: int) -> GPTConfig:
    n_layer = max(1, round(size_gb * 1e9 / 12 / (12 * 768 * 768)))  # 12 B per parameter
    return GPTConfig(vocab_size=256, block_size=block, n_layer=n_layer, n_head=12, n_embd=768)


def build(cfg: GPTConfig, distributed: bool = False, shard: bool | str = False):
    """(trainer or fm, fm, AdamW): the GPT's weights in one flat fp32 CPU buffer."""
    with torch.device("meta"):
        model = GPT(cfg)
    fm = FlatParamModule(model)
    if distributed:
        obj = DistributedTrainer(fm, init_fn=init_gpt_weights, shard=shard)
    else:
        obj = fm.bind(torch.empty(fm.numel), torch.zeros(fm.numel)).init_weights(init_gpt_weights)
    adamw = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if distributed:
        return obj, fm, obj.make_optimizer(torch.optim.AdamW, **adamw)
    return obj, fm, torch.optim.AdamW(fm.parameters(), **adamw)


def batch(block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 256, (1, block + 1), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1], idx[:, 1:]


def train_step(fm, opt, xy, trainer=None) -> None:
    opt.zero_grad()
    fm(*xy)[1].backward()
    if trainer is not None:
        trainer.average_gradients()
    opt.step()


def state_bytes(fm, opt) -> int:
    st = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return fm.layout.param_numel * 4 + sum(v.numel() * v.element_size() for v in st)


def weights_sum(fm) -> float:
    return sum(float(p.detach().double().sum()) for p in fm.parameters())


def cpu_s(children: bool = False, live: bool = False) -> float:
    """CPU seconds of this process (every thread), plus its waited-for children if asked, plus
    (``live``) what its running children have used so far (DCP's checkpoint process)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)[: 2 if children else 1]:
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    return total + (live_children_cpu_s() if live else 0.0)


def live_children_cpu_s() -> float:
    """CPU seconds used so far by this process's running children (Linux ``/proc``; 0
    elsewhere): utime + stime of each process whose parent is this one."""
    me, total, tick = os.getpid(), 0.0, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == me:  # after the name: state, ppid, ..., utime (12), stime (13)
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def fast_extra() -> bool:
    """Whether ISA-L (a dependency where it has a wheel) is importable here: whose CRC-32."""
    return importlib.util.find_spec("isal") is not None  # None where --no-fast hid it


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def fresh(work: Path) -> None:
    """Delete every output under ``work``, then sync and drop the page cache."""
    for p in work.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    drop_caches()


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def dcp_save(fm, opt, path: Path, kind: AsyncCheckpointerType = AsyncCheckpointerType.THREAD):
    """Start a DCP async save of the model and optimizer state dicts, written by a thread or
    (``kind`` PROCESS) by DCP's checkpoint process; returns its wait()."""
    state = {"model": fm.state_dict(), "optim": opt.state_dict()}
    fut = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=kind)
    return getattr(fut, "upload_completion", fut).result


# -- 1. blocking save -----------------------------------------------------------------------------
def part_blocking(fm, opt, work: Path, repeats: int) -> dict:
    tensors = {}  # separate contiguous copies, made before timing
    for name, p in fm.module.named_parameters():
        tensors[name] = p.detach().clone()
        tensors.update({f"{name}.{k}": v.clone() for k, v in opt.state[p].items() if v.dim()})
    count = -(-sum(t.numel() * t.element_size() for t in tensors.values()) // 2**26)

    def safetensors_save() -> int:
        save_file(tensors, str(work / "st.safetensors"))
        fd = os.open(work / "st.safetensors", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return tree_bytes(work)

    def dd(flag: str):
        args = ["dd", "if=/dev/zero", f"of={work / 'dd.bin'}", "bs=64M", f"count={count}", flag]
        return lambda: subprocess.run(args, check=True, capture_output=True) and count * 2**26

    methods = {
        "torchshard": lambda: tree_bytes(checkpoint.save(work / "ts", fm, step=1, optimizer=opt)),
        "safetensors": safetensors_save,
        "dd_fsync": dd("conv=fsync"),
        "dd_direct": dd("oflag=direct"),
    }
    samples, cpu, written, names = defaultdict(list), defaultdict(list), {}, list(methods)
    for rep in range(-1, repeats):  # round -1: warm-up (first touch of memory), not recorded
        for name in names[rep % 4 :] + names[: rep % 4]:
            fresh(work)
            c0, t0 = cpu_s(children=True), now()
            written[name] = methods[name]()
            if rep >= 0:
                samples[name].append(now() - t0)
                cpu[name].append(cpu_s(children=True) - c0)
    fresh(work)
    med = {k: median(v) for k, v in samples.items()}
    gbps = {k: written[k] / med[k] / 1e9 for k in med}
    paired = {
        f"{a} / {b}": {
            "wall": [x / y for x, y in zip(samples[a], samples[b])],
            "cpu": [x / y for x, y in zip(cpu[a], cpu[b])],
        }
        for a, b in (("torchshard", "safetensors"), ("torchshard", "dd_fsync"))
    }
    return {"samples_s": samples, "cpu_s": cpu, "median_s": med, "bytes_written": written,
            "gb_per_s": gbps, "paired": paired}  # fmt: skip


# -- 2. training time lost to one checkpoint --------------------------------------------------------
def part_training(fm, opt, work: Path, cfg: GPTConfig, steps: int, repeats: int) -> dict:
    batches = [batch(cfg.block_size, 100 + i) for i in range(steps)]
    starts = {"none": None}

    def blocking(i: int) -> None:  # the baseline: the loop waits for the whole save
        checkpoint.save(work / "blocking", fm, step=i, optimizer=opt)

    starts["blocking"] = blocking
    ckpt = checkpoint.Checkpointer(work / "ts", keep_last=None)
    starts["torchshard"] = lambda i: ckpt.save(fm, step=i, optimizer=opt).wait
    dcp_error = None
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        starts["dcp"] = lambda i: dcp_save(fm, opt, work / f"dcp-{i}")
        process = AsyncCheckpointerType.PROCESS
        starts["dcp_process"] = lambda i: dcp_save(fm, opt, work / f"dcpp-{i}", process)
    except Exception as e:  # reported; DCP is left out
        dcp_error = f"{type(e).__name__}: {e}"
    marks: dict[str, float] = {}
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("enter", now()))
    for name in list(starts)[1:]:  # warm-up; from here torchshard's fence hook is registered
        wait = starts[name](0)
        if wait:
            wait()
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("fenced", now()))

    def loop(start) -> dict:
        rec: dict = {"step_s": [], "opt_step_s": [], "fence_wait_s": [], "save_call_s": 0.0}
        cpu0 = cpu_s(live=True)  # its /proc scan before the clock starts, and after it stops
        wait, t_start = None, now()
        for i, xy in enumerate(batches):
            t0 = now()
            opt.zero_grad()
            fm(*xy)[1].backward()
            t1 = now()
            opt.step()
            rec["step_s"].append(now() - t0)
            rec["opt_step_s"].append(now() - t1)
            rec["fence_wait_s"].append(marks["fenced"] - marks["enter"])
            if i == SAVE_AT and start is not None:
                t0 = now()
                wait = start(i)
                rec["save_call_s"] = now() - t0
        t0 = now()
        if wait:
            wait()
        t_end = now()
        cpu = cpu_s(live=True) - cpu0
        rec.update(final_wait_s=t_end - t0, total_s=t_end - t_start, cpu_s=cpu)
        return rec

    rounds, names = [], list(starts)
    for rep in range(repeats):
        recs = {}
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            fresh(work)
            recs[name] = loop(starts[name])
        rounds.append(recs)
    ckpt.close()
    fresh(work)
    med, per = {}, {}
    for name in names:
        per[name] = [derived(r[name], r["none"]) for r in rounds]
        med[name] = {k: median([d[k] for d in per[name]]) for k in per[name][0]}
        lost = [d["lost"] for d in per[name]]
        med[name]["lost_range"] = [min(lost), max(lost)]

    def ratio(a: str, b: str, key: str, base: str = "lost") -> list[float]:
        return [x[key] / y[base] for x, y in zip(per[a], per[b])]

    # Per round. Blocked time against the time the blocking save held the loop (its call: a
    # direct timing); lost time against the blocking loop's lost time (both differences of
    # whole loops, so noisier).
    paired = {
        "blocked: async / blocking": {
            "wall": ratio("torchshard", "blocking", "blocked", "blocked")
        },
        "step diff: async / blocking": {
            "wall": ratio("torchshard", "blocking", "blocked_step_diff", "blocked")
        },
        "lost: async / blocking": {
            "wall": ratio("torchshard", "blocking", "lost"),
            "cpu": ratio("torchshard", "blocking", "cpu_added", "cpu_added"),
        },
    }
    for key, name in (("dcp", "dcp"), ("dcp process", "dcp_process")):
        if name in per:
            paired[f"lost: async / {key}"] = {
                "wall": ratio("torchshard", name, "lost"),
                "cpu": ratio("torchshard", name, "cpu_added", "cpu_added"),
            }
    return {"dcp_error": dcp_error, "rounds": rounds, "median_s": med, "paired": paired}


def derived(a: dict, b: dict) -> dict:
    """One round's figures: loop ``a`` (with a save) against its no-save twin ``b``."""
    n, call = SAVE_AT + 1, a["save_call_s"]
    return {"step": median(a["step_s"]), "total": a["total_s"], "lost": a["total_s"] - b["total_s"],
            "cpu_added": a["cpu_s"] - b["cpu_s"], "save_call": call,
            "fence_wait": a["fence_wait_s"][n], "blocked": call + a["fence_wait_s"][n],
            "blocked_step_diff": call + a["opt_step_s"][n] - b["opt_step_s"][n],
            "final_wait": a["final_wait_s"]}  # fmt: skip


# -- 3. resume at another world size (rank_* run in each rank) ----------------------------------------
def rank_save(root: str, cfg: dict) -> dict:
    trainer, fm, opt = build(GPTConfig(**cfg), distributed=True)
    train_step(fm, opt, batch(cfg["block_size"], dist.get_rank()), trainer)
    dist.barrier()
    t0 = now()
    checkpoint.save(root, trainer, step=1, optimizer=opt)
    return {"save_s": now() - t0, "weights_sum": weights_sum(fm)}


def rank_load(root: str, cfg: dict, shard: bool | str = False) -> dict:
    """One resume: a fresh process per rank, cold page cache, one timed load."""
    trainer, _, opt = build(GPTConfig(**cfg), distributed=True, shard=shard)
    dist.barrier()
    cold = drop_caches() if dist.get_rank() == 0 else None
    dist.barrier()
    calls: list[str] = []
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name: str):
        return lambda *a, **k: calls.append(name) or real[name](*a, **k)

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    c0, t0 = time.process_time(), now()
    info = checkpoint.load(root, trainer, optimizer=opt)
    wall, cpu = now() - t0, time.process_time() - c0
    for name in COLLECTIVES:
        setattr(dist, name, real[name])
    stats = trainer.memory_stats(opt)  # what the load filled: weights, state (no gradients)
    trainer.close()
    return {"load_s": wall, "cpu_s": cpu, "bytes_read": info.bytes_read, "cold": cold,
            "collectives": len(calls),
            "held_bytes": stats.parameters + stats.optimizer + stats.master}  # fmt: skip


WORLDS = (2, 3, 1, 4)
RESUME_MODES = {"replicated": False, "full": "full"}  # the two ends: all state, 1/world of it
COLLECTIVES = ("broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor")


def part_resume(work: Path, cfg: GPTConfig, repeats: int) -> dict:
    root, kw = str(work / "resume"), dict(cfg.__dict__)
    out: dict = {"save_ranks": run_ranks(rank_save, 2, root, kw), "rounds": []}
    path = sorted(Path(root).glob("step-*"))[-1]
    out["checkpoint_bytes"] = tree_bytes(path)
    out["files"] = {f.name: f.stat().st_size for f in sorted(path.iterdir())}
    runs = [(mode, w) for mode in RESUME_MODES for w in WORLDS]
    for rnd in range(repeats):
        k = rnd % len(runs)
        done = {(m, w): run_ranks(rank_load, w, root, kw, RESUME_MODES[m])
                for m, w in runs[k:] + runs[:k]}  # fmt: skip
        out["rounds"].append({m: {w: done[m, w] for w in WORLDS} for m in RESUME_MODES})
    shutil.rmtree(root)
    out["modes"], out["paired"] = {}, {}
    for mode in RESUME_MODES:
        rounds = [rnd[mode] for rnd in out["rounds"]]
        out["modes"][mode] = m = resume_figures(rounds, out["checkpoint_bytes"])
        for a, b in ((3, 2), (4, 2), (1, 2)):
            out["paired"][f"load {mode}: world {a} / world {b}"] = {
                kind: [x / y for x, y in zip(m[key][a], m[key][b])]
                for kind, key in (("wall", "max_over_ranks_s"), ("cpu", "max_over_ranks_cpu_s"))
            }
    return out


def resume_figures(rounds: list[dict], checkpoint_bytes: int) -> dict:
    """One mode's loads, per world size: max over ranks per round, what ranks read and hold."""

    def per_round(world: int, key: str) -> list[float]:
        return [max(r[key] for r in rnd[world]) for rnd in rounds]

    read = {w: max(sum(r["bytes_read"] for r in rnd[w]) for rnd in rounds) for w in WORLDS}
    return {
        "max_over_ranks_s": {w: per_round(w, "load_s") for w in WORLDS},
        "max_over_ranks_cpu_s": {w: per_round(w, "cpu_s") for w in WORLDS},
        "cpu_per_rank_s": {w: [[r["cpu_s"] for r in rnd[w]] for rnd in rounds] for w in WORLDS},
        "held_bytes_max": {w: max(r["held_bytes"] for r in rounds[0][w]) for w in WORLDS},
        "collectives": {w: rounds[0][w][0]["collectives"] for w in WORLDS},
        "bytes_read_sum": read,
        "read_ratio": {w: b / checkpoint_bytes for w, b in read.items()},
        "cold_cache": all(rnd[w][0]["cold"] for rnd in rounds for w in WORLDS),
    }


# -- 4. peak host memory (one fresh process each) -----------------------------------------------------
def child(kind: str, opts: argparse.Namespace) -> dict:
    cfg = gpt_config(opts.size_gb, opts.block)
    fm, _, opt = build(cfg)
    work = Path(opts.dir)
    if kind != "load":
        train_step(fm, opt, batch(cfg.block_size, 0))
    out: dict = {"kind": kind}
    if kind == "blocking":  # part 1 again, in a process that cannot import ISA-L
        train_step(fm, opt, batch(cfg.block_size, 1))
        return {**out, "fast": fast_extra(), **part_blocking(fm, opt, work, opts.repeats)}
    if kind == "repeat":
        ckpt, rss = checkpoint.Checkpointer(work, keep_last=1), []
        for i in range(5):
            future = ckpt.save(fm, step=i, optimizer=opt)
            opt.step()  # waits for the staging copy
            future.wait()
            rss.append(rss_bytes())
        ckpt.close()
        return {**out, "rss_after_each_save": rss}
    if kind == "safetensors":
        sd = {f"{i}": p.detach().clone() for i, p in enumerate(fm.parameters())}
        sd.update({f"{i}.{k}": v.clone() for i, s in enumerate(opt.state.values())
                   for k, v in s.items() if v.dim()})  # fmt: skip
    if kind == "dcp":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with PeakRSS() as m:
        if kind == "save":
            checkpoint.save(work, fm, step=1, optimizer=opt)
        elif kind == "load":
            checkpoint.load(opts.ckpt, fm, optimizer=opt)
        elif kind == "safetensors":
            save_file(sd, str(work / "mem.safetensors"))
        elif kind == "dcp":
            dcp_save(fm, opt, work / "dcp")()
    return {**out, "state_bytes": state_bytes(fm, opt), "rss_before": m.before,
            "peak_increase": m.increase, "rss_after": m.after, "exact": m.exact}  # fmt: skip


def part_memory(work: Path, opts: argparse.Namespace, ckpt: Path) -> dict:
    out = {}
    for kind in ("save", "load", "safetensors", "dcp", "repeat"):
        (work / kind).mkdir()
        args = ["--size-gb", str(opts.size_gb), "--block", str(opts.block), "--ckpt", str(ckpt)]
        out[kind] = run_child(__file__, ["--child", kind, "--dir", str(work / kind), *args])
        shutil.rmtree(work / kind)
    return out


# -- report --------------------------------------------------------------------------------------------
def span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def report(r: dict) -> dict:
    t, res, mem, n = r["training"], r["resume"], r["memory"], r["args"]["repeats"]
    labels = {"torchshard": "torchshard.checkpoint.save", "safetensors": "save_file + fsync",
              "dd_fsync": "dd bs=64M conv=fsync", "dd_direct": "dd bs=64M oflag=direct"}  # fmt: skip
    title = f"\n{fmt_bytes(r['state_bytes'])}: {r['model']}; {r['fs']}; median of {n} rounds"
    for part in ("blocking", "blocking_default"):
        b, med = r[part], r[part]["median_s"]
        rows = [(v, f"{med[k]:.2f}", span(b["samples_s"][k]), f"{median(b['cpu_s'][k]):.2f}",
                 f"{b['gb_per_s'][k]:.2f}") for k, v in labels.items()]  # fmt: skip
        crc = "ISA-L's CRC-32 (default install)" if b["fast"] else "zlib's CRC-32 (no ISA-L)"
        print(format_table(["1. blocking save", "wall s", "min-max", "CPU s", "GB/s"], rows,
                           title + f"; {crc}"))  # fmt: skip
    tm = t["median_s"]
    keys = ("cpu_added", "save_call", "fence_wait", "blocked", "blocked_step_diff")
    rows = [(k, f"{v['step']:.2f}", f"{v['total']:.2f}", f"{v['lost']:.2f}", span(v["lost_range"]),
             *(f"{v[c]:.2f}" for c in keys)) for k, v in tm.items()]  # fmt: skip
    heads = ["2. training (s)", "step", "loop", "lost", "min-max", "cpu+", "save()", "fence",
             "blocked", "step diff"]  # fmt: skip
    title = (f"\n{r['args']['steps']} steps of 1x{r['args']['block']} tokens, save after step "
             f"{SAVE_AT}; median of {r['args']['train_repeats']} rounds (every config in each)"
             + (f"\nDCP failed: {t['dcp_error']}" if t["dcp_error"] else ""))  # fmt: skip
    print(format_table(heads, rows, title))
    rows = [(f"{mode} at world {w}", f"{median(m['max_over_ranks_s'][w]):.2f}",
             span(m["max_over_ranks_s"][w]), f"{median(m['max_over_ranks_cpu_s'][w]):.2f}",
             f"{median([sum(c) / len(c) for c in m['cpu_per_rank_s'][w]]):.2f}",
             fmt_bytes(m["held_bytes_max"][w]), fmt_bytes(m["bytes_read_sum"][w]),
             f"{m['read_ratio'][w]:.3f}", m["collectives"][w])
            for mode, m in res["modes"].items() for w in sorted(WORLDS)]  # fmt: skip
    save2 = max(s["save_s"] for s in res["save_ranks"])
    cold = all(m["cold_cache"] for m in res["modes"].values())
    title = (f"\ncheckpoint {fmt_bytes(res['checkpoint_bytes'])} saved at world 2 in {save2:.2f} s;"
             f" load: max over ranks, median of {r['args']['resume_repeats']} rounds, page cache "
             f"{'dropped' if cold else 'NOT dropped (warm)'}")  # fmt: skip
    heads = ["3. resume", "wall s", "min-max", "CPU s", "CPU/rank", "holds", "read", "/ ckpt",
             "colls"]  # fmt: skip
    print(format_table(heads, rows, title))
    rows = [(k, fmt_bytes(m["peak_increase"]), fmt_bytes(m["rss_after"] - m["rss_before"]),
             f"{m['peak_increase'] / m['state_bytes']:.2f}")
            for k, m in mem.items() if k != "repeat"]  # fmt: skip
    rss = mem["repeat"]["rss_after_each_save"]
    title = f"\nfresh process each; RSS after async saves 1-5: {', '.join(map(fmt_bytes, rss))}"
    print(format_table(["4. host memory", "peak RSS +", "kept", "/ state"], rows, title))
    paired = {**{f"blocking: {k}": v for k, v in r["blocking"]["paired"].items()},
              **{f"blocking, without ISA-L: {k}": v
                 for k, v in r["blocking_default"]["paired"].items()},
              **t["paired"], **res["paired"]}  # fmt: skip
    rows = [(k, spread_text(v["wall"], 3), spread_text(v["cpu"], 3) if "cpu" in v else "-")
            for k, v in paired.items()]  # fmt: skip
    print(format_table(["paired ratio, per round", "wall", "CPU"], rows, "\nmedian (min-max)"))
    for key, kind, target in CHECKS:
        if key in paired:
            print(f"{key} ({kind}, <= {target}): {verdict(paired[key][kind], target)}")
    read = res["modes"]["replicated"]["read_ratio"][3]
    print(f"bytes read / checkpoint, replicated at world 3 (<= 1.05): {read:.3f}")
    print(f"RSS after save 5 / after save 2: {rss[4] / rss[1]:.3f}")
    return paired


CHECKS = (  # the targets: (paired key, wall or cpu, at most)
    ("blocking: torchshard / safetensors", "wall", 1.1),
    ("blocking: torchshard / safetensors", "cpu", 1.2),
    ("blocked: async / blocking", "wall", 0.05),
    ("lost: async / blocking", "wall", 0.1),
    ("lost: async / dcp", "wall", 0.5),
    ("lost: async / dcp process", "wall", 0.5),
    ("load full: world 3 / world 2", "wall", 1.3),
    ("load full: world 3 / world 2", "cpu", 0.8),
    ("load replicated: world 3 / world 2", "wall", 1.3),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.0, help="weights + AdamW state, GB")
    p.add_argument("--block", type=int, default=32, help="tokens per training step (batch 1)")
    p.add_argument("--steps", type=int, default=10, help="training steps per loop (part 2)")
    p.add_argument("--repeats", type=int, default=4, help="rounds of part 1")
    p.add_argument("--train-repeats", type=int, default=4, help="rounds of part 2")
    p.add_argument("--resume-repeats", type=int, default=4, help="rounds of part 3")
    p.add_argument("--dir", default="/tmp", help="where the temporary directory goes")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "checkpoint.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--no-fast", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        print(json.dumps(child(opts.child, opts)))
        return
    t_start, machine, code = now(), machine_info(), hashes("checkpoint")
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=opts.dir))
    try:
        cfg = gpt_config(opts.size_gb, opts.block)
        # part 3 first, while this process holds nothing: memory held elsewhere (parts 1 and
        # 2 keep 3 GB here and in DCP's checkpoint process) makes this VM's fresh pages dearer
        t0 = now()
        resume = part_resume(work, cfg, opts.resume_repeats)
        resume_s = now() - t0
        _, fm, opt = build(cfg)
        for i in range(2):  # AdamW state exists
            train_step(fm, opt, batch(cfg.block_size, i))
        df = subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout
        dev, fstype = df.splitlines()[-1].split()[:2]
        r: dict = {"benchmark": "checkpoint", "machine": machine, "measured": code,
                   "args": vars(opts), "df": df,
                   "fs": f"{work} on {dev} ({fstype})", "drop_caches": drop_caches(),
                   "state_bytes": state_bytes(fm, opt), "model": f"GPT n_layer={cfg.n_layer} "
                   f"n_embd=768, {fm.layout.param_numel / 1e6:.1f}M params + AdamW"}  # fmt: skip
        part_s, t0 = {}, now()
        r["blocking"] = {"fast": fast_extra(), **part_blocking(fm, opt, work, opts.repeats)}
        (work / "default").mkdir()
        args = ["--size-gb", str(opts.size_gb), "--block", str(opts.block)]
        args += ["--repeats", str(opts.repeats), "--dir", str(work / "default")]
        r["blocking_default"] = run_child(__file__, ["--child", "blocking", "--no-fast", *args])
        shutil.rmtree(work / "default")
        part_s["blocking"], t0 = now() - t0, now()
        r["training"] = part_training(fm, opt, work, cfg, opts.steps, opts.train_repeats)
        part_s["training"], t0 = now() - t0, now()
        keep = checkpoint.save(work / "keep", fm, step=1, optimizer=opt)  # for the load child
        del fm, opt
        r["resume"], part_s["resume"], t0 = resume, resume_s, now()
        r["memory"] = part_memory(work, opts, keep)
        part_s["memory"] = now() - t0
        r["part_s"] = part_s
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r["paired"] = report(r)
    r["loadavg_end"], r["total_s"] = list(os.getloadavg()), now() - t_start
    load = ", ".join(f"{x:.1f}" for x in machine["loadavg"])
    cache = "dropped before each" if r["drop_caches"] else "not droppable: warm-cache numbers"
    print(f"\nloadavg {load} at start, {', '.join(f'{x:.1f}' for x in r['loadavg_end'])} at end "
          f"({machine['cpu_count']} CPUs); page cache {cache}; total {r['total_s']:.0f} s "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in r['part_s'].items())})")  # fmt: skip
    print(f"wrote {write_json(opts.out, r)}")


if __name__ == "__main__":
    main()
