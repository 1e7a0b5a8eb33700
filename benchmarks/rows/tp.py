"""bench_tp.py (tp.json): tensor parallelism against the peer on torch's distributed-test
``Transformer``: TP=2 against DTensor TP, dp2 x tp2 against torchtitan's FSDP2 + TP, and the
data-parallel bytes per step against the unsplit model's flat buffer.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from report.results import Results
from report.stats import mib, paired, pairs_of, verdict, wall_cpu
from report.table import PAIRED, Cell, Row

TARGET = 1.0  # ts_tp / dtensor_tp and ts_full / fsdp2_tp
FULL = '`shard="full"`'


def _oversubscribed(r: Results, part: str, word: str) -> str:
    """Where more ranks than cores ran and the verdict is not "met": say so."""
    p = r["tp"]["parts"][part]
    if p["oversubscribed"] and not word.startswith("met"):
        return f"; {p['world']} processes on {r['tp']['cores']} cores (oversubscribed)"
    return ""


def _vs_dtensor(r: Results) -> Cell:
    p = paired(r, "tp", "ts_tp.step / dtensor_tp.step")
    diff = r["tp"]["parts"]["tp2"]["loss_diff"]["ts_tp"]
    cell = f"{wall_cpu(p)}; {pairs_of(p, 'steps')}; max abs loss difference {diff:.1e}"
    word = verdict(p["wall"], TARGET)
    return cell, word + _oversubscribed(r, "tp2", word)


def _vs_fsdp2_tp(r: Results) -> Cell:
    parts = []
    for label, name in ((FULL, "ts_full"), ("replicated", "ts_repl"), ("`shard=True`", "ts_shard")):
        parts.append(f"{label}: {wall_cpu(paired(r, 'tp', f'{name}.step / fsdp2_tp.step'))}")
    full = paired(r, "tp", "ts_full.step / fsdp2_tp.step")
    diff = max(r["tp"]["parts"]["dp2tp2"]["loss_diff"].values())
    cell = "; ".join(parts) + f"; {pairs_of(full, 'steps')}; max abs loss difference {diff:.1e}"
    word = verdict(full["wall"], TARGET)
    return cell, f"{FULL}: {word}" + _oversubscribed(r, "dp2tp2", word)


def _bytes(r: Results) -> Cell:
    b = r["tp"]["parts"]["dp2tp2"]["bytes"]
    whole, local = b["ts_repl"]["whole"], b["ts_repl"]["local"]

    def worst(name: str, key: str) -> float:
        return max(c[key] for c in b[name]["by_rank"])

    cell = (
        f"replicated: {mib(worst('ts_repl', 'reduced'))} all-reduced per rank, "
        f"{worst('ts_repl', 'reduced') / whole:.3f}x the unsplit model's flat buffer "
        f"({mib(whole)}), its local flat buffer {mib(local)}; `shard=True`: reduced "
        f"{mib(worst('ts_shard', 'reduced'))}, gathered {mib(worst('ts_shard', 'gathered'))}; "
        f"{FULL}: reduced {mib(worst('ts_full', 'reduced'))}, gathered "
        f"{mib(worst('ts_full', 'gathered'))} (forward and backward)"
    )
    return cell, "met" if r["tp"]["bytes_equal_local"] else "missed"


ROWS = (
    Row(
        "TP=2 step vs DTensor TP (torch's test `Transformer` through its own `parallelize`: "
        "`ColwiseParallel` / `RowwiseParallel`), 2 ranks, fp32",
        PAIRED,
        _vs_dtensor,
        f"<= {TARGET}",
        ("tp",),
    ),
    Row(
        f"dp2 x tp2 step (4 ranks) vs torchtitan's composition (DTensor TP, then FSDP2 "
        f"`fully_shard` per block over the dp dimension of a 2-D `DeviceMesh`): {FULL} / "
        "replicated / `shard=True`, the same model",
        PAIRED,
        _vs_fsdp2_tp,
        f"{FULL} <= {TARGET}",
        ("tp",),
    ),
    Row(
        "data-parallel bytes per step per rank at dp2 x tp2 vs the unsplit model's flat buffer",
        "counted (`trainer.stats`)",
        _bytes,
        "replicated: = the local flat buffer's",
        ("tp",),
    ),
)
