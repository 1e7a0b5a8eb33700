"""bench_checkpoint.py (checkpoint.json): blocking and async saves, resuming at another world
size, host memory.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from report.results import Results
from report.stats import mib, paired, pairs_of, spread_text, verdict, wall_cpu
from report.table import PAIRED, Cell, Row


def _blocking_save(r: Results) -> Cell:
    p = paired(r, "checkpoint", "blocking: torchshard / safetensors")
    return f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}", verdict(p["wall"], 1.1)


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


def _bytes_read(r: Results) -> Cell:
    ratio = r["checkpoint"]["resume"]["read_ratio"]["3"]
    return f"{ratio:.3f}x", "met" if ratio <= 1.05 else "missed"


def _resume_3_vs_2(r: Results) -> Cell:
    p = paired(r, "checkpoint", "load: world 3 / world 2")
    return f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}", verdict(p["wall"], 1.3)


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
        "blocking save vs `safetensors.save_file` + fsync (1 GB)",
        PAIRED,
        _blocking_save,
        "<= 1.1",
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
        "bytes read when resuming at 3 ranks vs the checkpoint",
        "measured",
        _bytes_read,
        "<= 1.05",
        ("checkpoint",),
    ),
    Row(
        "resume at 3 ranks vs at 2 (3 processes on 2 cores)",
        PAIRED,
        _resume_3_vs_2,
        "<= 1.3",
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
