"""bench_comm.py (comm.json) and bench_convergence.py (convergence.json): gradient compression
and star aggregation (issue 24): bytes per step, the step against the dense all-reduce, the
step on a link (computed), Star against the ring, and the example's final loss.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from report.results import Results
from report.stats import mib, pairs_of, verdicts, wall_cpu
from report.table import PAIRED, Cell, Failed, Row

BF16_TARGET = 0.5  # payload / dense
BF16_TOLERANCE = 0.01  # relative
POWERSGD_TARGET = 15.0  # dense / payload, at least
COMPRESSED = ("bf16", "powersgd", "topk", "star")  # the step-time rows, in this order
NAMES = {
    "dense": "`AllReduce()`",
    "bf16": "`BF16()`",
    "fp16": "`FP16()`",
    "powersgd": "`PowerSGD(rank=4)`",
    "topk": "`TopK(0.01)`",
    "star": "`Star(root=0)`",
}
LINKS = (1, 10, 100)  # Gbit/s, of the computed row
LOSS_TARGETS = (("bf16", "BF16", 0.5), ("powersgd", "PowerSGD", 2.0), ("topk", "TopK", 3.0))


def kib(n: float) -> str:
    """Bytes in KiB, one decimal.

    >>> kib(1536)
    '1.5 KiB'
    """
    return f"{n / 1024:.1f} KiB"


def _world(r: Results, world: int, *names: str) -> dict[str, Any]:
    """comm.json's launch at ``world`` ranks; :class:`Failed` where one of ``names`` failed."""
    w = r["comm"]["worlds"][str(world)]
    for name in names:
        if name in w["errors"]:
            raise Failed(f"{NAMES[name]} failed at {world} ranks (error in `comm.json`)")
    return w


def _bytes(r: Results, world: int, name: str) -> list[dict[str, Any]]:
    """Per rank: the median step's payload, dense, TCP sent and received bytes."""
    return _world(r, world, name)["bytes"][name]


def _payload(r: Results, name: str) -> tuple[float, float, bool]:
    """At 2 ranks: the most payload a rank handed to collectives per step, the dense
    equivalent, and whether every rank and step moved the same."""
    ranks = _bytes(r, 2, name)
    same = all(b["constant"] for b in ranks) and len({b["payload"] for b in ranks}) == 1
    return max(b["payload"] for b in ranks), max(b["dense"] for b in ranks), same


def _bytes_cell(r: Results) -> Cell:
    c = r["comm"]
    dense = _payload(r, "dense")[1]
    bf16, _, bf16_same = _payload(r, "bf16")
    fp16 = _payload(r, "fp16")[0]
    psgd, _, psgd_same = _payload(r, "powersgd")
    topk, _, topk_same = _payload(r, "topk")
    steps, start = c["example_steps"], c["example_start_step"]
    run = (start * dense + (steps - start) * psgd) / steps  # the example's run: dense first
    received = [max(b["received"] for b in _bytes(r, w, "topk")) for w in (2, 4)]
    ring = [max(b["received"] for b in _bytes(r, w, "dense")) for w in (2, 4)]
    differ = [n for n, same in (("BF16", bf16_same), ("PowerSGD", psgd_same),
                                ("TopK", topk_same)) if not same]  # fmt: skip
    cell = (
        f"dense {mib(dense)}; BF16 {bf16 / dense:.3f}x ({mib(bf16)}), FP16 {fp16 / dense:.3f}x; "
        f"PowerSGD {dense / psgd:.1f}x less ({kib(psgd)}; over the example's {steps} steps, "
        f"dense for the first {start}: {dense / run:.1f}x less); TopK {topk / dense:.3f}x "
        f"({kib(topk)}: every rank's values and indices, all-gathered); on its sockets a "
        f"rank receives with TopK {kib(received[0])} at 2 ranks and {kib(received[1])} at 4, "
        f"with the ring all-reduce {mib(ring[0])} and {mib(ring[1])}"
    )
    if differ:
        cell += f"; not the same on every rank and step: {', '.join(differ)}"
    ok_bf16 = abs(bf16 / dense - BF16_TARGET) <= BF16_TOLERANCE * BF16_TARGET
    ok_psgd = dense / psgd >= POWERSGD_TARGET
    word = {True: "met", False: "missed"}
    return cell, f"BF16: {word[ok_bf16]}; PowerSGD: {word[ok_psgd]}"


def _step_cell(world: int) -> Any:
    def cell(r: Results) -> Cell:
        w = _world(r, world, "dense")
        parts, ran = [], []
        for name in COMPRESSED:
            if name in w["errors"]:
                parts.append(f"{NAMES[name]}: failed")
            elif f"{name}.step / dense.step" in w["paired"]:
                ran.append(w["paired"][f"{name}.step / dense.step"])
                parts.append(f"{NAMES[name]}: {wall_cpu(ran[-1])}")
        if not ran:
            raise Failed(f"no comm ran at {world} ranks (errors in `comm.json`)")
        return "; ".join(parts) + f"; {pairs_of(ran[0], 'steps')}", "-"

    return cell


