"""Sharded checkpoints: ``save``, ``async_save``, ``load``, ``Checkpointer``; offline
``inspect_checkpoint``, ``consolidate`` (one safetensors file or a transformers directory)
and ``reshard``.

See ``docs/checkpoint-format.md`` for the format.
"""

from .._errors import CheckpointError
from ._inspect import inspect_checkpoint
from ._load import load
from ._manager import Checkpointer
from ._save import CheckpointFuture, async_save, save
from ._target import CheckpointInfo
from ._tools import consolidate, reshard

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
