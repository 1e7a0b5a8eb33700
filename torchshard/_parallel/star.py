"""Star aggregation (the parameter-server topology): each bucket reduced to one root rank,
then sent on from there: broadcast to every rank, or sent to the owner of its slice."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from .buckets import Bucket
from .comm import Mesh1D, ReduceSpec, settled

__all__ = ["StarComm"]


class StarComm:
    """Reduce each bucket to ``root``, then broadcast it (``owner`` ``None``: every rank
    gets it) or send it to ``owner(bucket)`` (a sharded mode; ``sink`` as
    :class:`~torchshard._parallel.comm.ReduceToOwner`'s).

    Both stages run on the trainer's group, from the launching thread, in one order on
    every rank: the launch of bucket ``k`` issues its reduce, then the second stage of
    bucket ``k - 1`` (waiting for its reduce, which had a bucket's backward to finish);
    :meth:`flush` issues the last one and waits for all.

    Example::

        comm = StarComm(mesh, root=0)
        comm.launch(view, spec, bucket).wait()
        comm.flush()   # now view holds the sum on every rank
    """

    runs_alone = False

    def __init__(
        self,
        mesh: Mesh1D,
        root: int,
        owner: Callable[[Bucket], int] | None = None,
        sink: Callable[[Bucket], torch.Tensor] | None = None,
    ) -> None:
        self.mesh, self.root, self.owner, self.sink = mesh, root, owner, sink
        self.fuses_mask = owner is None  # the mask must reach every rank
        self.payload_bytes = 0
        """Bytes handed to the reduces, broadcasts, sends and receives so far."""
        # reduced, not sent on yet: (reduce, wire, where it lands or None, bucket); then
        # the second stages issued: (work or None, wire, where it lands or None)
        self._reduced: list[tuple[dist.Work, torch.Tensor, torch.Tensor, Bucket]] = []
        self._sent: list[tuple[dist.Work | None, torch.Tensor, torch.Tensor | None]] = []

    def launch(self, view: torch.Tensor, spec: ReduceSpec, bucket: Bucket) -> Future[torch.Tensor]:
        """Reduce ``view`` by ``spec`` to the root; the future completes with that stage."""
        wire = spec.on_wire(view)
        spec.scale_before(wire)
        root = self.mesh.global_rank(self.root)
        work = dist.reduce(wire, root, op=spec.op, group=self.mesh.group, async_op=True)
        self.payload_bytes += bucket.elements * wire.element_size()
        dest = self.sink(bucket) if self.sink is not None and wire is not view else view
        self._reduced.append((work, wire, dest, bucket))
        while len(self._reduced) > 1:
            self._send_on(*self._reduced.pop(0))
        return settled(work, view)

    def _send_on(
        self, reduced: dist.Work, wire: torch.Tensor, dest: torch.Tensor, bucket: Bucket
    ) -> None:
        reduced.wait()  # raises what the reduce raised; on NCCL: orders the streams
        me, group, nbytes = self.mesh.rank, self.mesh.group, bucket.elements * wire.element_size()
        root = self.mesh.global_rank(self.root)
        if self.owner is None:
            work = dist.broadcast(wire, root, group=group, async_op=True)
            self._sent.append((work, wire, dest))
            self.payload_bytes += nbytes
            return
        owner = self.owner(bucket)
        if owner == self.root:
            if me == owner:
                self._sent.append((None, wire, dest))
        elif me == self.root:
            to = self.mesh.global_rank(owner)
            self._sent.append((dist.isend(wire, to, group=group, tag=bucket.index), wire, None))
            self.payload_bytes += nbytes
        elif me == owner:
            work = dist.irecv(wire, root, group=group, tag=bucket.index)
            self._sent.append((work, wire, dest))
            self.payload_bytes += nbytes

    def flush(self) -> int:
        """Issue the last second stage, wait for every one, land each bucket; 0 (no bytes
        cross replicas)."""
        while self._reduced:
            self._send_on(*self._reduced.pop(0))
        for work, wire, dest in self._sent:
            if work is not None:
                work.wait()
            if dest is not None and wire is not dest:
                dest.copy_(wire)
        self._sent.clear()
        return 0
