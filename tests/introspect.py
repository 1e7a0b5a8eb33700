"""The one place where tests look inside a trainer: every white-box read (or write) of the
trainer's strategy object and its private state goes through a function here, so renaming the
internals changes this file and no test.

Usage::

    import introspect

    geometries = introspect.unit_geometries(trainer)   # the fully sharded mode's stripes

What the trainer publishes is read through it, not here: ``trainer.memory_stats()``,
``reset_peak_memory()``, ``units``, ``local_shards()``. The functions here read today's
internals (``trainer._mode``: the mode object that ``shard=`` chose, see
``torchshard/_parallel/modes.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchshard import DistributedTrainer

__all__ = [
    "buckets_of",
    "gloo_collectives",
    "made_groups",
    "master_slice",
    "mode_of",
    "own_groups",
    "record_unit_mode_calls",
    "reducer_of",
    "release_all",
    "replicated_grad_store",
    "replicated_with_comm",
    "slice_range",
    "stripe_ranges",
    "stripes",
    "transient_bytes",
    "unit_buffers",
    "unit_geometries",
    "unit_storage_bytes",
]


def mode_of(trainer: DistributedTrainer) -> Any:
    """The strategy object behind ``trainer`` (replicated, sharded or fully sharded).

    Example::

        assert type(mode_of(trainer)).__name__ == "FullyShard"
    """
    return trainer._mode


# -- memory counters (the public ones: trainer.memory_stats(), reset_peak_memory()) --------
def transient_bytes(trainer: DistributedTrainer) -> int:
    """Bytes of unit buffers allocated now, by the mode's own counter: cheap enough to read at
    every op (``trainer.memory_stats().transient`` is the same number, with the whole
    memory_bytes() around it).

    Example::

        assert transient_bytes(trainer) == 0   # between steps
    """
    return getattr(mode_of(trainer), "transient", 0)


# -- the fully sharded mode's units (trainer.units is public) ---------------------------------
def unit_geometries(trainer: DistributedTrainer) -> tuple[Any, ...]:
    """Each unit's stripe geometry (``Geometry``: ``total`` padded elements, ...), by unit.

    Example::

        largest = max(g.total for g in unit_geometries(trainer)) * itemsize
    """
    return tuple(mode_of(trainer).storage.geometries)


def unit_buffers(trainer: DistributedTrainer) -> tuple[torch.Tensor, ...]:
    """Each unit's full buffer (its storage is empty while the unit is not gathered).

    Example::

        assert all(b.untyped_storage().nbytes() == 0 for b in unit_buffers(trainer))
    """
    return tuple(mode_of(trainer).storage.buffers)


def unit_storage_bytes(trainer: DistributedTrainer) -> int:
    """Bytes the unit buffers hold in storage now: real storage, not the mode's counter.

    Example::

        trainer.step()
        assert unit_storage_bytes(trainer) == 0   # nothing stays gathered between steps
    """
    return sum(b.untyped_storage().nbytes() for b in unit_buffers(trainer))


def stripes(trainer: DistributedTrainer) -> torch.Tensor:
    """This rank's stripes of every unit, in the master dtype: what a load writes and the
    optimizer updates with ``shard="full"`` (there is no flat buffer).

    Example::

        assert stripes(trainer).dtype == torch.float32
    """
    return mode_of(trainer).storage.stripe_weights


def stripe_ranges(trainer: DistributedTrainer) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of the flat layout that this rank's stripes hold.

    Example::

        held = sum(b - a for a, b in stripe_ranges(trainer))
    """
    return mode_of(trainer).storage.stripe_ranges()


def release_all(trainer: DistributedTrainer) -> None:
    """Free every gathered unit (after its stripes were written other than by a step).

    Example::

        stripes(trainer).copy_(saved)
        release_all(trainer)
    """
    mode_of(trainer).storage.release_all()


def made_groups(trainer: DistributedTrainer) -> bool:
    """Whether ``shard="full"`` created gather and reduce-scatter groups of its own.

    Example::

        assert made_groups(trainer) is True
    """
    return bool(mode_of(trainer).comm.made_groups)