def _link_cell(r: Results) -> Cell:
    rows = r["comm"]["computed"]
    parts = []
    for gbit in LINKS:
        by_world = []
        for world in (2, 4):
            mine = {x["comm"]: x for x in rows if x["gbit"] == gbit and x["world"] == world}
            ratios = ", ".join(
                f"{NAMES[n].strip('`').split('(')[0]} {mine[n]['vs_dense']:.2f}x"
                for n in COMPRESSED
                if n in mine
            )
            dense = mine["dense"]
            by_world.append(
                f"{world} ranks {ratios} (dense {1e3 * dense['step_s']:.1f} ms, of which "
                f"{1e3 * (dense['step_s'] - dense['compute_s']):.1f} ms on the link)"
            )
        parts.append(f"{gbit} Gbit/s: " + "; ".join(by_world))
    return "; ".join(parts), "-"


def _star_cell(r: Results) -> Cell:
    star = sorted(r["comm"]["star"], key=lambda s: s["world"])
    if not star:
        raise Failed("Star or the ring did not run (errors in `comm.json`)")
    worlds = " / ".join(str(s["world"]) for s in star)

    def each(key: str) -> str:
        return " / ".join(f"{s[key]:.2f}" for s in star)

    times = []
    for s in star:
        p = _world(r, s["world"], "star", "dense")["paired"]["star.step / dense.step"]
        times.append(f"{s['world']}: {wall_cpu(p)}")
    cell = (
        f"at {worlds} ranks, in gradient buffers per step (TCP counters): the root sends "
        f"{each('root_sent')} and receives {each('root_received')}; the other ranks send at "
        f"most {each('other_sent')}; a ring rank sends {each('ring_sent')} and receives "
        f"{each('ring_received')} (a parameter server's root: {each('server')} each way); "
        f"step vs ring, {'; '.join(times)}"
    )
    return cell, root_grows(star)


def root_grows(star: list[dict[str, Any]]) -> str:
    """``met`` when the root's bytes (sent + received) grow with every added rank.

    >>> root_grows([{"world": 2, "root_sent": 1.5, "root_received": 1.0},
    ...             {"world": 3, "root_sent": 2.7, "root_received": 1.3}])
    'met (2.50 < 4.00)'
    """
    total = [s["root_sent"] + s["root_received"] for s in sorted(star, key=lambda s: s["world"])]
    grows = len(total) >= 2 and all(a < b for a, b in pairwise(total))
    return f"{'met' if grows else 'missed'} ({' < '.join(f'{t:.2f}' for t in total)})"


def _signed(xs: list[float]) -> str:
    """``+0.12% (-0.05 to +0.30)``: the mean of ``xs`` (percent) and their range."""
    mean = sum(xs) / len(xs)
    return f"{mean:+.2f}% ({min(xs):+.2f} to {max(xs):+.2f})"


def _vs_dense(cmp: dict, name: str) -> str:
    """``name``'s final loss against the dense run of each seed: mean and range."""
    return _signed(list(cmp["vs_dense"][name].values()))


def _all_ran(runs: dict, what: str) -> None:
    """Raise Failed naming each run (comm and seed) that has no final loss."""
    failed = [
        f"{n} seed {s}" for n, by in runs.items() for s, x in by.items() if "val_loss" not in x
    ]
    if failed:
        raise Failed(f"{what} failed: {', '.join(failed)} (errors in `convergence.json`)")


def _convergence_cell(r: Results) -> Cell:
    c = r["convergence"]
    cmp, seeds = c["compare"], c["seeds"]
    _all_ran(c["runs"], "runs")
    parts, checks = [], []
    for name, label, target in LOSS_TARGETS:
        xs = list(cmp["vs_dense"][name].values())
        parts.append(f"{label} {_signed(xs)}")
        checks.append((label, xs, target))
    ef = list(cmp["ef_vs_noef"].values())
    parts[-1] += f", without error feedback {_vs_dense(cmp, 'topk_noef')}"
    checks.append(("TopK below no error feedback", ef, 0.0))
    dense = [run["val_loss"] for run in c["runs"]["dense"].values()]
    control = len(c.get("control", {}).get("runs", {}))  # the time below covers its runs too
    cell = (
        f"vs dense, the mean over seeds {', '.join(seeds)} (range): {'; '.join(parts)}; dense "
        f"{min(dense):.4f} to {max(dense):.4f} (spread {cmp['dense_spread']:.2f}%); "
        f"{len(dense)} seeds x {len(c['runs'])} comms"
        + (f" (and x {control} for the control below)" if control else "")
        + f", {c['total_s'] / 60:.0f} min in all"
    )
    return cell, verdicts(checks)


