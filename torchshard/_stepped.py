"""The optimizers that have stepped in this process, held weakly, and the bytes of their state.

``DistributedTrainer.memory_bytes()`` must count the state of an optimizer built outside
``make_optimizer`` (``torch.optim.AdamW(fm.parameters())``, the Quickstart's way), which
the trainer is never shown. torch runs its global post-step hooks after every step of
every ``torch.optim.Optimizer``: one such hook, registered once per process by the first
``FlatParamModule`` (before any parameter a trainer adopts exists, so before any
optimizer over one can step), remembers each optimizer at its first step. An optimizer
holds no state before its first step (unless it loaded a state dict), so none is missed.

The hook holds nothing strongly and nothing of any trainer: an optimizer is forgotten
when it is garbage collected, and a closed trainer has nothing to unregister. Per step
it costs one dict lookup (an ``id`` already seen).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ._errors import TorchShardError

__all__ = ["allow", "forbid", "held_state_bytes", "stepped", "watch"]

# id(optimizer) -> a weak reference whose callback drops the entry when the optimizer is
# collected (callbacks run before its memory, and so its id, can be reused).
_stepped: dict[int, weakref.ref[Any]] = {}
_handle: Any = None
_lock = threading.Lock()
# id(parameter) -> (a weak reference to it, why no optimizer of the user's may step it): a
# sharded trainer's fm.parameters(), which only make_optimizer's optimizer updates (through
# pieces of its own). Checked at an optimizer's first step only.
_forbidden: dict[int, tuple[weakref.ref[Any], str]] = {}


def forbid(params: Iterable[torch.Tensor], why: str) -> None:
    """Make the first step of any optimizer holding one of ``params`` raise ``why``."""
    for p in params:
        _forbidden[id(p)] = (weakref.ref(p), why)


def allow(params: Iterable[torch.Tensor]) -> None:
    """Undo :func:`forbid` (the trainer closed)."""
    for p in params:
        entry = _forbidden.get(id(p))
        if entry is not None and entry[0]() is p:
            del _forbidden[id(p)]


def watch() -> None:
    """Register the process-wide post-step hook; only the first call does anything."""
    global _handle
    if _handle is not None:
        return
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_post_hook(_remember)


def _remember(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    # Plain Python, not torch.compiler.disable'd: in a compiled `opt.step()` that would add a
    # graph break (torch 2.13); this adds none.
    key = id(optimizer)
    if key in _stepped:  # every step after the first: this lookup is all it costs
        return
    if _forbidden:
        for group in optimizer.param_groups:
            for p in group["params"]:
                entry = _forbidden.get(id(p))
                if entry is not None and entry[0]() is p:
                    raise TorchShardError(entry[1])

    def forget(ref: weakref.ref[Any]) -> None:
        if _stepped.get(key) is ref:
            del _stepped[key]

    _stepped[key] = weakref.ref(optimizer, forget)  # every Optimizer can be (it has no slots)


def stepped() -> list[Any]:
    """The optimizers alive now that have stepped since :func:`watch` was first called."""
    alive = (ref() for ref in list(_stepped.values()))
    return [o for o in alive if o is not None]


def held_state_bytes(own: Any, given: Any, tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of optimizer state held for ``tensors``.

    Counts all of ``own``'s state (the trainer's optimizer: every tensor it holds is the
    trainer's), and the state that ``given`` and every optimizer that has stepped keep
    for ``tensors`` (matched by identity), each tensor once. ``given`` must hold at
    least one of ``tensors``: one over none of them was built over other parameters.
    """
    ids = {id(t) for t in tensors}
    others = {id(o): o for o in stepped() if o is not own and _holds(o, ids)}
    if given is not None and given is not own:
        if not (hasattr(given, "state") and hasattr(given, "param_groups")):
            raise TorchShardError(
                "optimizer: expected a torch.optim.Optimizer (an object with .state and "
                f".param_groups), got {type(given).__name__}"
            )
        if not _holds(given, ids):
            raise TorchShardError(
                "optimizer: expected an optimizer over this trainer's parameters, got one over "
                "none of them; build it after creating the trainer, from fm.parameters() (the "
                "trainer and FlatParamModule replace the model's original parameters)"
            )
        others[id(given)] = given
    seen: set[int] = set()
    total = 0 if own is None else _state_bytes(own, None, seen)
    for o in others.values():
        total += _state_bytes(o, ids, seen)
    return total


def _holds(optimizer: Any, ids: set[int]) -> bool:
    return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


def _state_bytes(optimizer: Any, ids: set[int] | None, seen: set[int]) -> int:
    total = 0
    for p, state in list(optimizer.state.items()):
        if ids is None or id(p) in ids:
            total += _tensor_bytes(state, seen)
    return total


def _tensor_bytes(value: Any, seen: set[int]) -> int:
    """Bytes of the tensors in ``value`` (nested in dicts, lists and tuples), each once."""
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return 0
        seen.add(id(value))
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in value)
    return 0
