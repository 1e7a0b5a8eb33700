"""Pipeline stages, built: pruned meta copies of the whole model that keep every name
(``blocks.3`` stays ``blocks.3``), and their initialization as the whole model's."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from .._flat.hf import clear_init_flags, init_transformers_model, is_transformers_model
from .plan import StagePlan

__all__ = ["SparseModuleList", "split_stages", "whole_order_init"]


class SparseModuleList(nn.ModuleList):
    """A ``ModuleList`` that keeps some children under their original indices: iteration
    visits the kept ones in order, ``[i]`` looks up original index ``i``."""

    def __init__(self, kept: dict[str, nn.Module]) -> None:
        super().__init__()
        for key, module in kept.items():
            self.add_module(key, module)

    def __getitem__(self, idx: int | slice) -> nn.Module:  # type: ignore[override]
        if isinstance(idx, slice):
            raise TypeError("a SparseModuleList (a pipeline stage's) cannot be sliced")
        return self._modules[str(idx)]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)


def split_stages(
    model: nn.Module, plan: StagePlan, indices: Sequence[int], everywhere: Sequence[str] = ()
) -> list[nn.Module]:
    """Pruned deep copies of ``model`` (meta), one per stage index in ``indices``.

    Modules keep their names: a kept ``ModuleList`` child keeps its index (a
    :class:`SparseModuleList`, empty when the stage keeps none of its children), a pruned
    plain child becomes ``None``, a pruned root parameter too. Parameters shared inside the
    copy stay shared. ``everywhere``: modules every stage keeps besides its own (those
    without parameters a stage forward needs, e.g. a rotary embedding).

    Example::

        (stage1,) = torchshard.split_stages(model, plan, [1])
        stage1.wte is None and "blocks.1.attn.qkv.weight" in dict(stage1.named_parameters())
    """
    out = []
    for k in indices:
        stage = copy.deepcopy(model)
        _prune(stage, "", (*plan.modules[k], *everywhere))
        out.append(stage)
    return out


def _prune(module: nn.Module, prefix: str, keep: Sequence[str]) -> None:
    for name in list(module._parameters):
        if f"{prefix}{name}" not in keep:
            module._parameters[name] = None
    for name, child in list(module.named_children()):
        fqn = f"{prefix}{name}"
        if fqn in keep:
            continue
        if not any(k.startswith(fqn + ".") for k in keep):  # nothing under it is kept
            empty = isinstance(child, nn.ModuleList)  # a list stays, empty: loops run 0 times
            setattr(module, name, SparseModuleList({}) if empty else None)
            continue
        if isinstance(child, nn.ModuleList) and not isinstance(child, SparseModuleList):
            kept = {}
            for key, sub in child.named_children():
                sfqn = f"{fqn}.{key}"
                if sfqn in keep or any(k.startswith(sfqn + ".") for k in keep):
                    _prune(sub, sfqn + ".", keep) if sfqn not in keep else None
                    kept[key] = sub
            setattr(module, name, SparseModuleList(kept))
        else:
            _prune(child, fqn + ".", keep)


@torch.no_grad()
def whole_order_init(
    whole: nn.Module, stage: nn.Module, fn: Callable[[nn.Module], None] | None
) -> None:
    """Initialize ``stage``'s (bound) weights as a one-process init of ``whole`` would.

    Walks ``whole`` (on meta) in the one-process order: ``fn`` like ``nn.Module.apply``
    (children first), or without ``fn`` each module's ``reset_parameters()`` (parents
    first, as :meth:`FlatParamModule.init_weights` does; a transformers model its own way). Around each call the module's and
    its direct children's parameters and buffers are real: the stage's own tensors where
    the stage holds that name, scratch tensors elsewhere. So every rank draws the whole
    model's random numbers in the same order from the same seed and keeps what its stage
    holds: the same bits as one process, with one module's scratch alive at a time."""
    mine = dict(stage.named_parameters(remove_duplicate=False))
    mine_b = dict(stage.named_buffers(remove_duplicate=False))
    held_as: dict[int, torch.Tensor] = {}  # a whole tensor -> the stage's, under any name
    for table, stage_t in (
        (whole.named_parameters(remove_duplicate=False), mine),
        (whole.named_buffers(remove_duplicate=False), mine_b),
    ):
        for n, t in table:
            if n in stage_t:
                held_as[id(t)] = stage_t[n]

    def call(m: nn.Module, f: Callable[[nn.Module], None]) -> None:
        swaps: list[tuple[dict, str, torch.Tensor]] = []
        real: dict[int, torch.Tensor] = {}
        for c in (m, *m.children()):
            for table in (c._parameters, c._buffers):
                for leaf, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in real:
                        got = held_as.get(id(t))
                        real[id(t)] = got if got is not None else _scratch(t)
                    swaps.append((table, leaf, t))
                    table[leaf] = real[id(t)]
        try:
            f(m)
        finally:
            for table, leaf, t in swaps:
                table[leaf] = t

    if fn is not None:
        for m in _post_order(whole):
            call(m, fn)
    else:
        clear_init_flags(whole)  # transformers marks what it initialized, even on meta
        try:
            _own_way(whole, call, set())
        finally:
            clear_init_flags(whole)


def _own_way(m: nn.Module, call: Callable[..., None], seen: set[int]) -> None:
    """``FlatParamModule.init_weights``' default walk (pre-order, each module once): a
    transformers model initializes its subtree its own way (its ``_init_weights`` per
    module, each call through ``call``), any other module with ``reset_parameters()``
    resets itself."""
    if id(m) in seen:
        return
    seen.add(id(m))
    if is_transformers_model(m):
        init_transformers_model(m, whole=call)
        return
    if callable(getattr(m, "reset_parameters", None)):
        call(m, lambda x: x.reset_parameters())
    for c in m.children():
        _own_way(c, call, seen)


def _scratch(t: torch.Tensor) -> torch.Tensor:
    s = torch.empty(t.shape, dtype=t.dtype)
    return nn.Parameter(s, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else s


def _post_order(m: nn.Module) -> Iterator[nn.Module]:
    """``nn.Module.apply``'s order: children first, then the module."""
    for c in m.children():
        yield from _post_order(c)
    yield m
