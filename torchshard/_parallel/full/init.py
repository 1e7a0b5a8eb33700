"""Adopting a module into the units: its parameters become views of the unit buffers, and
this rank's stripes are filled from its weights (bound, real, or initialized from meta one
unit at a time) as rank ``src`` holds them. FSDP2: ``_fsdp_init.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..._flat.hf import clear_init_flags
from ..._flat.layout import FlatLayout, ParamSlot
from ..._flat.module import FlatParamModule, _init_own_way
from ..._flat.views import Owners, swap_in
from .storage import FREE, READY, UnitBuffers, slot_units

__all__ = ["Materialize", "UnitFiller", "adopt_units"]


def adopt_units(
    fm: FlatParamModule,
    storage: UnitBuffers,
    src: int,
    init_fn: Callable[[nn.Module], None] | None,
) -> tuple[nn.Parameter, ...]:
    """Make ``fm``'s parameters views of ``storage``'s unit buffers (freed after), and fill
    this rank's stripes with ``fm``'s weights as ``src`` holds them; the parameters by slot.

    Example::

        params = adopt_units(fm, storage, src=0, init_fn=None)
    """
    layout, units = fm.layout, storage.units
    unit_of = slot_units(units, len(layout))
    owners = Owners(fm.module)
    flat = fm.flat_param
    originals: list[torch.Tensor | None] = [None] * len(layout)
    if flat is None:
        for i, s in enumerate(layout):
            p = owners.get(s.name)
            originals[i] = None if p.is_meta else p.detach()

    def view_of(i: int, s: ParamSlot) -> torch.Tensor:
        u = units[unit_of[i]]
        return s.view(storage.buffers[u.index], base=u.start)

    params = swap_in(fm.module, layout, view_of)
    storage.free_all_storage()
    fm._detach_buffers()  # the flat buffers, if any, are no longer the parameters'
    fm._materialize_buffers(storage.device)
    UnitFiller(storage, src).fill(fm, layout, flat, originals, init_fn)
    del flat, originals
    storage.trim_heap()
    return params


class UnitFiller:
    """Fills the stripes one unit at a time: the unit's weights written, ``src``'s broadcast,
    this rank's stripe kept, the unit freed (:meth:`settle`); never more than a few units
    whole at once."""

    def __init__(self, storage: UnitBuffers, src: int) -> None:
        self.storage, self.src = storage, src
        self.settled: set[int] = set()

    @torch.no_grad()
    def fill(
        self,
        fm: FlatParamModule,
        layout: FlatLayout,
        flat: torch.Tensor | None,
        originals: list[torch.Tensor | None],
        init_fn: Callable[[nn.Module], None] | None,
    ) -> None:
        """Each unit from ``flat`` (a bound module), ``originals`` (real weights), or the
        initializer (a meta-built model)."""
        storage = self.storage
        if flat is not None or all(o is not None for o in originals):
            for u in storage.units:
                storage.alloc(u.index)
                buf = storage.buffers[u.index]
                if flat is not None:
                    buf[: u.numel].copy_(flat[u.start : u.end])
                else:
                    for i in range(u.lo, u.hi):
                        s = layout.slots[i]
                        o = originals[i]
                        assert o is not None
                        s.view(buf, base=u.start).copy_(o)
                        originals[i] = None  # release the old parameter as we go
                self.settle(u.index)
            return
        # A meta-built model: run the initializer as the other modes do (same order, same
        # random numbers), materializing each unit when an op first touches it and settling
        # units the initializer has moved past (a unit touched again is gathered back).
        with Materialize(self):
            clear_init_flags(fm.module)
            tp = fm.tp  # tensor parallel: each module's init on its whole parameters, sliced
            if init_fn is not None:
                fm.module.apply(init_fn if tp is None else lambda m: tp.whole_init(m, init_fn))
            else:
                _init_own_way(fm.module, whole=tp.whole_init if tp is not None else None)
        for u in storage.units:
            if storage.state[u.index] == READY:
                self.settle(u.index)
            elif u.index not in self.settled:
                storage.alloc(u.index)  # nothing initialized it: zeros, as the gaps
                self.settle(u.index)

    def settle(self, u: int) -> None:
        """``src``'s unit ``u`` everywhere; keep this rank's stripe; free the unit."""
        storage = self.storage
        buf = storage.buffers[u]
        storage.comm.broadcast(buf, self.src)
        storage.copy_stripe(u, into_buffer=False)
        self.settled.add(u)
        storage.free(u)


class Materialize(TorchDispatchMode):
    """During a meta-built model's initialization: give a unit storage when an op first
    touches it (zeros; or gathered back from the stripes once settled), and settle the least
    recently touched when more than two are materialized."""

    def __init__(self, filler: UnitFiller) -> None:
        super().__init__()
        self.filler = filler
        buffers = filler.storage.buffers
        self.by_storage = {b.untyped_storage()._cdata: i for i, b in enumerate(buffers)}
        self.recent: list[int] = []
        filler.settled.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        units = []
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.layout == torch.strided:
                u = self.by_storage.get(t.untyped_storage()._cdata)
                if u is not None and u not in units:
                    units.append(u)
        for u in units:
            self._touch(u)
        # settle the least recent beyond two, never one this op reads or writes
        for v in [v for v in self.recent[:-2] if v not in units]:
            self.recent.remove(v)
            self.filler.settle(v)
        return func(*args, **kwargs)

    def _touch(self, u: int) -> None:
        storage = self.filler.storage
        if storage.state[u] == FREE:
            if u in self.filler.settled:
                storage.gather(u, wait=True)  # settled before: its values are the stripes'
            else:
                storage.alloc(u)
        if u in self.recent:
            self.recent.remove(u)
        self.recent.append(u)
