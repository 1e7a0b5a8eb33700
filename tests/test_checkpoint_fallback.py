"""``load(..., fallback=True)``: a damaged latest checkpoint is skipped for the newest that loads.

Real checkpoints on disk, damaged as ``test_checkpoint_corruption.py`` damages them (a flipped
byte in ``metadata.json``, a flipped byte in a weights file that only one rank reads, a
missing file). The oracle of a fallback load is a direct load of the checkpoint it fell back
to, compared bitwise. In one process (a ``FlatParamModule``) and over gloo at world sizes 1, 2
and 3 in every mode (replicated, ``shard=True``, ``shard="full"``): every rank skips the same
checkpoints and loads the same one; when every checkpoint is damaged every rank raises,
naming each, and nothing changed. Also ``torchshard inspect ROOT`` with a damaged latest.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_harness import (
    MODEL,
    build,
    changes,
    flip_byte,
    header,
    snapshot,
    target,
    train,
    tree_diff,
)
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from sharded_harness import differences, flat_state

import torchshard
from torchshard import checkpoint
from torchshard._cli import main
from torchshard.checkpoint import Checkpointer, CheckpointError
from torchshard.checkpoint import _load as load_module
from torchshard.checkpoint._plan import state_ranges
from torchshard.checkpoint._target import Target

pytestmark = pytest.mark.usefixtures("single_thread")

LOGGER = "torchshard.checkpoint._load"


def step_path(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def flip_metadata(path: Path) -> None:
    """A flipped byte inside ``metadata.json``'s content: its checksum no longer matches."""
    flip_byte(path / "metadata.json", 40)


