"""The sharded mode (``shard=True``) against torch DDP beyond the plain case: ``no_sync``
accumulation, parameters used on some ranks only (and by no rank in some steps), frozen
parameters, ``clip_grad_norm_`` (``norm_type`` inf and 2) against torch's, and
``error_if_nonfinite``. The clipping and non-finite checks run in the fully sharded mode too
(``shard="full"``), whose norm is over the stripes (its other cases: ``test_parallel_full``).

In sharded mode the used-parameter mask is its own all-reduce, and a piece no rank used must
keep ``grad is None`` (AdamW would otherwise decay it and apply its momentum); the max-norm
is a MAX all-reduce of the slices' norms. Bitwise at 2 ranks (a sum of two scaled by 1/2
rounds as the mean of two does); at 3 within a tolerance (see ``compare``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from cases import Cases
from sharded_harness import Heads, Model, batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule, TorchShardError

ADAMW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1)
STEPS = 8


def micro_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(rank, 100 * step + micro)


def pair(
    case: str, shard: bool | str = True
) -> tuple[nn.Module, DistributedTrainer, nn.Module, DDP]:
    """The sharded trainer's model and the DDP oracle's, from the same weights."""
    torch.manual_seed(0)
    ref = Heads() if case == "unused" else Model()
    if case == "frozen":
        ref.wpe.weight.requires_grad_(False)
        ref.blocks[0].ln_1.requires_grad_(False)
    model = copy.deepcopy(ref)
    fm = FlatParamModule(model, align_bytes=4)  # no padding between fp32 parameters
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.004)
    ddp = DDP(ref, find_unused_parameters=case == "unused")
    return model, trainer, ref, ddp


def compare(
    trainer: DistributedTrainer, ref: nn.Module, where: str, exact: bool | None = None
) -> float:
    """The largest difference from DDP's weights; none at 2 ranks (``exact``), else small."""
    if exact is None:
        exact = dist.get_world_size() == 2
    worst = 0.0
    with trainer.gathered():  # the fully sharded mode's weights exist inside this only
        for (name, p), q in zip(trainer.module.module.named_parameters(), ref.parameters()):
            if exact:
                assert torch.equal(p, q), f"{where}: {name} differs from DDP"
            else:
                # The mean of three rounds otherwise than DDP's sum of thirds, and AdamW divides
                # by sqrt(v): where a gradient is nearly zero (the key projection's: softmax
                # ignores a shift of the keys) a last-bit difference moves the update by ~1e-6.
                # A step of AdamW moves an element by up to lr = 1e-2; weight decay alone by
                # 1e-3 * |p|.
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{where}: {name}")
            worst = max(worst, (p - q).abs().max().item())
    return worst


def backward(net: nn.Module, no_sync, case: str, rank: int, step: int) -> None:
    """One step's backward: three micro-batches, two inside ``no_sync``; or one batch."""
    if case == "no_sync":
        with no_sync():
            for micro in range(2):
                net(*micro_batch(rank, step, micro))[1].backward()
        net(*micro_batch(rank, step, 2))[1].backward()
        return
    flags = {}
    if case == "unused":
        flags = dict(use_aux=(step + rank) % 3 == 0, use_aux2=step % 4 == 0 and rank == 0)
    net(*batch(rank, step), **flags)[1].backward()


CLIPS = {"clip_inf": math.inf, "clip_2": 2.0}  # the cases that clip, and their norm_type


def _parity_with_ddp(case: str, shard: bool | str = True) -> dict:
    rank = dist.get_rank()
    _, trainer, ref, ddp = pair(case, shard)
    norm_type = CLIPS.get(case)
    trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    slots = trainer.module.layout.slots
    aux2 = {i for i, s in enumerate(slots) if any(n.startswith("aux2.") for n in s.names)}
    out: dict = {"worst": 0.0, "norms": [], "aux2_pieces": 0}
    for step in range(STEPS):
        # The trainer's step is over before DDP's backward: both communicate over the
        # default group, and a bucket of a parameter unused on this rank is reduced at step()
        trainer.zero_grad()
        backward(trainer.module, trainer.no_sync, case, rank, step)
        if norm_type is not None:
            norm = trainer.clip_grad_norm_(0.05, norm_type=norm_type)
        trainer.step()
        ref_opt.zero_grad()
        backward(ddp, ddp.no_sync, case, rank, step)
        if norm_type is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
            out["norms"].append((norm.item(), ref_norm.item()))
        ref_opt.step()
        if case == "unused":
            # the DDP oracle: a parameter no rank used keeps grad None (AdamW skips it)
            assert (ref.aux2.weight.grad is None) == (step % 4 != 0), step
            for slot, _, _, piece in trainer.optimizer_segments():
                if slot in aux2:
                    out["aux2_pieces"] += 1
                    assert (piece.grad is None) == (step % 4 != 0), (step, slots[slot].name)
        # the 2-norm sums the squares of each rank's part, then over ranks: another order
        # than torch's, so the clip coefficient (and the weights) may differ in the last bit
        exact = dist.get_world_size() == 2 and case != "clip_2"
        out["worst"] = max(out["worst"], compare(trainer, ref, f"{case}: step {step}", exact))
    trainer.assert_in_sync()
    trainer.close()
    return out


