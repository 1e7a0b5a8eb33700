"""How a gradient bucket travels: the mesh it travels over, the division policy, the comm.

Where a reduced bucket goes (every rank, or the owner of its range) and how its bytes
travel are one small object, a :class:`BucketComm`, apart from the reducer that decides
*when* a bucket launches. A launch returns a future, as a DDP comm hook does, so a
two-stage reduction (reduce-scatter then all-reduce across replicas, PowerSGD's P then
Q, reduce to a root then broadcast) chains its second stage with ``Future.then`` while
backward still runs, instead of serializing it at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist
from torch.futures import Future

from .._errors import TorchShardError
from .buckets import Bucket

__all__ = [
    "AllReduce",
    "BucketComm",
    "CommError",
    "Mesh1D",
    "ReduceAcrossReplicas",
    "ReduceSpec",
    "ReduceToOwner",
    "fill_mask",
    "landed",
    "settled",
]


class CommError(TorchShardError, ValueError):
    """A ``comm=`` that cannot be used: a bad setting (``rank < 1``, ``ratio`` outside
    (0, 1], ...), a mode or dtype it does not support (raised on every rank alike, when the
    trainer is built), or compression state that does not fit (``load_comm_state``)."""


@dataclass(frozen=True)
class Mesh1D:
    """The ranks a trainer communicates over: one process group (a 1-D mesh).

    Example::

        mesh = Mesh1D.of(None)                  # the default group
        dist.broadcast(t, mesh.global_rank(0), group=mesh.group)
    """

    group: dist.ProcessGroup | None
    rank: int
    """This process's rank in ``group``."""
    size: int
    global_ranks: tuple[int, ...]
    """The global rank of each rank of ``group``, by group rank."""

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Mesh1D:
        """The mesh over ``group`` (``None``: the default group).

        Example::

            Mesh1D.of(dist.new_group([0, 1])).global_rank(1)   # 1
        """
        size = dist.get_world_size(group)
        ranks = range(size) if group is None else dist.get_process_group_ranks(group)
        return cls(group, dist.get_rank(group), size, tuple(ranks))

    def global_rank(self, rank: int) -> int:
        """The global rank of ``rank`` of the group (torch's collectives name roots so).

        Example::

            mesh.global_rank(mesh.rank) == dist.get_rank()
        """
        return self.global_ranks[rank]


