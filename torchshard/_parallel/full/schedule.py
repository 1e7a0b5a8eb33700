"""When the fully sharded mode gathers and frees its units: module hooks around each unit's
forward, autograd hooks around its backward, prefetch, and a callback when backward ends.

Every rank runs the same model, so the hooks fire in the same order everywhere and so do
the gathers they issue. FSDP2: ``_fsdp_state.py`` (``FSDPState._pre_forward`` ...
``_root_post_backward_final_callback``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .grads import UnitGradReducer
from .storage import UnitBuffers

__all__ = ["PostBackward", "UnitSchedule"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


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


class UnitSchedule:
    """The hooks that gather a unit before its forward and its backward and free it after.

    Args:
        root: the wrapped module (the units are its submodules, by name).
        storage: the units' storage, gathered and released here.
        grads: told when a unit's backward is done and when backward ends.
        prefetch: units gathered ahead of the one running.
        reshard_after_forward: free a unit after its forward (``False``: keep it until its
            backward).

    Example::

        schedule = UnitSchedule(fm.module, storage, grads, prefetch=1, reshard_after_forward=True)
        loss = fm(x).sum()   # each unit gathered before its forward, freed after
    """

    def __init__(
        self,
        root: nn.Module,
        storage: UnitBuffers,
        grads: UnitGradReducer,
        *,
        prefetch: int,
        reshard_after_forward: bool,
    ) -> None:
        self.storage, self.grads, self.units = storage, grads, storage.units
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.reset()
        grads.on_gradient = self._queue_end_of_backward
        grads.on_close.append(self.remove_hooks)
        self.handles = [root.register_forward_pre_hook(self._root_pre_forward)]
        for u in self.units:
            if u.root:
                continue
            m = root.get_submodule(u.name)
            self.handles.append(
                m.register_forward_pre_hook(self._pre_forward(u.index), with_kwargs=True)
            )
            self.handles.append(m.register_forward_hook(self._post_forward(u.index)))

    def reset(self) -> None:
        """Forget the last backward: no unit ran, none finished its backward."""
        n = len(self.units)
        self.forward_calls = [0] * n
        """Forwards of each unit with grad since the last backward ended."""
        self.backward_calls = [0] * n
        """Of those, how many have had their backward."""
        self.end_queued = False

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _ahead(self, u: int, k: int, step: int = 1) -> list[int]:
        """The next ``k`` units after ``u`` (before it, ``step=-1``) that are not kept."""
        out, v = [], u + step
        while len(out) < k and 0 <= v < len(self.units):
            if not self.units[v].kept:
                out.append(v)
            v += step
        return out

    # -- forward -------------------------------------------------------------------------------
    def _root_pre_forward(self, *_: Any) -> None:
        storage = self.storage
        if storage.pinned or _in_backward():
            return
        for u in self.units:
            if u.kept:
                storage.gather(u.index, wait=False)
        for v in self._ahead(-1, self.prefetch):
            storage.gather(v, wait=False)
        for u in self.units:
            if u.kept:
                storage.gather(u.index, wait=True)

    def _pre_forward(self, u: int) -> Callable[..., Any]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
            storage = self.storage
            if storage.pinned:
                return None
            storage.gather(u, wait=True)
            if _in_backward():  # recomputation (activation checkpointing): only the weights
                return None
            for v in self._ahead(u, self.prefetch):
                storage.gather(v, wait=False)
            if not torch.is_grad_enabled():
                return None
            self.forward_calls[u] += 1
            flat, spec = tree_flatten((args, kwargs))
            idx = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not idx:
                return None
            outs = PostBackward.apply(lambda: self._post_backward(u), *(flat[k] for k in idx))
            for k, t in zip(idx, outs):
                flat[k] = t
            return tree_unflatten(flat, spec)

        return hook

    def _post_forward(self, u: int) -> Callable[..., Any]:
        def hook(_m: nn.Module, _args: tuple, output: Any) -> None:
            if self.storage.pinned or _in_backward():
                return
            if torch.is_grad_enabled():
                ts = [
                    t
                    for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if ts:
                    torch.autograd.graph.register_multi_grad_hook(
                        ts, lambda _g: self._pre_backward(u), mode="any"
                    )
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self.storage.release(u)  # (no backward will need it after a forward without grad)

        return hook

    # -- backward ------------------------------------------------------------------------------
    def _queue_end_of_backward(self) -> None:
        if not self.end_queued:
            self.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _pre_backward(self, u: int) -> None:
        storage = self.storage
        self._queue_end_of_backward()
        storage.gather(u, wait=False)
        for v in self._ahead(u, self.prefetch, step=-1):
            storage.gather(v, wait=False)
        storage.gather(u, wait=True)

    def _post_backward(self, u: int) -> None:
        self.backward_calls[u] += 1
        if self.backward_calls[u] >= self.forward_calls[u]:
            self.storage.release(u)
            self.grads.unit_done(u)

    def _end_of_backward(self) -> None:
        self.grads.end_of_backward()
        for u in range(len(self.units)):
            self.storage.release(u)
        self.grads.reset_backward()
        self.reset()
