"""Offline checkpoint tools: inspect, consolidate into one safetensors file, reshard.

Pure file work on a committed checkpoint directory: no process group, no
pickle. Everything streams: tensors are read block by block from their
shards (every chunk verified against its checksum) and written straight
out, so memory stays about one block (``_BLOCK_BYTES``) whatever the size
of the model or of a shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError, TorchShardError
from .._layout import dtype_name
from .._reshard import element_ranges, overlap, weight_shards
from ._format import (
    FORMAT_VERSION,
    INDEX,
    METADATA,
    commit,
    complete_checkpoints,
    fsync_dir,
    index_json,
    model_file,
    optim_file,
    resolve,
    step_dir,
    tmp_dir,
)
from ._metadata import Metadata, OptimMeta, Readers, read_metadata
from ._safetensors import FileRecord, SafetensorsReader, SafetensorsWriter, _bytes_of

__all__ = [
    "ArgumentError",
    "CheckpointReport",
    "Consolidated",
    "FileStatus",
    "Progress",
    "consolidate",
    "inspect_checkpoint",
    "reshard",
]

_BLOCK_BYTES = 64 * 2**20  # what one read/write step holds in memory
_MAX_OPEN = 8  # readers open at once (each caches one checksum chunk, <= 64 MiB)


class ArgumentError(TorchShardError, ValueError):
    """A bad argument to a checkpoint tool: a missing path, a bad world size or output."""


class Progress:
    """Receives the progress of long work. This one ignores it; the CLI draws on stderr."""

    def start(self, what: str, total_bytes: int) -> None:
        """Work named ``what`` begins; about ``total_bytes`` will pass through."""

    def file(self, name: str) -> None:
        """Work on file ``name`` begins."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes are done."""

    def close(self) -> None:
        """The work is over (finished or failed)."""


