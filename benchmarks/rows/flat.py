"""bench_flat.py (flat.json): wrapping a 7B GPT built on meta; `bind` against `copy_`.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from report.results import Results
from report.stats import paired, pairs_of, spread_text, wall_cpu
from report.table import PAIRED, Cell, Row


def _wrap_7b(r: Results) -> Cell:
    layout = r["flat"]["layout"]["7b"]
    rss_kib = layout["wrap_peak_rss_increase_bytes"] / 2**10
    ms = [1e3 * x for x in layout["wrap_s"]]
    cpu = [1e3 * x for x in layout["wrap_cpu_s"]]
    return (
        f"wall {spread_text(ms, 1, ' ms')}, CPU {spread_text(cpu, 1, ' ms')}; "
        f"+{rss_kib:.0f} KiB peak RSS",
        "-",
    )


def _bind_copy(r: Results) -> Cell:
    p = paired(r, "flat", "bind / copy_fresh")
    return f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}", "-"


ROWS = (
    Row("wrap a 7B GPT built on meta", "measured", _wrap_7b, "seconds, little memory", ("flat",)),
    Row(
        "`bind` copy of 125M fp32 weights vs `copy_` into fresh memory",
        PAIRED,
        _bind_copy,
        "-",
        ("flat",),
    ),
)
