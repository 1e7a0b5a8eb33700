"""Sharded checkpoints: ``save``, ``async_save``, ``load``, ``Checkpointer``; offline
``inspect_checkpoint``, ``consolidate`` (one safetensors file or a transformers directory)
and ``reshard``.

See ``docs/checkpoint-format.md`` for the format.
"""

from .._checkpoint import Checkpointer, CheckpointFuture, async_save, load, save
from .._ckpt_target import CheckpointInfo
from .._ckpt_tools import consolidate, inspect_checkpoint, reshard
from .._errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointFuture",
    "CheckpointInfo",
    "Checkpointer",
    "async_save",
    "consolidate",
    "inspect_checkpoint",
    "load",
    "reshard",
    "save",
]
