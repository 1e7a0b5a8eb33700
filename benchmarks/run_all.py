"""Regenerate every benchmark result and both README tables with one command, at one commit.

    python benchmarks/run_all.py            # every JSON in benchmarks/results/, then the tables
    python benchmarks/run_all.py --quick    # tiny counts into a scratch folder: a smoke test
    python benchmarks/run_all.py --results DIR [--allow-dirty]

Runs bench_flat.py, bench_trainer.py, bench_sharded.py, bench_full.py, bench_hsdp.py,
bench_comm.py, bench_checkpoint.py, scale.py, bench_lora.py, bench_mixed.py, bench_tp.py and
bench_pipeline.py one after the other (each in its own interpreter, with the step and round
counts below, chosen for a 15-minute budget on the project's 2-core machine when nothing else
runs there; it says when a run goes over), writes ``run.json`` (this command, each script's
wall time, the machine and commit), then ``python benchmarks/summary.py --write README.md
benchmarks/README.md`` and checks the results against the code (``summary.py --stale``:
each script records a hash of the code of every file it measures). Prints its wall time.
bench_convergence.py (42 runs of the example, three to five times the budget) is not run here:
``--stale`` names its result when the code it ran changed, with its own command.

The tables name the commit the results come from, so by default this refuses to run with
uncommitted changes under torchshard/, examples/ or benchmarks/ (``--allow-dirty`` runs
anyway; the results then record the changed files in ``machine.git_dirty``, and
``summary.py --stale``, which .ci/run runs, holds them stale unless exactly that content is
what gets committed). ``--quick`` and ``--results DIR`` (other than benchmarks/results)
leave the README tables alone and print the table instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import summary  # noqa: E402
from _common import REPO, machine_info, write_json  # noqa: E402

BUDGET_S = 15 * 60
# script: its arguments for the full run, for --quick
SCRIPTS = {
    "flat": (
        "bench_flat.py",
        "--sizes 125m,1.3b,7b --bind-size 125m --repeats 5",
        "--sizes tiny,7b --bind-size tiny --repeats 2",
    ),
    "trainer": (
        "bench_trainer.py",
        "--steps 40 --warmup 3 --sync-steps 3 --mem-steps 3",
        "--steps 3 --warmup 1 --sync-steps 1 --mem-steps 1",
    ),
    "sharded": ("bench_sharded.py", "--steps 30 --warmup 3", "--steps 3 --warmup 1"),
    "full": (
        "bench_full.py",
        "--mem-pairs 2 --mem-steps 2 --reps 20 --warmup 2",
        "--mem-pairs 1 --mem-steps 1 --reps 2 --warmup 1",
    ),
    "hsdp": ("bench_hsdp.py", "--steps 30 --warmup 3", "--steps 3 --warmup 1"),
    "comm": ("bench_comm.py", "--steps 20 --warmup 2", "--steps 3 --warmup 1"),
    "checkpoint": (
        "bench_checkpoint.py",
        "--size-gb 1.0 --steps 10 --repeats 4 --train-repeats 4 --resume-repeats 4",
        "--size-gb 0.05 --steps 4 --repeats 2 --train-repeats 2 --resume-repeats 2",
    ),
    "scale": ("scale.py", "", ""),
    "lora": ("bench_lora.py", "--steps 30 --warmup 3", "--steps 3 --warmup 1"),
    "mixed": ("bench_mixed.py", "--steps 30 --warmup 3", "--steps 3 --warmup 1"),
    "tp": ("bench_tp.py", "--steps 30 --warmup 3", "--steps 3 --warmup 1"),
    "pipeline": (
        "bench_pipeline.py",
        "--steps 20 --bubble-steps 10 --warmup 2",
        "--steps 3 --bubble-steps 2 --warmup 1",
    ),
}
assert tuple(SCRIPTS) == summary.FILES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny counts, a scratch results folder")
    p.add_argument("--results", type=Path, help=f"default: {summary.RESULTS} (--quick: a temp dir)")
    p.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes")
    args = p.parse_args(argv)
    results = args.results or (
        Path(tempfile.mkdtemp(prefix="torchshard-bench-")) if args.quick else summary.RESULTS
    )
    official = results.resolve() == summary.RESULTS.resolve()
    machine = machine_info()
    dirty = machine["git_dirty"]
    if dirty and official and not args.allow_dirty:
        print(
            f"uncommitted changes to {', '.join(dirty)}: the tables name the commit the results "
            "come from; commit first (or --allow-dirty: stale unless exactly that is committed)",
            file=sys.stderr,
        )
        return 2
    results.mkdir(parents=True, exist_ok=True)
    t_start, scripts = time.perf_counter(), {}
    for name, (script, full, quick) in SCRIPTS.items():
        cmd = [sys.executable, str(HERE / script), *(quick if args.quick else full).split()]
        cmd += ["--out", str(results / f"{name}.json")]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True)
        scripts[name] = {"argv": cmd[1:], "wall_s": time.perf_counter() - t0}
        print(f"=== {name}: {scripts[name]['wall_s']:.0f} s", flush=True)
    total = time.perf_counter() - t_start
    command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "")
    run = {"machine": machine, "command": command, "quick": args.quick, "scripts": scripts}
    run.update(total_s=total, budget_s=BUDGET_S, loadavg_end=list(os.getloadavg()))
    write_json(results / "run.json", run)
    head = machine_info()["git_commit"]
    if head != machine["git_commit"]:
        print(f"\nwarning: HEAD moved during the run ({machine['git_commit']} -> {head})")
    if official:
        summary.main(["--write", str(REPO / "README.md"), str(HERE / "README.md")])
    else:
        summary.main(["--results", str(results)])
    problems = summary.stale(summary.load_results(results))
    for line in problems:
        print(f"stale: {line}")
    over = f" (over the {BUDGET_S // 60}-minute budget)" if total > BUDGET_S else ""
    print(f"\nrun_all: {total:.0f} s ({total / 60:.1f} min){over}; results in {results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
