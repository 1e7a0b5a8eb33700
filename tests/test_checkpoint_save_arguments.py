"""Save arguments that cannot make a loadable checkpoint are refused with a CheckpointError
naming the argument, before anything is written: a negative or non-integer ``step``, an
``extra`` that is not JSON (NaN and infinity included), a step that is already committed,
and ``Checkpointer``'s ``keep_last`` and ``timeout``. A world of one (a bound module), and
a step already committed at 2 ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_harness import build, same_bits
from multiprocess import run_distributed

import torchshard
from torchshard import checkpoint
from torchshard.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("single_thread")


def saves(root: Path):
    """The three ways to save, each returning once the save is over (or raising)."""

    def with_checkpointer(fm, **kw):
        with checkpoint.Checkpointer(root) as ckpt:
            return ckpt.save(fm, **kw).wait()

    return {
        "save": lambda fm, **kw: checkpoint.save(root, fm, **kw),
        "async_save": lambda fm, **kw: checkpoint.async_save(root, fm, **kw).wait(),
        "Checkpointer": with_checkpointer,
    }


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes); {} when it does not exist."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("how", ["save", "async_save", "Checkpointer"])
@pytest.mark.parametrize("step", [-1, 1.0, 2.5, "3", None, math.nan])
def test_a_step_that_is_no_non_negative_integer_is_refused(tmp_path, how, step):
    root = tmp_path / "ckpt"
    fm = build()
    with pytest.raises(CheckpointError, match="step: expected a non-negative integer") as e:
        saves(root)[how](fm, step=step)
    assert repr(step) in str(e.value)
    assert not root.exists(), "nothing may be written"


def test_async_save_refuses_a_bad_step_when_called_not_when_waited_for(tmp_path):
    fm = build()
    with pytest.raises(CheckpointError, match="step"):
        checkpoint.async_save(tmp_path / "ckpt", fm, step=-3)  # no future to wait for
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt, pytest.raises(CheckpointError):
        ckpt.save(fm, step=-3)
    assert not (tmp_path / "ckpt").exists()


NOT_JSON = {  # extra, and what the message must say about it
    "an object": ({"a": object()}, "object"),
    "a tensor": ({"loss": torch.tensor(1.5)}, "Tensor"),
    "bytes": ({"data": b"\x00"}, "bytes"),
    "NaN": ({"loss": math.nan}, "NaN"),
    "infinity": ({"loss": -math.inf}, "infinity"),
    "NaN deep inside": ({"history": [{"loss": 1.0}, {"loss": math.nan}]}, "NaN"),
}


@pytest.mark.parametrize("how", ["save", "async_save", "Checkpointer"])
@pytest.mark.parametrize(("extra", "why"), list(NOT_JSON.values()), ids=list(NOT_JSON))
def test_an_extra_that_is_not_json_is_refused(tmp_path, how, extra, why):
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=r"extra: expected a dict of JSON values") as e:
        saves(root)[how](build(), step=1, extra=extra)
    assert why in str(e.value)
    assert not root.exists(), "nothing may be written"


def test_json_extra_round_trips(tmp_path):
    extra = {"loss": 1.25, "epoch": 3, "note": "ok", "flags": [True, None], "nested": {"a": []}}
    path = checkpoint.save(tmp_path, build(), step=4, extra=extra)
    assert checkpoint.load(path, build(seed=1)).extra == extra


@pytest.mark.parametrize("how", ["save", "async_save", "Checkpointer"])
def test_saving_over_a_committed_step_is_refused_and_leaves_it_intact(tmp_path, how):
    root = tmp_path / "ckpt"
    first = build(seed=0)
    checkpoint.save(root, first, step=7)
    before = tree(root)
    other = build(seed=1)
    with pytest.raises(CheckpointError, match="already exists") as e:
        saves(root)[how](other, step=7)
    assert "step-00000007" in str(e.value)
    assert tree(root) == before, "the committed checkpoint was changed"
    loaded = build(seed=2)
    checkpoint.load(root, loaded)
    assert same_bits(loaded.flat_param, first.flat_param)
    # the failure was seen: the next save (a new step) goes through
    assert saves(root)[how](other, step=8) == root / "step-00000008"


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, "2"])
def test_keep_last_must_be_a_positive_integer_or_none(tmp_path, keep_last):
    with pytest.raises(CheckpointError, match="keep_last: expected a positive integer or None"):
        checkpoint.Checkpointer(tmp_path / "ckpt", keep_last=keep_last)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(("keep_last", "kept"), [(None, [1, 2, 3, 4]), (2, [3, 4]), (1, [4])])
def test_keep_last_keeps_that_many_and_none_keeps_every_checkpoint(tmp_path, keep_last, kept):
    fm = build()
    with checkpoint.Checkpointer(tmp_path, keep_last=keep_last) as ckpt:
        for step in range(1, 5):
            ckpt.save(fm, step=step, blocking=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:08d}" for s in kept]


@pytest.mark.parametrize("timeout", [0, -1, -0.5, math.nan])
def test_timeout_must_be_a_positive_number_of_seconds(tmp_path, timeout):
    with pytest.raises(CheckpointError, match="timeout: expected a positive number of seconds"):
        checkpoint.Checkpointer(tmp_path / "ckpt", timeout=timeout)
    assert not (tmp_path / "ckpt").exists()


def _save_step_twice(root: str) -> dict:
    torch.manual_seed(0)
    trainer = torchshard.DistributedTrainer(torchshard.FlatParamModule(torch.nn.Linear(8, 8)))
    checkpoint.save(root, trainer, step=1)
    dist.barrier()
    before = tree(Path(root))
    with torch.no_grad():
        trainer.module.flat_param.add_(1.0)
    try:
        checkpoint.async_save(root, trainer, step=1).wait()
        error = None
    except CheckpointError as e:
        error = str(e)
    dist.barrier()
    out = {"error": error, "intact": tree(Path(root)) == before}
    trainer.close()
    return out


def test_saving_over_a_committed_step_fails_on_every_rank(tmp_path):
    # rank 0 finds the step committed; the others learn it while waiting for the directory
    for rank, r in enumerate(run_distributed(_save_step_twice, 2, str(tmp_path), timeout=60)):
        assert r["error"] is not None and "already exists" in r["error"], (rank, r)
        assert r["intact"], rank


# -- values Python lets through that JSON or the format would change or refuse later ----------
@pytest.mark.parametrize("step", [True, False])
def test_a_bool_step_is_refused(tmp_path, step):
    # bool is an int in Python; written, it would make a metadata.json that load refuses
    with pytest.raises(CheckpointError, match="step: expected a non-negative integer"):
        checkpoint.save(tmp_path / "ckpt", build(), step=step)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("extra", [[1, 2], "note", 5, [], ""])
def test_an_extra_that_is_not_a_dict_is_refused(tmp_path, extra):
    with pytest.raises(CheckpointError, match="extra: expected a dict"):
        checkpoint.save(tmp_path / "ckpt", build(), step=1, extra=extra)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("extra", [{1: "a"}, {"data": {(0, 1): 2}}, {"list": [{2.5: 1}]}])
def test_an_extra_with_keys_that_are_not_strings_is_refused(tmp_path, extra):
    # JSON would load {1: "a"} back as {"1": "a"}: another dict than the one saved
    with pytest.raises(CheckpointError, match="extra: expected string keys"):
        checkpoint.save(tmp_path / "ckpt", build(), step=1, extra=extra)
    assert not (tmp_path / "ckpt").exists()


def test_keep_last_true_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"^keep_last: "):
        checkpoint.Checkpointer(tmp_path / "ckpt", keep_last=True)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("name", ["timeout", "heartbeat_timeout"])
@pytest.mark.parametrize("value", ["5", True, None])
def test_a_timeout_that_is_no_number_is_a_checkpoint_error(tmp_path, name, value):
    # the argument by its own name ("timeout" alone would match "heartbeat_timeout" too)
    with pytest.raises(CheckpointError, match=rf"^{name}: "):
        checkpoint.Checkpointer(tmp_path / "ckpt", **{name: value})
    assert not (tmp_path / "ckpt").exists()
