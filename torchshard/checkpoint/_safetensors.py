"""Standard safetensors files, written from staged host memory (read by byte range in
:mod:`._safetensors_reader`).

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
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .._errors import CheckpointError

__all__ = [
    "FileRecord",
    "SafetensorsWriter",
    "TensorEntry",
    "bytes_of",
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

try:  # the same CRC-32, 4-5x faster than zlib's where ISA-L is installed (the `fast` extra)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32
_HEX = re.compile("[0-9a-f]+")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit
_WRITE_BLOCK = 64 * 2**20
_READ_BLOCK = 64 * 2**20  # the most one read in place asks for


def _is_hex(text: object, digits: int | None = None) -> bool:
    """Lowercase hex digits only (``int(x, 16)`` would also take ``0x``, ``+``, ``_``, spaces)."""
    if not isinstance(text, str) or not text or (digits is not None and len(text) != digits):
        return False
    return _HEX.fullmatch(text) is not None


def bytes_of(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (no copy, no numpy)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def chunk_size_for(nbytes: int) -> int:
    """CRC chunk size: about 1024 chunks per data section, between 4 KiB and 64 MiB.

    A reader verifies whole chunks, so it reads at most two chunks more than
    it needs per file: about 0.2% of a file.
    """
    return min(64 * 2**20, max(4096, 2 ** math.ceil(math.log2(max(nbytes, 1) / 1024))))


@dataclass(frozen=True)
class FileRecord:
    """A written file as ``metadata.json`` records it: its size and its header's CRC32.

    The header itself lists the CRC32 of every chunk of the data section
    (``__metadata__``: ``torchshard.chunk_bytes``, ``torchshard.crc32``), so
    ``metadata.json`` stays small whatever the sizes and the number of ranks.
    """

    size: int
    header_crc32: int

    def to_dict(self) -> dict:
        return {"size": self.size, "header_crc32": f"{self.header_crc32:08x}"}

    @classmethod
    def from_dict(cls, d: dict) -> FileRecord:
        """The record written by :meth:`to_dict`; ``ValueError`` for anything else."""
        size = d.get("size") if isinstance(d, dict) else None
        crc = d.get("header_crc32") if isinstance(d, dict) else None
        if type(size) is not int or size < 8 or not _is_hex(crc, 8):
            raise ValueError(f"bad file record {d!r}")
        return cls(size, int(crc, 16))


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int


class SafetensorsWriter:
    """A safetensors file written piece by piece, tensor data in the order of ``entries``.

    The header goes first with placeholder checksums (all the same length),
    the data streams after it while the CRC32 of each chunk is computed
    (the CRC and ``write`` release the GIL on large blocks), and
    :meth:`finish` rewrites the header with the real checksums and fsyncs.
    """

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self._header: dict[str, object] = {}
        offset = 0
        for name, dtype, shape in entries:
            if name in self._header or name == "__metadata__":
                raise CheckpointError(f"{path.name}: tensor name {name!r} appears twice")
            code = _DTYPES.get(dtype)
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
        head = self._head([0] * -(-offset // self._chunk))
        self.size = len(head) + offset
        try:
            self._f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in finish()/close()
        except OSError as e:
            raise self._error(e) from e
        try:
            self._put(memoryview(head))
        except BaseException:
            self._f.close()
            raise

    def _error(self, e: OSError) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: cannot write ({e.strerror or e}); earlier checkpoints are untouched"
        )

    def _put(self, data: memoryview) -> None:
        try:
            _write_all(self._f, data)
        except OSError as e:
            raise self._error(e) from e

    def _head(self, crcs: list[int]) -> bytes:
        meta = {
            **self._metadata,
            "torchshard.chunk_bytes": str(self._chunk),
            "torchshard.crc32": "".join(f"{c:08x}" for c in crcs),
        }
        head = json.dumps({"__metadata__": meta, **self._header}, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
        return len(head).to_bytes(8, "little") + head

    def write(self, data: memoryview) -> None:
        self._written += len(data)
        if self._written > self.data_size:
            raise CheckpointError(f"{self.path}: more data than its header describes")
        rest = data
        while len(rest):
            take = min(len(rest), self._chunk - self._filled)
            self._crc = _crc32(rest[:take], self._crc)
            self._filled += take
            rest = rest[take:]
            if self._filled == self._chunk:
                self._crcs.append(self._crc)
                self._crc = self._filled = 0
        self._put(data)

    def write_tensor(self, t: torch.Tensor) -> None:
        """Append a contiguous CPU tensor's bytes, in large blocks."""
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("stage tensors to contiguous host memory before writing")
        data = bytes_of(t)
        for start in range(0, len(data), _WRITE_BLOCK):
            self.write(data[start : start + _WRITE_BLOCK])

    def write_zeros(self, nbytes: int) -> None:
        """Append ``nbytes`` zero bytes."""
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
            os.pwrite(self._f.fileno(), head, 0)
            os.fsync(self._f.fileno())
        except OSError as e:
            raise self._error(e) from e
        finally:
            self._f.close()
        return FileRecord(self.size, _crc32(head))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_all(f, data: memoryview) -> None:
    while len(data):
        n = f.write(data)
        data = data[n:]


def write_safetensors(
    path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None
) -> FileRecord:
    """Write ``tensors`` (contiguous CPU tensors, in this order) as one safetensors file.

    Streams from the tensors' memory in large blocks, fsyncs, and returns the file's record.
    """
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
    with SafetensorsWriter(path, entries, metadata) as out:
        for _, t in tensors:
            out.write_tensor(t)
        return out.finish()
