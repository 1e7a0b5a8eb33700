"""Data parallelism over one flat buffer: the trainer's modes, one file each (see mode.py)."""
