"""Tiny models the tests share: the example GPT, and transformers configs (random init, no
download)."""

from __future__ import annotations

from typing import Any

import torch
from gpt import GPT, GPTConfig

CFG = GPTConfig.preset("tiny")


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


class GPTWithAux(GPT):
    """The GPT plus an auxiliary head that a test can leave unused on some ranks and steps
    (``use_aux=False``): the used-parameter mask then has news."""

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.aux = torch.nn.Linear(cfg.n_embd, 1)

    def forward(self, idx, targets, use_aux=True):  # type: ignore[override]
        logits, loss = super().forward(idx, targets)
        if use_aux:
            loss = loss + self.aux(self.wte(idx)).pow(2).mean()
        return logits, loss


class Blocks(torch.nn.Module):
    """The README's fully sharded block's shape: an input layer, ``n`` residual blocks in a
    ``ModuleList`` (the fully sharded mode's units by default) and a head."""

    def __init__(self, d_in: int = 16, width: int = 64, n: int = 4, d_out: int = 1) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(d_in, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(n)
        )
        self.head = torch.nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A two-layer GPT-2 or Llama config, width 32, no dropout; ``overrides`` win."""
    import transformers

    if arch == "gpt2":
        base = dict(
            n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=64,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2Config(**{**base, **overrides})
    if arch == "llama":
        base = dict(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return transformers.LlamaConfig(**{**base, **overrides})
    raise ValueError(f"arch: expected 'gpt2' or 'llama', got {arch!r}")
