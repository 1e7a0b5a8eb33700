"""One optimizer over the stages a pipeline rank runs: each stage's own (built by its
trainer, over what that rank updates), behind one :class:`torch.optim.Optimizer` whose
``param_groups`` are theirs joined, so LR schedules and loops over groups work unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PipelineOptimizer"]


class PipelineOptimizer(torch.optim.Optimizer):
    """The optimizers of a rank's stages as one. ``param_groups`` lists every stage's group
    dicts (the same dicts: setting ``lr`` on one sets it for its stage);
    ``step()`` is the pipeline's step (reductions, ties, then each stage's update).

    Example::

        opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 100))
        pipe.step(); sched.step()
    """

    def __init__(self, parts: list[torch.optim.Optimizer], step: Callable[[], None]) -> None:
        # no Optimizer.__init__: the parts own the parameters; these attributes are the
        # ones torch's schedulers and hooks read
        self.parts = parts
        self._step_fn = step
        self.defaults = dict(parts[0].defaults)
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._opt_called = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every stage's groups, read anew each time (a checkpoint load replaces them)."""
        return [g for p in self.parts for g in p.param_groups]

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {k: v for p in self.parts for k, v in p.state.items()}

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """The pipeline's :meth:`Pipeline.step` (``closure`` is not supported)."""
        if closure is not None:
            raise TypeError("PipelineOptimizer.step: closures are not supported")
        self._step_fn()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parts:
            p.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "PipelineOptimizer.state_dict: save with torchshard.checkpoint.save(root, pipe, "
            "optimizer=opt); its files are the one-process picture"
        )

    def __repr__(self) -> str:
        return f"PipelineOptimizer({len(self.parts)} stages: {type(self.parts[0]).__name__})"
