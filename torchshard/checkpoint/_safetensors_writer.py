"""Standard safetensors files, written from host memory.

The writer streams each tensor's bytes from its (CPU) memory, computing
per-chunk CRC32s on the way, and fsyncs; ``_safetensors`` reads them back by
byte range.

A checkpoint save (blocking or staged: nothing changes the bytes under it)
goes around the page cache where the filesystem allows (``O_DIRECT``): the
bytes pass through one half of a page-aligned :class:`DirectBlock`, are
checksummed there while in cache, and go to the disk from it while the other
half fills. Copying into the page cache is most of what a buffered write costs
in CPU (and the kernel may charge the writer its writeback too), and on a busy
machine that CPU comes out of training: ``benchmarks/bench_checkpoint.py``.
The copies are ``memmove`` calls, not ``Tensor.copy_``, whose intra-op
threads would spin through every write.

Where direct I/O is refused (a tmpfs), and for writers without a block, the
bytes go through the page cache: a large block's CRC32 runs on a second
thread while ``write`` copies it (both release the GIL), and on Linux the
kernel is asked to start writing each 8 MiB back as soon as it is written
(``sync_file_range``), so the disk works while the CPU copies the next ones.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import json
import math
import os
from pathlib import Path

import torch

from .._errors import CheckpointError
from ._safetensors import DTYPES, FileRecord, bytes_of, chunk_size_for, crc32

__all__ = ["DirectBlock", "SafetensorsWriter", "write_safetensors"]

_WRITE_BLOCK = 64 * 2**20
_CRC_ASIDE = 2**20  # a block at least this large is checksummed on the second thread
_WRITEBACK = 8 * 2**20  # start writing back whenever this much has been written since


def _sync_file_range():
    """Linux's ``sync_file_range(fd, offset, nbytes, flags)``, or ``None`` elsewhere."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_start_writeback = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait
_ALIGN = 4096  # O_DIRECT: memory, file offsets and lengths in multiples of this
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux's; 0 elsewhere: no direct I/O
if _O_DIRECT:
    import fcntl


