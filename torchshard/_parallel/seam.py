"""The seam between the trainer's mode-free core and a parallel mode: three small protocols.

- :class:`Storage`: where the weights live (plan from the module, fingerprint, bind);
- :class:`GradSync`: how gradients become the mean (the bucket reducer over a comm, or a
  mode's own schedule);
- :class:`UpdateShard`: what the optimizer updates (segments, gradients, norm, after-step).

:class:`Context` is what a mode may use of the trainer; it carries the mesh the ranks form
(the data-parallel group, and under hybrid sharding its shard and replicate groups) and the
division policy (:class:`~torchshard._parallel.comm.ReduceSpec`), decided once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .._flat.geometry import Geometry
from .._flat.module import FlatParamModule
from .comm import Mesh1D, ReduceSpec
from .shards import LocalShards

__all__ = ["CommStats", "Context", "GradSync", "Segment", "Storage", "UpdateShard"]

Segment = tuple[int, int, int, torch.Tensor]
"""``(slot, start, end, tensor)``: a tensor the optimizer updates, and its flat range."""


@dataclass(frozen=True)
class Context:
    """What a mode may use of the trainer: the module, the mesh, the buffer's geometry and
    the division policy.

    :attr:`mesh` is the data-parallel group: the mean is over its ranks (``world_size``), and
    so are the used-parameter mask and the gradient norm. Under hybrid sharding the buffer is
    cut over :attr:`shards` (a shard group) instead, and :attr:`replicas` hold the same cut.
    """

    fm: FlatParamModule
    mesh: Mesh1D
    device: torch.device
    geometry: Geometry
    """The gradient space (``fm.layout.grad_layout``: the trainable slots) over the ranks."""
    params: tuple[torch.nn.Parameter, ...]
    """The module's parameters (views of the flat buffer), by slot."""
    trainable: tuple[int, ...]
    """Slot indices of the parameters that require grad."""
    spec: ReduceSpec
    """How a sum over the ranks becomes the mean (computed once, by the trainer)."""
    cut: Mesh1D | None = None
    """Hybrid sharding: the ranks the buffer is cut over (a shard group of the mesh);
    ``None``: :attr:`mesh` itself (see :attr:`shards`)."""
    replicas: Mesh1D | None = None
    """Hybrid sharding: the ranks holding the same cut in the other replicas, across which
    a reduced cut is all-reduced; ``None``: no replicas."""

    @property
    def shards(self) -> Mesh1D:
        """The ranks the buffer is cut over: :attr:`cut`, else the whole :attr:`mesh`."""
        return self.mesh if self.cut is None else self.cut

    @property
    def replica_count(self) -> int:
        """How many replicas hold each cut (1: none besides this one)."""
        return 1 if self.replicas is None else self.replicas.size

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.mesh.group

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.size

    def global_rank(self, rank: int) -> int:
        return self.mesh.global_rank(rank)

    @property
    def flat(self) -> torch.Tensor:
        assert self.fm.flat_param is not None
        return self.fm.flat_param

    @property
    def grad(self) -> torch.Tensor:
        assert self.fm.flat_grad is not None
        return self.fm.flat_grad


@dataclass
class CommStats:
    """Counters of the gradient communication (for logs and tests).

    Example::

        s = trainer.stats
        print(f"{s.launched_during_backward}/{s.buckets} buckets started in backward, "
              f"{1e3 * s.wait_seconds / s.steps:.1f} ms/step waiting")
    """

    steps: int = 0
    """``average_gradients()`` calls so far."""
    buckets: int = 0
    """Buckets that carry gradients."""
    launched_during_backward: int = 0
    """Buckets of the last step whose all-reduce started inside backward (from a gradient
    hook). Not a measure of overlap: with the whole model compiled, backward is one graph
    and every hook runs after its last kernel, yet each launch still counts here."""
    wait_seconds: float = 0.0
    """Total time ``average_gradients()`` spent waiting for communication (host time:
    meaningful on gloo; on NCCL ``wait()`` only orders the streams and returns at once)."""
    bytes_reduced: int = 0
    """Bytes of gradient buffers handed to reductions (all-reduce, reduce, reduce-scatter),
    counted at their full size, since the trainer was built."""
    bytes_gathered: int = 0
    """Bytes of weight buffers all-gathered (sharded: after each step; fully sharded: each
    unit before its forward and again before its backward), at their full size."""
    bytes_across_replicas: int = 0
    """Hybrid sharding: bytes of reduced gradient all-reduced across replicas (each owner's
    buckets, over its replicate group), at their full size; 0 without replicas."""
    payload_bytes: int = 0
    """Bytes of gradient that went on the wire since the trainer was built, as the comm sent
    them (``comm=``, :mod:`torchshard.comm`): each buffer handed to a collective counted
    once, at its size in the dtype it travelled in (an all-gather at its output: what each
    rank sends and receives; a two-stage comm counts both stages). With the default comm,
    :attr:`bytes_reduced` (plus :attr:`bytes_across_replicas`) in the dtype summed in;
    ``BF16()`` half of a float32 model's; the used-parameter mask is not counted."""


class Storage(Protocol):
    """Where the weights live. The trainer calls, in this order and on every rank alike:
    ``prepare`` (no tensor, no collective), ``fingerprint`` (compared across ranks before
    anything is allocated), ``adopt`` (bind, initialize, broadcast from ``src``)."""

    def prepare(self, fm: FlatParamModule) -> None: ...

    def fingerprint(self) -> str: ...

    def adopt(
        self,
        fm: FlatParamModule,
        device: torch.device,
        group: dist.ProcessGroup | None,
        src: int,
        init_fn: Callable[[torch.nn.Module], None] | None,
        cut: Mesh1D | None = None,
    ) -> tuple[torch.nn.Parameter, ...]: ...

    def gathered(self) -> contextlib.AbstractContextManager[None]: ...


class GradSync(Protocol):
    """How gradients become the mean: hears backward, finishes in ``average_gradients``."""

    sync: bool
    """False inside ``no_sync()``."""
    averaged: bool
    """The gradients are the mean since the last backward."""
    stats: CommStats

    def finish(self) -> None: ...

    def close(self) -> None: ...


class UpdateShard(Protocol):
    """What the optimizer updates, and what becomes of the reduced gradient for it."""

    def finish(self, ctx: Context) -> None:
        """Every reduction completed: make the reduced sum the mean where it is kept."""
        ...

    def attach_grads(self, ctx: Context, used: dict[int, bool]) -> None: ...

    def optimizer_tensors(self, ctx: Context) -> list[Segment]: ...

    def local_grads(self, ctx: Context) -> list[torch.Tensor]: ...

    def norm(self, ctx: Context, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor: ...

    def after_step(self, ctx: Context) -> None: ...

    def local_shards(self, ctx: Context) -> LocalShards | None: ...
