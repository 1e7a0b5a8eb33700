"""The parallel modes, one registry line each: the one place a mode is named.

``DistributedTrainer(shard=...)``, :func:`plan_memory`, ``torchshard estimate`` and the
command line read :data:`MODES`; nothing else spells a mode. A line holds:

- ``choice``: the frozen dataclass users pass as ``shard=`` (:class:`Replicate`,
  :class:`ShardOptimizer`, :class:`FullShard`), its fields the mode's settings;
- ``alias``: the older ``shard=`` value for it (``False``, ``True``, ``"full"``), which
  ``trainer.shard`` still reports;
- ``build``: the class that implements it, made from a choice;
- ``memory``: how its memory is planned (a model of ``footprint.py``);
- ``name``, ``flag``, ``help``: the estimate's label and its command-line option.

Adding a mode is a file (its ``Mode`` subclass) and a line here: CONTRIBUTING.md,
"Adding a mode".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch

from .._errors import TorchShardError
from .footprint import MemoryModel, Request, Slices, Stripes, Whole
from .full import FullyShard
from .mode import Mode
from .replicated import Replicated
from .sharded import ShardedOptimizer
from .units import Unit, UnitSpec

__all__ = [
    "ALIASES",
    "MODES",
    "Choice",
    "FullShard",
    "ModeEntry",
    "ModeError",
    "Replicate",
    "ShardOptimizer",
    "choose",
    "entry_for",
    "is_alias",
    "listing",
]


class ModeError(TorchShardError, ValueError):
    """A ``shard=`` value that names no mode, or a setting that does not fit the mode."""


@dataclass(frozen=True, kw_only=True)
class Replicate:
    """Every rank holds and updates every weight; gradients are all-reduced in buckets
    during backward, as DDP does. The same as ``shard=False``.

    Example::

        trainer = torchshard.DistributedTrainer(fm, shard=torchshard.Replicate())
    """


@dataclass(frozen=True, kw_only=True)
class ShardOptimizer:
    """Optimizer state sharded (ZeRO-1/2): each rank owns one equal slice of the padded
    flat buffer, its gradient is reduced to the owner, and the updated slices are
    all-gathered after the step. The same as ``shard=True``.

    Example::

        fm = torchshard.FlatParamModule(model, dtype=torch.bfloat16)
        shard = torchshard.ShardOptimizer(master_dtype=torch.float32)
        trainer = torchshard.DistributedTrainer(fm, shard=shard)
    """

    master_dtype: torch.dtype = torch.float32
    """What the optimizer updates when the flat buffer's dtype is narrower (e.g. bf16); a
    wider model (float64) keeps its own dtype, with no master."""


@dataclass(frozen=True, kw_only=True)
class FullShard:
    """Fully sharded (ZeRO-3): each rank holds only its stripe of every unit's weights,
    gradients and optimizer state; a unit is gathered for its forward and its backward.

    Example::

        shard = torchshard.FullShard(units="auto", prefetch=1, reshard_after_forward=True)
        trainer = torchshard.DistributedTrainer(fm, shard=shard)
    """

    master_dtype: torch.dtype = torch.float32
    """What the optimizer updates when the model's dtype is narrower (e.g. bf16); a wider
    model (float64) keeps its own dtype, with no master."""
    units: UnitSpec = "auto"
    """The modules gathered one at a time: ``"auto"`` (a transformers model's
    ``_no_split_modules`` blocks, else each child of the largest ``nn.ModuleList``),
    module names or classes, or ``(name, module) -> bool``."""
    prefetch: int = 1
    """Units gathered ahead of the one running."""
    reshard_after_forward: bool = True
    """Free a unit after its forward (gather it again for backward); ``False`` keeps it."""

    def __post_init__(self) -> None:
        p = self.prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ModeError(f"prefetch: expected an int >= 0, got {p!r}")
        if self.reshard_after_forward not in (True, False):
            raise ModeError(
                f"reshard_after_forward: expected True or False, got {self.reshard_after_forward!r}"
            )


Choice = Replicate | ShardOptimizer | FullShard
"""What ``shard=`` takes besides the aliases (one type per line of :data:`MODES`)."""


@dataclass(frozen=True, kw_only=True)
class ModeEntry:
    """One mode: its choice type, its alias, its implementation and its memory model."""

    name: str
    """The estimate's label: a column of its table, a key of its JSON."""
    choice: type[Any]
    alias: bool | str
    """The older ``shard=`` value for this mode; what ``trainer.shard`` reports."""
    build: Callable[[Any], Mode]
    """The mode's implementation, from a choice."""
    memory: MemoryModel
    """How its memory is planned (``footprint.py``)."""
    flag: str
    """``torchshard estimate``'s option that picks it."""
    help: str

    @property
    def settings(self) -> tuple[str, ...]:
        """The choice's fields: the keywords this mode takes."""
        return tuple(f.name for f in fields(self.choice))

    @property
    def gathers(self) -> bool:
        """Units gathered in turn: planned with units, and unit buffers as ``transient``."""
        return "units" in self.settings

    @property
    def master(self) -> bool:
        """Keeps what the optimizer updates in ``master_dtype`` (below it: the model's dtype)."""
        return "master_dtype" in self.settings

    def request(self, choice: Any, optimizer: str, units: Iterable[Unit] = ()) -> Request:
        """What its memory model is asked for ``choice`` (the fields that size memory)."""
        sizing = {f.name for f in fields(Request)} & set(self.settings) - {"units"}
        given = {name: getattr(choice, name) for name in sizing}
        return Request(optimizer=optimizer, units=tuple(units), **given)


