"""A pipeline stage whose module is a flat buffer under a :class:`DistributedTrainer`: every
backward but the last accumulates locally (``no_sync``), the last launches the
data-parallel reduction as autograd runs, and nothing is divided after the fact (the loss
was scaled by ``1/microbatches``)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.pipelining import PipelineStage

from .._parallel.trainer import DistributedTrainer

__all__ = ["FlatStage", "StageModule"]


class StageModule(nn.Module):
    """What a stage runs: the flat module, with ``None`` left out of a tuple it returns
    (torch's stages carry tensors only; GPT's last stage returns ``(logits, None)``) and a
    tuple of one unwrapped."""

    def __init__(self, fm: nn.Module) -> None:
        super().__init__()
        self.fm = fm

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fm(*args, **kwargs)
        if isinstance(out, tuple):
            out = tuple(o for o in out if o is not None)
            return out[0] if len(out) == 1 else out
        return out


class FlatStage(PipelineStage):
    """torch's :class:`PipelineStage` at the seam torch keeps for DDP and FSDP."""

    trainer: DistributedTrainer
    hold: bool = False
    """Every backward in ``no_sync``: the pipeline launches the reduction itself (after
    summing a tied weight's gradient across stages)."""

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        if backward_type in ("input", "weight"):  # zero-bubble passes bypass the grad hooks
            raise NotImplementedError(f"torchshard: backward type {backward_type!r}")
        if last_backward and not self.hold:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, True)
        with self.trainer.no_sync():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, False)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """No division: the schedule was built with ``scale_grads=False`` and the loss scaled;
        the reduction the last backward launched is finished by the pipeline's
        ``clip_grad_norm_`` or ``step``."""
