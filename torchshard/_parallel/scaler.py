"""fp16 loss scaling with sharded gradients: the ranks agree on whether any found an inf.

``torch.amp.GradScaler`` checks the gradients of the optimizer it is given. With a sharded
trainer each rank's optimizer holds its own slice (or stripes), so an overflow that lands in
one rank's part would make that rank skip the step and lower its scale while the others
step: the replicas diverge. Here the found-inf flags are all-reduced (MAX) once per step,
as torch's own sharded scalers do (FSDP's ``ShardedGradScaler``, DTensor's GradScaler).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import Mesh1D

__all__ = ["agree_on_inf", "agreed_inf"]

_AGREED = "torchshard_agreed"  # set in the scaler's per-optimizer state once the ranks agreed


def _state(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict:
    # GradScaler keeps per-optimizer state in this dict (torch's sharded scalers read it too)
    return scaler._per_optimizer_states[id(optimizer)]


def agreed_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`agree_on_inf` ran for ``optimizer`` since the scaler's last update
    (``True`` for a disabled scaler, ``GradScaler(enabled=False)``: nothing to agree on)."""
    if not scaler.is_enabled():  # it keeps no per-optimizer state
        return True
    return bool(_state(scaler, optimizer).get(_AGREED))


def agree_on_inf(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh1D,
    device: torch.device,
) -> torch.Tensor | None:
    """After ``scaler.unscale_(optimizer)`` on every rank: one MAX all-reduce of the rank's
    found-inf flag; every device's flag becomes the agreed one (a rank with no gradients of
    its own, e.g. an empty slice, gets a flag, so ``step`` and ``update`` have one to read).
    Returns the agreed flag (> 0: skip the step), ``None`` for a disabled scaler.

    Example::

        scaler.unscale_(opt)
        found = agree_on_inf(scaler, opt, trainer_mesh, device)
    """
    if not scaler.is_enabled():
        return None
    state = _state(scaler, optimizer)
    found: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for t in found.values():
        flag = torch.maximum(flag, t.to(device))
    if mesh.size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.group)
    if not found:
        found[device] = flag
    for d in list(found):
        found[d] = flag.to(d)
    state[_AGREED] = True
    return flag
