"""Benchmark FlatParamModule: layout construction on meta, and bind() copy throughput.

    python benchmarks/bench_flat.py [--sizes 125m,1.3b,7b] [--bind-size 125m]
                                    [--repeats 5] [--threads N] [--out benchmarks/results/flat.json]

1. Layout on meta, one fresh subprocess per GPT preset (so RSS numbers are not
   polluted by earlier sizes): time to build the model under
   ``torch.device("meta")``, time to wrap it in ``FlatParamModule`` (layout
   only), the peak-RSS increase and ``tracemalloc`` peak of the wrap, and the
   parameter/slot counts and layout JSON size.
2. bind() throughput for a model with real fp32 CPU weights: ``fm.bind(torch.empty(n))``
   copies every parameter into the fresh flat buffer one at a time. Compared with
   ``dst.copy_(src)`` of the same bytes into a pre-faulted tensor (the limit) and into a
   fresh ``torch.empty`` one (page faults included, like bind's destination), and with
   the same copies done one slot at a time without bind's bookkeeping. Also bind +
   ``init_weights(init_gpt_weights)`` of a meta-built model.

Times are medians over ``--repeats``, wall-clock and CPU time (user + sys of the process);
GB/s is bytes copied (counted once) / s / 1e9; "sys CPU" and "faults" are the process's
kernel time and minor page faults (getrusage). Every repetition is one round of every
measurement, so ratios are paired: ``paired["bind / copy_fresh"]`` holds one ratio per
round (wall and CPU), and the tables show their median and spread. Prints tables and
writes every sample, with machine info, to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path

import torch
from _common import (
    REPO,
    PeakRSS,
    Stopwatch,
    add_examples_to_path,
    fmt_bytes,
    fmt_ms,
    format_table,
    machine_info,
    median,
    rss_bytes,
    run_child,
    write_json,
)
from report.freshness import hashes
from report.stats import spread_text

from torchshard import FlatParamModule

add_examples_to_path()
from gpt import GPT, GPTConfig, init_gpt_weights  # noqa: E402


def meta_gpt(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


# -- 1. layout on meta (runs in a child process, one per size) ------------------------------
def child_layout(size: str, repeats: int) -> dict:
    cfg = GPTConfig.preset(size)
    FlatParamModule(meta_gpt(GPTConfig.preset("tiny")))  # warm-up: one-time lazy init in torch
    rss_start = rss_bytes()
    with PeakRSS() as build_mem, Stopwatch() as sw:
        model = meta_gpt(cfg)
    build_s = [sw.s]
    with PeakRSS() as wrap_mem, Stopwatch() as sw:
        fm = FlatParamModule(model)
    wrap_s, wrap_cpu_s = [sw.s], [sw.user_s + sw.sys_s]
    layout = fm.layout
    with Stopwatch() as sw:
        layout_json = layout.to_json()
    to_json_s = sw.s
    # tracemalloc slows Python down, so it gets a wrap of its own.
    tracemalloc.start()
    FlatParamModule(model)
    tracemalloc_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    for _ in range(repeats - 1):
        with Stopwatch() as sw:
            m = meta_gpt(cfg)
        build_s.append(sw.s)
        with Stopwatch() as sw:
            FlatParamModule(m)
        wrap_s.append(sw.s)
        wrap_cpu_s.append(sw.user_s + sw.sys_s)
    return {
        "size": size,
        "params": layout.param_numel,
        "named_params": sum(len(s.names) for s in layout),
        "slots": len(layout),
        "numel": layout.numel,
        "buffer_bytes": layout.nbytes,
        "layout_json_bytes": len(layout_json.encode()),
        "to_json_s": to_json_s,
        "rss_after_import_bytes": rss_start,
        "build_meta_s": build_s,
        "build_meta_s_median": median(build_s),
        "build_meta_peak_rss_increase_bytes": build_mem.increase,
        "wrap_s": wrap_s,
        "wrap_s_median": median(wrap_s),
        "wrap_cpu_s": wrap_cpu_s,
        "wrap_peak_rss_increase_bytes": wrap_mem.increase,
        "wrap_tracemalloc_peak_bytes": tracemalloc_peak,
        "peak_rss_exact": wrap_mem.exact,
    }


def layout_table(results: list[dict]) -> str:
    rows = [
        [
            r["size"],
            f"{r['params'] / 1e6:,.1f} M",
            r["slots"],
            fmt_ms(r["build_meta_s_median"]),
            fmt_ms(r["wrap_s_median"]),
            fmt_ms(median(r["wrap_cpu_s"])),
            fmt_bytes(r["wrap_peak_rss_increase_bytes"]),
            fmt_bytes(r["wrap_tracemalloc_peak_bytes"]),
            fmt_bytes(r["layout_json_bytes"]),
            fmt_bytes(r["buffer_bytes"]),
        ]
        for r in results
    ]
    headers = ["preset", "params", "slots", "build (meta)", "wrap", "wrap CPU", "wrap RSS+",
               "wrap tracemalloc", "layout JSON", "fp32 buffer"]  # fmt: skip
    return format_table(headers, rows, "Layout on meta (fresh process per preset, medians)")


# -- 2. bind / copy throughput ----------------------------------------------------------------
def bench_bind(size: str, repeats: int) -> dict:
    cfg = GPTConfig.preset(size)
    layout = FlatParamModule(meta_gpt(cfg)).layout
    n, itemsize = layout.numel, layout.torch_dtype.itemsize
    param_bytes, buffer_bytes = layout.param_numel * itemsize, n * itemsize
    src = torch.empty(n).uniform_()  # touched: no page faults left in src
    dst = torch.zeros(n)  # touched: the pre-faulted destination
    grad = torch.zeros(n)  # a pre-faulted gradient buffer for the "grad given" variant
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def record(name: str, sw: Stopwatch) -> None:
        for metric in ("s", "user_s", "sys_s", "minflt"):
            samples[name][metric].append(getattr(sw, metric))

    def per_slot_copy(out: torch.Tensor) -> None:  # bind's copies without its bookkeeping
        for slot in layout:
            out[slot.offset : slot.end].copy_(src[slot.offset : slot.end])

    bind_rss: list[int] = []
    # One round per repetition, every measurement in each round, so that drift
    # (other processes, the state of free memory) hits them all alike.
    for _ in range(repeats):
        with Stopwatch() as sw:
            model = GPT(cfg)  # real weights: allocate + init_gpt_weights
        record("gpt_cpu_build", sw)
        fm = FlatParamModule(model)
        del model
        with PeakRSS() as mem, Stopwatch() as sw:
            fm.bind(torch.empty(fm.numel))
        record("bind", sw)
        bind_rss.append(mem.increase)
        del fm

        fm = FlatParamModule(GPT(cfg))
        with Stopwatch() as sw:
            fm.bind(torch.empty(fm.numel), grad)
        record("bind_grad_given", sw)
        del fm

        with Stopwatch() as sw:
            dst.copy_(src)
        record("copy_prefaulted", sw)
        with Stopwatch() as sw:
            torch.empty(n).copy_(src)
        record("copy_fresh", sw)
        with Stopwatch() as sw:
            per_slot_copy(dst)
        record("slots_prefaulted", sw)
        with Stopwatch() as sw:
            per_slot_copy(torch.empty(n))
        record("slots_fresh", sw)
        with Stopwatch() as sw:
            torch.zeros(n)
        record("zeros_fresh", sw)

        fm = FlatParamModule(meta_gpt(cfg))
        with Stopwatch() as sw:
            fm.bind(torch.empty(fm.numel))
        record("meta_bind", sw)
        with Stopwatch() as sw:
            fm.init_weights(init_gpt_weights)
        record("meta_init_weights", sw)
        del fm

    samples = {k: dict(v) for k, v in samples.items()}
    samples["meta_bind_init"] = {
        m: [a + b for a, b in zip(samples["meta_bind"][m], samples["meta_init_weights"][m])]
        for m in samples["meta_bind"]
    }
    med = {k: {m: median(v) for m, v in d.items()} for k, d in samples.items()}
    t = {k: d["s"] for k, d in med.items()}

    def cpu(k: str) -> list[float]:
        return [u + s for u, s in zip(samples[k]["user_s"], samples[k]["sys_s"])]

    paired = {  # one ratio per round: the measurements of a round ran back to back
        f"{a} / {b}": {
            "wall": [x / y for x, y in zip(samples[a]["s"], samples[b]["s"])],
            "cpu": [x / y for x, y in zip(cpu(a), cpu(b))],
        }
        for a, b in (("bind", "copy_fresh"), ("bind", "copy_prefaulted"),
                     ("slots_fresh", "copy_fresh"), ("meta_bind", "copy_fresh"))
    }  # fmt: skip
    copied = {k: param_bytes if k.startswith("bind") else buffer_bytes
              for k in ("bind", "bind_grad_given", "copy_prefaulted", "copy_fresh",
                        "slots_prefaulted", "slots_fresh", "zeros_fresh")}  # fmt: skip
    return {
        "size": size,
        "repeats": repeats,
        "numel": n,
        "slots": len(layout),
        "param_bytes": param_bytes,
        "buffer_bytes": buffer_bytes,
        "largest_param_bytes": max(slot.numel for slot in layout) * itemsize,
        "samples": samples,
        "median": med,
        "gbps": {k: b / t[k] / 1e9 for k, b in copied.items()},
        "ratio_vs_copy_prefaulted": {k: t[k] / t["copy_prefaulted"] for k in t},
        "ratio_vs_copy_fresh": {k: t[k] / t["copy_fresh"] for k in t},
        "paired": paired,
        "bind_peak_rss_increase_bytes": bind_rss,
    }


BIND_ROWS = [
    ("copy_prefaulted", "dst.copy_(src), dst pre-faulted (limit)"),
    ("copy_fresh", "torch.empty(n).copy_(src) (page faults)"),
    ("slots_prefaulted", "copy_ per slot, dst pre-faulted"),
    ("slots_fresh", "copy_ per slot, fresh torch.empty(n)"),
    ("zeros_fresh", "torch.zeros(n)"),
    ("bind", "fm.bind(torch.empty(n))"),
    ("bind_grad_given", "fm.bind(torch.empty(n), grad=pre-faulted)"),
    ("meta_bind", "meta: fm.bind(torch.empty(n))"),
    ("meta_init_weights", "meta: fm.init_weights(init_gpt_weights)"),
    ("meta_bind_init", "meta: bind + init_weights"),
    ("gpt_cpu_build", "GPT(cfg) on CPU (alloc + init)"),
]


def bind_table(r: dict) -> str:
    med, gbps = r["median"], r["gbps"]
    rows = [
        [label, fmt_ms(med[k]["s"]), f"{gbps[k]:.2f}" if k in gbps else "-",
         f"{r['ratio_vs_copy_prefaulted'][k]:.2f}x", f"{r['ratio_vs_copy_fresh'][k]:.2f}x",
         fmt_ms(med[k]["sys_s"]), f"{med[k]['minflt'] / 1e3:.0f}k"]
        for k, label in BIND_ROWS
    ]  # fmt: skip
    title = (f"bind vs copy_ ({r['size']}, fp32, {r['param_bytes'] / 1e9:.2f} GB in "
             f"{r['slots']} slots, median of {r['repeats']})")  # fmt: skip
    headers = ["operation", "time", "GB/s", "/ copy_", "/ fresh copy_", "sys CPU", "faults"]
    table = format_table(headers, rows, title)
    rows = [(k, spread_text(v["wall"]), spread_text(v["cpu"])) for k, v in r["paired"].items()]
    table += "\n\n" + format_table(["paired ratio, per round", "wall", "CPU"], rows)
    rss = fmt_bytes(median(r["bind_peak_rss_increase_bytes"]))
    return (f"{table}\nbind peak RSS increase: {rss} (flat buffer {fmt_bytes(r['buffer_bytes'])}, "
            f"largest parameter {fmt_bytes(r['largest_param_bytes'])})")  # fmt: skip


# -- main ------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", default="125m,1.3b,7b", help="GPT presets for the layout part")
    ap.add_argument("--bind-size", default="125m", help="GPT preset for bind ('' skips it)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "flat.json"))
    ap.add_argument("--child", metavar="SIZE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.child:  # one layout measurement, JSON on stdout
        print(json.dumps(child_layout(args.child, args.repeats)))
        return

    t_start = time.perf_counter()
    results: dict = {"benchmark": "flat", "machine": machine_info(), "measured": hashes("flat")}
    results["args"] = vars(args)
    sizes = [x for x in args.sizes.split(",") if x]
    layouts = [
        run_child(__file__, ["--child", size, "--repeats", str(args.repeats)]) for size in sizes
    ]
    results["layout"] = {r["size"]: r for r in layouts}
    if layouts:
        print(layout_table(layouts), end="\n\n", flush=True)
    if args.bind_size:
        results["bind"] = bench_bind(args.bind_size, args.repeats)
        results["paired"] = results["bind"]["paired"]
        print(bind_table(results["bind"]), end="\n\n")
    results["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results["total_s"] = time.perf_counter() - t_start
    m = results["machine"]
    load = "/".join(f"{x:.1f}" for x in m["loadavg"] or ())
    print(f"torch {m['torch']}, {m['cpu_count']} CPUs ({m['cpu']}), {m['torch_threads']} torch "
          f"threads, load {load} at start, {m['date']}")  # fmt: skip
    print(f"wrote {Path(write_json(args.out, results)).resolve()}")


if __name__ == "__main__":
    sys.exit(main())
