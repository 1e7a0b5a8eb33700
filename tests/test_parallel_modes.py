"""The mode registry: ``shard=`` as a typed choice (``Replicate()``, ``ShardOptimizer()``,
``FullShard()``) or its alias (``False``, ``True``, ``"full"``) with the loose keywords, read
once; the aliases behave and fail as before, and a choice trains as its alias does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models import Blocks
from multiprocess import run_distributed

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, FullShard, Replicate, ShardOptimizer
from torchshard._parallel.modes import ALIASES, MODES, ModeError, choose, entry_for


def test_one_line_per_mode_and_the_estimates_names():
    assert [e.name for e in MODES] == ["replicated", "sharded", "full"]
    assert ALIASES == (False, True, "full")
    assert [e.choice for e in MODES] == [Replicate, ShardOptimizer, FullShard]
    assert [e.flag for e in MODES] == ["--replicated", "--shard", "--full"]
    assert [e.gathers for e in MODES] == [False, False, True]
    assert [e.master for e in MODES] == [False, True, True]
    for e in MODES:
        assert entry_for(e.alias) is e and entry_for(e.choice()) is e
        assert getattr(torchshard, e.choice.__name__) is e.choice


def test_choices_are_frozen_keyword_only_dataclasses():
    for cls in (Replicate, ShardOptimizer, FullShard):
        params = dataclasses.fields(cls)
        assert all(f.kw_only for f in params), cls
        if params:
            with pytest.raises(TypeError):
                cls(params[0].default)  # positional: refused
    with pytest.raises(dataclasses.FrozenInstanceError):
        FullShard().prefetch = 2  # type: ignore[misc]
    assert FullShard(prefetch=2) == FullShard(prefetch=2) != FullShard()


@pytest.mark.parametrize(
    ("shard", "loose", "expected"),
    [
        (False, {}, Replicate()),
        (False, {"master_dtype": torch.bfloat16}, Replicate()),  # ignored, as always
        (True, {"master_dtype": torch.bfloat16}, ShardOptimizer(master_dtype=torch.bfloat16)),
        ("full", {"prefetch": 2}, FullShard(prefetch=2)),
        ("full", {"units": ["blocks.0"]}, FullShard(units=["blocks.0"])),
        (True, {"prefetch": 1, "units": "auto"}, ShardOptimizer()),  # defaults ask nothing
        (FullShard(prefetch=0), {"prefetch": 1}, FullShard(prefetch=0)),
    ],
)
def test_an_alias_and_its_keywords_are_one_choice(shard, loose, expected):
    assert choose(shard, strict=True, **loose) == expected


@pytest.mark.parametrize(
    ("shard", "loose", "message"),
    [
        ("fully", {}, "shard: expected True, False or 'full', got 'fully'"),
        (1, {}, "shard: expected True, False or 'full', got 1"),
        (Replicate, {}, "shard: expected True, False or 'full', got <class"),
        (True, {"units": ["blocks.0"]}, "units: only with shard='full', got ['blocks.0'] with"),
        (False, {"prefetch": 2}, "prefetch: only with shard='full', got 2 with shard=False"),
        (False, {"prefetch": True}, "prefetch: only with shard='full', got True with"),
        ("full", {"prefetch": -1}, "prefetch: expected an int >= 0, got -1"),
        ("full", {"reshard_after_forward": "yes"}, "reshard_after_forward: expected True or"),
        (FullShard(), {"prefetch": 2}, "prefetch: expected the mode's settings inside"),
        (ShardOptimizer(), {"units": "blocks"}, "ShardOptimizer takes no units"),
    ],
)
def test_bad_choices_name_what_is_wrong(shard, loose, message):
    with pytest.raises(ModeError) as e:
        choose(shard, strict=True, **loose)
    assert message in str(e.value), str(e.value)
    assert isinstance(e.value, torchshard.TorchShardError)


def test_the_planner_ignores_keywords_of_other_modes():
    assert choose(False, strict=False, prefetch=5) == Replicate()
    with pytest.raises(ModeError, match="prefetch: only with"):
        choose(False, strict=True, prefetch=5)


def test_bad_settings_are_refused_when_made():
    with pytest.raises(ModeError, match="prefetch: expected an int >= 0, got True"):
        FullShard(prefetch=True)
    with pytest.raises(ModeError, match="reshard_after_forward: expected True or False"):
        FullShard(reshard_after_forward=None)  # type: ignore[arg-type]


# -- a choice trains as its alias -------------------------------------------------------------
PAIRS = [
    ({"shard": False}, {"shard": Replicate()}),
    (
        {"shard": True, "master_dtype": torch.float64},
        {"shard": ShardOptimizer(master_dtype=torch.float64)},
    ),
    ({"shard": "full", "prefetch": 0}, {"shard": FullShard(prefetch=0)}),
    (
        {"shard": "full", "units": [torch.nn.Sequential], "reshard_after_forward": False},
        {"shard": FullShard(units=[torch.nn.Sequential], reshard_after_forward=False)},
    ),
]


def _train(kw: dict) -> tuple[object, int, list[torch.Tensor]]:
    torch.manual_seed(0)
    trainer = DistributedTrainer(FlatParamModule(Blocks(n=3)), **kw)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(2):
        x = torch.randn(4, 16, generator=g)
        trainer.zero_grad()
        trainer.module(x).pow(2).mean().backward()
        trainer.step()
    with trainer.gathered():
        weights = [p.detach().clone() for p in trainer.module.parameters()]
    shard, master = trainer.shard, trainer.memory_bytes()["master"]
    trainer.close()
    return shard, master, weights


def _pairs() -> tuple[list, list[str]]:
    out = []
    for alias, choice in PAIRS:
        (a, ma, wa), (c, mc, wc) = _train(alias), _train(choice)
        out.append((a, c, ma, mc, all(torch.equal(x, y) for x, y in zip(wa, wc))))
    errors = []
    for kw in ({"shard": FullShard(), "prefetch": 2}, {"shard": Replicate(), "units": "x"}):
        try:
            DistributedTrainer(FlatParamModule(Blocks()), **kw).close()
            errors.append("no error")
        except torchshard.TorchShardError as e:
            errors.append(str(e))
    return out, errors


def test_a_choice_trains_bitwise_as_its_alias():
    for out, errors in run_distributed(_pairs, 2, timeout=240):
        # trainer.shard reports the alias either way
        assert [(a, c) for a, c, *_ in out] == [(kw["shard"],) * 2 for kw, _ in PAIRS], out
        assert all(same for *_, same in out), out
        masters = [(ma, mc) for _, _, ma, mc, _ in out]
        assert masters[1][0] == masters[1][1] > 0, masters  # master_dtype reached the mode
        assert errors[0].startswith("prefetch: expected the mode's settings inside"), errors
        assert "Replicate takes no units" in errors[1], errors


def test_the_registry_readers_spell_no_mode():
    """The modules that read the registry name no mode themselves: no alias, no estimate
    name, no comparison with a bool (test_structure holds the alias literal over all of
    torchshard/; these readers are held to the stricter rule)."""
    import ast
    from pathlib import Path

    root = Path(torchshard.__file__).parent
    readers = [root / "_cli.py", *(root / "_estimate").glob("*.py")]
    readers += [root / "_parallel" / n for n in ("memory.py", "footprint.py")]
    names = {a for a in ALIASES if isinstance(a, str)} | {e.name for e in MODES}
    for path in readers:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in names, f"{path.name}:{node.lineno}: {node.value!r}"
            if isinstance(node, ast.Compare):  # shard is False / == True: branching on an alias
                consts = [c for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                assert not any(isinstance(c.value, bool) for c in consts), (
                    f"{path.name}:{node.lineno}: {ast.unparse(node)}"
                )


# -- a float64 model keeps float64 in the sharded modes -----------------------------------------
def _float64(kw: dict) -> tuple[int, int, list[torch.Tensor]]:
    torch.manual_seed(0)
    fm = FlatParamModule(Blocks(n=3).double())
    trainer = DistributedTrainer(fm, **kw)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(3):
        x = torch.randn(4, 16, generator=g, dtype=torch.float64)
        trainer.zero_grad()
        trainer.module(x).pow(2).mean().backward()
        trainer.step()
    with trainer.gathered():
        weights = [p.detach().clone() for p in trainer.module.parameters()]
    stats = trainer.memory_stats(trainer.optimizer)
    planned = torchshard.plan_memory(
        fm.layout, world_size=2, shard=kw["shard"], units=trainer.units
    )[torch.distributed.get_rank()]
    trainer.close()
    return stats.master, planned.master, weights


def _float64_runs() -> dict[str, tuple[int, int, list[torch.Tensor]]]:
    return {str(s): _float64({"shard": s}) for s in (False, True, "full")}


def test_a_float64_model_keeps_float64_in_every_mode_by_default():
    """The default master_dtype (float32) is for models below it: a float64 model's sharded
    modes keep no float32 master (it would round the weights at every step; "full" would
    hold its stripes in float32), and train like the replicated mode in float64."""
    for runs in run_distributed(_float64_runs, 2, timeout=120):
        replicated = runs["False"][2]
        for shard in ("True", "full"):
            master, planned, weights = runs[shard]
            assert master == planned == 0, (shard, master, planned)
            diff = max((a - b).abs().max().item() for a, b in zip(weights, replicated))
            assert diff < 1e-12, (shard, diff)  # a float32 master rounds at every step
