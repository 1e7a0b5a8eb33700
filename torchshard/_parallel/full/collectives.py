"""The fully sharded mode's communicators and the collectives a unit needs.

A unit is made whole by :func:`gather_unit` and its gradient cut into stripes by
:func:`reduce_scatter_unit`: small functions that take the process group explicitly and
return the async handles (FSDP2's ``_fsdp_collectives``). :class:`UnitComm` owns the
communicators they run on, the counters and the order log, and picks how bytes travel on
gloo (``native``). See [Note: one order per communicator] in ``docs/fully-sharded.md``.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..comm import Mesh1D
from ..reducer import CommStats

__all__ = ["OrderLog", "UnitComm", "gather_unit", "reduce_scatter_unit"]


def gather_unit(
    buf: torch.Tensor,
    n: int,
    rank: int,
    ranks: list[int],
    group: dist.ProcessGroup | None,
    *,
    native: bool,
) -> list[dist.Work]:
    """Start filling ``buf`` (``len(ranks)`` stripes of ``n`` elements, this rank's already in
    place at ``rank * n``) with every rank's stripe; the handles to wait for.

    ``native``: one in-place all-gather; else one broadcast per owner (``ranks``: the
    owners' global ranks), which gloo runs faster than its emulated all-gather.

    Example::

        works = gather_unit(buf, n, rank, ranks, group, native=True)
        for w in works:
            w.wait()
    """
    if native:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        a = rank * n
        return [gather(buf, buf[a : a + n], group=group, async_op=True)]
    return [
        dist.broadcast(buf[q * n : (q + 1) * n], ranks[q], group=group, async_op=True)
        for q in range(len(ranks))
    ]


def reduce_scatter_unit(
    grad: torch.Tensor,
    n: int,
    rank: int,
    ranks: list[int],
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp,
    *,
    native: bool,
) -> tuple[torch.Tensor, list[dist.Work]]:
    """Start reducing ``grad`` (a unit's gradient, ``len(ranks)`` stripes of ``n`` elements)
    over the ranks with ``op``; this rank's reduced stripe (valid once the handles are waited
    for) and the handles.

    ``native``: one reduce-scatter into a new tensor; else one reduce per owner, this rank's
    stripe reduced in place in ``grad``.

    Example::

        out, works = reduce_scatter_unit(grad, n, rank, ranks, group, op, native=True)
    """
    if native:
        out = torch.empty(n, dtype=grad.dtype, device=grad.device)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return out, [rs(out, grad, op=op, group=group, async_op=True)]
    a = rank * n
    works = [
        dist.reduce(grad[q * n : (q + 1) * n], ranks[q], op=op, group=group, async_op=True)
        for q in range(len(ranks))
    ]
    return grad[a : a + n], works


class OrderLog:
    """A running digest of the collectives issued on each communicator: gathers (``"g"``),
    reduce-scatters (``"r"``), the trainer's group (``"m"``) and, under hybrid sharding,
    the all-reduces across replicas (``"a"``)."""

    def __init__(self) -> None:
        self.digests = {k: hashlib.sha256() for k in "grma"}

    def log(self, kind: str, unit: int) -> None:
        self.digests[kind].update(f"{unit};".encode())

    def digest(self) -> str:
        """Equal on every rank, or some rank issued another sequence."""
        return " ".join(f"{k}:{h.hexdigest()[:16]}" for k, h in self.digests.items())


class UnitComm:
    """The communicators of a fully sharded trainer over ``group``: gathers and
    reduce-scatters each on a group of their own (where the ranks can agree on one), the
    trainer's group for the rest.

    Args:
        group: the ranks the units are cut over (``None``: the default group): the
            trainer's group, or under hybrid sharding this rank's shard group.
        device: where the units live (CUDA always gathers and reduces natively).
        native: on gloo, use its all-gather and reduce-scatter instead of a broadcast and a
            reduce per owner (``benchmarks/bench_full.py`` measures both).
        dp: hybrid sharding: the data-parallel group, over which :meth:`broadcast` sends the
            source's weights to every replica (``None``: ``group``).

    Example::

        comm = UnitComm(group, torch.device("cpu"))
        works = comm.gather(u, buf, n)   # logged, counted in comm.stats
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        native: bool = False,
        dp: Mesh1D | None = None,
    ) -> None:
        self.group, self.device = group, device
        self.source = dp or Mesh1D.of(group)  # where the starting weights come from
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.native = device.type == "cuda" or native
        self.global_ranks = [
            dist.get_global_rank(group, r) if group is not None else r for r in range(self.world)
        ]
        self.stats = CommStats()
        self.order = OrderLog()
        self.gather_group = self.reduce_group = group
        self.made_groups = self.destroy_groups = False
        if self.world > 1:
            self._make_groups()

    def _make_groups(self) -> None:
        """See [Note: communicators over a subgroup] in ``docs/fully-sharded.md``."""
        group = self.group
        backend = dist.get_backend(group)
        default = group is None or group == dist.group.WORLD
        if not default:
            known = torch.tensor([len(dist.distributed_c10d._world.pg_names)], device=self.device)
            lo, hi = known.clone(), known.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            if bool(lo != hi):
                return
        local = not default
        ranks = self.global_ranks
        self.gather_group = dist.new_group(ranks, backend=backend, use_local_synchronization=local)
        self.reduce_group = dist.new_group(ranks, backend=backend, use_local_synchronization=local)
        # destroyed at close() only over the default group (the note says why)
        self.made_groups, self.destroy_groups = True, not local

    def own_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups to destroy when the trainer closes (only over the default group)."""
        return (self.reduce_group, self.gather_group) if self.destroy_groups else ()

    def broadcast(self, buf: torch.Tensor, src: int) -> None:
        """``buf`` as rank ``src`` of the trainer's group holds it, on every rank (and every
        replica)."""
        source = self.source
        if source.size > 1:
            dist.broadcast(buf, source.global_rank(src), group=source.group)

    def all_reduce(
        self, unit: int, stripes: list[torch.Tensor], op: dist.ReduceOp, replicas: Mesh1D
    ) -> list[dist.Work]:
        """Start all-reducing unit ``unit``'s reduced stripe (its typed parts, one
        collective each) across ``replicas`` (hybrid sharding: the ranks holding the same
        stripes in the other replicas); the handles."""
        self.order.log("a", unit)
        self.stats.bytes_across_replicas += sum(t.numel() * t.element_size() for t in stripes)
        return [dist.all_reduce(t, op=op, group=replicas.group, async_op=True) for t in stripes]

    def gather(self, unit: int, buf: torch.Tensor, n: int) -> list[dist.Work]:
        """Start gathering unit ``unit`` into ``buf`` (this rank's stripe in place)."""
        self.order.log("g", unit)
        if self.world == 1:
            return []
        self.stats.bytes_gathered += buf.numel() * buf.element_size()
        return gather_unit(
            buf, n, self.rank, self.global_ranks, self.gather_group, native=self.native
        )

    def reduce_scatter(
        self, unit: int, grad: torch.Tensor, n: int, op: dist.ReduceOp
    ) -> tuple[torch.Tensor, list[dist.Work]]:
        """Start reducing unit ``unit``'s gradient ``grad``; this rank's stripe and handles."""
        self.order.log("r", unit)
        if self.world == 1:
            return grad[:n], []
        self.stats.bytes_reduced += grad.numel() * grad.element_size()
        return reduce_scatter_unit(
            grad, n, self.rank, self.global_ranks, self.reduce_group, op, native=self.native
        )

    def reduce_to_owners(
        self, unit: int, pieces: list[tuple[int, torch.Tensor]], op: dist.ReduceOp
    ) -> list[dist.Work]:
        """Start reducing unit ``unit``'s gradient given as ``(owner, piece)`` (a stripe of
        bytes of several dtypes, cut into typed pieces), each piece to its owner."""
        self.order.log("r", unit)
        if self.world == 1:
            return []
        self.stats.bytes_reduced += sum(t.numel() * t.element_size() for _, t in pieces)
        return [
            dist.reduce(t, self.global_ranks[q], op=op, group=self.reduce_group, async_op=True)
            for q, t in pieces
        ]
