"""The "Latest results" table, computed from the benchmarks' JSON in benchmarks/results/.

    python benchmarks/summary.py                                        # print the table
    python benchmarks/summary.py --write README.md benchmarks/README.md # regenerate the tables
    python benchmarks/summary.py --check README.md benchmarks/README.md # exit 1 if one is stale
    python benchmarks/summary.py --results DIR ...                      # read DIR/*.json instead

Reads flat.json (bench_flat.py), trainer.json (bench_trainer.py), sharded.json
(bench_sharded.py), checkpoint.json (bench_checkpoint.py) and scale.json (scale.py)
and prints one markdown table row per headline number, with its target, and a line
with the machine (CPU count, torch version) and date from the files' ``machine``
info. A missing file makes its rows say "not measured yet".

``--write`` replaces the text between the lines ``<!-- benchmark-table:begin -->``
and ``<!-- benchmark-table:end -->`` of each file with the table; ``--check`` exits 1
(naming the file) where that text differs from what ``--write`` would put there.
Either exits 2, naming the file, if a file lacks the markers. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
FILES = ("flat", "trainer", "sharded", "checkpoint", "scale")
BEGIN = "<!-- benchmark-table:begin -->"
END = "<!-- benchmark-table:end -->"
NOT_MEASURED = "not measured yet"

Results = dict[str, Any]  # file stem ("flat", ...) -> its parsed JSON


class Failed(Exception):
    """A measurement the JSON records as an error; the message goes in the cell."""


def load_results(directory: Path) -> Results:
    """Every ``<name>.json`` of :data:`FILES` present in ``directory``."""
    out: Results = {}
    for name in FILES:
        path = directory / f"{name}.json"
        if path.is_file():
            out[name] = json.loads(path.read_text())
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def gib(n: float, digits: int = 1) -> str:
    return f"{n / 2**30:.{digits}f} GiB"


# -- one function per row: results -> "measured" cell --------------------------------------------


def wrap_7b(r: Results) -> str:
    layout = r["flat"]["layout"]["7b"]
    rss_kib = layout["wrap_peak_rss_increase_bytes"] / 2**10
    return f"{layout['wrap_s_median'] * 1e3:.1f} ms, +{rss_kib:.0f} KiB RSS"


def bind_copy(r: Results) -> str:
    return f"{r['flat']['bind']['ratio_vs_copy_fresh']['bind']:.2f}x (per-parameter copies)"


def average_gradients(r: Results) -> str:
    ratios = r["trainer"]["ratios"]
    raw = ratios["torchshard_25mb.avg_no_sync / raw_all_reduce"]["paired"]
    mean = ratios["torchshard_25mb.avg_no_sync / plain_flat_grad_mean"]["paired"]
    return (
        f"{raw:.2f}x paired ({mean:.2f}x of a hand-written all-reduce + divide of the same buffer)"
    )


def training_step(r: Results) -> str:
    ratios = r["trainer"]["ratios"]
    big, small = (ratios[f"torchshard_{b}.step / ddp.step"]["paired"] for b in ("25mb", "1mb"))
    cell = f"{big:.2f}x / {small:.2f}x paired"
    # bench_trainer.py does not time CPU; bench_sharded.py runs the same replicated trainer.
    try:
        cpu = sharded(r, "ts_repl")["cpu_vs_ddp"]
        cell += f"; CPU time {cpu:.2f}x (replicated, `bench_sharded.py`)"
    except (KeyError, TypeError, Failed):
        pass
    return cell


def gradient_storage(r: Results) -> str:
    mem = r["trainer"]["memory_bytes"]
    ts, ddp = (
        max(rank["grad_storage_analytic"] for rank in mem[name]["ranks"])
        for name in ("torchshard_25mb", "ddp")
    )
    return f"{ts / ddp:.2g}x ({ts / 2**20:.1f} vs {mib(ddp)})"


def sharded(r: Results, name: str) -> dict[str, Any]:
    summary = r["sharded"]["summary"][name]
    if "error" in summary:
        raise Failed(f"{name} failed (error in `sharded.json`)")
    return summary


def optimizer_state(r: Results) -> str:
    fp32, bf16 = (
        f"{sharded(r, n)['opt_state_vs_repl']:.3f}x" for n in ("ts_shard", "ts_shard_bf16")
    )
    return f"{fp32} (fp32 and bf16)" if fp32 == bf16 else f"{fp32} / {bf16} (fp32 / bf16)"


def sharded_cpu(r: Results) -> str:
    fp32, bf16 = (sharded(r, n)["cpu_vs_ddp"] for n in ("ts_shard", "ts_shard_bf16"))
    try:
        fsdp2 = f"FSDP2 {sharded(r, 'fsdp2')['cpu_vs_ddp']:.2f}x"
    except Failed:
        fsdp2 = "FSDP2 failed (error in `sharded.json`)"
    return f"{fp32:.2f}x / {bf16:.2f}x; {fsdp2}"


def blocking_save(r: Results) -> str:
    b = r["checkpoint"]["blocking"]
    median = b["median_s"]["torchshard"] / b["median_s"]["safetensors"]
    fastest = min(b["samples_s"]["torchshard"]) / min(b["samples_s"]["safetensors"])
    return f"{median:.2f}x (fastest samples {fastest:.2f}x)"


def async_vs_blocking(r: Results, key: str) -> float:
    ck = r["checkpoint"]
    return ck["training"]["median_s"]["torchshard"][key] / ck["blocking"]["median_s"]["torchshard"]


def async_blocked(r: Results) -> str:
    return f"{async_vs_blocking(r, 'blocked'):.3f}x"


def async_lost(r: Results) -> str:
    return f"{async_vs_blocking(r, 'lost'):.2f}x"


def bytes_read(r: Results) -> str:
    return f"{r['checkpoint']['resume']['loads']['3']['read_ratio']:.3f}x"


def resume_3_vs_2(r: Results) -> str:
    loads = r["checkpoint"]["resume"]["loads"]
    median = loads["3"]["median_s"] / loads["2"]["median_s"]
    fastest = min(loads["3"]["max_over_ranks_s"]) / min(loads["2"]["max_over_ranks_s"])
    return f"{median:.2f}x (fastest {fastest:.2f}x)"


def host_memory(r: Results) -> str:
    mem = r["checkpoint"]["memory"]
    load = mem["load"]["peak_increase"] / mem["load"]["state_bytes"]
    rss = mem["repeat"]["rss_after_each_save"]
    growth = rss[-1] / rss[1]
    trend = "flat" if abs(growth - 1) < 0.01 else "grows"
    return (
        f"+{mib(mem['save']['peak_increase'])} / +{load:.1f}x state / "
        f"{trend} (save {len(rss)} / save 2: {growth:.3f}x)"
    )


def scale_1024(r: Results) -> str:
    (row,) = (x for x in r["scale"]["rows"] if x["world"] == 1024)
    total = sum(row[k] for k in ("parameters", "gradients", "optimizer", "master"))
    return (
        f"{row['metadata_bytes'] / 2**10:.0f} KiB / {gib(total)} "
        f"(bf16 params + grads {gib(row['parameters'] + row['gradients'])}; "
        f"AdamW state + fp32 master {gib(row['optimizer'] + row['master'], 2)}, "
        f"{gib(row['replicated_12_bytes'])} replicated)"
    )


@dataclass(frozen=True)
class Row:
    what: str
    measure: Callable[[Results], str]
    target: str
    needs: tuple[str, ...]  # result files without which the row is "not measured yet"


ROWS = (
    Row("wrap a 7B GPT built on meta", wrap_7b, "seconds, little memory", ("flat",)),
    Row(
        "`bind` copy of 125M fp32 weights vs `copy_` into fresh memory",
        bind_copy,
        "-",
        ("flat",),
    ),
    Row(
        "`average_gradients()` vs one raw `all_reduce` of the same bytes",
        average_gradients,
        "<= 1.05",
        ("trainer",),
    ),
    Row("training step vs DDP (25 MiB buckets / 1 MiB)", training_step, "<= 1.0", ("trainer",)),
    Row("gradient storage vs DDP's default", gradient_storage, "below DDP", ("trainer",)),
    Row(
        "sharded optimizer state per rank vs replicated, 2 ranks",
        optimizer_state,
        "<= 0.55",
        ("sharded",),
    ),
    Row("sharded step CPU time vs DDP (fp32 / bf16); FSDP2", sharded_cpu, "-", ("sharded",)),
    Row(
        "blocking save vs `safetensors.save_file` + fsync (1 GB)",
        blocking_save,
        "<= 1.1",
        ("checkpoint",),
    ),
    Row(
        "time the loop is blocked by an async save vs a blocking save",
        async_blocked,
        "<= 0.05",
        ("checkpoint",),
    ),
    Row(
        "training time lost to an async save vs a blocking save",
        async_lost,
        "<= 0.1",
        ("checkpoint",),
    ),
    Row(
        "bytes read when resuming at 3 ranks vs the checkpoint",
        bytes_read,
        "<= 1.05",
        ("checkpoint",),
    ),
    Row(
        "resume at 3 ranks vs at 2 (3 processes on 2 cores)",
        resume_3_vs_2,
        "<= 1.3",
        ("checkpoint",),
    ),
    Row(
        "host memory: blocking save / load / 5 async saves",
        host_memory,
        "bounded",
        ("checkpoint",),
    ),
    Row(
        "70B Llama at 1024 ranks (`scale.py`): metadata.json / memory per rank",
        scale_1024,
        "-",
        ("scale",),
    ),
)


def measured(row: Row, results: Results) -> str:
    if any(name not in results for name in row.needs):
        return NOT_MEASURED
    try:
        return row.measure(results)
    except Failed as e:
        return str(e)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return NOT_MEASURED  # a file from an older script that lacks the field


def machine_line(results: Results) -> str:
    machines = [r["machine"] for r in results.values() if isinstance(r.get("machine"), dict)]
    if not machines:
        return "Machine: not measured yet."

    def distinct(key: str) -> list[str]:
        return sorted({str(m[key]) for m in machines if m.get(key) is not None})

    cpus, torch = " / ".join(distinct("cpu_count")), " / ".join(distinct("torch"))
    dates = sorted({str(m["date"])[:10] for m in machines if m.get("date")})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "?"
    return (
        f"Machine: {cpus or '?'} CPUs, torch {torch or '?'}; measured {when} "
        "(`machine` in `benchmarks/results/*.json`)."
    )


def table(results: Results) -> str:
    """The markdown table and the machine line, without a trailing newline."""
    lines = ["| what | measured | target |", "|---|---|---|"]
    lines += [f"| {row.what} | {measured(row, results)} | {row.target} |" for row in ROWS]
    return "\n".join([*lines, "", machine_line(results)])


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
    p.add_argument("--results", type=Path, default=RESULTS, help="default: %(default)s")
    args = p.parse_args(argv)
    block = table(load_results(args.results)) + "\n"
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
        stale = [path for path, (_, between, _) in parts.items() if between != block]
        for path in stale:
            print(
                f"{path}: benchmark table is out of date; run "
                f"python benchmarks/summary.py --write {path}",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for path, (head, between, tail) in parts.items():
        if between != block:
            path.write_text(head + block + tail)
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
