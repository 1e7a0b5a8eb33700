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

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError
from .._flat.hf import transformers_config
from ._comm_meta import with_comm
from ._comm_state import snapshot_comm
from ._format import build_metadata, step_dir
from ._optim import OptimizerView
from ._plan import Piece, SharePlan, plan_share, stored_parts
from ._staging import Copy
from ._streams import Space, Stream, stream_parts, typed
from ._stripes import Stripes
from ._target import Target

__all__ = ["Item", "Share", "collect"]

Carve = Callable[[list[tuple[torch.Size, torch.dtype, int]]], list[torch.Tensor]]


@dataclass(eq=False)
class Item:
    """One host tensor of a share: its ``name`` (for messages), ``shape`` and ``dtype``, and
    its ``fill``: a live tensor to copy, or a collective that assembles it into the host
    tensor (``host``, set once the share is carved); ``align``: the bytes its host tensor
    starts at a multiple of, beyond its dtype's (a mixed buffer's bytes, viewed typed).

    Example::

        Item("weights", run.shape, run.dtype, run)  # copied from the flat buffer's run
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    fill: torch.Tensor | Callable[[torch.Tensor], None]
    host: torch.Tensor | None = None
    align: int = 0

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
    # per stream (its tensor's name): its dtype and its pieces in order (a tensor, or a
    # count of zero elements)
    optim: list[tuple[str, torch.dtype, list[torch.Tensor | int]]] = field(default_factory=list)
    # the compression state: this rank's range of each flat tensor, by name (_comm_state)
    comm: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    metadata: dict[str, Any] | None = None  # rank 0 only, without "files"
    buffer_bytes: int = 0


def _part(view: OptimizerView, piece: Piece, stream: Stream, a: int, b: int) -> torch.Tensor | None:
    """Flat ``[a, b)`` of ``piece`` in ``stream``; ``None`` where it is zeros."""
    if piece.segment is None:
        return None
    seg, w = view.segments[piece.segment], stream.width
    src = view.source(seg, stream)
    return None if src is None else src[(a - seg.start) // w : (b - seg.start) // w]


def _check_in_place(t: Target, view: OptimizerView, plan: SharePlan) -> None:
    """A layout of several dtypes is saved from the optimizer's own tensors, in place: the
    trainer's optimizer must then hold every trainable element of this rank's range (a
    plain optimizer holds whole parameters, and none of those it was not given)."""
    if t.trainer_segments(view.optimizer) is None:
        return
    slots = t.fm.layout.slots
    starts = [s.offset for s in slots]
    for p in plan.pieces:
        i = max(0, bisect.bisect_right(starts, p.start) - 1)
        for s in slots[i:] if p.segment is None else ():
            if s.offset >= p.end:
                break
            if s.requires_grad and p.start < s.end:
                raise CheckpointError(
                    f"rank {t.rank}: optimizer state of {s.name!r} in [{p.start}, {p.end}) of "
                    f"the buffer: this rank's optimizer does not hold it, though its file "
                    f"holds it; saving parameters of several dtypes needs the trainer's slices "
                    f"to be the files' ranges"
                )


def _fill_by_space(
    mapped: Stripes,
    dest: list[tuple[int, int]],
    parts: list[tuple[int, int, torch.Tensor | None]],
    stored: list[tuple[int, int, int]],
    space: Space,
    rank: int,
    host: torch.Tensor,
) -> None:
    """One stream's state of this rank's file range, exchanged in the stream's space
    (``mapped``: the stripes' cuts there) into the range whole, transiently, then the parts
    the file stores (``stored``: flat ``(a, b, at)``) into ``host``."""
    d0, d1 = dest[rank]
    whole = torch.empty(d1 - d0, dtype=host.dtype)
    mapped.assemble(dest, whole, parts)
    for a, b, at in stored:
        k, n = space.element(a) - d0, (b - a) // space.width
        host[at : at + n].copy_(whole[k : k + n])


class _Items:
    """The items of one share, from its plan: module buffers, weights, optimizer state."""

    def __init__(
        self, t: Target, plan: SharePlan, view: OptimizerView | None, frozen: bool
    ) -> None:
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
                align = max(d.itemsize for d in fm.dtypes)  # its slots are typed views
                self.weights = Item("weights", run.shape, fm.dtype, run, align=align)
        else:  # from every rank's local shards, by an exchange (every rank takes part)
            stripes, kept = t.stripes, t.frozen if frozen else None
            assert stripes is not None
            (self.base, end), tiles = plan.tile, list(plan.tiles)

            def weights(host: torch.Tensor) -> None:
                stripes.assemble(tiles, host, None)
                if kept is not None:  # the frozen weights (unless the files leave them out)
                    kept.assemble(tiles, host, None)

            self.weights = Item("weights", torch.Size([end - self.base]), fm.dtype, weights)
        self.optim: list[tuple[str, torch.dtype, list[Item | int]]] = []
        if view is not None and plan.state_ranges:
            # the optimizer holds whole parameters, or every rank's local shards hold what
            # its file stores of its range (else every rank takes part in the exchange: the
            # same answer on every rank, from their cuts)
            every = [
                t.covers((a, b), q)
                for q, r in enumerate(plan.state_ranges)
                for a, b, _ in stored_parts(fm.layout, *r)
            ]
            if not t.owns_state(view.optimizer) or all(every):
                if fm.layout.mixed:  # the sharded trainer's slices are the files' ranges
                    _check_in_place(t, view, plan)
                self._state_in_place(view)
            elif fm.layout.mixed:
                self._state_exchanged_by_space(view)
            else:
                self._state_exchanged(view)

    def _state_in_place(self, view: OptimizerView) -> None:
        plan, layout = self.plan.pieces, self.t.fm.layout
        for stream in view.streams:
            pieces: list[Item | int] = []  # the stream's parts of the pieces, in order
            for i, a, b, _ in typed(layout, [(p.start, p.end) for p in plan], stream.param):
                src = _part(view, plan[i], stream, a, b)
                if src is None:
                    pieces.append((b - a) // stream.width)
                else:
                    pieces.append(Item(f"{stream.name}[{a}:{b}]", src.shape, stream.dtype, src))
            self.optim.append((stream.name, stream.dtype, pieces))

    def _state_exchanged(self, view: OptimizerView) -> None:
        stripes, (s0, e0) = self.t.stripes, self.plan.state_range
        assert stripes is not None
        ranges = list(self.plan.state_ranges)
        stored = stored_parts(self.t.fm.layout, s0, e0)
        dense = stored == [(s0, e0, 0)]
        n = sum(b - a for a, b, _ in stored)
        for stream in view.streams:  # (a layout of one dtype: one stream per key)
            key, dtype = stream.name, stream.dtype
            parts = [(seg.start, seg.end, view.source(seg, stream)) for seg in view.segments]

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

    def _state_exchanged_by_space(self, view: OptimizerView) -> None:
        """:meth:`_state_exchanged` for parameters of several dtypes (the fully sharded
        trainer's stripes): each stream exchanged in its own space (:class:`Space`), where
        positions are its elements, then the parts the file stores picked out."""
        t, layout = self.t, self.t.fm.layout
        stripes, (s0, e0) = t.stripes, self.plan.state_range
        assert stripes is not None
        for stream in view.streams:
            space, w = Space.of(layout, stream.param), stream.width
            dest = [(space.element(a), space.element(b)) for a, b in self.plan.state_ranges]
            parts = [
                (space.element(seg.start), space.element(seg.end), view.source(seg, stream))
                for seg in view.segments
                if layout.slots[seg.slot].torch_dtype == stream.param
            ]
            stored = stream_parts(layout, s0, e0, None, stream.param)
            n = sum((b - a) // w for a, b, _ in stored)
            fill = functools.partial(
                _fill_by_space, stripes.in_space(space), dest, parts, stored, space, t.rank
            )
            item = Item(stream.name, torch.Size([n]), stream.dtype, fill)
            self.optim.append((stream.name, stream.dtype, [item]))

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
    from the live tensors, for a save the caller waits for): the module buffers' and the
    comm state's copies, then the others. Exchanged items are assembled here, by
    collectives, into host tensors (``carve``'s, or new ones).

    Example::

        share, early, late = collect(Target(trainer), root, 100, opt, {}, arena_carve)
        # share.weights / share.optim: the files' entries; early, late: (host, source) copies
    """
    layout = t.fm.layout
    view = OptimizerView.of(optimizer, t) if optimizer is not None else None
    scalars = view.agree(t) if view is not None else ({}, "")  # 1. a collective when sharded
    comm = snapshot_comm(t)  # and the mean error of a lossy comm: an all-reduce
    segments = None
    if view is not None and view.streams:
        segments = [(seg.start, seg.end) for seg in view.segments]
    plan = plan_share(layout, t.world, t.rank, segments)  # 2.
    items = _Items(t, plan, view, frozen)  # 3.
    # the comm state, copied already (its buffers change at the next backward): staged
    # early, as those copies are freed once staged (on CUDA the stream waits for them)
    comm_items = [Item(name, x.shape, x.dtype, x) for name, x in comm.tensors]
    order = items.all() + comm_items
    if carve is not None:
        for item, host in zip(order, carve([(x.shape, x.dtype, x.align) for x in order])):
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
                share.weights.append((s.name, s.view(host, base)))  # in its own dtype
    for name, item in items.buffers:
        assert item.host is not None
        share.weights.append((name, item.host))
        share.buffer_bytes += item.host.numel() * item.host.element_size()
    for key, dtype, pieces in items.optim:
        share.optim.append((key, dtype, [x if isinstance(x, int) else x.host for x in pieces]))
    share.comm = [(x.name, x.host) for x in comm_items if x.host is not None]
    if t.rank == 0:
        optim_meta = view.metadata(scalars) if view is not None else None
        # as save_pretrained: the first parameter's dtype (of several: the model's dtype)
        config = transformers_config(t.fm.module, layout.dtypes[0])
        buffers = [name for name, _ in items.buffers]
        share.metadata = with_comm(
            build_metadata(layout, t.world, step, buffers, optim_meta, extra, config, frozen),
            comm.section,
        )
    if carve is None:  # written from the live tensors: nothing to copy
        return share, [], []
    copies: list[Copy] = []
    for x in order:
        if x.host is not None and isinstance(x.fill, torch.Tensor):
            copies.append((x.host, x.fill))
    n, k = len(items.buffers), len(copies) - len(comm_items)  # they come first, and last
    return share, copies[:n] + copies[k:], copies[n:k]
