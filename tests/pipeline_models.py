"""The GPT that the pipeline tests split (examples/gpt.py): built on meta with its head tied
to the embedding or untied, and the loss of one microbatch on the last stage's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig
from torch import nn


def meta_gpt(cfg: GPTConfig, tied: bool) -> GPT:
    """``GPT(cfg)`` on meta; ``tied=False`` gives ``lm_head`` a weight of its own."""
    with torch.device("meta"):
        model = GPT(cfg)
        if not tied:
            model.lm_head.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.n_embd))
    return model


def gpt_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (the last stage returns them alone, the whole model a
    ``(logits, loss)`` tuple)."""
    logits = out[0] if isinstance(out, tuple) else out
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())
