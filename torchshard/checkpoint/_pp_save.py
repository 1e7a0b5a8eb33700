"""Pipeline checkpoints, the save: the files stay the one-process picture (issue 26).

Each rank writes, for each stage it runs, its share (``_pp_plan``): its run of the stage's
owned slots (whole named tensors under their canonical names) and its range of the whole
layout's flat optimizer state; a plain trainer's load, ``consolidate`` and ``inspect``
read the directory as any other save's. Slot by slot, every rank of a stage's
data-parallel group alike, the slot is assembled on the rank that writes it (from the
stripes when the stage's trainer shards: a collective in that group; else it is there),
as a tensor-parallel save does (``_tp_save``): nothing crosses stages. ``metadata.json``
records the whole layout; the optimizer's param groups merged by index, with the
parameters by global name in slot order; scalar state per global slot; and an optional
``"pipeline"`` key (degrees, modules, owned slots, tiles, ties) that loading does not
need. Every collective runs in the caller's thread, and what each rank writes is copied to
host tensors of its own before ``save_pp`` returns; the files are written and committed in
the writer's thread, the ranks meeting through the store (``_pp_commit``), as a trainer's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._dist import exchange_bytes
from .._errors import CheckpointError
from .._flat.hf import transformers_config
from .._flat.layout import FlatLayout
from ._format import build_metadata, model_file, step_dir
from ._optim import OptimizerView, merge_scalars
from ._plan import SharePlan, overlap, stored_parts
from ._pp_commit import meeting, side_of, write_commit
from ._pp_plan import (
    by_name,
    pipeline_targets,
    stage_ranges,
    stage_runs,
    stage_tiles,
    weight_shards,
    whole_layout,
)
from ._share import Share
from ._target import PipelineState, Target
from ._tp_save import local_state, local_weights

__all__ = ["save_pp"]


def _agree(pipe: PipelineState, t: Target, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``payload`` (JSON) over the pipeline's ranks; raise on every rank if one
    holds an ``"error"``."""
    data = json.dumps(payload).encode()
    group = pipe.process_group
    replies = [json.loads(r) for r in exchange_bytes(data, group, t.device)]
    me = _rank(pipe)
    for r, reply in enumerate(replies):
        if reply.get("error"):
            raise CheckpointError(reply["error"] if r == me else f"rank {r}: {reply['error']}")
    return replies


def _rank(pipe: PipelineState) -> int:
    """This rank's place in the pipeline's group: ``pp_rank * dp + dp_rank``."""
    return pipe.pp_rank * pipe.dp_size + pipe.dp_rank


def _stage_optim(
    whole: FlatLayout, t: Target, view: OptimizerView, lo: int, hi: int
) -> dict[str, Any]:
    """A stage's optimizer section over the global slots it owns (its replicas left out)."""
    index, n = by_name(whole), len(whole.slots)
    scalars, stateful = view.agree(t)  # a collective in the stage's group when it shards
    mine = [(i, index[s.name]) for i, s in enumerate(t.fm.layout.slots)]
    mine = [(i, g) for i, g in mine if lo <= g < hi]
    glob: dict[str, Any] = {}
    for key, spec in scalars.items():
        values: list[Any] = [None] * n
        for i, g in mine:
            values[g] = spec["values"][i]
        glob[key] = {"dtype": spec["dtype"], "values": values}
    flags = [False] * n
    for i, g in mine:
        flags[g] = stateful[i] == "1"
    meta = view.metadata(({}, ""))
    for group in meta["param_groups"]:
        kept = [(index[p], whole.slots[index[p]].name) for p in group["params"]]
        group["params"] = [[g, name] for g, name in kept if lo <= g < hi]
    return {**meta, "scalars": [glob, flags]}


