"""bench_full.py (full.json): peak RSS of the fully sharded mode at 4 ranks; gloo collectives
for one unit.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from report.results import Results
from report.stats import PERSISTENT, mib, plural, spread_text, verdict, verdicts, wall_cpu
from report.table import PAIRED, Cell, Row

ALLOCATOR_LABELS = {"glibc": "glibc", "mmap_128k": "`MALLOC_MMAP_THRESHOLD_=131072`"}


def _full_memory(r: Results) -> Cell:
    mem = r["full"]["memory"]
    parts, checks = [], []
    for alloc, m in mem["by_allocator"].items():
        label = ALLOCATOR_LABELS.get(alloc, alloc)
        xs = m["paired"]["full / replicated"]
        growth = {k: mib(statistics.median(v)) for k, v in m["max_growth_by_round"].items()}
        part = f"{label}: {spread_text(xs)}, growth {growth['full']} vs {growth['replicated']}"
        if "fsdp2 / replicated" in m["paired"]:
            part += f" (FSDP2 ZeRO-3: {spread_text(m['paired']['fsdp2 / replicated'])})"
        parts.append(part)
        checks.append((label, xs, mem["target"]))
    first = mem["by_allocator"]["glibc"]["rounds"][0]
    held = {
        k: sum(first[k]["ranks"][0]["memory_bytes"][f] for f in PERSISTENT)
        for k in ("full", "replicated")
    }
    rounds = plural(len(checks[0][1]), "round")
    return (
        "; ".join(parts) + f"; per round the max over ranks, {rounds} of fresh launches; "
        f"`memory_bytes()` {mib(held['full'])} vs {mib(held['replicated'])}",
        verdicts(checks),
    )


def _gloo_unit(unit: str) -> Callable[[Results], Cell]:
    def cell(r: Results) -> Cell:
        worlds = r["full"]["collectives"]["by_world"]
        parts, faster, n = [], [], 0
        for world, w in worlds.items():
            p = w["units"][unit]["paired"]["both"]
            n = len(p["wall"])
            parts.append(f"{world} ranks: {wall_cpu(p)}")
            word = verdict(p["wall"], 1.0).split()[0]  # met: owner <= native in 80%
            winner = {"met": "owner", "missed": "native"}.get(word, "unclear")
            k = sum(1 for x in p["wall"] if x <= 1)
            faster.append(f"{world}: {winner} ({k} of {n} owner <= native)")
        return "; ".join(parts) + f"; {n} repetitions", "; ".join(faster)

    return cell


ROWS = (
    Row(
        "peak RSS growth per rank, fully sharded vs replicated, 4 ranks, 34.9M-parameter GPT "
        "(fp32, AdamW), built on meta",
        "measured, paired (fresh launches)",
        _full_memory,
        "<= 0.5",
        ("full",),
    ),
    Row(
        "gloo: gather + reduce-scatter of a GPT-2 small block (7.1M fp32), one `broadcast` / "
        "`reduce` per owner vs `all_gather_single` / `reduce_scatter_single`",
        PAIRED,
        _gloo_unit("gpt2_block"),
        "the faster: the one that wins >= 80% of the pairs",
        ("full",),
    ),
    Row(
        "gloo: the same for a block of the benchmark GPT (198K fp32)",
        PAIRED,
        _gloo_unit("small_block"),
        "the faster (as above)",
        ("full",),
    ),
)
