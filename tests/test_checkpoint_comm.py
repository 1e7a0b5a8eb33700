"""Checkpoints carry a lossy comm's state (issue 24) and resume it at any world size.

A PowerSGD run in float64 saved at 4 ranks and resumed at 4, 2 and 1 on the same global
batches goes on as the uninterrupted run within 1e-12 (the checkpoint holds the mean error
over the ranks, ``Q`` and the step count); resumed with the error reset to zero, it does not.
Also: an async save holds the state as it was at the save (its background copy held until
the next step's backward changed the buffers); TopK's mean error loads (or is
reset); dense <-> compressed loads and a ``Q`` that does not fit say what they drop; the
files verify, reshard and refuse damage; a checkpoint without compression state (format 1,
and a dense one of today, still format 2) loads into a compressed trainer, its error at zero.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from comm_oracle import batch, build, loss_of
from multiprocess import run_distributed
from safetensors.torch import load_file
from test_checkpoint_async_sharded import gate_background_staging
from test_checkpoint_cli import GOLDEN, Golden, edit_metadata, flip_byte

import torchshard
from torchshard import DistributedTrainer, checkpoint
from torchshard._cli import main
from torchshard.comm import AllReduce, PowerSGD, TopK

BUCKET_MB = 0.004  # ~4 KB of float64: the test model spreads over several buckets
ROWS = 12  # one global batch per step, split evenly over 1, 2, 3 or 4 ranks
SAVE, END = 4, 8
POWERSGD = PowerSGD(rank=2, start_step=1)


def _part(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(0, step, rows=ROWS)
    n = ROWS // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _trainer(comm: object) -> tuple[DistributedTrainer, torch.optim.Optimizer]:
    trainer = DistributedTrainer(build(), comm=comm, bucket_mb=BUCKET_MB)
    return trainer, trainer.make_optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)


def _train(trainer: DistributedTrainer, steps: range) -> list[torch.Tensor]:
    flats = []
    for step in steps:
        trainer.zero_grad()
        loss_of(trainer.module, _part(step, trainer.rank, trainer.world_size)).backward()
        trainer.step()
        flats.append(trainer.module.flat_param.clone())  # type: ignore[union-attr]
    return flats


def _mean_error(trainer: DistributedTrainer) -> torch.Tensor:
    """The mean of the ranks' error feedback, as the test computes it."""
    mean = trainer.comm_state()["error"].clone()
    dist.all_reduce(mean)
    return mean / trainer.world_size


