"""The device mesh: data-parallel replicas of shard groups (and a tensor-parallel dimension),
one process group per dimension, created by every rank in one fixed order.

Rank order is torchtitan's: replicate outermost, tp innermost, so global rank
``g = (r * S + s) * T + t`` for replica ``r``, shard rank ``s`` and tp rank ``t``. Shard groups
are then consecutive ranks (one node when ``S * T`` is the node size), and a replicate
group is the ranks at the same place of every shard group.

Every rank calls ``new_group`` for every group of every dimension, members or not, without
``use_local_synchronization``: torch then names the groups by a count that every caller
advances alike, so a group has the same name on all of its members. The ranks first agree
on the arguments (one small exchange over the world), so a rank that asks for another mesh
raises on every rank instead of hanging in ``new_group``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._dist import backend_devices, exchange_bytes, init_distributed, set_data_parallel
from .._errors import MeshError, RankMismatchError, and_more
from .comm import Mesh1D

__all__ = ["DIMS", "Mesh", "init_mesh", "mesh_ranks", "split_dp"]

DIMS = ("dp_replicate", "dp_shard", "tp")
"""The mesh's dimensions, outermost first (the order of :attr:`Mesh.shape`)."""

_CREATION_ORDER = ("tp", "dp_shard", "dp_replicate", "dp")  # the same on every rank


@dataclass(frozen=True, eq=False)
class Mesh:
    """The ranks of a job as ``dp_replicate x dp_shard x tp``, with a process group for each
    dimension (and ``dp``: the data-parallel ranks, ``dp_replicate * dp_shard`` of them).

    Made by :func:`init_mesh`. Each group is a real process group with exactly its members
    (the whole world's is ``dist.group.WORLD``; a dimension of size 1 has groups of one), so
    passing ``group=mesh.tp`` to a collective never silently means the world.

    Example::

        mesh = torchshard.init_mesh(dp_replicate=2)          # 2 replicas of WORLD/2 shards
        trainer = torchshard.DistributedTrainer(fm, mesh=mesh, shard=True)
        sampler = torchshard.GlobalBatchSampler(n, 64, rank=mesh.dp_rank, world_size=mesh.dp_size)
    """

    shape: tuple[int, int, int]
    """``(dp_replicate, dp_shard, tp)``: ranks along each dimension, outermost first."""
    rank: int
    """This process's global rank."""
    world: dist.ProcessGroup
    dp: dist.ProcessGroup
    """The data-parallel ranks at this tp rank (``dp_size`` of them): the gradient mean."""
    dp_shard: dist.ProcessGroup
    """The ranks this rank shards with (same replica, same tp rank)."""
    dp_replicate: dist.ProcessGroup
    """The ranks holding the same shard as this rank in the other replicas."""
    tp: dist.ProcessGroup
    pp_size: int = 1
    """Pipeline ranks (outermost, before ``dp_replicate``): each runs the mesh ``shape``."""
    pp: dist.ProcessGroup | None = None
    """The ranks at this rank's place in every pipeline rank's mesh (``None`` at pp 1)."""

    @property
    def coordinate(self) -> tuple[int, int, int]:
        """This rank's ``(replica, shard rank, tp rank)`` (within its pipeline rank)."""
        r, s, t = self.shape
        local = self.rank % (r * s * t)
        return local // (s * t), local // t % s, local % t

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline rank (0 without pipeline parallelism)."""
        r, s, t = self.shape
        return self.rank // (r * s * t)

    @property
    def dp_rank(self) -> int:
        """This rank among the data-parallel ranks: ``replica * dp_shard + shard rank``."""
        r, s, _ = self.coordinate
        return r * self.shape[1] + s

    @property
    def dp_size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def tp_rank(self) -> int:
        return self.coordinate[2]

    @property
    def tp_size(self) -> int:
        return self.shape[2]

    @property
    def world_size(self) -> int:
        """The ranks of one pipeline rank's mesh (the whole job's at pp 1)."""
        return self.shape[0] * self.shape[1] * self.shape[2]

    def ranks(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` (``"dp_replicate"``, ``"dp_shard"``, ``"tp"`` or ``"dp"``) as
        lists of global ranks, in creation order.

        Example::

            init_mesh(dp_replicate=2).ranks("dp_replicate")   # 4 ranks: [[0, 2], [1, 3]]
        """
        return mesh_ranks(self.shape, self.pp_size)[dim]


