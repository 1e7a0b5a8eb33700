"""``Checkpointer``: saves under one root and loads from it; a peer above ``_save`` and
``_load``, so that neither imports the other."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError
from .._log import get_logger
from ._format import complete_checkpoints
from ._load import load
from ._save import CheckpointFuture, Writer
from ._target import Checkpointable, CheckpointInfo, PipelineState

__all__ = ["Checkpointer"]

logger = get_logger(__name__)


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
        if ckpt.latest() is not None:   # skips a damaged latest for the newest that loads
            start = ckpt.load(trainer, optimizer=opt, fallback=True).step
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
        if keep_last is not None and (
            not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
        ):
            raise CheckpointError(
                f"keep_last: expected a positive integer or None, got {keep_last!r}"
            )
        for name, value in (("timeout", timeout), ("heartbeat_timeout", heartbeat_timeout)):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and value > 0):
                raise CheckpointError(
                    f"{name}: expected a positive number of seconds, got {value!r}"
                )
        self.root = Path(root)
        self.keep_last = keep_last
        self._writer = Writer(timeout, heartbeat_timeout)

    def save(
        self,
        trainer: Checkpointable,
        *,
        step: int,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
        blocking: bool = False,
        frozen: bool = True,
    ) -> CheckpointFuture:
        """Start a save (see :func:`async_save`); with ``blocking=True`` also wait for the commit;
        ``frozen=False`` leaves the frozen parameters' weights out (see :func:`save`)."""
        future = self._writer.save(
            self.root, trainer, step, optimizer, extra, self.keep_last, blocking, frozen
        )
        if blocking:
            future.wait()
        return future

    def load(
        self,
        trainer: Checkpointable,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        path: str | os.PathLike[str] | None = None,
        fallback: bool = False,
        comm_error: str = "mean",
    ) -> CheckpointInfo:
        """Load ``path`` or the latest complete checkpoint (see :func:`load`).

        With ``fallback=True``, a checkpoint under the root (or under ``path``, if that is
        a root) that every rank refuses, having changed nothing, is skipped for the next
        older one (``info.skipped`` says which and why). A ``path`` that is one checkpoint
        directory is loaded, or refused, as it is.

        Once an older checkpoint has loaded, rank 0 renames each skipped one under this
        Checkpointer's root to ``step-N.bad`` (kept, never deleted): the run will save
        those steps again, and a later restart need not read them again. If none loads,
        nothing is renamed. ``comm_error``: what to do with a saved error feedback (see
        :func:`load`).
        """
        self._writer.settle()
        where = self.root if path is None else path
        info = load(where, trainer, optimizer=optimizer, fallback=fallback, comm_error=comm_error)
        first = (
            trainer.pp_rank == 0 and trainer.dp_rank == 0
            if isinstance(trainer, PipelineState)
            else getattr(trainer, "rank", 0) == 0
        )
        if info.skipped and first:
            for bad, _ in info.skipped:
                if Path(bad).parent.resolve() == self.root.resolve():
                    _set_aside(Path(bad))
        return info

    @property
    def pinned_bytes(self) -> int:
        """Host memory kept page-locked for staging CUDA saves (0 on CPU): exactly this
        rank's share of the largest save so far, until :meth:`close`."""
        return self._writer.pinned_bytes

    def latest(self) -> Path | None:
        """The newest complete checkpoint under the root, or ``None``."""
        found = complete_checkpoints(self.root)
        return found[-1][1] if found else None

    def close(self) -> None:
        """Wait for the save in flight and release the staging memory (unpinning it)."""
        self._writer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _set_aside(path: Path) -> None:
    """Rename a checkpoint that failed to load to ``<name>.bad`` (``.bad.1``, ... if taken),
    a name that is no checkpoint: kept for a post-mortem, out of the way of the next save."""
    target, n = path.with_name(path.name + ".bad"), 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.bad.{n}")
    try:
        path.rename(target)
    except OSError as e:
        logger.warning("could not set %s aside (%s); delete or move it before its step", path, e)
        return
    logger.warning("set the damaged checkpoint %s aside as %s", path, target.name)