# -- reading a checkpoint -----------------------------------------------------------------
def _existing(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise ArgumentError(f"{p}: no such file or directory")
    if not p.is_dir():
        raise ArgumentError(f"{p}: not a directory; expected a checkpoint directory or root")
    return p


def _open(path: str | os.PathLike[str]) -> tuple[Metadata, OptimMeta | None]:
    """The metadata of the checkpoint at ``path`` (or the latest under a root), checked."""
    meta = read_metadata(resolve(_existing(path)))
    return meta, meta.optim


class _Staging:
    """One reused host block that every read goes through."""

    def __init__(self) -> None:
        self._raw = torch.empty(0, dtype=torch.uint8)

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._raw.numel() < nbytes:
            self._raw = torch.empty(nbytes, dtype=torch.uint8)
        return self._raw[:nbytes].view(dtype)


def _block_elements(dtype: torch.dtype) -> int:
    return max(1, _BLOCK_BYTES // dtype.itemsize)


# -- writing safetensors tensor by tensor -------------------------------------------------
@dataclass(frozen=True)
class _Piece:
    """Elements ``[start, stop)`` of tensor ``name`` in checkpoint file ``file``."""

    file: str
    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class _OutTensor:
    """One tensor of an output file, and where its elements come from, in order."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[_Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _stream_file(
    path: Path,
    tensors: list[_OutTensor],
    metadata: dict[str, str] | None,
    readers: Readers,
    staging: _Staging,
    progress: Progress,
) -> FileRecord:
    """Write ``tensors`` to ``path``, reading each block from its pieces (checksums verified)."""
    with SafetensorsWriter(path, [(t.name, t.dtype, t.shape) for t in tensors], metadata) as out:
        for t in tensors:
            per = _block_elements(t.dtype)
            for piece in t.pieces:
                for a in range(piece.start, piece.stop, per):
                    b = min(piece.stop, a + per)
                    buf = staging.get(b - a, t.dtype)
                    readers[piece.file].read_into(piece.name, a, b, buf)
                    out.write(_bytes_of(buf))
                    progress.advance(buf.numel() * t.dtype.itemsize)
        return out.finish()


# -- inspect ----------------------------------------------------------------------------
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
    dtype: str
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
            "parameters": self.parameters,
            "param_numel": self.param_numel,
            "numel": self.numel,
            "tied": self.tied,
            "buffers": self.buffers,
            "optimizer": self.optimizer,
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
            (s.name, meta.layout.torch_dtype, s.shape) for s in meta.layout.slots[lo:hi]
        ]
    for name, file in meta.buffers.items():
        want[file].append((name, None, None))
    if opt is not None:
        for file, start, end in opt.files:
            want[file] += [(k, d, (end - start,)) for k, d in opt.flat_state.items()]
    return want


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
        problems.append(f"{path}: weight_map disagrees with {METADATA} for {wrong[:3]}; {fix}")
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
    given = _existing(path)
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
            "flat_state": {k: dtype_name(d) for k, d in opt.flat_state.items()},
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


# -- consolidate ------------------------------------------------------------------------
@dataclass(frozen=True)
class Consolidated:
    """What :func:`consolidate` wrote."""

    path: Path
    step: int
    tensors: int
    nbytes: int
    tied: dict[str, str]  # alias -> name it is stored under (empty when aliases were written)


def consolidate(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    aliases: bool = False,
    progress: Progress | None = None,
) -> Consolidated:
    """Export the checkpoint's weights: one safetensors file, or a transformers model directory.

    ``out`` ending in ``.safetensors``: one standard file with state-dict
    names. Each parameter is written once under its first name; a tied
    parameter's other names are left out (as transformers stores tied
    weights), so load with ``strict=False`` (the missing keys are exactly the
    aliases, filled through the shared ``Parameter``), or pass
    ``aliases=True`` to write a copy under every name. Module buffers are
    included.

    Any other ``out`` (a new or empty directory): ``config.json`` plus
    ``model.safetensors``, which ``AutoModelForCausalLM.from_pretrained(out)``
    loads. Needs the model's transformers config in the checkpoint: a save
    from a ``FlatParamModule`` that wraps a transformers model stores it.

    Streams block by block, verifying checksums; the file or directory
    appears (atomically) only when complete.

    Example::

        consolidate("runs/gpt", "gpt.safetensors")
        model.load_state_dict(safetensors.torch.load_file("gpt.safetensors"), strict=False)
        consolidate("runs/llama", "llama-hf")      # AutoModelForCausalLM.from_pretrained("llama-hf")
    """
    meta, _ = _open(path)
    out = Path(out)
    if out.suffix != ".safetensors":
        return _consolidate_dir(meta, out, aliases, progress or Progress())
    if out.is_dir():
        raise ArgumentError(f"{out}: is a directory; expected an output file name")
    if not out.parent.is_dir():
        raise ArgumentError(f"{out.parent}: no such directory for the output file")
    if out.parent.resolve() == meta.path.resolve():
        raise ArgumentError(
            f"{out}: would write into the checkpoint {meta.path}; choose another place"
        )
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        done = _consolidate_file(meta, tmp, aliases, progress or Progress(), out.name)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
    return Consolidated(out, *done)


def _consolidate_dir(meta: Metadata, out: Path, aliases: bool, progress: Progress) -> Consolidated:
    """``out/config.json`` + ``out/model.safetensors``, committed by renaming a temporary directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArgumentError(
            f"{out}: already exists and is not an empty directory; choose a new directory"
        )
    if meta.model_config is None:
        raise ArgumentError(
            f"{out}: exporting a transformers model directory needs the model's config, and "
            f"{meta.path} carries none (it was saved from a model that is not a transformers "
            "PreTrainedModel); write one file instead: give OUT a .safetensors name"
        )
    if not out.parent.is_dir():
        raise ArgumentError(f"{out.parent}: no such directory for the output directory")
    if meta.path.resolve() in (out.resolve(), *out.resolve().parents):
        raise ArgumentError(f"{out}: is inside the checkpoint {meta.path}; choose another place")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        done = _consolidate_file(meta, tmp / "model.safetensors", aliases, progress, out.name)
        config = tmp / "config.json"
        config.write_text(json.dumps(meta.model_config, indent=2, sort_keys=True) + "\n")
        with open(config, "rb") as f:
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return Consolidated(out, *done)


def _consolidate_file(
    meta: Metadata, dest: Path, aliases: bool, progress: Progress, label: str
) -> tuple[int, int, int, dict[str, str]]:
    """Stream every parameter (and buffer) into the safetensors file ``dest``."""
    layout, readers = meta.layout, Readers(meta)
    try:
        tensors = []
        for w in meta.weights:
            lo, hi = w["slots"]
            for s in layout.slots[lo:hi]:
                readers.entry(w["file"], s.name, layout.torch_dtype, s.shape)
                piece = (_Piece(w["file"], s.name, 0, s.numel),)
                for name in s.names if aliases else (s.name,):
                    tensors.append(_OutTensor(name, layout.torch_dtype, s.shape, piece))
        for name, file in meta.buffers.items():
            e = readers.entry(file, name, None, None)
            dtype, shape = e.dtype, e.shape
            tensors.append(
                _OutTensor(name, dtype, shape, (_Piece(file, name, 0, math.prod(shape)),))
            )
        progress.start(f"consolidate {meta.path.name}", sum(t.nbytes for t in tensors))
        progress.file(label)
        record = _stream_file(dest, tensors, None, readers, _Staging(), progress)
    finally:
        readers.close()
        progress.close()
    tied = {} if aliases else {a: s.name for s in layout for a in s.aliases}
    return meta.step, len(tensors), record.size, tied


# -- reshard ---------------------------------------------------------------------------
def reshard(
    path: str | os.PathLike[str],
    out_root: str | os.PathLike[str],
    world_size: int,
    *,
    progress: Progress | None = None,
) -> Path:
    """Rewrite the checkpoint at ``path`` as if saved at ``world_size``, as ``out_root/step-N``.

    Model files are re-split with :func:`weight_shards`, optimizer files with
    :func:`element_ranges`; everything else in ``metadata.json`` carries
    over. Streams block by block, verifying checksums, into
    ``out_root/.tmp-step-N``; ``metadata.json`` is written last and the
    rename commits. Returns the new checkpoint directory.

    Example::

        reshard("runs/gpt", "runs/gpt-8", 8)
        torchshard.checkpoint.load("runs/gpt-8", trainer, optimizer=opt)
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ArgumentError(f"world size: expected a positive integer, got {world_size!r}")
    meta, opt = _open(path)
    out_root = Path(out_root)
    if out_root.exists() and not out_root.is_dir():
        raise ArgumentError(f"{out_root}: not a directory; expected a checkpoint root")
    source = meta.path.resolve()
    if source == out_root.resolve() or source in out_root.resolve().parents:
        raise ArgumentError(f"{out_root}: inside the checkpoint {meta.path}; choose another root")
    final = step_dir(out_root, meta.step)
    if final.exists():
        raise ArgumentError(f"{final}: already exists; choose another output root or delete it")
    layout, world = meta.layout, world_size
    progress = progress or Progress()
    readers = Readers(meta)
    src_file = {i: w["file"] for w in meta.weights for i in range(*w["slots"])}
    shards = weight_shards(layout, world)
    align = layout.align_bytes // layout.torch_dtype.itemsize
    ranges = element_ranges(layout.numel, world, align)
    plan: list[tuple[str, list[_OutTensor], dict[str, str] | None]] = []
    try:
        buffers = []
        for name, file in meta.buffers.items():
            e = readers.entry(file, name, None, None)
            dtype, shape = e.dtype, e.shape
            buffers.append(
                _OutTensor(name, dtype, shape, (_Piece(file, name, 0, math.prod(shape)),))
            )
        for r in range(world):
            lo, hi = shards[r]
            tensors = [
                _OutTensor(
                    s.name, layout.torch_dtype, s.shape, (_Piece(src_file[i], s.name, 0, s.numel),)
                )
                for i, s in enumerate(layout.slots[lo:hi], start=lo)
            ]
            if r == 0:
                tensors += buffers
            if tensors:
                plan.append((model_file(r, world), tensors, None))
            start, end = ranges[r]
            if opt is not None and opt.flat_state and end > start:
                pieces = []
                for file, fs, fe in opt.files:
                    ov = overlap((fs, fe), (start, end))
                    if ov is not None:
                        pieces.append((file, ov[0] - fs, ov[1] - fs))
                state = [
                    _OutTensor(
                        key,
                        dtype,
                        (end - start,),
                        tuple(_Piece(f, key, a, b) for f, a, b in pieces),
                    )
                    for key, dtype in opt.flat_state.items()
                ]
                plan.append((optim_file(r, world), state, {"range": f"{start},{end}"}))
        progress.start(
            f"reshard {meta.path.name} to world size {world}",
            sum(t.nbytes for _, ts, _ in plan for t in ts),
        )
        tmp = tmp_dir(out_root, meta.step)
        out_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a reshard or save that crashed
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            records, staging = {}, _Staging()
            for name, tensors, file_meta in plan:
                progress.file(name)
                records[name] = _stream_file(
                    tmp / name, tensors, file_meta, readers, staging, progress
                )
            buffer_bytes = sum(t.nbytes for t in buffers)
            files = {k: v.to_dict() for k, v in records.items()}
            new_meta = _resharded_metadata(meta, world, shards, ranges)
            commit(tmp, final, new_meta, files, buffer_bytes)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        readers.close()
        progress.close()
    return final


def _resharded_metadata(
    meta: Metadata, world: int, shards: list[tuple[int, int]], ranges: list[tuple[int, int]]
) -> dict[str, Any]:
    """``metadata.json`` of the resharded checkpoint, without its ``files``."""
    raw = {k: v for k, v in meta.raw.items() if k != "files"}
    raw["format_version"] = FORMAT_VERSION
    raw["world_size"] = world
    shard_list = [
        {"file": model_file(r, world), "slots": [a, b]} for r, (a, b) in enumerate(shards) if b > a
    ]
    buffers = {n: model_file(0, world) for n in meta.buffers}
    raw["weights"] = {**raw["weights"], "shards": shard_list, "buffers": buffers}
    if meta.optim is not None:
        files = [
            {"file": optim_file(r, world), "range": [a, b]}
            for r, (a, b) in enumerate(ranges)
            if b > a and meta.optim.flat_state
        ]
        raw["optimizer"] = {**raw["optimizer"], "files": files}
    return raw
