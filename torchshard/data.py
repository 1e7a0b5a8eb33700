"""Global batches whose order does not depend on the world size, and a data position that
resumes at any world size, exactly, with DataLoader workers prefetching.

:class:`GlobalBatchSampler` draws the same sequence of *global* batches at any world size
(one seeded permutation per epoch) and gives each rank its equal, contiguous part of each.
Its position is counted in global batches *the loop received*, through
:meth:`GlobalBatchSampler.track`, because a DataLoader with workers draws index batches
ahead of the loop. See ``docs/data.md``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import Sampler

from ._dist import data_parallel
from ._errors import DataError

__all__ = ["GlobalBatchSampler", "TrackedLoader"]

T = TypeVar("T")

_STATE_VERSION = 1
# What a saved state must agree on with the sampler that loads it: the order depends on each.
_COMPATIBLE = ("num_samples", "global_batch_size", "seed", "shuffle", "drop_last")


def _check_int(where: str, name: str, value: Any, minimum: int | None, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataError(f"{where}: {name}: expected an int, got {value!r}; {hint}")
    if minimum is not None and value < minimum:
        raise DataError(f"{where}: {name}: expected an int >= {minimum}, got {value}; {hint}")
    return value


def _check_bool(where: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise DataError(f"{where}: {name}: expected True or False, got {value!r}; pass a bool")
    return value


class GlobalBatchSampler(Sampler[list[int]]):
    """A DataLoader ``batch_sampler`` whose global batches are the same at every world size.

    Epoch ``e`` visits the samples in the order ``torch.randperm(num_samples)`` draws from a
    generator seeded with ``(seed, e)`` (``range(num_samples)`` without ``shuffle``), cut into
    global batches of ``global_batch_size``. Rank ``r`` of ``W`` gets the ``r``-th of ``W``
    equal, contiguous parts of each global batch, so the ranks' parts concatenated in rank
    order are the global batch, whatever ``W``.

    The position (epoch, global batches of it the loop has received) is world-size free:
    :meth:`state_dict` is the same on every rank, JSON-serializable, and a sampler built at
    another world size that loads it continues the epoch with exactly the global batches the
    uninterrupted run would have drawn next. Iterating the sampler again (a new ``for`` over
    the DataLoader) continues where the loop stopped receiving, and starts the next epoch once
    one is done: no :meth:`set_epoch` is needed.

    **Prefetching.** A DataLoader with ``num_workers > 0`` draws ``prefetch_factor *
    num_workers`` index batches ahead of the loop, so the sampler cannot count what the loop
    received. Iterate ``sampler.track(loader)`` instead of ``loader``: it yields the loader's
    batches unchanged and counts each one as the loop receives it, which is what
    :meth:`state_dict` saves. Batches drawn outside ``track()`` make :meth:`state_dict` raise
    :class:`~torchshard.DataError` (never a position that may be ahead of the loop);
    :meth:`load_state_dict` or :meth:`set_epoch` with another epoch makes it known again.

    **The last, short global batch** (when ``global_batch_size`` does not divide
    ``num_samples``): with ``drop_last`` (the default) it is dropped. Without, it is completed
    with the first samples of the same epoch's order, as DistributedSampler pads: every global
    batch has ``global_batch_size`` samples and every rank the same number, and those
    ``global_batch_size - num_samples % global_batch_size`` samples are seen twice that epoch.

    Args:
        num_samples: the dataset's length; indices are ``0 .. num_samples - 1``.
        global_batch_size: samples per global batch, all ranks together; the world size must
            divide it.
        seed: the order's seed (any int).
        shuffle: a new permutation each epoch; ``False``: ``0, 1, 2, ...`` every epoch.
        drop_last: drop the last, short global batch of an epoch (else pad it, see above).
        rank, world_size: this process's data-parallel place; by default the last
            :func:`init_mesh`'s (``mesh.dp_rank`` of ``mesh.dp_size``: with tensor
            parallelism the tp ranks of a group read the same samples), else the default
            process group's (``torch.distributed``, if initialized), else 0 of 1.

    Raises:
        DataError: on a bad argument, e.g. a global batch size the world size does not divide.

    Example::

        import torch
        from torch.utils.data import DataLoader, TensorDataset
        from torchshard import GlobalBatchSampler

        data = TensorDataset(torch.arange(100.0))
        sampler = GlobalBatchSampler(len(data), 8, seed=0)  # 8 over all ranks
        loader = DataLoader(data, batch_sampler=sampler, num_workers=2)
        for step, (x,) in enumerate(sampler.track(loader)):  # counts what the loop receives
            if step == 3:
                break
        state = sampler.state_dict()  # {"epoch": 0, "consumed": 4, ...}: JSON, any world size
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        where = "GlobalBatchSampler"
        self.num_samples = _check_int(
            where, "num_samples", num_samples, 1, "pass the dataset's length"
        )
        self.global_batch_size = _check_int(
            where, "global_batch_size", global_batch_size, 1, "pass the samples per global batch"
        )
        self.seed = _check_int(where, "seed", seed, None, "pass an int seed")
        self.shuffle = _check_bool(where, "shuffle", shuffle)
        self.drop_last = _check_bool(where, "drop_last", drop_last)
        if (rank is None) != (world_size is None):
            raise DataError(
                f"{where}: rank and world_size: expected both or neither, got rank={rank!r}, "
                f"world_size={world_size!r}; pass both, or neither to use the process group's"
            )
        if world_size is None:  # the data-parallel place: with tensor parallelism, the mesh's
            rank, world_size = data_parallel()
        self.world_size = _check_int(where, "world_size", world_size, 1, "pass the ranks in all")
        self.rank = _check_int(where, "rank", rank, 0, "pass this process's rank")
        if self.rank >= self.world_size:
            raise DataError(
                f"{where}: rank: expected 0 <= rank < world_size {self.world_size}, got "
                f"{self.rank}; pass this process's rank"
            )
        if self.global_batch_size % self.world_size:
            up = -(-self.global_batch_size // self.world_size) * self.world_size
            raise DataError(
                f"{where}: global_batch_size: expected a multiple of the world size "
                f"{self.world_size}, got {self.global_batch_size}; pick a global batch size "
                f"that {self.world_size} divides (e.g. {up}) or a world size that divides "
                f"{self.global_batch_size}"
            )
        if self.drop_last and self.num_samples < self.global_batch_size:
            raise DataError(
                f"{where}: num_samples: expected at least global_batch_size "
                f"({self.global_batch_size}) with drop_last=True, got {self.num_samples}; pass "
                "a smaller global_batch_size or drop_last=False"
            )
        self.local_batch_size = self.global_batch_size // self.world_size
        full, rest = divmod(self.num_samples, self.global_batch_size)
        self._batches = full + (1 if rest and not self.drop_last else 0)

        # The position: global batches of epoch _epoch that the loop has received.
        self._epoch = 0
        self._pos = 0
        self._handed = 0  # global batches of _epoch the latest iteration has handed out
        self._iteration = 0  # id of the latest iteration; an older one may not draw again
        self._tracked = False  # whether the latest iteration runs under track()
        self._armed = False  # inside track()'s iter(loader): iterations started are tracked
        self._untracked = 0  # batches handed out outside track() since the position was known
        self._order_cache: tuple[int, torch.Tensor] | None = None

    # -- the order -------------------------------------------------------------------------

    def __len__(self) -> int:
        """Global batches per epoch (each rank gets its part of each)."""
        return self._batches

    @property
    def epoch(self) -> int:
        """The epoch of the next global batch the loop will receive."""
        return self._position()[0]

    def _order(self, epoch: int) -> torch.Tensor:
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                key = f"torchshard.GlobalBatchSampler:{self.seed}:{epoch}".encode()
                seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
                gen = torch.Generator().manual_seed(seed)
                order = torch.randperm(self.num_samples, generator=gen)
            else:
                order = torch.arange(self.num_samples)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _slice(self, epoch: int, start: int, stop: int) -> list[int]:
        positions = torch.arange(start, stop) % self.num_samples  # wraps only when padding
        return self._order(epoch)[positions].tolist()

    def global_batch(self, epoch: int, index: int) -> list[int]:
        """The sample indices of global batch ``index`` of ``epoch``, all ranks' parts in rank
        order: the same at every world size."""
        _check_int("GlobalBatchSampler.global_batch", "epoch", epoch, 0, "pass an epoch >= 0")
        if not 0 <= index < len(self):
            raise DataError(
                f"GlobalBatchSampler.global_batch: index: expected 0 <= index < {len(self)}, "
                f"got {index!r}; pass a global batch of the epoch"
            )
        start = index * self.global_batch_size
        return self._slice(epoch, start, start + self.global_batch_size)

    def _part(self, epoch: int, index: int) -> list[int]:
        start = index * self.global_batch_size + self.rank * self.local_batch_size
        return self._slice(epoch, start, start + self.local_batch_size)

    # -- iteration -------------------------------------------------------------------------

    def _position(self) -> tuple[int, int]:
        if self._pos >= self._batches:  # an epoch received in full: the next one starts
            return self._epoch + 1, 0
        return self._epoch, self._pos

    def _roll(self) -> None:  # only where no earlier iteration may draw any more
        self._epoch, self._pos = self._position()

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's part of each remaining global batch of the epoch (the next epoch's, if
        the loop has received all of this one)."""
        self._roll()
        self._iteration += 1
        self._tracked = self._armed  # every iter() inside iter(loader): a DataLoader calls two
        self._handed = self._pos  # batches drawn ahead by an abandoned iteration are redrawn
        return self._draw(self._iteration, self._epoch)

    def _draw(self, iteration: int, epoch: int) -> Iterator[list[int]]:
        while True:
            if iteration != self._iteration:
                raise DataError(
                    "GlobalBatchSampler: iterations: expected one at a time, got an earlier "
                    "iterator drawing after a newer one started (or after load_state_dict or "
                    "set_epoch); iterate one DataLoader over the sampler at a time"
                )
            index = self._handed
            if index >= self._batches:
                return
            self._handed = index + 1
            if not self._tracked:  # nobody counts what the consumer received: assume all
                self._pos = index + 1
                self._untracked += 1
            yield self._part(epoch, index)

    def track(self, loader: Iterable[T]) -> TrackedLoader[T]:
        """``loader``'s batches, counted as the loop receives them: iterate this, not ``loader``.

        ``loader`` is a DataLoader built with ``batch_sampler=self`` (in order, the default),
        or the sampler itself for a loop without a DataLoader. Each ``for`` over the result is
        one pass over the rest of the current epoch, like a ``for`` over the DataLoader.
        """
        if loader is not self:
            if getattr(loader, "batch_sampler", None) is not self:
                raise DataError(
                    "GlobalBatchSampler.track: loader: expected a DataLoader built with "
                    f"batch_sampler=this sampler (or the sampler itself), got a "
                    f"{type(loader).__name__} that does not draw from it; build "
                    "DataLoader(dataset, batch_sampler=sampler, ...) and track that"
                )
            in_order = getattr(loader, "in_order", True)
            if in_order is not True:
                raise DataError(
                    f"GlobalBatchSampler.track: loader.in_order: expected True, got {in_order!r}"
                    " (batches out of order cannot be counted as a position); build the "
                    "DataLoader with in_order=True"
                )
        return TrackedLoader(self, loader)

    def _start_tracked(self, loader: Iterable[T]) -> tuple[Iterator[T], int]:
        before, self._armed = self._iteration, True
        try:
            it = iter(loader)
        finally:
            self._armed = False
        if self._iteration == before:
            raise DataError(
                "GlobalBatchSampler.track: loader: expected iter(loader) to start an iteration "
                f"of this sampler, got a {type(loader).__name__} that did not; track a "
                "DataLoader built with batch_sampler=sampler"
            )
        return it, self._iteration

    def _received(self, iteration: int) -> None:
        if iteration != self._iteration or self._pos >= self._handed:
            raise DataError(
                "GlobalBatchSampler.track: batches: expected each batch the loop receives to "
                "have been drawn from the tracked iteration, got one that was not (another "
                "iteration of the sampler started, or the loader does not draw from it); "
                "iterate one tracked DataLoader over the sampler at a time"
            )
        self._pos += 1

    def _finished(self, iteration: int) -> None:
        if iteration == self._iteration and self._pos != self._batches:
            raise DataError(
                f"GlobalBatchSampler.track: batches: expected the loader to deliver the "
                f"epoch's {self._batches} global batches, got its end after {self._pos}; track "
                "a DataLoader built with batch_sampler=sampler"
            )

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, global batches of it the loop received) and what the order
        depends on: JSON values only, the same on every rank and at every world size.

        Raises DataError if batches were drawn outside :meth:`track` since the position was
        last known: a DataLoader with workers draws ahead, so that count may be wrong.
        """
        if self._untracked:
            raise DataError(
                "GlobalBatchSampler.state_dict: position: expected every batch drawn to be "
                f"counted when the loop received it, got {self._untracked} drawn outside "
                "track() (a DataLoader with workers draws ahead of the loop, so the sampler "
                "cannot tell how many were received); iterate `for batch in "
                "sampler.track(loader)`"
            )
        epoch, consumed = self._position()
        return {
            "version": _STATE_VERSION,
            "epoch": epoch,
            "consumed": consumed,
            **{key: getattr(self, key) for key in _COMPATIBLE},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, saved at any world size).

        The next iteration draws the rest of the saved epoch. Raises DataError if the state is
        malformed or was saved by a sampler with another order (number of samples, global
        batch size, seed, shuffle or drop_last): its position would mean other samples.
        """
        where = "GlobalBatchSampler.load_state_dict"
        if not isinstance(state, Mapping):
            raise DataError(
                f"{where}: state: expected a dict from state_dict(), got "
                f"{type(state).__name__}; pass what state_dict() returned"
            )
        missing = sorted({"version", "epoch", "consumed", *_COMPATIBLE} - set(state))
        if missing:
            raise DataError(
                f"{where}: state: expected the keys of state_dict(), got {sorted(state)} "
                f"(missing {missing}); pass what GlobalBatchSampler.state_dict() returned"
            )
        if state["version"] != _STATE_VERSION:
            raise DataError(
                f"{where}: version: expected {_STATE_VERSION}, got {state['version']!r}; load "
                "it with the torchshard version that saved it"
            )
        for key in _COMPATIBLE:
            mine, saved = getattr(self, key), state[key]
            if type(saved) is not type(mine) or saved != mine:
                raise DataError(
                    f"{where}: {key}: expected {saved!r} (the saved state's), got {mine!r} "
                    f"(this sampler's); build the sampler with {key}={saved!r} to continue "
                    "the saved epoch (the order depends on it), or do not load the state"
                )
        epoch = _check_int(where, "epoch", state["epoch"], 0, "pass what state_dict() returned")
        consumed = _check_int(
            where, "consumed", state["consumed"], 0, "pass what state_dict() returned"
        )
        if consumed > self._batches:
            raise DataError(
                f"{where}: consumed: expected at most the epoch's {self._batches} global "
                f"batches, got {consumed}; pass what state_dict() returned"
            )
        self._epoch, self._pos = epoch, consumed
        self._forget_iterations()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first global batch; a no-op if it is the current epoch.

        Not needed (epochs advance by themselves); the no-op keeps a resumed position when a
        loop written for DistributedSampler calls ``set_epoch(epoch)`` at each epoch's start.
        """
        _check_int("GlobalBatchSampler.set_epoch", "epoch", epoch, 0, "pass an epoch >= 0")
        if epoch != self.epoch:
            self._epoch, self._pos = epoch, 0
            self._forget_iterations()

    def _forget_iterations(self) -> None:
        self._iteration += 1  # an iterator started before may not draw any more
        self._roll()
        self._handed, self._tracked, self._untracked = self._pos, False, 0

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(num_samples={self.num_samples}, "
            f"global_batch_size={self.global_batch_size}, seed={self.seed}, "
            f"shuffle={self.shuffle}, drop_last={self.drop_last}, rank={self.rank}, "
            f"world_size={self.world_size})"
        )


class TrackedLoader(Generic[T]):
    """What :meth:`GlobalBatchSampler.track` returns: the loader's batches, unchanged, each
    counted in the sampler's position as the loop receives it.

    Each ``for`` over it is one pass over the rest of the current epoch. A loop that breaks
    out keeps the position it reached; the next pass starts there (batches the workers had
    prefetched are drawn again).
    """

    def __init__(self, sampler: GlobalBatchSampler, loader: Iterable[T]) -> None:
        self.sampler = sampler
        self.loader = loader

    def __iter__(self) -> Iterator[T]:
        it, iteration = self.sampler._start_tracked(self.loader)
        for batch in it:
            self.sampler._received(iteration)
            yield batch
        self.sampler._finished(iteration)
