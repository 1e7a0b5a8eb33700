"""What a checkpoint save or load acts on, and what a load returns.

The checkpoint layer never imports the trainer class: it reads the
:class:`TrainState` protocol (which ``DistributedTrainer`` satisfies), here only:
what a rank holds is data (``local_shards()``, seen through
:class:`~._stripes.Stripes`), and one hook (``after_load()``) runs after a load;
the other modules reach the trainer through :class:`Target`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from .._dist import exchange_bytes
from .._errors import CheckpointError
from .._flat.layout import FlatLayout
from .._flat.module import FlatParamModule
from .._flat.tp import TensorParallel
from .._parallel.state import TrainState
from ._stripes import Stripes

__all__ = ["CheckpointInfo", "Checkpointable", "PipelineState", "Ranks", "Target"]


@runtime_checkable
class PipelineState(Protocol):
    """What a checkpoint reads of a ``torchshard.Pipeline`` (never its class): ``whole``, the
    whole model on meta; ``plan``, the stage plan (``owned``, ``modules``, ``ties``);
    ``stages``, this rank's ``(index, fm, trainer, stage)`` handles; the degrees and this
    rank's coordinates; ``process_group``, its ranks (``None``: the world)."""

    whole: Any
    plan: Any
    stages: list[Any]
    dp_size: int
    pp_size: int
    dp_rank: int
    pp_rank: int
    process_group: dist.ProcessGroup | None


Checkpointable = TrainState | FlatParamModule | PipelineState
"""What save and load take: a trainer, a pipeline, or a bound ``FlatParamModule`` (a world
of one)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load` restored: the ``step``, the user's ``extra`` dict, the directory,
    and the newer checkpoints a load with ``fallback=True`` skipped.

    Example::

        info = torchshard.checkpoint.load("runs/gpt", trainer, optimizer=opt, fallback=True)
        start = info.step
        sampler.load_state_dict(info.extra["data"])
        for path, why in info.skipped:
            print(f"skipped {path}: {why}")
    """

    step: int
    extra: dict[str, Any]
    path: Path
    bytes_read: int = 0
    """Bytes this rank read from the checkpoint's files."""
    skipped: tuple[tuple[Path, str], ...] = ()
    """``(path, why)`` of each checkpoint a load with ``fallback=True`` skipped, newest first;
    the same on every rank."""
    comm: str = ""
    """What the load did with the compression state of a lossy comm (``PowerSGD``, ``TopK``):
    loaded, dropped (a dense trainer), started at zero (a checkpoint without it), in words;
    ``""`` when neither the checkpoint nor the trainer keeps any. See ``docs/compression.md``."""


