"""The comm seam: a bucket's travel is a small object whose launch returns a future.

- :class:`ReduceSpec` (the division policy, decided once) as pure arithmetic.
- The proof that a two-stage reduction fits: a test-only comm that reduces each bucket to a
  root and then broadcasts it from there (star aggregation), the broadcast chained on the
  reduce's future. It trains bitwise like the all-reduce and like torch DDP, launches the
  same buckets during backward, and its second stage is issued while backward still runs:
  a hook early in the graph waits for the first bucket's broadcast to be issued, which
  would time out if the second stage waited for ``average_gradients()``.
"""

from __future__ import annotations

import copy
import threading

import introspect
import pytest
import torch
import torch.distributed as dist
from gpt import GPTConfig
from models import GPTWithAux
from multiprocess import run_distributed
from torch import nn
from torch.futures import Future, collect_all
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule
from torchshard._parallel.buckets import Bucket
from torchshard._parallel.comm import Mesh1D, ReduceSpec, settled

CFG = GPTConfig.preset("tiny")
BUCKET_MB = 0.01  # ~10 KB: the tiny GPT spreads over several buckets


# -- the division policy -------------------------------------------------------------------------
def test_reduce_spec_is_decided_once_from_backend_dtype_world_and_preference():
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert ReduceSpec.of(1, f16, None, prefer_pre=True) == ReduceSpec(SUM)
    assert ReduceSpec.of(4, f16, AVG, prefer_pre=True) == ReduceSpec(AVG)  # NCCL: no pass
    assert ReduceSpec.of(4, f16, None, prefer_pre=False) == ReduceSpec(SUM, pre=0.25)
    assert ReduceSpec.of(3, f32, None, prefer_pre=True) == ReduceSpec(SUM, pre=1.0 / 3)
    assert ReduceSpec.of(3, bf16, None, prefer_pre=False) == ReduceSpec(SUM, post=3.0)


def test_reduce_spec_scales_as_ddp_and_divides_as_the_sharded_modes():
    t = torch.randn(100)
    pre, post = t.clone(), t.clone()
    ReduceSpec(dist.ReduceOp.SUM, pre=1.0 / 3).scale_before(pre)
    ReduceSpec(dist.ReduceOp.SUM, post=3.0).scale_after(post)
    assert torch.equal(pre, t * (1.0 / 3))  # times the reciprocal (DDP), not a division
    assert torch.equal(post, t / 3)
    same = t.clone()
    ReduceSpec(dist.ReduceOp.SUM).scale_before(same)
    ReduceSpec(dist.ReduceOp.SUM).scale_after(same)
    assert torch.equal(same, t)


# -- a two-stage comm: reduce to a root, then broadcast ------------------------------------------
PHASE = ["idle"]  # what the training loop is doing: "backward" or "finish"


class ReduceThenBroadcast:
    """Reduce each bucket to rank 0 of the mesh, then broadcast it from there.

    The broadcast is issued from the reduce's future (``then``), so while backward runs. It
    travels over a second group of the same ranks, issued in bucket order (each waits for
    the previous bucket's to be issued): a callback runs on whichever thread completes the
    reduce, so on the trainer's own group it could interleave with later buckets' reduces
    differently on different ranks."""

    fuses_mask = True  # lossless, and the result reaches every rank

    def __init__(self, mesh: Mesh1D) -> None:
        self.mesh = mesh
        self.root = mesh.global_rank(0)
        self.second = dist.new_group(list(mesh.global_ranks))  # every rank, same point
        self.issued_ok: Future[None] = Future()
        self.issued_ok.set_result(None)
        # (bucket, PHASE at the first stage, PHASE at the second, the second on the main thread)
        self.issues: list[tuple[int, str, str, bool]] = []
        self.first_issued = threading.Event()  # bucket 0's broadcast, this step

    def launch(self, view: torch.Tensor, spec: ReduceSpec, bucket: Bucket) -> Future[torch.Tensor]:
        spec.scale_before(view)
        reduced = dist.reduce(view, self.root, op=spec.op, group=self.mesh.group, async_op=True)
        result: Future[torch.Tensor] = Future()
        first = PHASE[0]

        def broadcast(ready: Future[list[Future[object]]]) -> None:
            try:
                for f in ready.value():
                    f.value()
                work = dist.broadcast(view, self.root, group=self.second, async_op=True)
            except Exception as e:  # handed to whoever waits on the result
                result.set_exception(e)
                return
            main = threading.current_thread() is threading.main_thread()
            self.issues.append((bucket.index, first, PHASE[0], main))
            if bucket.index == 0:
                self.first_issued.set()
            settled(work, view).then(_deliver(result))

        previous = self.issued_ok
        self.issued_ok = collect_all([settled(reduced, view), previous]).then(broadcast)
        return result


