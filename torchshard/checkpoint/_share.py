"""One rank's share of a save: what it writes, as a list of items planned once.

The steps, in order (DCP's local plan, write items and resolve):

1. the optimizer's scalar state is agreed on (a collective when its state is sharded);
2. one :class:`~._plan.SharePlan` holds every cut of the files this save needs;
3. the share is a list of :class:`Item` (name, shape, dtype, fill), built once from
   the plan and carved once into host memory: a fill is a live tensor (copied when
   staged, written as it is otherwise) or an exchange that assembles the item;
4. the exchanges run, in the same order on every rank;
5. the files' entries are views of the items' host tensors.

Where this rank holds the range of the files it writes (the flat buffer holds every
weight; its local shards hold its range of the optimizer state), it writes in
place; otherwise its share is exchanged from every rank's local shards
(:meth:`~._stripes.Stripes.assemble`). Ranges that are zeros (padding, parameters
without optimizer state) are counts, never items.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._flat.hf import transformers_config
from ._format import build_metadata, step_dir
from ._optim import OptimizerView
from ._plan import Piece, SharePlan, plan_share, stored_parts
from ._staging import Copy
from ._target import Target

__all__ = ["Item", "Share", "collect"]

Carve = Callable[[list[tuple[torch.Size, torch.dtype]]], list[torch.Tensor]]


@dataclass(eq=False)
class Item:
    """One host tensor of a share: its ``name`` (for messages), ``shape`` and ``dtype``, and
    its ``fill``: a live tensor to copy, or a collective that assembles it into the host
    tensor (``host``, set once the share is carved).

    Example::

        Item("weights", run.shape, run.dtype, run)  # copied from the flat buffer's run
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    fill: torch.Tensor | Callable[[torch.Tensor], None]
    host: torch.Tensor | None = None

    @property
    def live(self) -> bool:
        """Whether the fill is a live tensor (a copy), not an exchange."""
        return isinstance(self.fill, torch.Tensor)


@dataclass
class Share:
    """This rank's part of one save, staged in host memory (or the live tensors themselves)."""

    path: Path
    step: int
    plan: SharePlan
    weights: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # per state key: its dtype and its pieces in order (a tensor, or a count of zeros)
    optim: list[tuple[str, torch.dtype, list[torch.Tensor | int]]] = field(default_factory=list)
    metadata: dict[str, Any] | None = None  # rank 0 only, without "files"
    buffer_bytes: int = 0


def _part(view: OptimizerView, piece: Piece, key: str) -> torch.Tensor | None:
    """Piece ``piece`` of the flat state ``key``; ``None`` where it is zeros."""
    if piece.segment is None:
        return None
    seg = view.segments[piece.segment]
    src = view.source(seg, key)
    return None if src is None else src[piece.start - seg.start : piece.end - seg.start]


class _Items:
    """The items of one share, from its plan: module buffers, weights, optimizer state."""

    def __init__(self, t: Target, plan: SharePlan, view: OptimizerView | None) -> None:
        self.t, self.plan, fm = t, plan, t.fm
        self.buffers = [
            (name, Item(name, b.shape, b.dtype, b.detach()))
            for name, b in (t.buffers() if t.rank == 0 else {}).items()
        ]
        self.weights: Item | None = None
        (lo, hi), span = plan.slots, plan.span
        self.base = span[0]  # the flat element at the start of the weights item
        flat = fm.flat_param
        if flat is not None:  # every weight is here: this rank's run, in place
            if hi > lo:
                run = flat.detach()[span[0] : span[1]]
                self.weights = Item("weights", run.shape, fm.dtype, run)
        else:  # from every rank's local shards, by an exchange (every rank takes part)
            stripes = t.stripes
            assert stripes is not None
            (self.base, end), tiles = plan.tile, list(plan.tiles)

            def weights(host: torch.Tensor) -> None:
                stripes.assemble(tiles, host, None)

            self.weights = Item("weights", torch.Size([end - self.base]), fm.dtype, weights)
        self.optim: list[tuple[str, torch.dtype, list[Item | int]]] = []
        if view is not None and plan.state_ranges:
            # the optimizer holds whole parameters, or local shards that hold what the file
            # stores of the range
            stored = stored_parts(fm.layout, *plan.state_range)
            if not t.owns_state(view.optimizer) or all(t.covers((a, b)) for a, b, _ in stored):
                self._state_in_place(view)
            else:
                self._state_exchanged(view)

    def _state_in_place(self, view: OptimizerView) -> None:
        for key, dtype in view.flat_keys.items():
            pieces: list[Item | int] = []
            for p in self.plan.pieces:
                src = _part(view, p, key)
                name = f"{key}[{p.start}:{p.end}]"
                pieces.append(p.end - p.start if src is None else Item(name, src.shape, dtype, src))
            self.optim.append((key, dtype, pieces))

    def _state_exchanged(self, view: OptimizerView) -> None:
        stripes, (s0, e0) = self.t.stripes, self.plan.state_range
        assert stripes is not None
        ranges = list(self.plan.state_ranges)
        stored = stored_parts(self.t.fm.layout, s0, e0)
        dense = stored == [(s0, e0, 0)]
        n = sum(b - a for a, b, _ in stored)
        for key, dtype in view.flat_keys.items():
            parts = [(seg.start, seg.end, view.source(seg, key)) for seg in view.segments]

            def fill(host: torch.Tensor, parts: list = parts) -> None:
                if dense:
                    stripes.assemble(ranges, host, parts)
                    return
                # the whole range, transiently, then the parts the file stores
                whole = torch.empty(e0 - s0, dtype=host.dtype)
                stripes.assemble(ranges, whole, parts)
                for a, b, at in stored:
                    host[at : at + b - a].copy_(whole[a - s0 : b - s0])

            self.optim.append((key, dtype, [Item(key, torch.Size([n]), dtype, fill)]))

    def all(self) -> list[Item]:
        """Every item, in the order of the host memory: those copied from live tensors (the
        module buffers first), then those assembled."""
        items = [item for _, item in self.buffers]
        items += [self.weights] if self.weights is not None else []
        items += [x for _, _, pieces in self.optim for x in pieces if isinstance(x, Item)]
        return [x for x in items if x.live] + [x for x in items if not x.live]

    def exchanges(self) -> list[Item]:
        """The items assembled by an exchange, in the order every rank runs them: the
        weights, then the optimizer state by key."""
        ordered = [self.weights] if self.weights is not None else []
        for _, _, pieces in sorted(self.optim, key=lambda o: o[0]):
            ordered += [x for x in pieces if isinstance(x, Item)]
        return [x for x in ordered if not x.live]


