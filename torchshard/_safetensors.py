"""Standard safetensors files, written from staged host memory and read by byte range.

The writer streams each tensor's bytes straight from its (CPU) memory in
large writes (no serialized copy of the file), computing per-chunk CRC32s on
the way, and fsyncs. The reader parses and validates the JSON header (no
pickle, nothing executes), then reads only the requested byte ranges,
verifying the CRC of every chunk it touches. Files are readable by
``safetensors.safe_open`` and transformers.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ._errors import CheckpointError

__all__ = [
    "FileRecord",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TensorEntry",
    "write_safetensors",
]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit
_WRITE_BLOCK = 64 * 2**20


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (no copy, no numpy)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def chunk_size_for(nbytes: int) -> int:
    """CRC chunk size: about 1024 chunks per file, between 4 KiB and 64 MiB.

    A reader verifies whole chunks, so it reads at most two chunks more than
    it needs per file: about 0.2% of a file.
    """
    return min(64 * 2**20, max(4096, 2 ** math.ceil(math.log2(max(nbytes, 1) / 1024))))


@dataclass(frozen=True)
class FileRecord:
    """Size and per-chunk CRC32s of a written file, as stored in ``metadata.json``."""

    size: int
    chunk_bytes: int
    crc32: tuple[int, ...]

    def to_dict(self) -> dict:
        return {
            "size": self.size,
            "chunk_bytes": self.chunk_bytes,
            "crc32": "".join(f"{c:08x}" for c in self.crc32),
        }

    @classmethod
    def from_dict(cls, d: dict) -> FileRecord:
        text = d["crc32"]
        if not isinstance(text, str) or len(text) % 8:
            raise ValueError("crc32: expected a string of 8-digit hex values")
        crcs = tuple(int(text[i : i + 8], 16) for i in range(0, len(text), 8))
        size, chunk = int(d["size"]), int(d["chunk_bytes"])
        if chunk <= 0 or len(crcs) != -(-size // chunk):
            raise ValueError(
                f"{len(crcs)} checksums do not cover {size} bytes in chunks of {chunk}"
            )
        return cls(size, chunk, crcs)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int


class SafetensorsWriter:
    """A safetensors file written piece by piece from a header known in advance.

    Computes the per-chunk CRC32s on the way (``zlib`` and ``write`` release
    the GIL on large blocks) and fsyncs in :meth:`finish`.
    """

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for name, dtype, shape in entries:
            if name in header:
                raise CheckpointError(f"{path.name}: tensor name {name!r} appears twice")
            code = _DTYPES.get(dtype)
            if code is None:
                raise CheckpointError(
                    f"tensor {name!r}: dtype {dtype} has no safetensors code here"
                )
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": code,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        self.path = path
        self.size = 8 + len(head) + offset
        self._chunk = chunk_size_for(self.size)
        self._crcs: list[int] = []
        self._crc = self._filled = self._written = 0
        self._f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in finish()/close()
        try:
            self.write(memoryview(len(head).to_bytes(8, "little")))
            self.write(memoryview(head))
        except BaseException:
            self._f.close()
            raise

    def write(self, data: memoryview) -> None:
        self._written += len(data)
        if self._written > self.size:
            raise CheckpointError(f"{self.path}: more data than its header describes")
        rest = data
        while len(rest):
            take = min(len(rest), self._chunk - self._filled)
            self._crc = zlib.crc32(rest[:take], self._crc)
            self._filled += take
            rest = rest[take:]
            if self._filled == self._chunk:
                self._crcs.append(self._crc)
                self._crc = self._filled = 0
        while len(data):
            n = self._f.write(data)
            data = data[n:]

    def finish(self) -> FileRecord:
        if self._written != self.size:
            raise CheckpointError(f"{self.path}: wrote {self._written} of {self.size} bytes")
        os.fsync(self._f.fileno())
        self._f.close()
        if self._filled:
            self._crcs.append(self._crc)
        return FileRecord(self.size, self._chunk, tuple(self._crcs))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_safetensors(
    path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None
) -> FileRecord:
    """Write ``tensors`` (contiguous CPU tensors, in this order) as one safetensors file.

    Streams from the tensors' memory in large blocks, fsyncs, and returns the file's record.
    """
    for name, t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name}: stage tensors to contiguous host memory before writing")
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
    with SafetensorsWriter(path, entries, metadata) as out:
        for _, t in tensors:
            data = _bytes_of(t)
            for start in range(0, len(data), _WRITE_BLOCK):
                out.write(data[start : start + _WRITE_BLOCK])
        return out.finish()


class SafetensorsReader:
    """Reads byte ranges of one safetensors file, verifying chunk CRCs when a record is given.

    ``bytes_read`` counts what came from the file (for I/O accounting).
    """

    def __init__(self, path: Path, record: FileRecord | None = None) -> None:
        self.path = Path(path)
        self.record = record
        self.bytes_read = 0
        self._cached: tuple[int, bytes] | None = None
        try:
            self._f = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise CheckpointError(
                f"{self.path}: cannot open ({e.strerror}); is the file missing?"
            ) from e
        try:
            self.size = os.fstat(self._f.fileno()).st_size
            if record is not None and self.size != record.size:
                raise CheckpointError(
                    f"{self.path}: expected {record.size} bytes, found {self.size}; "
                    "the file is truncated or was replaced"
                )
            self.entries, self.metadata, self.data_start = self._parse_header()
        except BaseException:
            self._f.close()
            raise

    def _error(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a valid safetensors file: {what}")

    def _parse_header(self) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
        if self.size < 8:
            raise self._error(f"{self.size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(self.read(0, 8), "little")
        if n > _MAX_HEADER or 8 + n > self.size:
            raise self._error(f"header length {n} does not fit in {self.size} bytes")
        try:
            header = json.loads(self.read(8, n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._error(f"header is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        data_start, entries, end = 8 + n, {}, 0
        try:
            for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = _FROM_NAME[e["dtype"]]
                shape = tuple(int(d) for d in e["shape"])
                begin, stop = (int(x) for x in e["data_offsets"])
                if begin != end or stop - begin != math.prod(shape) * dtype.itemsize:
                    raise self._error(
                        f"tensor {name!r}: data_offsets {[begin, stop]} are inconsistent"
                    )
                entries[name] = TensorEntry(name, dtype, shape, begin, stop)
                end = stop
        except (KeyError, TypeError, ValueError) as e:
            raise self._error(f"malformed tensor entry ({type(e).__name__}: {e})") from e
        if data_start + end != self.size:
            raise self._error(f"data ends at byte {data_start + end}, file has {self.size}")
        return entries, metadata, data_start

    def read(self, offset: int, nbytes: int) -> bytes:
        """Raw bytes (verified against the chunk CRCs when there is a record)."""
        out = bytearray(nbytes)
        self._read_into(offset, memoryview(out))
        return bytes(out)

    def read_into(self, name: str, start: int, stop: int, dst: torch.Tensor) -> None:
        """Copy elements ``[start, stop)`` of tensor ``name`` (flattened) into CPU tensor ``dst``."""
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        item = e.dtype.itemsize
        if (
            dst.dtype != e.dtype
            or dst.numel() != stop - start
            or not 0 <= start <= stop <= (e.end - e.begin) // item
        ):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ({e.dtype}, {(e.end - e.begin) // item} elements) "
                f"cannot fill elements [{start}, {stop}) of a {dst.dtype} buffer of {dst.numel()}"
            )
        self._read_into(self.data_start + e.begin + start * item, _bytes_of(dst))

    def _read_into(self, offset: int, out: memoryview) -> None:
        if self.record is None:
            self._pread(offset, out)
            return
        chunk = self.record.chunk_bytes
        pos, end = offset, offset + len(out)
        while pos < end:
            index = pos // chunk
            data = self._chunk(index)
            lo = pos - index * chunk
            take = min(end - pos, len(data) - lo)
            out[pos - offset : pos - offset + take] = data[lo : lo + take]
            pos += take

    def _chunk(self, index: int) -> bytes:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        assert self.record is not None
        chunk = self.record.chunk_bytes
        n = min(chunk, self.size - index * chunk)
        buf = bytearray(n)
        self._pread(index * chunk, memoryview(buf))
        if zlib.crc32(buf) != self.record.crc32[index]:
            raise CheckpointError(
                f"{self.path}: checksum mismatch in bytes [{index * chunk}, {index * chunk + n}); "
                "the file is corrupt, restore it or load an earlier checkpoint"
            )
        self._cached = (index, bytes(buf))
        return self._cached[1]

    def _pread(self, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            n = os.preadv(self._f.fileno(), [out[done:]], offset + done)
            if n == 0:
                raise CheckpointError(
                    f"{self.path}: unexpected end of file at byte {offset + done}"
                )
            done += n
        self.bytes_read += len(out)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
