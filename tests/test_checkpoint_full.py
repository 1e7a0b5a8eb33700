"""Checkpoints of the fully sharded mode (``shard="full"``): the same files as the other modes,
written and read stripe by stripe, resumed across modes and world sizes.

A full save at 2 ranks loads replicated at 1, sharded at 3 and full at 3, each bitwise as it
was saved (weights, optimizer state, Adam's step); full at 2 resumes and continues bitwise as
the run that never stopped (saved asynchronously while it went on); replicated and sharded
saves load full at 3; a bf16 buffer's fp32 master round-trips full <-> ``shard=True`` bit for
bit. A full save's files are byte for byte a sharded save's of the same state, so
``consolidate`` is untouched. A full load reads its stripes only and broadcasts nothing.

The oracle is the saving run itself, carried with ``torch.save``: its state laid out like the
flat buffer (:func:`state_of`), the same in every mode and at every world size.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from probes import CollectiveLog
from sharded_harness import batch, differences, new_trainer, train
from sharded_harness import flat_state as state_of
from torch import nn

from torchshard import DistributedTrainer, FlatParamModule, checkpoint

SAVE_AT, MORE = 3, 2  # steps before the save, and after it

pytestmark = pytest.mark.slow


def _as_saved(saved: dict[str, torch.Tensor], trainer: DistributedTrainer) -> dict:
    """What ``trainer`` holds after loading ``saved``: without a master to restore into, the
    weights are the saved ones and the moments the weights' dtype (torch's load_state_dict
    casts them)."""
    want = {k: v for k, v in saved.items() if not k.startswith("final/")}
    dtype = trainer.module.dtype
    takes_master = bool(trainer.shard) and dtype != torch.float32
    if "master" in want and not takes_master:
        want.pop("master")
        want = {k: v if k.endswith("/slot") else v.to(dtype) for k, v in want.items()}
    return want


def _save(root: str, expected: str, shard: bool | str, dtype: str) -> None:
    """Train SAVE_AT steps, save (asynchronously while the run goes on for MORE steps, the
    oracle of a resume), and keep the state at the save and at the end in ``expected``."""
    trainer = new_trainer(shard, getattr(torch, dtype))
    train(trainer, range(SAVE_AT))
    future = checkpoint.async_save(
        root, trainer, step=SAVE_AT, optimizer=trainer.optimizer, extra={"data": [SAVE_AT]}
    )
    state = state_of(trainer)
    train(trainer, range(SAVE_AT, SAVE_AT + MORE))  # the uninterrupted run goes on
    future.wait()
    final = state_of(trainer)
    state["final/weights"] = final["weights"]
    if "master" in final:
        state["final/master"] = final["master"]
    if trainer.rank == 0:
        torch.save(state, expected)
    trainer.close()


def _load(
    root: str,
    expected: str,
    shard: bool | str,
    dtype: str,
    more: bool = False,
    evaluate: bool = True,
) -> dict:
    """A fresh trainer of other weights loads the checkpoint: its state against the saved one,
    the collectives the load issued, the bytes it read; with ``more``, the run continued.
    With ``evaluate``, a forward without grad first: in full mode the root units stay
    gathered after it, so the load must gather them again from the loaded stripes."""
    trainer = new_trainer(shard, getattr(torch, dtype), seed=1)
    if evaluate:
        with torch.no_grad():
            trainer.module(*batch(trainer.rank, 0))
    with CollectiveLog() as log:  # every collective torch.distributed has, objects' too
        info = checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    want = torch.load(expected, weights_only=True)
    out = {
        "step": info.step,
        "extra": info.extra,
        "calls": [call.op for call in log.calls],
        "bytes_read": info.bytes_read,
        "after_load": differences(state_of(trainer), _as_saved(want, trainer)),
    }
    if more:
        train(trainer, range(SAVE_AT, SAVE_AT + MORE))
        final = state_of(trainer)
        got = {k: final[k] for k in ("weights", "master") if k in final}
        out["continued"] = differences(got, {k: want[f"final/{k}"] for k in got})
    trainer.close()
    return out


def check(results: list[dict], continued: bool = False) -> None:
    for rank, r in enumerate(results):
        assert r["step"] == SAVE_AT and r["extra"] == {"data": [SAVE_AT]}, r
        assert not r["after_load"], f"rank {rank}: differs from the saved state: {r['after_load']}"
        if continued:
            assert not r["continued"], f"rank {rank}: the continuation differs: {r['continued']}"


@pytest.fixture(scope="module")
def full_at_2(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("full-at-2")
    root, expected = tmp / "ckpt", tmp / "expected.pt"
    run_distributed(_save, 2, str(root), str(expected), "full", "float32", timeout=180)
    return root, expected


def test_full_at_2_resumes_full_at_2_bitwise_as_the_uninterrupted_run(full_at_2):
    root, expected = full_at_2
    results = run_distributed(
        _load, 2, str(root), str(expected), "full", "float32", True, timeout=180
    )
    check(results, continued=True)


@pytest.mark.parametrize("shard, world", [(False, 1), ("full", 1), (True, 3), ("full", 3)])
def test_full_at_2_loads_in_every_mode_at_other_world_sizes(full_at_2, shard, world):
    root, expected = full_at_2
    check(run_distributed(_load, world, str(root), str(expected), shard, "float32", timeout=180))


def test_a_full_load_broadcasts_nothing(full_at_2):
    """The only collectives of a full load between steps (no unit gathered): the two
    all-gathers of the ranks' agreement."""
    root, expected = full_at_2
    args = (str(root), str(expected), "full", "float32", False, False)
    results = run_distributed(_load, 3, *args, timeout=180)
    check(results)
    for rank, r in enumerate(results):
        assert r["calls"] == ["all_gather", "all_gather"], (rank, r["calls"])


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_replicated_and_sharded_saves_at_2_load_full_at_3(tmp_path, shard):
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    run_distributed(_save, 2, str(root), str(expected), shard, "float32", timeout=180)
    check(run_distributed(_load, 3, str(root), str(expected), "full", "float32", timeout=180))


