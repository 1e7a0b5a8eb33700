"""Per-rank memory of a training run, computed from the layout alone (no process group)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._flat.geometry import Geometry
from .._flat.layout import FlatLayout

__all__ = ["OPTIMIZER_STATES", "RankMemory", "padded_numel", "plan_memory"]

# Elementwise state tensors per parameter element, and scalar tensors per parameter.
OPTIMIZER_STATES = {
    "adamw": (2, 1),  # exp_avg, exp_avg_sq; step
    "adam": (2, 1),
    "sgd": (1, 0),  # momentum_buffer (with momentum > 0)
    "sgd-nomomentum": (0, 0),
}


def padded_numel(layout: FlatLayout, world_size: int, shard: bool) -> int:
    """The flat buffers' length: in sharded mode a multiple of ``world_size`` alignment units."""
    return Geometry.of(layout, world_size, pad=shard).total


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds for training (what :meth:`DistributedTrainer.memory_bytes` reports).

    Example::

        for m in torchshard.plan_memory(fm.layout, world_size=8, shard=True):
            print(m.rank, m.total / 2**30, "GiB")
    """

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    master: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.master

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "master": self.master,
        }


def plan_memory(
    layout: FlatLayout,
    world_size: int,
    *,
    shard: bool,
    optimizer: str = "adamw",
    master_dtype: torch.dtype = torch.float32,
) -> list[RankMemory]:
    """What each rank will hold, by the trainer's own slicing rules.

    Parameters and gradients: one padded flat buffer each. Optimizer: the
    elementwise state for every trainable element the rank updates (all of
    them when replicated, its slice's when sharded), in the dtype of what it
    updates, plus a 4-byte scalar (Adam's ``step``) per parameter or piece.
    Master (sharded, when the buffer's dtype is not ``master_dtype``): the
    fp32 slice and its gradient.

    Example::

        with torch.device("meta"):
            fm = FlatParamModule(model, dtype=torch.bfloat16)
        worst = max(plan_memory(fm.layout, 64, shard=True), key=lambda r: r.total)
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"optimizer: expected one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}"
        )
    per_element, scalars = OPTIMIZER_STATES[optimizer]
    dtype = layout.torch_dtype
    geometry = Geometry.of(layout, world_size, pad=shard)
    flat_bytes = geometry.total * dtype.itemsize
    master = shard and dtype != master_dtype
    state_item = master_dtype.itemsize if master else dtype.itemsize
    trainable = [s for s in layout if s.requires_grad]
    out = []
    for rank, (a, b) in enumerate(geometry.ranges()):
        if shard:
            parts = [min(s.end, b) - max(s.offset, a) for s in trainable]
            parts = [p for p in parts if p > 0]
            slice_master = 2 * (b - a) * master_dtype.itemsize if master else 0
        else:
            parts = [s.numel for s in trainable]
            slice_master = 0
        opt = per_element * sum(parts) * state_item + scalars * 4 * len(parts)
        out.append(RankMemory(rank, flat_bytes, flat_bytes, opt, slice_master))
    return out
