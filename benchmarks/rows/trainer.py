"""bench_trainer.py (trainer.json): `average_gradients()` and the training step against DDP,
host syncs, gradient storage.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from report.results import Results
from report.stats import mib, paired, pairs_of, verdict, wall_cpu
from report.table import PAIRED, Cell, Row


def _average_gradients(r: Results) -> Cell:
    p = paired(r, "trainer", "ts_25mb.avg_no_sync / raw_all_reduce")
    return f"{wall_cpu(p)}; {pairs_of(p, 'repetitions')}", verdict(p["wall"], 1.05)


def _training_step(bucket: str) -> Callable[[Results], Cell]:
    def cell(r: Results) -> Cell:
        p = paired(r, "trainer", f"ts_{bucket}.step / ddp_{bucket}.step")
        return f"{wall_cpu(p)}; {pairs_of(p, 'steps')}", verdict(p["wall"], 1.0)

    return cell


def _host_syncs(r: Results) -> Cell:
    h = r["trainer"]["host_reads"]
    per = {
        name: max(sum(rank[name].values()) for rank in h["by_rank"]) / h["steps"]
        for name in ("ts_replicated", "ts_sharded", "ddp")
    }
    sees = all(sum(rank["control_item"].values()) >= 1 for rank in h["by_rank"])
    cell = (
        f"{per['ts_replicated']:g} (replicated) / {per['ts_sharded']:g} (sharded); "
        f"DDP {per['ddp']:g}; max over ranks, {h['steps']} steps; the counter sees a "
        f"`.item()`: {'yes' if sees else 'NO'}"
    )
    ok = per["ts_replicated"] <= per["ddp"] and per["ts_sharded"] <= per["ddp"]
    return cell, "met" if ok and per["ddp"] == 0 and sees else "missed"


def _gradient_storage(r: Results) -> Cell:
    mem, model = r["trainer"]["memory_bytes"], r["trainer"]["memory_model"]
    held = {k: v["held_bytes_max_over_ranks"] for k, v in mem.items()}
    analytic = {k: v["ranks"][0]["grad_storage_analytic"] for k, v in mem.items()}
    ts, ddp, view, plain = (held[k] for k in ("ts_25mb", "ddp_25mb", "ddp_bucket_view", "plain"))
    cell = (
        f"{ts / ddp:.2f}x ({mib(ts)} vs {mib(ddp)}; DDP `gradient_as_bucket_view` {mib(view)}, "
        f"the plain model without communication {mib(plain)}): RSS held after a step beyond "
        f"the weights of {model['layers']} x Linear({model['width']}, {model['width']}), "
        f"{mib(analytic['ts_25mb'])} of fp32 gradients; "
        f"analytic {analytic['ts_25mb'] / analytic['ddp_25mb']:.2g}x"
    )
    return cell, "met" if ts < ddp else "missed"


ROWS = (
    Row(
        "`average_gradients()` vs one raw `all_reduce` of the same bytes (2 ranks)",
        PAIRED,
        _average_gradients,
        "<= 1.05",
        ("trainer",),
    ),
    Row(
        "training step vs DDP, 25 MiB buckets (both)",
        PAIRED,
        _training_step("25mb"),
        "<= 1.0",
        ("trainer",),
    ),
    Row(
        "training step vs DDP, 1 MiB buckets (both: `DDP(bucket_cap_mb=1)`)",
        PAIRED,
        _training_step("1mb"),
        "<= 1.0",
        ("trainer",),
    ),
    Row(
        "host syncs per training step, every parameter used (SGD)",
        "counted",
        _host_syncs,
        "0, as DDP without `find_unused_parameters`",
        ("trainer",),
    ),
    Row(
        "gradient storage vs DDP's default",
        "measured",
        _gradient_storage,
        "below DDP",
        ("trainer",),
    ),
)