def test_full_at_1_saves_and_full_at_2_loads(tmp_path):
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    run_distributed(_save, 1, str(root), str(expected), "full", "float32", timeout=180)
    check(run_distributed(_load, 2, str(root), str(expected), "full", "float32", timeout=180))


@pytest.mark.parametrize(
    ("saver", "loader", "world"),
    [("full", True, 3), (True, "full", 3), ("full", "full", 2)],
    ids=["full-to-sharded-at-3", "sharded-to-full-at-3", "full-to-full-at-2"],
)
def test_bf16_master_round_trips_between_full_and_sharded(tmp_path, saver, loader, world):
    """bf16 weights, fp32 master: full@2 -> shard=True@3, and shard=True@2 -> full@3, the
    master bit for bit (its low 16 bits are not in the bf16 weights); full@2 -> full@2
    continues bitwise."""
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    run_distributed(_save, 2, str(root), str(expected), saver, "bfloat16", timeout=180)
    want = torch.load(expected, weights_only=True)
    assert (want["master"] != want["weights"].float()).float().mean() > 0.5  # a real test
    meta = json.loads((root / f"step-{SAVE_AT:08d}" / "metadata.json").read_text())
    assert meta["optimizer"]["flat_state"]["master"] == "float32"
    more = saver == loader
    results = run_distributed(
        _load, world, str(root), str(expected), loader, "bfloat16", more, timeout=180
    )
    check(results, continued=more)


def _full_and_sharded(tmp: str, dtype: str) -> None:
    """The same run (seed, batches) full and ``shard=True`` at 2, each saved; then a sharded
    trainer loads the full save and saves it again (a round trip)."""
    for shard in ("full", True):
        trainer = new_trainer(shard, getattr(torch, dtype))
        train(trainer, range(SAVE_AT))
        checkpoint.save(f"{tmp}/{shard}", trainer, step=SAVE_AT, optimizer=trainer.optimizer)
        trainer.close()
    trainer = new_trainer(True, getattr(torch, dtype), seed=1)
    checkpoint.load(f"{tmp}/full", trainer, optimizer=trainer.optimizer)
    checkpoint.save(f"{tmp}/round-trip", trainer, step=SAVE_AT, optimizer=trainer.optimizer)
    trainer.close()


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert any(n.startswith("optim-") for n in names), names
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (a, b, mismatch, errors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_full_save_writes_the_files_a_sharded_save_writes(tmp_path, dtype):
    """Byte for byte, metadata and checksums included, the files of a full and a sharded run
    of the same steps (the sharded mode is the oracle: its values are checked against DDP
    elsewhere): consolidate, reshard and transformers see no difference; consolidate's
    output is the same file; and a sharded trainer that loads the full save writes it back
    unchanged."""
    run_distributed(_full_and_sharded, 2, str(tmp_path), dtype, timeout=180)
    step = f"step-{SAVE_AT:08d}"
    full, sharded = tmp_path / "full" / step, tmp_path / "True" / step
    same_files(full, sharded)
    same_files(full, tmp_path / "round-trip" / step)
    checkpoint.consolidate(full, tmp_path / "full.safetensors")
    checkpoint.consolidate(sharded, tmp_path / "sharded.safetensors")
    assert (tmp_path / "full.safetensors").read_bytes() == (
        tmp_path / "sharded.safetensors"
    ).read_bytes()


# -- what a full load reads: a model large enough that checksum chunks are small beside it --
BIG = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=64)


def _big(shard: bool | str, seed: int) -> DistributedTrainer:
    torch.manual_seed(seed)
    trainer = DistributedTrainer(FlatParamModule(GPT(BIG)), shard=shard, bucket_mb=0.25)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-3)
    return trainer


def _big_save(root: str) -> None:
    trainer = _big("full", 0)
    g = torch.Generator().manual_seed(trainer.rank)
    idx = torch.randint(0, BIG.vocab_size, (2, BIG.block_size + 1), generator=g)
    trainer.zero_grad()
    trainer.module(idx[:, :-1], idx[:, 1:])[1].backward()
    trainer.step()
    checkpoint.save(root, trainer, step=1, optimizer=trainer.optimizer)
    trainer.close()


