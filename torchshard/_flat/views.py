"""Parameters as views of the flat buffers: who owns a name, swapping views in for the
parameters, gradient hooks that keep ``.grad`` in the flat gradient, and checks on the
buffers."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from .._log import get_logger
from .layout import FlatLayout, ParamSlot

__all__ = [
    "Owners",
    "install_grad_hooks",
    "overlaps",
    "swap_in",
    "warn_if_still_held",
    "zero_gaps",
]

logger = get_logger("torchshard._flat.module")  # bind()'s warnings, under bind()'s logger


def warn_if_still_held(replaced: list[tuple[str, weakref.ref[torch.Tensor], int]]) -> None:
    """Say when old parameters outlive bind(): a second copy, and usually a silent bug."""
    held = [(name, nbytes) for name, ref, nbytes in replaced if ref() is not None]
    # One survivor is usually a loop variable (`for p in model.parameters(): ...`).
    if len(held) > 1:
        logger.warning(
            "bind(): %d of %d replaced parameters (%.1f MiB, e.g. %r) are still referenced "
            "elsewhere, so their memory is not freed; if an optimizer was created before "
            "wrapping, it updates those old tensors, not the model: create it from "
            "fm.parameters() after bind() (or after DistributedTrainer(fm))",
            len(held),
            len(replaced),
            sum(n for _, n in held) / 2**20,
            held[0][0],
        )


class Owners:
    """Resolves dotted parameter names to (submodule, attribute) of one module tree."""

    def __init__(self, root: nn.Module) -> None:
        self._root = root

    def _split(self, name: str) -> tuple[nn.Module, str]:
        prefix, _, attr = name.rpartition(".")
        return (self._root.get_submodule(prefix) if prefix else self._root), attr

    def get(self, name: str) -> torch.Tensor:
        owner, attr = self._split(name)
        return owner._parameters[attr]

    def set(self, name: str, value: nn.Parameter) -> None:
        owner, attr = self._split(name)
        owner._parameters[attr] = value


def swap_in(
    module: nn.Module,
    layout: FlatLayout,
    view_of: Callable[[int, ParamSlot], torch.Tensor],
    on_swap: Callable[[int, ParamSlot, torch.Tensor, nn.Parameter], None] | None = None,
) -> tuple[nn.Parameter, ...]:
    """Make each slot's parameter of ``module`` an ``nn.Parameter`` over ``view_of(i, slot)``.

    The new parameter keeps the old one's attributes (``__dict__``) and ``requires_grad``,
    and replaces it under every name of the slot (tied names share it).
    ``on_swap(i, slot, old, new)`` runs before the old one is dropped (to copy its values
    or gradient in, or hook the new one); the old parameter is released right after, so a
    model's memory is given back as the loop proceeds. Runs under ``no_grad``.

    Args:
        module: the module ``layout`` was computed from.
        layout: its flat layout.
        view_of: the tensor (of the slot's shape) the new parameter of slot ``i`` wraps.
        on_swap: called once per slot, with the old parameter and its replacement.

    Returns:
        The new parameters, by slot.

    Example::

        params = swap_in(fm.module, fm.layout, lambda i, s: s.view(flat))
    """
    owners = Owners(module)
    params: list[nn.Parameter] = []
    with torch.no_grad():
        for index, slot in enumerate(layout):
            old = owners.get(slot.name)
            new = nn.Parameter(view_of(index, slot), requires_grad=slot.requires_grad)
            new.__dict__.update(old.__dict__)  # user attributes set on the parameter
            if on_swap is not None:
                on_swap(index, slot, old, new)
            for name in slot.names:
                owners.set(name, new)
            params.append(new)
            del old, new  # release the old storage now, not at the end of the loop
    return tuple(params)


GradListener = list  # a one-element cell: [weakref.WeakMethod of a callable(slot) or None]


def install_grad_hooks(
    param: nn.Parameter, gview: torch.Tensor, slot: int, listener: GradListener
) -> None:
    """Keep ``param.grad`` inside the flat gradient buffer, and tell ``listener[0]``.

    While ``param.grad`` is the view, autograd accumulates into it in place.
    After ``optimizer.zero_grad()`` (``.grad = None``) autograd hands the
    parameter the incoming gradient tensor itself (the one the backward op
    produced anyway); this hook, which runs right after accumulation, copies
    it into the view and puts the view back, so the stray tensor dies at
    once. The same path repairs ``backward(create_graph=True)``, which
    replaces ``.grad`` out of place. Then it calls the listener in the cell, if
    set and alive (the trainer's reducer, held weakly: a dropped trainer frees
    the module): one Python hook per parameter, not two, since hooks run inline
    on the autograd thread and hold back the next kernel. The hook holds the
    view and the cell, not the parameter or the module.
    """

    def after_accumulate(p: torch.Tensor) -> None:
        g = p.grad
        if g is not None and g.data_ptr() != gview.data_ptr():
            with torch.no_grad():
                gview.copy_(g)
            p.grad = gview
        ref = listener[0]
        ready = ref() if ref is not None else None
        if ready is not None:
            ready(slot)

    param.register_post_accumulate_grad_hook(after_accumulate)


def zero_gaps(t: torch.Tensor, layout: FlatLayout, *, frozen: bool = True) -> None:
    """Zero the alignment padding of ``t`` (a flat buffer) and, with ``frozen``, the
    frozen parameters' regions (a gradient buffer's)."""
    end = 0
    for s in layout:
        t[end : s.offset].zero_()
        if frozen and not s.requires_grad:
            t[s.offset : s.end].zero_()
        end = s.end
    t[end : layout.numel].zero_()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
