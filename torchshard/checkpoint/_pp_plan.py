"""Pipeline checkpoints, the plan: who writes what of the whole model's files (arithmetic
on the whole layout), and the stages a rank saves or loads.

A pipeline's files are what a one-process save writes, cut where the stages are: stage
``k`` owns slots ``[lo, hi)`` of the whole layout (``plan.owned``), hence the tile of flat
elements from its first slot to the next stage's. A **share** is one (stage ``k``,
data-parallel rank ``d``), numbered ``q = k * dp + d`` of ``Q = stages * dp``: it writes
run ``d`` of the stage's slots (byte-balanced) to ``model-{q+1}-of-{Q}`` and range ``d`` of
its tile (equal parts) to ``optim-{q+1}-of-{Q}``. The runs tile the slots in order and the
ranges tile ``[0, numel)`` in order: the reader's coverage check holds, and any reader
(a plain trainer's, ``consolidate``) reads them as any other save's. Replicas of tied
weights are never written: their owner's slot is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._errors import CheckpointError
from .._flat.layout import FlatLayout
from ._format import model_file, optim_file
from ._target import PipelineState, Target

__all__ = [
    "by_name",
    "pipeline_targets",
    "stage_ranges",
    "stage_runs",
    "stage_tiles",
    "weight_shards",
    "whole_layout",
]


def by_name(whole: FlatLayout) -> dict[str, int]:
    """Every name of the whole layout (canonical and tied aliases) -> its slot."""
    return {n: i for i, s in enumerate(whole.slots) for n in s.names}


def stage_tiles(whole: FlatLayout, owned: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each stage's flat elements: from its first slot to the next stage's (the first from
    0, the last to ``numel``)."""
    starts = [whole.slots[lo].offset for lo, _ in owned]
    starts[0] = 0
    return [
        (a, starts[k + 1] if k + 1 < len(starts) else whole.numel) for k, a in enumerate(starts)
    ]


def stage_runs(whole: FlatLayout, lo: int, hi: int, dp: int) -> list[tuple[int, int]]:
    """Slots ``[lo, hi)`` cut into ``dp`` runs of about equal bytes (some may be empty):
    run ``d`` starts at the first slot whose bytes before it reach ``d / dp`` of the total."""
    sizes = [whole.slots[i].numel * whole.slots[i].torch_dtype.itemsize for i in range(lo, hi)]
    total, cuts, acc, i = sum(sizes), [lo], 0, lo
    for d in range(1, dp):
        while i < hi and acc < total * d / dp:
            acc += sizes[i - lo]
            i += 1
        cuts.append(i)
    cuts.append(hi)
    return [(cuts[d], cuts[d + 1]) for d in range(dp)]


def stage_ranges(tile: tuple[int, int], dp: int) -> list[tuple[int, int]]:
    """A stage's tile cut into ``dp`` equal ranges of flat optimizer state."""
    a, b = tile
    return [(a + (b - a) * d // dp, a + (b - a) * (d + 1) // dp) for d in range(dp)]


def weight_shards(
    whole: FlatLayout, owned: Sequence[tuple[int, int]], dp: int
) -> tuple[list[dict], list[dict]]:
    """``metadata.json``'s ``weights.shards`` and ``optimizer.files`` of a pipeline save
    (the empty runs and ranges left out)."""
    q_all = len(owned) * dp
    shards, files = [], []
    for k, ((lo, hi), tile) in enumerate(zip(owned, stage_tiles(whole, owned))):
        for d, ((a, b), (s, e)) in enumerate(
            zip(stage_runs(whole, lo, hi, dp), stage_ranges(tile, dp))
        ):
            q = k * dp + d
            if b > a:
                shards.append({"file": model_file(q, q_all), "slots": [a, b]})
            if e > s:
                files.append({"file": optim_file(q, q_all), "range": [s, e]})
    return shards, files


def pipeline_targets(
    pipe: PipelineState, optimizer: torch.optim.Optimizer | None
) -> list[tuple[int, Target, torch.optim.Optimizer | None]]:
    """``(stage, its target, its optimizer)`` for each stage this rank runs; ``optimizer``
    must be the pipeline's (``pipe.make_optimizer``: one part per stage)."""
    parts = None
    if optimizer is not None:
        parts = getattr(optimizer, "parts", None)
        if not isinstance(parts, list) or len(parts) != len(pipe.stages):
            raise CheckpointError(
                f"optimizer: expected the pipeline's optimizer (pipe.make_optimizer(...), one "
                f"part per stage), got {type(optimizer).__name__}"
            )
    out = []
    for j, h in enumerate(pipe.stages):
        t = Target(h.trainer)
        if t.tp is not None or t.across is not None or t.fm.layout.mixed:
            raise CheckpointError(
                f"stage {h.index}: a pipeline stage with tensor parallelism, hybrid sharding "
                "or parameters of several dtypes cannot be checkpointed yet"
            )
        out.append((h.index, t, parts[j] if parts is not None else None))
    return out


def whole_layout(pipe: PipelineState) -> FlatLayout:
    """The whole model's layout: the one a checkpoint records."""
    return FlatLayout.from_module(pipe.whole)
