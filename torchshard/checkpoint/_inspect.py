"""``inspect_checkpoint``: describe a committed checkpoint and verify every byte of it.

Offline file work like the other tools (no process group, no pickle): each
file is read whole, chunk by chunk, and every problem found is collected into
the report, naming its file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError, and_more
from .._flat.layout import dtype_name
from ._format import INDEX, METADATA, complete_checkpoints, index_json, resolve, saved_slots
from ._metadata import Metadata, OptimMeta, read_metadata
from ._safetensors import FileRecord, SafetensorsReader
from ._streams import stream_parts, streams_json
from ._tools import Progress, existing

__all__ = [
    "CheckpointReport",
    "FileStatus",
    "inspect_checkpoint",
    "latest_under",
    "newest_verified",
]


@dataclass(frozen=True)
class FileStatus:
    """One file of a checkpoint as found on disk."""

    name: str
    size: int  # recorded in metadata.json
    found: int | None  # bytes on disk; None when missing
    chunks: int
    tensors: int
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class CheckpointReport:
    """What :func:`inspect_checkpoint` found: the checkpoint's contents and its problems."""

    path: Path
    steps_under_root: list[int]  # complete checkpoints under the root given; [] for a directory
    step: int
    world_size: int
    format_version: int
    dtype: str  # the flat buffer's: "uint8" (bytes) when the parameters have several
    parameters: int  # unique parameters (slots)
    param_numel: int
    numel: int  # flat buffer, with alignment padding
    tied: dict[str, str]  # alias -> the name it is stored under
    buffers: dict[str, str]  # buffer -> file
    optimizer: dict[str, Any] | None
    extra: dict[str, Any]
    files: list[FileStatus] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    protected: bool = True  # metadata.json carries its SHA-256 (format 2 on), and it matched
    warnings: list[str] = field(default_factory=list)  # not errors: e.g. an unprotected format
    dtypes: list[str] = field(default_factory=list)  # the parameters' dtypes, in layout order
    param_bytes: int = 0  # the parameters' bytes, each in its own dtype
    comm: dict[str, Any] | None = None  # a lossy comm's state (format 5): class, sizes, steps

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of everything in the report."""
        return {
            "path": str(self.path),
            "steps_under_root": self.steps_under_root,
            "step": self.step,
            "world_size": self.world_size,
            "format_version": self.format_version,
            "dtype": self.dtype,
            "dtypes": self.dtypes,
            "parameters": self.parameters,
            "param_numel": self.param_numel,
            "param_bytes": self.param_bytes,
            "numel": self.numel,
            "tied": self.tied,
            "buffers": self.buffers,
            "optimizer": self.optimizer,
            "comm": self.comm,
            "extra": self.extra,
            "files": [
                {
                    "name": f.name,
                    "size": f.size,
                    "found": f.found,
                    "chunks": f.chunks,
                    "tensors": f.tensors,
                    "problems": list(f.problems),
                }
                for f in self.files
            ],
            "ok": self.ok,
            "problems": self.problems,
            "protected": self.protected,
            "warnings": self.warnings,
        }


def _expected_tensors(
    meta: Metadata, opt: OptimMeta | None
) -> dict[str, list[tuple[str, torch.dtype | None, tuple[int, ...] | None]]]:
    """For each file, the tensors it must hold (``None``: any dtype/shape)."""
    want: dict[str, list[tuple[str, torch.dtype | None, tuple[int, ...] | None]]] = {
        f: [] for f in meta.files
    }
    for w in meta.weights:
        lo, hi = w["slots"]
        want[w["file"]] += [
            (s.name, s.torch_dtype, s.shape) for s in saved_slots(meta.layout, lo, hi, meta.raw)
        ]
    for name, file in meta.buffers.items():
        want[file].append((name, None, None))
    if opt is not None:
        for file, start, end in opt.files:
            for s in opt.streams:  # those with elements in its range (several dtypes: not all)
                parts = stream_parts(meta.layout, start, end, opt.trainable_only, s.param)
                n = sum((b - a) // s.width for a, b, _ in parts)
                want[file] += [(s.name, s.dtype, (n,))] if n else []
    for file, ranges in meta.comm.files if meta.comm is not None else []:
        for name, (a, b) in ranges.items():
            want[file].append((name, meta.comm.flat[name][0], (b - a,)))
    return want


def _comm_summary(meta: Metadata) -> dict[str, Any]:
    """The compression state of ``meta``: the comm, its integers and each tensor's size."""
    assert meta.comm is not None
    flat = {n: {"dtype": dtype_name(d), "numel": k} for n, (d, k) in meta.comm.flat.items()}
    return {"comm": str(meta.comm), "scalars": meta.comm.scalars, "flat": flat}


