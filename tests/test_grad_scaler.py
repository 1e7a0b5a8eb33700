"""fp16 loss scaling with ``torch.amp.GradScaler`` in every mode (issue 21): an inf that one
rank's gradient gets at one step makes every rank skip that step and halve its scale, and the
weights stay identical across ranks.

The inf is injected into one parameter's gradient on rank 1 only, a parameter whose slice (or
stripe) rank 0 owns when the gradient is sharded: without the ranks agreeing, rank 1 would find
nothing in its own part and step while rank 0 skips.

A lossy comm's error feedback (issue 24) holds gradients at their loss scale: after an overflow
it holds the inf too and must forget it, and it must follow the scale as the scaler changes it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import Cases
from test_frozen import LoRANet, data
from test_mixed_dtypes import MixedNet

from torchshard import DistributedTrainer, FlatParamModule
from torchshard.comm import PowerSGD, TopK

MODES = [False, True, "full"]
MODE_IDS = ["replicated", "sharded", "full"]
BAD_STEP = 2


def _overflow_on_one_rank(shard: bool | str, model: str) -> dict:
    """``model``: ``"lora"`` (frozen and trainable fp32 parameters alternate) or ``"mixed"``
    (bf16 linears, fp32 norms and routers: the flat buffers are bytes)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    fm = FlatParamModule(LoRANet() if model == "lora" else MixedNet())
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.002)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    # the first trainable parameter: in rank 0's slice and stripes
    target = fm.module.blocks[0][0].weight if model == "lora" else fm.module.embed.weight
    step_now = [0]

    def poison(g: torch.Tensor) -> torch.Tensor:
        return g * float("inf") if rank == 1 and step_now[0] == BAD_STEP else g

    target.register_hook(poison)
    scales, changed = [], []
    for step in range(4):
        step_now[0] = step
        with trainer.gathered():
            before = [p.detach().clone() for p in fm.module.parameters()]
        trainer.zero_grad()
        x, y = data(rank, step)
        scaler.scale(F.mse_loss(fm(x), y)).backward()
        trainer.unscale_(scaler)
        trainer.clip_grad_norm_(1.0)
        trainer.step(scaler)
        scaler.update()
        scales.append(scaler.get_scale())
        with trainer.gathered():
            changed.append(
                any(not torch.equal(a, p) for a, p in zip(before, fm.module.parameters()))
            )
    trainer.assert_in_sync()  # raises on every rank if any weight differs between ranks
    trainer.close()
    return {"scales": scales, "changed": changed}


SCALER = Cases(_overflow_on_one_rank, params=["shard", "model"], timeout=120, world_size=2)


@pytest.mark.parametrize("model", ["lora", "mixed"])
@pytest.mark.parametrize("shard", MODES, ids=MODE_IDS)
@SCALER.mark(cases=6)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(request, shard, model):
    ranks = SCALER.results(request)
    for r in ranks:
        assert r["changed"] == [True, True, False, True], r
        assert r["scales"] == [2.0**10, 2.0**10, 2.0**9, 2.0**9], r


