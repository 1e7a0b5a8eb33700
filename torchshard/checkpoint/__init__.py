"""Sharded checkpoints: ``save``, ``async_save``, ``load``, ``Checkpointer``.

See ``docs/checkpoint-format.md`` for the format.
"""

from .._checkpoint import Checkpointer, CheckpointFuture, async_save, load, save
from .._ckpt_target import CheckpointInfo
from .._errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointFuture",
    "CheckpointInfo",
    "Checkpointer",
    "async_save",
    "load",
    "save",
]