def _verify_file(
    path: Path,
    record: FileRecord,
    expected: list[tuple[str, torch.dtype | None, tuple[int, ...] | None]],
    progress: Progress,
    nbytes: dict[str, int],
) -> FileStatus:
    """Size, the header's and every data chunk's CRC32, and the tensors the metadata expects
    (their sizes in bytes go into ``nbytes``)."""
    try:
        found: int | None = path.stat().st_size
    except FileNotFoundError:
        found = None
    problems: list[str] = []
    chunks = tensors = 0
    try:
        with SafetensorsReader(path, record) as reader:  # checks size and header checksum
            chunks, tensors = len(reader.crc32), len(reader.entries)
            progress.advance(reader.data_start)
            bad = reader.verify(progress.advance)
            if bad:
                a = reader.data_start + bad[0] * reader.chunk_bytes
                b = min(a + reader.chunk_bytes, reader.size)
                problems.append(
                    f"{path}: checksum mismatch in {len(bad)} of {chunks} chunks (first: bytes "
                    f"[{a}, {b})); the file is corrupt"
                )
            for name, dtype, shape in expected:
                e = reader.entries.get(name)
                if e is not None:
                    nbytes[name] = e.end - e.begin
                if e is None:
                    problems.append(f"{path}: has no tensor {name!r}")
                elif (dtype is not None and e.dtype != dtype) or shape not in (None, e.shape):
                    problems.append(
                        f"{path}: tensor {name!r}: expected {dtype_name(dtype or e.dtype)} "
                        f"{list(shape or e.shape)}, found {dtype_name(e.dtype)} {list(e.shape)}"
                    )
    except CheckpointError as e:
        progress.advance(record.size)
        problems.append(f"{path}: missing" if found is None else str(e))
    return FileStatus(path.name, record.size, found, chunks, tensors, tuple(problems))


def _index_problems(meta: Metadata, nbytes: dict[str, int]) -> list[str]:
    """``model.safetensors.index.json`` (what transformers reads) against ``metadata.json``:
    the size and SHA-256 recorded there (format 2 on), then every entry."""
    path = meta.path / INDEX
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [f"{path}: missing"]
    except OSError as e:
        return [f"{path}: cannot read ({e.strerror or e})"]
    fix = "restore it from a copy or load an earlier checkpoint"
    if meta.index is not None:
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != meta.index["size"] or digest != meta.index["sha256"]:
            return [
                f"{path}: expected {meta.index['size']} bytes with sha256 "
                f"{meta.index['sha256']} as {METADATA} records, found {len(data)} bytes with "
                f"sha256 {digest}; the file is corrupt, {fix}"
            ]
    try:
        index = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return [f"{path}: not valid JSON ({e}); {fix}"]
    buffer_bytes = sum(nbytes.get(name, 0) for name in meta.buffers)
    want = index_json(meta.raw, buffer_bytes)
    if not isinstance(index, dict) or index.keys() != want.keys():
        keys = sorted(index) if isinstance(index, dict) else type(index).__name__
        return [f"{path}: expected the keys ['metadata', 'weight_map'], got {keys}; {fix}"]
    problems = []
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or weight_map != want["weight_map"]:
        have = weight_map if isinstance(weight_map, dict) else {}
        wrong = sorted(
            k
            for k in want["weight_map"].keys() | set(have)
            if want["weight_map"].get(k) != have.get(k)
        )
        problems.append(
            f"{path}: weight_map disagrees with {METADATA} for {and_more(wrong)}; {fix}"
        )
    known = all(name in nbytes for name in meta.buffers)  # else a file's problem says why
    if index["metadata"] != want["metadata"] and known:
        problems.append(
            f"{path}: metadata: expected {json.dumps(want['metadata'])} as {METADATA} and the "
            f"files imply, got {json.dumps(index['metadata'])}; {fix}"
        )
    return problems


