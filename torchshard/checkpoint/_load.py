"""Loading a checkpoint at any world size, reading each byte about once across all ranks.

Rank r of the current world reads only the parts of the saved files that
overlap its element range ``[s, e)`` of the flat buffer, into host memory,
verifying checksums. Only when every rank has read its part without error
does anything change: each rank copies its range into place and the ranges
are broadcast, so every rank ends with the whole buffer. A rank without a flat
buffer (``shard="full"``) reads its local shards' runs instead, and keeps them:
nothing is broadcast. With hybrid sharding the replicas hold the same local shards: each
reads a part of them, and an all-gather across the replicas completes them (``_reads``).

With ``fallback=True`` a root's complete checkpoints are tried newest first:
one that every rank refused before anything changed is skipped for the next
older one, in lockstep on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._errors import CheckpointError
from .._flat.layout import dtype_from_name
from .._log import get_logger
from ._comm_state import apply_comm, check_comm_error, read_comm
from ._format import METADATA, complete_checkpoints, resolve, saved_slots
from ._metadata import Metadata, Readers, layout_difference, read_metadata
from ._optim import MASTER, OptimizerView, group_problem, restore_group_values
from ._plan import overlap
from ._pp_load import PipelineLoad, target_of
from ._reads import (
    BROADCAST_BACKENDS,
    Holding,
    Parts,
    gather_alike,
    gather_whole,
    into_shards,
    live_weights,
    packed,
    read_buffers,
    read_state,
    to_shards,
    weight_reads,
    whole_ranges,
    zero_gaps,
)
from ._rules import OPTIMIZER_RULES
from ._streams import Stream
from ._target import Checkpointable, CheckpointInfo, Target
from ._tp_load import check_plan, read_share_tp, spread_error

__all__ = ["load"]

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class _Refusal:
    """The ranks agreed that one of them failed, before anything changed: a fallback may try
    another checkpoint. ``message``: this rank's error; ``reason``: the same on every rank."""

    message: str
    reason: str


def _check_compatible(meta: Metadata, t: Target, optimizer: torch.optim.Optimizer | None) -> None:
    diff = layout_difference(meta.layout, t.whole)
    if diff is not None:
        raise CheckpointError(
            f"{meta.path}: the checkpoint is of a different model; first difference "
            f"(checkpoint vs this model): {diff}"
        )
    live = set(t.buffers())
    if set(meta.buffers) != live:
        raise CheckpointError(
            f"{meta.path}: module buffers differ: checkpoint has {sorted(set(meta.buffers) - live)} "
            f"that the model lacks, the model has {sorted(live - set(meta.buffers))} that the checkpoint lacks"
        )
    check_plan(meta, t)
    if optimizer is None:
        return
    saved = meta.optim_for(optimizer)
    view = OptimizerView.of(optimizer, t)
    groups = saved.param_groups
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{meta.path}: optimizer: checkpoint has {len(groups)} param groups, got "
            f"{len(optimizer.param_groups)}"
        )
    for g, (sg, mine) in enumerate(zip(groups, view.group_names)):
        if sg["params"] != mine:
            first = next((a, b) for a, b in zip([*sg["params"], None], [*mine, None]) if a != b)
            raise CheckpointError(
                f"{meta.path}: optimizer param group {g}: checkpoint has parameter {first[0]!r} "
                f"where this optimizer has {first[1]!r}"
            )
    rules = OPTIMIZER_RULES.get(saved.cls)
    problem = group_problem(groups, optimizer, None if rules is None else rules.hyper, t.device)
    if problem is not None:
        raise CheckpointError(
            f"{meta.path / METADATA}: {problem}; restore the file, load an earlier checkpoint, "
            "or build the optimizer as it was when saved"
        )


@dataclasses.dataclass
class _Read:
    """This rank's part of a checkpoint, in host memory, before anything changed."""

    weights: torch.Tensor  # laid out by ``parts``
    parts: Parts  # of the weights: equal parts to gather, or this rank's local shards' runs
    buffers: dict[str, torch.Tensor]
    optim: dict[Stream, torch.Tensor]  # flat state: held whole, or laid out as read
    holdings: dict[Stream, Holding] = dataclasses.field(default_factory=dict)  # how, each


