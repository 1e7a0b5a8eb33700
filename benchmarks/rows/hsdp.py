"""bench_hsdp.py (hsdp.json): hybrid sharding's 2 x 2 step at 4 ranks against the plain
sharded modes and FSDP2's HSDP, and the cross-node bytes it saves at 8 GPUs per node.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from typing import Any

from report.results import Results
from report.stats import paired, pairs_of, verdict, wall_cpu
from report.table import PAIRED, Cell, Failed, Row

FULL = '`shard="full"`'
OVERHEAD_TARGET = 1.15  # hsdp_full / ts_full
FSDP2_TARGET = 1.0  # hsdp_full / fsdp2_hsdp


def _ratio(r: Results, config: str, baseline: str) -> Any:
    """The paired step ratios ``config / baseline``; ``None`` where ``hsdp_full`` is not
    available (hybrid ``shard="full"`` not implemented when measured); a configuration that
    failed, or another that is not available, raises :class:`Failed`."""
    h = r["hsdp"]
    for name in (config, baseline):
        if name in h["errors"]:
            raise Failed(f"{name} failed (error in `hsdp.json`)")
    if config in h["unavailable"]:
        if config.startswith("hsdp_full"):
            return None
        raise Failed(f"{config} not available (`hsdp.json`)")
    return paired(r, "hsdp", f"{config}.step / {baseline}.step")


def _overhead(r: Results) -> Cell:
    shard = _ratio(r, "hsdp_shard", "ts_shard")
    full = _ratio(r, "hsdp_full", "ts_full")
    fsdp2 = _ratio(r, "fsdp2_hsdp", "fsdp2_full")
    parts = [f"`shard=True`: {wall_cpu(shard)}"]
    parts.append(f"{FULL}: " + ("not available when measured" if full is None else wall_cpu(full)))
    parts.append(f"FSDP2's HSDP vs its ZeRO-3 at 4 ranks: {wall_cpu(fsdp2)}")
    cell = "; ".join(parts) + f"; {pairs_of(shard, 'steps')}"
    return cell, "-" if full is None else f"{FULL}: {verdict(full['wall'], OVERHEAD_TARGET)}"


def _vs_fsdp2(r: Results) -> Cell:
    full = _ratio(r, "hsdp_full", "fsdp2_hsdp")
    shard = _ratio(r, "hsdp_shard", "fsdp2_hsdp_keep")
    head = "not available when measured" if full is None else wall_cpu(full)
    cell = (
        f"{FULL} vs its default: {head}; `shard=True` vs `reshard_after_forward=False`: "
        f"{wall_cpu(shard)}; {pairs_of(shard, 'steps')}"
    )
    return cell, "-" if full is None else verdict(full["wall"], FSDP2_TARGET)


def _cross_node(r: Results) -> Cell:
    c = r["hsdp"]["cross_node"]
    rows = c["rows"]
    parts = []
    for mode, label in (("full", FULL), ("sharded", "`shard=True`")):
        mine = [x for x in rows if x["mode"] == mode]
        worlds = sorted({x["world"] for x in mine})
        ratios = " / ".join(
            f"{next(x['ratio'] for x in mine if x['world'] == w):.2f}x" for w in worlds
        )
        parts.append(f"{label}: {ratios} at {' / '.join(map(str, worlds))} GPUs")
    big = max(rows, key=lambda x: (x["params"], x["world"], x["mode"] == "full"))
    parts.append(
        f"{big['model']} at {big['world']}, {FULL}: {big['hybrid'] / 1e9:.1f} GB vs "
        f"{big['plain'] / 1e9:.1f} GB per rank (on node-spanning rings a plain rank sends "
        f"{big['plain_spanning'] / 1e9:.0f} GB, 1 hop in {c['node']} of it across nodes)"
    )
    return "; ".join(parts), "-"


ROWS = (
    Row(
        "hybrid sharding 2 x 2 (`init_mesh(dp_replicate=2)`) step vs the same mode over 4 "
        'ranks: `shard=True` / `shard="full"` (one machine: the overhead, not the network '
        "gain)",
        PAIRED,
        _overhead,
        f'`shard="full"` <= {OVERHEAD_TARGET}',
        ("hsdp",),
    ),
    Row(
        "hybrid sharding step vs FSDP2's HSDP (`fully_shard` per block on a 2 x 2 `DeviceMesh`, "
        'gloo): `shard="full"` vs its default / `shard=True` vs `reshard_after_forward=False`',
        PAIRED,
        _vs_fsdp2,
        f'`shard="full"` <= {FSDP2_TARGET}',
        ("hsdp",),
    ),
    Row(
        "cross-node bytes per step per rank, hybrid (`dp_shard=8`, node-local) vs sharding "
        "over every rank, 8 GPUs per node, ring collectives, bf16",
        "computed",
        _cross_node,
        "-",
        ("hsdp",),
    ),
)
