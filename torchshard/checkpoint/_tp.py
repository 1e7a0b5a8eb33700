"""Tensor-parallel checkpoints: the files stay the one-process (TP=1) picture.

A module split over ``tp`` ranks (``fm.tp``) lays out its local pieces; its checkpoint is
written as a save of the whole layout (``fm.tp.whole``) at ``dp x tp`` ranks: rank ``g`` of
the mesh writes run ``g`` of whole named tensors and range ``g`` of the whole layout's flat
optimizer state (``_plan``), so ``consolidate``, ``reshard``, ``inspect`` and a TP=1 load read
it as any other. ``metadata.json`` adds ``"tp"``: the degree, the plan, each split slot's
split (``fm.tp.to_json()``).

A save goes slot by slot, every rank alike (collectives): the local slot is assembled on
every data-parallel rank (from the local shards' stripes, when the trainer shards them), the
tp group all-gathers its pieces into the whole slot, and each rank keeps what its files hold.
One whole slot per tensor (the weights, each optimizer state) is transient at a time. It is
synchronous (an ``async_save`` of a split module returns a finished future); the ranks meet
by collectives over the mesh's world, not through the store.

A load at any degree reads, for each slot its rank holds, its local piece from the whole
tensors (a dim-0 split: its rows only; a dim-1 split: the whole slot, then its columns),
laid out as the TP=1 load lays out what it reads (``_load._apply`` then runs unchanged).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._dist import exchange_bytes
from .._errors import CheckpointError
from .._flat.hf import transformers_config
from .._flat.layout import FlatLayout
from .._flat.tp import TensorParallel
from ._format import build_metadata, commit, prepare, rotate, step_dir, tmp_dir
from ._metadata import Metadata, Readers
from ._optim import MASTER, OptimizerView
from ._plan import SharePlan, overlap, state_ranges, stored_parts, trainable_only, weight_runs
from ._reads import Holding, Parts, live_weights, read_state, weight_reads, zero_gaps
from ._share import Share
from ._streams import Stream
from ._target import Target

__all__ = [
    "check_plan",
    "read_share_tp",
    "save_tp",
    "split_of_target",
    "spread_error",
    "whole_layout",
]


def split_of_target(t: Target) -> TensorParallel | None:
    """The module's tensor parallelism when it splits over more than one rank."""
    tp = t.fm.tp
    return tp if tp is not None and tp.size > 1 else None


def whole_layout(t: Target) -> FlatLayout:
    """The layout a checkpoint of ``t`` stores: the whole model's."""
    return t.fm.tp.whole if t.fm.tp is not None else t.fm.layout


def _mesh(t: Target) -> Any:
    mesh = getattr(t.trainer, "mesh", None)
    if mesh is None or t.trainer is None:
        raise CheckpointError(
            "trainer: a tensor-parallel FlatParamModule is saved and loaded through its "
            "DistributedTrainer(fm, mesh=mesh), which knows the ranks holding its pieces"
        )
    if mesh.shape[0] > 1:
        raise CheckpointError(
            f"trainer: mesh {mesh.shape}: checkpoints of a tensor-parallel module with "
            "dp_replicate > 1 are not supported yet; use init_mesh(tp=T) (dp_shard only)"
        )
    return mesh


# -- save ---------------------------------------------------------------------------------------
def _dp_whole(t: Target, a: int, b: int, dtype: torch.dtype, fill: Any) -> torch.Tensor:
    """Local flat ``[a, b)`` on every data-parallel rank: assembled on dp rank 0 from every
    rank's stripes (``fill(dest, out)``, a collective), then broadcast over the dp group."""
    dest = [(a, b)] + [(b, b)] * (t.world - 1)
    out = torch.empty(b - a if t.rank == 0 else 0, dtype=dtype)
    fill(dest, out)
    if t.world == 1:
        return out.to(t.device)
    full = out.to(t.device) if t.rank == 0 else torch.empty(b - a, dtype=dtype, device=t.device)
    dist.broadcast(full, src=t.dp.global_rank(0), group=t.group)
    return full


def _local_weights(t: Target, i: int, frozen: bool) -> torch.Tensor:
    """Local slot ``i``'s weights, whole on this rank (shaped)."""
    slot = t.fm.layout.slots[i]
    flat = t.fm.flat_param
    if flat is not None:
        return slot.view(flat.detach())
    stripes, kept = t.stripes, t.frozen
    assert stripes is not None

    def fill(dest: list[tuple[int, int]], out: torch.Tensor) -> None:
        stripes.assemble(dest, out, None)
        if kept is not None:
            kept.assemble(dest, out, None)

    return _dp_whole(t, slot.offset, slot.end, slot.torch_dtype, fill).view(slot.shape)


