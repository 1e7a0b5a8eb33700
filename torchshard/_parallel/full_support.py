"""What the fully sharded mode leans on, apart from its schedule: the unit states, the
identity function whose backward marks a unit's backward done, initializing a meta-built
model one unit at a time, and giving a CPU heap's free memory back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["FREE", "HEAP", "PENDING", "READY", "Materialize", "PostBackward"]

FREE, PENDING, READY = 0, 1, 2
"""A unit's buffer: no storage; a gather in flight; whole."""


class _Heap:
    """glibc's heap, for a CPU trainer: how many free bytes it keeps, and giving them back."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        self.trim: Any = None
        self.info: Any = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            trim, info = libc.malloc_trim, libc.mallinfo2
        except (OSError, AttributeError, TypeError):  # not glibc (>= 2.33)
            return
        fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd")
        fields += ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
        info.restype = type(
            "mallinfo2", (ctypes.Structure,), {"_fields_": [(n, ctypes.c_size_t) for n in fields]}
        )
        self.trim, self.info = trim, info

    def free_bytes(self) -> int:
        return int(self.info().fordblks) if self.info is not None else 0


HEAP = _Heap()


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


class Materialize(TorchDispatchMode):
    """During a meta-built model's initialization: give a unit storage when an op first
    touches it (zeros; or gathered back from the stripes once settled), and settle the least
    recently touched when more than two are materialized."""

    def __init__(self, owner: Any, src: int) -> None:
        """``owner``: the FullyShard mode whose unit buffers (``buf``, ``state``) it watches."""
        super().__init__()
        self.owner, self.src = owner, src
        self.by_storage = {b.untyped_storage()._cdata: i for i, b in enumerate(owner.buf)}
        self.recent: list[int] = []
        owner._filled.clear()

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
            self.owner._settle(v, self.src)
        return func(*args, **kwargs)

    def _touch(self, u: int) -> None:
        o = self.owner
        if o.state[u] == FREE:
            if u in o._filled:
                o.gather_unit(u, wait=True)  # settled before: its values are the stripes'
            else:
                o._alloc(u)
        if u in self.recent:
            self.recent.remove(u)
        self.recent.append(u)
