"""Checkpoints of hybrid sharding (issue 23): a ``dp_replicate x dp_shard`` trainer
(``shard=True`` or ``"full"``) saves the files of a plain save at ``dp_replicate * dp_shard``
ranks, each rank writing its own file, and loads at any mesh or in any plain mode.

- Same state, same files: a plain 4-rank ``shard=True`` save, loaded into trainers over 2 x 2,
  1 x 4 and 4 x 1 meshes and 2 x 2 and 4 x 1 fully sharded ones, each saved again (blocking,
  then async), gives byte-identical files, ``metadata.json`` included, for fp32, bf16 with
  frozen weights between trainable ones, and two dtypes; the mesh trainers hold the plain
  trainer's state, bit for bit, on every rank.
- Resume matrix from a 2 x 2 save (blocking and async): plain ``shard=True`` at 4, meshes
  1 x 4, 4 x 1 and 2 x 2, and fully sharded 2 x 2 and 4 x 1 at 4 ranks; plain ``shard=True``
  at 2; ``shard="full"`` at 3. The oracle is the saving run's weights, optimizer state and
  per-slot scalars (``sharded_harness.flat_state``), bit for bit, on every rank.
- A 2 x 2 run resumed from its async save at step 2 is bitwise the uninterrupted run, in
  both sharded modes.
- The save's collectives: one ``all_to_all_single`` per state key inside the shard group, and
  nothing else beyond a plain save's; 1 x 4 and 4 x 1 meshes issue a plain 4-rank save's.
- A 2 x 2 checkpoint of a 0.8M-parameter GPT is read about once in all (1.002x at 2 x 2, 4 x 1,
  1 x 4 and plain 4; 1.017x fully sharded at 2 x 2, against 1.031x at plain 4); without the
  spread across replicas 1.67x at 2 x 2 (1.35x fully sharded).
- The arithmetic alone (no processes): the shard groups' exchanges put every element of the
  files' ranges in place, and a hybrid load reads each element once but for short tails.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from probes import CollectiveLog
from sharded_harness import KW, Model, differences, flat_state, no_decay, train
from torch import nn

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, checkpoint
from torchshard._flat.geometry import Geometry
from torchshard.checkpoint import CheckpointError
from torchshard.checkpoint._plan import exchange_splits, spread_ranges, state_ranges
from torchshard.checkpoint._target import _hybrid

BF16 = torch.bfloat16
STATE_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's flat state: one exchange each
SMALL = GPTConfig.preset("small")  # 0.8M parameters: ~9 MB of files, ~2300 chunks of 4 KiB


# -- the arithmetic ----------------------------------------------------------------------------------
def _gpt(align_bytes: int) -> torchshard.FlatLayout:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=24))
    return FlatParamModule(model, align_bytes=align_bytes).layout


@pytest.mark.parametrize("align", [4, 16, 256])
@pytest.mark.parametrize("shape", [(2, 2), (3, 2), (2, 3), (4, 1), (1, 4), (2, 4), (7, 3)])
def test_each_shard_group_exchanges_its_replica_s_block_of_the_files(align, shape):
    """The all-to-all of a shard group, simulated element by element with the split sizes
    ``exchange_splits`` gives: each rank sends its slice's part in its replica's block, and
    every data-parallel rank ends with exactly its ``state_ranges`` range at world R x S."""
    layout = _gpt(align)
    replicas, shards = shape
    world = replicas * shards
    slices = Geometry.of(layout, shards, pad=True).clipped(layout.numel)  # the trainer's cut
    dest = state_ranges(layout, world)
    for r in range(replicas):
        block = dest[r * shards : (r + 1) * shards]
        got: list[list[int]] = [[] for _ in range(shards)]
        splits = [exchange_splits(slices, block, s) for s in range(shards)]
        for s, (send, recv) in enumerate(splits):
            a, b = slices[s]
            lo, hi = max(a, block[0][0]), min(b, block[-1][1])
            assert sum(send) == max(0, hi - lo), (r, s, "its slice's part in the block")
            assert recv == [splits[p][0][s] for p in range(shards)]
        for s in range(shards):
            for p in range(shards):
                a, b = slices[p]
                at = max(a, block[0][0]) + sum(splits[p][0][:s])
                got[s] += range(at, at + splits[p][0][s])
        for s, (a, b) in enumerate(block):
            assert got[s] == list(range(a, b)), (r, s)


def test_exchange_splits_refuses_a_block_with_a_hole_in_the_stripe():
    with pytest.raises(ValueError, match="cover the stripe"):
        exchange_splits([(0, 6), (6, 10)], [(0, 3), (4, 10)], 0)


@pytest.mark.parametrize("numel", [0, 1, 5, 7, 64, 1001])
@pytest.mark.parametrize("shape", [(2, 2), (3, 2), (1, 4), (4, 1), (2, 3)])
def test_a_hybrid_load_reads_each_element_once_but_for_the_tails(numel, shape):
    replicas, shards = shape
    seen = torch.zeros(numel, dtype=torch.int64)
    for r, s in itertools.product(range(replicas), range(shards)):
        for a, b in spread_ranges(numel, shards, s, replicas, r):
            seen[a:b] += 1
    b = numel // shards
    c = b // replicas
    for s in range(shards):  # the equal parts, gathered across the replicas: read once
        assert bool((seen[s * b : s * b + replicas * c] == 1).all())
        assert bool((seen[s * b + replicas * c : (s + 1) * b] == replicas).all())
    assert bool((seen[shards * b :] == shards * replicas).all())  # fewer than `shards` elements


def test_a_trainer_whose_mesh_does_not_place_its_rank_is_refused():
    lost = SimpleNamespace(replicas=2, mesh=None, rank=0, world_size=4)
    with pytest.raises(CheckpointError, match="hybrid sharding over 2 replicas, but its mesh"):
        _hybrid(lost)  # type: ignore[arg-type]
    mesh = SimpleNamespace(shape=(2, 2, 1), coordinate=(1, 0, 0))
    moved = SimpleNamespace(replicas=2, mesh=mesh, rank=0, world_size=4)
    with pytest.raises(CheckpointError, match="the mesh puts it at replica 1, shard 0"):
        _hybrid(moved)  # type: ignore[arg-type]


# -- in processes ------------------------------------------------------------------------------------
class _OneReplica:
    """A hybrid trainer seen as its shard group, which holds each element once: what
    ``flat_state`` sums over (every replica holds the same, so each rank sees it all)."""

    def __init__(self, trainer: DistributedTrainer) -> None:
        self.trainer = trainer

    def __getattr__(self, name: str):
        return getattr(self.trainer, name)

    @property
    def process_group(self):
        return self.trainer.mesh.dp_shard

    @property
    def world_size(self) -> int:
        return self.trainer.mesh.shape[1]


def _state(trainer: DistributedTrainer) -> dict[str, torch.Tensor]:
    return flat_state(_OneReplica(trainer) if trainer.replicas > 1 else trainer)  # type: ignore[arg-type]


class Mixed(nn.Module):
    """bf16 linears around an fp32 norm: a buffer of bytes in regions of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 24).to(BF16)
        self.norm = nn.LayerNorm(24)
        self.down = nn.Linear(24, 4).to(BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.up(x.to(BF16)).float())
        return self.down(h.to(BF16)).float().square().mean()


