"""Sharded checkpoints: per-rank safetensors shards, written in the background, committed atomically.

An async save stages this rank's share (its run of whole parameters, its flat
range of optimizer state; which ones is ``_plan``'s arithmetic) into host
memory that is reused across saves, then a background thread writes and
fsyncs the files into ``ROOT/.tmp-step-N``; a blocking save on CPU writes
straight from the live tensors instead. The background thread never runs a
collective: the ranks meet through the process group's store
(``_rendezvous``), in four steps:

1. prepare: rank 0 creates ``ROOT/.tmp-step-N``; the others wait for it.
2. write: every rank writes and fsyncs its files and reports their records.
3. commit: rank 0 waits for every rank's records, writes ``metadata.json``
   last and renames the directory to ``ROOT/step-N``: the rename is the commit.
4. the other ranks wait for the commit.

A rank that fails tells the others under the key they wait on.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._errors import CheckpointError
from .._flat.hf import transformers_config
from .._log import get_logger
from ._format import (
    build_metadata,
    commit,
    model_file,
    optim_file,
    prepare,
    rotate,
    step_dir,
    tmp_dir,
)
from ._optim import OptimizerView
from ._plan import Piece, SharePlan, plan_share
from ._rendezvous import Rendezvous
from ._safetensors import FileRecord, SafetensorsWriter, write_safetensors
from ._target import Checkpointable, Target

__all__ = ["CheckpointFuture", "Writer", "async_save", "save"]

logger = get_logger(__name__)


class CheckpointFuture:
    """A save in flight. ``wait()`` returns the committed directory or raises :class:`CheckpointError`."""

    def __init__(self, future: concurrent.futures.Future[Path]) -> None:
        self._future = future
        self.observed = False

    def wait(self, timeout: float | None = None) -> Path:
        """Block until this rank's part is durable and the checkpoint is committed."""
        try:
            result = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise
        except CheckpointError:
            self.observed = True
            raise
        except BaseException as e:
            self.observed = True
            raise _as_checkpoint_error(e) from e
        self.observed = True
        return result

    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        """The error of a finished save (``None`` if it succeeded); blocks until it finishes."""
        self.observed = True
        return self._future.exception()


_Copy = tuple[torch.Tensor, torch.Tensor | None]  # (host destination, source); None: zeros


@dataclass
class _Share:
    """This rank's part of one save, staged in host memory (or the live tensors themselves)."""

    path: Path
    step: int
    plan: SharePlan
    weights: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # per state key: its dtype and its pieces in order (a tensor, or a count of zeros)
    optim: list[tuple[str, torch.dtype, list[torch.Tensor | int]]] = field(default_factory=list)
    metadata: dict[str, Any] | None = None  # rank 0 only, without "files"
    buffer_bytes: int = 0
    cuda_done: torch.cuda.Event | None = None  # staged on a side stream: when that is done