@dataclass(frozen=True)
class ReduceSpec:
    """How a sum over ranks becomes the mean, decided once: ``op`` on the wire, each bucket
    multiplied by ``pre`` before it travels, the reduced result divided by ``post`` after.

    Example::

        spec = ReduceSpec.of(4, torch.float32, None, prefer_pre=True)
        spec   # ReduceSpec(op=SUM, pre=0.25, post=1.0): DDP's order
    """

    op: dist.ReduceOp.RedOpType
    dtype: torch.dtype | None = None
    """The dtype gradients travel and are summed in (``reduce_dtype``; ``None``: their own)."""
    pre: float = 1.0
    """Factor applied to a bucket before it travels (``1 / world``: DDP's, times the
    reciprocal, not a division)."""
    post: float = 1.0
    """Divisor applied to the reduced sum where the mean is kept (``world``)."""

    @classmethod
    def of(
        cls,
        world_size: int,
        dtype: torch.dtype | tuple[torch.dtype, ...],
        native: dist.ReduceOp.RedOpType | None,
        *,
        prefer_pre: bool,
        wire: torch.dtype | None = None,
    ) -> ReduceSpec:
        """The spec for a group of ``world_size`` and gradients of ``dtype`` (or of each of
        several), reduced in ``wire`` (e.g. fp32 for bf16 gradients; ``None`` or ``dtype``:
        in their own).

        ``native`` is the backend's averaging op (``ReduceOp.AVG`` on NCCL, else ``None``):
        then no scaling pass at all. Otherwise float16 scales before (it tops out at 65504:
        a sum over ranks overflows where the mean would not), and so does a mode that
        prefers it (``prefer_pre``: the replicated mode, as DDP); the rest divide after.

        Example::

            ReduceSpec.of(2, torch.bfloat16, None, prefer_pre=False).post   # 2.0
        """
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        wire = None if all(d == wire for d in dtypes) else wire
        if world_size == 1:
            return cls(dist.ReduceOp.SUM)
        if native is not None:
            return cls(native, wire)
        fp16 = wire == torch.float16 if wire is not None else torch.float16 in dtypes
        if fp16 or prefer_pre:
            return cls(dist.ReduceOp.SUM, wire, pre=1.0 / world_size)
        return cls(dist.ReduceOp.SUM, wire, post=float(world_size))

    def on_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the dtype it travels in: itself, or a transient copy in :attr:`dtype`."""
        return t if self.dtype is None or t.dtype == self.dtype else t.to(self.dtype)

    def scale_before(self, t: torch.Tensor) -> None:
        """Apply ``pre`` to ``t`` in place (nothing when it is 1)."""
        if self.pre != 1.0:
            t.mul_(self.pre)

    def scale_after(self, t: torch.Tensor) -> None:
        """Apply ``post`` to ``t`` in place (nothing when it is 1)."""
        if self.post != 1.0:
            t.div_(self.post)


class BucketComm(Protocol):
    """How one bucket travels and where it lands; the reducer calls :meth:`launch` once per
    bucket, in bucket order, on every rank (during backward, on the autograd thread).

    A comm with a second stage that must not run from a future's callback (a collective
    issued from a backend's thread could be issued in another order on another rank) may
    also define ``flush() -> int``: the reducer calls it once the launches' futures
    completed; it finishes the second stage, waits for it, and returns the bytes it sent
    across replicas (see :class:`ReduceAcrossReplicas`).

    Optional attributes the reducer reads: ``payload_bytes`` (bytes handed to collectives so
    far, in the dtype they travelled in: ``trainer.stats.payload_bytes``), ``runs_alone``
    (launch and flush in a world of one too: a lossy comm whose update must not depend on
    the world size).
    """

    fuses_mask: ClassVar[bool]
    """The used-parameter mask may ride in a bucket's buffer: the comm delivers the result
    to every rank, losslessly (not a bf16 wire format, not a low-rank approximation)."""

    def launch(self, view: torch.Tensor, spec: ReduceSpec, bucket: Bucket) -> Future[torch.Tensor]:
        """Start reducing ``view`` (``bucket``'s gradient, in place) by ``spec``; the future
        completes once ``view`` holds the result wherever this comm delivers it. No host
        synchronization here."""
        ...


def fill_mask(mask: torch.Tensor, used: list[bool]) -> bool:
    """Write the used-parameter mask (1 where this rank has a gradient) on the device; True
    when every parameter is used: then a kernel fills it (no host-to-device copy) and the
    reduced mask is all ones, nothing to read back.

    Example::

        if not fill_mask(mask, used):
            ...   # reduce it, then read it back: some rank may lack a gradient
    """
    if all(used):
        mask.fill_(1)
        return True
    mask.copy_(torch.tensor(used, dtype=mask.dtype))
    return False


def landed(work: dist.Work, wire: torch.Tensor, dest: torch.Tensor) -> Future[torch.Tensor]:
    """``work``'s future, completing with ``dest`` once the reduced ``wire`` (the bucket in
    its travelling dtype) was written there (nothing to write when ``wire`` is ``dest``), as
    a DDP compression hook writes its result back.

    Example::

        wire = spec.on_wire(view)
        fut = landed(dist.all_reduce(wire, async_op=True), wire, view)
    """
    if wire is dest:
        return settled(work, dest)

    def done(f: Future[object]) -> torch.Tensor:
        f.value()
        dest.copy_(wire)
        return dest

    return work.get_future().then(done)


def settled(work: dist.Work, result: torch.Tensor) -> Future[torch.Tensor]:
    """``work``'s future, completing with ``result`` (a failure of ``work`` propagates).

    Example::

        fut = settled(dist.all_reduce(t, async_op=True), t)
        fut.wait() is t
    """

    def done(f: Future[object]) -> torch.Tensor:
        f.value()  # raises what the collective raised
        return result

    return work.get_future().then(done)


class AllReduce:
    """Every rank gets the reduced bucket (DDP's default hook).

    Example::

        comm = AllReduce(Mesh1D.of(None))
        comm.launch(grad[b.start : b.end], spec, b).wait()
    """

    fuses_mask: ClassVar[bool] = True

    def __init__(self, mesh: Mesh1D) -> None:
        self.mesh = mesh
        self.payload_bytes = 0

    def launch(self, view: torch.Tensor, spec: ReduceSpec, bucket: Bucket) -> Future[torch.Tensor]:
        """All-reduce ``view`` over the mesh by ``spec`` (in its dtype; back into ``view``)."""
        wire = spec.on_wire(view)
        spec.scale_before(wire)
        work = dist.all_reduce(wire, op=spec.op, group=self.mesh.group, async_op=True)
        self.payload_bytes += bucket.elements * wire.element_size()  # the mask not counted
        return landed(work, wire, view)


class ReduceToOwner:
    """Only the owner of a bucket's range gets the reduced bucket (ZeRO-2's reduction).

    Example::

        comm = ReduceToOwner(mesh, lambda b: geometry.owner(b.start))
    """

    fuses_mask: ClassVar[bool] = False  # the mask must reach every rank, not the owner only

    def __init__(
        self,
        mesh: Mesh1D,
        owner: Callable[[Bucket], int],
        sink: Callable[[Bucket], torch.Tensor] | None = None,
    ) -> None:
        self.mesh, self.owner, self.sink = mesh, owner, sink
        """``sink(bucket)``: where a bucket reduced in another dtype than the gradient's lands
        on its owner (the master gradient: no rounding to the gradient's dtype on the way)."""
        self.payload_bytes = 0

    def launch(self, view: torch.Tensor, spec: ReduceSpec, bucket: Bucket) -> Future[torch.Tensor]:
        """Reduce ``view`` by ``spec`` to the group rank ``owner(bucket)``."""
        wire = spec.on_wire(view)
        spec.scale_before(wire)
        owner = self.owner(bucket)
        dst = self.mesh.global_rank(owner)
        work = dist.reduce(wire, dst, op=spec.op, group=self.mesh.group, async_op=True)
        self.payload_bytes += bucket.elements * wire.element_size()
        if owner != self.mesh.rank:
            return settled(work, view)  # nothing lands here
        dest = self.sink(bucket) if self.sink is not None and wire is not view else view
        return landed(work, wire, dest)


class ReduceAcrossReplicas(ReduceToOwner):
    """Hybrid sharding's reduction (ZeRO-2 inside a shard group, then across replicas): each
    bucket is reduced to the owner of its range in the shard group (``mesh``), then the
    owner all-reduces the reduced bucket over ``replicas``, the ranks that own the same
    range in the other replicas (Megatron's distributed optimizer with several instances).

    The all-reduces are issued in bucket order on every rank, from the launching thread
    only: during backward, each launch first issues those whose reduction has completed
    (asked without waiting); :meth:`flush` issues the rest and waits for all. The reduced
    bucket lands (in ``sink``'s tensor when it travelled in another dtype) at the flush.

    Example::

        comm = ReduceAcrossReplicas(shard_mesh, replica_mesh, lambda b: geometry.owner(b.start))
        comm.launch(view, spec, bucket).wait()
        comm.flush()   # now view holds the sum over every replica's shard group
    """

    def __init__(
        self,
        mesh: Mesh1D,
        replicas: Mesh1D,
        owner: Callable[[Bucket], int],
        sink: Callable[[Bucket], torch.Tensor] | None = None,
    ) -> None:
        super().__init__(mesh, owner, sink)
        self.replicas = replicas
        # owned buckets whose reduction was issued, not yet their all-reduce, in order:
        # (reduce, wire, where it lands, spec); then the all-reduces issued: (work, wire, dest)
        self._reduced: list[tuple[dist.Work, torch.Tensor, torch.Tensor, ReduceSpec]] = []
        self._across: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []
        self._sent = 0

    def launch(self, view: torch.Tensor, spec: ReduceSpec, bucket: Bucket) -> Future[torch.Tensor]:
        """Reduce ``view`` to its owner in the shard group; the future completes with that
        stage (the all-reduce across replicas follows, in order)."""
        self._advance(wait=False)
        wire = spec.on_wire(view)
        spec.scale_before(wire)
        owner = self.owner(bucket)
        dst = self.mesh.global_rank(owner)
        work = dist.reduce(wire, dst, op=spec.op, group=self.mesh.group, async_op=True)
        self.payload_bytes += bucket.elements * wire.element_size()
        if owner == self.mesh.rank:
            dest = self.sink(bucket) if self.sink is not None and wire is not view else view
            self._reduced.append((work, wire, dest, spec))
        return settled(work, view)

    def _advance(self, *, wait: bool) -> None:
        """Issue the all-reduce of each owned bucket whose reduction completed, in order
        (``wait``: waiting for each reduction; otherwise up to the first one in flight)."""
        while self._reduced and (wait or self._reduced[0][0].is_completed()):
            work, wire, dest, spec = self._reduced.pop(0)
            work.wait()  # raises what the reduction raised; on NCCL: orders the streams
            group = self.replicas.group
            across = dist.all_reduce(wire, op=spec.op, group=group, async_op=True)
            self._across.append((across, wire, dest))
            self._sent += wire.numel() * wire.element_size()
            self.payload_bytes += wire.numel() * wire.element_size()

    def flush(self) -> int:
        """Issue the remaining all-reduces, wait for every one, land each bucket; the bytes
        all-reduced across replicas since the last flush."""
        self._advance(wait=True)
        for work, wire, dest in self._across:
            work.wait()
            if wire is not dest:
                dest.copy_(wire)
        self._across.clear()
        sent, self._sent = self._sent, 0
        return sent
