"""Sharded checkpoints: per-rank safetensors shards, written in the background, committed atomically.

An async save stages this rank's share (its run of whole parameters, its flat
range of optimizer state) into host memory that is reused across saves, then a
background thread writes and fsyncs the files into ``ROOT/.tmp-step-N``; a
blocking save on CPU writes straight from the live tensors instead.
Rank 0 waits until every rank's files are durable (through the process
group's store, never a collective from the background thread), writes
``metadata.json`` last, and renames the directory to ``ROOT/step-N``: the
rename is the commit.
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

from .._dist import RankLostError, exchange_bytes
from .._errors import CheckpointError
from .._flat_module import FlatParamModule
from .._hf import transformers_config
from .._layout import dtype_from_name, dtype_name
from .._log import get_logger
from .._reshard import element_ranges, weight_shards
from .._trainer import DistributedTrainer
from ._format import (
    build_metadata,
    commit,
    complete_checkpoints,
    model_file,
    optim_file,
    step_dir,
    tmp_dir,
)
from ._load import load
from ._optim import OptimizerView, merge_scalars
from ._safetensors import FileRecord, SafetensorsWriter, write_safetensors
from ._target import CheckpointInfo, Target

__all__ = ["CheckpointFuture", "CheckpointInfo", "Checkpointer", "async_save", "load", "save"]

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


@dataclass
class _Share:
    """This rank's part of one save, staged in host memory."""

    path: Path
    step: int
    weights: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # per state key: its dtype and its pieces in order (a tensor, or a count of zeros)
    optim: list[tuple[str, torch.dtype, list[torch.Tensor | int]]] = field(default_factory=list)
    optim_range: tuple[int, int] = (0, 0)
    metadata: dict[str, Any] | None = None  # rank 0 only, without "files"
    buffer_bytes: int = 0


