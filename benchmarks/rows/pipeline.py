"""bench_pipeline.py (pipeline.json): ``torchshard.Pipeline``'s bubble per rank against
theory at pp=2, its step against torch's pipelining driven by hand, and pp2 x dp2 against
torchtitan's FSDP2-per-stage pipeline.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from report.results import Results
from report.stats import paired, pairs_of, verdict, wall_cpu
from report.table import PAIRED, Cell, Row

HAND_TARGET = 1.05  # ts / torch by hand
FSDP2_TARGET = 1.0  # ts_shard / fsdp2_pp


def _bubble(r: Results, schedules: tuple[str, ...]) -> tuple[str, str]:
    """Per schedule and m: each rank's median bubble beside theory; one verdict per config."""
    b = r["pipeline"]["bubble"]["configs"]
    cells, words = [], []
    for key, c in b.items():
        if c["schedule"] not in schedules:
            continue
        meds = [sorted(x)[len(x) // 2] for x in c["by_rank"]]
        cells.append(f"{key}: {' / '.join(f'{v:.2f}' for v in meds)} (theory {c['theory']:.2f})")
        words.append(f"{key}: {c['verdict']}")
    if not cells:
        raise KeyError(schedules)
    n = len(next(iter(b.values()))["max_dev"])
    return "; ".join(cells) + f" (rank 0 / rank 1, median of {n} steps)", "; ".join(words)


def _single(r: Results) -> Cell:
    return _bubble(r, ("GPipe", "1F1B"))


def _interleaved(r: Results) -> Cell:
    cell, word = _bubble(r, ("Interleaved1F1B", "LoopedBFS"))
    below = r["pipeline"]["bubble"]["below_1f1b"]
    vs = "; ".join(f"{k} vs 1F1B: {v['verdict']}" for k, v in below.items())
    return cell, f"{word}; below 1F1B at the same m, per step: {vs}"


def _oversubscribed(r: Results, part: str, word: str) -> str:
    p = r["pipeline"]["parts"][part]
    if p["oversubscribed"] and not word.startswith("met"):
        return f"; {p['world']} processes on {r['pipeline']['cores']} cores (oversubscribed)"
    return ""


def _vs_hand(r: Results) -> Cell:
    p = paired(r, "pipeline", "ts.step / torch.step")
    diff = r["pipeline"]["parts"]["pp2"]["loss_diff"]["ts"]
    cell = f"{wall_cpu(p)}; {pairs_of(p, 'steps')}; max abs loss difference {diff:.1e}"
    word = verdict(p["wall"], HAND_TARGET)
    return cell, word + _oversubscribed(r, "pp2", word)


def _vs_fsdp2(r: Results) -> Cell:
    shard = paired(r, "pipeline", "ts_shard.step / fsdp2_pp.step")
    repl = paired(r, "pipeline", "ts_repl.step / fsdp2_pp.step")
    diff = max(r["pipeline"]["parts"]["pp2dp2"]["loss_diff"].values())
    cell = (
        f"`shard=True`: {wall_cpu(shard)}; replicated: {wall_cpu(repl)}; "
        f"{pairs_of(shard, 'steps')}; max abs loss difference {diff:.1e}"
    )
    word = verdict(shard["wall"], FSDP2_TARGET)
    return cell, f"`shard=True`: {word}" + _oversubscribed(r, "pp2dp2", word)


ROWS = (
    Row(
        "pipeline bubble per rank (1 - time in the stages' forward and backward / step), pp=2, "
        "GPipe and 1F1B at m = 2, 4, 8 microbatches, vs theory (p-1)/(m+p-1)",
        "measured",
        _single,
        "within 0.05 of theory",
        ("pipeline",),
    ),
    Row(
        "the same, Interleaved1F1B and LoopedBFS with 2 stages per rank (the same work per "
        "rank), vs theory (p-1)/(v*m+p-1) and vs 1F1B's bubble at the same m",
        "measured, paired",
        _interleaved,
        "within 0.05 of theory; below 1F1B",
        ("pipeline",),
    ),
    Row(
        "pipeline step (pp=2, 1F1B, m=8, 2 ranks) vs torch's pipelining by hand on the same "
        "stages (plain modules, `PipelineStage`, `Schedule1F1B`, AdamW)",
        PAIRED,
        _vs_hand,
        f"<= {HAND_TARGET}",
        ("pipeline",),
    ),
    Row(
        "pipeline step pp2 x dp2 (4 ranks, 1F1B, m=8) vs torchtitan's FSDP2 pipeline "
        "(`fully_shard` per block and stage over the dp dimension, "
        "`reshard_after_forward=False`, `PipelineStage`): `shard=True` / replicated",
        PAIRED,
        _vs_fsdp2,
        f"`shard=True` <= {FSDP2_TARGET}",
        ("pipeline",),
    ),
)
