"""A checkpoint of another model or optimizer is a clear CheckpointError naming the first
difference, and the failed load changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_harness import (
    CFG,
    build,
    refused,
    same_bits,
    target,
    train,
)
from gpt import GPTConfig

import torchshard
from torchshard import checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")


# -- 7. a checkpoint of a different model ----------------------------------------------------------
@pytest.mark.parametrize(
    ("saved_cfg", "load_cfg", "names"),
    [
        (
            CFG,
            GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
            ["wte.weight"],
        ),
        (
            CFG,
            GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=16),
            ["wte.weight"],
        ),
        (
            CFG,
            GPTConfig(vocab_size=64, block_size=17, n_layer=2, n_head=2, n_embd=16),
            ["wpe.weight"],
        ),
        (
            CFG,
            GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16),
            ["ln_f.weight", "blocks.2.ln_1.weight"],
        ),
        (
            GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16),
            CFG,
            ["blocks.2.ln_1.weight", "ln_f.weight"],
        ),
    ],
    ids=["n_embd", "vocab", "block_size", "one layer more", "one layer less"],
)
def test_checkpoint_of_a_different_model(tmp_path, saved_cfg, load_cfg, names):
    fm = build(saved_cfg, seed=0)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)
    train(fm, opt, 1, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", fm, step=1, optimizer=opt)
    for with_optimizer in (True, False):
        message = refused(path, *target(load_cfg), with_optimizer=with_optimizer)
        assert "different model" in message
        assert str(path) in message
        for name in names:
            assert repr(name) in message, message
        # the *first* difference: nothing about a later parameter
        assert "ln_f.bias" not in message


# -- 9. optimizer mismatches -----------------------------------------------------------------------
def _groups_two(fm: torchshard.FlatParamModule) -> torch.optim.Optimizer:
    decay = [p for p in fm.parameters() if p.dim() >= 2]
    rest = [p for p in fm.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=2e-3)


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (
            lambda fm: torch.optim.SGD(fm.parameters(), lr=0.1, momentum=0.9),
            ["torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"],
        ),
        (lambda fm: torch.optim.Adam(fm.parameters(), lr=2e-3), ["AdamW", "torch.optim.adam.Adam"]),
        (_groups_two, ["param groups", "1", "2"]),
        (
            lambda fm: torch.optim.AdamW([p for p in fm.parameters() if p.dim() >= 2], lr=2e-3),
            ["param group 0", "'blocks.0.ln_1.weight'", "'blocks.0.attn.qkv.weight'"],
        ),
        (
            lambda fm: torch.optim.AdamW(list(fm.parameters())[::-1], lr=2e-3),
            ["param group 0", "'wte.weight'", "'ln_f.bias'"],
        ),
    ],
    ids=["SGD", "Adam", "two groups", "fewer params", "other order"],
)
def test_optimizer_mismatch(saved, make, expect):
    fm = build(seed=1)
    opt = make(fm)
    train(fm, opt, 2, seed=1)
    message = refused(saved, fm, opt)
    assert str(saved) in message
    assert "optimizer" in message
    for text in expect:
        assert text in message, message


def test_optimizer_state_from_a_checkpoint_saved_without_one(tmp_path):
    fm = build(seed=0)
    path = checkpoint.save(tmp_path / "ckpt", fm, step=3)
    message = refused(path)
    assert str(path) in message
    assert "no optimizer state" in message
    assert "optimizer=None" in message
    # and without an optimizer it loads (the control)
    fm2, _ = target()
    assert checkpoint.load(path, fm2).step == 3
    assert same_bits(fm2.flat_param, fm.flat_param)