MODES: tuple[ModeEntry, ...] = (
    ModeEntry(
        name="replicated",
        choice=Replicate,
        alias=False,
        build=lambda c: Replicated(),
        memory=Whole(),
        flag="--replicated",
        help="the replicated mode",
    ),
    ModeEntry(
        name="sharded",
        choice=ShardOptimizer,
        alias=True,
        build=lambda c: ShardedOptimizer(c.master_dtype),
        memory=Slices(),
        flag="--shard",
        help="the sharded mode (shard=True)",
    ),
    ModeEntry(
        name="full",
        choice=FullShard,
        alias="full",
        build=lambda c: FullyShard(c.master_dtype, c.units, c.prefetch, c.reshard_after_forward),
        memory=Stripes(),
        flag="--full",
        help="the fully sharded mode (shard='full')",
    ),
)
"""Every mode, in the estimate's column order."""

ALIASES: tuple[bool | str, ...] = tuple(e.alias for e in MODES)
"""The older ``shard=`` values, in :data:`MODES` order."""

# shard=False always took master_dtype and ignored it (no master to keep): it still does
_IGNORED = frozenset({"master_dtype"})


def listing(values: Iterable[object], conjunction: str) -> str:
    """``"False, True and 'full'"``: reprs joined for a message."""
    *head, last = [repr(v) for v in values]
    return f"{', '.join(head)} {conjunction} {last}" if head else last


def _is(shard: object, alias: bool | str) -> bool:
    # a bool alias is that object (1 is no alias of True); a str alias any equal str
    return shard is alias if isinstance(alias, bool) else isinstance(shard, str) and shard == alias


def is_alias(shard: object) -> bool:
    """Whether ``shard`` is one of the older ``shard=`` values (:data:`ALIASES`).

    Example::

        is_alias(True), is_alias(1)   # (True, False)
    """
    return any(_is(shard, a) for a in ALIASES)


def entry_for(shard: object) -> ModeEntry:
    """The registry line for ``shard``: a choice (``FullShard()``) or an alias (``"full"``).

    Example::

        entry_for(True).name                           # "sharded"
        entry_for(FullShard(prefetch=2)).memory        # Stripes()
    """
    for e in MODES:
        if isinstance(shard, e.choice) or _is(shard, e.alias):
            return e
    bools_first = sorted(ALIASES, key=lambda a: (not isinstance(a, bool), not a))
    raise ModeError(f"shard: expected {listing(bools_first, 'or')}, got {shard!r}")


def choose(shard: object, *, strict: bool, **loose: Any) -> Choice:
    """``shard=`` and the loose keywords beside it (``master_dtype=``, ``units=``, ...) as one
    typed choice; each keyword at its default (the choice's) asks for nothing.

    An alias takes the keywords its choice has as fields. ``strict`` (the trainer): a
    keyword of another mode that asks for something raises, naming that mode; otherwise
    (the planner) it is ignored. A choice takes its settings inside it: a keyword beside
    it that asks for something raises.

    Example::

        choose("full", strict=True, prefetch=2)     # FullShard(prefetch=2)
        choose(FullShard(prefetch=2), strict=True)  # the same
    """
    entry = entry_for(shard)
    asks = {k: v for k, v in loose.items() if _asks(k, v)}
    kind = type(shard).__name__
    if isinstance(shard, entry.choice):
        for name, value in asks.items():
            how = (
                f"pass {kind}({name}=...)" if name in entry.settings else f"{kind} takes no {name}"
            )
            raise ModeError(
                f"{name}: expected the mode's settings inside shard={shard!r}, got {value!r} "
                f"beside it; {how}"
            )
        return shard  # type: ignore[return-value]
    for name, value in asks.items():
        if strict and name not in entry.settings and name not in _IGNORED:
            owner = next(e for e in MODES if name in e.settings)
            raise ModeError(
                f"{name}: only with shard={owner.alias!r}, got {value!r} with shard={shard!r}"
            )
    taken = {k: v for k, v in loose.items() if k in entry.settings}
    return entry.choice(**taken)  # type: ignore[no-any-return]


def _asks(name: str, value: object) -> bool:
    """Whether a loose keyword asks for anything: it differs from the default of the choice
    that has it as a field (a value that choice refuses, e.g. ``prefetch=True``, differs)."""
    owner = next(e for e in MODES if name in e.settings)
    default = next(f.default for f in fields(owner.choice) if f.name == name)
    try:
        made = owner.choice(**{name: value})
    except ModeError:
        return True
    return bool(getattr(made, name) != default)
