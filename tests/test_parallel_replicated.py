"""DistributedTrainer against torch DDP, in real processes on gloo over loopback."""

from __future__ import annotations

import copy

import introspect
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import Cases
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule, RankMismatchError, TorchShardError

CFG = GPTConfig.preset("tiny")
BUCKET_MB = 0.01  # ~10 KB: the tiny GPT spreads over several buckets


class GPTWithHeads(GPT):
    """The tiny GPT plus two auxiliary heads that some steps (and ranks) do not use."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.aux = nn.Linear(cfg.n_embd, 1)  # used on some ranks in some steps
        self.aux2 = nn.Linear(cfg.n_embd, 1)  # in some steps used by no rank at all

    def forward(self, idx, targets, use_aux=False, use_aux2=False):  # type: ignore[override]
        logits, loss = super().forward(idx, targets)
        h = self.wte(idx)
        if use_aux:
            loss = loss + self.aux(h).pow(2).mean()
        if use_aux2:
            loss = loss + self.aux2(h).pow(2).mean()
        return logits, loss


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _parity_with_ddp(case: str, steps: int = 10) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = GPTWithHeads(CFG) if case == "unused" else GPT(CFG)
    if case == "frozen":
        ref.wpe.weight.requires_grad_(False)
        ref.blocks[0].ln_1.requires_grad_(False)
    model = copy.deepcopy(ref)
    if rank == 1:  # the trainer must broadcast rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ddp = DDP(ref, find_unused_parameters=case == "unused")
    fm = FlatParamModule(model)
    trainer = DistributedTrainer(fm, bucket_mb=BUCKET_MB)
    kw = dict(lr=1e-2, eps=1e-6, weight_decay=0.1)
    opt = torch.optim.AdamW(fm.parameters(), **kw)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **kw)
    diffs = []
    for step in range(steps):
        flags = {}
        if case == "unused":
            flags = dict(use_aux=(step + rank) % 3 == 0, use_aux2=step % 4 == 0 and rank == 0)
        for net, o in ((fm, opt), (ddp, ref_opt)):
            o.zero_grad()
            if case == "no_sync":
                sync_off = trainer.no_sync() if net is fm else ddp.no_sync()
                with sync_off:
                    for micro in range(2):
                        net(*batch(rank, step, micro))[1].backward()
                net(*batch(rank, step, 2))[1].backward()
            else:
                net(*batch(rank, step), **flags)[1].backward()
            if net is fm:
                trainer.average_gradients()
            o.step()
        if case == "unused":
            assert (model.aux2.weight.grad is None) == (step % 4 != 0), step
            assert (ref.aux2.weight.grad is None) == (model.aux2.weight.grad is None)
        worst = 0.0
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if world == 2:
                assert torch.equal(p, q), f"{case}: step {step}: {name} differs from DDP"
            else:
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")
            worst = max(worst, (p - q).abs().max().item())
        diffs.append(worst)
    trainer.assert_in_sync()
    trainer.close()
    return diffs


PARITY = Cases(_parity_with_ddp, params=["case"], timeout=120)  # a spawn per world size


@pytest.mark.parametrize("world_size", PARITY.world_sizes(2, 3, cases=4))
@pytest.mark.parametrize("case", ["plain", "no_sync", "unused", "frozen"])
def test_matches_ddp_every_step(request, case, world_size):
    diffs = PARITY.results(request)
    assert len(diffs) == world_size and all(len(d) == 10 for d in diffs)
    if world_size == 2:
        assert max(max(d) for d in diffs) == 0.0


def _launches_during_backward() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    fm = FlatParamModule(GPT(CFG))
    trainer = DistributedTrainer(fm, bucket_mb=BUCKET_MB)
    log: list[tuple[bool, int]] = []
    phase = {"in_backward": False}
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        log.append((phase["in_backward"], tensor.numel()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        _, loss = fm(*batch(rank, 0))
        phase["in_backward"] = True
        loss.backward()
        phase["in_backward"] = False
        during = sum(flag for flag, _ in log)
        trainer.average_gradients()
    finally:
        dist.all_reduce = real_all_reduce
    trainer.close()
    return dict(
        during=during,
        log=log,
        buckets=trainer.stats.buckets,
        stat=trainer.stats.launched_during_backward,
        numel=fm.numel,
        mask=introspect.replicated_grad_store(trainer).numel() - fm.flat_grad.numel(),
    )


def test_buckets_are_launched_during_backward():
    for r in run_distributed(_launches_during_backward, 2, timeout=60):
        assert r["buckets"] >= 3
        assert r["during"] == r["buckets"] == r["stat"]
        grads = [n for flag, n in r["log"] if flag]
        # the buckets tile the whole flat gradient; the used-parameter mask rides in the last
        assert sum(grads) == r["numel"] + r["mask"] and 0 < r["mask"] < 64
        assert all(flag for flag, _ in r["log"])  # nothing left for average_gradients()


def _mismatched_layout() -> str:
    rank = dist.get_rank()
    cfg = GPTConfig(**{**CFG.__dict__, "n_embd": 32 if rank == 2 else CFG.n_embd})
    fm = FlatParamModule(GPT(cfg))
    try:
        DistributedTrainer(fm)
    except RankMismatchError as e:
        return str(e)
    return "no error"


def test_layout_mismatch_is_reported_on_every_rank():
    messages = run_distributed(_mismatched_layout, 3, timeout=60)
    for m in messages:
        assert "ranks [2] built a different model than rank 0" in m
        assert "'wte.weight'" in m


def _clip_like_torch() -> tuple[float, float]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = GPT(CFG)
    fm = FlatParamModule(copy.deepcopy(ref))
    trainer = DistributedTrainer(fm)
    ddp = DDP(ref)
    fm(*batch(rank, 0))[1].backward()
    ddp(*batch(rank, 0))[1].backward()
    trainer.average_gradients()
    norm = trainer.clip_grad_norm_(0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for p, q in zip(fm.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    clipped = torch.linalg.vector_norm(fm.flat_grad).item()
    trainer.close()
    return norm.item(), clipped


def test_clip_grad_norm_matches_torch():
    for norm, clipped in run_distributed(_clip_like_torch, 2, timeout=60):
        assert norm > 0.05
        assert clipped == pytest.approx(0.05, rel=1e-4)


def _sync_checks() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different weights on every rank ...
    fm = FlatParamModule(GPT(CFG))
    trainer = DistributedTrainer(fm)  # ... until the trainer broadcasts rank 0's
    trainer.assert_in_sync()
    out = {}
    if rank == world - 1:
        with torch.no_grad():
            fm.module.ln_f.bias[3] += 1e-3
    try:
        trainer.assert_in_sync()
    except RankMismatchError as e:
        out["drift"] = str(e)
    trainer.broadcast(src=0)
    trainer.assert_in_sync()
    with torch.no_grad():
        fm.flat_param.fill_(float(rank))
    trainer.all_reduce_parameters()
    out["mean"] = fm.module.wte.weight.unique().tolist()
    with torch.no_grad():
        fm.flat_param.fill_(float(rank))
    trainer.all_reduce_parameters("max")
    out["max"] = fm.module.ln_f.weight.unique().tolist()
    with pytest.raises(TorchShardError, match="op: expected one of"):
        trainer.all_reduce_parameters("avg")
    trainer.close()
    with pytest.raises(TorchShardError, match="closed"):
        trainer.average_gradients()
    return out


def test_broadcast_assert_in_sync_and_parameter_averaging():
    for r in run_distributed(_sync_checks, 3, timeout=60):
        assert "'ln_f.bias' differs between rank 0 and ranks [2]" in r["drift"]
        assert r["mean"] == [1.0] and r["max"] == [2.0]


def _second_backward_without_average() -> str:
    fm = FlatParamModule(GPT(CFG))
    trainer = DistributedTrainer(fm)
    fm(*batch(0, 0))[1].backward()
    try:
        fm(*batch(0, 1))[1].backward()
    except TorchShardError as e:
        return str(e)
    finally:
        trainer.close()
    return "no error"


def test_second_backward_without_average_is_a_clear_error():
    for m in run_distributed(_second_backward_without_average, 2, timeout=60):
        assert "received a second gradient before average_gradients()" in m
        assert "no_sync" in m


def test_bad_arguments():
    fm = FlatParamModule(nn.Linear(2, 2))
    with pytest.raises(TorchShardError, match="FlatParamModule"):
        DistributedTrainer(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TorchShardError, match="bucket_mb"):
        DistributedTrainer(fm, bucket_mb=0)


def _meta_model_is_bound_and_initialized() -> list[float]:
    with torch.device("meta"):
        model = GPT(CFG)
    fm = FlatParamModule(model)
    trainer = DistributedTrainer(fm)
    assert fm.is_bound and fm.device.type == "cpu" and fm.flat_grad is not None
    assert torch.all(model.ln_f.weight == 1)
    trainer.assert_in_sync()
    x, y = batch(dist.get_rank(), 0)
    loss = F.cross_entropy(fm(x)[0].flatten(0, 1), y.flatten())
    loss.backward()
    trainer.average_gradients()
    trainer.close()
    return fm.module.wte.weight.grad[:2, :2].flatten().tolist()


def test_meta_built_model_is_bound_initialized_and_broadcast():
    a, b = run_distributed(_meta_model_is_bound_and_initialized, 2, timeout=60)
    assert a == b


def _fp16_mean(shard: bool) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(6, 3).half()
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=1)
    fm = FlatParamModule(model, dtype=torch.float16)
    trainer = DistributedTrainer(fm, shard=shard, master_dtype=torch.float16)
    out = {}
    # each rank's gradient is 4e4 everywhere: the sum (8e4) overflows float16, the mean does not
    (fm.module.weight * 4e4).sum().backward()
    trainer.average_gradients()
    s0, e0 = introspect.slice_range(trainer, rank) if shard else (0, fm.numel)
    w = fm.layout.slots[0]
    mine = fm.flat_grad[max(w.offset, s0) : min(w.end, e0)]
    out["mean"] = mine.unique().tolist()
    trainer.zero_grad()
    # against DDP, which also divides first: bitwise
    same = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank)).half()
        trainer.zero_grad()
        ref.zero_grad()
        (fm(x).float().square().sum() * 3e3).backward()
        (ref(x).float().square().sum() * 3e3).backward()
        trainer.average_gradients()
        if not shard:  # sharded: only the rank's slice holds the mean
            same += [torch.equal(p.grad, q.grad) for p, q in zip(fm.parameters(), ref.parameters())]
    out["same"] = same
    out["finite"] = bool(torch.isfinite(fm.flat_grad[s0:e0]).all())
    trainer.close()
    return out


@pytest.mark.parametrize("shard", [False, True])
def test_fp16_gradients_do_not_overflow_in_the_mean(shard):
    for out in run_distributed(_fp16_mean, 2, shard, timeout=60):
        assert out["mean"] == [4e4], out
        assert out["finite"], out
        assert len(out["same"]) == (0 if shard else 6) and all(out["same"]), out


def _shard_that_is_no_mode() -> str:
    try:
        DistributedTrainer(FlatParamModule(nn.Linear(2, 2)), shard="fully")
    except TorchShardError as e:
        return str(e)
    return ""


def test_shard_that_is_no_mode_is_an_error_naming_it():
    message = run_distributed(_shard_that_is_no_mode, 1, timeout=60)[0]
    assert message == "shard: expected True, False or 'full', got 'fully'"
