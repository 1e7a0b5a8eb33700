"""Hybrid sharding (issue 23), ``shard=True`` and ``shard="full"``, at 4 ranks on gloo: a
2 x 2 mesh of ``init_mesh(dp_replicate=2)`` against oracles.

- The exact reduction tree, computed in one process: each bucket (each unit) is reduced
  inside the shard group ({0, 1}, {2, 3}) and the owners' sums are all-reduced across
  replicas ({0, 2}, {1, 3}). A sum of two is the same bits in either order (IEEE addition is commutative),
  so gloo's 2-rank reduce and all-reduce give exactly ``((g0 + g1) + (g2 + g3)) / 4``:
  the weights must equal an AdamW stepped on that mean, bitwise, every step.
- Replicas bitwise in sync every step (weights on all 4 ranks, and the optimizer state of
  the two ranks that own the same slice), with ``aux`` used by replica 0 only: the
  used-parameter mask is over the data-parallel group, or replica 1 would skip its update.
- torch DDP at 4 ranks: another reduction order, so within 1e-5 relative (a tensor norm).
- ``dp_replicate=1`` is today's ``shard=True``, bitwise; the norm is the same bits on
  every rank; bytes across replicas are the owners' slices, to the byte.
- One 8-rank run (2 x 4): replicas in sync, within 1e-5 of DDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_distributed
from sharded_harness import Heads, Model, batch, tree_sum
from torch.nn.parallel import DistributedDataParallel as DDP

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, MeshError
from torchshard._parallel.full.mode import FullyShard

ADAMW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1)
STEPS = 5


def _flags(rank: int, step: int) -> dict[str, bool]:
    # aux: replica 0 only (ranks 0, 1), some steps; aux2: one rank of replica 1, one step
    return dict(use_aux=rank < 2 and step % 2 == 0, use_aux2=rank == 3 and step == 2)


@torch.no_grad()
def _tree_mean(model: torch.nn.Module) -> None:
    """Each parameter's gradient becomes ``((g0 + g1) + (g2 + g3)) / 4`` over the 4 ranks
    (zeros where a rank has none), or ``None`` where no rank has one."""
    for p, total in zip(model.parameters(), tree_sum(model)):
        p.grad = None if total is None else total.div(4)


def _slice_state(trainer: DistributedTrainer) -> torch.Tensor:
    opt = trainer.optimizer
    assert opt is not None
    parts = [
        opt.state[t][k].reshape(-1)
        for *_, t in trainer.optimizer_segments()
        if t in opt.state
        for k in ("exp_avg", "exp_avg_sq")
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


def _hsdp_vs_oracles(shard: object, frozen: bool = False, native: bool = False) -> dict:
    rank = dist.get_rank()
    mesh = torchshard.init_mesh(dp_replicate=2)
    FullyShard.native_gloo = native  # gloo's reduce-scatter, not a reduce per owner
    torch.manual_seed(0)
    ref = Heads()
    for name, p in ref.named_parameters():  # the first block and the positions, frozen
        p.requires_grad_(not (frozen and (name.startswith("blocks.0.") or "wpe" in name)))
    oracle = copy.deepcopy(ref)
    fm = FlatParamModule(copy.deepcopy(ref), align_bytes=4)
    trainer = DistributedTrainer(fm, mesh=mesh, shard=shard, bucket_mb=0.004)
    trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
    oracle_opt = torch.optim.AdamW(oracle.parameters(), **ADAMW)
    ddp = DDP(ref, find_unused_parameters=True)
    ddp_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    out: dict = {"rank": trainer.rank, "world": trainer.world_size, "differ": [], "norms": []}
    out["replicas"], out["padded"] = trainer.replicas, trainer.padded_numel
    for step in range(STEPS):
        trainer.zero_grad()
        fm(*batch(rank, step), **_flags(rank, step))[1].backward()
        norm = trainer.clip_grad_norm_(1e9)  # coefficient 1: measures, changes nothing
        trainer.step()
        oracle_opt.zero_grad()
        oracle(*batch(rank, step), **_flags(rank, step))[1].backward()
        _tree_mean(oracle)
        oracle_norm = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1e9)
        oracle_opt.step()
        ddp_opt.zero_grad()
        ddp(*batch(rank, step), **_flags(rank, step))[1].backward()
        ddp_opt.step()
        out["norms"].append((norm.item(), oracle_norm.item()))
        with trainer.gathered():
            for (name, p), q in zip(fm.module.named_parameters(), oracle.parameters()):
                if not torch.equal(p, q):
                    out["differ"].append(f"step {step}: {name}")
        trainer.assert_in_sync()  # all 4 ranks' weights, bitwise
        # the two owners of this slice (one per replica) hold the same optimizer state
        state = _slice_state(trainer)
        pair = [torch.empty_like(state) for _ in range(2)]
        dist.all_gather(pair, state, group=mesh.dp_replicate)
        out.setdefault("state_in_sync", []).append(torch.equal(pair[0], pair[1]))
    with trainer.gathered():
        out["ddp_rel"] = max(
            ((p - q).norm() / q.norm()).item()
            for p, q in zip(fm.module.parameters(), ref.parameters())
        )
    out["bytes_across_replicas"] = trainer.stats.bytes_across_replicas
    # what this rank owns of the gradient: its slice (shard=True), its stripes (full)
    out["owned"] = sum(
        g.numel() * g.element_size() for g in trainer._mode.local_grads(trainer._ctx)
    )
    trainer.close()
    return out


VARIANTS = {  # shard, frozen parameters, gloo's native reduce-scatter
    "sharded": (True, False, False),
    "sharded-frozen": (True, True, False),
    "full": ("full", False, False),
    "full-native": ("full", False, True),
    "full-frozen": ("full", True, False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hsdp_2x2_is_the_tree_in_sync_and_near_ddp(variant):
    shard, frozen, native = VARIANTS[variant]
    results = run_distributed(_hsdp_vs_oracles, 4, shard, frozen, native, timeout=120)
    for r, got in enumerate(results):
        assert (got["rank"], got["world"], got["replicas"]) == (r, 4, 2)
        assert got["differ"] == [], f"rank {r}: not the tree's weights: {got['differ'][:5]}"
        assert all(got["state_in_sync"]), f"rank {r}: optimizer state differs across replicas"
        assert got["ddp_rel"] <= 1e-5, f"rank {r}: {got['ddp_rel']:.3g} from DDP"
        # one collective: the same bits on every rank; the tree's norm up to rounding
        assert got["norms"] == results[0]["norms"]
        for norm, oracle_norm in got["norms"]:
            assert abs(norm - oracle_norm) <= 1e-5 * oracle_norm
        # each owner all-reduces what it owns, fp32, once a step: for shard=True its slice,
        # half the padded buffer
        assert got["bytes_across_replicas"] == STEPS * got["owned"]
        if shard is True and not frozen:
            assert got["owned"] == got["padded"] // 2 * 4


def _trainer(mesh: object, shard: object, **kw: object) -> DistributedTrainer:
    torch.manual_seed(0)
    fm = FlatParamModule(Model(), align_bytes=4)
    trainer = DistributedTrainer(fm, mesh=mesh, shard=shard, bucket_mb=0.004, **kw)  # type: ignore[arg-type]
    trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
    return trainer


def _train(trainer: DistributedTrainer, steps: int = 3) -> None:
    for step in range(steps):
        trainer.zero_grad()
        trainer.module(*batch(dist.get_rank(), step))[1].backward()
        trainer.clip_grad_norm_(0.5)
        trainer.step()


def _same_shards(a: object, b: object) -> bool:
    if a is None or b is None:
        return a is b
    return (a.runs, a.regions, a.every) == (b.runs, b.regions, b.every) and torch.equal(
        a.tensor, b.tensor
    )


def _one_replica_is_today() -> dict:
    out = {}
    cases = ((True, torchshard.init_mesh()), ("full", torchshard.init_mesh()))
    for shard, mesh in (*cases, (False, torchshard.init_mesh(2))):
        got, today = _trainer(mesh, shard), _trainer(None, shard)
        _train(got)
        _train(today)
        with got.gathered(), today.gathered():
            pairs = zip(got.module.parameters(), today.module.parameters())
            equal = all(torch.equal(p, q) for p, q in pairs)
        out[shard] = {
            "equal": equal,
            "stats": (got.stats, today.stats),
            "shards": _same_shards(got.local_shards(), today.local_shards()),
        }
        got.close()
        today.close()
    return out


def test_one_replica_is_todays_path_bitwise():
    for got in run_distributed(_one_replica_is_today, 4, timeout=120):
        for shard in (True, "full", False):  # shard=False over a 2 x 2 mesh: DDP over mesh.dp
            assert got[shard]["equal"], shard
            assert got[shard]["shards"], shard
            mine, today = got[shard]["stats"]
            assert mine.bytes_reduced == today.bytes_reduced
            assert mine.bytes_gathered == today.bytes_gathered
            assert mine.bytes_across_replicas == today.bytes_across_replicas == 0


def _bf16(shard: object) -> dict:
    out = {}
    for reduce_dtype in (None, torch.float32):
        mesh = torchshard.init_mesh(dp_replicate=2)
        torch.manual_seed(0)
        fm = FlatParamModule(Model(), align_bytes=4, dtype=torch.bfloat16)
        trainer = DistributedTrainer(
            fm, mesh=mesh, shard=shard, bucket_mb=0.004, reduce_dtype=reduce_dtype
        )
        trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
        for step in range(2):
            trainer.zero_grad()
            fm(*batch(dist.get_rank(), step))[1].backward()
            trainer.step()
            trainer.assert_in_sync()
        owned = sum(g.numel() for g in trainer._mode.local_grads(trainer._ctx))  # fp32 master's
        out[str(reduce_dtype)] = (trainer.stats.bytes_across_replicas, owned)
        trainer.close()
    return out


@pytest.mark.parametrize("shard", [True, "full"])
def test_bf16_master_and_reduce_dtype_stay_in_sync(shard):
    for got in run_distributed(_bf16, 4, shard, timeout=120):
        sent, owned = got["None"]
        assert sent == 2 * owned * 2  # bf16 on the wire
        sent, owned = got["torch.float32"]
        assert sent == 2 * owned * 4  # reduced in fp32, into the fp32 master


def _errors(tmp: str) -> list[str]:
    seen = []
    mesh = torchshard.init_mesh(dp_replicate=2)
    fm = FlatParamModule(Model(), align_bytes=4)
    for kw in (
        dict(mesh=mesh, process_group=dist.group.WORLD, shard=True),
        dict(mesh=torchshard.init_mesh(tp=2), shard=True),
        dict(mesh="2x2", shard=True),
    ):
        try:
            DistributedTrainer(fm, **kw)  # type: ignore[arg-type]
        except MeshError as e:
            seen.append(str(e))
    return seen


def test_bad_meshes_raise_clearly(tmp_path):
    for seen in run_distributed(_errors, 4, str(tmp_path), timeout=120):
        assert len(seen) == 3, seen
        assert "pass mesh= or process_group=, not both" in seen[0]
        assert "tp=2, but the FlatParamModule is not split" in seen[1]
        assert "mesh: expected a torchshard Mesh" in seen[2]


def _hsdp_vs_ddp(replicate: int, shard: object) -> dict:
    rank = dist.get_rank()
    mesh = torchshard.init_mesh(dp_replicate=replicate)
    torch.manual_seed(0)
    ref = Heads()
    fm = FlatParamModule(copy.deepcopy(ref), align_bytes=4)
    trainer = DistributedTrainer(fm, mesh=mesh, shard=shard, bucket_mb=0.004)
    trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
    ddp = DDP(ref, find_unused_parameters=True)
    ddp_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(3):
        trainer.zero_grad()
        fm(*batch(rank, step), **_flags(rank, step))[1].backward()
        trainer.step()
        ddp_opt.zero_grad()
        ddp(*batch(rank, step), **_flags(rank, step))[1].backward()
        ddp_opt.step()
        trainer.assert_in_sync()
    with trainer.gathered():
        pairs = zip(fm.module.parameters(), ref.parameters())
        rel = max(((p - q).norm() / q.norm()).item() for p, q in pairs)
    out = {
        "shape": mesh.shape,
        "rel": rel,
        "sent": trainer.stats.bytes_across_replicas,
        "owned": sum(g.numel() for g in trainer._mode.local_grads(trainer._ctx)),
        "padded": trainer.padded_numel,
    }
    trainer.close()
    return out


@pytest.mark.parametrize("shard", [True, "full"])
def test_hsdp_4x1_replicates_every_shard(shard):
    """Shard groups of one rank: every rank holds everything, reduced across 4 replicas."""
    for got in run_distributed(_hsdp_vs_ddp, 4, 4, shard, timeout=120):
        assert got["shape"] == (4, 1, 1)
        assert got["rel"] <= 1e-5, got["rel"]
        assert got["sent"] == 3 * got["owned"] * 4
        if shard is True:
            assert got["owned"] == got["padded"]


@pytest.mark.parametrize("shard", [True, "full"])
def test_hsdp_2x4_in_sync_and_near_ddp(shard):
    for got in run_distributed(_hsdp_vs_ddp, 8, 2, shard, timeout=180):
        assert got["shape"] == (2, 4, 1)
        assert got["rel"] <= 1e-5, got["rel"]
        assert got["sent"] == 3 * got["owned"] * 4  # what it owns, fp32, each step
        if shard is True:
            assert got["owned"] == got["padded"] // 4  # a quarter of the buffer


def _shard_group_traffic(shard: object) -> dict:
    """A 2 x 2 trainer beside a plain one over this rank's shard group (2 ranks): the same
    bytes inside the shard group, step for step."""
    mesh = torchshard.init_mesh(dp_replicate=2)
    hybrid, plain = _trainer(mesh, shard), _trainer(None, shard, process_group=mesh.dp_shard)
    _train(hybrid)
    _train(plain)
    got = {
        name: (getattr(hybrid.stats, name), getattr(plain.stats, name))
        for name in ("bytes_reduced", "bytes_gathered", "steps", "buckets")
    }
    got["across"] = hybrid.stats.bytes_across_replicas
    got["owned"] = sum(g.numel() * g.element_size() for g in hybrid._mode.local_grads(hybrid._ctx))
    hybrid.close()
    plain.close()
    return got


@pytest.mark.parametrize("shard", [True, "full"])
def test_shard_group_traffic_is_the_plain_mode_at_the_shard_size(shard):
    for got in run_distributed(_shard_group_traffic, 4, shard, timeout=120):
        for name in ("bytes_reduced", "bytes_gathered", "steps", "buckets"):
            mine, plain = got[name]
            assert mine == plain and (name == "buckets" or mine > 0), (name, got)
        assert got["across"] == 3 * got["owned"]  # what this rank owns, once a step
