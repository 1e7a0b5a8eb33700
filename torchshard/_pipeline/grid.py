"""The ranks of a pipeline: a ``(pp, dp)`` grid, pp outermost, and the process groups every
rank creates in the same order (data-parallel groups per local stage, the pipeline's
point-to-point groups, one group per weight tied across ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .._errors import PipelineError
from .plan import StagePlan

__all__ = ["Grid"]


@dataclass
class Grid:
    """``rank = pp_rank * dp + dp_rank`` over the ranks of ``group`` (``None``: the world)."""

    pp: int
    group: dist.ProcessGroup | None
    owned: list[dist.ProcessGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        world = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        self.dp = world // self.pp
        self.pp_rank, self.dp_rank = divmod(me, self.dp)
        ranks = dist.get_process_group_ranks(self.group) if self.group else list(range(world))
        self.ranks = [[ranks[s * self.dp + d] for d in range(self.dp)] for s in range(self.pp)]

    def new(self, rows: list[list[int]], mine: int | None) -> dist.ProcessGroup | None:
        """One group per row, created by every rank in the same order; this rank's row's."""
        out = None
        for i, row in enumerate(rows):
            g = dist.new_group(row)
            if i == mine:
                out = g
                self.owned.append(g)
        return out

    def dp_group(self) -> dist.ProcessGroup | None:
        """A fresh data-parallel group of this rank's pipeline rank (one per local stage, so
        two stages on one rank never share a communicator)."""
        return self.new([self.ranks[s] for s in range(self.pp)], self.pp_rank)

    def pp_group(self) -> dist.ProcessGroup | None:
        return self.new([[row[d] for row in self.ranks] for d in range(self.dp)], self.dp_rank)

    def tie_groups(self, plan: StagePlan) -> list[dist.ProcessGroup | None]:
        """Per tie, the two pipeline ranks holding it, at each data-parallel index."""
        out = []
        for t in plan.ties:
            a, b = t.owner % self.pp, t.holder % self.pp
            if a == b:
                raise PipelineError(
                    f"stages: {t.name} is tied across stages {t.owner} and {t.holder}, which "
                    f"run on the same pipeline rank {a}; ties within one rank are not "
                    "supported yet"
                )
            mine = self.dp_rank if self.pp_rank in (a, b) else None
            out.append(
                self.new([[self.ranks[a][d], self.ranks[b][d]] for d in range(self.dp)], mine)
            )
        return out

    def last_rank(self) -> int:
        """The global rank holding the last stage at this data-parallel index."""
        return self.ranks[self.pp - 1][self.dp_rank]

    def destroy(self) -> None:
        groups, self.owned = self.owned, []
        for g in groups:
            dist.destroy_process_group(g)