class Writer:
    """Host staging memory reused across saves, one background thread, one save in flight."""

    def __init__(self, timeout: float, heartbeat_timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchshard-ckpt")
        self._staging: dict[str, torch.Tensor] = {}
        self._inflight: CheckpointFuture | None = None
        self._staged = threading.Event()
        self._staged.set()
        self._fenced: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    # -- staging ------------------------------------------------------------------------
    def buffer(
        self, key: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A host tensor for ``key``, grown on demand, never shrunk: memory stays bounded."""
        nbytes = numel * dtype.itemsize
        raw = self._staging.get(key)
        if raw is None or raw.numel() < nbytes:
            pin = device.type == "cuda"
            raw = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self._staging[key] = raw
        return raw[:nbytes].view(dtype)

    def fence(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait until a background staging copy is complete."""
        if optimizer in self._fenced:
            return
        staged = self._staged

        def wait_for_staging(*_: Any) -> None:
            staged.wait()

        optimizer.register_step_pre_hook(wait_for_staging)
        self._fenced.add(optimizer)

    # -- one save ----------------------------------------------------------------------------
    def save(
        self,
        root: Path,
        obj: Checkpointable,
        step: int,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any] | None,
        keep_last: int | None,
        blocking: bool = False,
    ) -> CheckpointFuture:
        previous = self._inflight
        if previous is not None:
            seen = previous.observed
            try:
                previous.wait()
            except CheckpointError as e:
                if not seen:  # an error nobody has seen yet must not pass silently
                    raise CheckpointError(f"the previous checkpoint save failed: {e}") from e
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step: expected a non-negative integer, got {step!r}")
        try:
            extra_json = json.loads(json.dumps(extra or {}, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"extra: expected a dict of JSON values ({e}); NaN and infinity are not JSON: "
                "store None or a string instead"
            ) from e
        target = Target(obj)
        seq = target.coord.next_sequence() if target.coord is not None else 0
        root = Path(root)
        cuda = target.device.type == "cuda"
        # A save the caller waits for writes host tensors straight from where they live.
        staged = cuda or not blocking
        buffer = self.buffer if staged else None
        share, copies = _collect(target, root, step, optimizer, extra_json, buffer)
        background: list[_Copy] | None = None
        if cuda:
            # enqueued on a side stream; the optimizer's stream waits for it
            share.cuda_done = _stage(copies, target.device)
        elif staged and optimizer is not None:
            self._staged.clear()  # staged in the background; optimizer.step() waits
            self.fence(optimizer)
            background = copies
        elif staged:
            _stage(copies, target.device)  # nothing tells us when the weights change: copy now
        future = self._pool.submit(self._write, target, share, root, seq, keep_last, background)
        result = CheckpointFuture(future)
        self._inflight = result
        return result

    def _write(
        self,
        t: Target,
        share: _Share,
        root: Path,
        seq: int,
        keep_last: int | None,
        background: list[_Copy] | None,
    ) -> Path:
        """The background thread's part of a save: the four steps of the module docstring."""
        tmp = tmp_dir(root, share.step)
        meet = Rendezvous(t, seq, share.path, share.step, self.timeout, self.heartbeat_timeout)
        try:
            if background is not None:
                try:
                    _stage(background, t.device)
                finally:
                    self._staged.set()
            if share.cuda_done is not None:
                share.cuda_done.synchronize()
            if t.rank == 0:  # 1. prepare
                prepare(root, tmp, share.path)
                meet.prepared(tmp)
            else:
                meet.wait_prepared()
                if not tmp.is_dir():  # another directory, or one rank 0 cannot see
                    raise CheckpointError(
                        f"rank {t.rank}: {tmp.absolute()}: missing, though rank 0 created "
                        f"{meet.their_dir()}; every rank must save to the same directory, on a "
                        "filesystem all ranks share"
                    )
            records = _write_files(t, share, tmp)  # 2. write
            meet.wrote(records)
        except BaseException as e:
            meet.failed(f"rank {t.rank}: {e}")
            if t.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _as_checkpoint_error(e) from e

        if t.rank != 0:  # 4. wait for the commit
            meet.wait_committed()
            return share.path
        try:  # 3. commit
            files = dict(records)
            for r in range(1, t.world):
                files.update(meet.files_of(r))
            assert share.metadata is not None
            commit(tmp, share.path, share.metadata, files, share.buffer_bytes)
            if keep_last is not None:
                rotate(root, keep_last, keep=share.path)
        except BaseException as e:
            meet.commit_failed(f"rank 0: {e}")
            shutil.rmtree(tmp, ignore_errors=True)
            raise _as_checkpoint_error(e) from e
        meet.committed()
        logger.info("checkpoint committed: %s", share.path)
        return share.path

    def settle(self) -> None:
        """Wait until no save is in flight (its error, if any, is left for wait() or the next save)."""
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight._future])

    def close(self) -> None:
        """Wait for the save in flight; raise its error unless someone has seen it already."""
        try:
            inflight, self._inflight = self._inflight, None
            if inflight is not None and not inflight.observed:
                inflight.wait()
            elif inflight is not None:
                concurrent.futures.wait([inflight._future])
        finally:
            self._pool.shutdown(wait=True)
            self._staging.clear()


def _collect(
    t: Target,
    root: Path,
    step: int,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    buffer: Callable[[str, int, torch.dtype, torch.device], torch.Tensor] | None,
) -> tuple[_Share, list[_Copy]]:
    """This rank's share, as ``_plan`` places it, and the copies that stage it into the
    host memory that ``buffer`` hands out (``None``: the files are written straight from
    the live tensors, for a save the caller waits for)."""
    layout, fm = t.fm.layout, t.fm
    flat = fm.flat_param
    assert flat is not None
    view = OptimizerView.of(optimizer, t) if optimizer is not None else None
    scalars = view.agree(t) if view is not None else ({}, "")  # a collective when sharded
    segments = None
    if view is not None and view.flat_keys:
        segments = [(seg.start, seg.end) for seg in view.segments]
    share = _Share(step_dir(root, step), step, plan_share(layout, t.world, t.rank, segments))
    copies: list[_Copy] = []
    (lo, hi), (base, end) = share.plan.slots, share.plan.span
    if hi > lo:
        host = flat[base:end]
        if buffer is not None:
            host = buffer("weights", end - base, fm.dtype, t.device)
            copies.append((host, flat[base:end]))
        for s in layout.slots[lo:hi]:
            share.weights.append((s.name, host[s.offset - base : s.end - base].view(s.shape)))
    buffers = t.buffers() if t.rank == 0 else {}
    for name, b in buffers.items():
        host = b.detach().contiguous()
        if buffer is not None:
            host = buffer(f"buffer:{name}", b.numel(), b.dtype, t.device).view(b.shape)
            copies.append((host, b.detach()))
        share.weights.append((name, host))
        share.buffer_bytes += b.numel() * b.element_size()
    if segments is not None:
        assert view is not None
        s0, e0 = share.plan.state_range
        for key, dtype in view.flat_keys.items():
            parts = [(p, _part(view, p, key)) for p in share.plan.pieces]
            if buffer is not None:
                host = buffer(f"optim:{key}", e0 - s0, dtype, t.device)
                copies += [(host[p.start - s0 : p.end - s0], part) for p, part in parts]
                share.optim.append((key, dtype, [host]))
            else:
                direct = [p.end - p.start if part is None else part for p, part in parts]
                share.optim.append((key, dtype, direct))
    if t.rank == 0:
        optim_meta = view.metadata(scalars) if view is not None else None
        config = transformers_config(t.fm.module, layout.torch_dtype)
        share.metadata = build_metadata(
            layout, t.world, step, list(buffers), optim_meta, extra, config
        )
    return share, copies