class _Writer:
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
        obj: DistributedTrainer | FlatParamModule,
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
        share, stage = self._plan(target, root, step, optimizer, extra_json, staged)
        background_stage = None
        if cuda:
            stage()  # enqueued on a side stream; the optimizer's stream waits for it
        elif staged and optimizer is not None:
            self._staged.clear()  # staged in the background; optimizer.step() waits
            self.fence(optimizer)
            background_stage = stage
        elif staged:
            stage()  # nothing tells us when the weights change: copy now
        future = self._pool.submit(
            self._write, target, share, root, seq, keep_last, background_stage
        )
        result = CheckpointFuture(future)
        self._inflight = result
        return result

    def _plan(
        self,
        t: Target,
        root: Path,
        step: int,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        staged: bool,
    ) -> tuple[_Share, Callable[[], None]]:
        """This rank's files and the copies that stage them (``staged=False``: the files
        are written straight from the live tensors, for a save the caller waits for)."""
        layout, fm = t.fm.layout, t.fm
        flat = fm.flat_param
        assert flat is not None
        share = _Share(path=step_dir(root, step), step=step)
        shards = weight_shards(layout, t.world)
        lo, hi = shards[t.rank]
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host destination, source)
        if hi > lo:
            base, end = layout.slots[lo].offset, layout.slots[hi - 1].end
            host = flat[base:end]
            if staged:
                host = self.buffer("weights", end - base, fm.dtype, t.device)
                copies.append((host, flat[base:end]))
            for s in layout.slots[lo:hi]:
                share.weights.append((s.name, host[s.offset - base : s.end - base].view(s.shape)))
        buffers = t.buffers() if t.rank == 0 else {}
        for name, b in buffers.items():
            host = b.detach().contiguous()
            if staged:
                host = self.buffer(f"buffer:{name}", b.numel(), b.dtype, t.device).view(b.shape)
                copies.append((host, b.detach()))
            share.weights.append((name, host))
            share.buffer_bytes += b.numel() * b.element_size()

        view = OptimizerView.of(optimizer, fm, t.trainer) if optimizer is not None else None
        scalars: tuple[dict[str, Any], str] = ({}, "")
        if view is not None:
            mine = view.scalars(len(layout))
            if optimizer is t.sharded_optimizer and t.world > 1:
                # Each rank knows the state of its own slice only: Adam's step, and which
                # state tensors exist at all (a rank whose slice no step touched has none).
                flat = {k: dtype_name(d) for k, d in view.flat_keys.items()}
                payload = json.dumps({"scalars": mine, "flat": flat}).encode()
                replies = [json.loads(r) for r in exchange_bytes(payload, t.group, t.device)]
                scalars = merge_scalars([r["scalars"] for r in replies])
                for r in replies:
                    for k, d in r["flat"].items():
                        view.flat_keys.setdefault(k, dtype_from_name(d))
            else:
                scalars = merge_scalars([mine])
        if view is not None and view.flat_keys:
            align = layout.align_bytes // layout.torch_dtype.itemsize
            s0, e0 = element_ranges(layout.numel, t.world, align)[t.rank]
            share.optim_range = (s0, e0)
            segments = sorted(view.segments, key=lambda g: g.start)
            for key, dtype in view.flat_keys.items():
                # The flat range [s0, e0): pieces of state tensors, zeros in between.
                pieces: list[tuple[int, int, torch.Tensor | None]] = []
                pos = s0
                for seg in segments:
                    a, b = max(seg.start, s0), min(seg.end, e0)
                    if a >= b:
                        continue
                    if a > pos:
                        pieces.append((pos, a, None))  # padding, frozen parameters
                    src = view.source(seg, key)
                    part = None if src is None else src[a - seg.start : b - seg.start]
                    pieces.append((a, b, part))
                    pos = b
                if pos < e0:
                    pieces.append((pos, e0, None))
                if staged:
                    host = self.buffer(f"optim:{key}", e0 - s0, dtype, t.device)
                    copies += [(host[a - s0 : b - s0], part) for a, b, part in pieces]
                    share.optim.append((key, dtype, [host]))
                else:
                    direct = [b - a if part is None else part for a, b, part in pieces]
                    share.optim.append((key, dtype, direct))

        if t.rank == 0:
            optim_meta = None
            if view is not None:
                optim_meta = {
                    "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                    "param_groups": view.groups_json(),
                    "flat_state": {k: dtype_name(d) for k, d in view.flat_keys.items()},
                    "scalar_state": scalars[0],
                    "stateful": scalars[1],
                }
            config = transformers_config(t.fm.module, layout.torch_dtype)
            share.metadata = build_metadata(
                layout, t.world, step, list(buffers), optim_meta, extra, config
            )

        def stage() -> None:
            if t.device.type == "cuda":
                side = torch.cuda.Stream(t.device)
                side.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(side):
                    for dst, src in copies:
                        dst.zero_() if src is None else dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
                torch.cuda.current_stream(t.device).wait_event(done)  # updates wait on the GPU
                share.cuda_done = done  # type: ignore[attr-defined]
                return
            with torch.no_grad():
                for dst, src in copies:
                    dst.zero_() if src is None else dst.copy_(src)

        return share, stage

    def _write(
        self,
        t: Target,
        share: _Share,
        root: Path,
        seq: int,
        keep_last: int | None,
        background_stage: Callable[[], None] | None,
    ) -> Path:
        coord = t.coord
        key = coord.key("ckpt", seq) if coord is not None else ""
        tmp = tmp_dir(root, share.step)

        def wait(name: str, ranks: list[int], what: str) -> str:
            """The value of ``key/name`` once set; a rank that dies meanwhile is an error."""
            assert coord is not None
            try:
                coord.wait(
                    [f"{key}/{name}"],
                    ranks,
                    timeout=self.timeout,
                    silence=self.heartbeat_timeout,
                    what=f"{what} of checkpoint step {share.step}",
                )
            except RankLostError as e:
                raise CheckpointError(
                    f"checkpoint {share.path} not saved: {e}; earlier checkpoints are untouched"
                ) from e
            except TimeoutError as e:
                raise CheckpointError(
                    f"checkpoint {share.path} not saved: {e}; every rank must call save() at "
                    "the same step (raise timeout= for slow filesystems)"
                ) from e
            return t.store.get(f"{key}/{name}").decode()

        try:
            if background_stage is not None:
                try:
                    background_stage()
                finally:
                    self._staged.set()
            done = getattr(share, "cuda_done", None)
            if done is not None:
                done.synchronize()
            if t.rank == 0:
                _prepare(root, tmp, share.path)
                if coord is not None:
                    t.store.set(f"{key}/dir", str(tmp.absolute()))
                    t.store.set(f"{key}/prepared", "ok")
            else:
                status = wait("prepared", [0], "rank 0 to prepare the directory")
                if status != "ok":
                    raise CheckpointError(status)
                if not tmp.is_dir():  # another directory, or one rank 0 cannot see
                    theirs = t.store.get(f"{key}/dir").decode()
                    raise CheckpointError(
                        f"rank {t.rank}: {tmp.absolute()}: missing, though rank 0 created "
                        f"{theirs}; every rank must save to the same directory, on a "
                        "filesystem all ranks share"
                    )
            records = _write_files(t, share, tmp)
            if coord is not None:
                t.store.set(f"{key}/rank{t.rank}", json.dumps({"files": records}))
        except BaseException as e:
            if coord is not None:
                message = f"rank {t.rank}: {e}"
                if t.rank == 0:
                    _tell(t.store, f"{key}/prepared", message)
                _tell(t.store, f"{key}/rank{t.rank}", json.dumps({"error": message}))
                if t.rank == 0:
                    _tell(t.store, f"{key}/commit", message)
            if t.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _as_checkpoint_error(e) from e

        if t.rank != 0:
            status = wait("commit", [0], "rank 0 to commit")
            if status != "ok":
                raise CheckpointError(f"checkpoint {share.path} was not committed: {status}")
            return share.path
        try:
            files = dict(records)
            for r in range(1, t.world):
                reply = json.loads(wait(f"rank{r}", [r], f"rank {r}'s files"))
                if "error" in reply:
                    raise CheckpointError(reply["error"])
                files.update(reply["files"])
            assert share.metadata is not None
            commit(tmp, share.path, share.metadata, files, share.buffer_bytes)
            if keep_last is not None:
                _rotate(root, keep_last, keep=share.path)
        except BaseException as e:
            if coord is not None:
                _tell(t.store, f"{key}/commit", f"rank 0: {e}")
            shutil.rmtree(tmp, ignore_errors=True)
            raise _as_checkpoint_error(e) from e
        if coord is not None:
            t.store.set(f"{key}/commit", "ok")
            # Every rank has finished the previous save (it sent its files for this one
            # only after): its keys are read by no one any more. The store outlives runs.
            before = coord.key("ckpt", seq - 1)
            coord.delete(
                [f"{before}/{k}" for k in ("dir", "prepared", "commit")]
                + [f"{key}/rank{r}" for r in range(1, t.world)]
            )
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


