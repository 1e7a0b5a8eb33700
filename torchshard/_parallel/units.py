"""Units of the fully sharded mode: contiguous runs of the flat layout, gathered one at a time.

A unit is a module (a transformer block) whose parameters are one contiguous run
of layout slots; the slots outside every unit form root units, one per maximal
run. Units tile ``[0, layout.numel)``: unit ``u`` is ``[its first slot's offset,
the next unit's first offset)``, so alignment gaps belong to the unit before and
the layout stays free of the world size. Each unit is cut over the ranks by its
own padded :class:`Geometry` (``start`` = the unit's offset): rank ``r`` holds
stripe ``r`` of every unit.

Pure functions of a module tree and a layout; no tensors, no process group.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._errors import TorchShardError, and_more
from .._flat.geometry import Geometry
from .._flat.layout import FlatLayout

__all__ = [
    "Unit",
    "UnitSpec",
    "layout_units",
    "resolve_units",
    "stripe_parts",
    "unit_geometry",
    "unit_pieces",
]

Piece = tuple[int, int, torch.dtype]
"""A flat ``[start, end)`` of one dtype."""

UnitSpec = str | Sequence[str | type] | Callable[[str, nn.Module], bool]
"""``"auto"``, a list of module names or classes, or ``(name, module) -> bool``."""


@dataclass(frozen=True)
class Unit:
    """Slots ``[lo, hi)`` of the layout, elements ``[start, end)`` of the flat buffer.

    ``root``: not a module the user named, but a run of slots outside every unit
    (embeddings, final norm, head); gathered for the whole step. ``kept``: gathered
    for the whole step too (a root unit, or a unit whose parameter is also used
    under another unit's name, a tied weight).
    """

    index: int
    name: str
    lo: int
    hi: int
    start: int
    end: int
    root: bool = False
    kept: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start


def unit_geometry(unit: Unit, world_size: int, align: int) -> Geometry:
    """The unit padded to ``world_size`` equal stripes of a multiple of ``align`` elements."""
    return Geometry(unit.numel, world_size, align, pad=True, start=unit.start)


def unit_pieces(layout: FlatLayout, unit: Unit, geometry: Geometry) -> list[Piece]:
    """What the fully sharded mode holds of ``unit`` in the master dtype (the optimizer's
    side), as flat ranges of one dtype: ``(start, end, dtype)``.

    Every parameter trains: the whole unit, padding included (``geometry``: the unit's),
    cut where the dtype changes (the padding is the unit's last dtype's). Some are frozen:
    the unit's trainable runs only (:meth:`FlatLayout.trainable_runs`, alignment gaps inside
    them included), cut so; a frozen weight, a gap between runs and the padding stay in the
    buffer's dtype (:func:`stripe_parts`), never in a master copy.

    Example::

        g = unit_geometry(unit, world, layout.align)
        for a, b, dtype in unit_pieces(layout, unit, g): ...
    """
    if layout.grad_layout is layout:
        runs = [(unit.start, geometry.start + geometry.total)]
    else:
        runs = [
            (max(a, unit.start), min(b, unit.end))
            for a, b, _ in layout.trainable_runs()
            if a < unit.end and b > unit.start
        ]
    regions = layout.regions
    starts = [r.start for r in regions]
    out = []
    for x, y in runs:
        while x < y:
            k = bisect.bisect_right(starts, x) - 1
            nxt = starts[k + 1] if k + 1 < len(starts) else y
            e = min(y, nxt) if nxt < unit.end else y  # the padding: the last dtype's
            out.append((x, e, regions[k].dtype))
            x = e
    return out


def stripe_parts(
    pieces: Sequence[Piece], a0: int, b0: int
) -> tuple[list[Piece], list[tuple[int, int]]]:
    """A rank's stripe ``[a0, b0)`` of a unit whose :func:`unit_pieces` are ``pieces``: the
    parts held in the master dtype (``(start, end, dtype)``) and the rest (``(start, end)``,
    held as the buffer holds it), each in flat order.

    Example::

        parts, rest = stripe_parts(unit_pieces(layout, unit, g), *g.range(rank))
    """
    parts = [(max(x, a0), min(y, b0), d) for x, y, d in pieces if max(x, a0) < min(y, b0)]
    rest, at = [], a0
    for x, y, _ in parts:
        if at < x:
            rest.append((at, x))
        at = y
    if at < b0:
        rest.append((at, b0))
    return parts, rest


def resolve_units(module: nn.Module, layout: FlatLayout, spec: UnitSpec = "auto") -> list[Unit]:
    """The units of ``module`` (wrapped by a FlatParamModule with ``layout``) for ``spec``.

    ``"auto"``: the instances of a transformers model's ``_no_split_modules``
    classes; for other models each child of the ``nn.ModuleList`` holding the most
    parameters. A list: modules with those names, or instances of those classes.
    A callable: modules for which ``spec(name, module)`` is true. Only the
    outermost match counts. Raises :class:`TorchShardError` when a unit's
    parameters are not one contiguous run of the layout.

    Example::

        units = resolve_units(model, fm.layout, [GPT2Block])
    """
    named = list(module.named_modules())
    pick = _matcher(module, named, spec)
    chosen: list[str] = []
    for name, m in named:
        if name and pick(name, m) and not any(_under(name, c) for c in chosen):
            chosen.append(name)
    return _tile(layout, chosen)


def layout_units(layout: FlatLayout) -> list[Unit]:
    """``"auto"`` from the layout's names alone (for :func:`plan_memory` without a module):
    the indexed children ``<prefix>.<i>`` of the prefix whose children hold the most
    elements, as the largest ``nn.ModuleList`` is found by :func:`resolve_units`."""
    sizes: dict[str, int] = {}
    for s in layout:
        for m in re.finditer(r"\.(\d+)\.", s.name):
            prefix = s.name[: m.start()]
            sizes[prefix] = sizes.get(prefix, 0) + s.numel
    if not sizes:
        return _tile(layout, [])
    best = max(sizes, key=lambda p: (sizes[p], -len(p)))
    chosen = sorted(
        {m.group(0) for s in layout if (m := re.match(re.escape(best) + r"\.\d+", s.name))},
        key=lambda n: int(n.rsplit(".", 1)[1]),
    )
    return _tile(layout, chosen)


def _matcher(
    root: nn.Module, named: list[tuple[str, nn.Module]], spec: UnitSpec
) -> Callable[[str, nn.Module], bool]:
    if isinstance(spec, str):
        if spec != "auto":
            raise TorchShardError(
                f"units: expected 'auto', a list of module names or classes, or a callable "
                f"(name, module) -> bool, got {spec!r}"
            )
        classes = _no_split_classes(root)
        if classes:
            return lambda _n, m: type(m).__name__ in classes
        lists = [(n, m) for n, m in named if isinstance(m, nn.ModuleList) and len(m)]
        if not lists:
            return lambda _n, _m: False
        best, _ = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
        return lambda n, _m: n.rpartition(".")[0] == best and n != best
    if callable(spec) and not isinstance(spec, type):
        return lambda n, m: bool(spec(n, m))  # type: ignore[operator]
    if isinstance(spec, (list, tuple)):
        names = {x for x in spec if isinstance(x, str)}
        classes_ = tuple(x for x in spec if isinstance(x, type))
        bad = [x for x in spec if not isinstance(x, (str, type))]
        if bad:
            raise TorchShardError(
                f"units: expected module names or classes, got {and_more([repr(x) for x in bad])}"
            )
        known = {n for n, _ in named}
        missing = sorted(names - known)
        if missing:
            raise TorchShardError(
                "units: the model has no module named "
                f"{and_more([repr(n) for n in missing])}; use names from model.named_modules()"
            )
        return lambda n, m: n in names or (bool(classes_) and isinstance(m, classes_))
    raise TorchShardError(
        f"units: expected 'auto', a list of module names or classes, or a callable, "
        f"got {type(spec).__name__}"
    )


def _no_split_classes(root: nn.Module) -> set[str]:
    """``_no_split_modules`` of every transformers model in the tree (class names)."""
    out: set[str] = set()
    for m in root.modules():
        names = getattr(type(m), "_no_split_modules", None) or getattr(m, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set)) and hasattr(m, "config"):
            out.update(n for n in names if isinstance(n, str))
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _tile(layout: FlatLayout, chosen: list[str]) -> list[Unit]:
    """Units for the modules named ``chosen`` (their slots: those whose first name is under
    the module), root units for the runs between, covering every slot and element."""
    slots = layout.slots
    owner: list[int | None] = [None] * len(slots)
    spans: list[tuple[int, int, str]] = []
    for k, name in enumerate(chosen):
        mine = [i for i, s in enumerate(slots) if _under(s.name, name)]
        if not mine:
            continue  # no parameter of its own (all tied to another unit's): nothing to shard
        lo, hi = mine[0], mine[-1] + 1
        if hi - lo != len(mine):
            foreign = next(i for i in range(lo, hi) if not _under(slots[i].name, name))
            raise TorchShardError(
                f"units: module {name!r} is not a contiguous run of the flat layout: slot "
                f"{foreign} ({slots[foreign].name!r}) lies between its parameters; a unit's "
                "parameters must be registered one after another (pass units= to choose others)"
            )
        for i in mine:
            owner[i] = k
        spans.append((lo, hi, name))
    spans.sort()
    runs: list[tuple[int, int, str, bool]] = []
    at = 0
    for lo, hi, name in spans:
        if at < lo:
            runs.append((at, lo, "", True))
        runs.append((lo, hi, name, False))
        at = hi
    if at < len(slots):
        runs.append((at, len(slots), "", True))
    # a slot used under a name in another unit (a tied weight) keeps its unit gathered
    kept_slots = set()
    for i, s in enumerate(slots):
        homes = {next((name for _, _, name in spans if _under(n, name)), "") for n in s.names}
        if len(homes) > 1:
            kept_slots.add(i)
    units = []
    for k, (lo, hi, name, root) in enumerate(runs):
        start = slots[lo].offset if k else 0
        end = slots[runs[k + 1][0]].offset if k + 1 < len(runs) else layout.numel
        label = name or f"<root {slots[lo].name}..{slots[hi - 1].name}>"
        kept = root or any(i in kept_slots for i in range(lo, hi))
        units.append(Unit(k, label, lo, hi, start, end, root=root, kept=kept))
    return units
