"""Pipeline checkpoints, the background part: write the staged shares, commit (issue 26).

``save_pp`` runs every collective in the caller's thread (a slot assembled inside a
stage's data-parallel group, the metadata agreed over the pipeline's group) and copies
what each rank writes into host tensors of its own; this module's :func:`write_commit`
then runs in the writer's thread, as a trainer's save does (``_save``): rank 0 prepares
``ROOT/.tmp-step-N``, every rank writes its shares' files and reports their records,
rank 0 writes ``metadata.json`` last and renames the directory (the commit), the others
wait for it. The ranks meet through the store (``_rendezvous``), never a collective.

A stage's trainer coordinates its data-parallel group only, so the pipeline gets the
minimal equivalent over its own ranks (:class:`PipeCoord`): keys under a prefix that rank
0 draws once per pipeline and sends with the save's first collective, with the save's
number; each rank's heartbeat is its first stage trainer's (``dp == 1``: none, and a
wait on such a rank is bounded by ``timeout`` alone).
"""

from __future__ import annotations

import shutil
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._dist import RankLostError, own_connection
from .._errors import CheckpointError
from ._format import commit, prepare, rotate, tmp_dir
from ._rendezvous import Rendezvous
from ._share import Share

__all__ = ["PipeCoord", "Side", "meeting", "side_of", "write_commit"]

# rank 0's (prefix, saves so far) per pipeline; the other ranks take rank 0's
_DRAWN: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


class PipeCoord:
    """The store keys of one pipeline's saves, and the waits on its ranks' heartbeats
    (what ``_rendezvous`` uses of a trainer's ``Coordinator``).

    Example::

        coord = PipeCoord("torchshard/pipeline-1f2e", 0, [None, "torchshard/ab/alive/0"])
        coord.key("ckpt", 3)   # 'torchshard/pipeline-1f2e/ckpt/3'
    """

    def __init__(self, prefix: str, rank: int, alive: list[str | None]) -> None:
        self.prefix, self.rank, self.alive = prefix, rank, alive

    def key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    @property
    def store(self) -> Any:
        return own_connection()

    def wait(
        self, keys: list[str], ranks: Iterable[int], *, timeout: float, silence: float, what: str
    ) -> None:
        """Wait until ``keys`` are set (by ``ranks``); a rank whose heartbeat has not moved
        for ``silence`` seconds is lost (:class:`RankLostError`), ``timeout`` bounds all."""
        store, start, pause = self.store, time.monotonic(), 0.01
        beating = [r for r in sorted(set(ranks)) if self.alive[r] is not None]
        seen = {r: (-1, start) for r in beating}  # heartbeat count, when it last moved
        while not store.check(keys):
            time.sleep(pause)
            pause = min(2 * pause, 0.25)
            now = time.monotonic()
            for r in beating:
                count = store.add(self.alive[r], 0)  # read without blocking
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] >= silence:
                    raise RankLostError(
                        f"pipeline rank {r} stopped responding while rank {self.rank} waited "
                        f"for {what}: no heartbeat for {now - seen[r][1]:.1f} s",
                        r,
                    )
            if now - start >= timeout:
                raise TimeoutError(f"rank {self.rank}: {what}: not done after {timeout:.0f} s")

    def delete(self, keys: Iterable[str]) -> None:
        store = self.store
        for k in keys:
            store.delete_key(k)


@dataclass(frozen=True)
class Side:
    """What a :class:`~._rendezvous.Rendezvous` reads of its target, for a pipeline: the
    coordinator (``None`` in a world of one), its store, this rank and the world (the
    pipeline's group: ``pp_rank * dp + dp_rank`` of ``pp * dp``)."""

    coord: PipeCoord | None
    store: Any
    rank: int
    world: int


def meeting(pipe: Any, rank: int) -> dict[str, Any]:
    """This rank's part of the save's first collective: its heartbeat key and, on rank 0,
    the pipeline's key prefix and this save's number."""
    coord = getattr(pipe.stages[0].trainer, "coordinator", None) if pipe.stages else None
    out: dict[str, Any] = {"alive": coord.key("alive", coord.rank) if coord else None}
    if rank == 0:
        drawn = _DRAWN.setdefault(pipe, [f"torchshard/pipeline-{uuid.uuid4().hex}", 0])
        drawn[1] += 1
        out.update(prefix=drawn[0], seq=drawn[1])
    return out


def side_of(replies: list[dict[str, Any]], rank: int) -> tuple[Side, int]:
    """Everyone's :func:`meeting` parts: this rank's :class:`Side` and the save's number."""
    world, first = len(replies), replies[0]
    alive = [r["alive"] for r in replies]
    coord = PipeCoord(first["prefix"], rank, alive) if world > 1 else None
    return Side(coord, coord.store if coord else None, rank, world), int(first["seq"])


def write_commit(
    side: Side,
    seq: int,
    root: Path,
    path: Path,
    step: int,
    shares: list[tuple[int, Share]],
    q_all: int,
    write: Callable[[int, int, Share, Path], dict[str, Any]],
    meta: dict[str, Any] | None,
    buffer_bytes: int,
    keep_last: int | None,
    timeout: float,
    silence: float,
) -> Path:
    """The writer thread's part of a pipeline save (rank 0 passes ``meta``): the four steps
    of ``_save``'s docstring, over the pipeline's ranks."""
    tmp = tmp_dir(root, step)
    meet = Rendezvous(side, seq, path, step, timeout, silence)  # type: ignore[arg-type]
    try:
        if side.rank == 0:  # 1. prepare
            prepare(root, tmp, path)
            meet.prepared(tmp)
        else:
            meet.wait_prepared()
            if not tmp.is_dir():
                raise CheckpointError(
                    f"rank {side.rank}: {tmp.absolute()}: missing, though rank 0 created "
                    f"{meet.their_dir()}; every rank must save to the same directory, on a "
                    "filesystem all ranks share"
                )
        records: dict[str, Any] = {}
        for q, share in shares:  # 2. write
            records.update(write(q, q_all, share, tmp))
        meet.wrote(records)
    except BaseException as e:
        meet.failed(f"rank {side.rank}: {e}")
        if side.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if side.rank != 0:  # 4. wait for the commit
        meet.wait_committed()
        return path
    try:  # 3. commit
        files = dict(records)
        for r in range(1, side.world):
            files.update(meet.files_of(r))
        assert meta is not None
        commit(tmp, path, meta, files, buffer_bytes)
        if keep_last is not None:
            rotate(root, keep_last, keep=path)
    except BaseException as e:
        meet.commit_failed(f"rank 0: {e}")
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meet.committed()
    return path