def _model(name: str) -> FlatParamModule:
    """``"gpt"``: ``sharded_harness.Model``; ``"small"``: the example's GPT, whose files are
    many checksum chunks each; ``"frozen"``: the first in bf16 (an fp32 master) with its
    position embedding and first attention frozen (frozen weights between trainable ones);
    ``"mixed"``: :class:`Mixed`."""
    if name == "mixed":
        return FlatParamModule(Mixed())
    model = GPT(SMALL) if name == "small" else Model()
    if name == "frozen":
        model.wpe.requires_grad_(False)
        model.blocks[0].attn.requires_grad_(False)
    return FlatParamModule(model, align_bytes=4, dtype=BF16 if name == "frozen" else None)


def _train(trainer: DistributedTrainer, steps: range) -> None:
    if not isinstance(trainer.module.module, Mixed):
        return train(trainer, steps)
    for step in steps:
        trainer.zero_grad()
        g = torch.Generator().manual_seed(1000 * trainer.rank + step)
        trainer.module(torch.randn(5, 8, generator=g)).backward()
        trainer.step()


def _trainer(kind: str, seed: int, model: str = "gpt") -> DistributedTrainer:
    """``"plain"``: ``shard=True`` over the world; ``"full"``: ``shard="full"``; ``"RxS"``:
    ``shard=True`` over a mesh of R replicas of S shards (``"RxS-full"``: ``shard="full"``);
    of :func:`_model`'s ``model``."""
    torch.manual_seed(seed)
    fm = _model(model)
    mesh, (shape, _, full) = None, kind.partition("-")
    if "x" in shape:
        r, s = map(int, shape.split("x"))
        mesh = torchshard.init_mesh(dp_replicate=r, dp_shard=s)
    shard = "full" if kind == "full" or full else True
    trainer = DistributedTrainer(fm, mesh=mesh, shard=shard, bucket_mb=0.004)
    trainer.make_optimizer(torch.optim.AdamW, groups=[(no_decay, {"weight_decay": 0.0})], **KW)
    return trainer


