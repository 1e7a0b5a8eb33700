"""fp16 loss scaling with ``torch.amp.GradScaler`` in every mode (issue 21): an inf that one
rank's gradient gets at one step makes every rank skip that step and halve its scale, and the
weights stay identical across ranks.

The inf is injected into one parameter's gradient on rank 1 only, a parameter whose slice (or
stripe) rank 0 owns when the gradient is sharded: without the ranks agreeing, rank 1 would find
nothing in its own part and step while rank 0 skips.
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
