"""Bytes a training step hands to collectives, per rank, from the layout alone (no process
group): :func:`plan_comm`, the communication side of :func:`plan_memory`.

The counts are the trainer's own (:class:`CommStats`): each collective's buffer at its full
size, per step (one backward, one optimizer step), from the same geometry the trainer cuts
by (``Geometry`` and ``unit_geometry``), so a test compares them to ``trainer.stats`` to
the byte. Under hybrid sharding the reductions and gathers run inside a shard group and the
reduced cut is all-reduced across the replicas; :class:`CommPlan` keeps the two apart and,
given the node size, says which of them crosses nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._flat.geometry import Geometry
from .._flat.layout import FlatLayout
from .footprint import PlanError, typed
from .memory import asked, shard_size
from .modes import Choice
from .tpcost import TPTraffic, tp_layout, tp_traffic
from .units import Unit, stripe_parts, unit_geometry, unit_pieces

__all__ = ["CommPlan", "node_spans", "plan_comm"]


@dataclass(frozen=True, kw_only=True)
class CommPlan:
    """Bytes one rank hands to collectives in one training step, as ``trainer.stats``
    counts them (each collective's buffer at its full size; ``*_sent``: what a ring
    algorithm sends from each rank).

    ``group_size`` ranks run the reductions and gathers (a shard group under hybrid
    sharding, else the whole data-parallel group); ``dp_replicate`` groups hold the same
    cut, and each reduced cut is all-reduced across them (``bytes_across_replicas``).

    Example::

        plan = torchshard.plan_comm(layout, 512, shard=True, dp_replicate=64, gpus_per_node=8)
        plan.bytes_reduced, plan.bytes_gathered, plan.bytes_across_replicas
        plan.group_nodes, plan.replica_nodes      # 1 (node-local), 64 (across nodes)
    """

    world_size: int
    """The data-parallel size."""
    dp_replicate: int
    """Replicas of each cut (1: none)."""
    group_size: int
    """The ranks each reduction and gather runs over: ``world_size // dp_replicate`` in a
    sharded mode, ``world_size`` in the replicated one (DDP over every rank)."""
    reduction: str
    """How gradients are reduced inside the group: ``"all-reduce"`` (replicated),
    ``"reduce"`` (each bucket to the owner of its slice) or ``"reduce-scatter"`` (each
    unit into the stripes)."""
    bytes_reduced: int
    """Gradient bytes handed to reductions inside the group (``CommStats.bytes_reduced``)."""
    bytes_gathered: int
    """Weight bytes all-gathered inside the group (``CommStats.bytes_gathered``)."""
    across: tuple[int, ...] = ()
    """``CommStats.bytes_across_replicas`` of each data-parallel rank (empty: no replicas):
    the reduced cut it owns, all-reduced across its replicate group."""
    gpus_per_node: int | None = None
    group_nodes: int | None = None
    """The most nodes one group spans (1: node-local); ``None`` without ``gpus_per_node``."""
    replica_nodes: int | None = None
    """The most nodes one replicate group spans; ``None`` without ``gpus_per_node``."""
    tp: int = 1
    """Tensor-parallel ranks (``init_mesh(tp=T)``); the bytes above are then the local flat
    buffer's, each tp rank's data-parallel traffic over its own group."""
    tp_activations: TPTraffic = field(default_factory=TPTraffic)
    """Activation bytes per token the split layers hand to the tp group (:func:`tp_traffic`);
    not in ``trainer.stats``: they scale with the batch, not the layout."""

    @property
    def bytes_across_replicas(self) -> int:
        """The most any rank all-reduces across replicas (ranks whose cut is all padding
        send less)."""
        return max(self.across, default=0)

    @property
    def group_sent(self) -> int:
        """Bytes a rank sends inside its group in a ring: ``2 (n - 1) / n`` of an
        all-reduce, ``(n - 1) / n`` of a reduce-scatter (or the owners' reductions) and of
        an all-gather."""
        n = self.group_size
        reduced = self.bytes_reduced * (2 if self.reduction == "all-reduce" else 1)
        return (reduced + self.bytes_gathered) * (n - 1) // n

    @property
    def replica_sent(self) -> int:
        """Bytes the worst rank sends across replicas in a ring all-reduce:
        ``2 (R - 1) / R`` of :attr:`bytes_across_replicas`."""
        r = self.dp_replicate
        return 2 * (r - 1) * self.bytes_across_replicas // r

    def stats(self, rank: int) -> dict[str, int]:
        """What ``trainer.stats`` of data-parallel rank ``rank`` adds in one step.

        Example::

            got = trainer.stats
            assert got.bytes_reduced == steps * plan.stats(trainer.rank)["bytes_reduced"]
        """
        across = self.across[rank] if self.across else 0
        return {
            "bytes_reduced": self.bytes_reduced,
            "bytes_gathered": self.bytes_gathered,
            "bytes_across_replicas": across,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_size": self.group_size,
            "dp_replicate": self.dp_replicate,
            "reduction": self.reduction,
            "bytes_reduced": self.bytes_reduced,
            "bytes_gathered": self.bytes_gathered,
            "bytes_across_replicas": self.bytes_across_replicas,
            "group_sent": self.group_sent,
            "replica_sent": self.replica_sent,
            "gpus_per_node": self.gpus_per_node,
            "group_nodes": self.group_nodes,
            "replica_nodes": self.replica_nodes,
            "tp": self.tp,
            "tp_forward_per_token": self.tp_activations.forward,
            "tp_backward_per_token": self.tp_activations.backward,
        }


def plan_comm(
    layout: FlatLayout,
    world_size: int,
    *,
    shard: bool | str | Choice,
    dp_replicate: int = 1,
    units: Sequence[Unit] | None = None,
    reshard_after_forward: bool = True,
    reduce_dtype: torch.dtype | None = None,
    gpus_per_node: int | None = None,
    tp: int = 1,
    tp_plan: Mapping[str, str] | None = None,
) -> CommPlan:
    """The bytes each rank hands to collectives in one step, by the trainer's own cutting
    rules: what ``trainer.stats`` adds per step (one backward, one step).

    Args:
        layout, world_size, shard, dp_replicate, units: as :func:`plan_memory`.
        reshard_after_forward: fully sharded: as the trainer's (``False``: each unit is
            gathered once a step, not twice).
        reduce_dtype: as the trainer's: the dtype gradients are summed in.
        gpus_per_node: ranks per node (torchrun's ``LOCAL_WORLD_SIZE``): then the plan says
            how many nodes each group spans, ranks numbered as :func:`init_mesh` numbers
            them (replicate outermost: shard groups are consecutive ranks). Ranks here are
            data-parallel ranks: with ``tp``, each node holds ``gpus_per_node // tp`` of them.
        tp, tp_plan: tensor parallelism, as :func:`plan_memory`: the data-parallel bytes are
            the local layout's (a split parameter moves ``1/T`` of its bytes), and
            ``tp_activations`` the split layers' activation traffic per token
            (:func:`tp_traffic`).

    Per step, with ``n`` the group's ranks (``S = world_size // dp_replicate`` in a sharded
    mode, the world size in the replicated one; counted when ``n > 1``), ``b`` the
    gradients' item size and ``w`` the reduce dtype's (else ``b``):

    - replicated: each bucket all-reduced: the gradient space (``layout.grad_layout``), ``b``
      bytes an element. Nothing gathered, nothing across replicas (DDP over every rank).
    - sharded (``shard=True``): each bucket reduced to its slice's owner: the gradient space
      padded to ``S`` slices, up to the end of the last slice holding a parameter, ``b``
      bytes an element (counted when the data-parallel size is above 1); after the step the
      padded space all-gathered (``b``). Across replicas: the rank's own slice of that, in
      ``w``.
    - fully sharded: each unit gathered before its forward and again before its backward
      (kept units once; ``reshard_after_forward=False``: every unit once), padded to ``S``
      stripes, ``b``; each unit with trainable parameters reduce-scattered whole (its
      trainable runs only, when some are frozen), in ``w``. Across replicas: the rank's
      stripe of each such unit, in ``w``.

    Every unit's forward and backward run once a step (activation checkpointing gathers
    again for its recomputation; a unit whose backward never runs is not gathered for it).

    Example::

        plan = plan_comm(fm.layout, 4, shard=True, dp_replicate=2)
        for _ in range(steps):
            ...   # a backward and trainer.step()
        assert trainer.stats.bytes_across_replicas == steps * plan.across[trainer.rank]
    """
    whole, layout = layout, tp_layout(layout, tp, tp_plan)
    how = (units, 1, reshard_after_forward)  # prefetch sizes memory, not traffic
    entry, req = asked(layout, world_size, shard, "adamw", torch.float32, *how)
    if reduce_dtype is not None and not (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        raise PlanError(
            f"reduce_dtype: expected a floating point torch.dtype or None, got {reduce_dtype!r}"
        )
    g = gpus_per_node
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
        raise PlanError(f"gpus_per_node: expected a positive integer, got {g!r}")
    if g is not None and g % tp:
        raise PlanError(
            f"gpus_per_node: tp={tp} must divide the node size {g} (a tp group stays in a node)"
        )
    n = shard_size(world_size, dp_replicate, shard)
    replicas = world_size // n
    wire = _wire(layout, reduce_dtype)
    if not entry.memory.divided:
        reduction, (reduced, gathered, cuts) = "all-reduce", _replicated(layout, n)
    elif entry.gathers:
        again = 2 if req.reshard_after_forward else 1
        reduction = "reduce-scatter"
        reduced, gathered, cuts = _stripes(layout, req.units, n, again, wire, replicas > 1)
    else:
        reduction = "reduce"
        reduced, gathered, cuts = _slices(layout, n, world_size, wire, replicas > 1)
    spans = None if g is None else node_spans(world_size, n, g // tp)  # dp ranks a node
    return CommPlan(
        world_size=world_size,
        dp_replicate=replicas,
        group_size=n,
        reduction=reduction,
        bytes_reduced=reduced,
        bytes_gathered=gathered,
        across=tuple(cuts[q % n] for q in range(world_size)) if cuts else (),
        gpus_per_node=g,
        group_nodes=None if spans is None else spans[0],
        replica_nodes=None if spans is None or replicas == 1 else spans[1],
        tp=tp,
        tp_activations=tp_traffic(whole, tp, tp_plan),
    )


def _wire(layout: FlatLayout, reduce_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype gradients travel in where it is not their own (``ReduceSpec``'s rule:
    ``None`` when every parameter already has it)."""
    if reduce_dtype is None or all(d == reduce_dtype for d in layout.dtypes):
        return None
    return reduce_dtype


