"""The per-optimizer rules (``checkpoint/_rules.py``) agree with torch: torch's own values pass,
what torch's constructors refuse is refused, and an optimizer without rules is checked
against the live optimizer's types.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoint_harness import (
    build,
    read_meta,
    refused,
    same_bits,
    train,
    tree_diff,
    write_meta,
)

from torchshard import checkpoint
from torchshard.checkpoint._rules import OPTIMIZER_RULES, Invalid

pytestmark = pytest.mark.usefixtures("single_thread")


# -- 5c. every optimizer with rules: torch's own values pass, torch's refusals are refused ---------
KINDS = {
    "SGD": (torch.optim.SGD, dict(lr=0.05)),
    "SGD momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    "SGD nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "Adam": (torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01)),
    "Adam amsgrad": (torch.optim.Adam, dict(lr=1e-3, amsgrad=True)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-3, betas=(0.8, 0.9))),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-3)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-3, momentum_decay=0.005)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-3, decoupled_weight_decay=True, weight_decay=0.1)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2, lr_decay=0.01)),
    "Adadelta": (torch.optim.Adadelta, dict(lr=0.5, rho=0.8)),
    "ASGD (no rules: live types)": (torch.optim.ASGD, dict(lr=1e-2, t0=3.0)),
}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_every_optimizer_with_rules_is_tested():
    assert {_qualname(c) for c, _ in KINDS.values()} - {_qualname(torch.optim.ASGD)} == set(
        OPTIMIZER_RULES
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_of_every_optimizer_passes_its_rules(tmp_path, kind):
    cls, hyper = KINDS[kind]
    fm = build(seed=0)
    named = list(fm.module.named_parameters())
    groups = [
        {"params": [p for n, p in named if p.dim() >= 2]},
        {"params": [p for n, p in named if p.dim() < 2], "lr": hyper["lr"] / 2},
    ]
    opt = cls(groups, **hyper)
    train(fm, opt, 2, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", fm, step=2, optimizer=opt)
    fm2 = build(seed=1)
    opt2 = cls(fm2.parameters(), **hyper)
    opt2 = cls(
        [
            {"params": [p for p in fm2.parameters() if p.dim() >= 2]},
            {"params": [p for p in fm2.parameters() if p.dim() < 2]},
        ],
        **hyper,
    )
    checkpoint.load(path, fm2, optimizer=opt2)
    assert same_bits(fm2.flat_param, fm.flat_param)
    assert not tree_diff(opt2.state_dict(), opt.state_dict(), "optimizer")


@pytest.mark.parametrize("name", list(OPTIMIZER_RULES))
def test_required_hyperparameters_are_those_torch_does_not_fill_in(name):
    """What a rule requires is exactly what torch's load_state_dict leaves missing."""
    cls = next(c for c, _ in KINDS.values() if _qualname(c) == name)
    p = torch.nn.Parameter(torch.ones(3))
    opt = cls([p], lr=0.1)
    sd = opt.state_dict()
    keys = [k for k in sd["param_groups"][0] if k != "params"]
    filled = []
    for key in keys:
        group = {k: v for k, v in sd["param_groups"][0].items() if k != key}
        probe = cls([p], lr=0.1)
        probe.load_state_dict({"state": {}, "param_groups": [group]})
        if key in probe.param_groups[0]:
            filled.append(key)
    assert set(OPTIMIZER_RULES[name].required) == set(keys) - set(filled)
    assert set(OPTIMIZER_RULES[name].hyper) >= set(keys), "a hyperparameter without a rule"


BAD = {"lr": -1e-3, "eps": -1.0, "weight_decay": -0.1, "momentum": -0.5, "alpha": -1.0,
       "lr_decay": -1.0, "initial_accumulator_value": -1.0, "momentum_decay": -1.0,
       "rho": 1.5, "betas": (0.9, 1.0)}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIMIZER_RULES))
def test_the_rules_refuse_what_torch_refuses(name):
    cls = next(c for c, _ in KINDS.values() if _qualname(c) == name)
    rules = OPTIMIZER_RULES[name]
    tried = 0
    for key, bad in BAD.items():
        if key not in rules.hyper:
            continue
        tried += 1
        with pytest.raises(ValueError):  # torch's constructor: the reference
            cls([torch.nn.Parameter(torch.ones(2))], **{key: bad})
        with pytest.raises(Exception, match=re.escape(f"group.{key}")) as info:
            rules.hyper[key](list(bad) if isinstance(bad, tuple) else bad, f"group.{key}")
        assert type(info.value) is Invalid
        good = cls([torch.nn.Parameter(torch.ones(2))]).param_groups[0][key]
        rules.hyper[key](list(good) if isinstance(good, tuple) else good, f"group.{key}")
    assert tried >= 3


def _saved_with(tmp_path: Path, make: Callable[..., torch.optim.Optimizer]) -> Path:
    fm = build(seed=0)
    opt = make(fm.parameters())
    train(fm, opt, 1, seed=0)
    return checkpoint.save(tmp_path / "ckpt", fm, step=1, optimizer=opt)


@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        ("t0", "x", "like this optimizer's"),
        ("t0", True, "like this optimizer's"),
        ("lambd", None, "like this optimizer's"),
        ("no_such_hyperparameter", 1.0, "expected a hyperparameter of torch.optim.asgd.ASGD"),
        ("DROP lr", None, "optimizer.param_groups[0].lr: expected a value"),
    ],
)
def test_an_optimizer_without_rules_gets_the_live_types(tmp_path, key, value, expect):
    path = _saved_with(tmp_path, lambda ps: torch.optim.ASGD(ps, lr=1e-2))
    meta = read_meta(path)
    if key.startswith("DROP "):
        del meta["optimizer"]["param_groups"][0][key.split()[1]]
    else:
        meta["optimizer"]["param_groups"][0][key] = value
    write_meta(path, meta)
    fm = build(seed=1)
    message = refused(path, fm, torch.optim.ASGD(fm.parameters(), lr=1e-2))
    assert expect in message, message


@pytest.mark.parametrize(
    ("key", "expect"),
    [("capturable", "capturable: expected false"), ("differentiable", "as this optimizer has it")],
)
def test_capturable_on_cpu_and_a_different_differentiable_are_refused(saved, key, expect):
    meta = read_meta(saved)
    meta["optimizer"]["param_groups"][0][key] = True
    write_meta(saved, meta)
    assert expect in refused(saved)