def _part(view: OptimizerView, piece: Piece, key: str) -> torch.Tensor | None:
    """Piece ``piece`` of the flat state ``key``; ``None`` where it is zeros."""
    if piece.segment is None:
        return None
    seg = view.segments[piece.segment]
    src = view.source(seg, key)
    return None if src is None else src[piece.start - seg.start : piece.end - seg.start]


def _stage(copies: list[_Copy], device: torch.device) -> torch.cuda.Event | None:
    """Run the staging copies: on CUDA, enqueued on a side stream that the current stream
    waits for (returns the event that marks them done); elsewhere, at once."""
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for dst, src in copies:
                dst.zero_() if src is None else dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
        torch.cuda.current_stream(device).wait_event(done)  # updates wait on the GPU
        return done
    with torch.no_grad():
        for dst, src in copies:
            dst.zero_() if src is None else dst.copy_(src)
    return None


def _as_checkpoint_error(e: BaseException) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, dist.DistNetworkError):
        return CheckpointError(
            f"checkpoint save failed: the process group's store is unreachable ({e}): the "
            "process hosting it (global rank 0, unless torchrun's agent hosts it) has most "
            "likely died; earlier checkpoints are untouched"
        )
    if isinstance(e, OSError):
        where = f" {e.filename}:" if e.filename else ""
        return CheckpointError(
            f"writing the checkpoint failed:{where} {e.strerror or e}; earlier checkpoints are untouched"
        )
    return CheckpointError(f"writing the checkpoint failed: {type(e).__name__}: {e}")


def _write_files(t: Target, share: _Share, tmp: Path) -> dict[str, dict[str, Any]]:
    records: dict[str, FileRecord] = {}
    if share.weights:
        name = model_file(t.rank, t.world)
        records[name] = write_safetensors(tmp / name, share.weights)
    s, e = share.plan.state_range
    if share.optim and e > s:
        name = optim_file(t.rank, t.world)
        entries = [(key, dtype, (e - s,)) for key, dtype, _ in share.optim]
        with SafetensorsWriter(tmp / name, entries, {"range": f"{s},{e}"}) as out:
            for _, dtype, pieces in share.optim:
                for piece in pieces:
                    if isinstance(piece, int):
                        out.write_zeros(piece * dtype.itemsize)
                    else:
                        out.write_tensor(piece)
            records[name] = out.finish()
    return {k: v.to_dict() for k, v in records.items()}


# -- public API -----------------------------------------------------------------------------------
_default_writer: Writer | None = None


def _writer() -> Writer:
    global _default_writer
    if _default_writer is None:
        _default_writer = Writer(timeout=600.0)
    return _default_writer


def async_save(
    root: str | os.PathLike[str],
    trainer: Checkpointable,
    *,
    step: int,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> CheckpointFuture:
    """Start saving a checkpoint of ``trainer`` (and ``optimizer``) as ``root/step-N``; return at once.

    Every rank calls it at the same step. This rank's share is copied into
    reused host memory (in the background when ``optimizer`` is given:
    ``optimizer.step()`` waits for that copy; without it, before returning),
    then written, fsynced and committed by a background thread. One save is
    in flight at a time: the next call waits for this one, and raises if it
    failed unobserved.

    Example::

        future = torchshard.checkpoint.async_save("ckpt", trainer, step=step, optimizer=opt)
        ...                       # keep training
        future.wait()             # the checkpoint is committed
    """
    return _writer().save(Path(root), trainer, step, optimizer, extra, keep_last=None)


def save(
    root: str | os.PathLike[str],
    trainer: Checkpointable,
    *,
    step: int,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save a checkpoint and wait until it is committed; returns its directory.

    On CPU the files are written straight from the live tensors: no staging
    copy, no host memory kept afterwards.

    Example::

        path = torchshard.checkpoint.save("ckpt", trainer, step=100, optimizer=opt)
    """
    return _writer().save(Path(root), trainer, step, optimizer, extra, None, blocking=True).wait()
