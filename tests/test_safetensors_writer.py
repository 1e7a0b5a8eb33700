"""The safetensors writer's fast path: a large block's CRC32 on a second thread beside its
``write``, and writeback started as data comes. Neither may change a byte of the file."""

from __future__ import annotations

import threading
import zlib

import pytest
import torch
from safetensors.torch import load_file

from torchshard.checkpoint import _safetensors_writer as w
from torchshard.checkpoint._safetensors import SafetensorsReader

MiB = 2**20


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("small", torch.randn(7, generator=g)),  # checksummed inline
        ("big", torch.randn(5 * MiB, generator=g)),  # 20 MiB: aside, several writeback hints
        ("tail", torch.randint(0, 255, (MiB + 3,), dtype=torch.uint8, generator=g)),
    ]


def write(path, monkeypatch, aside: int, writeback) -> w.FileRecord:
    monkeypatch.setattr(w, "_CRC_ASIDE", aside)
    monkeypatch.setattr(w, "_start_writeback", writeback)
    monkeypatch.setattr(w, "_WRITE_BLOCK", 5 * MiB)  # blocks that cross CRC chunks
    return w.write_safetensors(path, tensors())


def test_checksums_aside_give_the_same_file(tmp_path, monkeypatch):
    hints: list[tuple[int, int, int, int]] = []
    fast = write(tmp_path / "fast.safetensors", monkeypatch, MiB, lambda *a: hints.append(a))
    plain = write(tmp_path / "plain.safetensors", monkeypatch, 2**62, None)
    assert (tmp_path / "fast.safetensors").read_bytes() == (
        tmp_path / "plain.safetensors"
    ).read_bytes()
    assert fast == plain
    # every chunk's CRC32 is zlib's over the chunk's bytes: the reader verifies all of them
    reader = SafetensorsReader(tmp_path / "fast.safetensors", fast)
    try:
        assert reader.verify() == []
        data = (tmp_path / "fast.safetensors").read_bytes()[reader.data_start :]
        c = reader.chunk_bytes
        assert list(reader.crc32) == [zlib.crc32(data[i : i + c]) for i in range(0, len(data), c)]
    finally:
        reader.close()
    loaded = load_file(tmp_path / "fast.safetensors")
    for name, t in tensors():
        assert torch.equal(loaded[name], t), name
    # writeback hints: contiguous ranges from the file's start, none after the last write
    assert [h[3] for h in hints] == [w._SYNC_FILE_RANGE_WRITE] * len(hints)
    assert len(hints) >= 2
    pos = 0
    for _, start, nbytes, _ in hints:
        assert start == pos and nbytes >= w._WRITEBACK
        pos += nbytes
    assert pos <= fast.size
    # the checksum thread is gone once the file is finished
    assert not [t for t in threading.enumerate() if t.name.startswith("torchshard-crc")]


def test_a_failed_write_waits_for_its_checksum_and_stops_the_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(w, "_CRC_ASIDE", MiB)
    out = w.SafetensorsWriter(tmp_path / "x.safetensors", [("x", torch.uint8, (4 * MiB,))])
    seen: list[int] = []

    def checksum(data):
        seen.append(len(data))

    def fail(data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(out, "_checksum", checksum)
    monkeypatch.setattr(w, "_write_all", lambda f, data: fail(data))
    with pytest.raises(w.CheckpointError, match="No space left on device"), out:
        out.write(memoryview(bytes(4 * MiB)))
    assert seen == [4 * MiB]
    assert not [t for t in threading.enumerate() if t.name.startswith("torchshard-crc")]


@pytest.mark.skipif(w._start_writeback is None, reason="sync_file_range is Linux's")
def test_the_writeback_hint_is_the_real_call(tmp_path):
    record = w.write_safetensors(tmp_path / "real.safetensors", tensors())
    reader = SafetensorsReader(tmp_path / "real.safetensors", record)
    try:
        assert reader.verify() == []
    finally:
        reader.close()
