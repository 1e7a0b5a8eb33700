"""benchmarks/bench_pipeline.py's arithmetic and its rows, on made-up samples (no processes):
the theory it holds the bubble to, the per-step verdicts, the interleaved-below-1F1B check."""

from __future__ import annotations

import importlib.util
import sys
from fractions import Fraction
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "benchmarks_summary", REPO / "benchmarks" / "summary.py"
)
assert spec is not None and spec.loader is not None
summary = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = summary
spec.loader.exec_module(summary)  # puts benchmarks/ on sys.path
import bench_pipeline  # noqa: E402


@pytest.mark.parametrize(
    ("schedule", "m", "expected"),
    [
        ("GPipe", 2, Fraction(1, 3)),
        ("1F1B", 4, Fraction(1, 5)),
        ("1F1B", 8, Fraction(1, 9)),
        ("Interleaved1F1B", 4, Fraction(1, 9)),  # (p-1)/(v*m+p-1), v=2
        ("LoopedBFS", 8, Fraction(1, 17)),
    ],
)
def test_theory_is_the_share_of_the_step(schedule: str, m: int, expected: Fraction) -> None:
    assert bench_pipeline.theory(schedule, m) == pytest.approx(float(expected))


def ranks(offset: dict[str, list[float]]) -> list[dict]:
    """Two ranks' samples: each config's bubble is theory + the offsets, on both ranks."""
    bubble = {}
    for key, offs in offset.items():
        s, m = key.split(" m=")
        bubble[key] = [bench_pipeline.theory(s, int(m)) + o for o in offs]
    rank = {"bubble": bubble, "step": {k: [1.0] * len(v) for k, v in bubble.items()}}
    return [{**rank, "errors": {}, "p2p_s": [1e-3] * 3} for _ in range(2)]


def test_a_config_is_met_when_most_steps_are_within_the_margin() -> None:
    out = bench_pipeline.summarize_bubble(
        ranks({"1F1B m=4": [0.04] * 8 + [0.2] * 2, "GPipe m=4": [0.06] * 10})
    )
    assert out["configs"]["1F1B m=4"]["verdict"] == "met (8 of 10 <= 0.05)"
    assert out["configs"]["GPipe m=4"]["verdict"] == "missed (0 of 10 <= 0.05)"


def test_interleaved_is_compared_with_1f1b_at_the_same_m() -> None:
    out = bench_pipeline.summarize_bubble(
        ranks({"1F1B m=2": [0.0] * 5, "Interleaved1F1B m=2": [0.0] * 5, "LoopedBFS m=2": [0.2] * 5})
    )
    below = out["below_1f1b"]
    assert below["Interleaved1F1B m=2"]["verdict"] == "met (5 of 5 <= 1)"  # 0.2 vs 1/3
    assert below["LoopedBFS m=2"]["verdict"] == "missed (0 of 5 <= 1)"  # 0.4 vs 1/3


def test_the_rows_read_the_summary() -> None:
    bubble = bench_pipeline.summarize_bubble(
        ranks({"1F1B m=2": [0.01] * 10, "Interleaved1F1B m=2": [0.01] * 10})
    )
    ratio = {"wall": [1.0] * 10, "cpu": [1.0] * 10}
    part = {"oversubscribed": False, "world": 2, "loss_diff": {"ts": 0.0, "ts_shard": 0.0}}
    paired = {k: ratio for k, _ in bench_pipeline.CHECKS} | {"ts_repl.step / fsdp2_pp.step": ratio}
    results = {
        "pipeline": {
            "bubble": bubble,
            "paired": paired,
            "cores": 2,
            "parts": {"pp2": part, "pp2dp2": part},
        }
    }
    cells = [summary.measured(r, results) for r in summary.ROWS if "pipeline" in r.needs]
    assert len(cells) == 4
    assert cells[0] == (
        "1F1B m=2: 0.34 / 0.34 (theory 0.33) (rank 0 / rank 1, median of 10 steps)",
        "1F1B m=2: met (10 of 10 <= 0.05)",
    )
    assert cells[1][1].endswith("Interleaved1F1B m=2 vs 1F1B: met (10 of 10 <= 1)")
    assert cells[2][1] == "met (10 of 10 <= 1.05)"
    assert cells[3][1] == "`shard=True`: met (10 of 10 <= 1)"
