"""Paired ratios: their median and spread, whether a target is met, and the cell texts built
from them. Stdlib only.

Each benchmark runs the compared configurations interleaved (step by step, or round by round
in rotation) and records one ratio per step or round, wall-clock and CPU time. A cell shows
the median of those ratios with their spread: p10-p90 from 10 ratios up, min-max below. A
target counts as met only when at least 80% of the paired ratios meet it, as missed when at
most 20% do; in between it says "unclear".
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

MOSTLY = Fraction(4, 5)  # a target is met when at least this share of the paired ratios meet it

Paired = dict[str, list[float]]  # "wall" (and "cpu"): one ratio per step or round


@dataclass(frozen=True)
class Spread:
    """The median of samples and their spread (p10-p90 from 10 samples, min-max below).

    >>> Spread.of([1.0, 3.0, 2.0])
    Spread(median=2.0, lo=1.0, hi=3.0, n=3)
    """

    median: float
    lo: float
    hi: float
    n: int

    @property
    def kind(self) -> str:
        return "p10-p90" if self.n >= 10 else "min-max"

    @classmethod
    def of(cls, xs: Sequence[float]) -> Spread:
        xs = list(xs)
        if not xs:
            raise ValueError("no samples")
        if len(xs) >= 10:
            q = statistics.quantiles(xs, n=10, method="inclusive")
            lo, hi = q[0], q[-1]
        else:
            lo, hi = min(xs), max(xs)
        return cls(statistics.median(xs), lo, hi, len(xs))


def spread_text(xs: Sequence[float], digits: int = 2, unit: str = "x") -> str:
    """``1.03x (p10-p90 0.95-1.12)``: the median and the spread of ``xs``.

    >>> spread_text([1.0, 3.0, 2.0])
    '2.00x (min-max 1.00-3.00)'
    """
    s = Spread.of(xs)
    f = f"{{:.{digits}f}}"
    return f"{f.format(s.median)}{unit} ({s.kind} {f.format(s.lo)}-{f.format(s.hi)})"


def verdict(xs: Sequence[float], target: float) -> str:
    """``met``/``missed``/``unclear`` and how many of the paired ratios ``xs`` are <= target.

    >>> verdict([0.9] * 8 + [1.5] * 2, 1.0)
    'met (8 of 10 <= 1)'
    """
    n, k = len(xs), sum(1 for x in xs if x <= target)
    share = Fraction(k, n)
    word = "met" if share >= MOSTLY else "missed" if share <= 1 - MOSTLY else "unclear"
    return f"{word} ({k} of {n} <= {target:g})"


def verdicts(parts: Sequence[tuple[str, Sequence[float], float]]) -> str:
    """``fp32: met (28 of 30 <= 1.3); bf16: ...``: one verdict per labelled set of ratios.

    >>> verdicts([("fp32", [0.5], 1.0), ("bf16", [2.0], 1.0)])
    'fp32: met (1 of 1 <= 1); bf16: missed (0 of 1 <= 1)'
    """
    return "; ".join(f"{label}: {verdict(xs, target)}" for label, xs, target in parts)


def paired(results: dict[str, Any], name: str, key: str) -> Paired:
    """The paired ratios ``key`` of the results file ``name``.

    >>> paired({"flat": {"paired": {"a / b": {"wall": [1.0]}}}}, "flat", "a / b")
    {'wall': [1.0]}
    """
    return results[name]["paired"][key]


def wall_cpu(p: Paired, digits: int = 2) -> str:
    """Wall-clock first, CPU time beside it.

    >>> wall_cpu({"wall": [1.0], "cpu": [2.0]})
    'wall 1.00x (min-max 1.00-1.00), CPU 2.00x (min-max 2.00-2.00)'
    """
    cell = f"wall {spread_text(p['wall'], digits)}"
    if p.get("cpu"):
        cell += f", CPU {spread_text(p['cpu'], digits)}"
    return cell


def pairs_of(p: Paired, what: str = "pairs") -> str:
    """How many paired ratios: ``30 steps``.

    >>> pairs_of({"wall": [1.0, 1.1]}, "steps")
    '2 steps'
    """
    return f"{len(p['wall'])} {what}"


def plural(n: int, what: str) -> str:
    """``1 round``, ``2 rounds``.

    >>> plural(2, "round")
    '2 rounds'
    """
    return f"{n} {what}" + ("" if n == 1 else "s")


def mib(n: float) -> str:
    """Bytes in MiB, one decimal.

    >>> mib(3 * 2**19)
    '1.5 MiB'
    """
    return f"{n / 2**20:.1f} MiB"


def gib(n: float, digits: int = 1) -> str:
    """Bytes in GiB.

    >>> gib(2**30)
    '1.0 GiB'
    """
    return f"{n / 2**30:.{digits}f} GiB"


# memory_bytes() fields held between steps (the fully sharded mode adds "transient")
PERSISTENT = ("parameters", "gradients", "optimizer", "master")