def inspect_checkpoint(
    path: str | os.PathLike[str], *, progress: Progress | None = None
) -> CheckpointReport:
    """Describe the checkpoint at ``path`` (or the latest under a root) and verify every byte.

    Verifies ``metadata.json`` (its SHA-256, then every value), then reads
    every file whole, chunk by chunk, checking its size, every chunk's CRC32,
    its header and the tensors ``metadata.json`` places in it, and checks
    ``model.safetensors.index.json`` against ``metadata.json``. Problems are
    collected in ``report.problems``, each naming its file; a ``metadata.json``
    that fails its checksum or holds a bad value, or a root without a complete
    checkpoint, raises :class:`CheckpointError`, a missing path
    :class:`ArgumentError`. A checkpoint of format 1 (no checksum) is reported
    with ``report.protected`` false and a warning.

    Example::

        report = inspect_checkpoint("runs/gpt")
        assert report.ok, report.problems
    """
    given = existing(path)
    ckpt = resolve(given)
    meta = read_metadata(ckpt)  # its checksum and every value, or CheckpointError
    steps = [s for s, _ in complete_checkpoints(given)] if ckpt != given else []
    opt = meta.optim  # read_metadata has checked its structure
    problems: list[str] = []
    layout = meta.layout
    optimizer = None
    if opt is not None:
        optimizer = {
            "class": opt.cls,
            "flat_state": streams_json(opt.streams, layout),
            "scalar_state": {k: v.get("dtype") for k, v in opt.scalar_state.items()},
            "stateful": opt.stateful.count("1"),
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": len(g["params"])}
                for g in opt.param_groups
            ],
        }
    report = CheckpointReport(
        path=ckpt,
        steps_under_root=steps,
        step=meta.step,
        world_size=meta.world_size,
        format_version=int(meta.raw["format_version"]),
        dtype=layout.dtype,
        parameters=len(layout),
        param_numel=layout.param_numel,
        numel=layout.numel,
        tied={a: s.name for s in layout for a in s.aliases},
        buffers=dict(meta.buffers),
        optimizer=optimizer,
        extra=meta.extra,
        protected=meta.protected,
        dtypes=[dtype_name(d) for d in layout.dtypes],
        param_bytes=sum(s.numel * s.torch_dtype.itemsize for s in layout),
        comm=None if meta.comm is None else _comm_summary(meta),
    )
    if not meta.protected:
        report.warnings.append(
            f"{meta.path / METADATA}: format {report.format_version} carries no checksum, so "
            "damage to its values cannot be detected (they were checked for type and range "
            "only); `torchshard reshard` writes a protected copy"
        )
    expected = _expected_tensors(meta, opt)
    nbytes: dict[str, int] = {}
    progress = progress or Progress()
    progress.start(f"verify {ckpt.name}", sum(r.size for r in meta.files.values()))
    try:
        for name, record in meta.files.items():
            progress.file(name)
            status = _verify_file(meta.file_path(name), record, expected[name], progress, nbytes)
            report.files.append(status)
            problems += status.problems
    finally:
        progress.close()
    report.problems = problems + _index_problems(meta, nbytes)
    return report


def latest_under(path: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """``(step, path)`` of the latest complete checkpoint under the root ``path``; ``None``
    when ``path`` is a checkpoint directory itself, or no directory, or holds none."""
    p = Path(path)
    if (p / METADATA).is_file() or not p.is_dir():
        return None
    found = complete_checkpoints(p)
    return found[-1] if found else None


def newest_verified(
    root: str | os.PathLike[str], below: int, *, progress: Progress | None = None
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint under ``root`` before step ``below`` that verifies (as
    :func:`inspect_checkpoint` verifies it: every byte), or ``None``; and ``(path, first
    problem)`` of each newer one before it that does not, newest first.

    Example::

        step, latest = latest_under("runs/gpt")
        good, bad = newest_verified("runs/gpt", below=step)
    """
    bad: list[tuple[Path, str]] = []
    for step, path in reversed(complete_checkpoints(Path(root))):
        if step >= below:
            continue
        try:
            report = inspect_checkpoint(path, progress=progress)
        except CheckpointError as e:
            bad.append((path, str(e)))
            continue
        if report.ok:
            return path, bad
        bad.append((path, report.problems[0]))
    return None, bad
