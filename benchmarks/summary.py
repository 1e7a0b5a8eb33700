"""The "Latest results" table, computed from the benchmarks' JSON in benchmarks/results/.

    python benchmarks/summary.py                                        # print the table
    python benchmarks/summary.py --write README.md benchmarks/README.md # regenerate the tables
    python benchmarks/summary.py --check README.md benchmarks/README.md # exit 1 if one is stale
    python benchmarks/summary.py --stale                                # exit 1 if a result is
                                                                        # older than its code
    python benchmarks/summary.py --results DIR ...                      # read DIR/*.json instead

Reads flat.json (bench_flat.py), trainer.json (bench_trainer.py), sharded.json
(bench_sharded.py), full.json (bench_full.py), checkpoint.json (bench_checkpoint.py),
scale.json (scale.py) and run.json (run_all.py: the command, its wall time) and prints one markdown table row per
headline number: what kind of number it is (measured, paired, counted, computed), the
result, its target and whether the target is met. A missing file makes its rows say
"not measured yet".

Paired ratios: each benchmark runs the compared configurations interleaved (step by step,
or round by round in rotation) and records one ratio per step or round, wall-clock and CPU
time. A cell shows the median of those ratios with their spread: p10-p90 from 10 ratios
up, min-max below. A target counts as met only when at least 80% of the paired ratios meet
it, as missed when at most 20% do; in between it says "unclear".

``--write`` replaces the text between the lines ``<!-- benchmark-table:begin -->``
and ``<!-- benchmark-table:end -->`` of each file with the table; ``--check`` exits 1
(naming the file) where that text differs from what ``--write`` would put there.
Either exits 2, naming the file, if a file lacks the markers.

``--stale`` (a step of .ci/run, after the tests: it needs the history) holds each result against the code it
measured: the result's ``machine.git_commit`` must be an ancestor of HEAD,
``git log <commit>..HEAD -- <paths it measures>`` (:data:`MEASURES`) must be empty and
the tree must have been clean there when it ran (``machine.git_dirty``). Where git
cannot tell (not installed, not a repository, a shallow clone without the commit, no
commit recorded) that is a failure too, never a pass. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
FILES = ("flat", "trainer", "sharded", "full", "checkpoint", "scale")
RUN = "run"  # run.json: written by run_all.py
BEGIN = "<!-- benchmark-table:begin -->"
END = "<!-- benchmark-table:end -->"
NOT_MEASURED = "not measured yet"
MOSTLY = Fraction(4, 5)  # a target is met when at least this share of the paired ratios meet it
COMMAND = "python benchmarks/run_all.py"

# What each result measured: a commit that changed any of these since the result's commit
# makes it stale. The benchmark's own script, the shared helpers and the example model and
# data it runs count too.
_COMMON = ("benchmarks/_common.py", "examples/gpt.py")
_TRAINING = (
    "torchshard/_flat",
    "torchshard/_parallel",
    "torchshard/_dist.py",
    "examples/train_gpt.py",
)
MEASURES: dict[str, tuple[str, ...]] = {
    "flat": ("benchmarks/bench_flat.py", "torchshard/_flat", *_COMMON),
    "trainer": ("benchmarks/bench_trainer.py", *_TRAINING, *_COMMON),
    "sharded": ("benchmarks/bench_sharded.py", *_TRAINING, *_COMMON),
    "full": ("benchmarks/bench_full.py", *_TRAINING, *_COMMON),
    "checkpoint": (
        "benchmarks/bench_checkpoint.py",
        "torchshard/checkpoint",
        "torchshard/_flat",
        "torchshard/_parallel",
        "torchshard/_dist.py",
        *_COMMON,
    ),
    "scale": (
        "benchmarks/scale.py",
        "torchshard/_flat",
        "torchshard/_parallel/memory.py",
        "torchshard/checkpoint",
    ),
}

Results = dict[str, Any]  # file stem ("flat", ...) -> its parsed JSON


class Failed(Exception):
    """A measurement the JSON records as an error; the message goes in the cell."""


def load_results(directory: Path) -> Results:
    """Every ``<name>.json`` of :data:`FILES` (and run.json) present in ``directory``."""
    out: Results = {}
    for name in (*FILES, RUN):
        path = directory / f"{name}.json"
        if path.is_file():
            out[name] = json.loads(path.read_text())
    return out


# -- paired ratios: median, spread, verdict --------------------------------------------------------


@dataclass(frozen=True)
class Spread:
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
    """``1.03x (p10-p90 0.95-1.12)``: the median and the spread of ``xs``."""
    s = Spread.of(xs)
    f = f"{{:.{digits}f}}"
    return f"{f.format(s.median)}{unit} ({s.kind} {f.format(s.lo)}-{f.format(s.hi)})"


def verdict(xs: Sequence[float], target: float) -> str:
    """``met``/``missed``/``unclear`` and how many of the paired ratios ``xs`` are <= target."""
    n, k = len(xs), sum(1 for x in xs if x <= target)
    share = Fraction(k, n)
    word = "met" if share >= MOSTLY else "missed" if share <= 1 - MOSTLY else "unclear"
    return f"{word} ({k} of {n} <= {target:g})"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def gib(n: float, digits: int = 1) -> str:
    return f"{n / 2**30:.{digits}f} GiB"


def paired(r: Results, name: str, key: str) -> dict[str, list[float]]:
    return r[name]["paired"][key]


def wall_cpu(p: dict[str, list[float]], digits: int = 2) -> str:
    """Wall-clock first, CPU time beside it."""
    cell = f"wall {spread_text(p['wall'], digits)}"
    if p.get("cpu"):
        cell += f", CPU {spread_text(p['cpu'], digits)}"
    return cell


def plural(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def pairs_of(p: dict[str, list[float]], what: str = "pairs") -> str:
    return f"{len(p['wall'])} {what}"


# -- one function per row: results -> (result cell, verdict cell) ---------------------------------

Cell = tuple[str, str]


def wrap_7b(r: Results) -> Cell:
    layout = r["flat"]["layout"]["7b"]
    rss_kib = layout["wrap_peak_rss_increase_bytes"] / 2**10
    ms = [1e3 * x for x in layout["wrap_s"]]
    cpu = [1e3 * x for x in layout["wrap_cpu_s"]]
    return (
        f"wall {spread_text(ms, 1, ' ms')}, CPU {spread_text(cpu, 1, ' ms')}; "
        f"+{rss_kib:.0f} KiB peak RSS",
        "-",
    )


def bind_copy(r: Results) -> Cell:
    p = paired(r, "flat", "bind / copy_fresh")
    return f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}", "-"


def average_gradients(r: Results) -> Cell:
    p = paired(r, "trainer", "ts_25mb.avg_no_sync / raw_all_reduce")
    return f"{wall_cpu(p)}; {pairs_of(p, 'repetitions')}", verdict(p["wall"], 1.05)


def training_step(bucket: str) -> Callable[[Results], Cell]:
    def cell(r: Results) -> Cell:
        p = paired(r, "trainer", f"ts_{bucket}.step / ddp_{bucket}.step")
        return f"{wall_cpu(p)}; {pairs_of(p, 'steps')}", verdict(p["wall"], 1.0)

    return cell


def host_syncs(r: Results) -> Cell:
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


def gradient_storage(r: Results) -> Cell:
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


def sharded(r: Results, name: str) -> dict[str, Any]:
    summary = r["sharded"]["summary"][name]
    if "error" in summary:
        raise Failed(f"{name} failed (error in `sharded.json`)")
    return summary


def optimizer_state(r: Results) -> Cell:
    fracs = [sharded(r, n)["opt_state_vs_repl"] for n in ("ts_shard", "ts_shard_bf16")]
    fp32, bf16 = (f"{x:.3f}x" for x in fracs)
    cell = f"{fp32} (fp32 and bf16)" if fp32 == bf16 else f"{fp32} / {bf16} (fp32 / bf16)"
    return f"{cell}: optimizer state tensor bytes", "met" if max(fracs) <= 0.55 else "missed"


def sharded_vs(*pairs: tuple[str, str, str]) -> Callable[[Results], Cell]:
    """Paired step ratios of ``(config, baseline, label)`` from sharded.json."""

    def cell(r: Results) -> Cell:
        parts, n = [], 0
        for config, baseline, label in pairs:
            for name in (config, baseline):
                sharded(r, name)  # raises Failed for a configuration that failed
            p = paired(r, "sharded", f"{config}.step / {baseline}.step")
            n = len(p["wall"])
            parts.append(f"{label}: {wall_cpu(p)}")
        return "; ".join(parts) + f"; {n} steps", "-"

    return cell


BYTES_TOLERANCE = 0.01  # measured bytes per step over the analytic ratio
# memory_bytes() fields held between steps (the fully sharded mode adds "transient")
PERSISTENT = ("parameters", "gradients", "optimizer", "master")
ALLOCATOR_LABELS = {"glibc": "glibc", "mmap_128k": "`MALLOC_MMAP_THRESHOLD_=131072`"}


def verdicts(parts: Sequence[tuple[str, Sequence[float], float]]) -> str:
    """``fp32: met (28 of 30 <= 1.3); bf16: ...``: one verdict per labelled set of ratios."""
    return "; ".join(f"{label}: {verdict(xs, target)}" for label, xs, target in parts)


def full_vs_fsdp2(r: Results) -> Cell:
    for name in ("ts_full", "fsdp2_zero3"):
        sharded(r, name)
    p = paired(r, "sharded", "ts_full.step / fsdp2_zero3.step")
    return f"{wall_cpu(p)}; {pairs_of(p, 'steps')}", verdict(p["wall"], 1.0)


FULL_VS_SHARD = (("fp32", "ts_full", "ts_shard"), ("bf16", "ts_full_bf16", "ts_shard_bf16"))


def full_vs_shard(r: Results) -> Cell:
    parts, checks = [], []
    for label, full, base in FULL_VS_SHARD:
        for name in (full, base):
            sharded(r, name)
        p = paired(r, "sharded", f"{full}.step / {base}.step")
        parts.append(f"{label}: {wall_cpu(p)}")
        checks.append((label, p["wall"], 1.3))
    return "; ".join(parts) + f"; {len(checks[0][1])} steps", verdicts(checks)


def full_bytes(r: Results) -> Cell:
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


def full_plan(r: Results) -> Cell:
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


def full_memory(r: Results) -> Cell:
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


def gloo_unit(unit: str) -> Callable[[Results], Cell]:
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


def blocking_save(r: Results) -> Cell:
    p = paired(r, "checkpoint", "blocking: torchshard / safetensors")
    return f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}", verdict(p["wall"], 1.1)


def async_blocked(r: Results) -> Cell:
    p = paired(r, "checkpoint", "blocked: async / blocking")
    diff = paired(r, "checkpoint", "step diff: async / blocking")
    return (
        f"{spread_text(p['wall'], 3)}; the `opt.step()` after the save vs its no-save twin: "
        f"{spread_text(diff['wall'], 3)}; {pairs_of(p, 'rounds')}",
        verdict(p["wall"], 0.05),
    )


def async_lost(r: Results) -> Cell:
    p = paired(r, "checkpoint", "lost: async / blocking")
    return (
        f"wall {spread_text(p['wall'])}, CPU added {spread_text(p['cpu'])}; "
        f"{pairs_of(p, 'rounds')}",
        verdict(p["wall"], 0.1),
    )


def bytes_read(r: Results) -> Cell:
    ratio = r["checkpoint"]["resume"]["read_ratio"]["3"]
    return f"{ratio:.3f}x", "met" if ratio <= 1.05 else "missed"


def resume_3_vs_2(r: Results) -> Cell:
    p = paired(r, "checkpoint", "load: world 3 / world 2")
    return f"{wall_cpu(p)}; {pairs_of(p, 'rounds')}", verdict(p["wall"], 1.3)


def host_memory(r: Results) -> Cell:
    mem = r["checkpoint"]["memory"]
    load = mem["load"]["peak_increase"] / mem["load"]["state_bytes"]
    rss = mem["repeat"]["rss_after_each_save"]
    growth = rss[-1] / rss[1]
    flat = abs(growth - 1) < 0.01
    return (
        f"+{mib(mem['save']['peak_increase'])} / +{load:.1f}x state / "
        f"{'flat' if flat else 'grows'} (save {len(rss)} / save 2: {growth:.3f}x)",
        "met" if flat else "missed",
    )


def scale_1024(r: Results) -> Cell:
    (row,) = (x for x in r["scale"]["rows"] if x["world"] == 1024)
    total = sum(row[k] for k in ("parameters", "gradients", "optimizer", "master"))
    return (
        f"{row['metadata_bytes'] / 2**10:.0f} KiB / {gib(total)} "
        f"(bf16 params + grads {gib(row['parameters'] + row['gradients'])}; "
        f"AdamW state + fp32 master {gib(row['optimizer'] + row['master'], 2)}, "
        f"{gib(row['replicated_12_bytes'])} replicated)",
        "-",
    )


@dataclass(frozen=True)
class Row:
    what: str
    how: str  # measured / measured, paired / counted / computed
    measure: Callable[[Results], Cell]
    target: str
    needs: tuple[str, ...]  # result files without which the row is "not measured yet"


PAIRED = "measured, paired"
ROWS = (
    Row("wrap a 7B GPT built on meta", "measured", wrap_7b, "seconds, little memory", ("flat",)),
    Row(
        "`bind` copy of 125M fp32 weights vs `copy_` into fresh memory",
        PAIRED,
        bind_copy,
        "-",
        ("flat",),
    ),
    Row(
        "`average_gradients()` vs one raw `all_reduce` of the same bytes (2 ranks)",
        PAIRED,
        average_gradients,
        "<= 1.05",
        ("trainer",),
    ),
    Row(
        "training step vs DDP, 25 MiB buckets (both)",
        PAIRED,
        training_step("25mb"),
        "<= 1.0",
        ("trainer",),
    ),
    Row(
        "training step vs DDP, 1 MiB buckets (both: `DDP(bucket_cap_mb=1)`)",
        PAIRED,
        training_step("1mb"),
        "<= 1.0",
        ("trainer",),
    ),
    Row(
        "host syncs per training step, every parameter used (SGD)",
        "counted",
        host_syncs,
        "0, as DDP without `find_unused_parameters`",
        ("trainer",),
    ),
    Row(
        "gradient storage vs DDP's default",
        "measured",
        gradient_storage,
        "below DDP",
        ("trainer",),
    ),
    Row(
        "sharded optimizer state per rank vs replicated, 2 ranks",
        "measured",
        optimizer_state,
        "<= 0.55",
        ("sharded",),
    ),
    Row(
        "sharded step (`shard=True`) vs DDP: fp32 / bf16 with an fp32 master",
        PAIRED,
        sharded_vs(("ts_shard", "ddp", "fp32"), ("ts_shard_bf16", "ddp", "bf16")),
        "-",
        ("sharded",),
    ),
    Row(
        "sharded step vs FSDP2: `fully_shard(reshard_after_forward=False)` (the same memory "
        "class) / its default (ZeRO-3)",
        PAIRED,
        sharded_vs(
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
        full_vs_fsdp2,
        "<= 1.0",
        ("sharded",),
    ),
    Row(
        "fully sharded step vs `shard=True`: fp32 / bf16 with an fp32 master",
        PAIRED,
        full_vs_shard,
        "<= 1.3",
        ("sharded",),
    ),
    Row(
        "bytes communicated per step, fully sharded vs replicated (ZeRO accounting: all-reduce "
        "2x its buffer, reduce-scatter and all-gather 1x), 2 ranks",
        "counted (`trainer.stats`)",
        full_bytes,
        "= analytic within 1% (1.5x in the ZeRO paper, less the kept root units)",
        ("sharded",),
    ),
    Row(
        'fully sharded `memory_bytes()` vs `plan_memory(shard="full")`, 2 ranks',
        "measured (tensor bytes) vs computed",
        full_plan,
        "persistent equal; peak unit buffers <= `transient`",
        ("sharded",),
    ),
    Row(
        "peak RSS growth per rank, fully sharded vs replicated, 4 ranks, 34.9M-parameter GPT "
        "(fp32, AdamW), built on meta",
        "measured, paired (fresh launches)",
        full_memory,
        "<= 0.5",
        ("full",),
    ),
    Row(
        "gloo: gather + reduce-scatter of a GPT-2 small block (7.1M fp32), one `broadcast` / "
        "`reduce` per owner vs `all_gather_single` / `reduce_scatter_single`",
        PAIRED,
        gloo_unit("gpt2_block"),
        "the faster: the one that wins >= 80% of the pairs",
        ("full",),
    ),
    Row(
        "gloo: the same for a block of the benchmark GPT (198K fp32)",
        PAIRED,
        gloo_unit("small_block"),
        "the faster (as above)",
        ("full",),
    ),
    Row(
        "blocking save vs `safetensors.save_file` + fsync (1 GB)",
        PAIRED,
        blocking_save,
        "<= 1.1",
        ("checkpoint",),
    ),
    Row(
        "time the loop is blocked by an async save vs by a blocking save in the same loop",
        PAIRED,
        async_blocked,
        "<= 0.05",
        ("checkpoint",),
    ),
    Row(
        "training time lost to an async save vs to a blocking save in the same loop",
        PAIRED,
        async_lost,
        "<= 0.1",
        ("checkpoint",),
    ),
    Row(
        "bytes read when resuming at 3 ranks vs the checkpoint",
        "measured",
        bytes_read,
        "<= 1.05",
        ("checkpoint",),
    ),
    Row(
        "resume at 3 ranks vs at 2 (3 processes on 2 cores)",
        PAIRED,
        resume_3_vs_2,
        "<= 1.3",
        ("checkpoint",),
    ),
    Row(
        "host memory: blocking save / load / 5 async saves",
        "measured",
        host_memory,
        "bounded",
        ("checkpoint",),
    ),
    Row(
        "70B Llama at 1024 ranks (`scale.py`): metadata.json / memory per rank",
        "computed (the save path's metadata, `plan_memory`)",
        scale_1024,
        "-",
        ("scale",),
    ),
)


def measured(row: Row, results: Results) -> Cell:
    if any(name not in results for name in row.needs):
        return NOT_MEASURED, "-"
    try:
        return row.measure(results)
    except Failed as e:
        return str(e), "-"
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return NOT_MEASURED, "-"  # a file from an older script that lacks the field


def machine_line(results: Results) -> str:
    runs = {k: v for k, v in results.items() if k in FILES and isinstance(v.get("machine"), dict)}
    if not runs:
        return "Machine: not measured yet."
    machines = list(runs.values())

    def distinct(key: str) -> list[str]:
        return sorted({str(m["machine"][key]) for m in machines if m["machine"].get(key)})

    cpus, torch, model = (" / ".join(distinct(k)) for k in ("cpu_count", "torch", "cpu"))
    dates = sorted({str(m["machine"]["date"])[:10] for m in machines if m["machine"].get("date")})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "?"
    commits: dict[str, list[str]] = {}
    for name, m in runs.items():
        commits.setdefault(str(m["machine"].get("git_commit") or "unknown")[:10], []).append(name)
    if len(commits) == 1:
        commit = f"commit {next(iter(commits))}"
    else:
        commit = "commits " + ", ".join(f"{c} ({', '.join(n)})" for c, n in commits.items())
    loads = [m["machine"]["loadavg"][0] for m in machines if m["machine"].get("loadavg")]
    load = f"; 1-min load average {min(loads):.1f}-{max(loads):.1f} at the starts" if loads else ""
    line = (
        f"Machine: {cpus or '?'} CPUs ({model or '?'}), torch {torch or '?'}; {commit}; "
        f"measured {when}{load} (`machine` in `benchmarks/results/*.json`)."
    )
    run = results.get(RUN)
    if run:
        parts = ", ".join(f"{k} {v['wall_s'] / 60:.1f}" for k, v in run["scripts"].items())
        line += f" Regenerated by `{run['command']}` in {run['total_s'] / 60:.1f} min ({parts})."
    else:
        line += f" Not regenerated by `{COMMAND}` (no run.json)."
    return line


def table(results: Results) -> str:
    """The markdown table and the machine line, without a trailing newline."""
    lines = ["| what | how | result | target | verdict |", "|---|---|---|---|---|"]
    for row in ROWS:
        cell, verdict_cell = measured(row, results)
        lines.append(f"| {row.what} | {row.how} | {cell} | {row.target} | {verdict_cell} |")
    return "\n".join([*lines, "", machine_line(results)])


# -- staleness: results against the code they measured ---------------------------------------------


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60
    )


def stale(results: Results, repo: Path = REPO) -> list[str]:
    """Why results are not known to be current, one line each (empty: every one is).

    A result is current when its ``machine.git_commit`` is an ancestor of HEAD, no commit
    since touched the paths it measures (:data:`MEASURES`), and none of those paths had
    uncommitted changes when it ran (``machine.git_dirty``). Not knowing is a problem too:
    no git, no repository, a shallow clone that lacks the commit, no commit recorded.
    """
    problems: list[str] = []
    try:
        ok = _git(repo, "rev-parse", "--is-inside-work-tree")
    except (OSError, subprocess.SubprocessError) as e:
        return [f"cannot check the results against the code: git failed to run ({e})"]
    if ok.returncode != 0 or ok.stdout.strip() != "true":
        return [f"cannot check the results against the code: {repo} is not a git work tree"]
    shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    for name in FILES:
        if name not in results:
            problems.append(f"{name}.json: missing; run {COMMAND}")
            continue
        machine = results[name].get("machine") or {}
        commit = machine.get("git_commit")
        if not commit:
            problems.append(f"{name}.json: records no commit (machine.git_commit); run {COMMAND}")
            continue
        paths = MEASURES[name]
        if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            hint = (
                "this is a shallow clone: fetch the history (git fetch --unshallow)"
                if shallow
                else f"the commit is not in this repository; run {COMMAND}"
            )
            problems.append(f"{name}.json: measured at {commit[:10]}, unknown here: {hint}")
            continue
        if _git(repo, "merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
            problems.append(
                f"{name}.json: measured at {commit[:10]}, not an ancestor of HEAD; run {COMMAND}"
            )
            continue
        log = _git(repo, "log", "--format=%h %s", f"{commit}..HEAD", "--", *paths)
        if log.returncode != 0:
            problems.append(f"{name}.json: git log failed: {log.stderr.strip()}")
        elif log.stdout.strip():
            changes = log.stdout.strip().splitlines()
            problems.append(
                f"{name}.json: measured at {commit[:10]}; {len(changes)} later commit(s) change "
                f"what it measures ({', '.join(paths)}), e.g. {changes[0]}; run {COMMAND}"
            )
        dirty = machine.get("git_dirty")
        if dirty is None:
            problems.append(
                f"{name}.json: does not record whether the tree was clean; run {COMMAND}"
            )
        else:
            touched = [f for f in dirty if any(f == p or f.startswith(p + "/") for p in paths)]
            if touched:
                problems.append(
                    f"{name}.json: measured with uncommitted changes to {', '.join(touched)}: "
                    f"it belongs to no commit; commit, then run {COMMAND}"
                )
    commits = {
        str((results[n].get("machine") or {}).get("git_commit")) for n in FILES if n in results
    }
    if RUN in results:
        commits.add(str((results[RUN].get("machine") or {}).get("git_commit")))
    else:
        problems.append(f"run.json: missing; run {COMMAND}")
    if len(commits) > 1:
        problems.append(
            f"the results come from {len(commits)} commits ({', '.join(sorted(c[:10] for c in commits))}),"
            f" not one; run {COMMAND}"
        )
    return problems


# -- --write / --check ---------------------------------------------------------------------------


class MarkerError(Exception):
    pass


def split(text: str, path: Path) -> tuple[str, str, str]:
    """(through the begin marker's line, the text between, from the end marker's line on)."""
    begin = text.find(BEGIN)
    end = text.find(END, begin + len(BEGIN)) if begin >= 0 else -1
    if begin < 0 or end < 0:
        raise MarkerError(f"{path}: no '{BEGIN}' ... '{END}' marker lines")
    head_end = text.find("\n", begin)
    if head_end < 0 or head_end > end:
        raise MarkerError(f"{path}: '{BEGIN}' and '{END}' must be on lines of their own")
    end = text.rfind("\n", 0, end) + 1
    return text[: head_end + 1], text[head_end + 1 : end], text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", nargs="+", type=Path, metavar="FILE")
    mode.add_argument("--check", nargs="+", type=Path, metavar="FILE")
    mode.add_argument("--stale", action="store_true", help="exit 1 if a result is out of date")
    p.add_argument("--results", type=Path, default=RESULTS, help="default: %(default)s")
    args = p.parse_args(argv)
    results = load_results(args.results)
    if args.stale:
        problems = stale(results)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    block = table(results) + "\n"
    files: list[Path] = args.write or args.check or []
    if not files:
        print(block, end="")
        return 0
    parts = {}
    for path in files:
        try:
            parts[path] = split(path.read_text(), path)
        except (OSError, MarkerError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.check:
        out_of_date = [path for path, (_, between, _) in parts.items() if between != block]
        for path in out_of_date:
            print(
                f"{path}: benchmark table is out of date; run "
                f"python benchmarks/summary.py --write {path}",
                file=sys.stderr,
            )
        return 1 if out_of_date else 0
    for path, (head, between, tail) in parts.items():
        if between != block:
            path.write_text(head + block + tail)
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