def _replicated(layout: FlatLayout, n: int) -> tuple[int, int, list[int]]:
    grads = layout.grad_layout
    if n == 1 or not grads.slots:
        return 0, 0, []
    total = Geometry.of(grads, n, pad=False).total
    return total * grads.torch_dtype.itemsize, 0, []


def _slices(
    layout: FlatLayout, n: int, world_size: int, wire: torch.dtype | None, hybrid: bool
) -> tuple[int, int, list[int]]:
    """The sharded mode: buckets cut at the slice starts; a bucket holding no parameter
    (padding past the last one) is never reduced."""
    grads = layout.grad_layout
    if not grads.slots:
        return 0, 0, []
    space = Geometry.of(grads, n, pad=True)
    per, itemsize = space.per_rank, grads.torch_dtype.itemsize
    last = max(s.end for s in grads.slots)
    end = min(space.total, -(-last // per) * per)  # the buckets that hold a parameter end
    reduced = end * itemsize if world_size > 1 else 0
    gathered = space.total * layout.torch_dtype.itemsize if n > 1 else 0
    if not hybrid:
        return reduced, gathered, []
    cuts = []
    for a, b in space.ranges():  # each owner's reduced slice, in the dtype it travels in
        pieces = typed(grads, a, min(b, end))
        cuts.append(sum(k * (wire or d).itemsize for d, k in pieces))
    return reduced, gathered, cuts


def _stripes(
    layout: FlatLayout,
    units: Sequence[Unit],
    n: int,
    again: int,
    wire: torch.dtype | None,
    hybrid: bool,
) -> tuple[int, int, list[int]]:
    """The fully sharded mode: units gathered and reduce-scattered over ``n`` ranks."""
    if n == 1:
        return 0, 0, []
    itemsize = layout.torch_dtype.itemsize
    width = (lambda d: d.itemsize) if layout.mixed else (lambda d: 1)
    gathered = reduced = every = 0  # every: what each rank all-reduces alike
    cuts = [0] * n if hybrid else []
    plain = layout.grad_layout is layout and not layout.mixed  # a stripe is one piece
    for u in units:
        g = unit_geometry(u, n, layout.align)
        gathered += g.total * itemsize * (1 if u.kept else again)
        if not any(s.requires_grad for s in layout.slots[u.lo : u.hi]):
            continue  # nothing to reduce
        pieces = unit_pieces(layout, u, g)
        reduced += sum((y - x) // width(d) * (wire or d).itemsize for x, y, d in pieces)
        if hybrid and plain:
            every += g.per_rank * (wire or layout.torch_dtype).itemsize
        elif hybrid:  # this rank's parts of the unit's pieces
            for q in range(n):
                parts, _ = stripe_parts(pieces, *g.range(q))
                cuts[q] += sum((y - x) // width(d) * (wire or d).itemsize for x, y, d in parts)
    return reduced, gathered, [c + every for c in cuts]


def node_spans(world_size: int, group_size: int, gpus_per_node: int) -> tuple[int, int]:
    """The most nodes one shard group spans (``group_size`` consecutive ranks, as
    :func:`init_mesh` numbers them) and one replicate group (every ``group_size``-th rank),
    with ``gpus_per_node`` ranks a node, filled in rank order (torchrun's).

    Example::

        node_spans(512, 32, 8)   # (4, 16): a shard group spans 4 nodes, 16 replicas 16
    """
    n = group_size
    node = [q // gpus_per_node for q in range(world_size)]
    groups = max(node[a + n - 1] - node[a] + 1 for a in range(0, world_size, n))
    across = max(len(set(node[s::n])) for s in range(n))
    return groups, across
