"""The exceptions torchshard raises. Every one is a :class:`TorchShardError`.

Also :func:`and_more`, how their messages list things.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ArgumentError",
    "BindError",
    "CheckpointError",
    "DataError",
    "DeviceError",
    "LayoutError",
    "MeshError",
    "PipelineError",
    "RankMismatchError",
    "TPPlanError",
    "TorchShardError",
    "UnwrittenBufferError",
    "and_more",
]


class TorchShardError(Exception):
    """Base class of every error torchshard raises on bad input or bad state."""


class LayoutError(TorchShardError, ValueError):
    """A module cannot be laid out in one flat buffer (mixed dtypes, no parameters, ...)."""


class BindError(TorchShardError, ValueError):
    """A buffer handed to :meth:`FlatParamModule.bind` does not fit the layout."""


class DeviceError(TorchShardError, RuntimeError):
    """No device fits this rank: more ranks on a node than GPUs, or no local rank to pick one."""


class MeshError(TorchShardError, ValueError):
    """A device mesh that does not fit the job: sizes that do not tile the world size, or a
    node size (``LOCAL_WORLD_SIZE``) the shard size does not divide (:func:`init_mesh`).

    Raised on every rank alike.
    """


class TPPlanError(TorchShardError, ValueError):
    """A tensor-parallel plan that does not fit the model: a glob that names no module, a
    style for another module type, a size the degree does not divide, a tied parameter split
    two ways. Raised on every rank alike, when the model is wrapped."""


class RankMismatchError(TorchShardError):
    """Ranks disagree: they built different models, or their weights drifted apart.

    Raised on every rank, so no rank is left waiting in a collective.
    """


class CheckpointError(TorchShardError):
    """A checkpoint cannot be written or read: missing, corrupt, incompatible or unwritable.

    The message names the file (and parameter) at fault. A load that raises
    it has changed nothing.
    """


class DataError(TorchShardError, ValueError):
    """A data sampler got a bad argument or saved state, or cannot know its position exactly."""


class UnwrittenBufferError(TorchShardError, RuntimeError):
    """Forward read a buffer built on meta that nothing wrote: it holds zeros, not its values.

    The message names the buffer and how to write it (an init function, a checkpoint).
    """


class ArgumentError(TorchShardError, ValueError):
    """A bad argument to a checkpoint tool: a missing path, a bad world size or output."""


def and_more(items: Sequence[object], limit: int = 3) -> str:
    """``items`` for a message: the first ``limit``, and how many were cut (``"a, b, c and 5
    more"``), so that a message never shows part of a list as if it were all of it."""
    shown = ", ".join(str(i) for i in items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


class PipelineError(TorchShardError, ValueError):
    """A pipeline that cannot run as asked: a split that leaves out or repeats a module or
    breaks the layout's order, a degree the world size does not divide, a batch the
    microbatches do not divide, a schedule not supported. Raised on every rank alike,
    before the first step."""