def _read_share(
    meta: Metadata, t: Target, optimizer: torch.optim.Optimizer | None, readers: Readers
) -> _Read:
    """Read this rank's part of the weights and optimizer state, and the buffers, to host.

    What every rank ends up holding whole (the weights in a flat buffer; state of an
    optimizer over whole parameters) is read in equal parts plus a short tail
    (:func:`~._plan.gather_ranges`), so that one all-gather per tensor completes it. What
    is held in local shards (the weights without a flat buffer; the state of the
    trainer's sharding optimizer) is read for their runs, laid out like their tensor (with
    parameters of several dtypes: for the optimizer's pieces, one after another):
    each rank reads exactly what it holds, and nothing is exchanged after. Optimizer state
    is read stream by stream (:class:`~._reads.Holding`).

    Into plain (pageable) host memory, also for a CUDA trainer: each byte crosses to
    the device once, and page-locking it first would cost about as much as the faster
    copy saves; torch's pinned allocator would also round each buffer up to a power of
    two and keep it pinned after the load.
    """
    layout = t.fm.layout
    mine, reads, numel, within = weight_reads(t)
    own = t.owns_state(optimizer)
    weights = torch.empty(numel, dtype=layout.torch_dtype)
    written = []
    live = t.fm.flat_param if t.fm.is_bound else t.stripes.tensor if t.stripes else None
    for shard in meta.weights:
        lo, hi = shard["slots"]
        saved = {s.name for s in saved_slots(layout, lo, hi, meta.raw)}
        for slot in layout.slots[lo:hi]:
            for rs, re, at in reads:
                ov = overlap((slot.offset, slot.end), (rs, re))
                if ov is None:
                    continue
                a, b = ov
                dst = weights[at + a - rs : at + b - rs]
                written.append((at + a - rs, at + b - rs))
                if slot.name not in saved:  # saved with frozen=False: the model's own stays
                    assert live is not None
                    dst.copy_(live_weights(t, live, slot, a, b, at - rs))
                    continue
                readers.entry(shard["file"], slot.name, slot.torch_dtype, slot.shape)
                read = readers[shard["file"]]  # a mixed buffer holds bytes: read bytes
                take = read.read_bytes_into if layout.mixed else read.read_into
                take(slot.name, a - slot.offset, b - slot.offset, dst)
    zero_gaps(weights, written, within)
    buffers = read_buffers(t, meta, readers)
    state, holdings = {}, {}
    if optimizer is not None:
        assert meta.optim is not None
        view = OptimizerView.of(optimizer, t)
        for stream in meta.optim.streams:
            if stream.key == MASTER and stream.param not in view.masters:
                continue  # the live optimizer updates these parameters themselves
            hold = Holding.of(t, view, own, stream)
            # On CPU the state of an optimizer over whole parameters is read straight into
            # full-size tensors, in place: they only become live in load_state_dict, after
            # every rank has succeeded, and the all-gather fills the rest.
            if t.device.type == "cpu" and hold.whole is not None:
                host = torch.empty(hold.whole, dtype=stream.dtype)
                read_state(readers, meta, stream, hold.direct, host)
            else:
                host = torch.empty(hold.numel, dtype=stream.dtype)
                written = read_state(readers, meta, stream, hold.parts, host)
                zero_gaps(host, written, hold.within)
            state[stream], holdings[stream] = host, hold
    return _Read(weights, mine, buffers, state, holdings)


def _agree(t: Target | PipelineLoad, error: str | None, path: Path) -> _Refusal | None:
    """Whether any rank failed (the same answer on every rank); raise on every rank if they
    resolved different checkpoints."""
    if t.world == 1:
        return _Refusal(error, error) if error else None
    mine = f"{path}\0{error or ''}".encode()
    replies = [r.decode().split("\0", 1) for r in t.exchange(mine)]
    for r, (_, err) in enumerate(replies):
        if err:
            message = err if r == t.rank else f"rank {r} failed to load: {err}"
            return _Refusal(message, f"rank {r}: {err}")
    paths = sorted({p for p, _ in replies})
    if len(paths) > 1:
        raise CheckpointError(f"ranks resolved different checkpoints: {paths}; pass one directory")
    return None


