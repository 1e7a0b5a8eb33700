"""FSDP-lite: sharded optimizer state and gradients, against the replicated trainer and DDP."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule

CFG = GPTConfig(vocab_size=60, block_size=8, n_layer=2, n_head=2, n_embd=20)


class Model(GPT):
    """The GPT plus a 5-element gain: 11545 elements, which no world size in 2..4 divides."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.gain = torch.nn.Parameter(torch.ones(5))

    def forward(self, idx, targets):  # type: ignore[override]
        logits, loss = super().forward(idx, targets)
        return logits, loss * self.gain.mean()


KW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1, betas=(0.9, 0.95))


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln" in name or name.startswith("ln_")


def torch_groups(model) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not no_decay(n)]},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _sharded_vs_replicated_vs_ddp(steps: int = 10, clip: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Model()
    models = {name: copy.deepcopy(ref) for name in ("sharded", "replicated")}
    trainers, opts = {}, {}
    for name, model in models.items():
        fm = FlatParamModule(model, align_bytes=4)  # no padding between parameters
        trainers[name] = DistributedTrainer(fm, shard=name == "sharded", bucket_mb=0.002)
        opts[name] = trainers[name].make_optimizer(
            torch.optim.AdamW, groups=[(no_decay, {"weight_decay": 0.0})], **KW
        )
    ddp = DDP(ref)
    ddp_opt = torch.optim.AdamW(torch_groups(ref), **KW)
    worst = 0.0
    for step in range(steps):
        for t in trainers.values():
            t.zero_grad()
            t.module(*batch(rank, step))[1].backward()
            if clip:
                t.clip_grad_norm_(0.5)
            t.step()
        ddp_opt.zero_grad()
        ddp(*batch(rank, step))[1].backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ddp_opt.step()
        for (n, p), q, r in zip(
            models["sharded"].named_parameters(),
            models["replicated"].parameters(),
            ref.parameters(),
        ):
            if world == 2 and not clip:
                assert torch.equal(p, q), f"step {step}: {n}: sharded vs replicated"
                assert torch.equal(p, r), f"step {step}: {n}: sharded vs DDP"
            torch.testing.assert_close(
                p, q, rtol=1e-5, atol=1e-6, msg=f"step {step} {n} vs replicated"
            )
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=f"step {step} {n} vs DDP")
            worst = max(worst, (p - r).abs().max().item())
    trainers["sharded"].assert_in_sync()
    mem = {name: t.memory_bytes() for name, t in trainers.items()}
    pieces = {name: len(t.optimizer_segments()) for name, t in trainers.items()}
    numel = trainers["sharded"].module.layout.numel
    padded = trainers["sharded"].padded_numel
    for t in trainers.values():
        t.close()
    return {"worst": worst, "mem": mem, "numel": numel, "padded": padded, "pieces": pieces}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_training_equals_replicated_and_ddp(world_size):
    results = run_distributed(_sharded_vs_replicated_vs_ddp, world_size, timeout=180)
    numel = results[0]["numel"]
    padded = results[0]["padded"]
    assert numel % world_size != 0 and padded % world_size == 0 and padded - numel < 4 * world_size
    replicated = results[0]["mem"]["replicated"]["optimizer"]
    shards = [r["mem"]["sharded"]["optimizer"] for r in results]
    # Every trainable element's AdamW state (8 bytes) lives on exactly one rank; a parameter
    # split between two slices has one more 4-byte `step` counter.
    extra_pieces = sum(r["pieces"]["sharded"] for r in results) - results[0]["pieces"]["replicated"]
    assert 0 < extra_pieces < world_size
    assert sum(shards) == replicated + 4 * extra_pieces
    # ... and no rank holds more than its slice of the padded buffer (plus its `step`s).
    for r in results:
        elementwise = r["mem"]["sharded"]["optimizer"] - 4 * r["pieces"]["sharded"]
        assert elementwise <= 8 * padded // world_size
        assert elementwise >= 8 * (padded // world_size - (padded - numel))


def test_global_norm_clipping_matches_torch():
    # Clipping rounds differently (per-slice norms, then one all-reduce), hence tolerances.
    results = run_distributed(_sharded_vs_replicated_vs_ddp, 3, 10, True, timeout=180)
    assert all(r["worst"] < 1e-5 for r in results)
