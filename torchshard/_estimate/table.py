"""The table ``torchshard estimate`` prints: per-rank bytes by mode, and what fits."""

from __future__ import annotations

import torch

from .._flat.layout import dtype_name
from .._parallel.memory import OPTIMIZER_STATES
from .._parallel.traffic import CommPlan, node_spans
from .estimate import DTYPES, MAX_WORLD_SIZE, NOT_COUNTED, MemoryEstimate, ModeEstimate

__all__ = ["format_estimate"]

_OPTIMIZER_NAMES = {
    "adamw": "AdamW",
    "adam": "Adam",
    "sgd": "SGD with momentum",
    "sgd-nomomentum": "SGD without momentum",
}


def _short(dtype: torch.dtype) -> str:
    """``bf16`` for torch.bfloat16 (the ``--dtype`` names), else the dtype's name."""
    return {v: k for k, v in DTYPES.items()}.get(dtype) or dtype_name(dtype)


def _precision(r: MemoryEstimate) -> str:
    """Where each mode keeps what the optimizer updates, when some parameters are not fp32."""
    trains = [d for d, _, t in r.dtype_bytes if t] or list(r.dtypes)  # what has state
    low = [_short(d) for d in trains if d != torch.float32]
    if not low:
        return ""
    state = OPTIMIZER_STATES[r.optimizer][0] > 0
    own = [m.name for m in r.modes if not m.entry.master]
    which = " and ".join(map(_short, trains))
    parts = [f"{' and '.join(own)}: state in {which}"] if state and own else []
    master = [m.name for m in r.modes if m.entry.master]
    if master:
        of = f" of the {' and '.join(low)} parameters" if len(trains) > 1 else ""
        parts.append(f"{' and '.join(master)}: fp32 master{of}{' and state' if state else ''}")
    return f" ({'; '.join(parts)})" if parts else ""


def _sizes(values: list[tuple[str, int]]) -> str:
    """``"bfloat16 12.53 GiB, float32 2.06 MiB"``: each size in its own unit."""
    return ", ".join(f"{name} {_size(b)}" for name, b in values)


