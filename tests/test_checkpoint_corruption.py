"""A damaged checkpoint is a clear CheckpointError, and the failed load changes nothing.

Each test damages the files of a real checkpoint on disk (truncation, flipped
bytes, missing files, pickles posing as shards, one rank's part at 2 ranks),
or points the load at nothing, loads into a *different* model and optimizer,
and checks that ``load`` raises :class:`CheckpointError` naming the file at
fault, and that the weights, the optimizer state and its hyperparameters are
bitwise what they were before.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_harness import (
    MODEL,
    OPTIM,
    changes,
    flip_byte,
    header,
    read_meta,
    refused,
    rerecord,
    snapshot,
    target,
    train,
    write_meta,
)
from gpt import GPT, GPTConfig
from multiprocess import run_distributed

import torchshard
from torchshard import TorchShardError, checkpoint
from torchshard.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("single_thread")


def test_checkpoint_error_is_a_torchshard_error():
    assert issubclass(CheckpointError, TorchShardError)


def test_control_an_intact_checkpoint_loads_and_changes_everything(saved):
    """The harness is sound: a good load changes weights, optimizer state and hyperparameters."""
    fm, opt = target()
    before = snapshot(fm, opt)
    info = checkpoint.load(saved, fm, optimizer=opt)
    assert info.step == 1
    changed = changes(fm, opt, before)
    assert "flat buffer" in changed
    assert any("exp_avg" in c for c in changed)
    assert any("'lr'" in c for c in changed)
    assert any("'step'" in c for c in changed)


# -- 1. truncated shards ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", [MODEL, OPTIM])
@pytest.mark.parametrize("keep", ["half", "header only", "empty"])
def test_truncated_shard(saved, name, keep):
    file = saved / name
    raw = file.read_bytes()
    size = {"half": len(raw) // 2, "header only": header(file)[0], "empty": 0}[keep]
    file.write_bytes(raw[:size])
    message = refused(saved)
    assert name in message
    assert "truncated" in message


# -- 2. flipped bytes ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [MODEL, OPTIM])
@pytest.mark.parametrize("where", ["data start", "data middle", "last byte", "header"])
def test_flipped_byte_fails_the_checksum(saved, name, where):
    file = saved / name
    start, _ = header(file)
    size = file.stat().st_size
    offset = {
        "data start": start,
        "data middle": (start + size) // 2,
        "last byte": size - 1,
        "header": 20,
    }[where]
    flip_byte(file, offset)
    message = refused(saved)
    assert name in message
    assert "checksum mismatch" in message


# -- 3. missing shard files ------------------------------------------------------------------------
@pytest.mark.parametrize("name", [MODEL, OPTIM])
def test_missing_shard(saved, name):
    (saved / name).unlink()
    message = refused(saved)
    assert name in message
    assert "missing" in message


# -- 10. nothing there -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nonexistent", "empty root", "only a .tmp dir", "a file"])
def test_load_from_nothing(tmp_path, kind):
    root = tmp_path / "root"
    if kind == "empty root":
        root.mkdir()
    elif kind == "only a .tmp dir":
        (root / ".tmp-step-00000005").mkdir(parents=True)
        (root / "step-00000004").mkdir()  # no metadata.json: not committed
    elif kind == "a file":
        root.write_text("not a checkpoint")
    message = refused(root)
    assert str(root) in message
    assert checkpoint.Checkpointer(root).latest() is None
    fm, opt = target()
    before = snapshot(fm, opt)
    with pytest.raises(CheckpointError, match="checkpoint"):
        checkpoint.Checkpointer(root).load(fm, optimizer=opt)
    assert not changes(fm, opt, before)


def test_step_dir_without_metadata(saved):
    (saved / "metadata.json").unlink()
    message = refused(saved)
    assert str(saved) in message


# -- 11. loading never unpickles -------------------------------------------------------------------
class _Payload:
    """Unpickling this creates a directory: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("fmt", ["pickle", "torch.save"])
