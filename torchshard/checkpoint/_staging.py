"""Staging a save into host memory: the reused host block, the fence that makes
``optimizer.step()`` wait for the copies, and the CPU and CUDA ways of copying.

A :class:`Stager` starts a save's copies (``early``: the module buffers, which
forward changes, and a lossy comm's state, a copy taken at the save; then ``late``:
the rest) and returns a :class:`Staged` whose ``wait()`` the writer thread calls
before it writes. Three stagers, chosen per save (DCP's ``AsyncStager`` in three
small policies):

- :class:`CudaStager`: every copy enqueued on a side stream; the current stream
  waits for the early copies (with an optimizer: its step waits for the rest, on
  the GPU) or for all of them (without one);
- :class:`CpuStager` with ``background``: the early copies now, the rest in the
  writer thread, and ``optimizer.step()`` waits for them;
- :class:`CpuStager` otherwise: every copy now (a blocking save has none).
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref
from typing import Any, Protocol

import torch

from .._errors import CheckpointError

__all__ = [
    "CpuStager",
    "CudaStager",
    "Fence",
    "HostArena",
    "Staged",
    "Stager",
    "bind_device",
    "resolve_device",
]

Copy = tuple[torch.Tensor, torch.Tensor]  # (host destination, source)

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_PAGE = mmap.PAGESIZE


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

    def carve(
        self, specs: list[tuple[torch.Size, torch.dtype, int]], pin: bool
    ) -> list[torch.Tensor]:
        """Host tensors of these shapes and dtypes, laid out in order in one block of
        exactly their size (plus alignment for each dtype, or to the spec's third value when
        larger: the bytes of parameters of several dtypes, viewed in each)."""
        offsets, total = [], 0
        for shape, dtype, align in specs:
            size = max(dtype.itemsize, align)
            total = -(-total // size) * size
            offsets.append(total)
            total += math.prod(shape) * dtype.itemsize
        block = self.reserve(total, pin)
        return [
            block[o : o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype, _) in zip(offsets, specs)
        ]


class Fence:
    """What ``optimizer.step()`` waits for while a save's staging copies may still run.

    Registered once per optimizer as a step pre-hook (:meth:`guard`); the hook holds
    this, not the writer.

    Example::

        fence = Fence()
        fence.guard(optimizer)   # optimizer.step() now waits for the copies in flight
    """

    def __init__(self) -> None:
        self.staged = threading.Event()  # CPU: cleared while the writer thread copies
        self.staged.set()
        self.cuda: tuple[torch.cuda.Event, torch.device] | None = None  # CUDA: the copies' event
        self._guarded: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def __call__(self, *_: Any) -> None:
        self.staged.wait()
        pending = self.cuda
        if pending is not None:
            done, device = pending
            # on the GPU: the step's kernels wait for the copies; the host does not block
            torch.cuda.current_stream(device).wait_event(done)

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for this fence (once per optimizer)."""
        if optimizer not in self._guarded:
            optimizer.register_step_pre_hook(self)
            self._guarded.add(optimizer)


def bind_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op elsewhere).

    A new thread's current device is 0: its first CUDA call (an event sync) would
    otherwise create a context on GPU 0, for every rank of the node.

    Example::

        bind_device(torch.device("cuda", 1))  # in the writer thread, before any CUDA call
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