def _save(trainer: DistributedTrainer, root: Path, step: int, async_: bool) -> Path:
    opt = trainer.optimizer
    if async_:
        return checkpoint.async_save(root, trainer, step=step, optimizer=opt).wait()
    return checkpoint.save(root, trainer, step=step, optimizer=opt)


def _ops(log: CollectiveLog) -> list[tuple]:
    return [(c.op, c.group, c.splits is not None) for c in log.calls]


def _save_2x2(root: str, expected: str, async_: bool) -> dict:
    trainer = _trainer("2x2", seed=0)
    train(trainer, range(2))
    with CollectiveLog() as log:
        _save(trainer, Path(root), 2, async_)
    state = _state(trainer)
    if trainer.rank == 0:
        torch.save(state, expected)
    out = {"ops": _ops(log), "shard_group": trainer.mesh.ranks("dp_shard")}
    trainer.close()
    return out


def _load(root: str, expected: str, kind: str) -> dict:
    trainer = _trainer(kind, seed=1)
    train(trainer, range(1))  # other weights and state than the saved ones
    info = checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    out = {
        "step": info.step,
        "read": info.bytes_read,
        "differs": differences(_state(trainer), torch.load(expected, weights_only=True)),
        "replicas": trainer.replicas,
    }
    trainer.close()
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["blocking", "async"])
def saved_2x2(request, tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("saved-2x2")
    root, expected = tmp / "ckpt", tmp / "expected.pt"
    saved = run_distributed(_save_2x2, 4, str(root), str(expected), request.param, timeout=180)
    return root, expected, saved


def test_a_2x2_save_writes_every_file_once_with_one_exchange_per_state_key(saved_2x2):
    root, _, saved = saved_2x2
    path = root / "step-00000002"
    names = sorted(p.name for p in path.iterdir())
    model = [f"model-{q + 1:05d}-of-00004.safetensors" for q in range(4)]
    optim = [f"optim-{q + 1:05d}-of-00004.safetensors" for q in range(4)]
    assert set(model + optim) <= set(names), names  # every data-parallel rank wrote its files
    for rank, got in enumerate(saved):
        group = tuple(next(g for g in got["shard_group"] if rank in g))
        exchanges = [op for op in got["ops"] if op[0] == "all_to_all_single"]
        assert exchanges == [("all_to_all_single", group, True)] * len(STATE_KEYS), got["ops"]


_MATRIX = [(4, "plain"), (4, "1x4"), (4, "4x1"), (4, "2x2"), (2, "plain"), (3, "full")]
_MATRIX += [(4, "2x2-full"), (4, "4x1-full")]


@pytest.mark.slow
@pytest.mark.parametrize("world,kind", _MATRIX, ids=[f"{k}@{w}" for w, k in _MATRIX])
def test_a_2x2_save_resumes_bitwise_at_any_mesh_or_mode(saved_2x2, world, kind):
    root, expected, _ = saved_2x2
    got = run_distributed(_load, world, str(root), str(expected), kind, timeout=180)
    for rank, r in enumerate(got):
        assert r["step"] == 2
        assert not r["differs"], (rank, r["differs"])


def _read_volume(root: str, kind: str) -> int:
    """Save a 2 x 2 run of the small GPT (``kind`` ``"save"``), or load it: the bytes read."""
    trainer = _trainer("2x2" if kind == "save" else kind, seed=0, model="small")
    if kind == "save":
        train(trainer, range(1))
        checkpoint.save(root, trainer, step=1, optimizer=trainer.optimizer)
        read = 0
    else:
        read = checkpoint.load(root, trainer, optimizer=trainer.optimizer).bytes_read
    trainer.close()
    return read


@pytest.mark.slow
def test_the_ranks_of_any_mesh_read_a_2x2_checkpoint_once(tmp_path):
    """Without the spread across replicas each replica would read all it holds alone: at
    2 x 2 about 1.67x the files (4 + 2 x 8 bytes per 12 saved), at 4 x 1 3x, fully sharded at
    2 x 2 1.35x. Whole chunks are read (4 KiB), so a rank that reads many small stripes
    (``shard="full"``, here also plain at 4 ranks) reads a few percent more."""
    run_distributed(_read_volume, 4, str(tmp_path), "save", timeout=180)
    data = sum(f.stat().st_size for f in tmp_path.glob("step-*/*.safetensors"))
    for kind in ("2x2", "4x1", "1x4", "plain", "2x2-full", "full"):
        read = sum(run_distributed(_read_volume, 4, str(tmp_path), kind, timeout=180))
        assert read <= 1.05 * data, (kind, read / data)


_MESHES = ("2x2", "1x4", "4x1", "2x2-full", "4x1-full")


def _same_state_same_files(tmp: str, model: str = "gpt") -> dict:
    """A plain 4-rank save; the same state loaded into trainers over each of ``_MESHES``, each
    saved again, blocking and async; the collectives of each blocking save."""
    out: dict = {"ops": {}, "differs": {}}
    plain = _trainer("plain", seed=0, model=model)
    _train(plain, range(2))
    with CollectiveLog() as log:
        _save(plain, Path(tmp, "plain"), 2, async_=False)
    out["ops"]["plain"] = _ops(log)
    want = flat_state(plain) if model != "mixed" else {}  # (it lays out one dtype)
    plain.close()
    for kind in _MESHES:
        trainer = _trainer(kind, seed=1, model=model)
        _train(trainer, range(1))
        checkpoint.load(Path(tmp, "plain"), trainer, optimizer=trainer.optimizer)
        out["differs"][kind] = differences(_state(trainer) if want else {}, want)
        with CollectiveLog() as log:
            _save(trainer, Path(tmp, kind), 2, async_=False)
        out["ops"][kind] = _ops(log)
        _save(trainer, Path(tmp, f"{kind}-async"), 2, async_=True)
        trainer.close()
    return out


@pytest.mark.parametrize("model", ["gpt", "frozen", "mixed"])
def test_same_state_same_files_whatever_the_mesh(tmp_path, model):
    got = run_distributed(_same_state_same_files, 4, str(tmp_path), model, timeout=180)
    for rank, r in enumerate(got):
        assert r["differs"] == {kind: [] for kind in _MESHES}, (rank, r["differs"])
        # a 1 x 4 mesh is the plain code path, and at 4 x 1 every rank holds its range; 2 x 2
        # adds all-to-alls in the shard group: one per state key with one region (frozen
        # weights or several dtypes cut it in more)
        assert r["ops"]["1x4"] == r["ops"]["plain"] == r["ops"]["4x1"], rank
        plain, hybrid = Counter(r["ops"]["plain"]), Counter(r["ops"]["2x2"])
        assert not plain - hybrid, (rank, plain - hybrid)
        group = (0, 1) if rank < 2 else (2, 3)
        assert set(hybrid - plain) == {("all_to_all_single", group, True)}, hybrid - plain
        if model == "gpt":
            assert sum((hybrid - plain).values()) == len(STATE_KEYS)
    plain = tmp_path / "plain" / "step-00000002"
    names = sorted(p.name for p in plain.iterdir())
    assert {"metadata.json", "model.safetensors.index.json"} <= set(names), names
    assert len(names) == 2 + 4 + 4, names  # and a model and an optimizer file per rank
    for kind in (*_MESHES, *(f"{kind}-async" for kind in _MESHES)):
        other = tmp_path / kind / "step-00000002"
        assert sorted(p.name for p in other.iterdir()) == names, kind
        for name in names:
            assert (other / name).read_bytes() == (plain / name).read_bytes(), (kind, name)


def _resumed(tmp: str, kind: str) -> list[str]:
    """A 2 x 2 run of 4 steps with an async save after 2, training on while it is written;
    then another 2 x 2 trainer resumed from it and trained the last 2 steps."""
    whole = _trainer(kind, seed=0)
    train(whole, range(2))
    future = checkpoint.async_save(tmp, whole, step=2, optimizer=whole.optimizer)
    train(whole, range(2, 4))
    future.wait()
    want = _state(whole)
    whole.close()
    resumed = _trainer(kind, seed=1)
    info = checkpoint.load(tmp, resumed, optimizer=resumed.optimizer)
    train(resumed, range(info.step, 4))
    got = _state(resumed)
    resumed.close()
    return differences(got, want)


@pytest.mark.parametrize("kind", ["2x2", "2x2-full"])
def test_a_resumed_2x2_run_is_bitwise_the_uninterrupted_one(tmp_path, kind):
    got = run_distributed(_resumed, 4, str(tmp_path), kind, timeout=180)
    for rank, differs in enumerate(got):
        assert not differs, (rank, differs)
