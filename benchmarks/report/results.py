"""Where the benchmark results live and how they are read. Stdlib only.

flat.json (bench_flat.py), trainer.json (bench_trainer.py), sharded.json (bench_sharded.py),
full.json (bench_full.py), hsdp.json (bench_hsdp.py), checkpoint.json (bench_checkpoint.py),
scale.json (scale.py), lora.json (bench_lora.py), mixed.json (bench_mixed.py) and run.json
(run_all.py: the command, its wall time).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
RESULTS = REPO / "benchmarks" / "results"
FILES = ("flat", "trainer", "sharded", "full", "hsdp", "checkpoint", "scale", "lora", "mixed")
RUN = "run"  # run.json: written by run_all.py
COMMAND = "python benchmarks/run_all.py"

Results = dict[str, Any]  # file stem ("flat", ...) -> its parsed JSON


def load_results(directory: Path) -> Results:
    """Every ``<name>.json`` of :data:`FILES` (and run.json) present in ``directory``.

    >>> load_results(Path("/nonexistent"))
    {}
    """
    out: Results = {}
    for name in (*FILES, RUN):
        path = directory / f"{name}.json"
        if path.is_file():
            out[name] = json.loads(path.read_text())
    return out
