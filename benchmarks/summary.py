"""The "Latest results" table, computed from the benchmarks' JSON in benchmarks/results/.

    python benchmarks/summary.py                                        # print the table
    python benchmarks/summary.py --write README.md benchmarks/README.md # regenerate the tables
    python benchmarks/summary.py --check README.md benchmarks/README.md # exit 1 if one is stale
    python benchmarks/summary.py --stale                                # exit 1 if a result is
                                                                        # older than its code
    python benchmarks/summary.py --rehash                               # byte hashes -> code
    python benchmarks/summary.py --results DIR ...                      # read DIR/*.json instead

Reads flat.json (bench_flat.py), trainer.json (bench_trainer.py), sharded.json
(bench_sharded.py), full.json (bench_full.py), hsdp.json (bench_hsdp.py), comm.json
(bench_comm.py), checkpoint.json (bench_checkpoint.py), scale.json (scale.py), lora.json
(bench_lora.py), mixed.json (bench_mixed.py), tp.json (bench_tp.py), pipeline.json
(bench_pipeline.py), run.json (run_all.py: the command, its wall
time) and convergence.json (bench_convergence.py, too slow for run_all.py) and prints one
markdown table row per headline number (``rows/<benchmark>.py``): what kind of number it is
(measured, paired, counted, computed), the result, its target and whether the target is met
(``report/stats.py``: the median of the paired ratios, their spread, and "met" only when at
least 80% of them meet it). A missing file makes its rows say "not measured yet".

``--write`` replaces the text between the lines ``<!-- benchmark-table:begin -->``
and ``<!-- benchmark-table:end -->`` of each file with the table; ``--check`` exits 1
(naming the file) where that text differs from what ``--write`` would put there.
Either exits 2, naming the file, if a file lacks the markers.

``--stale`` (a step of .ci/run, after the tests) holds each result against the code it
measured, by content (``report/freshness.py``): every result records a hash of each file
it measures (``measured``; of a Python file, its code without docstrings and comments), and
a result is stale where one of those files changed, appeared or disappeared since. It names
each stale result and the changed paths. No git needed. ``--rehash`` rewrites the results
that recorded the bytes of each file (written before code hashes) and are fresh by them,
with code hashes; it leaves the others as they are. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # report/ and rows/ sit beside us
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from report.files import write_atomically
from report.freshness import MEASURES, rehash, stale
from report.results import COMMAND, FILES, REPO, RESULTS, RUN, SLOW, Results, load_results
from report.table import NOT_MEASURED, Row, measured
from report.table import table as render
from rows import ROWS

__all__ = [
    "BEGIN",
    "COMMAND",
    "END",
    "FILES",
    "MEASURES",
    "NOT_MEASURED",
    "REPO",
    "RESULTS",
    "ROWS",
    "RUN",
    "SLOW",
    "Row",
    "load_results",
    "main",
    "measured",
    "rehash",
    "stale",
    "table",
]

BEGIN = "<!-- benchmark-table:begin -->"
END = "<!-- benchmark-table:end -->"


def table(results: Results) -> str:
    """The markdown table of every row and the machine line, without a trailing newline.

    >>> table({}).splitlines()[-1]
    'Machine: not measured yet.'
    """
    return render(results, ROWS)


class MarkerError(Exception):
    """A file to write the table into lacks the begin or end marker line."""


def split(text: str, path: Path) -> tuple[str, str, str]:
    """(through the begin marker's line, the text between, from the end marker's line on).

    >>> split(f"a\\n{BEGIN}\\nold\\n{END}\\nb\\n", Path("x.md"))[1]
    'old\\n'
    """
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
    """The command line: print, ``--write``, ``--check`` or ``--stale``; the exit status.

    >>> main(["--stale", "--results", "/nonexistent"])  # every result missing: stale
    1
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", nargs="+", type=Path, metavar="FILE")
    mode.add_argument("--check", nargs="+", type=Path, metavar="FILE")
    mode.add_argument("--stale", action="store_true", help="exit 1 if a result is out of date")
    mode.add_argument(
        "--rehash", action="store_true", help="byte hashes of results fresh by them -> code hashes"
    )
    p.add_argument("--results", type=Path, default=RESULTS, help="default: %(default)s")
    args = p.parse_args(argv)
    results = load_results(args.results)
    if args.rehash:
        for name, result in results.items():
            if name in MEASURES and rehash(result, name):
                path = args.results / f"{name}.json"
                write_atomically(path, json.dumps(result, indent=2) + "\n")  # as write_json
                print(f"rehashed {path}", file=sys.stderr)
        return 0
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
            write_atomically(path, head + block + tail)
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