CASES = [
    *[pytest.param(c, True, id=c) for c in ("no_sync", "unused", "frozen", *CLIPS)],
    *[pytest.param(c, "full", id=f"{c}-full") for c in CLIPS],
]
PARITY = Cases(_parity_with_ddp, params=["case", "shard"], timeout=180)  # a spawn per world size


@pytest.mark.parametrize("world_size", PARITY.world_sizes(2, 3, cases=len(CASES)))
@pytest.mark.parametrize(("case", "shard"), CASES)
def test_sharded_matches_ddp_every_step(request, case, shard, world_size):
    results = PARITY.results(request)
    if world_size == 2 and case != "clip_2":
        assert all(r["worst"] == 0.0 for r in results), results
    if case == "unused":
        # some rank's slice holds aux2 (the check above ran), and every step was checked there
        assert sum(r["aux2_pieces"] for r in results) >= STEPS
    if case in CLIPS:
        for r in results:
            assert len(r["norms"]) == STEPS
            for norm, ref_norm in r["norms"]:
                assert norm > 0.05, "the norm must exceed max_norm, or nothing is clipped"
                if case == "clip_inf" and world_size == 2:
                    assert norm == ref_norm  # a max is exact: the same gradients, the same max
                elif case == "clip_inf":
                    assert norm == pytest.approx(ref_norm, rel=1e-5)
                else:  # a sum of squares in another order
                    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0.0)
        # every rank agrees on the global norm, not just its slice's
        assert all(r["norms"] == results[0]["norms"] for r in results)


# -- error_if_nonfinite ------------------------------------------------------------------------
def _nonfinite_gradient(value: float, norm_type: float, shard: bool | str) -> dict:
    """Steps 0 and 2 train, clipping; in step 1 the last rank's loss makes ``gain``'s gradient
    ``value`` (inf or nan) while every other gradient stays finite, and both clips raise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, trainer, ref, ddp = pair("plain", shard)
    opt = trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    out: dict = {}

    def backward(net: nn.Module, gain: torch.Tensor, step: int) -> None:
        _, loss = net(*batch(rank, step))
        if step == 1 and rank == world - 1:
            loss = loss + (gain * value).sum()
        loss.backward()

    for step in range(3):
        trainer.zero_grad()
        backward(trainer.module, model.gain, step)
        if step == 1:
            with trainer.gathered():
                weights = {k: v.clone() for k, v in model.state_dict().items()}
            state = copy.deepcopy(opt.state_dict())
            try:
                trainer.clip_grad_norm_(1.0, norm_type=norm_type, error_if_nonfinite=True)
            except TorchShardError as e:
                out["message"] = str(e)
            # nothing changed; the step is skipped, as a training loop skips it on the error
            with trainer.gathered():
                assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
            assert str(opt.state_dict()) == str(state)
        else:
            trainer.clip_grad_norm_(1.0, norm_type=norm_type, error_if_nonfinite=True)
            trainer.step()
        # DDP after the trainer's step: both communicate over the default group
        ref_opt.zero_grad()
        backward(ddp, ref.gain, step)
        if step == 1:
            try:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, norm_type, True)
            except RuntimeError as e:
                out["ddp"] = str(e)
            continue
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, norm_type, True)
        ref_opt.step()
        # the max-norm is exact; the 2-norm is summed over slices (another rounding)
        compare(trainer, ref, f"step {step}", exact=world == 2 and norm_type == math.inf)
    trainer.assert_in_sync()
    trainer.close()
    return out


NONFINITE = Cases(_nonfinite_gradient, params=["value", "norm_type", "shard"], timeout=180)


@pytest.mark.parametrize("shard", [True, "full"], ids=["sharded", "full"])
@pytest.mark.parametrize("world_size", NONFINITE.world_sizes(2, 3, cases=8))
@pytest.mark.parametrize(
    ("value", "norm_type"),
    [(math.inf, 2.0), (math.nan, 2.0), (math.inf, math.inf), (math.nan, math.inf)],
    ids=["inf-2norm", "nan-2norm", "inf-maxnorm", "nan-maxnorm"],
)
def test_nonfinite_gradient_raises_on_every_rank(request, world_size, value, norm_type, shard):
    results = NONFINITE.results(request)
    for rank, r in enumerate(results):
        assert "ddp" in r, f"rank {rank}: the oracle did not raise: {r}"
        assert "message" in r, f"rank {rank}: no TorchShardError, though DDP raised: {r}"
        message = r["message"]
        assert "gradient norm" in message and "error_if_nonfinite=False" in message, message
        assert str(value) in message, message  # inf or nan: what the norm is
