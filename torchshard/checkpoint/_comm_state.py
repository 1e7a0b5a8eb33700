"""A lossy comm's state in a save and a load (the format: ``_comm_meta``).

Save (:func:`snapshot_comm`): the trainer's ``comm_state()``; the error feedback averaged
over the ranks (one all-reduce, in the gradient's dtype), the other flat tensors (PowerSGD's
``Q``, the same on every rank) as they are, each cut to this rank's :func:`comm_ranges` and
copied (the live buffers change at the next backward), and the step count.

Load (:func:`read_comm`, then :func:`apply_comm` once every rank has read its part): every
rank ends with the saved mean error (each reads equal parts, one all-gather completes them),
at any world size. What of the saved state fits the live comm, and what is dropped:

- saved and live comm keep the same tensors: all of it loads (``comm_error="reset"``: the
  error starts at zero instead, ``Q`` and ``steps`` load);
- the live comm keeps no state (``AllReduce``, ``BF16``, ...): all of it is dropped;
- the checkpoint holds none (a dense run, or one saved before format 5): the live error
  feedback starts at zero; its ``Q`` and step count stay the trainer's;
- another class, or other settings than ``start_step`` (PowerSGD's ``rank`` or
  ``min_compression``: ``Q`` of another shape): the error and ``steps`` load, the saved
  ``Q`` is dropped and the trainer keeps its own.

Each case but the first says so in ``CheckpointInfo.comm`` and, on rank 0, a warning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._errors import CheckpointError
from .._log import get_logger
from ._comm_meta import ERROR, comm_json, comm_ranges, describe
from ._metadata import Metadata, Readers
from ._reads import BROADCAST_BACKENDS, gather_whole, whole_ranges
from ._target import Target
from ._tp_comm import saved_tp, tp_numel, tp_read, tp_snapshot

__all__ = ["COMM_ERROR", "CommRead", "CommSnapshot", "apply_comm", "read_comm", "snapshot_comm"]

logger = get_logger(__name__)

COMM_ERROR = ("mean", "reset")
"""What ``load(..., comm_error=...)`` does with a saved error feedback: load the mean, or
start from zero (TopK, for which the mean is an approximation)."""


@dataclass(frozen=True)
class _Live:
    """The live comm: its class name and settings (``""``, ``{}``: no trainer), its state."""

    cls: str
    settings: dict[str, object]
    state: dict[str, torch.Tensor]

    @classmethod
    def of(cls, t: Target) -> _Live:
        trainer = t.trainer
        get = getattr(trainer, "comm_state", None)
        if trainer is None or get is None:
            return cls("", {}, {})
        comm = getattr(trainer, "comm", None)
        settings = {}
        if dataclasses.is_dataclass(comm) and not isinstance(comm, type):
            settings = {f.name: getattr(comm, f.name) for f in dataclasses.fields(comm)}
        return cls(type(comm).__name__, settings, get())

    def __str__(self) -> str:
        return describe(self.cls, self.settings) if self.cls else "a FlatParamModule (no comm)"


@dataclass(frozen=True)
class CommSnapshot:
    """This rank's part of a save's compression state: its ranges of each flat tensor (new
    tensors, on the trainer's device) and the ``"comm"`` section (``None``: no state)."""

    section: dict[str, object] | None = None
    tensors: tuple[tuple[str, torch.Tensor], ...] = ()


@torch.no_grad()
def snapshot_comm(t: Target) -> CommSnapshot:
    """The compression state of ``t``'s comm as a save writes it: one all-reduce of the error
    (every rank calls it, after the optimizer's scalars and before the exchanges).

    Example::

        snap = snapshot_comm(Target(trainer))  # snap.tensors: [("error", ...), ...]
    """
    live = _Live.of(t)
    state = live.state
    if not state:
        return CommSnapshot()
    if t.tp is not None:  # the whole model's picture, at the mesh's world size: _tp_comm
        return CommSnapshot(*tp_snapshot(t, live.cls, live.settings, state))
    flat = {n: x.detach() for n, x in sorted(state.items()) if x.dim() == 1}
    if ERROR in flat:
        mean = flat[ERROR].clone()
        if t.world > 1:
            dist.all_reduce(mean, group=t.group)
            mean.div_(t.world)
        flat[ERROR] = mean
    tensors = []
    for name, x in flat.items():
        a, b = comm_ranges(x.numel(), t.world)[t.rank]
        if b > a:  # a copy: the live buffers change at the next backward
            tensors.append((name, x[a:b].clone()))
    scalars = {n: int(x.item()) for n, x in sorted(state.items()) if x.dim() == 0}
    shapes = {n: (x.dtype, x.numel()) for n, x in flat.items()}
    section = comm_json(live.cls, live.settings, scalars, shapes, t.world)
    return CommSnapshot(section, tuple(tensors))


@dataclass(frozen=True)
class CommRead:
    """What a load does with the compression state, decided and read before anything
    changed: this rank's equal parts of each tensor to load (host, whole-sized), the
    integers to load, whether the error starts at zero, and what it says (``note``)."""

    note: str
    warn: bool
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    scalars: dict[str, int] = dataclasses.field(default_factory=dict)
    reset: bool = False
    complete: bool = False  # a split module's: each tensor read whole, nothing to gather


def check_comm_error(comm_error: object) -> str:
    """``comm_error`` if it is one of :data:`COMM_ERROR`, else :class:`CheckpointError`."""
    if not isinstance(comm_error, str) or comm_error not in COMM_ERROR:
        raise CheckpointError(
            f"comm_error: expected 'mean' (load the saved mean error feedback) or 'reset' "
            f"(start it at zero), got {comm_error!r}"
        )
    return comm_error


def read_comm(meta: Metadata, t: Target, readers: Readers, comm_error: str) -> CommRead | None:
    """Decide what of ``meta``'s compression state the live comm takes (the module
    docstring) and read this rank's part of it; ``None`` when neither side has any."""
    now = _Live.of(t)
    live, saved, where = now.state, meta.comm, meta.path
    if saved is None:
        if not live:
            return None
        note = (
            f"{where}: holds no compression state; {now} starts with zero error "
            "feedback (its Q and step count stay this trainer's)"
        )
        return CommRead(note, True, reset=True)
    if not live:
        held = ", ".join([*saved.flat, *saved.scalars])
        note = f"{where}: the compression state of {saved} ({held}) is dropped: {now} keeps none"
        return CommRead(note, True)
    same = saved.cls == now.cls and _shaping(saved.settings) == _shaping(now.settings)
    loaded, kept, moved, tensors = [], [], [], {}
    degrees = (saved_tp(meta), t.tp.size if t.tp is not None else 1)
    for name, x in live.items():
        if x.dim() == 0:
            continue
        spec, numel = saved.flat.get(name), tp_numel(t, name, x)
        if name == ERROR and (spec is None or spec[1] != numel):
            got = "none" if spec is None else f"{spec[1]} elements"
            raise CheckpointError(
                f"{where}: comm error feedback: expected {numel} elements, got {got}"
            )
        if name != ERROR and spec is not None and degrees[0] != degrees[1]:
            moved.append(name)  # of another degree's pieces (_tp_comm)
        elif spec is None or spec[1] != numel or (name != ERROR and not same):
            kept.append(name)
        elif not (name == ERROR and comm_error == "reset"):
            read = _read if t.tp is None else tp_read
            tensors[name] = read(meta, readers, t, name, x)
            loaded.append(
                f"{name} (the mean over {_ranks(meta.world_size)})" if name == ERROR else name
            )
    scalars = {n: v for n, v in saved.scalars.items() if n in live and live[n].dim() == 0}
    loaded += [f"{n}={v}" for n, v in scalars.items()]
    dropped = [n for n in saved.flat if n not in live]
    unfit = [n for n in kept if n in saved.flat]
    note = f"{where}: loaded {', '.join(loaded) or 'nothing'} of {saved} into {now}"
    if comm_error == "reset":
        note += "; the error feedback starts at zero (comm_error='reset')"
    if dropped:
        note += f"; dropped the saved {', '.join(dropped)}: {now} keeps none"
    if unfit:
        note += f"; the saved {', '.join(unfit)} does not fit {now}: it keeps its own"
    if len(unfit) < len(kept):
        note += f"; kept this trainer's {', '.join(n for n in kept if n not in unfit)}"
    if moved:
        note += (
            f"; the saved {', '.join(moved)} is of tp={degrees[0]}'s pieces, this trainer "
            f"splits at tp={degrees[1]}: it keeps its own (a degree change resets Q)"
        )
    warn, reset = bool(dropped or kept or moved), comm_error == "reset"
    return CommRead(note, warn, tensors, scalars, reset, t.tp is not None)


def _ranks(n: int) -> str:
    return "1 rank" if n == 1 else f"{n} ranks"


def _shaping(settings: dict[str, object]) -> dict[str, object]:
    """The settings that shape a comm's own tensors: all but when it starts compressing."""
    return {k: v for k, v in settings.items() if k != "start_step"}


def _read(meta: Metadata, readers: Readers, t: Target, name: str, _: object) -> torch.Tensor:
    """Flat tensor ``name`` in host memory, whole-sized, holding this rank's equal parts
    (:func:`~._reads.whole_ranges`); an all-gather completes it (:func:`apply_comm`)."""
    assert meta.comm is not None
    dtype, numel = meta.comm.flat[name]
    held = {file: ranges[name] for file, ranges in meta.comm.files if name in ranges}
    host = torch.empty(numel, dtype=dtype)  # the rest: the other ranks' parts, gathered
    for start, end in whole_ranges(t, numel):
        for file, a, b, at in meta.comm.pieces(name, start, end):
            readers.entry(file, name, dtype, (held[file][1] - held[file][0],))
            readers[file].read_into(name, a, b, host[start + at : start + at + b - a])
    return host


@torch.no_grad()
def apply_comm(t: Target, read: CommRead | None) -> str:
    """Complete and load what :func:`read_comm` read (a collective per tensor: every rank
    calls it); returns what it did (``""``: nothing to do), warned on rank 0 where it drops
    or resets something the user may not expect."""
    if read is None:
        return ""
    live = _Live.of(t).state
    if read.tensors or read.scalars:
        trainer = t.trainer
        assert trainer is not None
        by_broadcast = t.world > 1 and dist.get_backend(t.group) in BROADCAST_BACKENDS
        state = dict(live)
        for name, host in read.tensors.items():
            full = host.to(live[name].device)
            for work in (
                ()
                if read.complete
                else gather_whole(full, full.numel(), t, by_broadcast=by_broadcast)
            ):
                work.wait()
            state[name] = full
        for name, value in read.scalars.items():
            state[name] = torch.tensor(value, dtype=torch.int64)
        trainer.load_comm_state(state)  # type: ignore[attr-defined]
    if read.reset:
        t.trainer.reset_comm_error()  # type: ignore[union-attr]
    if t.rank == 0:
        (logger.warning if read.warn else logger.info)("%s", read.note)
    return read.note