# -- one process ---------------------------------------------------------------------------------
@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Three committed checkpoints (steps 1, 2, 3) of the tiny GPT with AdamW state."""
    fm = build(seed=0)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)
    out = tmp_path / "root"
    for step in (1, 2, 3):
        train(fm, opt, 1, seed=step)
        checkpoint.save(out, fm, step=step, optimizer=opt, extra={"step": step})
    return out


def loaded_directly(path: Path) -> dict[str, Any]:
    fm, opt = target()
    checkpoint.load(path, fm, optimizer=opt)
    return snapshot(fm, opt)


def same_state(fm: torchshard.FlatParamModule, opt: torch.optim.Optimizer, path: Path) -> None:
    """``fm`` and ``opt`` hold bitwise what a direct load of ``path`` gives."""
    want = loaded_directly(path)
    got = snapshot(fm, opt)
    assert torch.equal(got["flat"].view(torch.uint8), want["flat"].view(torch.uint8))
    assert not tree_diff(got["optim"], want["optim"], "optimizer")


@pytest.mark.parametrize("damage", ["metadata", "weights", "missing"])
def test_a_damaged_latest_is_skipped_for_the_previous(root, damage, caplog):
    latest = step_path(root, 3)
    if damage == "metadata":
        flip_metadata(latest)
    elif damage == "weights":
        start, _ = header(latest / MODEL)
        flip_byte(latest / MODEL, (start + (latest / MODEL).stat().st_size) // 2)
    else:
        (latest / MODEL).unlink()
    fm, opt = target()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = checkpoint.load(root, fm, optimizer=opt, fallback=True)
    assert info.step == 2 and info.extra == {"step": 2}
    assert info.path == step_path(root, 2)
    assert [p for p, _ in info.skipped] == [latest]
    why = info.skipped[0][1]
    named = "metadata.json" if damage == "metadata" else MODEL
    assert named in why and ("missing" if damage == "missing" else "checksum mismatch") in why
    same_state(fm, opt, step_path(root, 2))
    warned = [r for r in caplog.records if r.name == LOGGER]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert str(latest) in warned[0].getMessage() and named in warned[0].getMessage()
    assert str(step_path(root, 2)) in warned[0].getMessage()  # what it tries next


def test_an_intact_latest_loads_with_nothing_skipped(root, caplog):
    fm, opt = target()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = checkpoint.load(root, fm, optimizer=opt, fallback=True)
    assert info.step == 3 and info.skipped == ()
    assert not [r for r in caplog.records if r.name == LOGGER]
    same_state(fm, opt, step_path(root, 3))


def test_two_damaged_are_skipped_newest_first(root):
    flip_metadata(step_path(root, 3))
    (step_path(root, 2) / MODEL).unlink()
    fm, opt = target()
    info = Checkpointer(root).load(fm, optimizer=opt, fallback=True)
    assert info.step == 1
    assert [p for p, _ in info.skipped] == [step_path(root, 3), step_path(root, 2)]
    same_state(fm, opt, step_path(root, 1))
    # the Checkpointer set both aside, kept whole, so that the run saves those steps again
    names = sorted(p.name for p in root.iterdir())
    assert names == ["step-00000001", "step-00000002.bad", "step-00000003.bad"]
    ckpt = Checkpointer(root, keep_last=None)
    ckpt.save(fm, step=2, optimizer=opt, blocking=True)
    ckpt.close()
    assert Checkpointer(root).latest() == step_path(root, 2)


def test_the_checkpointer_sets_nothing_aside_when_nothing_loads(root):
    flip_metadata(step_path(root, 3))
    for step in (1, 2):
        (step_path(root, step) / MODEL).unlink()
    fm, opt = target()
    with pytest.raises(CheckpointError):
        Checkpointer(root).load(fm, optimizer=opt, fallback=True)
    assert sorted(p.name for p in root.iterdir()) == [f"step-0000000{s}" for s in (1, 2, 3)]


def test_without_fallback_the_error_is_unchanged(root):
    flip_metadata(step_path(root, 3))
    fm, opt = target()
    before = snapshot(fm, opt)
    with pytest.raises(CheckpointError) as plain:
        checkpoint.load(root, fm, optimizer=opt)
    with pytest.raises(CheckpointError) as direct:
        checkpoint.load(step_path(root, 3), fm, optimizer=opt)
    with pytest.raises(CheckpointError) as managed:
        Checkpointer(root).load(fm, optimizer=opt)
    assert type(plain.value) is CheckpointError
    assert str(plain.value) == str(direct.value) == str(managed.value)
    assert "metadata.json: checksum mismatch" in str(plain.value)
    assert not changes(fm, opt, before)


def test_one_checkpoint_given_by_path_does_not_fall_back(root):
    flip_metadata(step_path(root, 3))
    fm, opt = target()
    before = snapshot(fm, opt)
    with pytest.raises(CheckpointError) as without:
        checkpoint.load(step_path(root, 3), fm, optimizer=opt)
    with pytest.raises(CheckpointError) as given:
        checkpoint.load(step_path(root, 3), fm, optimizer=opt, fallback=True)
    with pytest.raises(CheckpointError) as managed:
        Checkpointer(root).load(fm, optimizer=opt, path=step_path(root, 3), fallback=True)
    assert str(given.value) == str(without.value) == str(managed.value)
    assert not changes(fm, opt, before)
    # a root given as path= does fall back
    info = Checkpointer(root.parent / "elsewhere").load(fm, optimizer=opt, path=root, fallback=True)
    assert info.step == 2


def test_every_checkpoint_damaged_names_each_and_changes_nothing(root, caplog):
    flip_metadata(step_path(root, 3))
    (step_path(root, 2) / MODEL).unlink()
    start, _ = header(step_path(root, 1) / MODEL)
    flip_byte(step_path(root, 1) / MODEL, start)
    fm, opt = target()
    before = snapshot(fm, opt)
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(CheckpointError) as e:
        checkpoint.load(root, fm, optimizer=opt, fallback=True)
    message = str(e.value)
    for step in (3, 2, 1):
        assert str(step_path(root, step)) in message, step
    assert message.index("step-00000003") < message.index("step-00000002")
    assert "metadata.json: checksum mismatch" in message
    assert "missing" in message and "checksum mismatch in" in message
    assert not changes(fm, opt, before)
    assert len([r for r in caplog.records if r.name == LOGGER]) == 3


def test_an_empty_root_fails_as_without_fallback(tmp_path):
    (tmp_path / "root").mkdir()
    fm, opt = target()
    for root in (tmp_path / "root", tmp_path / "missing"):
        with pytest.raises(CheckpointError) as plain:
            checkpoint.load(root, fm, optimizer=opt)
        with pytest.raises(CheckpointError) as fallback:
            checkpoint.load(root, fm, optimizer=opt, fallback=True)
        assert str(plain.value) == str(fallback.value)


def test_an_incompatible_model_is_refused_by_every_checkpoint(root):
    fm = build(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(root, fm, fallback=True)
    assert str(e.value).count("different model") == 3


def test_a_failure_once_applying_started_is_never_skipped(root, monkeypatch):
    calls = []

    def broken(*args: Any) -> None:
        calls.append(args)
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(load_module, "_apply", broken)
    fm, opt = target()
    with pytest.raises(CheckpointError, match="applying the checkpoint failed") as e:
        checkpoint.load(root, fm, optimizer=opt, fallback=True)
    assert str(step_path(root, 3)) in str(e.value)
    assert len(calls) == 1, "fell back after _apply had started"


# -- multi-rank: every rank skips the same checkpoints, in every mode ----------------------------
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)  # 4 KiB chunks


def _trainer(shard: bool | str, seed: int) -> torchshard.DistributedTrainer:
    torch.manual_seed(seed)
    fm = torchshard.FlatParamModule(GPT(CFG))
    trainer = torchshard.DistributedTrainer(fm, shard=shard, bucket_mb=0.25)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-3)
    return trainer


def _train(trainer: torchshard.DistributedTrainer, step: int) -> None:
    g = torch.Generator().manual_seed(100 * trainer.rank + step)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1), generator=g)
    trainer.zero_grad()
    trainer.module(idx[:, :-1], idx[:, 1:])[1].backward()
    trainer.step()


def _read_sets(trainer: torchshard.DistributedTrainer) -> list[list[tuple[int, int]]]:
    """Every rank's flat element ranges that a load reads (a collective)."""
    t = Target(trainer)
    if not trainer.module.is_bound:  # shard="full": the runs of its local shards
        mine = [(a, b) for a, b, _ in trainer.local_shards().runs]
    else:
        mine = [state_ranges(trainer.module.layout, t.world)[t.rank]]
    every: list[Any] = [None] * t.world
    dist.all_gather_object(every, mine)
    return every