@pytest.mark.parametrize("name", [MODEL, OPTIM])
def test_loading_never_unpickles(saved, tmp_path, fmt, name):
    marker = tmp_path / "code-ran"
    file = saved / name
    if fmt == "pickle":
        file.write_bytes(pickle.dumps(_Payload(str(marker))))
    else:
        torch.save({"wte.weight": _Payload(str(marker))}, file)
    data = file.read_bytes()
    meta = read_meta(saved)
    meta["files"][name] = rerecord(meta["files"][name], data)  # the size agrees: only the format
    write_meta(saved, meta)
    message = refused(saved)
    assert name in message
    assert "not a valid safetensors file" in message
    assert not marker.exists(), "loading the checkpoint ran code from a pickle"
    # the control: the payload is live
    if fmt == "pickle":
        pickle.loads(data)
    else:
        torch.load(io.BytesIO(data), weights_only=False)  # by name, torch would use safetensors
    assert marker.is_dir()


# -- 12. multi-rank: one rank's part is corrupt, every rank raises ---------------------------------
CFG_2RANKS = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)  # 4 KB chunks


def _byte_only_rank_reads(path: Path, bad_rank: int) -> tuple[Path, int]:
    """A data byte of a model shard that, loading at world size 2, only ``bad_rank`` reads."""
    meta = read_meta(path)
    ranges = [f["range"] for f in meta["optimizer"]["files"]]  # element ranges at world size 2
    lo, hi = ranges[bad_rank]
    slots = meta["layout"]["slots"]  # [name, shape, offset, numel, requires_grad, aliases]
    inside = [s for s in slots if lo <= s[2] and s[2] + s[3] <= hi]
    name = max(inside, key=lambda s: s[3])[0]
    shard = next(
        w["file"]
        for w in meta["weights"]["shards"]
        if name in [s[0] for s in slots[w["slots"][0] : w["slots"][1]]]
    )
    file = path / shard
    start, head = header(file)
    begin, end = head[name]["data_offsets"]
    # The middle of a tensor of 48 KiB or more: with the 4 KiB checksum chunks of files this
    # small, no chunk around it holds bytes that another rank reads.
    assert end - begin >= 48 * 1024, (name, end - begin)
    return file, start + (begin + end) // 2


def _corrupt_one_rank(root: str, bad_rank: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    fm = torchshard.FlatParamModule(GPT(CFG_2RANKS))
    trainer = torchshard.DistributedTrainer(fm)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)
    train(fm, opt, 1, seed=rank, trainer=trainer)
    path = checkpoint.save(root, trainer, step=1, optimizer=opt)
    file, offset = _byte_only_rank_reads(path, bad_rank)
    dist.barrier()
    if rank == 0:
        flip_byte(file, offset)
    dist.barrier()
    torch.manual_seed(1)
    fm2 = torchshard.FlatParamModule(GPT(CFG_2RANKS))
    trainer2 = torchshard.DistributedTrainer(fm2)
    opt2 = torch.optim.AdamW(fm2.parameters(), lr=2e-3, betas=(0.8, 0.9))
    train(fm2, opt2, 2, seed=10 + rank, trainer=trainer2)
    before = snapshot(fm2, opt2)
    outcome: dict[str, Any] = {"type": None, "message": ""}
    try:
        checkpoint.load(root, trainer2, optimizer=opt2)
    except Exception as e:
        outcome = {"type": type(e).__name__, "checkpoint_error": isinstance(e, CheckpointError)}
        outcome["message"] = str(e)
    outcome["changed"] = changes(fm2, opt2, before)
    outcome["file"] = file.name
    dist.barrier()  # the group still works after the failed load
    trainer.close()
    trainer2.close()
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_one_rank_corrupt_every_rank_raises(tmp_path, bad_rank):
    out = run_distributed(_corrupt_one_rank, 2, str(tmp_path / "ckpt"), bad_rank, timeout=60)
    for rank, o in enumerate(out):
        assert o["type"] is not None, f"rank {rank}: the load did not fail"
        assert o["checkpoint_error"], (rank, o)
        assert not o["changed"], f"rank {rank}: a failed load changed {o['changed']}"
        assert "checksum mismatch" in o["message"], (rank, o)
        assert o["file"] in o["message"], (rank, o)
        if rank != bad_rank:
            assert f"rank {bad_rank} failed to load" in o["message"], (rank, o)