@contextlib.contextmanager
def gloo_collectives(how: str) -> Iterator[None]:
    """Within the block, ``shard="full"`` on gloo gathers and reduces its units the ``how``
    way (``"owner"``: a broadcast and a reduce per owner; ``"native"``: all-gather and
    reduce-scatter); the default is restored after.

    Example::

        with gloo_collectives("native"):
            trainer = DistributedTrainer(fm, shard="full")
    """
    from torchshard._parallel.full import FullyShard

    before = FullyShard.native_gloo
    FullyShard.native_gloo = how == "native"
    try:
        yield
    finally:
        FullyShard.native_gloo = before


@contextlib.contextmanager
def record_unit_mode_calls(*methods: str) -> Iterator[list[str]]:
    """Within the block, the name of each call of the fully sharded mode's ``methods`` (e.g.
    ``"adopt"``, ``"gather"``), in call order, appended to the list it yields.

    Example::

        with record_unit_mode_calls("gather") as calls:
            trainer.module(x)
        assert calls
    """
    import torchshard._parallel.full as full

    calls: list[str] = []
    cls = full.FullyShard
    real = {m: getattr(cls, m) for m in methods}
    for name, fn in real.items():

        def record(self: Any, *a: Any, _real: Any = fn, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return _real(self, *a, **kw)

        setattr(cls, name, record)
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(cls, name, fn)


def own_groups(trainer: DistributedTrainer) -> tuple[dist.ProcessGroup, ...]:
    """The process groups the trainer created for itself (and destroys at close).

    Example::

        groups = own_groups(trainer)
        trainer.close()   # each of them destroyed
    """
    return tuple(mode_of(trainer).own_groups())


# -- the bucket modes --------------------------------------------------------------------------
@contextlib.contextmanager
def replicated_with_comm(comm_type: type) -> Iterator[None]:
    """Trainers built inside the block with ``shard=False`` reduce their buckets through
    ``comm_type`` (a :class:`~torchshard._parallel.comm.BucketComm`), e.g. a test-only one.

    Example::

        with replicated_with_comm(ReduceThenBroadcast):
            trainer = DistributedTrainer(fm)
    """
    from torchshard._parallel import trainer as trainer_module
    from torchshard._parallel.replicated import Replicated

    pick = trainer_module._pick_mode
    trainer_module._pick_mode = lambda *_: (Replicated(comm=comm_type), False)
    try:
        yield
    finally:
        trainer_module._pick_mode = pick


def reducer_of(trainer: DistributedTrainer) -> Any:
    """The trainer's gradient sync (the bucket reducer, or the fully sharded mode's).

    Example::

        assert isinstance(reducer_of(trainer).comm, AllReduce)
    """
    return trainer._reducer


def buckets_of(trainer: DistributedTrainer) -> tuple[Any, ...]:
    """The trainer's gradient buckets (``Bucket``: ``[start, end)`` of the gradient space,
    ``index`` in launch order).

    Example::

        sizes = [b.end - b.start for b in buckets_of(trainer)]
    """
    return tuple(trainer._buckets)


def replicated_grad_store(trainer: DistributedTrainer) -> torch.Tensor | None:
    """The bucket reducer's reduction buffer: [used-parameter mask | padding | flat gradient]
    (``None`` when no mask rides in a bucket).

    Example::

        mask = replicated_grad_store(trainer).numel() - fm.flat_grad.numel()
    """
    return reducer_of(trainer)._store


def master_slice(trainer: DistributedTrainer) -> torch.Tensor | None:
    """``shard=True``'s master copy of this rank's slice (``None`` without one).

    Example::

        assert master_slice(trainer).dtype == torch.float32
    """
    return mode_of(trainer)._master


def slice_range(trainer: DistributedTrainer, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the flat buffer that ``rank`` owns with ``shard=True``.

    Example::

        s0, e0 = slice_range(trainer, dist.get_rank())
    """
    return trainer._geometry.range(rank)