def _size(b: int) -> str:
    """``"12.53 GiB"``, ``"2.06 MiB"``, ``"12 bytes"``: in its own unit."""
    units = [("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)]
    unit, scale = next(((u, s) for u, s in units if b >= s), ("bytes", 1))
    return f"{b:,} bytes" if scale == 1 else f"{b / scale:,.2f} {unit}"


def _per_tp_rank(r: MemoryEstimate) -> str:
    """``" per tp rank (whole model: N)"`` under tensor parallelism, else nothing."""
    return f" per tp rank (whole model: {r.whole_numel:,})" if r.tp > 1 else ""


def _nodes(n: int | None) -> str:
    """``", within a node"``, ``", 4 nodes"``, or nothing without a node size."""
    return "" if n is None else ", within a node" if n == 1 else f", {n} nodes"


def _hsdp_line(r: MemoryEstimate) -> str:
    """The mesh: ``dp_replicate x dp_shard``, and where its groups lie."""
    consecutive = "consecutive ranks" if r.tp == 1 else f"data-parallel ranks, {r.tp} apart"
    shard, across = f"{r.dp_shard} {consecutive}", f"{r.dp_replicate} ranks"
    if r.dp_per_node is not None:
        groups, replicas = node_spans(r.dp_size, r.dp_shard, r.dp_per_node)
        shard += _nodes(groups)
        across += _nodes(replicas)
    return (
        f"hsdp         dp_replicate {r.dp_replicate} x dp_shard {r.dp_shard} (shard groups: "
        f"{shard}; replicate groups: {across})"
    )


def _comm_lines(name: str, c: CommPlan) -> list[str]:
    """One mode's bytes per rank and step: inside its group, and across the replicas."""
    group = "shard group" if c.dp_replicate > 1 else "data-parallel group"
    moved = [f"{c.reduction} {_size(c.bytes_reduced)}"]
    if c.bytes_gathered:  # in the order of a step: fully sharded, gathers come first
        gathered = f"all-gather {_size(c.bytes_gathered)}"
        moved = [gathered, *moved] if c.reduction == "reduce-scatter" else [*moved, gathered]
    lines = [
        f"  {name + ':':<11} {group} ({c.group_size} ranks{_nodes(c.group_nodes)}): "
        f"{', '.join(moved)} (ring: {_size(c.group_sent)} sent)"
    ]
    if c.dp_replicate > 1:
        lines.append(
            f"  {'':<11} replicate group ({c.dp_replicate} ranks{_nodes(c.replica_nodes)}): "
            f"all-reduce {_size(c.bytes_across_replicas)} (ring: {_size(c.replica_sent)} sent)"
        )
    return lines


def _tp_lines(r: MemoryEstimate) -> list[str]:
    """The split layers' activation bytes per token, by way (not in trainer.stats)."""
    t, where = r.tp_activations, "" if r.gpus_per_node is None else ", within a node"
    return [
        f"  {'tp:':<11} tp group ({r.tp} ranks{where}), per token of a rank's micro-batch: "
        f"forward {_size(t.forward)} in {t.forward_calls} collectives, backward "
        f"{_size(t.backward)} in {t.backward_calls}"
    ]


def _trainable_line(r: MemoryEstimate) -> str:
    """How many parameters train, their bytes in the model's dtype, and how they were chosen."""
    size = r.trainable_bytes
    unit, scale = ("GiB", 2**30) if size >= 2**30 else ("MiB", 2**20)
    how = r.trainable.describe() if not r.trainable.everything else "the rest frozen"
    if len(r.dtypes) > 1:
        of = _sizes([(dtype_name(d), t) for d, _, t in r.dtype_bytes if t])
    else:
        of = f"{size / scale:,.2f} {unit} of {dtype_name(r.dtype)}"
    return f"trainable    {r.trainable_parameters:,} in {r.trainable_tensors} tensors ({of}): {how}"


def _unit_lines(r: MemoryEstimate, short: str, name: str) -> list[str]:
    """What the mode ``name`` gathers, and what its ``transient`` row counts."""
    what = "bytes" if len(r.dtypes) > 1 else "elements"  # a mixed layout's positions
    gathered = [u for u in r.units if not u.kept]
    kept = [u for u in r.units if u.kept]
    parts = []
    if gathered:
        span = gathered[0].name
        if len(gathered) > 1:
            span += f" .. {gathered[-1].name}"
        largest = max(u.numel for u in gathered)
        parts.append(f"{len(gathered)} gathered in turn ({span}, up to {largest:,} {what})")
    if kept:
        numel = sum(u.numel for u in kept)
        parts.append(f"{len(kept)} kept for the step ({numel:,} {what})")
    if r.reshard_after_forward:
        what = f"the running unit, {r.prefetch} prefetched, 2 unit gradients"
    else:
        what = "every unit from its forward to its backward, 2 unit gradients"
    across = ", a stripe all-reduced across replicas" if r.dp_replicate > 1 else ""
    return [
        f"units        {name}: {', '.join(parts)}",
        f"transient    {name}: {what}, the kept units and their gradients{across} ({short})",
    ]


def format_estimate(r: MemoryEstimate) -> str:
    """The table ``torchshard estimate`` prints: per-rank bytes by mode, and what fits.

    Example::

        print(format_estimate(estimate_memory(layout, world_size=8)))
    """
    lines: list[str] = []
    short = "+".join(map(_short, r.dtypes))  # with several, the buffers are bytes
    big = max(m.worst.total for m in r.modes) >= 2**30
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    gathering = [m.name for m in r.modes if m.entry.gathers]
    lines.append(f"model        {r.model} ({r.model_class})")
    if len(r.dtypes) > 1:
        lines.append(
            f"parameters   {r.parameters:,} in {r.tensors} tensors: "
            f"{_sizes(list(r.parameter_bytes.items()))}; flat buffer {r.numel:,} bytes"
            + _per_tp_rank(r)
        )
    else:
        lines.append(
            f"parameters   {r.parameters:,} in {r.tensors} tensors; flat buffer {r.numel:,} "
            f"elements of {dtype_name(r.dtype)}" + _per_tp_rank(r)
        )
    if not r.trainable.everything or r.trainable_parameters != r.parameters:
        lines.append(_trainable_line(r))
    lines.append(
        f"training     {_OPTIMIZER_NAMES[r.optimizer]} at world size {r.world_size}"
        + (f" (tp {r.tp} x data-parallel {r.dp_size})" if r.tp > 1 else "")
        + _precision(r)
    )
    if r.dp_replicate > 1:
        lines.append(_hsdp_line(r))
    for name in gathering:
        lines.extend(_unit_lines(r, short, name))
    lines.append("")
    rows = [
        (f"parameters ({short})", "parameters"),
        (f"gradients ({short})", "gradients"),
        ("optimizer state", "optimizer"),
        ("fp32 master + grad", "master"),
    ]
    if gathering:
        rows.append((f"transient ({short})", "transient"))
    w = max(18, *(len(label) for label, _ in rows))  # wider for several dtypes' labels
    lines.append(f"{'per rank, ' + unit:<{w}}" + "".join(f"{m.name:>12}" for m in r.modes))
    for label, key in rows:
        values = [m.worst.as_dict()[key] / scale for m in r.modes]
        lines.append(f"{label:<{w}}" + "".join(f"{v:>12,.2f}" for v in values))
    lines.append(f"{'total':<{w}}" + "".join(f"{m.worst.total / scale:>12,.2f}" for m in r.modes))
    lines.append("")
    for m in r.modes:
        if not m.entry.memory.divided or r.dp_size == 1:
            continue
        if m.spread:
            lines.append(
                f"{m.name}: the worst rank (rank {m.worst.rank}); the others hold at most "
                f"{m.spread:,} bytes less"
            )
        else:
            lines.append(f"{m.name}: every rank holds the same")
    if r.dp_replicate > 1 or r.gpus_per_node is not None or r.tp > 1:
        lines.append(
            "per step     bytes per rank as trainer.stats counts them (each collective's buffer "
            "at its full size)"
        )
        for m in r.modes:
            if m.comm is not None:
                lines.extend(_comm_lines(m.name, m.comm))
        if r.tp > 1:
            lines.extend(_tp_lines(r))
    if r.budget is not None and r.device_memory is not None:
        size = f"{r.device_memory / scale:,.2f} {unit} ({r.device_memory:,} bytes)"
        if r.reserve:
            size += f", {r.reserve:.0%} reserved: {r.budget / scale:,.2f} {unit} for the above"
        lines.append(f"device       {size}")
        lines.extend(f"  {m.name + ':':<11} {_fit(r, m, r.budget)}" for m in r.modes)
    lines.append(f"not counted: {', '.join(NOT_COUNTED)}; leave headroom for them (--reserve)")
    return "\n".join(lines)


def _fit(r: MemoryEstimate, m: ModeEstimate, budget: int) -> str:
    """Whether mode ``m`` fits ``budget`` now, and at which world size (or, at this world
    size, which ``dp_shard``) it first does."""
    now = f"{'fits' if m.worst.total <= budget else 'does not fit'} at world size {r.world_size}"
    memory = m.entry.memory
    if not memory.divided:
        if m.min_world_size is not None:
            return f"{now}; fits at any world size (nothing is divided among ranks)"
        return f"{now}; no world size fits (nothing is divided among ranks)"
    if r.dp_replicate > 1:
        now = f"{now} (dp_shard {r.dp_shard}, dp_replicate {r.dp_replicate})"
        return f"{now}; {_shard_fit(r, m)}"
    if m.min_world_size is not None:
        hybrid = f"; {_shard_fit(r, m)}" if r.dp_size > 1 else ""
        return f"{now}; the smallest world size that fits is {m.min_world_size}{hybrid}"
    if m.floor > budget:
        return f"{now}; no world size fits: {memory.floor_note} {m.floor / 2**30:,.2f} GiB"
    return f"{now}; no world size up to {MAX_WORLD_SIZE:,} fits"


def _shard_fit(r: MemoryEstimate, m: ModeEstimate) -> str:
    """The smallest ``dp_shard`` that fits at the world size: its total, its replicas, and
    how many nodes its shard groups span."""
    n, total = m.min_shard_size, m.min_shard_total
    if n is None or total is None:
        memory = m.entry.memory
        why = (
            f": {memory.floor_note} {m.floor / 2**30:,.2f} GiB" if m.floor > (r.budget or 0) else ""
        )
        return f"no dp_shard fits at world size {r.world_size}{why}"
    where = f"{total / 2**30:,.2f} GiB, dp_replicate {r.dp_size // n}"
    if r.dp_per_node is not None:
        groups, _ = node_spans(r.dp_size, n, r.dp_per_node)
        where += (
            "; shard groups within a node" if groups == 1 else f"; shard groups span {groups} nodes"
        )
    return f"the smallest dp_shard that fits at world size {r.world_size} is {n} ({where})"