UNTARGETED = (  # no targets: what a higher rank, and a longer dense start, buy
    ("powersgd8", "PowerSGD(rank=8)"),
    ("powersgd16", "PowerSGD(rank=16)"),
    ("powersgd30", "PowerSGD(rank=4, start_step=30)"),
    ("topk30", "TopK(0.01, start_step=30)"),
    ("topk_noef30", "without error feedback"),
)


def _untargeted_cell(r: Results) -> Cell:
    cmp = r["convergence"]["compare"]
    parts = [f"{label} {_vs_dense(cmp, n)}" for n, label in UNTARGETED if n in cmp["vs_dense"]]
    if not parts:
        raise Failed("no runs without targets in `convergence.json`; rerun bench_convergence.py")
    ef = list(cmp.get("ef_vs_noef30", {}).values())
    if ef:  # error feedback against none, both dense for 30 steps: the sign by seed
        below = sum(x < 0 for x in ef)
        parts.append(f"error feedback below none on {below} of {len(ef)} seeds ({_signed(ef)})")
    return f"vs dense, the mean over seeds (range): {'; '.join(parts)}", "-"


def _control_cell(r: Results) -> Cell:
    c = r["convergence"].get("control")
    if c is None:
        raise Failed(
            "no control runs in `convergence.json` (run with --control ''); rerun "
            "python benchmarks/bench_convergence.py"
        )
    cmp = c["compare"]
    _all_ran(c["runs"], "control runs")
    sgd, adamw = ([x["val_loss"] for x in runs["dense"].values()]
                  for runs in (c["runs"], r["convergence"]["runs"]))  # fmt: skip
    labels = (
        ("powersgd", "PowerSGD(rank=4)"),
        ("topk", "TopK"),
        ("topk_noef", "without error feedback"),
    )
    parts = [f"{label} {_vs_dense(cmp, n)}" for n, label in labels]
    cell = (
        f"vs dense under SGD, the mean over seeds (range): {'; '.join(parts)}; dense "
        f"{min(sgd):.4f} to {max(sgd):.4f}, against AdamW's {min(adamw):.4f} to {max(adamw):.4f}"
    )
    return cell, "-"


ROWS = (
    Row(
        "bytes per step on the example GPT vs the dense all-reduce (`AllReduce()`), 2 ranks: "
        "`BF16()`, `FP16()`, `PowerSGD(rank=4)`, `TopK(0.01)`",
        "counted (`trainer.stats.payload_bytes`)",
        _bytes_cell,
        f"BF16 {BF16_TARGET}x; PowerSGD >= {POWERSGD_TARGET:g}x less; TopK as counted",
        ("comm",),
    ),
    Row(
        "training step with a comm vs `AllReduce()`, 2 ranks, gloo on one machine (a fast "
        "loopback and a slow CPU: what compression costs, not what it saves)",
        PAIRED,
        _step_cell(2),
        "- (as measured)",
        ("comm",),
    ),
    Row(
        "the same, 4 ranks",
        PAIRED,
        _step_cell(4),
        "- (as measured)",
        ("comm",),
    ),
    Row(
        "step time with a comm vs `AllReduce()` on a 1 / 10 / 100 Gbit/s link: this machine's "
        "measured compute + the bytes a rank sent or received / bandwidth (no overlap)",
        "computed",
        _link_cell,
        "-",
        ("comm",),
    ),
    Row(
        "`Star(root=0)` vs the ring all-reduce (`AllReduce()`), 2 / 3 / 4 ranks: the root's "
        "bytes per step",
        "measured (TCP counters), paired",
        _star_cell,
        "the root's bytes grow with N",
        ("comm",),
    ),
    Row(
        "final validation loss of the example (`train_gpt.py`, 300 steps) with a comm vs "
        "dense, 2 ranks, seeds 0-2 (`bench_convergence.py`; plot: `benchmarks/comm-loss.png`)",
        "measured, paired by seed",
        _convergence_cell,
        "BF16 within 0.5%, PowerSGD within 2%, TopK within 3% and below TopK without error "
        "feedback",
        ("convergence",),
    ),
    Row(
        "the same runs for PowerSGD at higher ranks (8, 16) and with a longer dense start (torch's "
        "advice: 10% of the run), and for TopK with and without error feedback, dense for the "
        "first 30 steps (10%), without targets",
        "measured, paired by seed",
        _untargeted_cell,
        "-",
        ("convergence",),
    ),
    Row(
        "the control: the same runs under SGD with momentum 0.9 (`--optimizer sgd`, lr 0.1) "
        "instead of AdamW, for dense, `PowerSGD(rank=4)`, `TopK(0.01)` with and without error "
        "feedback",
        "measured, paired by seed",
        _control_cell,
        "- (a control)",
        ("convergence",),
    ),
)