def _local_state(t: Target, view: OptimizerView, stream: Stream, i: int) -> torch.Tensor:
    """Local slot ``i``'s state of ``stream``, whole on this rank (shaped; zeros where the
    optimizer holds none)."""
    slot = t.fm.layout.slots[i]
    if t.owns_state(view.optimizer):  # the trainer's sharding optimizer: its stripes
        assert t.stripes is not None
        parts = [(s.start, s.end, view.source(s, stream)) for s in view.segments]
        stripes = t.stripes

        def fill(dest: list[tuple[int, int]], out: torch.Tensor) -> None:
            stripes.assemble(dest, out, parts)

        return _dp_whole(t, slot.offset, slot.end, stream.dtype, fill).view(slot.shape)
    seg = next((s for s in view.segments if s.slot == i), None)
    src = view.source(seg, stream) if seg is not None else None
    if src is None:
        return torch.zeros(slot.shape, dtype=stream.dtype, device=t.device)
    return src.view(slot.shape)


def _collect(
    t: Target, tp: TensorParallel, g: int, world: int, optimizer: Any, frozen: bool
) -> tuple[Share, dict[str, Any] | None]:
    """Rank ``g``'s share of the files of the whole layout at ``world`` ranks, and (rank 0)
    the optimizer section of the metadata."""
    whole = tp.whole
    view = OptimizerView.of(optimizer, t) if optimizer is not None else None
    scalars = view.agree(t) if view is not None else ({}, "")  # over the dp group
    lo, hi = weight_runs(whole, world)[g]
    span = (whole.slots[lo].offset, whole.slots[hi - 1].end) if hi > lo else (0, 0)
    s0, e0 = state_ranges(whole, world)[g] if view is not None and view.streams else (0, 0)
    share = Share(Path(), 0, SharePlan(g, world, (lo, hi), span, (s0, e0), ()))
    stored = stored_parts(whole, s0, e0) if e0 > s0 else []
    streams = view.streams if view is not None else []
    n = sum(b - a for a, b, _ in stored)
    hosts = [torch.zeros(n, dtype=s.dtype) for s in streams]
    sparse = trainable_only(whole)
    for i, slot in enumerate(whole.slots):  # every rank, every slot: collectives
        if frozen or slot.requires_grad:
            full = tp.gather(i, _local_weights(t, i, frozen))
            if lo <= i < hi:
                share.weights.append((slot.name, full.detach().to("cpu", copy=True)))
        if view is None or (sparse and not slot.requires_grad):
            continue  # no rank's file stores state of it
        for stream, host in zip(streams, hosts):
            full = tp.gather(i, _local_state(t, view, stream, i)).reshape(-1)
            for a, b, at in stored:
                ov = overlap((a, b), (slot.offset, slot.end))
                if ov is not None:
                    x, y = ov
                    host[at + x - a : at + y - a].copy_(full[x - slot.offset : y - slot.offset])
    share.optim = [(s.name, s.dtype, [h]) for s, h in zip(streams, hosts) if n]
    return share, (view.metadata(scalars) if view is not None and g == 0 else None)


