"""``torchshard.init_mesh``: its shape arithmetic (pure), its groups at 4 ranks (members,
names, a collective on each), and its errors, raised on every rank alike."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_distributed

import torchshard
from torchshard import MeshError, RankMismatchError
from torchshard._parallel.mesh import mesh_ranks, mesh_shape


@pytest.mark.parametrize(
    ("world", "r", "s", "t", "local", "want"),
    [
        (8, 2, None, 1, None, (2, 4, 1)),  # dp_shard=None: the rest
        (8, 1, None, 1, None, (1, 8, 1)),
        (4, 1, None, 2, None, (1, 2, 2)),
        (8, 2, 2, 2, None, (2, 2, 2)),
        (8, 1, "node", 1, "4", (2, 4, 1)),  # a shard group per node, replicas across
        (8, 2, "node", 1, "4", (2, 4, 1)),  # the replicas it makes, asked for explicitly
        (8, 1, "node", 2, "4", (2, 2, 2)),
        (1, 1, None, 1, None, (1, 1, 1)),
    ],
)
def test_shapes(world, r, s, t, local, want):
    assert mesh_shape(world, r, s, t, local) == want


@pytest.mark.parametrize(
    ("world", "r", "s", "t", "local", "match"),
    [
        (6, 4, None, 1, None, r"dp_replicate \(4\) x tp \(1\) = 4 does not divide .* 6"),
        (8, 3, 2, 1, None, r"dp_replicate \(3\) x dp_shard \(2\) x tp \(1\) = 6 ranks, .* 8"),
        (4, 0, None, 1, None, r"init_mesh\(dp_replicate=...\): expected an int >= 1, got 0"),
        (4, True, None, 1, None, r"dp_replicate=...\): expected an int >= 1, got True"),
        (4, 1, "nodes", 1, None, r"dp_shard=...\): expected an int >= 1, None or 'node'"),
        (4, 1, 2.0, 1, None, r"dp_shard=...\): expected .* got 2.0"),
        (4, 1, None, -1, None, r"init_mesh\(tp=...\)"),
        (4, 1, "node", 1, None, r"LOCAL_WORLD_SIZE is not set"),
        (4, 1, "node", 1, "x", r"LOCAL_WORLD_SIZE: expected an int, got 'x'"),
        (8, 1, "node", 1, "3", r"LOCAL_WORLD_SIZE=3 ranks do not divide the world size 8"),
        (8, 1, "node", 3, "4", r"tp=3\): tp does not divide the node size 4"),
        (8, 4, "node", 1, "4", r"dp_replicate=4, dp_shard='node'\): .* makes 2 replicas"),
    ],
)
def test_bad_shapes_name_the_argument(world, r, s, t, local, match):
    with pytest.raises(MeshError, match=match):
        mesh_shape(world, r, s, t, local)


def test_rank_order_is_replicate_major_tp_minor():
    assert mesh_ranks((2, 2, 1)) == {
        "tp": [[0], [1], [2], [3]],
        "dp_shard": [[0, 1], [2, 3]],
        "dp_replicate": [[0, 2], [1, 3]],
        "dp": [[0, 1, 2, 3]],
        "pp": [[0], [1], [2], [3]],
    }
    got = mesh_ranks((2, 2, 2))
    assert got["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert got["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert got["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_pipeline_ranks_are_outermost():
    got = mesh_ranks((1, 2, 2), pp=2)  # 8 ranks: two pipeline ranks of dp 2 x tp 2
    assert got["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert got["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert got["dp_shard"] == got["dp"] and got["dp_replicate"] == [[i] for i in range(8)]


_GROUPS = ("world", "dp", "dp_shard", "dp_replicate", "tp")


def _describe(kwargs: dict) -> dict:
    """This rank's view of ``init_mesh(**kwargs)``: coordinates, members and names of each
    group, and a sum over each group (proof that it works)."""
    mesh = torchshard.init_mesh(**kwargs)
    out: dict = {
        "shape": mesh.shape,
        "dp_at": (mesh.dp_rank, mesh.dp_size),
        "tp_at": (mesh.tp_rank, mesh.tp_size),
        "world_is_world": mesh.world is dist.group.WORLD,
    }
    for name in _GROUPS:
        group = getattr(mesh, name)
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=group)
        out[name] = (dist.get_process_group_ranks(group), group.group_name, t.item())
    return out


def test_groups_at_4_ranks():
    replicas = run_distributed(_describe, 4, {"dp_replicate": 2}, timeout=60)
    for rank, got in enumerate(replicas):
        r, s = divmod(rank, 2)
        assert got["shape"] == (2, 2, 1)
        assert got["dp_at"] == (rank, 4) and got["tp_at"] == (0, 1) and got["world_is_world"]
        assert got["dp_shard"][0] == [2 * r, 2 * r + 1]
        assert got["dp_shard"][2] == 4 * r + 1  # 0 + 1, or 2 + 3
        assert got["dp_replicate"][0] == [s, s + 2]
        assert got["dp_replicate"][2] == 2 * s + 2
        assert got["tp"][0] == [rank] and got["tp"][2] == rank
        assert got["dp"][0] == [0, 1, 2, 3]
    for name in _GROUPS:  # the same name on every member of a group
        names: dict = {}
        for got in replicas:
            ranks, group_name, _ = got[name]
            assert names.setdefault(tuple(ranks), group_name) == group_name, name
    tp = run_distributed(_describe, 4, {"tp": 2}, timeout=60)
    for rank, got in enumerate(tp):
        assert got["shape"] == (1, 2, 2)
        assert got["dp_at"] == (rank // 2, 2) and got["tp_at"] == (rank % 2, 2)
        assert got["tp"][0] == [rank - rank % 2, rank - rank % 2 + 1]
        assert got["dp"][0] == got["dp_shard"][0] == [rank % 2, rank % 2 + 2]
    node = run_distributed(_describe, 4, {"dp_shard": "node"}, env={"LOCAL_WORLD_SIZE": "2"})
    assert [got["shape"] for got in node] == [(2, 2, 1)] * 4
    assert [got["dp_shard"][0] for got in node] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def _error(kwargs_by_rank: list[dict]) -> tuple[str, str]:
    try:
        torchshard.init_mesh(**kwargs_by_rank[dist.get_rank()])
    except (MeshError, RankMismatchError) as e:
        return type(e).__name__, str(e)
    return "", ""


def test_errors_raise_on_every_rank():
    got = run_distributed(_error, 4, [{"dp_replicate": 3}] * 4, timeout=60)
    assert {kind for kind, _ in got} == {"MeshError"}
    assert all("does not divide the world size 4" in msg for _, msg in got)
    # one rank asks for another mesh: every rank raises, none waits in new_group
    got = run_distributed(_error, 4, [{"dp_replicate": 2}] + [{}] * 3, timeout=60)
    assert {kind for kind, _ in got} == {"RankMismatchError"}
    assert all("ranks 1, 2, 3 asked for" in msg for _, msg in got)