@torch.no_grad()
def _apply(
    meta: Metadata, t: Target, share: _Read, optimizer: torch.optim.Optimizer | None
) -> None:
    layout = t.fm.layout
    pending: list[dist.Work] = []
    by_broadcast = t.world > 1 and dist.get_backend(t.group) in BROADCAST_BACKENDS

    def fill(full: torch.Tensor, mine: torch.Tensor | None, n: int) -> None:
        """This rank's equal parts of ``full[:n]`` from ``mine`` (``None``: read in place),
        then the exchange of the rest, started, not waited for."""
        for a, b, at in packed(whole_ranges(t, n)) if mine is not None else ():
            full[a:b].copy_(mine[at : at + b - a], non_blocking=True)
        pending.extend(gather_whole(full, n, t, by_broadcast=by_broadcast))

    flat = t.fm.flat_param
    if flat is not None:
        fill(flat, share.weights, layout.numel)
    else:  # read for the local shards' runs, laid out like their tensor; in its dtype: a bf16
        # buffer's fp32 master is the bf16 weights until a saved master overrides it below
        weights = share.weights if t.across is None else share.weights.to(t.device)
        for work in gather_alike(weights, t, by_broadcast=by_broadcast):  # the replicas' parts
            work.wait()
        into_shards(t, weights, share.parts)
    live = t.buffers()
    for name, value in share.buffers.items():
        live[name].copy_(value)
    if optimizer is None:
        for work in pending:
            work.wait()
        to_shards(t)
        return
    assert meta.optim is not None
    view = OptimizerView.of(optimizer, t)
    # Everything was checked and load_state_dict replaces the state: drop the old state
    # now, so that it and the loaded one are never held at once.
    optimizer.state.clear()
    # An optimizer of local shards holds their runs only (read laid out like their tensor):
    # no exchange needed, but across replicas, each of which read a part of them.
    flat_state: dict[Stream, tuple[torch.Tensor, Holding]] = {}
    for stream, host in share.optim.items():
        hold = share.holdings[stream]
        if hold.whole is None:  # read for this rank (its replicas' parts gathered)
            tensor = host.to(t.device)
            pending.extend(gather_alike(tensor, t, by_broadcast=by_broadcast))
        elif host.numel() == hold.whole:  # read in place (CPU): the exchange is left
            tensor = host
            fill(host, None, host.numel())
        else:
            tensor = torch.empty(hold.whole, dtype=host.dtype, device=t.device)
            fill(tensor, host, hold.whole)
        flat_state[stream] = (tensor, hold)
    for work in pending:  # the weights and the state, gathered at once
        work.wait()
    to_shards(t, view)  # a saved master, if any, overrides it below
    segment = {id(seg.tensor): seg for seg in view.segments}
    scalars, stateful = meta.optim.scalar_state, meta.optim.stateful
    rules = meta.optim.rules
    state, groups, pid = {}, [], 0
    for group, saved in zip(optimizer.param_groups, meta.optim.param_groups):
        ids = []
        # a known optimizer's state keys per group (Adam's max_exp_avg_sq only with amsgrad)
        keys = {s.key for s in flat_state} - {MASTER} if rules is None else rules.flat(saved)
        for p in group["params"]:
            seg = segment.get(id(p))  # None: the sharded trainer's empty placeholder
            if seg is not None and not layout.slots[seg.slot].requires_grad:
                seg = None  # a frozen parameter in a plain optimizer: it has no state
            if seg is None:
                ids.append(pid)
                pid += 1
                continue
            param = layout.slots[seg.slot].torch_dtype
            mine = {}  # this parameter's flat state by key
            for stream, (tensor, hold) in flat_state.items():
                if stream.param == param:
                    a = hold.position(seg.start)
                    mine[stream.key] = tensor[a : a + (seg.end - seg.start) // stream.width]
            if MASTER in mine:
                p.copy_(mine[MASTER].view(p.shape))
            if stateful[seg.slot] == "1":
                st: dict[str, Any] = {k: v.view(p.shape) for k, v in mine.items() if k in keys}
                for key, spec in scalars.items():
                    v = spec["values"][seg.slot]
                    if v is not None:
                        st[key] = (
                            v
                            if spec["dtype"] == "python"
                            else torch.tensor(v, dtype=dtype_from_name(spec["dtype"]))
                        )
                state[pid] = st
            ids.append(pid)
            pid += 1
        hyper = restore_group_values(group, {k: v for k, v in saved.items() if k != "params"})
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _candidates(given: Path, t: Target | PipelineLoad) -> tuple[bool, list[Path]]:
    """Whether ``given`` is one checkpoint (else a root), and the checkpoints to try, newest
    first: the same on every rank, or :class:`CheckpointError` on every rank (one exchange)."""
    single = (given / METADATA).is_file() or not given.is_dir()
    try:
        paths = [given] if single else [p for _, p in reversed(complete_checkpoints(given))]
    except OSError:  # unlistable: loading it as one path raises (on every rank) why
        single, paths = True, [given]
    if t.world == 1:
        return single, paths
    try:
        replies = t.exchange(json.dumps([single, [str(p) for p in paths]]).encode())
    except Exception as e:  # a peer that died, a broken process group
        raise CheckpointError(
            f"{given}: the ranks could not agree which checkpoints to try "
            f"({type(e).__name__}: {e}); nothing was changed"
        ) from e
    differ = next((r for r, reply in enumerate(replies) if reply != replies[0]), None)
    if differ is not None:
        raise CheckpointError(
            f"{given}: expected every rank to see the same checkpoints, got rank 0: "
            f"{replies[0].decode()}, rank {differ}: {replies[differ].decode()}; pass the same "
            "path on every rank, and load while no save writes under it"
        )
    return single, paths


def _load_one(
    given: Path, t: Target | PipelineLoad, optimizer: torch.optim.Optimizer | None, comm_error: str
) -> CheckpointInfo | _Refusal:
    """Load the checkpoint ``given`` (or the latest under it), or say why every rank refused
    it, having changed nothing: see :func:`load`."""
    error, share, path, comm, finish = None, None, given, None, None
    readers, stages = None, None
    try:
        path = resolve(path)
        meta = read_metadata(path)
        readers = Readers(meta)
        if isinstance(t, PipelineLoad):  # each stage's slots of the whole tensors
            stages = t.read(meta, readers)
        else:
            _check_compatible(meta, t, optimizer)
            if t.tp is not None:  # its local pieces of the whole tensors
                read, finish = read_share_tp(meta, t, optimizer, readers)
                share = _Read(*read)
            else:
                share = _read_share(meta, t, optimizer, readers)
            comm = read_comm(meta, t, readers, comm_error)  # the compression state: _comm_state
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"{e.filename or path}: {e.strerror or e}"
    except Exception as e:  # never leave the other ranks waiting in _agree
        error = f"{path}: loading failed: {type(e).__name__}: {e}"
    finally:
        if readers is not None:
            readers.close()
    try:
        error = spread_error(t, error) if isinstance(t, Target) else error  # a tp peer's
        refusal = _agree(t, error, path)
    except CheckpointError:
        raise
    except Exception as e:  # a peer that died, a broken process group
        raise CheckpointError(
            f"{path}: the ranks could not agree that every rank read its share "
            f"({type(e).__name__}: {e}); nothing was changed"
        ) from e
    if refusal is not None:
        return refusal
    try:
        if stages is not None:  # a pipeline: each stage over its data-parallel group
            return t.apply(stages, lambda tk, ok, mk, read: _apply(mk, tk, _Read(*read), ok))
        assert share is not None and isinstance(t, Target)
        if finish is not None:  # a split module: the tp group's exchange of what it read
            finish()
        _apply(meta, t, share, optimizer)
        note = apply_comm(t, comm)
        t.after_load()  # e.g. units gathered now hold the old weights
    except Exception as e:  # everything was checked: a bug, or a peer lost mid-way
        raise CheckpointError(
            f"{path}: applying the checkpoint failed after every check had passed "
            f"({type(e).__name__}: {e}); the model and optimizer may be partly loaded: "
            "load again, and please report this"
        ) from e
    return CheckpointInfo(
        meta.step, meta.extra, path, readers.bytes_read if readers else 0, comm=note
    )


def load(
    path_or_root: str | os.PathLike[str],
    trainer: Checkpointable,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    fallback: bool = False,
    comm_error: str = "mean",
) -> CheckpointInfo:
    """Load a checkpoint into ``trainer`` (and ``optimizer``), at any world size.

    ``path_or_root`` is a checkpoint directory or a root (then its latest
    complete checkpoint). Every rank calls it. Each rank reads only its
    share of the files (with ``shard="full"``, its stripes: nothing is
    broadcast), verified against their checksums; if any rank fails,
    every rank raises :class:`CheckpointError` and nothing has changed. The
    optimizer's hyperparameters are restored as ``optimizer.load_state_dict``
    restores them.

    With ``fallback=True`` and a root, a checkpoint that fails so (a damaged
    or missing file, or one that does not fit the model or optimizer) is
    skipped, with a warning on rank 0, and the next older complete one is
    tried; ``info.skipped`` names each skipped one and why, the same on every
    rank. If none loads, :class:`CheckpointError` names each one tried. Only
    the bytes a load reads are verified (``torchshard inspect`` reads them
    all); a failure once the state is being applied is never skipped. A
    ``path_or_root`` that is one checkpoint directory is loaded or refused
    as without ``fallback``.

    The compression state of a lossy comm (``PowerSGD``, ``TopK``) is loaded on every
    rank at any world size: the mean of the saved ranks' error feedback (``comm_error=
    "reset"``: zero instead; for ``TopK`` the mean is an approximation), ``Q`` and the
    step count. Into a trainer whose comm keeps no state it is dropped; a checkpoint
    without it starts the error at zero; a saved ``Q`` that does not fit (another comm, or
    another ``rank`` or ``min_compression``) is dropped and the trainer keeps its own.
    ``info.comm`` says what happened (a warning on rank 0 where something was dropped).

    ``trainer`` may be a ``torchshard.Pipeline`` (``optimizer``: its ``pipe.make_optimizer``):
    it loads a checkpoint saved at any pipeline degree, split, data-parallel degree and
    mode, or by a plain trainer; tied replicas end equal to their owner.

    Example::

        info = torchshard.checkpoint.load("ckpt", trainer, optimizer=opt, fallback=True)
        start_step = info.step + 1
    """
    t, comm_error = target_of(trainer, optimizer), check_comm_error(comm_error)
    given = Path(path_or_root)
    single, paths = _candidates(given, t) if fallback else (True, [given])
    if single or not paths:  # one checkpoint, or none to try: loaded, or its error as it is
        got = _load_one(given, t, optimizer, comm_error)
        if isinstance(got, _Refusal):
            raise CheckpointError(got.message)
        return got
    skipped: list[tuple[Path, str]] = []
    for i, path in enumerate(paths):
        got = _load_one(path, t, optimizer, comm_error)
        if isinstance(got, CheckpointInfo):
            return dataclasses.replace(got, skipped=tuple(skipped))
        skipped.append((path, got.reason))  # every rank refused it, and nothing changed
        if t.rank == 0:  # warnings pass on every rank; the ranks agree on this one
            then = f"trying {paths[i + 1]}" if i + 1 < len(paths) else "none older to try"
            logger.warning("checkpoint %s skipped: %s; %s", path, got.reason, then)
    tried = "; ".join(f"{p} ({why})" for p, why in skipped)
    raise CheckpointError(
        f"{given}: expected a complete checkpoint that loads, got {len(skipped)} that failed, "
        f"newest first: {tried}; restore one from a copy (`torchshard inspect` names every "
        "damaged file), or build the model and optimizer as they were saved"
    )
