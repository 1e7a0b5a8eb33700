"""Data parallelism over one flat buffer: the trainer's mode-free core (trainer, reducer,
setup), one file per mode (replicated, sharded; see mode.py), buckets, memory planning,
and the protocol the checkpoint layer reads (state.py)."""
