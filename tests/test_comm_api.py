"""The comm choices' API (``torchshard.comm``): settings checked when made; a choice a mode,
a mesh or a dtype cannot take refused on every rank when the trainer is built (and the
ranks go on: no collective left waiting); the compression state's contract."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from comm_oracle import batch, build, loss_of
from multiprocess import run_distributed

import torchshard
from torchshard import DistributedTrainer, TorchShardError
from torchshard._parallel.powersgd import orthogonalize
from torchshard.comm import BF16, FP16, AllReduce, CommError, PowerSGD, Star, TopK


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: PowerSGD(rank=0), "rank"),
        (lambda: PowerSGD(rank=2.0), "rank"),
        (lambda: PowerSGD(rank=True), "rank"),
        (lambda: PowerSGD(start_step=-1), "start_step"),
        (lambda: PowerSGD(min_compression=0.5), "min_compression"),
        (lambda: PowerSGD(min_compression=float("nan")), "min_compression"),
        (lambda: TopK(ratio=0), "ratio"),
        (lambda: TopK(ratio=1.5), "ratio"),
        (lambda: TopK(ratio=-0.1), "ratio"),
        (lambda: TopK(ratio="0.1"), "ratio"),
        (lambda: TopK(error_feedback=1), "error_feedback"),
        (lambda: TopK(start_step=-1), "start_step"),
        (lambda: TopK(start_step=2.0), "start_step"),
        (lambda: Star(root=-1), "root"),
    ],
)
def test_bad_settings_raise_a_comm_error_naming_the_setting(make, named):
    with pytest.raises(CommError, match=named) as e:
        make()
    assert isinstance(e.value, TorchShardError) and isinstance(e.value, ValueError)


def test_the_choices_are_frozen_settings_exported_at_the_top_too():
    assert TopK(ratio=1.0).ratio == 1.0 and TopK(0.5) == TopK(ratio=0.5)
    assert PowerSGD() == PowerSGD(rank=4, start_step=10, min_compression=2.0)
    assert torchshard.PowerSGD is PowerSGD and torchshard.comm.BF16 is BF16
    with pytest.raises(AttributeError):
        PowerSGD().rank = 2  # type: ignore[misc]


def test_orthogonalize_gives_orthonormal_columns_and_keeps_a_zero_column_zero():
    p = torch.randn(20, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q = orthogonalize(p.clone())
    assert torch.allclose(q.T @ q, torch.eye(4, dtype=torch.float64), atol=1e-14)
    # the same column space: projecting p onto q's columns gives p back
    assert torch.allclose(q @ (q.T @ p), p, atol=1e-12)
    zero = orthogonalize(torch.zeros(5, 2))
    assert torch.equal(zero, torch.zeros(5, 2))


# -- refused on every rank, at construction ------------------------------------------------------
def _refusals() -> dict:
    caught = {}

    def attempt(name: str, **kwargs: object) -> None:
        try:
            DistributedTrainer(build(kwargs.pop("dtype", torch.float64)), **kwargs).close()  # type: ignore[arg-type]
            caught[name] = None
        except CommError as e:
            caught[name] = str(e)

    attempt("powersgd sharded", comm=PowerSGD(), shard=True)
    attempt("topk sharded", comm=TopK(), shard=True)
    attempt("bf16 full", comm=BF16(), shard="full")
    attempt("star full", comm=Star(), shard="full")
    attempt("powersgd bf16", comm=PowerSGD(), dtype=torch.bfloat16)
    attempt("topk fp16", comm=TopK(), dtype=torch.float16)
    attempt("bf16 reduce_dtype", comm=BF16(), reduce_dtype=torch.float32)
    attempt("star root", comm=Star(root=2))
    attempt("a string", comm="bf16")
    mesh = torchshard.init_mesh(dp_replicate=2)
    attempt("star hybrid", comm=Star(), shard=True, mesh=mesh)
    # what does work: every rank went on together, through every refusal
    ok = []
    for comm, shard in ((BF16(), True), (FP16(), False), (Star(), True), (TopK(), False)):
        t = DistributedTrainer(build(), comm=comm, shard=shard)
        loss_of(t.module, batch(dist.get_rank(), 0)).backward()
        t.average_gradients()
        ok.append(t.comm == comm)
        t.close()
    t = DistributedTrainer(build(), comm=BF16(), shard=True, mesh=mesh)  # hybrid: a cast works
    ok.append(t.replicas == 2)
    t.close()
    return dict(caught=caught, ok=ok)


def test_unsupported_choices_raise_on_every_rank_and_the_ranks_go_on():
    results = run_distributed(_refusals, 2, timeout=180)
    assert results[0] == results[1]
    caught = results[0]["caught"]
    assert all(caught.values()), caught
    assert (
        "shard=True" in caught["powersgd sharded"]
        and "whole parameters" in caught["powersgd sharded"]
    )
    assert "TopK" in caught["topk sharded"]
    assert "shard='full'" in caught["bf16 full"] and "own schedule" in caught["star full"]
    assert "torch.bfloat16" in caught["powersgd bf16"] and "float32" in caught["powersgd bf16"]
    assert "torch.float16" in caught["topk fp16"]
    assert "reduce_dtype" in caught["bf16 reduce_dtype"]
    assert "[0, 2)" in caught["star root"]
    assert "'bf16'" in caught["a string"]
    assert "hybrid" in caught["star hybrid"]
    assert results[0]["ok"] == [True] * 5


# -- the compression state ----------------------------------------------------------------------
def _state_contract() -> dict:
    rank = dist.get_rank()
    out = {}
    for name, comm in (("powersgd", PowerSGD(rank=2, start_step=0)), ("topk", TopK(0.2))):
        fm = build()
        t = DistributedTrainer(fm, comm=comm, bucket_mb=0.004)
        loss_of(fm, batch(rank, 0)).backward()
        t.average_gradients()
        state = t.comm_state()
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        live = state["error"] is t.comm_state()["error"]
        saved = {k: v.clone() for k, v in state.items()}
        t.reset_comm_error()
        reset = not t.comm_state()["error"].any() and bool(saved["error"].any())
        t.load_comm_state({k: v.float() for k, v in saved.items()})  # any dtype: converted
        back = torch.equal(t.comm_state()["error"], saved["error"].float().double())
        errors = []
        for bad in (
            {},
            {**saved, "extra": saved["error"]},
            {**saved, "error": saved["error"][:-1]},
        ):
            try:
                t.load_comm_state(bad)
            except CommError as e:
                errors.append(str(e))
        out[name] = dict(shapes=shapes, live=live, reset=reset, back=back, errors=errors)
        out[name]["numel"] = fm.flat_grad.numel()  # type: ignore[union-attr]
        t.close()
    fm = build()
    t = DistributedTrainer(fm, comm=Star())
    out["star"] = t.comm_state()
    t.load_comm_state({})
    try:
        t.load_comm_state({"error": torch.zeros(3)})
    except CommError as e:
        out["star_refuses"] = str(e)
    t.reset_comm_error()  # nothing to reset: no error
    t.close()
    return out


def test_comm_state_is_named_flat_tensors_that_load_back():
    for r in run_distributed(_state_contract, 2, timeout=180):
        p, k = r["powersgd"], r["topk"]
        assert set(p["shapes"]) == {"error", "powersgd_q", "steps"}
        assert set(k["shapes"]) == {"error", "steps"}
        for s in (p, k):
            assert s["shapes"]["error"] == ((s["numel"],), torch.float64)
            assert s["shapes"]["steps"] == ((), torch.int64)
            assert s["live"] and s["reset"] and s["back"]
            assert len(s["errors"]) == 3
            assert "expected the tensors" in s["errors"][0] and "'extra'" in s["errors"][1]
            assert "'error'" in s["errors"][2] and "elements" in s["errors"][2]
        # Q of a.weight (32 x 16) and b.weight (24 x 32) at rank 2; c.weight (3 x 24) is dense
        assert p["shapes"]["powersgd_q"] == ((16 * 2 + 32 * 2,), torch.float64)
        assert r["star"] == {} and "keeps no state" in r["star_refuses"]


def _alone() -> list[bool]:
    out = []
    for comm in (AllReduce(), BF16(), FP16(), Star(), PowerSGD(start_step=0), TopK()):
        fm = build()
        t = DistributedTrainer(fm, comm=comm)
        loss_of(fm, batch(0, 0)).backward()
        t.average_gradients()
        out.append(t.stats.payload_bytes == 0 and t.stats.steps == 1)
        t.close()
    return out


def test_a_world_of_one_takes_every_choice():
    assert run_distributed(_alone, 1, timeout=120) == [[True] * 6]


def _different_comms() -> str:
    comm = [PowerSGD(rank=4), PowerSGD(rank=2)][dist.get_rank()]
    try:
        DistributedTrainer(build(), comm=comm).close()
    except torchshard.RankMismatchError as e:
        return str(e)
    return "no error"


def test_ranks_that_pass_different_comms_are_refused_naming_them():
    # another rank's PowerSGD would issue other collectives (other P and Q sizes): a hang
    for message in run_distributed(_different_comms, 2, timeout=120):
        assert "ranks [1] built their trainer with other options than rank 0" in message
        assert "PowerSGD(rank=2" in message and "PowerSGD(rank=4" in message, message
