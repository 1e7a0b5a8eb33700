"""The store protocol of a save: every key the ranks meet under, the waits and the reports.

The background threads of a save never run a collective; they meet through
the process group's store instead (the four steps are in ``_save``). A rank
that waits for another whose heartbeat stopped fails at once, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._dist import RankLostError
from .._errors import CheckpointError
from .._log import get_logger
from ._target import Target

__all__ = ["Rendezvous"]

logger = get_logger(__name__)


class Rendezvous:
    """One save's keys, waits and reports.

    The keys of save number ``seq`` live under the coordinator's prefix for it
    (private to the trainer's group and run attempt): ``dir`` and ``prepared``
    (rank 0 made the directory, or why not), ``rank{r}`` (rank r's file
    records, or its error) and ``commit`` (``"ok"``, or why not). Without a
    coordinator (a world of one) there is no one to meet.
    """

    def __init__(
        self, t: Target, seq: int, path: Path, step: int, timeout: float, silence: float
    ) -> None:
        self.t, self.coord, self.seq, self.path, self.step = t, t.coord, seq, path, step
        self.timeout, self.silence = timeout, silence
        self.base = self.coord.key("ckpt", seq) if self.coord is not None else ""

    def _key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def _wait(self, name: str, ranks: list[int], what: str) -> str:
        """The value of ``name`` once set; a rank that dies meanwhile is an error."""
        assert self.coord is not None
        try:
            self.coord.wait(
                [self._key(name)],
                ranks,
                timeout=self.timeout,
                silence=self.silence,
                what=f"{what} of checkpoint step {self.step}",
            )
        except RankLostError as e:
            raise CheckpointError(
                f"checkpoint {self.path} not saved: {e}; earlier checkpoints are untouched"
            ) from e
        except TimeoutError as e:
            raise CheckpointError(
                f"checkpoint {self.path} not saved: {e}; every rank must call save() at "
                "the same step (raise timeout= for slow filesystems)"
            ) from e
        return self.t.store.get(self._key(name)).decode()

    # -- 1. prepare: rank 0 made the directory ------------------------------------------------
    def prepared(self, tmp: Path) -> None:
        if self.coord is not None:
            self.t.store.set(self._key("dir"), str(tmp.absolute()))
            self.t.store.set(self._key("prepared"), "ok")

    def wait_prepared(self) -> None:
        status = self._wait("prepared", [0], "rank 0 to prepare the directory")
        if status != "ok":
            raise CheckpointError(status)

    def their_dir(self) -> str:
        """The directory rank 0 created."""
        return self.t.store.get(self._key("dir")).decode()

    # -- 2. write: each rank's file records -----------------------------------------------------
    def wrote(self, records: dict[str, dict[str, Any]]) -> None:
        if self.coord is not None:
            self.t.store.set(self._key(f"rank{self.t.rank}"), json.dumps({"files": records}))

    def files_of(self, rank: int) -> dict[str, Any]:
        reply = json.loads(self._wait(f"rank{rank}", [rank], f"rank {rank}'s files"))
        if "error" in reply:
            raise CheckpointError(reply["error"])
        return reply["files"]

    def failed(self, message: str) -> None:
        """This rank failed before the commit: every key someone may wait on says so."""
        if self.coord is None:
            return
        if self.t.rank == 0:
            _tell(self.t.store, self._key("prepared"), message)
        _tell(self.t.store, self._key(f"rank{self.t.rank}"), json.dumps({"error": message}))
        if self.t.rank == 0:
            _tell(self.t.store, self._key("commit"), message)

    # -- 3. and 4. commit: rank 0 commits, the others wait for it ---------------------------------
    def commit_failed(self, message: str) -> None:
        if self.coord is not None:
            _tell(self.t.store, self._key("commit"), message)

    def committed(self) -> None:
        if self.coord is None:
            return
        self.t.store.set(self._key("commit"), "ok")
        # Every rank has finished the previous save (it sent its files for this one
        # only after): its keys are read by no one any more. The store outlives runs.
        before = self.coord.key("ckpt", self.seq - 1)
        self.coord.delete(
            [f"{before}/{k}" for k in ("dir", "prepared", "commit")]
            + [self._key(f"rank{r}") for r in range(1, self.t.world)]
        )

    def wait_committed(self) -> None:
        status = self._wait("commit", [0], "rank 0 to commit")
        if status != "ok":
            raise CheckpointError(f"checkpoint {self.path} was not committed: {status}")


def _tell(store: Any, key: str, value: str) -> None:
    """Report a failure to the other ranks, if the store is still there to carry it."""
    try:
        store.set(key, value)
    except Exception:
        logger.debug("could not report a failed save through the store", exc_info=True)
