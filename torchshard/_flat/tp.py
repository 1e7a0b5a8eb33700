"""Tensor parallelism on the flat layout: each rank lays out its local shards.

:class:`TensorParallel` resolves a plan (:mod:`.tp_plan`), replaces every split parameter
by this rank's piece of it (on meta: an empty one of the local shape), gives the split
modules their tensor-parallel forwards (:mod:`.tp_layers`), and keeps the layout of the
whole model (:attr:`TensorParallel.whole`): the one-process picture that checkpoints store.
Every data-parallel mode then runs unchanged over the mesh's data-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._errors import TPPlanError
from .layout import FlatLayout
from .tp_layers import install_forward
from .tp_plan import Split, resolve_plan

__all__ = ["TensorParallel", "make_tp"]


class TensorParallel:
    """A flat module's tensor parallelism: ``size`` ranks in ``group``, this one ``rank``;
    ``plan`` as given (``"auto"`` resolved), and per slot of the layout its :class:`Split`
    (``None``: replicated on every tp rank). The local and whole layouts have the same slots
    in the same order; only split slots' shapes differ.

    Example::

        fm = FlatParamModule(model, tp_plan={"mlp.up": "colwise", "mlp.down": "rowwise"}, mesh=mesh)
        fm.tp.splits[fm.layout.index("mlp.up.weight")]   # Split(dim=0, parts=1)
    """

    def __init__(
        self,
        module: nn.Module,
        plan: Mapping[str, str] | str,
        mesh: Any,
        *,
        dtype: torch.dtype | None,
        align_bytes: int,
        init: str = "whole",
    ) -> None:
        if init not in ("whole", "local"):
            raise TPPlanError(f"tp_init: expected 'whole' or 'local', got {init!r}")
        self.init = init
        self.group: dist.ProcessGroup = mesh.tp
        self.rank: int = mesh.tp_rank
        self.size: int = mesh.tp_size
        resolved = resolve_plan(module, plan, self.size)
        self.plan: dict[str, str] = {k: resolved.styles[k] for k in sorted(resolved.styles)}
        self.whole = FlatLayout.from_module(module, dtype=dtype, align_bytes=align_bytes)
        self.splits: tuple[Split | None, ...] = tuple(
            resolved.splits.get(s.name) for s in self.whole.slots
        )
        self._by_module = _shrink(module, resolved.splits, self.rank, self.size)
        for name, style in self.plan.items():
            install_forward(module.get_submodule(name), style, self.group, self.rank)

    def to_json(self) -> dict[str, Any]:
        """What a checkpoint records: the degree, the plan, each split slot's split."""
        splits = {s.name: p.to_json() for s, p in zip(self.whole.slots, self.splits) if p}
        return {"tp": self.size, "tp_plan": self.plan, "splits": splits}

    def split_map(self) -> dict[str, Split]:
        """Each split slot's :class:`Split`, by its first name."""
        return {s.name: p for s, p in zip(self.whole.slots, self.splits) if p is not None}

    def localize(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict`` with each whole tensor of a split parameter (under any of its
        names) replaced by this rank's piece; everything else as it is."""
        out = dict(state_dict)
        for slot, split in zip(self.whole.slots, self.splits):
            for name in slot.names if split is not None else ():
                t = out.get(name)
                if isinstance(t, torch.Tensor) and tuple(t.shape) == slot.shape:
                    out[name] = split.take(t, self.rank, self.size)
        return out

    def whole_shape(self, index: int) -> tuple[int, ...]:
        return self.whole.slots[index].shape

    def take(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of slot ``index``'s whole value ``full``."""
        split = self.splits[index]
        return full if split is None else split.take(full, self.rank, self.size)

    @torch.no_grad()
    def gather(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """Slot ``index``'s whole value from every tp rank's piece (a collective over the
        tp group for a split slot; ``local`` itself for a replicated one)."""
        split = self.splits[index]
        if split is None:
            return local
        pieces = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        full = local.new_empty(self.whole_shape(index))
        for r, piece in enumerate(pieces):
            split.put(full, piece, r, self.size)
        return full

    @torch.no_grad()
    def whole_init(self, m: nn.Module, fn: Callable[[nn.Module], Any]) -> None:
        """``fn(m)`` with the split parameters of ``m`` and of its direct children whole
        (an init may write a child's, as GPT-2's scaled projection does), then each keeps
        this rank's piece: the same random draws as a one-process init, sliced. One
        module's parameters are whole at a time, never the model's. With ``init="local"``:
        ``fn(m)`` on the pieces."""
        if self.init == "local":
            fn(m)
            return
        held = [
            (c, leaf, s)
            for c in (m, *m.children())
            for leaf, s in self._by_module.get(id(c), {}).items()
        ]
        wholes: dict[int, tuple[nn.Parameter, nn.Parameter, Split, int]] = {}
        kept = []
        for c, leaf, s in held:
            local = c._parameters[leaf]
            if id(local) not in wholes:  # a tied parameter: one whole value for its names
                shape = list(local.shape)
                shape[s.dim] *= self.size
                whole = nn.Parameter(local.new_empty(shape), requires_grad=local.requires_grad)
                wholes[id(local)] = (local, whole, s, whole._version)
            c._parameters[leaf] = wholes[id(local)][1]
            kept.append((c, leaf, local))
        try:
            fn(m)
        finally:
            for c, leaf, local in kept:
                c._parameters[leaf] = local
            for local, whole, s, version in wholes.values():
                if whole._version != version:  # fn wrote it (else its values are no values)
                    local.copy_(s.take(whole, self.rank, self.size))


def _shrink(
    module: nn.Module, splits: Mapping[str, Split], rank: int, tp: int
) -> dict[int, dict[str, Split]]:
    """Replace each split parameter (under all its names) by this rank's piece; the split
    parameters of each module by leaf name, keyed by module id."""
    done: dict[int, nn.Parameter] = {}
    by_module: dict[int, dict[str, Split]] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for leaf, p in list(m._parameters.items()):
            full = f"{mname}.{leaf}" if mname else leaf
            split = splits.get(full)
            if split is None or p is None:
                continue
            if id(p) not in done:
                if p.is_meta:
                    data = torch.empty(
                        split.local_shape(tuple(p.shape), tp), dtype=p.dtype, device="meta"
                    )
                else:
                    data = split.take(p.detach(), rank, tp).clone()
                done[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            m._parameters[leaf] = done[id(p)]
            by_module.setdefault(id(m), {})[leaf] = split
    return by_module


def make_tp(
    module: nn.Module,
    plan: Mapping[str, str] | str | None,
    mesh: Any,
    dtype: torch.dtype | None,
    align_bytes: int,
    init: str,
) -> TensorParallel | None:
    """``FlatParamModule``'s tensor parallelism: ``None`` without a plan, or at ``tp=1``
    (where the plan is still checked: a bad plan is bad at any degree)."""
    _check_args(plan, mesh)
    if plan is None:
        return None
    if mesh.tp_size == 1:
        resolve_plan(module, plan, 1)
        return None
    return TensorParallel(module, plan, mesh, dtype=dtype, align_bytes=align_bytes, init=init)


def _check_args(plan: object, mesh: object) -> None:
    """``tp_plan`` and ``mesh`` go together (a mesh with ``tp > 1`` needs a plan)."""
    if plan is not None and mesh is None:
        raise TPPlanError(
            "tp_plan: needs mesh= too (torchshard.init_mesh(tp=T)): the ranks to split over"
        )
    if mesh is not None and not all(hasattr(mesh, a) for a in ("tp", "tp_rank", "tp_size")):
        raise TPPlanError(
            f"mesh: expected a torchshard Mesh from init_mesh(), got {type(mesh).__name__}"
        )
    if plan is None and mesh is not None and mesh.tp_size > 1:
        raise TPPlanError(
            f"mesh: tp={mesh.tp_size} but no tp_plan: pass tp_plan={{glob: style}} or "
            "tp_plan='auto' to say which layers to split"
        )
