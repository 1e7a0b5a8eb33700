"""What the sharded-trainer tests share: a tiny GPT whose buffer no world size in 2..4 divides,
per-rank batches, and a trainer's whole state laid out like the flat buffer.

Used by ``test_parallel_full.py``, ``test_parallel_sharded_parity.py``, ``test_parallel_subgroups.py``,
``test_checkpoint_bf16_master.py``, ``test_checkpoint_async_sharded.py`` and
``test_checkpoint_failures.py``; all of it runs in the worker processes of ``run_distributed``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchshard import DistributedTrainer, FlatParamModule

CFG = GPTConfig(vocab_size=60, block_size=8, n_layer=2, n_head=2, n_embd=20)
KW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1, betas=(0.9, 0.95))


class Model(GPT):
    """The GPT plus a 5-element gain: 11545 elements, which no world size in 2..4 divides."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.gain = torch.nn.Parameter(torch.ones(5))

    def forward(self, idx, targets):  # type: ignore[override]
        logits, loss = super().forward(idx, targets)
        return logits, loss * self.gain.mean()


class Checkpointed(Model):
    """The model with each block under activation checkpointing (recomputed in backward)."""

    def forward(self, idx, targets):  # type: ignore[override]
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss * self.gain.mean()


class Heads(Model):
    """The model plus two auxiliary heads that some steps (and ranks) do not use."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = torch.nn.Linear(CFG.n_embd, 1)  # used on some ranks in some steps
        self.aux2 = torch.nn.Linear(CFG.n_embd, 1)  # in some steps used by no rank at all

    def forward(self, idx, targets, use_aux=False, use_aux2=False):  # type: ignore[override]
        logits, loss = super().forward(idx, targets)
        h = self.wte(idx)
        if use_aux:
            loss = loss + self.aux(h).pow(2).mean()
        if use_aux2:
            loss = loss + self.aux2(h).pow(2).mean()
        return logits, loss


@torch.no_grad()
def tree_sum(model: torch.nn.Module) -> list[torch.Tensor | None]:
    """Each parameter's gradient summed over 4 ranks as hybrid sharding at 2 x 2 sums it:
    ``(g0 + g1) + (g2 + g3)`` (zeros where a rank has none; ``None`` where no rank has one).
    A collective over the default group of 4 ranks."""
    sums = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        had = torch.tensor([float(p.grad is not None)])
        everyone = [torch.empty_like(g) for _ in range(4)]
        dist.all_gather(everyone, g)
        dist.all_reduce(had)
        g0, g1, g2, g3 = everyone
        sums.append(((g0 + g1) + (g2 + g3)) if had.item() else None)
    return sums


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln" in name or name.startswith("ln_")


def torch_groups(model: torch.nn.Module) -> list[dict]:
    """``no_decay``'s param groups for a plain torch optimizer (the DDP oracle's)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not no_decay(n)]},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def new_trainer(
    shard: bool,
    dtype: torch.dtype = torch.float32,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
    seed: int = 0,
) -> DistributedTrainer:
    """A trainer of :class:`Model` (weights from ``seed``) with AdamW in two param groups."""
    torch.manual_seed(seed)
    fm = FlatParamModule(Model(), align_bytes=4, dtype=dtype)
    trainer = DistributedTrainer(fm, shard=shard, process_group=group, src=src, bucket_mb=0.004)
    trainer.make_optimizer(torch.optim.AdamW, groups=[(no_decay, {"weight_decay": 0.0})], **KW)
    return trainer


def train(trainer: DistributedTrainer, steps: range, rank: int | None = None) -> None:
    """``trainer.step()`` on ``batch(rank, step)`` (``rank``: the trainer's own by default)."""
    for step in steps:
        trainer.zero_grad()
        trainer.module(*batch(trainer.rank if rank is None else rank, step))[1].backward()
        trainer.step()


def has_master(trainer: DistributedTrainer) -> bool:
    """Whether the optimizer updates master copies in another dtype than the flat buffer."""
    return trainer.shard and trainer.module.dtype != torch.float32  # master_dtype's default


def flat_state(trainer: DistributedTrainer) -> dict[str, torch.Tensor]:
    """Weights, master weights and optimizer state laid out like the flat buffer (zeros in
    the gaps), in any mode, the same on every rank (a collective).

    ``weights``: every parameter by slot, read inside ``trainer.gathered()`` (the full mode
    has no flat buffer); ``master``: what a sharded optimizer updates, when that is another
    dtype than the weights; ``<key>``: each flat optimizer state; ``<key>/slot``: each scalar
    state by slot (pieces of a slot share it).
    """
    fm, opt = trainer.module, trainer.optimizer
    assert opt is not None
    layout, n = fm.layout, fm.layout.numel
    params = dict(fm.module.named_parameters(remove_duplicate=False))
    out = {"weights": torch.zeros(n, dtype=fm.dtype)}
    with trainer.gathered():
        for s in layout.slots:
            out["weights"][s.offset : s.end] = params[s.name].detach().reshape(-1).cpu()
    mine = trainer.rank == 0 or bool(trainer.shard)  # replicated: every rank holds it all
    segments = trainer.optimizer_segments()
    local: dict[str, tuple[str, bool]] = {}
    for _, _, _, t in segments:
        for k, v in opt.state.get(t, {}).items():
            local.setdefault(k, (str(v.dtype), v.dim() == 0))
    everyone: list[dict] = [{} for _ in range(trainer.world_size)]
    dist.all_gather_object(everyone, local, group=trainer.process_group)
    keys: dict[str, torch.Tensor] = {}
    for k, (dtype, scalar) in sorted({k: v for d in everyone for k, v in d.items()}.items()):
        dt = getattr(torch, dtype.removeprefix("torch."))
        keys[f"{k}/slot" if scalar else k] = torch.zeros(len(layout) if scalar else n, dtype=dt)
    if trainer.shard and fm.dtype != torch.float32:
        keys["master"] = torch.zeros(n, dtype=torch.float32)
    for slot, a, b, t in segments:
        if not mine:
            continue
        if "master" in keys:
            keys["master"][a:b] = t.detach().reshape(-1)
        for k, v in opt.state.get(t, {}).items():
            if v.dim() == 0:
                keys[f"{k}/slot"][slot] = v
            else:
                keys[k][a:b] = v.reshape(-1)
    for k in sorted(keys):
        op = dist.ReduceOp.MAX if k.endswith("/slot") else dist.ReduceOp.SUM
        dist.all_reduce(keys[k], op=op, group=trainer.process_group)  # one rank per element
        out[k] = keys[k]
    return out


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors are not bitwise equal (dtype included), or missing."""
    out = [f"{k}: missing" for k in want if k not in got]
    out += [f"{k}: unexpected" for k in got if k not in want]
    for k in sorted(got.keys() & want.keys()):
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
            diff = (a.double() - b.double()).abs()
            out.append(f"{k}: {int((diff != 0).sum())} elements differ, max {diff.max().item():g}")
    return out
