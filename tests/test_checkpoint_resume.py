"""Save at one world size, resume at others: training continues bitwise as if never stopped.

The oracle is an uninterrupted run: a second model whose exact in-memory
state (weights and ``optimizer.state_dict()``) the test carries between the
phases with torch's own serialization, trained side by side with the resumed one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from torch import nn

import torchshard
from torchshard import checkpoint

# ~0.4M parameters (5 MB with AdamW state): big enough to account read bytes, odd enough
# (n_embd 120, the extra 3x5 layer) that no world size divides the buffer evenly
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=120)
STEPS_PER_PHASE = 3


class Model(GPT):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.never_used = nn.Linear(3, 5)  # never gets a gradient: no optimizer state
        self.wpe.weight.requires_grad_(False)  # frozen


def make_optimizer(kind: str, fm: torchshard.FlatParamModule) -> torch.optim.Optimizer:
    decay = [p for n, p in fm.module.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in fm.module.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.8, 0.95), eps=1e-6)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train_step(fm, trainer, opt, step: int) -> None:
    opt.zero_grad()
    fm(*batch(dist.get_rank(), step))[1].backward()
    trainer.average_gradients()
    opt.step()


def assert_same(fm, opt, ref_fm, ref_opt, where: str) -> None:
    for (name, p), q in zip(fm.module.named_parameters(), ref_fm.module.parameters()):
        assert torch.equal(p, q), f"{where}: parameter {name}"
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in ref_group.items() if k != "params"
        }, where
    for p, q in zip(fm.parameters(), ref_fm.parameters()):
        st, ref_st = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert st.keys() == ref_st.keys(), f"{where}: state keys {st.keys()} vs {ref_st.keys()}"
        for k in st:
            assert torch.equal(torch.as_tensor(st[k]), torch.as_tensor(ref_st[k])), f"{where}: {k}"


def _phase(root: str, snapshot: str, kind: str, saved_at: int | None, use_async: bool) -> dict:
    """One phase at this world size; ``saved_at``: the previous phase's world (None: first)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # the first phase's starting point; later ones load
    fm = torchshard.FlatParamModule(Model())
    trainer = torchshard.DistributedTrainer(fm)
    opt = make_optimizer(kind, fm)
    torch.manual_seed(1234)
    ref_fm = torchshard.FlatParamModule(Model())
    ref_trainer = torchshard.DistributedTrainer(ref_fm)
    ref_opt = make_optimizer(kind, ref_fm)
    start, info = 0, None
    if saved_at is not None:
        info = checkpoint.load(root, trainer, optimizer=opt)
        start = info.step
        assert info.extra == {"kind": kind, "saved_at_world": saved_at}, info.extra
        assert info.path.name == f"step-{start:08d}" and str(info.path).startswith(root)
        state = torch.load(snapshot, weights_only=True)  # the oracle's carried state
        ref_fm.load_state_dict(state["model"])
        ref_opt.load_state_dict(state["optim"])
        assert_same(fm, opt, ref_fm, ref_opt, f"right after loading at world {world}")
    for step in range(start, start + STEPS_PER_PHASE):
        train_step(fm, trainer, opt, step)
        train_step(ref_fm, ref_trainer, ref_opt, step)
        assert_same(fm, opt, ref_fm, ref_opt, f"step {step} at world {world}")
    assert fm.module.never_used.weight not in opt.state
    end = start + STEPS_PER_PHASE
    extra = {"kind": kind, "saved_at_world": world}
    if use_async:
        ckpt = checkpoint.Checkpointer(root, keep_last=2)
        future = ckpt.save(trainer, step=end, optimizer=opt, extra=extra)
        train_step(fm, trainer, opt, end)  # keeps training while the save runs
        future.wait()
        ckpt.close()
    else:
        checkpoint.save(root, trainer, step=end, optimizer=opt, extra=extra)
    if rank == 0:
        torch.save({"model": ref_fm.state_dict(), "optim": ref_opt.state_dict()}, snapshot)
    dist.barrier()
    trainer.close()
    ref_trainer.close()
    return {"bytes_read": info.bytes_read if info else 0, "step": start}


def checkpoint_bytes(root) -> int:
    latest = sorted(root.glob("step-*"))[-1]
    return sum(f.stat().st_size for f in latest.glob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_resume_at_other_world_sizes_continues_bitwise(tmp_path, kind):
    root, snap = tmp_path / "ckpt", str(tmp_path / "oracle.pt")
    worlds = [4, 3, 2, 1, 4]
    for i, world in enumerate(worlds):
        size_before = checkpoint_bytes(root) if i else 0
        saved_at = worlds[i - 1] if i else None
        out = run_distributed(
            _phase, world, str(root), snap, kind, saved_at, i % 2 == 1, timeout=120
        )
        if i:
            assert [r["step"] for r in out] == [i * STEPS_PER_PHASE] * world  # the latest one
            # each byte read about once across all ranks, not once per rank
            total = sum(r["bytes_read"] for r in out)
            assert size_before <= total <= 1.05 * size_before, (world, total, size_before)
    steps = sorted(p.name for p in root.glob("step-*"))
    assert steps[-1] == f"step-{len(worlds) * STEPS_PER_PHASE:08d}"
