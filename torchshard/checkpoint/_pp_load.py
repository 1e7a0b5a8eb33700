"""Pipeline checkpoints, the load: each stage reads its slots of the whole tensors.

A checkpoint is the one-process picture (``_pp_save``; a plain trainer's save, or one of a
pipeline cut otherwise, alike). Each stage this rank runs is loaded as a trainer would be,
over its data-parallel group (``_load._apply``), from reads laid out as that trainer's:
slot by slot, local slot ``i`` is the whole slot of the same name (a tied replica: the
slot it is an alias of, so that after a load it equals its owner), read at the whole
layout's offsets through the existing reader arithmetic (``_tp_load.read_pieces``,
``_reads.read_state``). The optimizer section is narrowed to the stage: its param groups
by its own names (checked against the saved groups), its scalar state by its slots. The
ranks agree over the pipeline's group: one failing rank makes every rank raise, before
anything changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .._dist import exchange_bytes
from .._errors import CheckpointError
from .._flat.layout import FlatLayout
from ._format import METADATA
from ._metadata import Metadata, Readers, layout_difference
from ._optim import OptimizerView, group_problem
from ._pp_plan import by_name, pipeline_targets, whole_layout
from ._reads import read_state, zero_gaps
from ._streams import Stream
from ._target import CheckpointInfo, PipelineState, Target
from ._tp_load import read_pieces

__all__ = ["PipelineLoad", "target_of"]


class _Global:
    """A stage's slots read from the whole tensors: local slot ``i`` is whole slot
    ``slot[i]``, read whole (what ``read_pieces`` asks of a piece)."""

    def __init__(self, meta: Metadata, readers: Readers, slot: list[int]) -> None:
        self.meta, self.readers, self.slot = meta, readers, slot
        self.file = {i: w["file"] for w in meta.weights for i in range(*w["slots"])}

    def weights(self, i: int, lo: int, hi: int, dst: torch.Tensor) -> None:
        s = self.meta.layout.slots[self.slot[i]]
        file = self.file[self.slot[i]]
        self.readers.entry(file, s.name, s.torch_dtype, s.shape)
        self.readers[file].read_into(s.name, lo, hi, dst)

    def state(self, stream: Stream, i: int, lo: int, hi: int, dst: torch.Tensor) -> None:
        off = self.meta.layout.slots[self.slot[i]].offset
        parts = [(off + lo, off + hi, 0)]
        zero_gaps(dst, read_state(self.readers, self.meta, stream, parts, dst))


class PipelineLoad:
    """A pipeline as a load sees it: its ranks (``rank``, ``world``, ``exchange``: what
    ``_load`` agrees over) and each stage it runs, read and checked as a trainer."""

    def __init__(self, pipe: PipelineState, optimizer: torch.optim.Optimizer | None) -> None:
        self.stages = pipeline_targets(pipe, optimizer)
        self.whole = whole_layout(pipe)
        self.index = by_name(self.whole)
        sd = pipe.whole.state_dict(keep_vars=True)
        self.buffers = {n for n, v in sd.items() if n not in self.index and v is not None}
        self.group, self.device = pipe.process_group, self.stages[0][1].device
        self.readers: Readers | None = None
        self.rank, self.world = (
            pipe.pp_rank * pipe.dp_size + pipe.dp_rank,
            pipe.pp_size * pipe.dp_size,
        )

    def exchange(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (a collective over the pipeline's ranks)."""
        return exchange_bytes(data, self.group, self.device)

    def apply(self, stages: list[tuple[Any, ...]], apply: Callable[..., None]) -> CheckpointInfo:
        """Apply each stage's reads (``apply(target, optimizer, meta, read)``: ``_load``'s),
        then let its trainer refresh what it derives from the weights; what was loaded."""
        for t, optimizer, meta, read in stages:
            apply(t, optimizer, meta, read)
            t.after_load()
        meta = stages[0][2]
        return CheckpointInfo(
            meta.step, meta.extra, meta.path, self.readers.bytes_read if self.readers else 0
        )

    def read(
        self, meta: Metadata, readers: Readers
    ) -> list[tuple[Target, torch.optim.Optimizer | None, Metadata, tuple[Any, ...]]]:
        """Check the checkpoint against the whole model, then per stage: its narrowed
        metadata and its reads (``_load._Read``'s fields)."""
        diff = layout_difference(meta.layout, self.whole)
        if diff is not None:
            raise CheckpointError(
                f"{meta.path}: the checkpoint is of a different model; first difference "
                f"(checkpoint vs this pipeline's whole model): {diff}"
            )
        if set(meta.buffers) != self.buffers:
            raise CheckpointError(
                f"{meta.path}: module buffers differ: checkpoint has "
                f"{sorted(set(meta.buffers) - self.buffers)} that the model lacks, the model "
                f"has {sorted(self.buffers - set(meta.buffers))} that the checkpoint lacks"
            )
        out, self.readers = [], readers  # closed before apply: then it counts the bytes read
        for k, t, optimizer in self.stages:
            slot = [self.index[s.name] for s in t.fm.layout.slots]
            mine = _narrow(meta, k, t, optimizer, slot)
            src = _Global(mine, readers, slot)
            out.append((t, optimizer, mine, read_pieces(mine, t, optimizer, readers, src)))
        return out


def target_of(obj: Any, optimizer: torch.optim.Optimizer | None) -> Target | PipelineLoad:
    """What a load acts on: a pipeline's stages, or a trainer (``Target`` says what else)."""
    return PipelineLoad(obj, optimizer) if isinstance(obj, PipelineState) else Target(obj)


def _narrow(
    meta: Metadata, k: int, t: Target, optimizer: torch.optim.Optimizer | None, slot: list[int]
) -> Metadata:
    """``meta`` with its optimizer section as stage ``k``'s: the saved groups with this
    stage's parameters by its names, scalar state and ``stateful`` by its slots."""
    if optimizer is None:
        return meta
    saved = meta.optim_for(optimizer)
    view = OptimizerView.of(optimizer, t)
    if len(saved.param_groups) != len(view.group_names):
        raise CheckpointError(
            f"{meta.path}: optimizer: checkpoint has {len(saved.param_groups)} param groups, "
            f"stage {k}'s optimizer {len(view.group_names)}"
        )
    layout: FlatLayout = t.fm.layout
    local = {s.name: i for i, s in enumerate(layout.slots)}
    where = {name: g for g, grp in enumerate(saved.param_groups) for name in grp["params"]}
    groups = []
    for g, (grp, names) in enumerate(zip(saved.param_groups, view.group_names)):
        for name in names:
            whole = meta.layout.slots[slot[local[name]]].name
            if where.get(whole) != g:
                theirs = "in no param group" if whole not in where else f"in group {where[whole]}"
                raise CheckpointError(
                    f"{meta.path}: optimizer param group {g}: stage {k} has parameter {name!r} "
                    f"there; the checkpoint has {whole!r} {theirs}"
                )
        groups.append({**grp, "params": list(names)})
    rules = saved.rules
    problem = group_problem(groups, optimizer, None if rules is None else rules.hyper, t.device)
    if problem is not None:
        raise CheckpointError(
            f"{meta.path / METADATA}: {problem}; build the optimizer as it was when saved"
        )
    scalars = {
        key: {**spec, "values": [spec["values"][g] for g in slot]}
        for key, spec in saved.scalar_state.items()
    }
    stateful = "".join(saved.stateful[g] for g in slot)
    optim = dataclasses.replace(saved, param_groups=groups, scalar_state=scalars, stateful=stateful)
    return dataclasses.replace(meta, optim=optim)