@dataclass(frozen=True)
class Ranks:
    """A process group as a checkpoint uses it: this rank's place in it, and its size.

    Example::

        Ranks(None, 0, 1).global_rank(0)  # 0: a world of one
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def global_rank(self, rank: int) -> int:
        """The global rank of ``rank`` of the group (torch's collectives name roots so)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


class Target:
    """What a save or load acts on: a flat module, and the group of ranks holding it.

    With hybrid sharding (``trainer.replicas > 1``) the data-parallel group is
    ``replicas x shards`` ranks: ``cut`` is the shard group the local shards are cut over,
    ``across`` the ranks holding the same shards in the other replicas. Otherwise ``cut`` is
    the data-parallel group and ``across`` is ``None``.
    """

    def __init__(self, obj: Checkpointable) -> None:
        self.trainer = obj if isinstance(obj, TrainState) else None
        self.across: Ranks | None = None
        if self.trainer is not None:
            t = self.trainer
            self.fm, self.group = t.module, t.process_group
            self.rank, self.world, self.device = t.rank, t.world_size, t.device
            self.cut = Ranks(self.group, self.rank, self.world)
            if getattr(t, "replicas", 1) > 1:
                self.cut, self.across = _hybrid(t)
        elif isinstance(obj, FlatParamModule):
            self.fm, self.group, self.rank, self.world = obj, None, 0, 1
            self.device, self.cut = obj.device, Ranks(None, 0, 1)
        else:
            raise CheckpointError(
                f"trainer: expected a DistributedTrainer or a FlatParamModule, got {type(obj).__name__}"
            )
        # What this rank's optimizer updates, when it is not every whole weight; without a
        # flat buffer (shard="full"), all this rank holds of the weights.
        shards = self.trainer.local_shards() if self.trainer is not None else None
        layout = self.fm.layout
        # a buffer of several dtypes: each region's (its positions bytes, its elements typed)
        dtypes = (
            [layout.region_of(a).dtype for a, _ in shards.regions]
            if shards is not None and layout.mixed
            else None
        )
        cut, first = self.cut, self.rank - self.cut.rank  # this shard group's first dp rank
        if shards is not None and any(len(e) != cut.size for e in shards.every):
            raise CheckpointError(
                f"trainer.local_shards(): cut over {len(shards.every[0])} ranks, expected "
                f"{cut.size} (the ranks the trainer shards over); the checkpoint cannot place "
                "its state"
            )
        self.stripes = (
            None
            if shards is None
            else Stripes(shards, cut.group, cut.rank, cut.size, dtypes, first)
        )
        # the weights it holds but never updates (frozen, fully sharded), as the buffer holds
        # them: positions are their elements
        frozen = shards.frozen if shards is not None else None
        self.frozen = (
            None if frozen is None else Stripes(frozen, cut.group, cut.rank, cut.size, None, first)
        )
        if not self.fm.is_bound and self.stripes is None:
            raise CheckpointError(
                "trainer: the FlatParamModule is not bound to a buffer yet (or a fully "
                "sharded trainer holds it: pass the DistributedTrainer instead)"
            )
        # Keys private to the trainer's group and run attempt, and the ranks' heartbeats.
        self.coord = self.trainer.coordinator if self.trainer is not None else None
        self.store = self.coord.store if self.coord is not None else None

    def owns_state(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether ``optimizer`` updates this rank's local shards only (the trainer's own,
        when it shards): then its state is this rank's runs, not whole parameters."""
        return (
            optimizer is not None
            and self.stripes is not None
            and self.trainer is not None
            and self.trainer.optimizer is optimizer
        )

    def covers(self, span: tuple[int, int], rank: int | None = None) -> bool:
        """Whether rank ``rank`` (default: this one) holds every flat element of ``span`` of
        what its optimizer updates (its local shards' runs; without them, every element)."""
        return self.stripes is None or self.stripes.covers(span, rank)

    def trainer_segments(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[list[tuple[int, int, int, torch.Tensor]], list[list[str]]] | None:
        """For the optimizer the trainer built: ``(slot, start, end, tensor)`` of each tensor
        it updates, and every rank's parameter names per param group. ``None`` for any other
        optimizer (it holds whole parameters of the module)."""
        if self.trainer is None or self.trainer.optimizer is not optimizer:
            return None
        segments = list(self.trainer.optimizer_segments())
        return segments, [list(n) for n in self.trainer.group_names]

    def own_segments(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """``(slot, start, end, tensor)`` of each tensor the trainer's optimizer updates
        (none without a trainer or before it built one)."""
        if self.trainer is None or self.trainer.optimizer is None:
            return []
        return list(self.trainer.optimizer_segments())

    def after_load(self) -> None:
        """The weights were loaded: the trainer refreshes what it derives from them now."""
        if self.trainer is not None:
            self.trainer.after_load()

    def exchange(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (a collective: every rank calls it)."""
        return exchange_bytes(data, self.group, self.device)

    @property
    def tp(self) -> TensorParallel | None:
        """The module's tensor parallelism, when it splits over more than one rank."""
        tp = self.fm.tp
        return tp if tp is not None and tp.size > 1 else None

    @property
    def whole(self) -> FlatLayout:
        """The layout a checkpoint stores: the whole model's (of a split module too)."""
        return self.fm.tp.whole if self.fm.tp is not None else self.fm.layout

    @property
    def dp(self) -> Ranks:
        """The data-parallel group: every rank saving or loading."""
        return Ranks(self.group, self.rank, self.world)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Persistent module buffers by state-dict name (parameters excluded)."""
        names = {n for s in self.fm.layout for n in s.names}
        sd = self.fm.module.state_dict(keep_vars=True)
        return {k: v for k, v in sd.items() if k not in names and isinstance(v, torch.Tensor)}


def _hybrid(t: TrainState) -> tuple[Ranks, Ranks]:
    """A hybrid trainer's shard group and replicate group, from its mesh (``trainer.mesh``:
    ``shape`` ``(dp_replicate, dp_shard, tp)``, ``coordinate``, the groups ``dp_shard`` and
    ``dp_replicate``), checked against the trainer's data-parallel rank and size."""
    replicas, mesh = getattr(t, "replicas", 1), getattr(t, "mesh", None)
    shape = getattr(mesh, "shape", None)
    if shape is None or len(shape) != 3 or shape[0] != replicas:
        raise CheckpointError(
            f"trainer: hybrid sharding over {replicas} replicas, but its mesh is {shape} "
            "(expected (dp_replicate, dp_shard, tp) with dp_replicate = trainer.replicas): "
            "a checkpoint cannot tell which ranks hold which shards"
        )
    replica, shard, _ = mesh.coordinate
    shards = shape[1]
    if replica * shards + shard != t.rank or replicas * shards != t.world_size:
        raise CheckpointError(
            f"trainer: data-parallel rank {t.rank} of {t.world_size}, but the mesh puts it at "
            f"replica {replica}, shard {shard} of {shape}; expected rank = replica x dp_shard "
            "+ shard"
        )
    return Ranks(mesh.dp_shard, shard, shards), Ranks(mesh.dp_replicate, replica, replicas)
