"""What the checkpoint layer reads of a trainer: a protocol, never the trainer class.

``DistributedTrainer`` satisfies it; a bare ``FlatParamModule`` is adapted to it by the
checkpoint layer as a world of one (DCP reads ``Stateful`` the same way).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from .._dist import Coordinator
from .._flat.module import FlatParamModule
from .mode import Segment
from .shards import LocalShards, MemoryStats

__all__ = ["LocalShards", "MemoryStats", "TrainState"]


@runtime_checkable
class TrainState(Protocol):
    """A bound flat module and the group of ranks that hold it, as save and load need them."""

    module: FlatParamModule
    rank: int
    world_size: int
    device: torch.device
    group_names: list[list[str]]
    """Parameter names per param group of that optimizer, on every rank alike."""

    @property
    def process_group(self) -> dist.ProcessGroup | None: ...

    @property
    def coordinator(self) -> Coordinator | None:
        """Store keys private to the group and run attempt, and heartbeats (world > 1)."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer ``make_optimizer`` built, if any."""
        ...

    def optimizer_segments(self) -> list[Segment]:
        """``(slot, start, end, tensor)`` for each tensor that optimizer updates."""
        ...

    def local_shards(self) -> LocalShards | None:
        """What this rank's optimizer updates of the flat buffer (``None``: whole weights);
        the checkpoint plans its reads and writes on this alone."""
        ...

    def after_load(self) -> None:
        """A load wrote the weights (the flat buffer or the local shards): refresh what the
        trainer derives from them now (units gathered at the moment)."""
        ...
