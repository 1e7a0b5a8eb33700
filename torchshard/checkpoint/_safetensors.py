"""Standard safetensors files: the format's shared parts, and a reader by byte range.

The format's parts shared by writer and reader (dtype codes, checksum chunks,
file records) and the reader: it parses and validates the JSON header (no
pickle, nothing executes), then reads only the requested byte ranges,
verifying the CRC of every chunk it touches. The writer
(``_safetensors_writer``) streams each tensor's bytes straight from its (CPU)
memory. Files are readable by ``safetensors.safe_open`` and transformers.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .._errors import CheckpointError

__all__ = ["DTYPES", "FileRecord", "SafetensorsReader", "TensorEntry", "bytes_of", "crc32"]

DTYPES = {  # safetensors' dtype codes
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
_FROM_NAME = {v: k for k, v in DTYPES.items()}

try:  # the same CRC-32, ~4x faster than zlib's: ISA-L, a dependency where it has a wheel
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32
_HEX = re.compile("[0-9a-f]+")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit
_READ_BLOCK = 64 * 2**20  # the most one read in place asks for


def crc32(data: memoryview | bytes, value: int = 0) -> int:
    """The CRC-32 of ``data``, continued from ``value`` (ISA-L's where installed).

    Example::

        crc32(b"abc")  # 0x352441c2
    """
    return _crc32(data, value)


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
    """CRC chunk size: about 4096 chunks per data section, between 4 KiB and 64 MiB.

    A reader verifies whole chunks, so it reads at most two chunks more than
    it needs per range: about 0.05% of a file. A fully sharded load reads a
    range per unit and tensor, so this is what it reads beyond its share.
    The header holds 8 hex digits per chunk (32 KiB at most).
    """
    return min(64 * 2**20, max(4096, 2 ** math.ceil(math.log2(max(nbytes, 1) / 4096))))


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


def _count(v: object) -> int:
    """A JSON non-negative integer (``int()`` would also take floats, bools and strings)."""
    if type(v) is not int or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


class SafetensorsReader:
    """Reads byte ranges of one safetensors file, verifying chunk CRCs when a record is given.

    ``bytes_read`` counts what came from the file (for I/O accounting).
    """

    def __init__(self, path: Path, record: FileRecord | None = None) -> None:
        self.path = Path(path)
        self.record = record
        self.bytes_read = 0
        self._cached: tuple[int, bytearray] | None = None
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
            self.chunk_bytes, self.crc32 = self._parse_checksums()
        except BaseException:
            self._f.close()
            raise

    def _error(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a valid safetensors file: {what}")

    def _parse_header(self) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
        if self.size < 8:
            raise self._error(f"{self.size} bytes, shorter than the 8-byte header length")
        first = bytearray(8)
        self._pread(0, memoryview(first))
        n = int.from_bytes(first, "little")
        if n > _MAX_HEADER or 8 + n > self.size:
            raise self._error(f"header length {n} does not fit in {self.size} bytes")
        raw = bytearray(n)
        self._pread(8, memoryview(raw))
        if self.record is not None and _crc32(raw, _crc32(first)) != self.record.header_crc32:
            raise CheckpointError(
                f"{self.path}: header checksum mismatch; the file is corrupt, restore it or "
                "load an earlier checkpoint"
            )
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise self._error(f"header is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._error("__metadata__ is not an object of strings")
        data_start, entries, end = 8 + n, {}, 0
        try:
            for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = _FROM_NAME[e["dtype"]]
                shape = tuple(_count(d) for d in e["shape"])
                begin, stop = (_count(x) for x in e["data_offsets"])
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

    def _parse_checksums(self) -> tuple[int, tuple[int, ...]]:
        """The data section's chunk size and CRC32s, from the header (when a record vouches for it)."""
        if self.record is None:
            return 0, ()
        chunk_text = self.metadata.get("torchshard.chunk_bytes")
        text = self.metadata.get("torchshard.crc32")
        digits = isinstance(chunk_text, str) and chunk_text.isascii() and chunk_text.isdigit()
        if not digits or not isinstance(text, str):
            raise self._error("no chunk checksums in its header")
        if text and not _is_hex(text):
            raise self._error("torchshard.crc32 holds something other than hex digits")
        chunk = int(chunk_text)
        crcs = tuple(int(text[i : i + 8], 16) for i in range(0, len(text), 8))
        data = self.size - self.data_start
        if chunk <= 0 or len(text) % 8 or len(crcs) != -(-data // chunk):
            raise self._error(f"{len(crcs)} checksums do not cover {data} bytes of data")
        return chunk, crcs

    def verify(self, progress: Callable[[int], None] | None = None) -> list[int]:
        """Read the whole data section; return the indices of chunks whose CRC32 is wrong."""
        bad = []
        for index in range(len(self.crc32)):
            try:
                self._chunk(index)
            except CheckpointError:
                bad.append(index)
            if progress is not None:
                progress(
                    min(self.chunk_bytes, self.size - self.data_start - index * self.chunk_bytes)
                )
        return bad

    def read_into(self, name: str, start: int, stop: int, dst: torch.Tensor) -> None:
        """Copy elements ``[start, stop)`` of tensor ``name`` (flattened) into CPU tensor ``dst``."""
        if dst.device.type != "cpu" or not dst.is_contiguous():
            # the bytes are written through dst's address: a device pointer would crash
            raise ValueError(
                f"read into contiguous host memory, then copy to the device; got a "
                f"{'contiguous' if dst.is_contiguous() else 'non-contiguous'} tensor on {dst.device}"
            )
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
        self._read_into(self.data_start + e.begin + start * item, bytes_of(dst))

    def read_bytes_into(self, name: str, start: int, stop: int, dst: torch.Tensor) -> None:
        """Copy bytes ``[start, stop)`` of tensor ``name``'s data into contiguous CPU bytes
        ``dst`` (``torch.uint8``): a piece of a buffer that holds tensors of several dtypes,
        which may cut an element.

        Example::

            reader.read_bytes_into("norm.weight", 0, 8, flat[64:72])  # 2 float32 values
        """
        if dst.device.type != "cpu" or not dst.is_contiguous() or dst.dtype != torch.uint8:
            raise ValueError(f"read into contiguous host bytes; got {dst.dtype} on {dst.device}")
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        if dst.numel() != stop - start or not 0 <= start <= stop <= e.end - e.begin:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ({e.end - e.begin} bytes) cannot fill bytes "
                f"[{start}, {stop}) of a buffer of {dst.numel()}"
            )
        self._read_into(self.data_start + e.begin + start, bytes_of(dst))

    def _read_into(self, offset: int, out: memoryview) -> None:
        """Read ``len(out)`` bytes at file ``offset`` into ``out``, verifying every chunk they
        touch. Whole chunks are read straight into ``out``, many per call, and checked there;
        only a chunk cut by either end goes through a buffer (the last one is kept: the next
        range usually starts in it)."""
        if self.record is None:
            self._pread(offset, out)
            return
        chunk, base = self.chunk_bytes, self.data_start
        pos, end = offset - base, offset - base + len(out)  # within the data section
        data_end = self.size - base
        while pos < end:
            index = pos // chunk
            first = index * chunk
            if pos == first and min(first + chunk, data_end) <= end:
                # whole chunks (the data's short last one too): read in place, up to
                # _READ_BLOCK at a time (at least one chunk)
                stop = min(end, pos + _READ_BLOCK)
                if stop != data_end:
                    stop -= stop % chunk
                view = out[pos - (offset - base) : stop - (offset - base)]
                self._pread(base + pos, view)
                for i in range(index, -(-stop // chunk)):
                    lo = (i - index) * chunk
                    self._check(i, view[lo : lo + chunk])
                pos = stop
                continue
            data = self._chunk(index)
            lo = pos - first
            take = min(end - pos, len(data) - lo)
            out[pos - (offset - base) : pos - (offset - base) + take] = data[lo : lo + take]
            pos += take

    def _check(self, index: int, data: memoryview | bytearray) -> None:
        if _crc32(data) != self.crc32[index]:
            start = self.data_start + index * self.chunk_bytes
            raise CheckpointError(
                f"{self.path}: checksum mismatch in bytes [{start}, {start + len(data)}); "
                "the file is corrupt, restore it or load an earlier checkpoint"
            )

    def _chunk(self, index: int) -> bytearray:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        chunk = self.chunk_bytes
        start = self.data_start + index * chunk
        buf = bytearray(min(chunk, self.size - start))
        self._pread(start, memoryview(buf))
        self._check(index, buf)
        self._cached = (index, buf)  # never written to after this
        return buf

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
