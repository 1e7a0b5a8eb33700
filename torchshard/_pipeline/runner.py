"""``Pipeline``: the whole model split into stages over ``pp`` ranks, each stage a flat
buffer under a :class:`DistributedTrainer` over its data-parallel group, scheduled by
torch's own ``torch.distributed.pipelining``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._dist import init_distributed, set_data_parallel
from .._errors import PipelineError
from .._flat.module import FlatParamModule
from .._parallel.mesh import Mesh
from .._parallel.seam import CommStats
from .._parallel.trainer import DistributedTrainer
from .grads import global_norm_, tie_grads, tie_weights
from .grid import Grid
from .hf import hf_stage_forward, set_stage_forward, stage_forward_for
from .optim import PipelineOptimizer
from .plan import StagePlan, parameterless_units, plan_stages
from .split import split_stages, whole_order_init

if TYPE_CHECKING:
    from .stage import FlatStage

# torch.distributed.pipelining (with the stage class that subclasses it) is imported where a
# Pipeline is built: it imports torch._dynamo and DTensor, about 1.5 s of CPU that every
# `import torchshard` (each torchrun rank) would pay otherwise.

__all__ = ["Pipeline", "StageHandle"]

SUPPORTED = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(eq=False)
class StageHandle:
    """One stage this rank runs: its index in the plan, its flat module, its trainer (over
    the stage's data-parallel group) and torch's stage object around them."""

    index: int
    fm: FlatParamModule
    trainer: DistributedTrainer
    stage: FlatStage


class Pipeline:
    """Pipeline parallelism: ``model`` split into stages over ``pp`` ranks, ``world // pp``
    data-parallel replicas of each.

    Ranks form a ``(pp, dp)`` grid, pp outermost: ``rank = pp_rank * dp + dp_rank``. Each
    stage is a :class:`FlatParamModule` over a pruned copy of ``model`` (names unchanged),
    initialized to the bits a one-process init of the whole model gives (same seed, same
    order), under a :class:`DistributedTrainer` over the stage's data-parallel group
    (``shard=False`` or ``True``). The schedule is torch's (``get_schedule_class``), built
    with ``scale_grads=False``: the loss is divided by ``microbatches`` instead. Interleaved
    schedules run ``stages_per_rank`` stages per rank, stage ``k`` on pipeline rank
    ``k % pp``. A weight tied across stages (an embedding and its head) has one owner; the
    replica gets the same gradient sum and the same update, and is counted once in the norm.

    Args:
        model: the whole model, built on meta.
        pp: the pipeline degree; the world size must be a multiple of it (or ``mesh=``).
        microbatches: per step and data-parallel replica; the local batch must divide.
        loss_fn: ``(last stage's output, target) -> mean loss`` of one microbatch.
        stages: ``"auto"`` (``pp * stages_per_rank`` stages balanced by parameters), a
            count, or per stage the names of the modules it keeps (:func:`plan_stages`).
        schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"`` or ``"LoopedBFS"``.
        stages_per_rank: stages each rank runs with ``stages="auto"`` (default: 1 for GPipe
            and 1F1B, 2 for the interleaved schedules).
        shard: each stage's data-parallel mode (``False`` or ``True``).
        dtype: each stage's flat buffer's dtype (:class:`FlatParamModule`'s ``dtype=``).
        init_fn: as :class:`DistributedTrainer`'s, applied in the whole model's order.
        process_group: the ranks of the pipeline (default: the world).
        mesh: instead of ``pp=``: ``torchshard.init_mesh(pp=P)`` (pp outermost; each
            pipeline rank's data-parallel ranks run its stages).
        stage_forward: ``(stage_module, *inputs) -> output``, run instead of the pruned
            model's own forward (default: :func:`hf_stage_forward` for a transformers
            decoder, which also keeps its parameterless modules on every stage).
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
        pp: int | None = None,
        microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        stages: str | int | Sequence[Sequence[str]] | StagePlan = "auto",
        schedule: str = "1F1B",
        stages_per_rank: int | None = None,
        shard: bool = False,
        dtype: torch.dtype | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
        process_group: dist.ProcessGroup | None = None,
        mesh: Mesh | None = None,
        stage_forward: Callable[..., Any] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if process_group is None:
            init_distributed()
        pp = _from_mesh(mesh, pp, process_group)
        world = dist.get_world_size(process_group)
        single = _check_args(pp, microbatches, world, schedule, shard, loss_fn)
        self.plan = _plan(model, stages, pp, single, stages_per_rank)
        run = stage_forward_for(model, stage_forward)
        self.microbatches, self._world = microbatches, process_group
        self._sharded = shard is True
        self.whole = model  # the whole model, on meta: checkpoints record its layout and config
        self.process_group = process_group  # the pipeline's ranks (None: the world)
        self._grid = grid = Grid(pp, process_group)
        self.pp_size, self.dp_size = pp, grid.dp
        self.pp_rank, self.dp_rank = grid.pp_rank, grid.dp_rank
        mine = self.plan.stages_of_rank(self.pp_rank)
        self.is_first, self.is_last = 0 in mine, self.plan.num_stages - 1 in mine
        if process_group is None:  # GlobalBatchSampler's default: this rank's replica
            set_data_parallel(self.dp_rank, self.dp_size, world)
        dp_groups = [grid.dp_group() for _ in mine]
        self._pp_group = grid.pp_group()
        self._tie_groups = grid.tie_groups(self.plan)
        self._last_rank = grid.last_rank()
        rng = torch.get_rng_state()  # every stage walks the whole model from the same state
        self.stages: list[StageHandle] = []
        everywhere = parameterless_units(model) if run is hf_stage_forward else []
        for k, module, group in zip(
            mine, split_stages(model, self.plan, mine, everywhere), dp_groups
        ):
            torch.set_rng_state(rng)
            if run is not None:
                set_stage_forward(module, run)
            fm = FlatParamModule(module, dtype=dtype)
            trainer = DistributedTrainer(
                fm,
                process_group=group,
                shard=shard,
                init_fn=_whole_init(model, module, init_fn),
                **trainer_kwargs,
            )
            from .stage import FlatStage, StageModule

            stage = FlatStage(
                StageModule(fm), k, self.plan.num_stages, trainer.device, group=self._pp_group
            )
            stage.trainer = trainer
            # sharded with a tie: the tie sum precedes the reduction, so nothing launches
            # in backward (replicated stages sum the means after it and keep the overlap)
            stage.hold = shard is True and any(k in (t.owner, t.holder) for t in self.plan.ties)
            self.stages.append(StageHandle(k, fm, trainer, stage))
        from torch.distributed.pipelining.schedules import get_schedule_class

        cls, scaled = get_schedule_class(schedule), _scaled(loss_fn, microbatches)
        runs = self.stages[0].stage if single else [h.stage for h in self.stages]
        try:
            self.schedule = cls(runs, microbatches, loss_fn=scaled, scale_grads=False)
        except ValueError as e:  # torch's own checks (microbatches against pp)
            raise PipelineError(f"schedule {schedule}: {e}") from None
        self._optimizer: PipelineOptimizer | None = None
        self._reduced = False

    # -- training --------------------------------------------------------------------------
    def make_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], **kw: Any
    ) -> PipelineOptimizer:
        """One optimizer over this rank's stages: each stage's
        :meth:`DistributedTrainer.make_optimizer` with the same arguments, behind one
        :class:`torch.optim.Optimizer` (``param_groups`` joined, for LR schedulers)."""
        if self._optimizer is not None:
            raise PipelineError("make_optimizer: this pipeline already has an optimizer")
        parts = [h.trainer.make_optimizer(optimizer_class, **kw) for h in self.stages]
        self._optimizer = PipelineOptimizer(parts, self._step)
        return self._optimizer

    def zero_grad(self) -> None:
        """Forget the gradients of this rank's stages."""
        for h in self.stages:
            h.trainer.zero_grad()
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
            return_outputs=False,  # else the last stage keeps every microbatch's output
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
        """Finish the reductions (ties included) and step this rank's stages."""
        if self._optimizer is not None:
            self._optimizer.step()  # through the optimizer: LR schedulers count the step
        else:
            self._step()

    def _step(self) -> None:
        self._finish()
        for h in self.stages:
            h.trainer.step()
        if self._sharded:
            tie_weights(self)
        self._reduced = False

    @property
    def stats(self) -> CommStats:
        """The data-parallel communication counters of this rank's stages, summed
        (:attr:`DistributedTrainer.stats`); pipeline p2p is not counted."""
        out = CommStats()
        for h in self.stages:
            for f in fields(CommStats):
                setattr(out, f.name, getattr(out, f.name) + getattr(h.trainer.stats, f.name))
        return out

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank's stages hold, summed (:meth:`DistributedTrainer.memory_bytes`)."""
        out: dict[str, int] = {}
        for h in self.stages:
            for key, n in h.trainer.memory_bytes().items():
                out[key] = out.get(key, 0) + n
        return out

    def close(self) -> None:
        """Close the stages' trainers, then destroy the groups the pipeline created."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for h in self.stages:
            h.trainer.close()
        self._grid.destroy()

    # -- helpers ---------------------------------------------------------------------------
    def _finish(self) -> None:
        if not self._reduced:
            if self._sharded:
                tie_grads(self)
            for h in self.stages:
                h.trainer.average_gradients()
            if not self._sharded:
                tie_grads(self)
            self._reduced = True

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        dtype = torch.get_default_dtype()
        out = torch.zeros((), dtype=dtype, device=self.stages[0].trainer.device)
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


def _from_mesh(mesh: Any, pp: Any, group: Any) -> Any:
    """``pp``, from ``mesh=`` where one is given (checked against ``pp=``)."""
    if mesh is None:
        if pp is None:
            raise PipelineError("Pipeline: pass pp= (the pipeline degree) or mesh=")
        return pp
    if not isinstance(mesh, Mesh):
        raise PipelineError(f"mesh: expected torchshard.init_mesh(pp=...), got {mesh!r}")
    if group is not None:
        raise PipelineError("Pipeline: pass mesh= or process_group=, not both")
    if pp is not None and pp != mesh.pp_size:
        raise PipelineError(f"pp={pp}, but the mesh has pp={mesh.pp_size}")
    if mesh.shape[0] != 1 or mesh.shape[2] != 1:
        raise PipelineError(
            f"mesh: dp_replicate={mesh.shape[0]}, tp={mesh.shape[2]}: hybrid sharding and "
            "tensor parallelism inside pipeline stages are not supported yet; use "
            "init_mesh(pp=P) alone"
        )
    return mesh.pp_size


def _plan(model: nn.Module, stages: Any, pp: int, single: bool, per_rank: int | None) -> StagePlan:
    if per_rank is not None and (
        isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 1
    ):
        raise PipelineError(f"stages_per_rank: expected a positive int, got {per_rank!r}")
    if isinstance(stages, StagePlan):
        if stages.pp != pp:
            raise PipelineError(f"stages: a plan for pp={stages.pp}, got pp={pp}")
        plan = stages
    else:
        if stages == "auto":
            stages = pp * (per_rank or (1 if single else 2))
        plan = plan_stages(model, stages, pp=pp)
    v = plan.num_stages // pp
    if single and v != 1:
        raise PipelineError(
            f"stages: {plan.num_stages} stages on pp={pp} ranks is {v} per rank; GPipe and "
            "1F1B run one stage per rank (use Interleaved1F1B or LoopedBFS)"
        )
    if per_rank is not None and per_rank != v:
        raise PipelineError(f"stages_per_rank={per_rank}, but the stages give {v} per rank")
    return plan


def _check_args(pp: Any, m: Any, world: int, schedule: Any, shard: Any, loss_fn: Any) -> bool:
    """Raise on bad arguments; whether the schedule runs a single stage per rank."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise PipelineError(f"pp: expected a positive int, got {pp!r}")
    if world % pp:
        raise PipelineError(f"pp: expected a divisor of the world size {world}, got {pp}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise PipelineError(f"microbatches: expected a positive int, got {m!r}")
    if schedule in ZERO_BUBBLE:
        raise PipelineError(
            f"schedule: {schedule} is not supported yet: its weight-only backward "
            "(stage_backward_weight) writes .grad directly, past the gradient hooks that "
            "put gradients into the flat buffer and launch the data-parallel reduction "
            f"(pytorch#144530); use one of {list(SUPPORTED)}"
        )
    if schedule not in SUPPORTED:
        raise PipelineError(f"schedule: expected one of {list(SUPPORTED)}, got {schedule!r}")
    if shard not in (False, True):
        raise PipelineError(
            f"shard: expected False or True, got {shard!r}; a fully sharded stage "
            '(shard="full") is not supported in a pipeline yet'
        )
    if not callable(loss_fn):
        raise PipelineError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    return issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
