"""Per-stage memory of a pipeline, from the whole model on meta: each stage is the pruned copy
:class:`Pipeline` builds (:func:`split_stages`), its flat layout planned by
:func:`plan_memory` at the data-parallel degree. Pure: no tensor data, no process group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._errors import PipelineError
from .._flat.layout import FlatLayout
from .._parallel.footprint import RankMemory
from .._parallel.memory import plan_memory
from .plan import StagePlan, plan_stages
from .split import split_stages

__all__ = ["PipelineMemory", "held_microbatches", "plan_pipeline_memory"]


@dataclass(frozen=True)
class PipelineMemory:
    """What each stage's trainer holds, per data-parallel rank, and what a rank holds.

    Example::

        mem = torchshard.plan_pipeline_memory(model, 4, pp=2, dp=2, shard=True)
        mem.stages[3][1].total          # stage 3's trainer on data-parallel rank 1
        mem.rank(pp_rank=1, dp_rank=1)  # stages 1 and 3 summed: pipe.memory_bytes() there
    """

    plan: StagePlan
    stages: tuple[tuple[RankMemory, ...], ...]
    """Per stage, per data-parallel rank: its trainer's :meth:`memory_bytes`."""

    @property
    def dp(self) -> int:
        return len(self.stages[0])

    def rank(self, pp_rank: int, dp_rank: int = 0) -> RankMemory:
        """The stages of pipeline rank ``pp_rank`` summed on data-parallel rank ``dp_rank``,
        as :meth:`Pipeline.memory_bytes` reports them (``rank`` the global rank
        ``pp_rank * dp + dp_rank``)."""
        if not 0 <= pp_rank < self.plan.pp or not 0 <= dp_rank < self.dp:
            raise PipelineError(
                f"rank: expected pp_rank in [0, {self.plan.pp}) and dp_rank in [0, {self.dp}), "
                f"got ({pp_rank}, {dp_rank})"
            )
        mine = [self.stages[k][dp_rank] for k in self.plan.stages_of_rank(pp_rank)]
        fields = ("parameters", "gradients", "optimizer", "master", "transient")
        sums = {f: sum(getattr(m, f) for m in mine) for f in fields}
        return RankMemory(rank=pp_rank * self.dp + dp_rank, **sums)

    def ranks(self) -> list[RankMemory]:
        """Every global rank's :meth:`rank`, in rank order (pp outermost)."""
        return [self.rank(p, q) for p in range(self.plan.pp) for q in range(self.dp)]


def plan_pipeline_memory(
    model: nn.Module,
    stages: int | Sequence[Sequence[str]] | StagePlan,
    *,
    pp: int,
    dp: int = 1,
    shard: bool = False,
    optimizer: str = "adamw",
    master_dtype: torch.dtype = torch.float32,
) -> PipelineMemory:
    """What each stage of ``Pipeline(model, pp=pp, stages=stages, shard=shard)`` holds on a
    world of ``pp * dp`` ranks, by :func:`plan_memory` over each stage's own layout.

    Args:
        model: the whole model, on meta (nothing is allocated).
        stages: a stage count, per stage the module names, or a :class:`StagePlan`, as
            :class:`Pipeline`'s ``stages`` (``"auto"`` there is ``pp`` stages for GPipe and
            1F1B, ``2 * pp`` for the interleaved schedules).
        pp, dp: the pipeline and data-parallel degrees.
        shard: each stage's data-parallel mode (``False`` or ``True``).
        optimizer, master_dtype: as :func:`plan_memory`'s (and the stages' trainers').

    A stage holds the parameters it owns and a replica of each weight tied to another stage
    (the replica gets its own gradient and optimizer state: it is updated like the owner's).
    Activations are not counted: with ``m`` microbatches a stage ``s`` of ``p`` holds those
    of ``m`` microbatches under GPipe and of at most ``p - s`` under 1F1B.

    Example::

        with torch.device("meta"):
            model = GPT(cfg)
        mem = torchshard.plan_pipeline_memory(model, 2, pp=2, dp=4, shard=True)
        worst = max(mem.ranks(), key=lambda r: r.total)
    """
    if isinstance(stages, StagePlan):
        if stages.pp != pp:
            raise PipelineError(f"stages: a plan for pp={stages.pp}, got pp={pp}")
        plan = stages
    else:
        plan = plan_stages(model, stages, pp=pp)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise PipelineError(f"dp: expected a positive int, got {dp!r}")
    if shard not in (False, True):
        raise PipelineError(
            f"shard: expected False or True, got {shard!r}; a fully sharded stage "
            '(shard="full") is not supported in a pipeline yet'
        )
    out = []
    for module in split_stages(model, plan, range(plan.num_stages)):
        layout = FlatLayout.from_module(module)
        planned = plan_memory(
            layout, dp, shard=shard, optimizer=optimizer, master_dtype=master_dtype
        )
        out.append(tuple(planned))
    return PipelineMemory(plan, tuple(out))


def held_microbatches(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1
) -> tuple[int, ...]:
    """Per pipeline rank, the most microbatches whose forward activations its stages hold at
    once (a microbatch counted once per stage holding it), as torch's schedules run them.

    GPipe and LoopedBFS run every forward before any backward: ``v * m`` (``v`` stages per
    rank, ``m`` microbatches). 1F1B: rank ``r`` runs ``p - 1 - r`` warm-up forwards and one
    more before its first backward, ``min(m, p - r)``: the first stage holds ``p``, the last
    one. Interleaved1F1B: torch's warm-up (Megatron's), ``(v - 1) * k + 2 * (p - 1 - r)``
    forwards with ``k`` microbatches per round (``p`` when ``m >= p``), plus one, at most
    ``v * m``. Multiply by a stage's activation bytes per microbatch for the memory.

    Example::

        torchshard.held_microbatches("1F1B", 4, 8)             # (4, 3, 2, 1)
        torchshard.held_microbatches("Interleaved1F1B", 4, 8, 2)  # (11, 9, 7, 5)
    """
    p, m, v = pp, microbatches, stages_per_rank
    for name, n in (("pp", p), ("microbatches", m), ("stages_per_rank", v)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PipelineError(f"{name}: expected a positive int, got {n!r}")
    if schedule in ("GPipe", "LoopedBFS"):
        if schedule == "GPipe" and v != 1:
            raise PipelineError(f"stages_per_rank: GPipe runs one stage per rank, got {v}")
        return tuple(v * m for _ in range(p))
    if schedule == "1F1B":
        if v != 1:
            raise PipelineError(f"stages_per_rank: 1F1B runs one stage per rank, got {v}")
        return tuple(min(m, p - r) for r in range(p))
    if schedule == "Interleaved1F1B":
        k = m // max(1, m // p)  # torch's microbatches per round
        return tuple(min(v * m, (v - 1) * k + 2 * (p - 1 - r) + 1) for r in range(p))
    raise PipelineError(
        f"schedule: expected GPipe, 1F1B, Interleaved1F1B or LoopedBFS, got {schedule!r}"
    )
