"""Count aborts at exit over fresh torchrun launches: the README blocks, the example, a control.

A rank that dies at exit after training succeeded (``terminate called without an active
exception``, SIGABRT) makes torchrun report FAILED, and under ``--max-restarts`` restart the
whole job. It is a race (see ``torchshard/_exit.py``), so it is counted over many fresh
launches. The control row runs plain torch (gloo, a DDP step, ``destroy_process_group()``
without agreeing first) in the same run, to show the race is there to be seen on this
machine at this load.

    python benchmarks/bench_exit.py                    # 50 launches per row (about an hour
                                                       # on 2 cores)
    python benchmarks/bench_exit.py --launches 5 --rows quickstart-2,control-2

A launch counts as an abort when torchrun exits non-zero or any output says ``terminate
called``, ``core dumped`` or ``Traceback``. Writes ``benchmarks/results/exit.json`` (not part
of ``run_all.py``: its 15-minute budget holds a tenth of this).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, format_table, machine_info, write_json

BAD = re.compile(r"terminate called|core dumped|Traceback|SIGABRT")

CONTROL = """
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    opt.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
dist.destroy_process_group()
"""


def readme_blocks() -> list[str]:
    """The README's Python blocks, in order: quickstart, sharded + checkpoints, fully sharded."""
    text = (REPO / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def rows() -> dict[str, tuple[str, int, list[str]]]:
    """name -> (script key, ranks, extra arguments)."""
    out: dict[str, tuple[str, int, list[str]]] = {
        "quickstart-2": ("quickstart", 2, []),
        "readme-sharded-2": ("sharded", 2, []),
        "readme-sharded-3": ("sharded", 3, []),
        "readme-full-2": ("full", 2, []),
        "readme-full-3": ("full", 3, []),
    }
    for ranks in (2, 3):
        for mode, flags in (
            ("replicated", []),
            ("sharded", ["--shard"]),
            ("full", ["--shard", "full"]),
        ):
            out[f"train_gpt-{mode}-{ranks}"] = ("train_gpt", ranks, flags)
    out["control-2"] = ("control", 2, [])
    return out


def launch(script: Path, ranks: int, args: list[str], cwd: Path) -> tuple[bool, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(ranks), str(script), *args]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    text = out.stdout + out.stderr
    bad = out.returncode != 0 or BAD.search(text) is not None
    return bad, text, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--launches", type=int, default=50, help="fresh launches per row")
    p.add_argument("--rows", help="comma-separated row names (default: all)")
    p.add_argument("--steps", type=int, default=5, help="train_gpt.py --steps")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exit.json"))
    args = p.parse_args(argv)
    table = rows()
    chosen = args.rows.split(",") if args.rows else list(table)
    unknown = [r for r in chosen if r not in table]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(table)}")
    work = Path(tempfile.mkdtemp(prefix="bench-exit-"))
    blocks = readme_blocks()
    scripts = {
        "quickstart": blocks[0],
        "sharded": blocks[1],
        "full": blocks[2],
        "control": CONTROL,
    }
    paths = {}
    for key, text in scripts.items():
        paths[key] = work / f"{key}.py"
        paths[key].write_text(text)
    paths["train_gpt"] = REPO / "examples" / "train_gpt.py"
    results: dict[str, dict] = {}
    started = time.perf_counter()
    # rows interleaved launch by launch, so that a change of load hits every row alike
    for i in range(args.launches):
        for name in chosen:
            key, ranks, extra = table[name]
            if key == "train_gpt":
                ckpt = work / f"ckpt-{name}"
                extra = [*extra, "--steps", str(args.steps), "--ckpt-dir", str(ckpt)]
                extra += ["--overwrite", "--log-every", str(args.steps)]
            bad, text, seconds = launch(paths[key], ranks, extra, work)
            r = results.setdefault(
                name, {"ranks": ranks, "launches": 0, "aborts": 0, "seconds": [], "examples": []}
            )
            r["launches"] += 1
            r["aborts"] += bad
            r["seconds"].append(round(seconds, 2))
            if bad and len(r["examples"]) < 2:
                r["examples"].append(text[-2000:])
        done = ", ".join(f"{n} {results[n]['aborts']}" for n in chosen)
        print(f"launch {i + 1}/{args.launches}: aborts so far: {done}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        format_table(
            ["row", "ranks", "aborted", "s per launch (median)"],
            [
                [
                    n,
                    r["ranks"],
                    f"{r['aborts']} of {r['launches']}",
                    f"{sorted(r['seconds'])[len(r['seconds']) // 2]:.1f}",
                ]
                for n, r in results.items()
            ],
            title="aborts at exit over fresh torchrun launches",
        )
    )
    data = {
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "rows": results,
    }
    print(f"wrote {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
