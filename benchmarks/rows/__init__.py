"""The rows of the benchmark table, one module per benchmark (named after its results file):
each holds its rows and the functions that read them from its JSON. Stdlib only.

A new benchmark adds its module here and its rows to :data:`ROWS`, in table order.
"""

from __future__ import annotations

from . import checkpoint, comm, flat, full, hsdp, lora, mixed, pipeline, scale, sharded, tp, trainer

ROWS = (
    *flat.ROWS,
    *trainer.ROWS,
    *sharded.ROWS,
    *full.ROWS,
    *hsdp.ROWS,
    *tp.ROWS,
    *pipeline.ROWS,
    *comm.ROWS,
    *checkpoint.ROWS,
    *lora.ROWS,
    *mixed.ROWS,
    *scale.ROWS,
)
