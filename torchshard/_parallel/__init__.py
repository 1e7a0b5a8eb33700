"""Data parallelism over one flat buffer: the trainer's mode-free core (trainer, reducer,
setup, teardown), the seam (seam.py's protocols, comm.py's comms, mode.py's base), the
registry of modes (modes.py) and one file or package per mode (replicated, sharded, full/),
buckets, memory planning, and what the checkpoint layer reads (state.py, shards.py)."""