def _big_load(root: str) -> dict:
    trainer = _big("full", 1)
    info = checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    held = sum(b - a for a, b, _ in trainer.local_shards().runs)
    # weights (4 bytes) and two fp32 moments per element this rank holds
    out = {"bytes_read": info.bytes_read, "stripes_bytes": held * 12}
    trainer.close()
    return out


def test_a_full_rank_reads_its_stripes_only(tmp_path):
    root = tmp_path / "ckpt"
    run_distributed(_big_save, 2, str(root), timeout=180)
    total = sum(p.stat().st_size for p in (root / "step-00000001").glob("*.safetensors"))
    results = run_distributed(_big_load, 3, str(root), timeout=180)
    for rank, r in enumerate(results):
        assert r["stripes_bytes"] <= r["bytes_read"] <= 1.1 * r["stripes_bytes"], (rank, r)
        assert r["bytes_read"] < 0.4 * total, (rank, r, total)
    assert sum(r["bytes_read"] for r in results) < 1.1 * total


def _errors(root: str) -> list[str]:
    trainer = new_trainer("full")
    messages = []
    other = torch.optim.SGD(trainer.module.parameters(), lr=0.1)
    for call in (
        lambda: checkpoint.save(root, trainer.module, step=1),
        lambda: checkpoint.save(root, trainer, step=1, optimizer=other),
    ):
        try:
            call()
        except checkpoint.CheckpointError as e:
            messages.append(str(e))
    trainer.close()
    return messages


def test_a_full_trainer_is_saved_through_the_trainer_and_its_own_optimizer(tmp_path):
    messages = run_distributed(_errors, 2, str(tmp_path / "ckpt"), timeout=120)[0]
    assert len(messages) == 2, messages
    assert "pass the DistributedTrainer" in messages[0], messages[0]
    assert "make_optimizer" in messages[1], messages[1]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def _in_a_subgroup(root: str) -> list[dict]:
    """Ranks [1, 2] of 3 train full over a subgroup and save; a fresh full trainer there and a
    sharded one over all three load it."""
    group = dist.new_group([1, 2])
    out = []
    saved = None
    if dist.get_rank() in (1, 2):
        trainer = new_trainer("full", group=group)
        train(trainer, range(2))
        saved = state_of(trainer)
        checkpoint.save(root, trainer, step=2, optimizer=trainer.optimizer)
        trainer.close()
        trainer = new_trainer("full", group=group, seed=1)
        checkpoint.load(root, trainer, optimizer=trainer.optimizer)
        out.append(state_of(trainer))
        trainer.close()
    everyone: list = [None] * 3
    dist.all_gather_object(everyone, saved)
    trainer = new_trainer(True, seed=2)
    checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    out.append(state_of(trainer))
    trainer.close()
    return [differences(got, everyone[1]) for got in out]


def test_a_full_trainer_over_a_subgroup_saves_and_loads(tmp_path):
    results = run_distributed(_in_a_subgroup, 3, str(tmp_path / "ckpt"), timeout=180)
    assert [len(r) for r in results] == [1, 2, 2]
    assert all(not d for r in results for d in r), results


class _Frozen(nn.Module):
    """Tiny, with frozen parameters between trainable ones: at 3 ranks some rank's stripes
    hold its range of the files and some rank's do not."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(4, 3), nn.LayerNorm(3)
        self.mid, self.head = nn.Linear(3, 3), nn.Linear(3, 2)
        self.norm.bias.requires_grad_(False)
        self.mid.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.norm(self.proj(x))))


def _frozen_full(root: str) -> dict:
    torch.manual_seed(0)
    trainer = DistributedTrainer(FlatParamModule(_Frozen(), align_bytes=4), shard="full")
    opt = trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        g = torch.Generator().manual_seed(step + 10 * trainer.rank)
        trainer.zero_grad()
        trainer.module(torch.randn(2, 4, generator=g)).square().mean().backward()
        trainer.step()
    checkpoint.save(root, trainer, step=2, optimizer=opt)  # hung: see the test
    saved = state_of(trainer)
    trainer.close()
    torch.manual_seed(1)
    other = DistributedTrainer(FlatParamModule(_Frozen(), align_bytes=4), shard="full")
    other.make_optimizer(torch.optim.AdamW, lr=1e-2)
    checkpoint.load(root, other, optimizer=other.optimizer)
    out = {"differs": differences(state_of(other), saved)}
    other.close()
    return out


def test_a_save_where_some_ranks_stripes_miss_their_range_exchanges_on_every_rank(tmp_path):
    """Whether a rank writes its optimizer file in place or assembles it by an exchange (a
    collective) was each rank's own decision: with one rank's stripes missing its range and
    the others' not, that rank waited in the exchange alone, forever. Every rank decides from
    every rank's cuts now, so they all exchange."""
    results = run_distributed(_frozen_full, 3, str(tmp_path / "ckpt"), timeout=120)
    assert all(not r["differs"] for r in results), results
