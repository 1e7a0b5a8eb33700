"""Offline checkpoint tools: consolidate into one safetensors file, reshard; the progress
protocol and the path check that they and ``inspect_checkpoint`` (``_inspect``) share.

Pure file work on a committed checkpoint directory: no process group, no
pickle. Everything streams: tensors are read block by block from their
shards (every chunk verified against its checksum) and written straight
out, so memory stays about one block (``_BLOCK_BYTES``) whatever the size
of the model or of a shard.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import ArgumentError, CheckpointError
from .._flat.layout import FlatLayout
from ._comm_meta import CommMeta, comm_ranges
from ._format import (
    COMM_VERSION,
    DENSE_VERSION,
    MIXED_VERSION,
    SPARSE_VERSION,
    comm_file,
    commit,
    fsync_dir,
    holds_frozen,
    model_file,
    optim_file,
    resolve,
    saved_slots,
    step_dir,
    tmp_dir,
)
from ._metadata import Metadata, OptimMeta, Readers, read_metadata
from ._plan import overlap, state_ranges, weight_runs
from ._safetensors import FileRecord, bytes_of
from ._safetensors_writer import SafetensorsWriter
from ._streams import Stream, stream_parts

__all__ = ["Consolidated", "Progress", "consolidate", "existing", "reshard"]

_BLOCK_BYTES = 64 * 2**20  # what one read/write step holds in memory


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
def existing(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is a directory; else :class:`ArgumentError` saying what it is."""
    p = Path(path)
    if not p.exists():
        raise ArgumentError(f"{p}: no such file or directory")
    if not p.is_dir():
        raise ArgumentError(f"{p}: not a directory; expected a checkpoint directory or root")
    return p


def _open(path: str | os.PathLike[str]) -> tuple[Metadata, OptimMeta | None]:
    """The metadata of the checkpoint at ``path`` (or the latest under a root), checked."""
    meta = read_metadata(resolve(existing(path)))
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
                    out.write(bytes_of(buf))
                    progress.advance(buf.numel() * t.dtype.itemsize)
        return out.finish()


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
    if not holds_frozen(meta.raw):
        raise CheckpointError(
            f"{meta.path}: saved with frozen=False, it holds no frozen weights (the adapters "
            "of a LoRA run, without their base); consolidate a checkpoint saved with them"
        )
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
                readers.entry(w["file"], s.name, s.torch_dtype, s.shape)
                piece = (_Piece(w["file"], s.name, 0, s.numel),)
                for name in s.names if aliases else (s.name,):
                    tensors.append(_OutTensor(name, s.torch_dtype, s.shape, piece))
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
    the geometry's state ranges, a lossy comm's state (the comm files) in equal
    ranges; everything else in ``metadata.json`` carries over. Streams block by block, verifying checksums, into
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
    saved = {s.name for s in saved_slots(layout, 0, len(layout), meta.raw)}
    shards = weight_runs(layout, world)
    ranges = state_ranges(layout, world)
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
                    s.name, s.torch_dtype, s.shape, (_Piece(src_file[i], s.name, 0, s.numel),)
                )
                for i, s in enumerate(layout.slots[lo:hi], start=lo)
                if s.name in saved  # frozen=False: the trainable ones only
            ]
            if r == 0:
                tensors += buffers
            if tensors or hi > lo:  # (frozen=False: a run of frozen weights alone is empty)
                plan.append((model_file(r, world), tensors, None))
            start, end = ranges[r]
            if opt is not None and opt.streams and end > start:
                state = [_resharded_stream(layout, opt, s, start, end) for s in opt.streams]
                state = [x for x in state if x.shape[0]]  # none of its dtype here: no tensor
                plan.append((optim_file(r, world), state, {"range": f"{start},{end}"}))
            comm = _resharded_comm(meta.comm, r, world) if meta.comm is not None else []
            if comm:
                plan.append((comm_file(r, world), comm, None))
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


def _resharded_stream(
    layout: FlatLayout, opt: OptimMeta, stream: Stream, start: int, end: int
) -> _OutTensor:
    """What a new optimizer file of flat range ``[start, end)`` stores of ``stream`` (its
    parts trainable_only as the old files'), from what the old files store of it."""
    out = stream_parts(layout, start, end, opt.trainable_only, stream.param)
    pieces, w = [], stream.width
    for file, fs, fe in opt.files:
        for ps, pe, pos in stream_parts(layout, fs, fe, opt.trainable_only, stream.param):
            for a0, b0, _ in out:
                ov = overlap((ps, pe), (a0, b0))
                if ov is not None:
                    a, b = pos + (ov[0] - ps) // w, pos + (ov[1] - ps) // w
                    pieces.append((ov[0], _Piece(file, stream.name, a, b)))
    pieces.sort(key=lambda x: x[0])
    n = sum((b - a) // w for a, b, _ in out)
    return _OutTensor(stream.name, stream.dtype, (n,), tuple(piece for _, piece in pieces))


def _resharded_comm(comm: CommMeta, rank: int, world: int) -> list[_OutTensor]:
    """What a new comm file of rank ``rank`` of ``world`` holds: its :func:`comm_ranges` of
    each flat tensor of the compression state, from the old files' ranges."""
    out = []
    for name, (dtype, numel) in comm.flat.items():
        a, b = comm_ranges(numel, world)[rank]
        if b > a:
            pieces = tuple(_Piece(f, name, x, y) for f, x, y, _ in comm.pieces(name, a, b))
            out.append(_OutTensor(name, dtype, (b - a,), pieces))
    return out


def _resharded_metadata(
    meta: Metadata, world: int, shards: list[tuple[int, int]], ranges: list[tuple[int, int]]
) -> dict[str, Any]:
    """``metadata.json`` of the resharded checkpoint, without its ``files``."""
    raw = {k: v for k, v in meta.raw.items() if k != "files"}
    # version 3 when the optimizer files store the trainable runs alone or the model files
    # leave the frozen weights out (as the save wrote it)
    sparse = meta.optim is not None and meta.optim.trainable_only
    sparse = sparse or not holds_frozen(meta.raw)
    version = SPARSE_VERSION if sparse else DENSE_VERSION
    raw["format_version"] = MIXED_VERSION if meta.layout.mixed else version
    if meta.comm is not None:  # the compression state, re-split as the optimizer's
        raw["format_version"], raw["comm"] = COMM_VERSION, meta.comm.to_json(world)
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
            if b > a and meta.optim.streams
        ]
        raw["optimizer"] = {**raw["optimizer"], "files": files}
    return raw