def _agree(mesh: Any, t: Target, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``payload`` (JSON) over the mesh's world; raise on every rank if one
    holds an ``"error"``."""
    replies = [
        json.loads(r) for r in exchange_bytes(json.dumps(payload).encode(), mesh.world, t.device)
    ]
    for r, reply in enumerate(replies):
        if reply.get("error"):
            raise CheckpointError(
                reply["error"] if r == mesh.rank else f"rank {r}: {reply['error']}"
            )
    return replies


def save_tp(
    t: Target,
    root: Path,
    step: int,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    keep_last: int | None,
    frozen: bool,
    write: Any,
) -> concurrent.futures.Future[Path]:
    """Save a split module's checkpoint as its TP=1 picture (see the module docstring);
    ``write(rank, world, share, tmp)`` writes one rank's files and returns their records."""
    tp, mesh = split_of_target(t), _mesh(t)
    assert tp is not None
    if tp.whole.mixed:
        raise CheckpointError(
            "trainer: a tensor-parallel module with parameters of several dtypes cannot be "
            "checkpointed yet; cast the model to one dtype"
        )
    g, world = mesh.rank, mesh.world_size
    share, optim_meta = _collect(t, tp, g, world, optimizer, frozen)
    path, tmp = step_dir(root, step), tmp_dir(root, step)
    if g == 0:
        for name, b in t.buffers().items():
            share.weights.append((name, b.detach().to("cpu", copy=True)))
            share.buffer_bytes += b.numel() * b.element_size()
    error = None
    if g == 0:
        try:
            prepare(root, tmp, path)
        except (CheckpointError, OSError) as e:
            error = f"{path}: {e}"
    _agree(mesh, t, {"error": error})
    try:
        records, error = write(g, world, share, tmp), None
    except (CheckpointError, OSError) as e:
        records, error = {}, f"writing {tmp}: {e}"
    try:
        replies = _agree(mesh, t, {"error": error, "files": records})
    except CheckpointError:
        if g == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if g == 0:
        files = {k: v for reply in replies for k, v in reply["files"].items()}
        buffers = list(t.buffers())
        config = transformers_config(t.fm.module, tp.whole.dtypes[0])
        meta = build_metadata(tp.whole, world, step, buffers, optim_meta, extra, config, frozen)
        meta["tp"] = tp.to_json()
        try:
            commit(tmp, path, meta, files, share.buffer_bytes)
            if keep_last is not None:
                rotate(root, keep_last, keep=path)
        except (CheckpointError, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"committing {path}: {e}"
    _agree(mesh, t, {"error": error})
    done: concurrent.futures.Future[Path] = concurrent.futures.Future()
    done.set_result(path)
    return done


# -- load ---------------------------------------------------------------------------------------
def check_plan(meta: Metadata, t: Target) -> None:
    """A checkpoint saved split (``"tp"`` in its metadata) loads into a split module only if
    each parameter is split alike (the files are whole: any degree fits)."""
    saved, tp = meta.raw.get("tp"), split_of_target(t)
    if saved is None or tp is None:
        return
    splits = saved.get("splits") if isinstance(saved, dict) else None
    if not isinstance(splits, dict) or not isinstance(saved.get("tp"), int):
        raise CheckpointError(
            f"{meta.path}: metadata.json: tp: expected {{'tp': int, 'tp_plan': ..., "
            f"'splits': {{name: [dim, parts]}}}}, got {saved!r}"
        )
    if saved["tp"] == 1:
        return
    mine = {k: v.to_json() for k, v in tp.split_map().items()}

    def said(s: Any) -> str:
        return "replicated" if s is None else f"split along dim {s[0]} in {s[1]} part(s)"

    for slot in tp.whole.slots:
        theirs = splits.get(slot.name)
        if (list(theirs) if theirs is not None else None) != mine.get(slot.name):
            raise CheckpointError(
                f"{meta.path}: parameter {slot.name!r}: the checkpoint's tensor-parallel plan "
                f"has it {said(theirs)}, this module's {said(mine.get(slot.name))}; load with "
                f"the plan it was saved with ({saved.get('tp_plan')})"
            )


def spread_error(t: Target, error: str | None) -> str | None:
    """This rank's error, or one of its tp group's (an exchange over the tp group, which every
    rank of a split module calls): the dp group's agreement after it then reaches every rank."""
    tp = split_of_target(t)
    if tp is None:
        return error
    replies = exchange_bytes((error or "").encode(), tp.group, t.device)
    for r, reply in enumerate(replies):
        if reply and error is None:
            return f"tp rank {r} failed to load: {reply.decode()}"
    return error


class _Whole:
    """Each slot's local piece, read from the whole tensors of a checkpoint (one slot cached
    per tensor: reads come in layout order)."""

    def __init__(self, meta: Metadata, readers: Readers, tp: TensorParallel) -> None:
        self.meta, self.readers, self.tp = meta, readers, tp
        self.file = {i: w["file"] for w in meta.weights for i in range(*w["slots"])}
        self.cache: dict[Any, tuple[int, torch.Tensor]] = {}

    def _rows(self, i: int) -> list[tuple[int, int]] | None:
        """Element ranges of whole slot ``i`` that are this rank's piece, in order; ``None``
        where the piece is no run of rows (read the whole slot, then take it)."""
        split, slot = self.tp.splits[i], self.tp.whole.slots[i]
        if split is None:
            return [(0, slot.numel)]
        if split.dim != 0:
            return None
        row = slot.numel // slot.shape[0]
        return [
            (a * row, b * row) for a, b in split.pieces(slot.shape[0], self.tp.rank, self.tp.size)
        ]

    def _piece(self, i: int, dtype: torch.dtype, read: Any) -> torch.Tensor:
        slot, rows = self.tp.whole.slots[i], self._rows(i)
        if rows is None:
            full = torch.empty(slot.numel, dtype=dtype)
            read([(0, slot.numel, 0)], full)
            return self.tp.take(i, full.view(slot.shape)).contiguous().view(-1)
        out = torch.empty(sum(b - a for a, b in rows), dtype=dtype)
        at, parts = 0, []
        for a, b in rows:
            parts.append((a, b, at))
            at += b - a
        read(parts, out)
        return out

    def weights(self, i: int) -> torch.Tensor:
        key = "weights"
        if self.cache.get(key, (None,))[0] != i:
            slot = self.tp.whole.slots[i]
            file = self.file[i]
            self.readers.entry(file, slot.name, slot.torch_dtype, slot.shape)

            def read(parts: Parts, out: torch.Tensor) -> None:
                for a, b, at in parts:
                    self.readers[file].read_into(slot.name, a, b, out[at : at + b - a])

            self.cache[key] = (i, self._piece(i, slot.torch_dtype, read))
        return self.cache[key][1]

    def state(self, stream: Stream, i: int) -> torch.Tensor:
        if self.cache.get(stream, (None,))[0] != i:
            off = self.tp.whole.slots[i].offset

            def read(parts: Parts, out: torch.Tensor) -> None:
                moved = [(off + a, off + b, at) for a, b, at in parts]
                zero_gaps(out, read_state(self.readers, self.meta, stream, moved, out))

            self.cache[stream] = (i, self._piece(i, stream.dtype, read))
        return self.cache[stream][1]


def _fill(
    layout: FlatLayout, parts: Parts, into: torch.Tensor, piece: Any
) -> list[tuple[int, int]]:
    """Local flat ``parts`` into ``into``: ``piece(slot, a, b, shift)`` gives flat ``[a, b)``
    of a slot (``shift``: from a flat position to its place in ``into``); the ranges written
    (alignment gaps are not)."""
    starts, written = [s.offset for s in layout.slots], []
    for rs, re, at in sorted(parts):
        i = max(0, bisect.bisect_right(starts, rs) - 1)
        for slot in layout.slots[i:]:
            if slot.offset >= re:
                break
            ov = overlap((slot.offset, slot.end), (rs, re))
            if ov is None:
                continue
            a, b = ov
            into[at + a - rs : at + b - rs].copy_(piece(slot, a, b, at - rs))
            written.append((at + a - rs, at + b - rs))
    return written


def read_share_tp(
    meta: Metadata, t: Target, optimizer: torch.optim.Optimizer | None, readers: Readers
) -> tuple[torch.Tensor, Parts, dict[str, torch.Tensor], dict[Stream, Any], dict[Stream, Any]]:
    """``_load._read_share`` for a split module: the same reads, laid out alike, of this
    rank's local pieces of the whole tensors; ``(weights, parts, buffers, state, holdings)``."""
    tp = split_of_target(t)
    assert tp is not None
    layout, src = t.fm.layout, _Whole(meta, readers, tp)
    if layout.mixed:
        raise CheckpointError("trainer: a tensor-parallel module of several dtypes cannot load yet")
    index = {id(s): i for i, s in enumerate(layout.slots)}
    saved = {meta.layout.slots[i].name for i in src.file}
    if meta.raw["weights"].get("frozen", True) is False:
        saved = {s.name for s in meta.layout.slots if s.requires_grad} & saved
    mine, reads, numel, within = weight_reads(t)
    weights = torch.empty(numel, dtype=layout.torch_dtype)
    live = t.fm.flat_param if t.fm.is_bound else t.stripes.tensor if t.stripes else None

    def weight(slot: Any, a: int, b: int, shift: int) -> torch.Tensor:
        if slot.name in saved:
            return src.weights(index[id(slot)])[a - slot.offset : b - slot.offset]
        assert live is not None  # saved with frozen=False: the model's own stays
        return live_weights(t, live, slot, a, b, shift)

    zero_gaps(weights, _fill(layout, reads, weights, weight), within)
    buffers = {}
    for name, want in t.buffers().items():
        file = meta.buffers[name]
        readers.entry(file, name, want.dtype, tuple(want.shape))
        host = torch.empty(want.shape, dtype=want.dtype)
        readers[file].read_into(name, 0, host.numel(), host.view(-1))
        buffers[name] = host
    state, holdings = {}, {}
    if optimizer is not None:
        assert meta.optim is not None
        view, own = OptimizerView.of(optimizer, t), t.owns_state(optimizer)
        for stream in meta.optim.streams:
            if stream.key == MASTER and stream.param not in view.masters:
                continue
            hold = Holding.of(t, view, own, stream)

            def piece(slot: Any, a: int, b: int, _: int, stream: Stream = stream) -> torch.Tensor:
                return src.state(stream, index[id(slot)])[a - slot.offset : b - slot.offset]

            if t.device.type == "cpu" and hold.whole is not None:
                host = torch.empty(hold.whole, dtype=stream.dtype)
                _fill(layout, hold.direct, host, piece)
            else:
                host = torch.empty(hold.numel, dtype=stream.dtype)
                zero_gaps(host, _fill(layout, hold.parts, host, piece), hold.within)
            state[stream], holdings[stream] = host, hold
    return weights, mine, buffers, state, holdings