def mesh_ranks(shape: tuple[int, int, int], pp: int = 1) -> dict[str, list[list[int]]]:
    """The groups of each dimension of a ``(dp_replicate, dp_shard, tp)`` mesh run by each
    of ``pp`` pipeline ranks (outermost), as lists of global ranks (a pure function: no
    process group in sight); ``"pp"``: the ranks at one place of every pipeline rank.

    Example::

        mesh_ranks((2, 2, 1))["dp_shard"]   # [[0, 1], [2, 3]]
        mesh_ranks((1, 2, 1), pp=2)["pp"]   # [[0, 2], [1, 3]]
    """
    nr, ns, nt = shape
    n = nr * ns * nt
    rows = range(pp)

    def g(r: int, s: int, t: int, p: int = 0) -> int:
        return p * n + (r * ns + s) * nt + t

    return {
        "tp": [
            [g(r, s, t, p) for t in range(nt)] for p in rows for r in range(nr) for s in range(ns)
        ],
        "dp_shard": [
            [g(r, s, t, p) for s in range(ns)] for p in rows for r in range(nr) for t in range(nt)
        ],
        "dp_replicate": [
            [g(r, s, t, p) for r in range(nr)] for p in rows for s in range(ns) for t in range(nt)
        ],
        "dp": [
            [g(r, s, t, p) for r in range(nr) for s in range(ns)] for p in rows for t in range(nt)
        ],
        "pp": [[p * n + i for p in rows] for i in range(n)],
    }


