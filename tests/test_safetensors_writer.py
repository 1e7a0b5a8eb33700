"""The safetensors writer's fast paths: direct I/O through two alternating halves (a helper
thread writes one while the other fills), and through the page cache a large block's CRC32 on
a second thread beside its ``write``, with writeback started as data comes. None may change a
byte of the file."""

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


def direct_io_here(path) -> bool:
    """Whether the filesystem of ``path`` opens files for direct I/O."""
    if not w._O_DIRECT:
        return False
    try:
        fd = w.os.open(path / "probe", w.os.O_WRONLY | w.os.O_CREAT | w._O_DIRECT, 0o666)
    except OSError:
        return False
    w.os.close(fd)
    (path / "probe").unlink()
    return True


@pytest.mark.parametrize("block", [2 * 4096, 16 * MiB])
def test_direct_io_writes_the_same_file(tmp_path, monkeypatch, block):
    """Through a small block (many flushes, a tensor across several, a padded tail cut
    back) and the default one: the bytes and checksums of a buffered write."""
    monkeypatch.setattr(w, "_WRITE_BLOCK", 5 * MiB)
    plain = w.write_safetensors(tmp_path / "plain.safetensors", tensors())
    flags: list[int] = []
    real_flush = w._Direct.flush

    def flush(self, wait=False):
        flags.append(w.fcntl.fcntl(self.fd, w.fcntl.F_GETFL) if w._O_DIRECT else 0)
        real_flush(self, wait)

    monkeypatch.setattr(w._Direct, "flush", flush)
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in tensors()]
    with w.SafetensorsWriter(
        tmp_path / "d.safetensors", entries, None, w.DirectBlock(block)
    ) as out:
        for _, t in tensors():
            out.write_tensor(t)
        out.write_zeros(0)
        direct = out.finish()
    assert (tmp_path / "d.safetensors").read_bytes() == (
        tmp_path / "plain.safetensors"
    ).read_bytes()
    assert direct == plain
    if direct_io_here(tmp_path):  # the data went around the page cache
        assert len(flags) >= (2 if block == 16 * MiB else 100)
        assert all(f & w._O_DIRECT for f in flags), flags
    else:  # e.g. a tmpfs without O_DIRECT: the same file through the page cache
        assert flags == []


def test_a_refused_direct_write_goes_through_the_page_cache(tmp_path, monkeypatch):
    if not direct_io_here(tmp_path):
        pytest.skip("this filesystem has no direct I/O to refuse")
    real = w.os.pwrite
    refused: list[int] = []

    def pwrite(fd, data, pos):
        if not refused:
            refused.append(pos)
            raise OSError(22, "Invalid argument")
        return real(fd, data, pos)

    monkeypatch.setattr(w.os, "pwrite", pwrite)
    record = w.write_safetensors(tmp_path / "x.safetensors", tensors(), direct=w.DirectBlock(4096))
    monkeypatch.undo()
    plain = w.write_safetensors(tmp_path / "plain.safetensors", tensors())
    assert refused == [0] and record == plain
    assert (tmp_path / "x.safetensors").read_bytes() == (
        tmp_path / "plain.safetensors"
    ).read_bytes()


def test_an_async_save_writes_through_the_direct_block_and_close_frees_it(tmp_path):
    from torchshard import FlatParamModule, checkpoint

    fm = FlatParamModule(torch.nn.Linear(64, 64))
    fm.bind(torch.randn(fm.numel), torch.zeros(fm.numel))
    opt = torch.optim.AdamW(fm.parameters())
    fm(torch.randn(2, 64)).sum().backward()
    opt.step()
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt")
    path = ckpt.save(fm, step=1, optimizer=opt).wait()
    writer = ckpt._writer
    assert writer._direct is not None  # an async save's files went through it
    ckpt.close()
    assert writer._direct is None and writer.arena.block is None
    fresh = FlatParamModule(torch.nn.Linear(64, 64))
    fresh.bind(torch.zeros(fresh.numel), torch.zeros(fresh.numel))
    checkpoint.load(path, fresh)
    assert torch.equal(fresh.flat_param, fm.flat_param)


def test_a_blocking_save_writes_through_the_direct_block(tmp_path, monkeypatch):
    """A blocking save's files go around the page cache too (nothing changes the live tensors
    while the caller waits), through the writer's two halves, and load as before."""
    from torchshard import FlatParamModule, checkpoint

    if not direct_io_here(tmp_path):
        pytest.skip("this filesystem has no direct I/O")
    fm = FlatParamModule(torch.nn.Linear(512, 512))
    fm.bind(torch.randn(fm.numel), torch.zeros(fm.numel))
    opt = torch.optim.AdamW(fm.parameters())
    fm(torch.randn(2, 512)).sum().backward()
    opt.step()
    halves: list[int] = []
    real_flush = w._Direct.flush

    def flush(self, wait=False):
        halves.append(self.half)
        real_flush(self, wait)

    monkeypatch.setattr(w._Direct, "flush", flush)
    monkeypatch.setattr(w.DirectBlock.__init__, "__defaults__", (64 * 1024,))
    path = checkpoint.save(tmp_path / "ckpt", fm, step=1, optimizer=opt)
    assert {0, 1} <= set(halves)  # ~3 MiB through 64 KiB halves: both took turns
    fresh = FlatParamModule(torch.nn.Linear(512, 512))
    fresh.bind(torch.zeros(fresh.numel), torch.zeros(fresh.numel))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    checkpoint.load(path, fresh, optimizer=fresh_opt)
    assert torch.equal(fresh.flat_param, fm.flat_param)
    assert all(
        torch.equal(fresh_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])
        for a, b in zip(fresh.parameters(), fm.parameters())
    )


def test_a_direct_write_that_fails_in_the_helper_thread_raises_naming_the_file(
    tmp_path, monkeypatch
):
    """The disk fills up during the third block's write, on the helper thread: the error
    reaches the writer (at the next hand-over or at finish) as a CheckpointError naming the
    file, and no write is left running on the closed file."""
    from torchshard.checkpoint import CheckpointError

    if not direct_io_here(tmp_path):
        pytest.skip("this filesystem has no direct I/O")
    real, calls = w.os.pwrite, []

    def pwrite(fd, data, pos):
        calls.append(pos)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(fd, data, pos)

    monkeypatch.setattr(w.os, "pwrite", pwrite)
    block = w.DirectBlock(64 * 1024)
    with pytest.raises(CheckpointError, match=r"x\.safetensors: cannot write \(No space left"):
        w.write_safetensors(tmp_path / "x.safetensors", tensors(), direct=block)
    assert len(calls) == 3  # nothing written after the failure
    block.close()