class DirectBlock:
    """Two page-aligned host blocks that a file's bytes pass through on their way to the
    disk with ``O_DIRECT``: one fills (copy, checksum) while a helper thread writes the
    other. One per writer thread, reused by every file it writes; :meth:`close` ends the
    helper thread.

    Example::

        block = DirectBlock()
        write_safetensors(path, tensors, direct=block)
        block.close()
    """

    def __init__(self, nbytes: int = 8 * 2**20) -> None:
        assert nbytes % _ALIGN == 0
        raw = torch.empty(2 * nbytes + _ALIGN, dtype=torch.uint8)
        start = -raw.data_ptr() % _ALIGN
        self.halves = (raw[start : start + nbytes], raw[start + nbytes : start + 2 * nbytes])
        self.views = tuple(bytes_of(h) for h in self.halves)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "torchshard-direct")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _Direct:
    """A file written in whole aligned blocks through a :class:`DirectBlock`: while one half
    fills, the other is written; at most one write is in flight, so the file grows in order."""

    def __init__(self, fd: int, block: DirectBlock) -> None:
        self.fd, self.block, self.fill, self.pos, self.half = fd, block, 0, 0, 0
        self._writing: concurrent.futures.Future | None = None

    def room(self) -> int:
        return self.block.halves[self.half].numel() - self.fill

    def address(self) -> int:
        """Where the next byte goes in the half that fills."""
        return self.block.halves[self.half].data_ptr() + self.fill

    def view(self, start: int, stop: int) -> memoryview:
        return self.block.views[self.half][start:stop]

    def flush(self, wait: bool = False) -> None:
        """Hand the filled half to the helper thread (a whole number of aligned units: the last
        one padded; the caller truncates the file to its size) and fill the other one."""
        n = -(-self.fill // _ALIGN) * _ALIGN
        ctypes.memset(self.address(), 0, n - self.fill)
        data, at = self.view(0, n), self.pos
        self.wait()  # the other half is free, and the file gets its bytes in order
        self._writing = self.block.submit(self._write, data, at)
        self.pos, self.fill, self.half = self.pos + n, 0, 1 - self.half
        if wait:
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight; raise its error."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _write(self, data: memoryview, at: int) -> None:
        while len(data):
            try:
                done = os.pwrite(self.fd, data, at)
            except OSError as e:  # direct I/O refused after all: through the page cache
                if e.errno != errno.EINVAL or not _buffered(self.fd):
                    raise
                continue
            data, at = data[done:], at + done


def _buffered(fd: int) -> bool:
    """Turn direct I/O off for ``fd``; whether it was on."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & _O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
    return True


class SafetensorsWriter:
    """A safetensors file written piece by piece, tensor data in the order of ``entries``.

    The header goes first with placeholder checksums (all the same length),
    the data streams after it while the CRC32 of each chunk is computed (on
    a second thread for large blocks, beside their ``write``), writeback
    starts as the data comes, and :meth:`finish` rewrites the header with
    the real checksums and fsyncs.
    """

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        direct: DirectBlock | None = None,
    ) -> None:
        self._header: dict[str, object] = {}
        offset = 0
        for name, dtype, shape in entries:
            if name in self._header or name == "__metadata__":
                raise CheckpointError(f"{path.name}: tensor name {name!r} appears twice")
            code = DTYPES.get(dtype)
            if code is None:
                raise CheckpointError(
                    f"tensor {name!r}: dtype {dtype} has no safetensors code here"
                )
            nbytes = math.prod(shape) * dtype.itemsize
            self._header[name] = {
                "dtype": code,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        self._metadata = {"format": "pt", **(metadata or {})}
        self.path = path
        self.data_size = offset
        self._chunk = chunk_size_for(offset)
        self._crcs: list[int] = []
        self._crc = self._filled = self._written = 0
        self._aside: concurrent.futures.ThreadPoolExecutor | None = None
        self._pos = self._synced = 0  # bytes in the file; where writeback was last started
        head = self._head([0] * -(-offset // self._chunk))
        self.size = len(head) + offset
        self._direct: _Direct | None = None
        try:
            self._f = self._open(path, direct)
        except OSError as e:
            raise self._error(e) from e
        try:
            self._put(memoryview(head))
        except BaseException:
            self._f.close()
            raise

    def _open(self, path: Path, direct: DirectBlock | None):
        if direct is not None and _O_DIRECT:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o666)
            except OSError:  # a filesystem without direct I/O (tmpfs): through the page cache
                pass
            else:
                self._direct = _Direct(fd, direct)
                return open(fd, "wb", buffering=0, closefd=True)
        return open(path, "wb", buffering=0)

    def _error(self, e: OSError) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: cannot write ({e.strerror or e}); earlier checkpoints are untouched"
        )

    def _put(self, data: memoryview) -> None:
        if self._direct is not None:
            self._put_direct(_tensor_of(data), data=False)
            return
        try:
            _write_all(self._f, data)
        except OSError as e:
            raise self._error(e) from e
        self._pos += len(data)
        if _start_writeback is not None and self._pos - self._synced >= _WRITEBACK:
            # Only a hint: durability comes from finish()'s fsync, so a failure is ignored.
            _start_writeback(
                self._f.fileno(), self._synced, self._pos - self._synced, _SYNC_FILE_RANGE_WRITE
            )
            self._synced = self._pos

    def _head(self, crcs: list[int]) -> bytes:
        meta = {
            **self._metadata,
            "torchshard.chunk_bytes": str(self._chunk),
            "torchshard.crc32": "".join(f"{c:08x}" for c in crcs),
        }
        head = json.dumps({"__metadata__": meta, **self._header}, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
        return len(head).to_bytes(8, "little") + head

    def _count(self, nbytes: int) -> None:
        self._written += nbytes
        if self._written > self.data_size:
            raise CheckpointError(f"{self.path}: more data than its header describes")

    def _put_direct(self, src: torch.Tensor | int, data: bool = True) -> None:
        """Copy ``src`` (bytes, or a count of zero bytes) into the direct block, checksum the
        data there, and write every block that fills."""
        out = self._direct
        assert out is not None
        n, at = (src if isinstance(src, int) else src.numel()), 0
        while at < n:
            take = min(n - at, out.room())
            # ctypes, not Tensor.copy_/zero_: those fan out over the intra-op thread pool, whose
            # OpenMP threads then spin through each block's write (0.4 CPU-s per GB measured
            # with 2 threads), and from a writer thread they compete with training for cores
            if isinstance(src, int):
                ctypes.memset(out.address(), 0, take)
            else:
                ctypes.memmove(out.address(), src.data_ptr() + at, take)
            if data:
                self._checksum(out.view(out.fill, out.fill + take))
            out.fill, at = out.fill + take, at + take
            if not out.room():
                self._flush_direct()

    def _flush_direct(self) -> None:
        assert self._direct is not None
        try:
            self._direct.flush()
        except OSError as e:
            raise self._error(e) from e

    def write(self, data: memoryview) -> None:
        self._count(len(data))
        if self._direct is not None:
            self._put_direct(_tensor_of(data))
            return
        if len(data) < _CRC_ASIDE:
            self._checksum(data)
            self._put(data)
            return
        if self._aside is None:
            self._aside = concurrent.futures.ThreadPoolExecutor(1, "torchshard-crc")
        summed = self._aside.submit(self._checksum, data)
        try:
            self._put(data)
        finally:
            summed.result()  # the bytes stay untouched until their checksum is done

    def _checksum(self, data: memoryview) -> None:
        """Fold ``data`` into the running chunk CRC32s (one thread at a time)."""
        rest = data
        while len(rest):
            take = min(len(rest), self._chunk - self._filled)
            self._crc = crc32(rest[:take], self._crc)
            self._filled += take
            rest = rest[take:]
            if self._filled == self._chunk:
                self._crcs.append(self._crc)
                self._crc = self._filled = 0

    def write_tensor(self, t: torch.Tensor) -> None:
        """Append a contiguous CPU tensor's bytes, in large blocks."""
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("stage tensors to contiguous host memory before writing")
        if self._direct is not None:
            self._count(t.numel() * t.element_size())
            self._put_direct(t.reshape(-1).view(torch.uint8))
            return
        data = bytes_of(t)
        for start in range(0, len(data), _WRITE_BLOCK):
            self.write(data[start : start + _WRITE_BLOCK])

    def write_zeros(self, nbytes: int) -> None:
        """Append ``nbytes`` zero bytes."""
        if self._direct is not None:
            self._count(nbytes)
            self._put_direct(nbytes)
            return
        zeros = memoryview(bytes(min(nbytes, _WRITE_BLOCK)))
        while nbytes > 0:
            self.write(zeros[: min(nbytes, len(zeros))])
            nbytes -= len(zeros)

    def finish(self) -> FileRecord:
        """Write the real checksums into the header, fsync, and return the file's record."""
        if self._written != self.data_size:
            raise CheckpointError(f"{self.path}: wrote {self._written} of {self.data_size} bytes")
        if self._filled:
            self._crcs.append(self._crc)
        head = self._head(self._crcs)
        assert len(head) + self.data_size == self.size  # same length as the placeholder
        try:
            if self._direct is not None:  # the tail, padded; then the file to its size
                self._direct.flush(wait=True)
                os.ftruncate(self._f.fileno(), self.size)
                _buffered(self._f.fileno())  # the header is not a whole aligned block
            os.pwrite(self._f.fileno(), head, 0)
            os.fsync(self._f.fileno())
        except OSError as e:
            raise self._error(e) from e
        finally:
            self.close()
        return FileRecord(self.size, crc32(head))

    def close(self) -> None:
        if self._direct is not None:  # a failed save: its last write ends before the file closes
            with contextlib.suppress(OSError):
                self._direct.wait()
        self._f.close()
        if self._aside is not None:
            self._aside.shutdown()
            self._aside = None

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tensor_of(data: memoryview) -> torch.Tensor:
    """``data``'s bytes as a uint8 tensor (a copy: ``data`` may be read-only)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _write_all(f, data: memoryview) -> None:
    while len(data):
        n = f.write(data)
        data = data[n:]


def write_safetensors(
    path: Path,
    tensors: list[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    direct: DirectBlock | None = None,
) -> FileRecord:
    """Write ``tensors`` (contiguous CPU tensors, in this order) as one safetensors file.

    Streams from the tensors' memory in large blocks (through ``direct`` with direct I/O
    where the filesystem has it), fsyncs, and returns the file's record.

    Example::

        record = write_safetensors(Path("model.safetensors"), [("w", torch.zeros(3))])
    """
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
    with SafetensorsWriter(path, entries, metadata, direct) as out:
        for _, t in tensors:
            out.write_tensor(t)
        return out.finish()
