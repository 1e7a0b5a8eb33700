"""A small GPT (nanoGPT-style) used by the training example, the tests and the benchmarks.

Token and position embeddings, pre-LayerNorm blocks with causal
self-attention and a GELU MLP, and an ``lm_head`` tied to the token
embedding (one ``Parameter`` under two names, as in GPT-2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Tokens; 256 covers raw bytes."""
    block_size: int = 128
    """Longest sequence (position embeddings)."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        """Sizes by name: tiny (tests), small (the example), 125m, 1.3b, 7b (benchmarks)."""
        presets = {
            "tiny": dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16),
            "small": dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
            "125m": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
            "1.3b": dict(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
            "7b": dict(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096),
        }
        if name not in presets:
            raise ValueError(f"preset: expected one of {sorted(presets)}, got {name!r}")
        return cls(**presets[name])


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_layer = cfg.n_layer  # for the scaled init of proj
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.qkv.tp_packed = 3  # q, k and v fused: tensor parallelism splits each
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # the heads this rank holds (all of them, unless tensor parallelism splits qkv)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (z.view(b, t, -1, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


TP_PLAN = {
    "wte": "embedding_rowwise",
    "blocks.*.attn.qkv": "packed_colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "lm_head": "colwise_gather_output",
}
"""Tensor parallelism for :class:`GPT` (``FlatParamModule(model, tp_plan=TP_PLAN, mesh=...)``):
Megatron's split of each block, a vocabulary-parallel embedding tied to a gathered head."""


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None) -> (logits, loss)``.

    A pipeline stage (:func:`torchshard.split_stages`) may lack modules: without ``wte``
    it takes hidden states for ``idx``; without ``lm_head`` it returns hidden states."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two names
        if not any(p.is_meta for p in self.parameters()):
            self.apply(init_gpt_weights)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = idx
        if self.wte is not None:  # the whole model, or a pipeline's first stage: tokens in
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:  # a pipeline stage iterates only its own blocks
            x = block(x)
        if self.lm_head is None:  # a pipeline stage before the last: hidden states out
            return x  # type: ignore[return-value]
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


@torch.no_grad()
def init_gpt_weights(m: nn.Module) -> None:
    """GPT-2 initialization, in place; usable as ``fm.init_weights(init_gpt_weights)``."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
    if isinstance(m, CausalSelfAttention):
        # Scaled residual projection (GPT-2); applied after the Linear rule above
        # because apply() visits children first.
        nn.init.normal_(m.proj.weight, std=0.02 / math.sqrt(2 * m.n_layer))


def gpt_small() -> GPT:
    """The example's default model (``torchshard layout gpt:gpt_small`` from examples/)."""
    return GPT(GPTConfig.preset("small"))
