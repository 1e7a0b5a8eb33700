"""A resume's work per rank falls with the world size as its bytes do (issue 22).

A checkpoint saved at 2 ranks loads at 1, 2, 3 and 4, replicated and sharded; in each rank the
load's work is counted, not timed: bytes and calls of file reads, bytes checksummed, and the
collectives issued. At 3 ranks each rank reads and checks at most what it did at 2, the ranks
together read the checkpoint about once, and the collectives are one in-place all-gather per
tensor that every rank holds whole (none per key per rank), the same list at every world size.
The oracle is the saving run's state (:func:`sharded_harness.flat_state`), bit for bit.

The reader's part is unit-tested here too: any byte range reads back exactly, whole chunks
read in place many per call, and a corrupt chunk is caught on either path.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from probes import CollectiveLog
from sharded_harness import differences, flat_state

from torchshard import DistributedTrainer, FlatParamModule, checkpoint
from torchshard.checkpoint import CheckpointError
from torchshard.checkpoint import _load as load_module
from torchshard.checkpoint import _safetensors as st
from torchshard.checkpoint._plan import gather_ranges
from torchshard.checkpoint._safetensors_writer import write_safetensors

CFG = GPTConfig.preset("small")  # about 0.8M parameters: ~400 checksum chunks per file
STATE_KEYS = ("exp_avg", "exp_avg_sq")


# -- pure ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("numel", [0, 1, 2, 7, 10, 4096, 4099])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_gather_ranges_tile_the_tensor_in_equal_parts_and_a_tail(numel, world):
    b = numel // world
    seen = torch.zeros(numel, dtype=torch.int64)
    for rank in range(world):
        ranges = gather_ranges(numel, world, rank)
        body = [r for r in ranges if r[1] <= world * b]
        assert body == ([(rank * b, rank * b + b)] if b else []), (rank, ranges)
        for a, c in ranges:
            seen[a:c] += 1
    assert bool((seen[: world * b] == 1).all()), "each equal part is read by one rank"
    assert bool((seen[world * b :] == world).all()), "the tail is read by every rank"
    assert numel - world * b < world


# -- the reader ---------------------------------------------------------------------------------
class Counted:
    """Counts the reader's ``_pread`` calls and bytes, and the bytes checksummed, while open."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.preads = self.read = self.crc = 0
        pread, crc = st.SafetensorsReader._pread, st._crc32

        def counted_pread(reader, offset, out):
            self.preads += 1
            self.read += len(out)
            return pread(reader, offset, out)

        def counted_crc(data, value=0):
            self.crc += len(data)
            return crc(data, value)

        monkeypatch.setattr(st.SafetensorsReader, "_pread", counted_pread)
        monkeypatch.setattr(st, "_crc32", counted_crc)


@pytest.fixture
def written(tmp_path) -> tuple[Path, st.FileRecord, torch.Tensor]:
    data = torch.randn(50_001)  # 200 KB: 49 chunks of 4 KiB, the last one short
    path = tmp_path / "t.safetensors"
    record = write_safetensors(path, [("a", torch.arange(3.0)), ("x", data)])
    return path, record, data


def test_any_range_reads_back_exactly(written):
    path, record, data = written
    rng = random.Random(0)
    with st.SafetensorsReader(path, record) as reader:
        assert reader.chunk_bytes == 4096
        cases = [(0, data.numel()), (0, 1), (1023, 1024), (1024, 2048), (49_000, 50_001)]
        cases += [tuple(sorted(rng.sample(range(data.numel() + 1), 2))) for _ in range(200)]
        for a, b in cases:
            out = torch.full((b - a,), float("nan"))
            reader.read_into("x", a, b, out)
            assert torch.equal(out, data[a:b]), (a, b)


def test_a_range_checks_each_chunk_once_reading_whole_ones_in_place(written, monkeypatch):
    path, record, data = written
    reader = st.SafetensorsReader(path, record)
    n = Counted(monkeypatch)
    out = torch.empty(data.numel())
    reader.read_into("x", 0, data.numel(), out)  # all 49 chunks but a part of the first
    assert torch.equal(out, data)
    assert n.read == reader.size - reader.data_start, "the data section, once"
    assert n.crc == n.read, "every byte read is checked once"
    assert n.preads <= 2, f"whole chunks in few calls, got {n.preads}"
    reader.close()


@pytest.mark.parametrize("where", [100, 30_000], ids=["cut-chunk", "whole-chunk"])
def test_a_corrupt_chunk_is_caught_on_either_path(written, where):
    path, record, data = written
    raw = bytearray(path.read_bytes())
    with st.SafetensorsReader(path, record) as reader:
        at = reader.data_start + 12 + where * 4  # element `where` of "x"
    raw[at] ^= 1
    path.write_bytes(bytes(raw))
    with st.SafetensorsReader(path, record) as reader, pytest.raises(CheckpointError) as e:
        reader.read_into("x", 0, data.numel(), torch.empty(data.numel()))
    assert "checksum mismatch" in str(e.value)