def _deliver(result: Future[torch.Tensor]):  # type: ignore[no-untyped-def]
    def deliver(done: Future[torch.Tensor]) -> None:
        try:
            result.set_result(done.value())
        except Exception as e:
            result.set_exception(e)

    return deliver


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000 * rank + step)
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _two_stage_trains_like_all_reduce(steps: int = 4) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = GPTWithAux(CFG)
    ddp = DDP(copy.deepcopy(ref), find_unused_parameters=True)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    plain_fm, star_fm = FlatParamModule(copy.deepcopy(ref)), FlatParamModule(copy.deepcopy(ref))
    plain = DistributedTrainer(plain_fm, bucket_mb=BUCKET_MB)
    with introspect.replicated_with_comm(ReduceThenBroadcast):
        star = DistributedTrainer(star_fm, bucket_mb=BUCKET_MB)
    comm = introspect.reducer_of(star).comm
    assert isinstance(comm, ReduceThenBroadcast)
    assert introspect.replicated_grad_store(star) is not None  # the mask rides in a bucket
    for t in (plain, star):
        t.make_optimizer(torch.optim.SGD, lr=0.1)

    waited: list[bool] = []

    def wait_for_the_second_stage(grad: torch.Tensor) -> None:
        # Runs in backward once every block after the first has its gradients: the buckets
        # of the last layers were reduced long ago; their broadcast must be out by now.
        waited.append(comm.first_issued.wait(timeout=60))

    def on_first_block(_m: nn.Module, _i: object, out: torch.Tensor) -> None:
        out.register_hook(wait_for_the_second_stage)

    launched, diffs = [], []
    for step in range(steps):
        use_everywhere = step % 2 == 0  # else rank 1 skips the head: its buckets wait
        use = use_everywhere or rank != 1
        for t in (plain, star):
            t.zero_grad()
            hook = None
            if t is star and use_everywhere:
                comm.first_issued.clear()
                block = t.module.module.blocks[0]
                hook = block.register_forward_hook(on_first_block)
            loss = t.module(*batch(rank, step), use_aux=use)[1]
            PHASE[0] = "backward"
            loss.backward()
            PHASE[0] = "finish"
            t.step()
            PHASE[0] = "idle"
            if hook is not None:
                hook.remove()
        ddp_opt.zero_grad()
        ddp(*batch(rank, step), use_aux=use)[1].backward()
        ddp_opt.step()
        launched.append((plain.stats.launched_during_backward, star.stats.launched_during_backward))
        flat = _flat(ddp.module)
        ours = [_flat(fm.module) for fm in (plain_fm, star_fm)]
        pairs = ((ours[0], flat), (ours[1], flat), (ours[1], ours[0]))
        diffs.append([float((a - b).abs().max()) for a, b in pairs])
    issues = list(comm.issues)
    buckets = star.stats.buckets
    plain.close()
    star.close()
    return dict(
        diffs=diffs, launched=launched, waited=waited, issues=issues, buckets=buckets, steps=steps
    )


def test_a_two_stage_comm_trains_bitwise_like_the_all_reduce_and_chains_in_backward():
    for r in run_distributed(_two_stage_trains_like_all_reduce, 2, timeout=180):
        # bitwise: the all-reduce, the two-stage comm and torch DDP, every step
        assert all(d == [0.0, 0.0, 0.0] for d in r["diffs"]), r["diffs"]
        # the same buckets launched during backward, all of them when every parameter is used
        assert all(a == b for a, b in r["launched"]), r["launched"]
        assert r["launched"][0][1] == r["buckets"] >= 3
        # the second stage of the first bucket was issued while backward ran, every step in
        # which every rank used every parameter
        assert r["waited"] == [True] * ((r["steps"] + 1) // 2)
        assert any(i == 0 and second == "backward" for i, _, second, _ in r["issues"])
        # a bucket launched in backward has its second stage issued from the reduce's future
        # (a gloo thread, or inline in backward), never by average_gradients() itself
        for _, first, second, main in r["issues"]:
            assert first == "finish" or not (second == "finish" and main), r["issues"]
        # every bucket's second stage, once per step, in bucket order within a step
        assert len(r["issues"]) == r["buckets"] * r["steps"]
        order = [i for i, *_ in r["issues"]]
        assert order == list(range(r["buckets"])) * r["steps"]


@pytest.mark.parametrize("world_size", [1, 3])
def test_mesh_names_global_ranks_of_a_subgroup(world_size):
    assert run_distributed(_mesh_of_a_subgroup, world_size, timeout=60) == [True] * world_size


def _mesh_of_a_subgroup() -> bool:
    world = dist.get_world_size()
    whole = Mesh1D.of(None)
    ok = whole.global_ranks == tuple(range(world)) and whole.rank == dist.get_rank()
    if world > 1:
        ranks = list(range(1, world))
        sub = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mesh = Mesh1D.of(sub)
            ok &= mesh.size == world - 1 and mesh.global_rank(mesh.rank) == dist.get_rank()
            ok &= mesh.global_ranks == tuple(ranks)
        dist.barrier()  # rank 0 serves the store the subgroup's members still read
    return ok
