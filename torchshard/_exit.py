"""Leaving cleanly: what torchshard set up goes away once every rank is done, before Python
finalizes.

Why this is needed (measured on torch 2.13 with gloo, counted by
``benchmarks/bench_exit.py``): gloo's worker threads drop their last reference to a
finished collective after the caller's ``wait()`` has returned. When that collective held
Python-owned objects (a tensor whose Python object is gone, the thread-local state of a
backward hook), dropping it takes the GIL. If the main thread has begun finalizing the
interpreter by then, the worker thread is unwound by ``pthread_exit`` inside a
``noexcept`` destructor, and the process dies with ``terminate called without an active
exception`` (SIGABRT) after the script succeeded. Destroying the process group does not
help by itself: gloo joins its threads only in its destructor, and torch keeps references
to the default group (module-level default arguments evaluated after
``init_process_group``), so the destructor runs during finalization, too late.

What helps is order: every rank finishes and waits for its own communication, the ranks
agree through the store that they are done (no collective, which a rank on an error path
would never match), the heartbeat threads stop and are joined, the groups torchshard
created are destroyed in one order, and the main thread releases the GIL while gloo's
threads finish their bookkeeping. All of it before the interpreter finalizes:
:meth:`DistributedTrainer.close` does it, and an exit hook does it for every trainer that
was never closed. A process leaving on an uncaught exception skips the agreement and the
waits (its peers may be stuck in a collective it will never join); it only stops its own
threads.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from typing import Protocol

import torch.distributed as dist

from ._log import get_logger

__all__ = ["EXIT_TIMEOUT", "destroy_group", "destroy_owned_group", "failing", "track"]

logger = get_logger(__name__)

EXIT_TIMEOUT = 60.0
"""Seconds a closing rank waits for its peers to close too (then it leaves anyway, with a
warning naming the ranks that did not arrive)."""

DRAIN_SECONDS = 0.02
"""Seconds the main thread sleeps, GIL released, after the last collective of a close, so
that gloo's worker threads finish dropping what they held."""


class Closable(Protocol):
    def _close(self, *, failed: bool) -> None: ...


_open: list[weakref.ref[Closable]] = []  # trainers not closed yet, oldest first
_lock = threading.Lock()
_hooked = False
# Whether init_distributed() created the default process group (then torchshard also
# destroys it, at interpreter exit, unless the user did first).
_owns_default_group = False


def own_default_group() -> None:
    """Record that torchshard created the default group (and install the exit hook)."""
    global _owns_default_group
    _owns_default_group = True
    _hook()


def track(obj: Closable) -> None:
    """Close ``obj`` at interpreter exit if nobody did before (newest first)."""
    with _lock:
        _open[:] = [r for r in _open if r() is not None]
        _open.append(weakref.ref(obj))
    _hook()


def untrack(obj: Closable) -> None:
    with _lock:
        _open[:] = [r for r in _open if r() is not None and r() is not obj]


def _hook() -> None:
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(_at_exit)
            _hooked = True


def failing() -> bool:
    """Whether the interpreter is leaving on an uncaught exception (its traceback was printed)."""
    return getattr(sys, "last_value", None) is not None or (
        getattr(sys, "last_exc", None) is not None
    )


def drain() -> None:
    """Release the GIL for a moment: gloo's threads may need it to drop finished work."""
    time.sleep(DRAIN_SECONDS)


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group`` if it is still registered (a user may have destroyed every group)."""
    if group is None or not dist.is_initialized():
        return
    if dist.distributed_c10d._world.pg_map.get(group) is None:
        return
    dist.destroy_process_group(group)


def destroy_owned_group() -> None:
    """Destroy the default process group if :func:`init_distributed` created it and it is
    still there."""
    global _owns_default_group
    if _owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_default_group = False


def _at_exit() -> None:
    failed = failing()
    with _lock:
        objs = [o for o in (r() for r in reversed(_open)) if o is not None]
        _open.clear()
    owned = _owns_default_group
    for obj in objs:
        try:
            obj._close(failed=failed)
        except Exception:  # at exit, never mask the real error with a teardown one
            logger.warning("closing %s at exit failed", type(obj).__name__, exc_info=True)
    try:
        destroy_owned_group()
    except Exception:
        logger.debug("process group teardown at exit failed", exc_info=True)
    if objs or owned:
        drain()