def _merge_optim(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer section of the whole save, from every stage's (same on every rank)."""
    first = parts[0]
    groups = []
    for g, group in enumerate(first["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        names = []
        for k, p in enumerate(parts):
            if p["class"] != first["class"] or len(p["param_groups"]) != len(first["param_groups"]):
                raise CheckpointError(
                    f"optimizer: the stages' optimizers differ ({first['class']} with "
                    f"{len(first['param_groups'])} groups against {p['class']} with "
                    f"{len(p['param_groups'])}); build it with pipe.make_optimizer"
                )
            theirs = {k: v for k, v in p["param_groups"][g].items() if k != "params"}
            if theirs != hyper:
                raise CheckpointError(
                    f"optimizer param group {g}: the stages hold different hyperparameters "
                    f"({hyper} against {theirs}); a checkpoint keeps one value per group"
                )
            names += p["param_groups"][g]["params"]
        groups.append({**hyper, "params": [name for _, name in sorted(names)]})
    flat = next((p["flat_state"] for p in parts if p["flat_state"]), first["flat_state"])
    if any(p["flat_state"] and p["flat_state"] != flat for p in parts):
        raise CheckpointError(
            "optimizer: the stages hold different state tensors; step every stage before saving"
        )
    scalars, stateful = merge_scalars([tuple(p["scalars"]) for p in parts])  # type: ignore[misc]
    return {
        "class": first["class"],
        "param_groups": groups,
        "flat_state": flat,
        "scalar_state": scalars,
        "stateful": stateful,
    }


def _share(
    whole: FlatLayout,
    k: int,
    t: Target,
    view: OptimizerView | None,
    q: int,
    q_all: int,
    owned: tuple[int, int],
    tile: tuple[int, int],
    frozen: bool,
) -> Share:
    """This rank's share ``q`` of stage ``k``: slot by slot, assembled on its writer."""
    lo, hi = owned
    dp, d, index = t.world, t.rank, by_name(whole)
    runs, ranges = stage_runs(whole, lo, hi, dp), stage_ranges(tile, dp)
    s0, e0 = ranges[d]
    share = Share(Path(), 0, SharePlan(q, q_all, runs[d], tile, (s0, e0), ()))
    stored = stored_parts(whole, s0, e0) if e0 > s0 and view is not None else []
    streams = view.streams if view is not None else []
    n = sum(b - a for a, b, _ in stored)
    hosts = [torch.zeros(n, dtype=s.dtype) for s in streams]
    for i, slot in enumerate(t.fm.layout.slots):  # every rank of the stage alike
        g = index[slot.name]
        if not lo <= g < hi:
            continue  # a replica: its owner writes it
        gs = whole.slots[g]
        if frozen or slot.requires_grad:
            w = next(r for r, (a, b) in enumerate(runs) if a <= g < b)
            full = local_weights(t, i, w)
            if full is not None and d == w:
                share.weights.append((gs.name, full.detach().to("cpu", copy=True)))
        if view is None or not slot.requires_grad:
            continue
        span = (gs.offset, gs.end)
        writers = [r for r, rg in enumerate(ranges) if overlap(rg, span) is not None]
        for stream, host in zip(streams, hosts):
            for w in writers:
                full = local_state(t, view, stream, i, w)
                if full is None or d != w:
                    continue
                flat = full.reshape(-1)
                for a, b, at in stored:
                    ov = overlap((a, b), span)
                    if ov is not None:
                        x, y = ov
                        host[at + x - a : at + y - a].copy_(flat[x - gs.offset : y - gs.offset])
    share.optim = [(s.name, s.dtype, [h]) for s, h in zip(streams, hosts) if n]
    return share


def save_pp(
    pipe: PipelineState,
    root: Path,
    step: int,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    keep_last: int | None,
    frozen: bool,
    write: Callable[[int, int, Share, Path], dict[str, Any]],
    timeout: float,
    silence: float,
) -> Callable[[], Path]:
    """Stage a pipeline's checkpoint as its one-process picture (see the module docstring):
    every collective now, every rank's shares copied to host; returns the writer thread's
    part (``_pp_commit``). ``write(q, Q, share, tmp)`` writes one share's files and returns
    their records."""
    stages = pipeline_targets(pipe, optimizer)
    for k, t, _ in stages:
        kept = getattr(t.trainer, "comm_state", None)
        if kept is not None and kept():
            raise CheckpointError(
                f"stage {k}: its comm keeps compression state, which a pipeline checkpoint "
                "does not save yet; train the pipeline with a dense comm"
            )
    whole, plan, dp = whole_layout(pipe), pipe.plan, pipe.dp_size
    owned, q_all = list(plan.owned), plan.num_stages * dp
    tiles, t0 = stage_tiles(whole, owned), stages[0][1]
    views = [OptimizerView.of(o, t) if o is not None else None for _, t, o in stages]
    sections = [
        _stage_optim(whole, t, v, *owned[k]) if v is not None else None
        for (k, t, _), v in zip(stages, views)
    ]
    mine = [
        {"k": k, "d": t.rank, "optim": s, "buffers": sorted(t.buffers())}
        for (k, t, _), s in zip(stages, sections)
    ]
    me = _rank(pipe)
    replies = _agree(pipe, t0, {"stages": mine, **meeting(pipe, me)})
    side, seq = side_of(replies, me)
    every = sorted((s["k"], s["d"], s) for r in replies for s in r["stages"])
    optim_meta = (
        _merge_optim([s["optim"] for _, d, s in every if d == 0]) if optimizer is not None else None
    )
    holder: dict[str, int] = {}  # each buffer: the lowest stage holding it
    for k, _, s in every:
        for name in s["buffers"]:
            holder.setdefault(name, k)
    path = step_dir(root, step)
    meta, buffer_bytes, error = None, 0, None
    shares: list[tuple[int, Share]] = []
    try:  # the staging: host copies of what this rank writes (the next step changes none)
        for (k, t, _), view in zip(stages, views):
            q = k * dp + t.rank
            share = _share(whole, k, t, view, q, q_all, owned[k], tiles[k], frozen)
            if t.rank == 0:
                for name, b in t.buffers().items():
                    if holder[name] == k:
                        share.weights.append((name, b.detach().to("cpu", copy=True)))
            shares.append((q, share))
        if me == 0:
            meta, buffer_bytes = _metadata(
                pipe, whole, tiles, q_all, step, optim_meta, extra, frozen
            )
            meta["weights"]["buffers"] = {n: model_file(k * dp, q_all) for n, k in holder.items()}
    except (CheckpointError, OSError) as e:
        error = f"{path}: {e}"
    _agree(pipe, t0, {"error": error})
    return functools.partial(
        write_commit,
        side,
        seq,
        root,
        path,
        step,
        shares,
        q_all,
        write,
        meta,
        buffer_bytes,
        keep_last,
        timeout,
        silence,
    )


def _metadata(
    pipe: PipelineState,
    whole: FlatLayout,
    tiles: list[tuple[int, int]],
    q_all: int,
    step: int,
    optim_meta: dict[str, Any] | None,
    extra: dict[str, Any],
    frozen: bool,
) -> tuple[dict[str, Any], int]:
    """Rank 0's ``metadata.json`` (but its ``"files"``) and the module buffers' bytes."""
    whole_buffers = {
        n: b
        for n, b in pipe.whole.state_dict(keep_vars=True).items()
        if n not in by_name(whole) and isinstance(b, torch.Tensor)
    }
    buffer_bytes = sum(b.numel() * b.element_size() for b in whole_buffers.values())
    config = transformers_config(pipe.whole, whole.dtypes[0])
    meta = build_metadata(whole, q_all, step, [], optim_meta, extra, config, frozen)
    shards, optim_files = weight_shards(whole, list(pipe.plan.owned), pipe.dp_size)
    meta["weights"]["shards"] = shards
    if meta["optimizer"] is not None and meta["optimizer"]["files"]:
        meta["optimizer"]["files"] = optim_files
    meta["pipeline"] = _section(pipe, whole, tiles)
    return meta, buffer_bytes


def _section(pipe: PipelineState, whole: FlatLayout, tiles: list[tuple[int, int]]) -> dict:
    """``metadata.json``'s optional ``"pipeline"`` key: how the save was cut (informative)."""
    plan = pipe.plan
    return {
        "pp": pipe.pp_size,
        "dp": pipe.dp_size,
        "stages": plan.num_stages,
        "shard": bool(getattr(pipe.stages[0].trainer, "shard", False)),
        "modules": [list(m) for m in plan.modules],
        "owned_slots": [list(o) for o in plan.owned],
        "tiles": [list(t) for t in tiles],
        "ties": [
            {"slot": t.slot, "name": t.name, "owner": t.owner, "holder": t.holder, "alias": t.alias}
            for t in plan.ties
        ],
    }
