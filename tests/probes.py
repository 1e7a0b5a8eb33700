"""Probes the tests share: a log of every ``torch.distributed`` collective a process calls,
and a counter of the ops that read a tensor's value on the host.

Both run inside the worker processes of ``run_distributed`` (or in the test process itself).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import Counter
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# -- the collective log -------------------------------------------------------------------------
# Everything torch.distributed offers that communicates; whatever this torch lacks is skipped.
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
)
# Pickle over the wire, and on the CPU under NCCL: torchshard promises none.
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
ROOTS = ("src", "dst", "group_src", "group_dst")  # must name the same rank everywhere


class Call(NamedTuple):
    phase: str
    op: str
    tensors: tuple[tuple[str, Any], ...]  # (argument, (numel, dtype, contiguous, device) or a list)
    args: tuple[tuple[str, str], ...]  # the reduce op and roots
    group: tuple[int, ...] | str
    thread: str
    # all_to_all_single: (input_split_sizes, output_split_sizes), which differ by rank
    splits: tuple[tuple[int, ...] | None, tuple[int, ...] | None] | None = None


def describe(t: torch.Tensor) -> tuple[int, str, bool, str]:
    return (t.numel(), str(t.dtype), t.is_contiguous(), str(t.device))


class CollectiveLog:
    """Records each call of a torch.distributed collective (while installed), then calls it."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.phase = "setup"
        self._real: dict[str, Any] = {}

    def install(self) -> None:
        for name in COLLECTIVES + OBJECT_COLLECTIVES:
            real = getattr(dist, name, None)
            if real is not None:
                self._real[name] = real
                setattr(dist, name, self._wrap(name, real))

    def uninstall(self) -> None:
        for name, real in self._real.items():
            setattr(dist, name, real)
        self._real.clear()

    def _wrap(self, name: str, real: Any) -> Any:
        sig = inspect.signature(real)

        @functools.wraps(real)
        def logged(*args: Any, **kwargs: Any) -> Any:
            self._record(name, sig, args, kwargs)
            return real(*args, **kwargs)

        return logged

    def _record(self, name: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
        try:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            named = dict(bound.arguments)
        except TypeError:  # let the real call raise its own error
            named = {f"arg{i}": a for i, a in enumerate(args)} | kwargs
        tensors: list[tuple[str, Any]] = []
        for arg, v in named.items():
            if isinstance(v, torch.Tensor):
                tensors.append((arg, describe(v)))
            elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
                tensors.append((arg, tuple(describe(t) for t in v)))
        extra = [("op", str(named["op"]))] if named.get("op") is not None else []
        extra += [(k, str(named[k])) for k in ROOTS if named.get(k) is not None]
        group = named.get("group")
        ranks = "default" if group is None else tuple(dist.get_process_group_ranks(group))
        thread = threading.current_thread().name
        splits = None
        if name == "all_to_all_single":
            splits = tuple(
                None if named.get(k) is None else tuple(named[k])
                for k in ("input_split_sizes", "output_split_sizes")
            )
        call = Call(self.phase, name, tuple(tensors), tuple(extra), ranks, thread, splits)
        self.calls.append(call)

    def __enter__(self) -> CollectiveLog:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


# -- host reads ---------------------------------------------------------------------------------
# The ops that read a tensor's value on the host: on CUDA each is a synchronization.
# ``_local_scalar_dense``: ``.item()``, ``bool()``, ``int()``, ``float()``; ``lift_fresh``:
# ``torch.tensor`` of Python data; the rest need the data to size their output or answer.
HOST_READS = frozenset(
    {
        "_local_scalar_dense",
        "is_nonzero",
        "lift_fresh",
        "equal",
        "nonzero",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
    }
)


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (a sync on CUDA), by name.

    ``Tensor.tolist`` does not dispatch: it is counted by patching it while the mode is on.
    Not seen on CPU: a copy to the host (``.cpu()``, ``.numpy()``), which on CUDA syncs too."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()
        self._tolist = torch.Tensor.tolist

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        counter, original = self.seen, self._tolist

        def tolist(t: torch.Tensor):
            counter["tolist"] += 1
            return original(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        return super().__exit__(*exc)
