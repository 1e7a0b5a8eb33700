"""bench_sharded.py (sharded.json): the sharded and fully sharded steps against DDP and FSDP2,
optimizer state, bytes communicated, `memory_bytes()` against `plan_memory()`.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from report.results import Results
from report.stats import PERSISTENT, mib, paired, pairs_of, verdict, verdicts, wall_cpu
from report.table import PAIRED, Cell, Failed, Row


def _sharded(r: Results, name: str) -> dict[str, Any]:
    summary = r["sharded"]["summary"][name]
    if "error" in summary:
        raise Failed(f"{name} failed (error in `sharded.json`)")
    return summary


def _optimizer_state(r: Results) -> Cell:
    fracs = [_sharded(r, n)["opt_state_vs_repl"] for n in ("ts_shard", "ts_shard_bf16")]
    fp32, bf16 = (f"{x:.3f}x" for x in fracs)
    cell = f"{fp32} (fp32 and bf16)" if fp32 == bf16 else f"{fp32} / {bf16} (fp32 / bf16)"
    return f"{cell}: optimizer state tensor bytes", "met" if max(fracs) <= 0.55 else "missed"


def _sharded_vs(*pairs: tuple[str, str, str]) -> Callable[[Results], Cell]:
    """Paired step ratios of ``(config, baseline, label)`` from sharded.json."""

    def cell(r: Results) -> Cell:
        parts, n = [], 0
        for config, baseline, label in pairs:
            for name in (config, baseline):
                _sharded(r, name)  # raises Failed for a configuration that failed
            p = paired(r, "sharded", f"{config}.step / {baseline}.step")
            n = len(p["wall"])
            parts.append(f"{label}: {wall_cpu(p)}")
        return "; ".join(parts) + f"; {n} steps", "-"

    return cell


BYTES_TOLERANCE = 0.01  # measured bytes per step over the analytic ratio


def _full_vs_fsdp2(r: Results) -> Cell:
    for name in ("ts_full", "fsdp2_zero3"):
        _sharded(r, name)
    p = paired(r, "sharded", "ts_full.step / fsdp2_zero3.step")
    return f"{wall_cpu(p)}; {pairs_of(p, 'steps')}", verdict(p["wall"], 1.0)


FULL_VS_SHARD = (("fp32", "ts_full", "ts_shard"), ("bf16", "ts_full_bf16", "ts_shard_bf16"))


def _full_vs_shard(r: Results) -> Cell:
    parts, checks = [], []
    for label, full, base in FULL_VS_SHARD:
        for name in (full, base):
            _sharded(r, name)
        p = paired(r, "sharded", f"{full}.step / {base}.step")
        parts.append(f"{label}: {wall_cpu(p)}")
        checks.append((label, p["wall"], 1.3))
    return "; ".join(parts) + f"; {len(checks[0][1])} steps", verdicts(checks)


def _full_bytes(r: Results) -> Cell:
    ratios, comm = r["sharded"]["bytes_ratio"], r["sharded"]["comm_bytes"]
    fp32, bf16 = ratios["ts_full / ts_repl"], ratios["ts_full_bf16 / ts_shard_bf16"]
    full, repl, shard = (comm[k] for k in ("ts_full", "ts_repl", "ts_shard"))
    cell = (
        f"{fp32['measured']:.4f}x, analytic {fp32['analytic']:.4f}x "
        f"({fp32['kept_elements']:,} of {fp32['all_elements']:,} elements in units kept "
        f"gathered for the step); per step: fully sharded {mib(full['zero_bytes'])} "
        f"(gathered {mib(full['bytes_gathered'])}, reduce-scattered "
        f"{mib(full['bytes_reduced'])}), replicated {mib(repl['zero_bytes'])} "
        f"({mib(repl['bytes_reduced'])} all-reduced), `shard=True` {mib(shard['zero_bytes'])}; "
        f"bf16 vs `shard=True` bf16: {bf16['measured']:.4f}x (analytic {bf16['analytic']:.4f}x)"
    )
    close = all(abs(x["measured"] / x["analytic"] - 1) <= BYTES_TOLERANCE for x in (fp32, bf16))
    ok = close and all(c["constant"] for c in comm.values())  # the same every step and rank
    return cell, "met" if ok else "missed"


def _full_plan(r: Results) -> Cell:
    checks = r["sharded"]["full_memory"]
    parts, ok = [], True
    for label, name in (("fp32", "ts_full"), ("bf16", "ts_full_bf16")):
        ranks = checks[name]
        equal = all(c["persistent_equal"] for c in ranks)
        within = all(c["transient_within_plan"] for c in ranks)
        ok = ok and equal and within
        peak = max(c["peak_transient"] for c in ranks)
        bound = max(c["plan_transient"] for c in ranks)
        parts.append(
            f"{label}: persistent {'equal' if equal else 'DIFFERENT'} on every rank "
            f"({mib(sum(ranks[0]['memory_bytes'][k] for k in PERSISTENT))}), "
            f"peak unit buffers {mib(peak)} vs `transient` {mib(bound)}"
        )
    return "; ".join(parts), "met" if ok else "missed"


ROWS = (
    Row(
        "sharded optimizer state per rank vs replicated, 2 ranks",
        "measured",
        _optimizer_state,
        "<= 0.55",
        ("sharded",),
    ),
    Row(
        "sharded step (`shard=True`) vs DDP: fp32 / bf16 with an fp32 master",
        PAIRED,
        _sharded_vs(("ts_shard", "ddp", "fp32"), ("ts_shard_bf16", "ddp", "bf16")),
        "-",
        ("sharded",),
    ),
    Row(
        "sharded step vs FSDP2: `fully_shard(reshard_after_forward=False)` (the same memory "
        "class) / its default (ZeRO-3)",
        PAIRED,
        _sharded_vs(
            ("ts_shard", "fsdp2_keep", "vs `reshard_after_forward=False`"),
            ("ts_shard", "fsdp2_zero3", "vs ZeRO-3"),
        ),
        "-",
        ("sharded",),
    ),
    Row(
        'fully sharded step (`shard="full"`, a unit per block) vs FSDP2 `fully_shard` per '
        "block (ZeRO-3), 2 ranks",
        PAIRED,
        _full_vs_fsdp2,
        "<= 1.0",
        ("sharded",),
    ),
    Row(
        "fully sharded step vs `shard=True`: fp32 / bf16 with an fp32 master",
        PAIRED,
        _full_vs_shard,
        "<= 1.3",
        ("sharded",),
    ),
    Row(
        "bytes communicated per step, fully sharded vs replicated (ZeRO accounting: all-reduce "
        "2x its buffer, reduce-scatter and all-gather 1x), 2 ranks",
        "counted (`trainer.stats`)",
        _full_bytes,
        "= analytic within 1% (1.5x in the ZeRO paper, less the kept root units)",
        ("sharded",),
    ),
    Row(
        'fully sharded `memory_bytes()` vs `plan_memory(shard="full")`, 2 ranks',
        "measured (tensor bytes) vs computed",
        _full_plan,
        "persistent equal; peak unit buffers <= `transient`",
        ("sharded",),
    ),
)