def _byte_only_rank_reads(
    path: Path, sets: list[list[tuple[int, int]]], bad: int
) -> tuple[Path, int]:
    """A byte of a weights file in a checksum chunk that, loading with ``sets``, only rank
    ``bad`` reads (every rank verifies each chunk it reads a byte of)."""
    meta = json.loads((path / "metadata.json").read_text())
    slots = {s[0]: s for s in meta["layout"]["slots"]}  # name, shape, offset, numel, ...
    itemsize = torch.empty((), dtype=getattr(torch, meta["layout"]["dtype"])).element_size()

    def readers(lo: int, hi: int) -> set[int]:
        return {r for r, ranges in enumerate(sets) if any(a < hi and lo < b for a, b in ranges)}

    for shard in meta["weights"]["shards"]:
        file = path / shard["file"]
        start, head = header(file)
        chunk = int(head["__metadata__"]["torchshard.chunk_bytes"])
        size = file.stat().st_size - start
        for c0 in range(0, size, chunk):
            c1, who = min(c0 + chunk, size), set()
            for name, entry in head.items():
                b, e = entry["data_offsets"] if name != "__metadata__" else (0, 0)
                if not (b < c1 and c0 < e):
                    continue
                if name not in slots:  # a module buffer: every rank reads it
                    who |= set(range(len(sets)))
                    continue
                offset = slots[name][2]
                lo = offset + (max(b, c0) - b) // itemsize
                hi = offset + -(-(min(e, c1) - b) // itemsize)
                who |= readers(lo, hi)
            if who == {bad}:
                return file, start + (c0 + c1) // 2
    raise AssertionError(f"no checksum chunk is read by rank {bad} only")


def _flip_on_rank_0(file: Path, offset: int) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        flip_byte(file, offset)
    dist.barrier()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fallback_load(root: Path, shard: bool | str, seed: int) -> dict[str, Any]:
    """A fresh trainer loads ``root`` with fallback: what it skipped and loaded, the state it
    holds against a direct load of that checkpoint, the warnings; and, first, the error of
    the same load without fallback, and that it changed nothing."""
    trainer = _trainer(shard, seed)
    before = flat_state(trainer)
    out: dict[str, Any] = {"plain": None}
    try:
        checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    except CheckpointError as e:
        out["plain"] = str(e)
    out["plain_changed"] = differences(flat_state(trainer), before)
    records = _Records()
    logging.getLogger(LOGGER).addHandler(records)
    try:
        info = checkpoint.load(root, trainer, optimizer=trainer.optimizer, fallback=True)
    finally:
        logging.getLogger(LOGGER).removeHandler(records)
    out.update(step=info.step, path=str(info.path), warnings=records.messages)
    out["skipped"] = [(str(p), why) for p, why in info.skipped]
    direct = _trainer(shard, seed + 1)
    checkpoint.load(info.path, direct, optimizer=direct.optimizer)
    out["vs_direct"] = differences(flat_state(trainer), flat_state(direct))
    trainer.close()
    direct.close()
    return out


def _worker(root_: str, shard: bool | str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root_)
    saver = _trainer(shard, 0)
    for step in (1, 2, 3):
        _train(saver, step)
        checkpoint.save(root, saver, step=step, optimizer=saver.optimizer)
    sets = _read_sets(saver)
    saver.close()
    bad = world - 1
    out: dict[str, Any] = {}
    # A: the latest's metadata.json is damaged: every rank fails to read it
    _flip_on_rank_0(step_path(root, 3) / "metadata.json", 40)
    out["metadata"] = _fallback_load(root, shard, seed=10)
    # B: with that one set aside, the latest's weights are damaged where only `bad` reads
    dist.barrier()
    if rank == 0:
        step_path(root, 3).rename(root.parent / "aside")
    file, offset = _byte_only_rank_reads(step_path(root, 2), sets, bad)
    out["file"] = file.name
    _flip_on_rank_0(file, offset)
    out["weights"] = _fallback_load(root, shard, seed=20)
    # C: every checkpoint damaged: every rank raises, naming each, and nothing changed
    _flip_on_rank_0(step_path(root, 1) / "metadata.json", 40)
    trainer = _trainer(shard, 30)
    before = flat_state(trainer)
    try:
        checkpoint.load(root, trainer, optimizer=trainer.optimizer, fallback=True)
        out["all"] = None
    except CheckpointError as e:
        out["all"] = str(e)
    out["all_changed"] = differences(flat_state(trainer), before)
    dist.barrier()  # the group still works
    trainer.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True, "full"], ids=["replicated", "sharded", "full"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_falls_back_alike(tmp_path, world, shard):
    root = tmp_path / "root"
    results = run_distributed(_worker, world, str(root), shard, timeout=240)
    bad = world - 1
    for rank, r in enumerate(results):
        a, b = r["metadata"], r["weights"]
        # A: skips step 3 (its metadata.json), loads step 2 as a direct load does
        assert "metadata.json: checksum mismatch" in a["plain"], (rank, a)
        assert not a["plain_changed"], (rank, a["plain_changed"])
        assert a["step"] == 2 and a["path"] == str(step_path(root, 2)), (rank, a)
        assert [p for p, _ in a["skipped"]] == [str(step_path(root, 3))], (rank, a)
        assert not a["vs_direct"], (rank, a["vs_direct"])
        # B: skips step 2 (one rank's part of a weights file), loads step 1
        assert "checksum mismatch" in b["plain"] and r["file"] in b["plain"], (rank, b)
        if rank != bad:
            assert f"rank {bad} failed to load" in b["plain"], (rank, b)
        assert not b["plain_changed"], (rank, b["plain_changed"])
        assert b["step"] == 1 and b["path"] == str(step_path(root, 1)), (rank, b)
        assert [p for p, _ in b["skipped"]] == [str(step_path(root, 2))], (rank, b)
        why = b["skipped"][0][1]
        assert r["file"] in why and "checksum mismatch" in why, (rank, why)
        if world > 1:
            assert why.startswith(f"rank {bad}: "), (rank, why)
        assert not b["vs_direct"], (rank, b["vs_direct"])
        # every rank skipped the same, for the same reason; only rank 0 warned
        assert a["skipped"] == results[0]["metadata"]["skipped"], rank
        assert b["skipped"] == results[0]["weights"]["skipped"], rank
        for got, skipped in ((a, str(step_path(root, 3))), (b, str(step_path(root, 2)))):
            if rank == 0:
                assert len(got["warnings"]) == 1 and skipped in got["warnings"][0], got
            else:
                assert got["warnings"] == [], (rank, got["warnings"])
        # C: all damaged
        assert r["all"] is not None, f"rank {rank}: loaded a damaged checkpoint"
        assert str(step_path(root, 2)) in r["all"] and str(step_path(root, 1)) in r["all"]
        assert not r["all_changed"], (rank, r["all_changed"])


# -- torchshard inspect ROOT ---------------------------------------------------------------------
def test_inspect_names_the_newest_checkpoint_that_verifies(root, capsys):
    flip_metadata(step_path(root, 3))
    assert main(["inspect", str(root)]) == 1
    out, err = capsys.readouterr()
    assert f"checkpoint   {step_path(root, 3)}" in out
    assert "BAD" in out and "metadata.json: checksum mismatch" in out
    assert f"newest good  {step_path(root, 2)}" in out
    err_lines = err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("torchshard: error: ")
    assert err_lines[0].endswith(f"that verifies is {step_path(root, 2)}")


def test_inspect_skips_older_damaged_ones_too(root, capsys):
    latest, older = step_path(root, 3), step_path(root, 2)
    start, _ = header(latest / MODEL)
    flip_byte(latest / MODEL, start)
    (older / MODEL).unlink()
    assert main(["inspect", str(root)]) == 1
    out, err = capsys.readouterr()
    assert f"checkpoint   {latest}" in out and "BAD" in out  # the usual report of the latest
    assert f"also bad     {older}: " in out and "missing" in out
    assert f"newest good  {step_path(root, 1)}" in out
    assert err.strip().endswith(f"that verifies is {step_path(root, 1)}")
    assert main(["inspect", str(root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["step"] == 3
    assert report["newest_verified"] == str(step_path(root, 1))
    assert [x["path"] for x in report["not_verified"]] == [str(older)]


def test_inspect_when_nothing_verifies(root, capsys):
    for step in (3, 2, 1):
        flip_metadata(step_path(root, step))
    assert main(["inspect", str(root), "--json"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["path"] == str(step_path(root, 3)) and not report["ok"]
    assert report["newest_verified"] is None
    assert [x["path"] for x in report["not_verified"]] == [
        str(step_path(root, 2)),
        str(step_path(root, 1)),
    ]
    assert err.strip().endswith(f"no complete checkpoint under {root} verifies")


def test_inspect_of_a_good_root_or_a_damaged_directory_is_as_before(root, tmp_path, capsys):
    assert main(["inspect", str(root)]) == 0
    assert "newest good" not in capsys.readouterr().out
    copy = tmp_path / "copy" / "step-00000003"
    shutil.copytree(step_path(root, 3), copy)
    flip_metadata(copy)
    assert main(["inspect", str(copy)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "newest" not in err


def test_inspect_help_says_what_each_exit_status_means(capsys):
    with pytest.raises(SystemExit) as done:
        main(["inspect", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for status in ("0 when all is well", "1 when the checkpoint", "2 when the command line"):
        assert status in text, status
    assert "newest checkpoint under it that verifies" in text
