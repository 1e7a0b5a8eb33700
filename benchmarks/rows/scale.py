"""scale.py (scale.json): a 70B Llama at 1024 ranks, computed.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from report.results import Results
from report.stats import gib
from report.table import Cell, Row


def _scale_1024(r: Results) -> Cell:
    (row,) = (x for x in r["scale"]["rows"] if x["world"] == 1024)
    total = sum(row[k] for k in ("parameters", "gradients", "optimizer", "master"))
    return (
        f"{row['metadata_bytes'] / 2**10:.0f} KiB / {gib(total)} "
        f"(bf16 params + grads {gib(row['parameters'] + row['gradients'])}; "
        f"AdamW state + fp32 master {gib(row['optimizer'] + row['master'], 2)}, "
        f"{gib(row['replicated_12_bytes'])} replicated)",
        "-",
    )


ROWS = (
    Row(
        "70B Llama at 1024 ranks (`scale.py`): metadata.json / memory per rank",
        "computed (the save path's metadata, `plan_memory`)",
        _scale_1024,
        "-",
        ("scale",),
    ),
)
