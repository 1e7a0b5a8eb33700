"""bench_checkpoint.py (checkpoint.json): blocking and async saves, resuming at another world
size, host memory.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

import statistics

from report.results import Results
from report.stats import mib, paired, pairs_of, spread_text, verdict, wall_cpu
from report.table import PAIRED, Cell, Row


def _blocking_save(r: Results) -> Cell:
    p = paired(r, "checkpoint", "blocking: torchshard / safetensors")
    wall, cpu = verdict(p["wall"], 1.1), verdict(p["cpu"], 1.2)
    return (
        f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}; {_medians(r['checkpoint']['blocking'])}",
        f"wall {wall}; CPU {cpu}",
    )


def _medians(b: dict) -> str:
    """Each writer's median wall and CPU seconds: the page cache's cost (save_file, dd
    conv=fsync) moves 2x to 3x between runs; a ratio alone hides which side moved."""
    names = {"torchshard": "torchshard", "safetensors": "save_file", "dd_fsync": "dd conv=fsync"}
    return "medians " + ", ".join(
        f"{label} {b['median_s'][k]:.2f} s / {statistics.median(b['cpu_s'][k]):.2f} CPU-s"
        for k, label in names.items()
    )


def _blocking_zlib(r: Results) -> Cell:
    p = paired(r, "checkpoint", "blocking, without ISA-L: torchshard / safetensors")
    return f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}", "-"


def _async_blocked(r: Results) -> Cell:
    p = paired(r, "checkpoint", "blocked: async / blocking")
    diff = paired(r, "checkpoint", "step diff: async / blocking")
    return (
        f"{spread_text(p['wall'], 3)}; the `opt.step()` after the save vs its no-save twin: "
        f"{spread_text(diff['wall'], 3)}; {pairs_of(p, 'rounds')}",
        verdict(p["wall"], 0.05),
    )


def _async_lost(r: Results) -> Cell:
    p = paired(r, "checkpoint", "lost: async / blocking")
    return (
        f"wall {spread_text(p['wall'])}, CPU added {spread_text(p['cpu'])}; "
        f"{pairs_of(p, 'rounds')}",
        verdict(p["wall"], 0.1),
    )


def _async_vs(key: str):
    """The row against one of DCP's writers (``dcp``: a thread; ``dcp process``: its
    checkpoint process); CPU includes that process's."""

    def cell(r: Results) -> Cell:
        p = paired(r, "checkpoint", f"lost: async / {key}")
        return f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}", verdict(p["wall"], 0.5)

    return cell


def _bytes_read(r: Results) -> Cell:
    modes = r["checkpoint"]["resume"]["modes"]
    rep, full = modes["replicated"]["read_ratio"]["3"], modes["full"]["read_ratio"]["3"]
    return f'{rep:.3f}x (`shard="full"`: {full:.3f}x)', "met" if rep <= 1.05 else "missed"


def _resume(mode: str):
    def cell(r: Results) -> Cell:
        p = paired(r, "checkpoint", f"load {mode}: world 3 / world 2")
        held = r["checkpoint"]["resume"]["modes"][mode]["held_bytes_max"]
        text = f"{wall_cpu(p)}; holds {held['3'] / held['2']:.2f}x; {pairs_of(p, 'rounds')}"
        if mode == "replicated":
            return text, verdict(p["wall"], 1.3)
        return text, f"wall {verdict(p['wall'], 1.3)}; CPU {verdict(p['cpu'], 0.8)}"

    return cell


def _host_memory(r: Results) -> Cell:
    mem = r["checkpoint"]["memory"]
    load = mem["load"]["peak_increase"] / mem["load"]["state_bytes"]
    rss = mem["repeat"]["rss_after_each_save"]
    growth = rss[-1] / rss[1]
    # bounded: no more than 1% above save 2 (less is no growth: the allocator gave some back)
    trend = "grows" if growth >= 1.01 else "flat" if growth > 0.99 else "shrinks"
    return (
        f"+{mib(mem['save']['peak_increase'])} / +{load:.1f}x state / "
        f"{trend} (save {len(rss)} / save 2: {growth:.3f}x)",
        "missed" if trend == "grows" else "met",
    )


ROWS = (
    Row(
        "blocking save vs `safetensors.save_file` + fsync (1 GB), default install "
        "(ISA-L's CRC-32, a dependency)",
        PAIRED,
        _blocking_save,
        "wall <= 1.1, CPU <= 1.2",
        ("checkpoint",),
    ),
    Row(
        "the same where ISA-L has no wheel (zlib's CRC-32)",
        PAIRED,
        _blocking_zlib,
        "-",
        ("checkpoint",),
    ),
    Row(
        "time the loop is blocked by an async save vs by a blocking save in the same loop",
        PAIRED,
        _async_blocked,
        "<= 0.05",
        ("checkpoint",),
    ),
    Row(
        "training time lost to an async save vs to a blocking save in the same loop",
        PAIRED,
        _async_lost,
        "<= 0.1",
        ("checkpoint",),
    ),
    Row(
        "training time lost to an async save vs to DCP's `async_save` in the same loop",
        PAIRED,
        _async_vs("dcp"),
        "<= 0.5",
        ("checkpoint",),
    ),
    Row(
        "the same vs DCP's `async_save` written by its checkpoint process "
        "(`async_checkpointer_type=AsyncCheckpointerType.PROCESS`; CPU: both processes)",
        PAIRED,
        _async_vs("dcp process"),
        "<= 0.5",
        ("checkpoint",),
    ),
    Row(
        "bytes read when resuming at 3 ranks vs the checkpoint",
        "measured",
        _bytes_read,
        "<= 1.05",
        ("checkpoint",),
    ),
    Row(
        "resume at 3 ranks vs at 2, replicated (every rank holds all: 3 processes on 2 cores)",
        PAIRED,
        _resume("replicated"),
        "<= 1.3",
        ("checkpoint",),
    ),
    Row(
        'resume at 3 ranks vs at 2, `shard="full"` (each rank holds 1/world)',
        PAIRED,
        _resume("full"),
        "wall <= 1.3, CPU <= 0.8",
        ("checkpoint",),
    ),
    Row(
        "host memory: blocking save / load / 5 async saves",
        "measured",
        _host_memory,
        "bounded",
        ("checkpoint",),
    ),
)