def _tell(store: Any, key: str, value: str) -> None:
    """Report a failure to the other ranks, if the store is still there to carry it."""
    try:
        store.set(key, value)
    except Exception:
        logger.debug("could not report a failed save through the store", exc_info=True)


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


def _prepare(root: Path, tmp: Path, final: Path) -> None:
    if final.exists():
        raise CheckpointError(
            f"{final}: a checkpoint for this step already exists; save under a new step or delete it"
        )
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by a save that crashed
        shutil.rmtree(tmp)
    tmp.mkdir()


def _write_files(t: Target, share: _Share, tmp: Path) -> dict[str, dict[str, Any]]:
    records: dict[str, FileRecord] = {}
    if share.weights:
        name = model_file(t.rank, t.world)
        records[name] = write_safetensors(tmp / name, share.weights)
    s, e = share.optim_range
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


def _rotate(root: Path, keep_last: int, keep: Path) -> None:
    done = complete_checkpoints(root)
    for _, path in done[: max(0, len(done) - keep_last)]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
            logger.info("checkpoint rotated out: %s", path)


# -- public API -----------------------------------------------------------------------------------
_default_writer: _Writer | None = None


def _writer() -> _Writer:
    global _default_writer
    if _default_writer is None:
        _default_writer = _Writer(timeout=600.0)
    return _default_writer


def async_save(
    root: str | os.PathLike[str],
    trainer: DistributedTrainer | FlatParamModule,
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
    trainer: DistributedTrainer | FlatParamModule,
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


class Checkpointer:
    """Saves under one root, one save in flight, keeping the ``keep_last`` newest checkpoints.

    Old checkpoints are deleted only after a new one is committed, so the
    newest complete checkpoint always survives. Ranks coordinate a save through
    the process group's store, under keys private to the trainer's group and run
    attempt (a worker restarted by ``torchrun --max-restarts`` never reads the
    keys of the attempt before). A rank that waits for another whose heartbeat
    stopped for ``heartbeat_timeout`` seconds (its process died) fails the save
    with a :class:`CheckpointError` naming it; ``timeout`` bounds the wait for
    ranks that are alive but never call ``save``.

    Example::

        ckpt = torchshard.checkpoint.Checkpointer("runs/gpt", keep_last=2)
        if ckpt.latest() is not None:
            start = ckpt.load(trainer, optimizer=opt).step
        for step in range(start, steps):
            ...
            if step % 100 == 0:
                ckpt.save(trainer, step=step, optimizer=opt)   # returns at once
        ckpt.close()                                            # waits for the last save
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        timeout: float = 600.0,
        heartbeat_timeout: float = 10.0,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise CheckpointError(
                f"keep_last: expected a positive integer or None, got {keep_last!r}"
            )
        if not timeout > 0:
            raise CheckpointError(
                f"timeout: expected a positive number of seconds, got {timeout!r}"
            )
        if not heartbeat_timeout > 0:
            raise CheckpointError(
                f"heartbeat_timeout: expected a positive number of seconds, got {heartbeat_timeout!r}"
            )
        self.root = Path(root)
        self.keep_last = keep_last
        self._writer = _Writer(timeout, heartbeat_timeout)

    def save(
        self,
        trainer: DistributedTrainer | FlatParamModule,
        *,
        step: int,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
        blocking: bool = False,
    ) -> CheckpointFuture:
        """Start a save (see :func:`async_save`); with ``blocking=True`` also wait for the commit."""
        future = self._writer.save(
            self.root, trainer, step, optimizer, extra, self.keep_last, blocking=blocking
        )
        if blocking:
            future.wait()
        return future

    def load(
        self,
        trainer: DistributedTrainer | FlatParamModule,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> CheckpointInfo:
        """Load ``path`` or the latest complete checkpoint (see :func:`load`)."""
        self._writer.settle()
        return load(self.root if path is None else path, trainer, optimizer=optimizer)

    def latest(self) -> Path | None:
        """The newest complete checkpoint under the root, or ``None``."""
        found = complete_checkpoints(self.root)
        return found[-1][1] if found else None

    def close(self) -> None:
        """Wait for the save in flight and release the staging memory."""
        self._writer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