def test_step_with_a_scaler_unscales_when_unscale_was_not_called():
    torch.manual_seed(0)
    fm = FlatParamModule(LoRANet())
    trainer = DistributedTrainer(fm, shard=True)
    trainer.make_optimizer(torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with torch.no_grad():
        before = [p.clone() for p in fm.module.parameters()]
    scaler.scale(F.mse_loss(fm(data(0, 0)[0]), data(0, 0)[1])).backward()
    trainer.step(scaler)  # unscale_ inside: the update is lr times the true gradient
    scaler.update()
    torch.manual_seed(0)
    ref = LoRANet()
    F.mse_loss(ref(data(0, 0)[0]), data(0, 0)[1]).backward()
    for p, q, b in zip(fm.module.parameters(), ref.parameters(), before):
        if q.requires_grad:
            torch.testing.assert_close(b - p, 0.1 * q.grad, rtol=1e-5, atol=1e-7)
    trainer.close()


# -- a lossy comm's error feedback under loss scaling --------------------------------------
COMMS = {"powersgd": lambda: PowerSGD(rank=1, start_step=0), "topk": lambda: TopK(ratio=0.1)}


def _lora_with_comm(comm: str) -> tuple[FlatParamModule, DistributedTrainer]:
    torch.manual_seed(0)
    fm = FlatParamModule(LoRANet())
    trainer = DistributedTrainer(fm, comm=COMMS[comm]())
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    return fm, trainer


def _comm_overflow(comm: str) -> dict:
    """One overflow on rank 1, in a matrix PowerSGD compresses, then three more steps."""
    rank = dist.get_rank()
    fm, trainer = _lora_with_comm(comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    step_now = [0]
    target = fm.module.blocks[0][1].lora_A.weight
    target.register_hook(lambda g: g * float("inf") if rank == 1 and step_now[0] == BAD_STEP else g)
    changed, finite = [], []
    for step in range(6):
        step_now[0] = step
        before = fm.flat_param.detach().clone()
        trainer.zero_grad()
        x, y = data(rank, step)
        scaler.scale(F.mse_loss(fm(x), y)).backward()
        trainer.step(scaler)  # unscales: the ranks agree, the comm's state forgets the inf
        scaler.update()
        changed.append(not torch.equal(before, fm.flat_param))
        finite.append(all(bool(torch.isfinite(t).all()) for t in trainer.comm_state().values()))
    trainer.assert_in_sync()
    trainer.close()
    return {"changed": changed, "finite": finite}


def _comm_run(comm: str, scaled: bool) -> dict:
    rank = dist.get_rank()
    fm, trainer = _lora_with_comm(comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1, enabled=scaled)
    for step in range(5):
        trainer.zero_grad()
        x, y = data(rank, step)
        scaler.scale(F.mse_loss(fm(x), y)).backward()
        trainer.step(scaler)
        scaler.update()
    error = trainer.comm_state()["error"] / scaler.get_scale()  # at the next step's scale
    out = {"weights": fm.flat_param.detach().clone(), "error": error, "scale": scaler.get_scale()}
    trainer.close()
    return out


def _comm_scaled(comm: str) -> dict:
    """Five steps with a loss scale that doubles at every update (powers of two: every
    product with it is exact), and five without one: the weights, and the error divided by
    the scale it is at, compared."""
    a, b = _comm_run(comm, True), _comm_run(comm, False)
    return {
        "scale": a["scale"],
        "weights": torch.equal(a["weights"], b["weights"]),
        "error": torch.equal(a["error"], b["error"]),
        "some_error": bool(b["error"].abs().sum() > 0),
    }


COMM_CASES = Cases(_comm_overflow, params=["comm"], timeout=120, world_size=2)
SCALED = Cases(_comm_scaled, params=["comm"], timeout=120, world_size=2)


@pytest.mark.parametrize("comm", list(COMMS))
@COMM_CASES.mark(cases=2)
def test_a_lossy_comm_forgets_an_overflow_and_trains_on(request, comm):
    # before: PowerSGD's error and Q kept the inf, and every later step was skipped
    for r in COMM_CASES.results(request):
        assert r["changed"] == [True, True, False, True, True, True], r
        assert all(r["finite"]), r


@pytest.mark.parametrize("comm", list(COMMS))
@SCALED.mark(cases=2)
def test_a_lossy_comms_error_follows_the_loss_scale_bitwise(request, comm):
    for r in SCALED.results(request):
        assert r == {"scale": 2.0**9, "weights": True, "error": True, "some_error": True}, r


def _one_step(scaler: torch.amp.GradScaler | None) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    fm = FlatParamModule(LoRANet())
    trainer = DistributedTrainer(fm)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    before = fm.flat_param.detach().clone()
    loss = F.mse_loss(fm(data(0, 0)[0]), data(0, 0)[1])
    (loss if scaler is None else scaler.scale(loss)).backward()
    trainer.step(scaler)
    out = fm.flat_param.detach().clone()
    trainer.close()
    return before, out


def test_step_with_a_disabled_scaler_is_a_plain_step():
    # GradScaler(enabled=use_fp16) is the usual pattern: disabled, it keeps no state to agree on
    before, disabled = _one_step(torch.amp.GradScaler("cpu", enabled=False))
    assert torch.equal(disabled, _one_step(None)[1])
    assert not torch.equal(disabled, before)  # it stepped