def resolve_device(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` alone means the calling thread's current one).

    Example::

        resolve_device(torch.device("cuda"))  # cuda:1 on a thread whose device is 1
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@torch.no_grad()
def _stage_cpu(copies: list[Copy]) -> None:
    """Run staging copies at once."""
    for dst, src in copies:
        dst.copy_(src)


@torch.no_grad()
def _stage_cuda(
    first: list[Copy], rest: list[Copy], device: torch.device
) -> tuple[torch.cuda.Event | None, torch.cuda.Event]:
    """Enqueue staging copies on a side stream, after the work queued so far on the
    current stream (they read what it writes); ``first``, then ``rest``. Returns the events
    that mark ``first`` done (``None`` if empty) and all of them done. Nothing here makes
    the current stream wait: the caller decides. The sources of ``rest`` are persistent
    tensors (weights, optimizer state) that outlive the copies: no ``record_stream``; a
    temporary goes in ``first``, which the current stream waits for (:class:`CudaStager`)."""
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


class Staged(Protocol):
    """A save's copies, started: the writer thread waits for them before it writes."""

    def wait(self) -> None:
        """Block until every copy is in host memory (in the writer thread)."""
        ...


class Stager(Protocol):
    """How one save's copies into host memory are started and waited for.

    Example::

        staged = CpuStager(fence, background=True).stage(early, late)
        ...                      # in the writer thread:
        staged.wait()            # every copy is in host memory
    """

    def stage(self, early: list[Copy], late: list[Copy]) -> Staged:
        """Start the copies: ``early`` (the module buffers) before anything queued after
        this call, ``late`` at least before the optimizer's next step."""
        ...


class _Done:
    """Copies that are over already (or none)."""

    def wait(self) -> None:
        pass


class _InThread:
    """Copies the writer thread makes itself, then lets the optimizer step."""

    def __init__(self, copies: list[Copy], fence: Fence) -> None:
        self.copies, self.fence = copies, fence

    def wait(self) -> None:
        try:
            _stage_cpu(self.copies)
        finally:
            self.fence.staged.set()


class _OnGpu:
    """Copies enqueued on a side stream: done when their event is."""

    def __init__(self, done: torch.cuda.Event, fence: Fence) -> None:
        self.done, self.fence = done, fence

    def wait(self) -> None:
        self.done.synchronize()
        pending = self.fence.cuda
        if pending is not None and pending[0] is self.done:
            self.fence.cuda = None  # copied: later steps need not wait


class CpuStager:
    """CPU copies: with ``background`` the early ones now and the rest in the writer
    thread while ``optimizer.step()`` waits at ``fence``; otherwise every one now.

    Example::

        CpuStager(fence, background=False).stage(early, late).wait()  # copied already
    """

    def __init__(self, fence: Fence, background: bool) -> None:
        self.fence, self.background = fence, background

    def stage(self, early: list[Copy], late: list[Copy]) -> Staged:
        if not self.background:
            _stage_cpu(early + late)  # nothing tells us when the weights change: copy now
            return _Done()
        _stage_cpu(early)  # forward changes the module buffers: copy them now
        self.fence.staged.clear()  # the rest in the background; optimizer.step() waits
        return _InThread(late, self.fence)


class CudaStager:
    """Copies from the GPU on a side stream, after the work already queued. Forward changes
    the module buffers: the current stream waits for their (small) copies at once. With an
    optimizer (``fenced``) only its step waits for the rest (a GPU-side wait in its step
    pre-hook); without one nothing says when the weights change, so the current stream
    waits for every copy (still on the GPU: the host goes on). An early copy's source may
    be a temporary (a lossy comm's state, copied at the save): the current stream waits
    for it before it can reuse that memory.

    Example::

        stager = CudaStager(torch.device("cuda", 0), fence, fenced=True)
        staged = stager.stage(early, late)    # stager.done: the copies' event
    """

    def __init__(self, device: torch.device, fence: Fence, fenced: bool) -> None:
        self.device, self.fence, self.fenced = device, fence, fenced
        self.done: torch.cuda.Event | None = None  # every copy of the last stage()

    def stage(self, early: list[Copy], late: list[Copy]) -> Staged:
        early_done, self.done = _stage_cuda(early, late, self.device)
        current = torch.cuda.current_stream(self.device)
        if not self.fenced:
            current.wait_event(self.done)
        else:
            if early_done is not None:
                current.wait_event(early_done)
            self.fence.cuda = (self.done, self.device)
        return _OnGpu(self.done, self.fence)