# -- a resume at 1, 2, 3 and 4 ranks ------------------------------------------------------------
def _trainer(shard: bool, seed: int) -> DistributedTrainer:
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    trainer = DistributedTrainer(FlatParamModule(GPT(CFG)), shard=shard)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-3)
    return trainer


def _save(root: str, expected: str, shard: bool) -> None:
    trainer = _trainer(shard, 0)
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + trainer.rank)
        idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1), generator=g)
        trainer.zero_grad()
        trainer.module(idx[:, :-1], idx[:, 1:])[1].backward()
        trainer.step()
    checkpoint.save(root, trainer, step=2, optimizer=trainer.optimizer)
    state = flat_state(trainer)
    if trainer.rank == 0:
        torch.save(state, expected)
    trainer.close()


def _load(root: str, expected: str, shard: bool, all_gather: bool) -> dict:
    trainer = _trainer(shard, 1)
    with pytest.MonkeyPatch.context() as mp:
        if all_gather:  # what NCCL gets: gloo's own all-gather is slower than its broadcasts
            mp.setattr(load_module, "BROADCAST_BACKENDS", frozenset())
        n = Counted(mp)
        with CollectiveLog() as log:
            info = checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    out = {
        "calls": [(c.op, *(t for _, t in c.tensors)) for c in log.calls],
        "numel": trainer.module.layout.numel,
        "read": info.bytes_read,
        "preads": n.preads,
        "crc": n.crc,
        "differs": differences(flat_state(trainer), torch.load(expected, weights_only=True)),
    }
    trainer.close()
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["replicated", "sharded"])
def saved_at_2(request, tmp_path_factory) -> tuple[Path, Path, bool]:
    tmp = tmp_path_factory.mktemp("saved-at-2")
    root, expected = tmp / "ckpt", tmp / "expected.pt"
    run_distributed(_save, 2, str(root), str(expected), request.param, timeout=180)
    return root, expected, request.param


@pytest.mark.slow
@pytest.mark.parametrize("all_gather", [False, True], ids=["gloo", "all-gather"])
def test_a_resume_does_less_per_rank_at_more_ranks(saved_at_2, all_gather):
    root, expected, shard = saved_at_2
    path = next(root.glob("step-*"))
    data = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    args = (str(root), str(expected), shard, all_gather)
    runs = {w: run_distributed(_load, w, *args, timeout=180) for w in (1, 2, 3, 4)}
    for w, results in runs.items():
        for rank, r in enumerate(results):
            assert not r["differs"], (w, rank, r["differs"])
            assert r["crc"] <= r["read"], (w, rank, "a chunk checked twice")
            assert r["calls"] == results[0]["calls"], (w, rank, "collectives differ by rank")
        total = sum(r["read"] for r in results)
        assert total <= 1.05 * data, (w, total / data, "the checkpoint read about once")
    for most, fewer in ((1, 2), (2, 3), (3, 4)):
        for key in ("read", "crc"):  # bytes read, bytes checksummed
            hi = max(r[key] for r in runs[most])
            lo = max(r[key] for r in runs[fewer])
            assert lo <= hi, (key, f"{lo} per rank at {fewer} ranks, {hi} at {most}")
    # read calls go with the files and tensors a rank touches, not its bytes: never more
    # than one rank reading the whole checkpoint makes
    whole = runs[1][0]["preads"]
    for w in (2, 3, 4):
        assert max(r["preads"] for r in runs[w]) <= whole, (w, [r["preads"] for r in runs[w]])
    # per tensor every rank ends up holding whole (the weights; a replicated optimizer's
    # state): one in-place all-gather, or on gloo one broadcast per rank of an equal part,
    # all started before any is waited for; beside them only the ranks' agreement (two
    # all_gathers of a few bytes)
    tensors = 1 + (0 if shard else len(STATE_KEYS))
    numel = runs[1][0]["numel"]
    for w in (2, 3, 4):
        calls = runs[w][0]["calls"]
        ops = [c[0] for c in calls]
        if all_gather:
            assert "broadcast" not in ops, (w, ops)
            assert ops.count("all_gather_single") == tensors, (w, ops)
        else:
            assert "all_gather_single" not in ops, (w, ops)
            sizes = {c[1][0] for c in calls if c[0] == "broadcast"}
            assert ops.count("broadcast") == w * tensors, (w, ops)
            assert sizes == {numel // w}, (w, sizes, "equal parts")
        assert len(ops) == (1 if all_gather else w) * tensors + 2, (w, ops)
    assert runs[1][0]["calls"] == [], "a world of one exchanges nothing"
