"""Sharded checkpoints: per-rank safetensors shards, written in the background, committed atomically.

An async save stages this rank's share (its run of whole parameters, its flat
range of optimizer state: ``_share`` builds it from one plan) into one block of
host memory that is reused across saves (on CUDA, page-locked to the byte: see
``_staging``), then a background thread writes and fsyncs the files into
``ROOT/.tmp-step-N``; a blocking save on CPU writes straight from the live
tensors instead. Ranges that are zeros (padding, parameters without optimizer
state) are never staged: the writer writes the zeros. The background thread
binds the trainer's CUDA device before anything else and never runs a
collective: the ranks meet through the process group's store (``_rendezvous``),
in four steps:

1. prepare: rank 0 creates ``ROOT/.tmp-step-N``; the others wait for it.
2. write: every rank writes and fsyncs its files and reports their records.
3. commit: rank 0 waits for every rank's records, writes ``metadata.json``
   last and renames the directory to ``ROOT/step-N``: the rename is the commit.
4. the other ranks wait for the commit.

A rank that fails tells the others under the key they wait on.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._errors import CheckpointError
from .._log import get_logger
from ._format import (
    check_save_args,
    comm_file,
    commit,
    model_file,
    optim_file,
    prepare,
    rotate,
    tmp_dir,
)
from ._pp_save import save_pp
from ._rendezvous import Rendezvous
from ._safetensors import FileRecord
from ._safetensors_writer import DirectBlock, SafetensorsWriter, write_safetensors
from ._share import Share, collect
from ._staging import (
    CpuStager,
    CudaStager,
    Fence,
    HostArena,
    Staged,
    Stager,
    bind_device,
    resolve_device,
)
from ._target import Checkpointable, PipelineState, Target
from ._tp_save import save_tp

__all__ = ["CheckpointFuture", "Writer", "async_save", "save"]

logger = get_logger(__name__)


class CheckpointFuture:
    """A save in flight. ``wait()`` returns the committed directory or raises :class:`CheckpointError`.

    Example::

        future = torchshard.checkpoint.async_save("runs/gpt", trainer, step=100, optimizer=opt)
        ...                                  # training goes on
        print(future.wait())                 # runs/gpt/step-100, once every rank committed
    """

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


class Writer:
    """Host staging memory reused across saves, one background thread, one save in flight."""

    def __init__(self, timeout: float, heartbeat_timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchshard-ckpt")
        self.arena = HostArena()
        self._inflight: CheckpointFuture | None = None
        self._fence = Fence()
        self._copying: torch.cuda.Event | None = None  # the last save's copies from the GPU
        self._direct: DirectBlock | None = None  # staged saves' files go to the disk through it

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked for staging CUDA saves: exactly the largest save's share."""
        return self.arena.pinned_bytes

    # -- staging ------------------------------------------------------------------------
    def _copies_done(self) -> None:
        """Block until the last save's copies into the staging memory are over. Its writer
        thread waited for them, unless it failed first: then the memory must not be
        reused or unpinned under a running copy."""
        copying, self._copying = self._copying, None
        if copying is not None:
            copying.synchronize()

    def fence(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait until the staging copies of the save in flight are done."""
        self._fence.guard(optimizer)

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
        frozen: bool = True,
    ) -> CheckpointFuture:
        previous = self._inflight
        if previous is not None:
            seen = previous.observed
            try:
                previous.wait()
            except CheckpointError as e:
                if not seen:  # an error nobody has seen yet must not pass silently
                    raise CheckpointError(f"the previous checkpoint save failed: {e}") from e
        extra_json = check_save_args(step, extra)
        if isinstance(obj, PipelineState):  # collectives and copies now, files in the thread
            job = save_pp(
                obj,
                Path(root),
                step,
                optimizer,
                extra_json,
                keep_last,
                frozen,
                _tp_files,
                self.timeout,
                self.heartbeat_timeout,
            )
            self._inflight = CheckpointFuture(self._pool.submit(job))
            return self._inflight
        target = Target(obj)
        if target.tp is not None:  # the files of the whole model, now (_tp)
            done = save_tp(
                target, Path(root), step, optimizer, extra_json, keep_last, frozen, _tp_files
            )
            self._inflight = CheckpointFuture(done)
            return self._inflight
        seq = target.coord.next_sequence() if target.coord is not None else 0
        root = Path(root)
        device = resolve_device(target.device)
        cuda = device.type == "cuda"
        # The previous save is over (waited for above), and so are its copies from the GPU
        # even if its writer failed before waiting for them: its staging memory is free.
        self._copies_done()
        # A save the caller waits for writes host tensors straight from where they live.
        stage = cuda or not blocking
        carve = (lambda specs: self.arena.carve(specs, pin=cuda)) if stage else None
        share, early, late = collect(target, root, step, optimizer, extra_json, carve, frozen)
        stager: Stager
        if cuda:
            stager = gpu = CudaStager(device, self._fence, fenced=optimizer is not None)
        else:
            stager = CpuStager(self._fence, background=stage and optimizer is not None)
        staged = stager.stage(early, late)
        if cuda:
            self._copying = gpu.done  # what a failed writer may leave running
        if stage and optimizer is not None:
            self.fence(optimizer)
        # Direct I/O: the bytes change under no one (staged, or the caller waits). Staged saves
        # reuse one block; a blocking save's own is freed with it (no host memory kept).
        if stage and self._direct is None:
            self._direct = DirectBlock()
        direct = self._direct if stage else DirectBlock()
        future = self._pool.submit(
            self._write, target, device, share, root, seq, keep_last, staged, direct
        )
        if not stage:
            future.add_done_callback(lambda _: direct.close())
        result = CheckpointFuture(future)
        self._inflight = result
        return result

    def _write(
        self,
        t: Target,
        device: torch.device,
        share: Share,
        root: Path,
        seq: int,
        keep_last: int | None,
        staged: Staged,
        direct: DirectBlock | None,
    ) -> Path:
        """The background thread's part of a save: the four steps of the module docstring."""
        tmp = tmp_dir(root, share.step)  # (these two make no CUDA call)
        meet = Rendezvous(t, seq, share.path, share.step, self.timeout, self.heartbeat_timeout)
        try:
            bind_device(device)  # before this thread's first CUDA call
            staged.wait()  # the copies into host memory, if any are left
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
            records = _write_files(t, share, tmp, direct)  # 2. write
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
            self._fence.cuda = None
            self._copies_done()
            self.arena.release()
            if self._direct is not None:
                self._direct.close()
            self._direct = None


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


@dataclass(frozen=True)
class _Writing:
    """Who writes: file number ``rank`` of a save at ``world`` ranks (a split module's save
    numbers its files by the mesh's ranks, not by the data-parallel group's)."""

    rank: int
    world: int


def _tp_files(rank: int, world: int, share: Share, tmp: Path) -> dict[str, dict[str, Any]]:
    return _write_files(_Writing(rank, world), share, tmp)


def _write_files(
    t: Target | _Writing, share: Share, tmp: Path, direct: DirectBlock | None = None
) -> dict[str, dict[str, Any]]:
    rank, world = t.rank, t.world
    records: dict[str, FileRecord] = {}
    if share.weights:
        name = model_file(rank, world)
        records[name] = write_safetensors(tmp / name, share.weights, direct=direct)
    s, e = share.plan.state_range
    # each stream's elements in this range (stored: see stored_parts); a stream with none
    # here (parameters of several dtypes: none of its dtype) has no tensor in the file
    sizes = [sum(x if isinstance(x, int) else x.numel() for x in p) for _, _, p in share.optim]
    streams = [(o, n) for o, n in zip(share.optim, sizes) if n]
    if share.optim and e > s:
        name = optim_file(rank, world)
        entries = [(key, dtype, (n,)) for (key, dtype, _), n in streams]
        with SafetensorsWriter(tmp / name, entries, {"range": f"{s},{e}"}, direct) as out:
            for (_, dtype, pieces), _ in streams:
                for piece in pieces:
                    if isinstance(piece, int):
                        out.write_zeros(piece * dtype.itemsize)
                    else:
                        out.write_tensor(piece)
            records[name] = out.finish()
    if share.comm:  # this rank's ranges of the compression state (_comm_meta)
        name = comm_file(rank, world)
        records[name] = write_safetensors(tmp / name, share.comm, direct=direct)
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
    frozen: bool = True,
) -> CheckpointFuture:
    """Start saving a checkpoint of ``trainer`` (and ``optimizer``) as ``root/step-N``; return at once.

    Every rank calls it at the same step. This rank's share is copied into
    host memory reused across saves, then written, fsynced and committed by a
    background thread. One save is in flight at a time: the next call waits
    for this one, and raises if it failed unobserved.

    What waits for the copy: the module buffers (which forward changes) are
    copied first, before anything queued after this call. With ``optimizer``,
    the rest is copied in the background and only ``optimizer.step()`` waits
    for it (on CUDA a GPU-side wait, enqueued by a step pre-hook: forward and
    backward run meanwhile, and the host never blocks). Code that changes the
    weights or the optimizer state in place other than through that step must
    ``wait()`` for the future first. Without ``optimizer`` nothing says when
    the weights change: on CPU the copy is made before returning, on CUDA every
    kernel queued after this call waits for it (the host does not).

    On CUDA the staging memory is page-locked to the byte (``cudaHostRegister``):
    as many bytes as this rank's share, kept until the next larger save needs
    more or the writer closes.

    With ``shard="full"`` no rank holds its share of the files: it is assembled
    from every rank's stripes inside this call (collectives, unit by unit), so
    only the writing is left to the background.

    A tensor-parallel module (``tp_plan=``, ``init_mesh(tp=T)``) is saved as the whole
    model's files within this call, which returns a finished future (``docs/checkpoint-
    format.md``, "Tensor parallelism"). A ``torchshard.Pipeline`` (with ``optimizer=`` its
    ``pipe.make_optimizer(...)``; "Pipelines") is staged within this call too (every
    collective, and a host copy of what this rank writes), its files written and committed
    in the background as above.

    Example::

        future = torchshard.checkpoint.async_save("ckpt", trainer, step=step, optimizer=opt)
        ...                       # keep training
        future.wait()             # the checkpoint is committed
    """
    return _writer().save(Path(root), trainer, step, optimizer, extra, None, frozen=frozen)


def save(
    root: str | os.PathLike[str],
    trainer: Checkpointable,
    *,
    step: int,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    frozen: bool = True,
) -> Path:
    """Save a checkpoint and wait until it is committed; returns its directory.

    ``frozen=False``: the model files leave out the frozen parameters' weights (a LoRA
    checkpoint of the adapters and their optimizer state); a load then keeps the weights
    the model holds for them (its base, loaded from the pretrained weights first), and
    ``consolidate`` refuses it. (``async_save`` and ``Checkpointer.save`` take it too.)

    ``trainer`` may be a ``torchshard.Pipeline``: the files are then the whole model's, as a
    one-process save writes them (``docs/checkpoint-format.md``, "Pipelines").

    On CPU the files are written straight from the live tensors: no staging
    copy, no host memory kept afterwards (with ``shard="full"``, from this
    rank's share, assembled from every rank's stripes and then dropped).

    Example::

        path = torchshard.checkpoint.save("ckpt", trainer, step=100, optimizer=opt)
    """
    writer = _writer()
    return writer.save(Path(root), trainer, step, optimizer, extra, None, True, frozen).wait()
