"""Sharded checkpoints: per-rank safetensors shards, written in the background, committed atomically.

An async save stages this rank's share (its run of whole parameters, its flat
range of optimizer state; which ones is ``_plan``'s arithmetic) into one block
of host memory that is reused across saves (on CUDA, page-locked to the byte:
see :class:`HostArena`), then a background thread writes and fsyncs the files
into ``ROOT/.tmp-step-N``; a blocking save on CPU writes straight from the live
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
import json
import math
import mmap
import os
import shutil
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
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
from ._plan import Piece, SharePlan, plan_share, state_ranges, weight_tiles
from ._rendezvous import Rendezvous
from ._safetensors import FileRecord, SafetensorsWriter, write_safetensors
from ._target import Checkpointable, Target

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


_Copy = tuple[torch.Tensor, torch.Tensor]  # (host destination, source)

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_PAGE = mmap.PAGESIZE


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


def _cuda_check(rc: Any, what: str) -> None:
    """Raise if a CUDA runtime call returned an error code (``cudaSuccess`` is 0)."""
    code = int(rc)
    if code != 0:
        raise CheckpointError(f"checkpoint staging memory: {what} failed with CUDA error {code}")


def _unpin(block: torch.Tensor) -> None:
    _cuda_check(
        torch.cuda.cudart().cudaHostUnregister(block.data_ptr()),
        f"cudaHostUnregister of {block.numel()} bytes",
    )


class HostArena:
    """One block of host memory that each save carves its staging copies from, grown on
    demand (to exactly what the save needs) and never shrunk, so memory stays bounded.

    For CUDA the block is a plain allocation page-locked with ``cudaHostRegister``,
    exactly its size, and unregistered when it is replaced or released. Torch's
    pinned allocator (``pin_memory=True``) would round every block up to a power of
    two and keep freed blocks pinned for the life of the process.
    """

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self._unpin: weakref.finalize | None = None  # unregisters the block; set while pinned

    @property
    def pinned_bytes(self) -> int:
        """Bytes registered (page-locked) for CUDA staging, 0 when none are; the pages
        locked cover them, so at most one page more."""
        return self.block.numel() if self.block is not None and self._unpin is not None else 0

    def reserve(self, nbytes: int, pin: bool) -> torch.Tensor:
        """At least ``nbytes`` bytes (uint8), page-locked if ``pin``. The previous block is
        replaced only if too small (or not pinned when it must be): the caller makes sure
        no copy into it is still running."""
        block = self.block
        if block is None or block.numel() < nbytes or (pin and nbytes and self._unpin is None):
            self.release()  # first: the old and the new block never coexist
            if pin and nbytes:
                # Registration locks whole pages: start on a page of our own, and own the
                # rest of the last one too, so that no other allocation (another writer's
                # registered block) shares a page with this one.
                pages = -(-nbytes // _PAGE) * _PAGE
                raw = torch.empty(pages + _PAGE, dtype=torch.uint8)
                start = -raw.data_ptr() % _PAGE
                block = raw[start : start + nbytes]
                _cuda_check(
                    torch.cuda.cudart().cudaHostRegister(
                        block.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE
                    ),
                    f"cudaHostRegister of {nbytes} bytes (page-locking host memory for the "
                    "copies from the GPU; the save did not start)",
                )
                self._unpin = weakref.finalize(self, _unpin, block)
                self._unpin.atexit = False  # at exit the process's memory goes anyway
            else:
                block = torch.empty(nbytes, dtype=torch.uint8)
            self.block = block
        return block

    def release(self) -> None:
        """Unregister (if pinned) and drop the block."""
        unpin, self._unpin, self.block = self._unpin, None, None
        if unpin is not None:
            unpin()

    def carve(self, specs: list[tuple[torch.Size, torch.dtype]], pin: bool) -> list[torch.Tensor]:
        """Host tensors of these shapes and dtypes, laid out in order in one block of
        exactly their size (plus alignment for each dtype)."""
        offsets, total = [], 0
        for shape, dtype in specs:
            size = dtype.itemsize
            total = -(-total // size) * size
            offsets.append(total)
            total += math.prod(shape) * size
        block = self.reserve(total, pin)
        return [
            block[o : o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, specs)
        ]


class _Fence:
    """What ``optimizer.step()`` waits for while a save's staging copies may still run.

    Registered once per optimizer as a step pre-hook; it holds this, not the writer.
    """

    def __init__(self) -> None:
        self.staged = threading.Event()  # CPU: cleared while the writer thread copies
        self.staged.set()
        self.cuda: tuple[torch.cuda.Event, torch.device] | None = None  # CUDA: the copies' event

    def __call__(self, *_: Any) -> None:
        self.staged.wait()
        pending = self.cuda
        if pending is not None:
            done, device = pending
            # on the GPU: the step's kernels wait for the copies; the host does not block
            torch.cuda.current_stream(device).wait_event(done)


def _bind_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op elsewhere).

    A new thread's current device is 0: its first CUDA call (an event sync) would
    otherwise create a context on GPU 0, for every rank of the node.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


class Writer:
    """Host staging memory reused across saves, one background thread, one save in flight."""

    def __init__(self, timeout: float, heartbeat_timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchshard-ckpt")
        self.arena = HostArena()
        self._inflight: CheckpointFuture | None = None
        self._fence = _Fence()
        self._fenced: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._copying: torch.cuda.Event | None = None  # the last save's copies from the GPU

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
        if optimizer in self._fenced:
            return
        optimizer.register_step_pre_hook(self._fence)
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
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"step: expected a non-negative integer, got {step!r}")
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise CheckpointError(
                f"extra: expected a dict of JSON values or None, got {type(extra).__name__}"
            )
        odd = [k for k in _keys(extra) if not isinstance(k, str)]
        if odd:  # JSON would turn them into strings: another dict comes back than was saved
            raise CheckpointError(
                f"extra: expected string keys, got {odd[0]!r} ({type(odd[0]).__name__}); "
                "JSON would load it back as a string"
            )
        try:
            extra_json = json.loads(json.dumps(extra, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"extra: expected a dict of JSON values ({e}); NaN and infinity are not JSON: "
                "store None or a string instead"
            ) from e
        target = Target(obj)
        seq = target.coord.next_sequence() if target.coord is not None else 0
        root = Path(root)
        device = _resolve(target.device)
        cuda = device.type == "cuda"
        # The previous save is over (waited for above), and so are its copies from the GPU
        # even if its writer failed before waiting for them: its staging memory is free.
        self._copies_done()
        # A save the caller waits for writes host tensors straight from where they live.
        staged = cuda or not blocking
        carve = (lambda sources: self.arena.carve(sources, pin=cuda)) if staged else None
        share, early, late = _collect(target, root, step, optimizer, extra_json, carve)
        background: list[_Copy] | None = None
        if cuda:
            # Enqueued on a side stream after the work already queued. Forward changes the
            # module buffers: the current stream waits for their (small) copies at once.
            # With an optimizer, only its step waits for the rest (a GPU-side wait in its
            # step pre-hook); without one nothing says when the weights change, so the
            # current stream waits for every copy (still on the GPU: the host goes on).
            early_done, share.cuda_done = _stage_cuda(early, late, device)
            self._copying = share.cuda_done
            current = torch.cuda.current_stream(device)
            if optimizer is None:
                current.wait_event(share.cuda_done)
            else:
                if early_done is not None:
                    current.wait_event(early_done)
                self._fence.cuda = (share.cuda_done, device)
                self.fence(optimizer)
        elif staged and optimizer is not None:
            _stage_cpu(early)  # forward changes the module buffers: copy them now
            self._fence.staged.clear()  # the rest in the background; optimizer.step() waits
            self.fence(optimizer)
            background = late
        elif staged:
            _stage_cpu(early + late)  # nothing tells us when the weights change: copy now
        future = self._pool.submit(
            self._write, target, device, share, root, seq, keep_last, background
        )
        result = CheckpointFuture(future)
        self._inflight = result
        return result

    def _write(
        self,
        t: Target,
        device: torch.device,
        share: _Share,
        root: Path,
        seq: int,
        keep_last: int | None,
        background: list[_Copy] | None,
    ) -> Path:
        """The background thread's part of a save: the four steps of the module docstring."""
        tmp = tmp_dir(root, share.step)  # (these two make no CUDA call)
        meet = Rendezvous(t, seq, share.path, share.step, self.timeout, self.heartbeat_timeout)
        try:
            _bind_device(device)  # before this thread's first CUDA call
            if background is not None:
                try:
                    _stage_cpu(background)
                finally:
                    self._fence.staged.set()
            if share.cuda_done is not None:
                share.cuda_done.synchronize()
                pending = self._fence.cuda
                if pending is not None and pending[0] is share.cuda_done:
                    self._fence.cuda = None  # copied: later steps need not wait
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
            self._fence.cuda = None
            self._copies_done()
            self.arena.release()