def init_mesh(
    dp_replicate: int = 1, dp_shard: int | str | None = None, tp: int = 1, pp: int = 1
) -> Mesh:
    """Split the world into ``pp x dp_replicate x dp_shard x tp`` ranks and create every group.

    Every rank calls it, with the same arguments (the ranks check that, and raise
    :class:`RankMismatchError` on every rank if not). Initializes the default process group
    from torchrun's environment first if needed (:func:`init_distributed`).

    Args:
        dp_replicate: replicas of the sharded state (the outermost dimension).
        dp_shard: ranks each replica shards over; ``None``: what is left of the world size;
            ``"node"``: one node (``LOCAL_WORLD_SIZE // tp`` ranks), and ``dp_replicate`` the
            number of nodes.
        tp: tensor-parallel ranks (the innermost dimension).
        pp: pipeline ranks (the outermost dimension), for :class:`torchshard.Pipeline`'s
            ``mesh=``; the other sizes then describe one pipeline rank's ``world // pp``.

    Raises:
        MeshError: a size that is not a positive int, sizes whose product is not the world
            size, or ``"node"`` without ``LOCAL_WORLD_SIZE`` or with a node size that does
            not divide the world size (or that ``tp`` does not divide).

    Example::

        mesh = torchshard.init_mesh(dp_shard="node")   # shard in a node, replicate across
        trainer = torchshard.DistributedTrainer(fm, mesh=mesh, shard=True)
    """
    if not dist.is_initialized():
        init_distributed()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    world = dist.get_world_size()
    asked = [repr(dp_replicate), repr(dp_shard), repr(tp), local if dp_shard == "node" else None]
    asked += [repr(pp)] * (pp != 1)  # as before at pp 1
    device = _exchange_device()
    replies = [json.loads(r) for r in exchange_bytes(json.dumps(asked).encode(), None, device)]
    odd = [r for r, a in enumerate(replies) if a != replies[0]]
    if odd:
        raise RankMismatchError(
            f"init_mesh: ranks {and_more(odd)} asked for (dp_replicate, dp_shard, tp, "
            f"LOCAL_WORLD_SIZE) {replies[odd[0]]}, rank 0 for {replies[0]}; every rank must "
            "call init_mesh with the same sizes, on nodes of the same size"
        )
    p = _size("pp", pp)
    if world % p:
        raise MeshError(f"init_mesh(pp={p}): pp does not divide the world size {world}")
    shape = mesh_shape(world // p, dp_replicate, dp_shard, tp, local)
    groups = _create_groups(shape, p)
    mesh = Mesh(shape, dist.get_rank(), dist.group.WORLD, **groups, pp_size=p)  # type: ignore[arg-type]
    set_data_parallel(mesh.dp_rank, mesh.dp_size, world)  # GlobalBatchSampler's default
    return mesh


def mesh_shape(
    world: int, dp_replicate: object, dp_shard: object, tp: object, local: str | None
) -> tuple[int, int, int]:
    """``(dp_replicate, dp_shard, tp)`` for ``world`` ranks and nodes of ``local`` ranks
    (``LOCAL_WORLD_SIZE``; ``None``: unset), or :class:`MeshError` (a pure function).

    Example::

        mesh_shape(8, 2, None, 1, None)   # (2, 4, 1)
    """
    r, t = _size("dp_replicate", dp_replicate), _size("tp", tp)
    if dp_shard == "node":
        n = _node_size(local, world, t)
        nodes = world // n
        if r not in (1, nodes):
            raise MeshError(
                f"init_mesh(dp_replicate={r}, dp_shard='node'): a shard group per node makes "
                f"{nodes} replicas ({world} ranks in nodes of {n}); leave dp_replicate out"
            )
        return nodes, n // t, t
    if dp_shard is None:
        if world % (r * t):
            raise MeshError(
                f"init_mesh: dp_replicate ({r}) x tp ({t}) = {r * t} does not divide the world "
                f"size {world}; pick sizes whose product divides {world}"
            )
        return r, world // (r * t), t
    s = _size("dp_shard", dp_shard, "an int >= 1, None or 'node'")
    if r * s * t != world:
        raise MeshError(
            f"init_mesh: dp_replicate ({r}) x dp_shard ({s}) x tp ({t}) = {r * s * t} ranks, but "
            f"the world size is {world}; pick sizes whose product is {world}, or leave "
            "dp_shard=None to take the rest"
        )
    return r, s, t


def _size(name: str, value: object, expected: str = "an int >= 1") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshError(f"init_mesh({name}=...): expected {expected}, got {value!r}")
    return value


def _node_size(local: str | None, world: int, tp: int) -> int:
    """The ranks per node, checked: set, a positive int, dividing the world, divided by tp."""
    if local is None:
        raise MeshError(
            "init_mesh(dp_shard='node'): LOCAL_WORLD_SIZE is not set, so the node size is "
            "unknown; launch with torchrun, export LOCAL_WORLD_SIZE, or pass dp_shard=<int>"
        )
    try:
        n = int(local)
    except ValueError as e:
        raise MeshError(
            f"init_mesh(dp_shard='node'): LOCAL_WORLD_SIZE: expected an int, got {local!r}"
        ) from e
    if n < 1 or world % n:
        raise MeshError(
            f"init_mesh(dp_shard='node'): nodes of LOCAL_WORLD_SIZE={n} ranks do not divide "
            f"the world size {world}; every node must run the same number of ranks"
        )
    if n % tp:
        raise MeshError(
            f"init_mesh(dp_shard='node', tp={tp}): tp does not divide the node size {n}; "
            "a tensor-parallel group must fit in a node"
        )
    return n


def _create_groups(shape: tuple[int, int, int], pp: int = 1) -> dict[str, dist.ProcessGroup]:
    """Every group of every dimension, created by this rank in one fixed order; the ones
    this rank is a member of, by dimension (``pp`` groups only where ``pp > 1``)."""
    me, world = dist.get_rank(), dist.get_world_size()
    mine: dict[str, dist.ProcessGroup] = {}
    everything = mesh_ranks(shape, pp)
    for dim in _CREATION_ORDER + ("pp",) * (pp > 1):
        for ranks in everything[dim]:
            if len(ranks) == world:  # the world itself: no new group (as DeviceMesh does)
                group = dist.group.WORLD
            else:
                group = dist.new_group(ranks, group_desc=f"torchshard_{dim}")
            if me in ranks:
                mine[dim] = group
    return mine


def _exchange_device() -> torch.device:
    """Where the default group's small exchanges run: CPU where it serves CPU tensors."""
    if "cpu" in backend_devices(dist.get_backend_config()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def split_dp(
    mesh: Mesh | None,
    process_group: dist.ProcessGroup | None,
    *,
    sharded: bool,
    hybrid: bool,
    shard: object,
) -> tuple[dist.ProcessGroup | None, Mesh1D | None, Mesh1D | None]:
    """A trainer's groups: the data-parallel group (the mean, the mask, the norm, the
    broadcast), the group a hybrid mode cuts its buffer over (``None``: the data-parallel
    group) and the group it all-reduces the reduced cut across (``None``: no replicas).

    ``sharded``: the mode cuts its state over the ranks; one that does not (replicated) is
    DDP over ``mesh.dp`` whatever the mesh's shape. ``hybrid``: a sharded mode that shards
    inside ``mesh.dp_shard`` and all-reduces across ``mesh.dp_replicate``; a sharded mode
    that is not hybrid refuses replicas.

    Example::

        group, cut, across = split_dp(mesh, None, sharded=True, hybrid=True, shard=True)
    """
    if mesh is None:
        return process_group, None, None
    if process_group is not None:
        raise MeshError(
            "DistributedTrainer: pass mesh= or process_group=, not both (process_group= is "
            "the one-dimensional case; the mesh has its data-parallel group as mesh.dp)"
        )
    if not isinstance(mesh, Mesh):
        raise MeshError(
            f"mesh: expected a torchshard Mesh from torchshard.init_mesh(), got "
            f"{type(mesh).__name__}"
        )
    if mesh.pp_size > 1:
        raise MeshError(
            f"mesh: a mesh with pp={mesh.pp_size} splits the model into pipeline stages: pass "
            "it to torchshard.Pipeline(model, mesh=mesh, ...), which builds each stage's trainer"
        )
    group = None if mesh.dp is dist.group.WORLD else mesh.dp
    replicas = mesh.shape[0]
    if replicas == 1 or not sharded:  # the one-dimensional case: today's code path
        return group, None, None
    if not hybrid:
        raise MeshError(
            f"mesh: dp_replicate={replicas} with shard={shard!r}: this mode cannot cut its state "
            "over a shard group (hybrid sharding is shard=True or shard='full'); use one of "
            "those, or a mesh with dp_replicate=1"
        )
    return group, Mesh1D.of(mesh.dp_shard), Mesh1D.of(mesh.dp_replicate)