def collect(
    t: Target,
    root: Path,
    step: int,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    carve: Carve | None,
    frozen: bool = True,
) -> tuple[Share, list[Copy], list[Copy]]:
    """This rank's share (the steps of the module docstring), and the copies that stage it
    into the host tensors ``carve`` hands out (``None``: the files are written straight
    from the live tensors, for a save the caller waits for): the module buffers' copies,
    then the others. Exchanged items are assembled here, by collectives, into host
    tensors (``carve``'s, or new ones).

    Example::

        share, early, late = collect(Target(trainer), root, 100, opt, {}, arena_carve)
        # share.weights / share.optim: the files' entries; early, late: (host, source) copies
    """
    layout = t.fm.layout
    view = OptimizerView.of(optimizer, t) if optimizer is not None else None
    scalars = view.agree(t) if view is not None else ({}, "")  # 1. a collective when sharded
    segments = None
    if view is not None and view.flat_keys:
        segments = [(seg.start, seg.end) for seg in view.segments]
    plan = plan_share(layout, t.world, t.rank, segments)  # 2.
    items = _Items(t, plan, view)  # 3.
    order = items.all()
    if carve is not None:
        for item, host in zip(order, carve([(x.shape, x.dtype) for x in order])):
            item.host = host
    else:
        for item in order:
            fill = item.fill
            live = isinstance(fill, torch.Tensor)
            item.host = fill.contiguous() if live else torch.empty(item.shape, dtype=item.dtype)
    for item in items.exchanges():  # 4.
        assert item.host is not None and not isinstance(item.fill, torch.Tensor)
        item.fill(item.host)
    share = Share(step_dir(root, step), step, plan)  # 5.
    (lo, hi), weights = plan.slots, items.weights
    if hi > lo and weights is not None and weights.host is not None:
        host, base = weights.host, items.base
        for s in layout.slots[lo:hi]:
            if frozen or s.requires_grad:  # frozen=False: the model files hold no frozen weight
                share.weights.append((s.name, host[s.offset - base : s.end - base].view(s.shape)))
    for name, item in items.buffers:
        assert item.host is not None
        share.weights.append((name, item.host))
        share.buffer_bytes += item.host.numel() * item.host.element_size()
    for key, dtype, pieces in items.optim:
        share.optim.append((key, dtype, [x if isinstance(x, int) else x.host for x in pieces]))
    if t.rank == 0:
        optim_meta = view.metadata(scalars) if view is not None else None
        config = transformers_config(t.fm.module, layout.torch_dtype)
        buffers = [name for name, _ in items.buffers]
        share.metadata = build_metadata(
            layout, t.world, step, buffers, optim_meta, extra, config, frozen
        )
    if carve is None:  # written from the live tensors: nothing to copy
        return share, [], []
    copies: list[Copy] = []
    for x in order:
        if x.host is not None and isinstance(x.fill, torch.Tensor):
            copies.append((x.host, x.fill))
    n = len(items.buffers)  # they come first
    return share, copies[:n], copies[n:]