def _collect(
    t: Target,
    root: Path,
    step: int,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    carve: Callable[[list[tuple[torch.Size, torch.dtype]]], list[torch.Tensor]] | None,
) -> tuple[_Share, list[_Copy], list[_Copy]]:
    """This rank's share, as ``_plan`` places it, and the copies that stage it into the
    host tensors that ``carve`` hands out (``None``: the files are written straight from
    the live tensors, for a save the caller waits for): the module buffers' copies, then
    the others. Ranges that are zeros are counts in the share, never copies.

    A fully sharded trainer holds no range of the files: its weights and state are
    assembled from every rank's stripes here, by collectives, into host tensors
    (``carve``'s, or new ones); only the module buffers are left to copy."""
    layout, fm = t.fm.layout, t.fm
    # without a flat buffer no rank holds its range of the files: exchanged from the shards
    stripes = t.stripes if fm.flat_param is None else None
    view = OptimizerView.of(optimizer, t) if optimizer is not None else None
    scalars = view.agree(t) if view is not None else ({}, "")  # a collective when sharded
    segments = None
    if view is not None and view.flat_keys:
        segments = [(seg.start, seg.end) for seg in view.segments]
    if stripes is None:
        plan = plan_share(layout, t.world, t.rank, segments)
    else:  # the state range of the files, cut into no pieces: it is assembled whole
        plan = plan_share(layout, t.world, t.rank)
        if segments is not None:
            plan = replace(plan, state_range=state_ranges(layout, t.world)[t.rank])
    share = _Share(step_dir(root, step), step, plan)
    (lo, hi), (base, end) = share.plan.slots, share.plan.span
    buffers = t.buffers() if t.rank == 0 else {}
    # What is written from live tensors, each in the dtype of its file entry, in staging
    # order: the module buffers first, then this rank's run of weights, then the state.
    sources = [(b.detach(), b.dtype) for b in buffers.values()]
    # Fully sharded: what is assembled instead, after them: the weight tile, the state.
    assembled: list[tuple[torch.Size, torch.dtype]] = []
    optim: list[tuple[str, torch.dtype, list[torch.Tensor | int]]] = []
    if stripes is not None:
        tile = weight_tiles(layout, t.world)[t.rank]
        base = tile[0]
        assembled.append((torch.Size([tile[1] - tile[0]]), fm.dtype))
        if segments is not None:
            assert view is not None
            s0, e0 = share.plan.state_range
            assembled += [(torch.Size([e0 - s0]), d) for d in view.flat_keys.values()]
    else:
        flat = fm.flat_param
        assert flat is not None
        if hi > lo:
            sources.append((flat.detach()[base:end], fm.dtype))
        if segments is not None:
            assert view is not None
            for key, dtype in view.flat_keys.items():
                parts = [(p, _part(view, p, key)) for p in share.plan.pieces]
                pieces = [p.end - p.start if part is None else part for p, part in parts]
                optim.append((key, dtype, pieces))
                sources += [(x, dtype) for x in pieces if isinstance(x, torch.Tensor)]
    specs = [(src.shape, dtype) for src, dtype in sources]
    if carve is not None:
        hosts = carve(specs + assembled)
        copies = [(host, src) for host, (src, _) in zip(hosts, sources)]
    else:
        hosts = [src.contiguous() for src, _ in sources]
        hosts += [torch.empty(shape, dtype=dtype) for shape, dtype in assembled]
        copies = []
    staged = iter(hosts)
    buffer_hosts = [next(staged) for _ in buffers]
    if stripes is not None:
        weights = next(staged)
        stripes.assemble(weight_tiles(layout, t.world), weights, None)
        if segments is not None:
            assert view is not None
            states = {key: next(staged) for key in view.flat_keys}
            ranges = state_ranges(layout, t.world)
            for key in sorted(states):  # the same order on every rank
                parts = [(seg.start, seg.end, view.source(seg, key)) for seg in view.segments]
                stripes.assemble(ranges, states[key], parts)
            share.optim = [(key, host.dtype, [host]) for key, host in states.items()]
        if hi > lo:
            host = weights
    elif hi > lo:
        host = next(staged)
    if hi > lo:
        for s in layout.slots[lo:hi]:
            share.weights.append((s.name, host[s.offset - base : s.end - base].view(s.shape)))
    for (name, b), host in zip(buffers.items(), buffer_hosts):
        share.weights.append((name, host))
        share.buffer_bytes += b.numel() * b.element_size()
    for key, dtype, pieces in optim:
        share.optim.append(
            (key, dtype, [x if isinstance(x, int) else next(staged) for x in pieces])
        )
    if t.rank == 0:
        optim_meta = view.metadata(scalars) if view is not None else None
        config = transformers_config(t.fm.module, layout.torch_dtype)
        share.metadata = build_metadata(
            layout, t.world, step, list(buffers), optim_meta, extra, config
        )
    return share, copies[: len(buffers)], copies[len(buffers) :]


