"""``Pipeline``: the whole model split into stages over ``pp`` ranks, each stage a flat
buffer under a :class:`DistributedTrainer` over its data-parallel group, scheduled by
torch's own ``torch.distributed.pipelining``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from .._dist import init_distributed
from .._errors import PipelineError
from .._flat.module import FlatParamModule
from .._parallel.trainer import DistributedTrainer
from .grads import global_norm_, tie_grads
from .plan import StagePlan, plan_stages
from .split import split_stages, whole_order_init
from .stage import FlatStage, StageModule

__all__ = ["Pipeline"]

SUPPORTED = ("GPipe", "1F1B")


class Pipeline:
    """Pipeline parallelism: ``model`` split into ``pp`` stages, ``world // pp`` data-parallel
    replicas of each.

    Ranks form a ``(pp, dp)`` grid, pp outermost: ``rank = pp_rank * dp + dp_rank``. Each
    stage is a :class:`FlatParamModule` over a pruned copy of ``model`` (names unchanged),
    initialized to the bits a one-process init of the whole model gives (same seed, same
    order), under a :class:`DistributedTrainer` over the stage's data-parallel group
    (``shard=False`` or ``True``). The schedule is torch's (``get_schedule_class``), built
    with ``scale_grads=False``: the loss is divided by ``microbatches`` instead. A weight
    tied across stages (an embedding and its head) has one owner; the replica gets the
    same gradient sum and the same update, and is counted once in the norm.

    Args:
        model: the whole model, built on meta.
        pp: the pipeline degree; the world size must be a multiple of it.
        microbatches: per step and data-parallel replica; the local batch must divide.
        loss_fn: ``(last stage's output, target) -> mean loss`` of one microbatch.
        stages: ``"auto"`` (``pp`` stages balanced by parameters), a count, or per stage
            the names of the modules it keeps (:func:`plan_stages`).
        schedule: ``"GPipe"`` or ``"1F1B"``.
        shard: each stage's data-parallel mode (``False`` or ``True``).
        init_fn: as :class:`DistributedTrainer`'s, applied in the whole model's order.
        process_group: the ranks of the pipeline (default: the world).
        trainer_kwargs: passed to each stage's :class:`DistributedTrainer`.

    Example::

        pipe = torchshard.Pipeline(model, pp=2, microbatches=4, loss_fn=loss_fn)
        opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)
        for x, y in data:
            pipe.zero_grad()
            loss = pipe.forward_backward(x, target=y)
            pipe.clip_grad_norm_(1.0)
            pipe.step()
        pipe.close()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pp: int,
        microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        stages: str | int | Sequence[Sequence[str]] | StagePlan = "auto",
        schedule: str = "1F1B",
        shard: bool = False,
        init_fn: Callable[[nn.Module], None] | None = None,
        process_group: dist.ProcessGroup | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if process_group is None:
            init_distributed()
        world = dist.get_world_size(process_group)
        me = dist.get_rank(process_group)
        _check_args(pp, microbatches, world, schedule, shard, loss_fn)
        self.plan = _plan(model, stages, pp)
        if self.plan.ties and shard is not False:
            t = self.plan.ties[0]
            raise PipelineError(
                f"shard={shard!r}: {t.name} is tied across stages {t.owner} and {t.holder} "
                f"(as {t.alias}); tied weights across stages need shard=False for now"
            )
        self.microbatches, self._world = microbatches, process_group
        self.pp_size, self.dp_size = pp, world // pp
        self.pp_rank, self.dp_rank = divmod(me, self.dp_size)
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == pp - 1
        self._groups: list[dist.ProcessGroup] = []
        ranks = dist.get_process_group_ranks(process_group) if process_group else range(world)
        grid = [[ranks[s * self.dp_size + d] for d in range(self.dp_size)] for s in range(pp)]
        dp_group = self._group([grid[s] for s in range(pp)], self.pp_rank)
        pp_group = self._group(
            [[row[d] for row in grid] for d in range(self.dp_size)], self.dp_rank
        )
        self._tie_groups = [
            self._group(
                [[grid[t.owner][d], grid[t.holder][d]] for d in range(self.dp_size)],
                self.dp_rank if self.pp_rank in (t.owner, t.holder) else None,
            )
            for t in self.plan.ties
        ]
        self._pp_group, self._last_rank = pp_group, grid[pp - 1][self.dp_rank]
        (module,) = split_stages(model, self.plan, [self.pp_rank])
        self.fm = FlatParamModule(module)
        self.trainer = DistributedTrainer(
            self.fm,
            process_group=dp_group,
            shard=shard,
            init_fn=_whole_init(model, module, init_fn),
            **trainer_kwargs,
        )
        self.stage = FlatStage(
            StageModule(self.fm), self.pp_rank, pp, self.trainer.device, group=pp_group
        )
        self.stage.trainer = self.trainer
        self.schedule = get_schedule_class(schedule)(
            self.stage, microbatches, loss_fn=_scaled(loss_fn, microbatches), scale_grads=False
        )
        self._reduced = False

    def _group(self, rows: list[list[int]], mine: int | None) -> dist.ProcessGroup | None:
        """One group per row, created by every rank in the same order; this rank's row's."""
        out = None
        for i, row in enumerate(rows):
            g = dist.new_group(row)
            if i == mine:
                out = g
                self._groups.append(g)
        return out

    # -- training --------------------------------------------------------------------------
    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kw: Any) -> Any:
        """This rank's stage's optimizer (:meth:`DistributedTrainer.make_optimizer`)."""
        return self.trainer.make_optimizer(optimizer_class, **kw)

    def zero_grad(self) -> None:
        """Forget the gradients of this rank's stage."""
        self.trainer.zero_grad()
        self._reduced = False

    def forward_backward(self, *inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        """Run one schedule over the local batch (``microbatches`` equal pieces); returns this
        data-parallel replica's mean loss on every rank of the replica."""
        self._check_batch(inputs, target)
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *(inputs if self.is_first else ()),
            target=target if self.is_last else None,
            losses=losses if self.is_last else None,
        )
        return self._mean_loss(losses)

    @torch.no_grad()
    def evaluate(self, *inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        """The replica's mean loss, forward only (``schedule.eval``), on every rank."""
        self._check_batch(inputs, target)
        losses: list[torch.Tensor] = []
        self.schedule.eval(
            *(inputs if self.is_first else ()),
            target=target if self.is_last else None,
            losses=losses if self.is_last else None,
        )
        return self._mean_loss(losses)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every stage's gradient to one global norm of ``max_norm``; returns the norm
        before, bitwise equal on every rank (one gather of a scalar over the pipeline)."""
        self._finish()
        return global_norm_(self, float(max_norm), float(norm_type))

    def step(self) -> None:
        """Finish the reductions (ties included) and step this rank's stage."""
        self._finish()
        self.trainer.step()
        self._reduced = False

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank's stage holds (:meth:`DistributedTrainer.memory_bytes`)."""
        return self.trainer.memory_bytes()

    def close(self) -> None:
        """Close the stage's trainer, then destroy the groups the pipeline created."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.trainer.close()
        groups, self._groups = self._groups, []
        for g in groups:
            dist.destroy_process_group(g)

    # -- helpers ---------------------------------------------------------------------------
    def _finish(self) -> None:
        if not self._reduced:
            self.trainer.average_gradients()
            tie_grads(self)
            self._reduced = True

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        dtype = torch.get_default_dtype()
        out = torch.zeros((), dtype=dtype, device=self.trainer.device)
        if self.is_last:
            for v in losses:  # each already divided by the microbatch count
                out += v.detach().to(dtype)
        if self.pp_size > 1:
            dist.broadcast(out, self._last_rank, group=self._pp_group)
        return out

    def _check_batch(self, inputs: tuple[torch.Tensor, ...], target: Any) -> None:
        first = inputs[0] if inputs else target
        if not isinstance(first, torch.Tensor):
            raise PipelineError("forward_backward: pass the batch (and target) on every rank")
        if first.shape[0] % self.microbatches:
            raise PipelineError(
                f"forward_backward: local batch {first.shape[0]} is not divisible by "
                f"microbatches {self.microbatches}: microbatches must be equal"
            )


def _scaled(loss_fn: Callable[..., torch.Tensor], m: int) -> Callable[..., torch.Tensor]:
    def scaled(out: Any, target: Any) -> torch.Tensor:
        return loss_fn(out, target) / m

    return scaled


def _whole_init(
    whole: nn.Module, stage: nn.Module, fn: Callable[[nn.Module], None] | None
) -> Callable[[nn.Module], None]:
    """An ``init_fn`` for the stage's trainer: at the stage's root (``apply`` reaches it
    last), initialize in the whole model's order."""

    def init(m: nn.Module) -> None:
        if m is stage:
            whole_order_init(whole, stage, fn)

    return init


def _plan(model: nn.Module, stages: Any, pp: int) -> StagePlan:
    if isinstance(stages, StagePlan):
        if stages.pp != pp:
            raise PipelineError(f"stages: a plan for pp={stages.pp}, got pp={pp}")
        return stages
    if stages == "auto":
        stages = pp
    return plan_stages(model, stages, pp=pp)


def _check_args(pp: Any, m: Any, world: int, schedule: Any, shard: Any, loss_fn: Any) -> None:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise PipelineError(f"pp: expected a positive int, got {pp!r}")
    if world % pp:
        raise PipelineError(f"pp: expected a divisor of the world size {world}, got {pp}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise PipelineError(f"microbatches: expected a positive int, got {m!r}")
    if schedule not in SUPPORTED:
        raise PipelineError(
            f"schedule: expected one of {list(SUPPORTED)}, got {schedule!r}; interleaved and "
            "zero-bubble schedules are not supported yet"
        )
    if not issubclass(get_schedule_class(schedule), PipelineScheduleSingle):
        raise PipelineError(f"schedule: {schedule} runs several stages per rank")
    if shard not in (False, True):
        raise PipelineError(f"shard: expected False or True, got {shard!r}")
    if not callable(loss_fn):
        raise PipelineError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")