class _Notes(logging.Handler):
    """The torchshard warnings a rank logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []
        logging.getLogger("torchshard").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


# -- the uninterrupted run, saved at 4 ranks (blocking and async) -------------------------------
def _uninterrupted(root: str, comm: object) -> dict:
    trainer, opt = _trainer(comm)
    _train(trainer, range(SAVE))
    state = {k: v.clone() for k, v in trainer.comm_state().items()}
    saved = dict(flat=trainer.module.flat_param.clone(), mean=_mean_error(trainer), state=state)
    checkpoint.save(f"{root}/blocking", trainer, step=SAVE, optimizer=opt)
    # the background copy waits for the next optimizer.step(): after a backward changed
    # the comm's buffers (a save that staged the live buffers would hold those)
    gate_background_staging(opt)
    future = checkpoint.async_save(f"{root}/async", trainer, step=SAVE, optimizer=opt)
    saved["after"] = _train(trainer, range(SAVE, END))  # the comm's buffers change meanwhile
    future.wait()
    saved["moved"] = not torch.equal(trainer.comm_state()["error"], state["error"])
    trainer.close()
    return saved


@pytest.fixture(scope="module")
def powersgd_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("powersgd")
    saved = run_distributed(_uninterrupted, 4, str(root), POWERSGD, timeout=240)
    return root, saved


def _resumed(path: str, comm_error: str, expected: list[torch.Tensor]) -> dict:
    trainer, opt = _trainer(POWERSGD)
    info = checkpoint.load(path, trainer, optimizer=opt, comm_error=comm_error)
    state = {k: v.clone() for k, v in trainer.comm_state().items()}
    after = _train(trainer, range(SAVE, END))
    trainer.close()
    diff = max(float((a - b).abs().max()) for a, b in zip(after, expected))
    return dict(diff=diff, state=state, note=info.comm, step=info.step)


@pytest.mark.parametrize("world_size", [4, 2, 1])
def test_powersgd_resumes_from_a_checkpoint_at_any_world_size(powersgd_run, world_size):
    root, saved = powersgd_run
    path, first = str(root / "blocking"), saved[0]
    kept = run_distributed(_resumed, world_size, path, "mean", first["after"], timeout=240)
    for r in kept:
        assert r["diff"] <= 1e-12, [x["diff"] for x in kept]
        # every rank holds the mean error of the 4 ranks that saved, Q and the step count
        assert torch.equal(r["state"]["error"], first["mean"])
        assert torch.equal(r["state"]["powersgd_q"], first["state"]["powersgd_q"])
        assert int(r["state"]["steps"]) == SAVE == r["step"]
        assert "error (the mean over 4 ranks), powersgd_q, steps=4" in r["note"], r["note"]
    reset = run_distributed(_resumed, world_size, path, "reset", first["after"], timeout=240)
    for r in reset:
        assert r["diff"] > 1e-6, [x["diff"] for x in reset]  # the error mattered
        assert not r["state"]["error"].any() and int(r["state"]["steps"]) == SAVE
        assert torch.equal(r["state"]["powersgd_q"], first["state"]["powersgd_q"])
        assert "starts at zero (comm_error='reset')" in r["note"]


def _files(path: Path, prefix: str) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(p) for p in sorted(path.glob(f"{prefix}-*.safetensors"))}


def test_an_async_save_holds_the_state_as_it_was_at_the_save(powersgd_run):
    root, saved = powersgd_run
    assert all(r["moved"] for r in saved)  # training went on while it was written
    blocking, early = root / "blocking" / "step-00000004", root / "async" / "step-00000004"
    a, b = _files(blocking, "comm"), _files(early, "comm")
    assert len(a) == 4 and a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys() == {"error", "powersgd_q"}
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)
    # the files hold the mean error and Q, split in 4 equal ranges
    first = saved[0]
    assert torch.equal(torch.cat([f["error"] for f in a.values()]), first["mean"])
    assert torch.equal(
        torch.cat([f["powersgd_q"] for f in a.values()]), first["state"]["powersgd_q"]
    )
    meta = json.loads((early / "metadata.json").read_text())
    assert meta == json.loads((blocking / "metadata.json").read_text())


def test_the_metadata_records_the_comm_and_the_files_verify(powersgd_run, tmp_path, capsys):
    root, saved = powersgd_run
    path = root / "blocking" / "step-00000004"
    meta = json.loads((path / "metadata.json").read_text())
    comm = meta["comm"]
    assert meta["format_version"] == 5 and comm["class"] == "PowerSGD"
    assert comm["settings"] == {"rank": 2, "start_step": 1, "min_compression": 2.0}
    assert comm["scalars"] == {"steps": SAVE}
    assert comm["flat"]["error"] == {"dtype": "float64", "numel": saved[0]["mean"].numel()}
    report = checkpoint.inspect_checkpoint(path)
    assert report.ok and report.format_version == 5, report.problems
    assert report.comm is not None and report.comm["scalars"] == {"steps": SAVE}
    assert main(["inspect", str(path)]) == 0  # the command line says it too
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("comm "))
    n = saved[0]["mean"].numel()
    assert line.startswith("comm         PowerSGD(rank=2, start_step=1, min_compression=2.0): ")
    assert f"error (float64, {n:,})" in line and f"steps={SAVE}" in line, line
    # resharded to 3 ranks: the same tensors, split in 3
    out = checkpoint.reshard(path, tmp_path / "three", 3)
    assert checkpoint.inspect_checkpoint(out).ok
    three = _files(out, "comm")
    assert len(three) == 3
    for key in ("error", "powersgd_q"):
        whole = torch.cat([f[key] for f in _files(path, "comm").values()])
        assert torch.equal(torch.cat([f[key] for f in three.values()]), whole)


def _refused(path: str) -> dict:
    trainer, opt = _trainer(POWERSGD)
    trainer.comm_state()["error"].fill_(1.0)
    before = trainer.module.flat_param.clone()
    try:
        checkpoint.load(path, trainer, optimizer=opt)
        message = ""
    except checkpoint.CheckpointError as e:
        message = str(e)
    same = torch.equal(trainer.module.flat_param, before)
    untouched = bool((trainer.comm_state()["error"] == 1).all())
    trainer.close()
    return dict(message=message, same=same, untouched=untouched)


def test_a_damaged_comm_file_is_refused_before_anything_changes(powersgd_run, tmp_path):
    root, _ = powersgd_run
    path = tmp_path / "step-00000004"
    shutil.copytree(root / "blocking" / "step-00000004", path)
    flip_byte(path / "comm-00002-of-00004.safetensors", 0.9)
    problems = checkpoint.inspect_checkpoint(path).problems
    assert len(problems) == 1 and "comm-00002-of-00004.safetensors" in problems[0]
    for r in run_distributed(_refused, 2, str(path), timeout=120):
        assert "comm-00002-of-00004.safetensors" in r["message"], r["message"]
        assert r["same"] and r["untouched"]
    # metadata.json is checked too: an error of another size than the gradient space
    edit_metadata(path, lambda m: m["comm"]["flat"]["error"].update(numel=7))
    with pytest.raises(checkpoint.CheckpointError, match=r"comm\.flat\.error\.numel: expected"):
        checkpoint.inspect_checkpoint(path)


def test_comm_state_in_a_format_4_checkpoint_is_refused(powersgd_run, tmp_path):
    root, _ = powersgd_run
    path = tmp_path / "step-00000004"
    shutil.copytree(root / "blocking" / "step-00000004", path)
    edit_metadata(path, lambda m: m.update(format_version=4))
    with pytest.raises(checkpoint.CheckpointError, match=r"format_version: expected 5 or more"):
        checkpoint.inspect_checkpoint(path)


# -- into other comms ------------------------------------------------------------------------
def _into(path: str, comm: object) -> dict:
    notes = _Notes()
    trainer, opt = _trainer(comm)
    own = {k: v.clone() for k, v in trainer.comm_state().items()}
    info = checkpoint.load(path, trainer, optimizer=opt)
    out = dict(
        note=info.comm,
        warned=notes.seen,
        flat=trainer.module.flat_param.clone(),
        own=own,
        state={k: v.clone() for k, v in trainer.comm_state().items()},
    )
    trainer.close()
    return out


@pytest.mark.parametrize(
    "comm",
    [AllReduce(), TopK(ratio=0.1), PowerSGD(rank=3, start_step=1), PowerSGD(rank=2, start_step=6)],
    ids=["dense", "topk", "another-rank", "another-start"],
)
def test_a_powersgd_checkpoint_into_another_comm_says_what_it_drops(powersgd_run, comm):
    root, saved = powersgd_run
    first = saved[0]
    path = str(root / "blocking")
    got = run_distributed(_into, 2, path, comm, timeout=120)
    for rank, r in enumerate(got):
        assert torch.equal(r["flat"], first["flat"])
        if isinstance(comm, AllReduce):  # keeps no state: all of it is dropped
            assert r["state"] == {}
            assert "the compression state of PowerSGD(rank=2, start_step=1" in r["note"]
            assert "(error, powersgd_q, steps) is dropped: AllReduce() keeps none" in r["note"]
        else:  # the error and the step count load
            assert torch.equal(r["state"]["error"], first["mean"])
            assert int(r["state"]["steps"]) == SAVE
        if isinstance(comm, TopK):
            assert "dropped the saved powersgd_q: TopK(ratio=0.1" in r["note"], r["note"]
        if isinstance(comm, PowerSGD) and comm.rank != POWERSGD.rank:  # Q of another shape
            assert torch.equal(r["state"]["powersgd_q"], r["own"]["powersgd_q"])
            assert "the saved powersgd_q does not fit PowerSGD(rank=3" in r["note"], r["note"]
            assert r["note"].endswith("it keeps its own")
        if isinstance(comm, PowerSGD) and comm.rank == POWERSGD.rank:  # only start_step differs
            assert torch.equal(r["state"]["powersgd_q"], first["state"]["powersgd_q"])
            assert "dropped" not in r["note"] and not r["warned"]
        elif rank == 0:  # said once, on rank 0
            assert r["warned"] == [r["note"]]
        else:
            assert r["warned"] == []


def _dense_then_compressed(root: str, comm: object) -> dict:
    trainer, opt = _trainer(AllReduce())
    _train(trainer, range(2))
    saved = trainer.module.flat_param.clone()
    path = checkpoint.save(root, trainer, step=2, optimizer=opt)
    trainer.close()
    trainer, opt = _trainer(comm)
    trainer.comm_state()["error"].normal_()  # as if it had run: the load starts it afresh
    steps = int(trainer.comm_state()["steps"])
    info = checkpoint.load(path, trainer, optimizer=opt)
    state = trainer.comm_state()
    out = dict(
        note=info.comm,
        loaded=torch.equal(trainer.module.flat_param, saved),
        zero=not state["error"].any(),
        steps=int(state["steps"]) == steps,
        meta=json.loads((path / "metadata.json").read_text()),
    )
    trainer.close()
    return out


@pytest.mark.parametrize("comm", [POWERSGD, TopK(ratio=0.1)], ids=["powersgd", "topk"])
def test_a_dense_checkpoint_into_a_compressed_trainer_starts_the_error_at_zero(tmp_path, comm):
    for r in run_distributed(_dense_then_compressed, 2, str(tmp_path), comm, timeout=120):
        assert r["loaded"] and r["zero"] and r["steps"]
        assert "holds no compression state" in r["note"] and "zero error feedback" in r["note"]
        # a dense save is what it was before compression state existed: format 2, no "comm"
        assert r["meta"]["format_version"] == 2 and "comm" not in r["meta"]


# -- TopK: the mean error is an approximation; load it, or reset it -----------------------------
TOPK = TopK(ratio=0.1)


def _topk_saved(root: str) -> dict:
    trainer, opt = _trainer(TOPK)
    _train(trainer, range(3))
    out = dict(mean=_mean_error(trainer), own=trainer.comm_state()["error"].clone())
    checkpoint.save(root, trainer, step=3, optimizer=opt)
    trainer.close()
    return out


def _topk_loaded(root: str, comm_error: str) -> dict:
    trainer, opt = _trainer(TOPK)
    info = checkpoint.Checkpointer(root).load(trainer, optimizer=opt, comm_error=comm_error)
    state = {k: v.clone() for k, v in trainer.comm_state().items()}
    _train(trainer, range(3, 5))  # and it trains on
    trainer.close()
    return dict(state=state, note=info.comm)


def test_topk_loads_the_mean_error_or_resets_it(tmp_path):
    saved = run_distributed(_topk_saved, 2, str(tmp_path), timeout=120)
    assert not torch.equal(saved[0]["own"], saved[1]["own"])  # the ranks' errors differ
    for r in run_distributed(_topk_loaded, 3, str(tmp_path), "mean", timeout=120):
        assert torch.equal(r["state"]["error"], saved[0]["mean"])
        assert int(r["state"]["steps"]) == 3 and "error (the mean over 2 ranks)" in r["note"]
    for r in run_distributed(_topk_loaded, 3, str(tmp_path), "reset", timeout=120):
        assert not r["state"]["error"].any() and int(r["state"]["steps"]) == 3
        assert "comm_error='reset'" in r["note"]


# -- checkpoints older than compression state ---------------------------------------------------
def _format_1_into_topk(path: str) -> dict:
    fm = torchshard.FlatParamModule(Golden())
    trainer = DistributedTrainer(fm, comm=TopK(ratio=0.5))
    trainer.comm_state()["error"].normal_()
    info = checkpoint.load(path, trainer)
    reference = torchshard.FlatParamModule(Golden())
    reference.bind(torch.empty(reference.numel))
    checkpoint.load(path, reference)
    out = dict(
        note=info.comm,
        zero=not trainer.comm_state()["error"].any(),
        loaded=torch.equal(fm.flat_param, reference.flat_param),
    )
    trainer.close()
    return out


def test_a_format_1_checkpoint_loads_into_a_compressed_trainer(tmp_path):
    path = tmp_path / GOLDEN.name
    shutil.copytree(GOLDEN, path)
    for r in run_distributed(_format_1_into_topk, 2, str(path), timeout=120):
        assert r["loaded"] and r["zero"], r
        assert "holds no compression state; TopK(ratio=0.5" in r["note"]


def test_comm_error_is_checked_before_anything(tmp_path):
    fm = build()
    fm.bind(torch.empty(fm.numel, dtype=torch.float64))
    with pytest.raises(checkpoint.CheckpointError, match=r"comm_error: expected 'mean'.*'Mean'"):
        checkpoint.load(tmp_path, fm, comm_error="Mean")


# -- the format pinned: a checkpoint of format 5 written when it was introduced -----------------
GOLDEN_V5 = Path(__file__).resolve().parent / "golden" / "v5"


def _golden_v5_as_today(root: str, out: str) -> None:
    sys.path.insert(0, str(GOLDEN_V5))
    from make import expected_after_load  # the same function that wrote the expectation

    expected_after_load(root, out)


def test_the_format_5_golden_loads_bitwise_as_the_code_that_wrote_it(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(GOLDEN_V5 / "step-00000003", root / "step-00000003")
    out = tmp_path / "today.safetensors"
    run_distributed(_golden_v5_as_today, 1, str(root), str(out), timeout=60)
    expected, today = load_file(GOLDEN_V5 / "expected.safetensors"), load_file(out)
    assert sorted(expected) == sorted(today)
    assert {"comm/error", "comm/powersgd_q", "comm/steps"} <= set(expected)
    assert expected["comm/error"].any() and int(expected["comm/steps"]) == 3
    for k in expected:
        assert expected[k].dtype == today[k].dtype and torch.equal(expected[k], today[k]), k