def _keys(value: Any) -> Iterator[Any]:
    """Every dict key in ``value``, at any depth."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _keys(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _keys(v)


def _part(view: OptimizerView, piece: Piece, key: str) -> torch.Tensor | None:
    """Piece ``piece`` of the flat state ``key``; ``None`` where it is zeros."""
    if piece.segment is None:
        return None
    seg = view.segments[piece.segment]
    src = view.source(seg, key)
    return None if src is None else src[piece.start - seg.start : piece.end - seg.start]


def _resolve(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` alone means the calling thread's current one)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@torch.no_grad()
def _stage_cpu(copies: list[_Copy]) -> None:
    """Run staging copies at once."""
    for dst, src in copies:
        dst.copy_(src)


@torch.no_grad()
def _stage_cuda(
    first: list[_Copy], rest: list[_Copy], device: torch.device
) -> tuple[torch.cuda.Event | None, torch.cuda.Event]:
    """Enqueue staging copies on a side stream, after the work queued so far on the
    current stream (they read what it writes); ``first``, then ``rest``. Returns the events
    that mark ``first`` done (``None`` if empty) and all of them done. Nothing here makes
    the current stream wait: the caller decides. The sources are persistent tensors
    (weights, buffers, optimizer state) that outlive the copies: no ``record_stream``."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    first_done = None
    with torch.cuda.stream(side):
        for dst, src in first:
            dst.copy_(src, non_blocking=True)
        if first:
            first_done = torch.cuda.Event()
            first_done.record(side)
        for dst, src in rest:
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event(blocking=True)  # the writer thread sleeps in synchronize()
        done.record(side)
    return first_done, done


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
    copy, no host memory kept afterwards (with ``shard="full"``, from this
    rank's share, assembled from every rank's stripes and then dropped).

    Example::

        path = torchshard.checkpoint.save("ckpt", trainer, step=100, optimizer=opt)
    """
    return _writer().save(Path(root), trainer, step, optimizer, extra, None, blocking=True).wait()
