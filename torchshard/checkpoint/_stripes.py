"""A fully sharded trainer's stripes, as a checkpoint saves and loads them.

With ``shard="full"`` rank ``r`` holds stripe ``r`` of every unit of the flat
buffer, in the shard the optimizer updates; nobody holds a whole model. The
files keep their format (rank ``q`` of a save writes its run of whole
parameters and its ``state_ranges`` range of optimizer state), so a save moves
the stripes to those ranges: per unit and per tensor (the weights, each flat
state key) one ``all_to_all_single``, in which every element crosses the
network once: about ``itemsize x numel / world`` bytes per rank and tensor, never
a gathered unit; transient, one stripe (and on a GPU the unit's part of the
range, on its way to host memory). A load needs no exchange: each rank reads
exactly its stripes from the files.

The mode is read duck-typed from the trainer (``trainer._mode``: its ``units``,
``geometries``, ``stripe_offsets``, ``stripe_weights``, ``regather``): the
checkpoint layer imports neither the trainer nor its modes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._errors import CheckpointError
from ._plan import exchange_splits, overlap

__all__ = ["Stripes"]

_NEEDS = ("units", "geometries", "stripe_offsets", "stripe_weights", "regather")


class Stripes:
    """This rank's stripes of a fully sharded trainer: where they lie in the flat buffer and
    in its shard, the exchange a save runs, and what a load writes into."""

    def __init__(self, mode: Any, group: dist.ProcessGroup | None, rank: int, world: int) -> None:
        self.mode, self.group, self.rank, self.world = mode, group, rank, world
        self.units = [(u.start, u.end) for u in mode.units]
        self.starts = [u.start for u in mode.units]
        # every rank's stripe of each unit, clipped to the unit (the mode's stripes())
        self.every = [g.clipped(u.numel) for u, g in zip(mode.units, mode.geometries)]
        # where flat element x of unit u's stripe sits in the shard: x + shift[u]
        self.shift = [at - g.range(rank)[0] for at, g in zip(mode.stripe_offsets, mode.geometries)]

    @classmethod
    def of(cls, trainer: Any) -> Stripes | None:
        """The stripes of ``trainer`` when it is fully sharded (``trainer.shard == "full"``)."""
        if trainer is None or getattr(trainer, "shard", None) != "full":
            return None
        mode = getattr(trainer, "_mode", None)
        missing = [a for a in _NEEDS if not hasattr(mode, a)]
        if missing:
            raise CheckpointError(
                f"trainer: shard='full', but its mode has no {missing[0]!r}: this torchshard's "
                "checkpoint layer and trainer do not match; reinstall torchshard"
            )
        return cls(mode, trainer.process_group, trainer.rank, trainer.world_size)

    @property
    def shard(self) -> torch.Tensor:
        """The weights the optimizer updates (in the master dtype when there is one)."""
        return self.mode.stripe_weights

    def ranges(self) -> list[tuple[int, int, int]]:
        """``(start, end, at)`` of each non-empty stripe: flat elements ``[start, end)`` are
        the shard's ``[at, at + end - start)``."""
        out = []
        for u, every in enumerate(self.every):
            a, b = every[self.rank]
            if b > a:
                out.append((a, b, a + self.shift[u]))
        return out

    def unit_of(self, a: int) -> int:
        """The unit holding flat element ``a``."""
        u = bisect.bisect_right(self.starts, a) - 1
        if not 0 <= a < self.units[-1][1]:
            raise ValueError(f"a: expected an element of [0, {self.units[-1][1]}), got {a}")
        return u

    def position(self, a: int) -> int:
        """Where flat element ``a`` (in one of this rank's stripes) sits in the shard."""
        return a + self.shift[self.unit_of(a)]

    # -- a save ------------------------------------------------------------------------------
    @torch.no_grad()
    def assemble(
        self,
        dest: list[tuple[int, int]],
        out: torch.Tensor,
        parts: list[tuple[int, int, torch.Tensor | None]] | None,
    ) -> None:
        """Fill host tensor ``out`` with flat elements ``dest[rank]`` of the weights (``parts``
        ``None``: the shard, in ``out``'s dtype) or of one optimizer state: ``parts`` are this
        rank's ``(start, end, tensor)`` of it (``None``: no state; zeros, as between them).

        A collective, unit by unit: every rank calls it with the same ``dest`` (every rank's
        range in rank order, tiling ``[0, layout.numel)``). One stripe is transient.
        """
        by_unit: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for a, b, x in parts or ():
            if x is not None:
                by_unit.setdefault(self.unit_of(a), []).append((a, b, x))
        shard = self.shard

        def send(u: int, a: int, b: int) -> torch.Tensor:
            if parts is None:
                at = a + self.shift[u]
                return shard[at : at + b - a].to(out.dtype)
            mine = torch.zeros(b - a, dtype=out.dtype, device=shard.device)
            for s, e, x in by_unit.get(u, ()):
                mine[s - a : e - a] = x.reshape(-1)
            return mine

        self._exchange(send, dest, out)

    def _exchange(
        self,
        send: Callable[[int, int, int], torch.Tensor],
        dest: list[tuple[int, int]],
        out: torch.Tensor,
    ) -> None:
        """For each unit ``u``: this rank's stripe ``[a, b)`` of it, ``send(u, a, b)`` (on the
        trainer's device), to the ranks whose ``dest`` ranges hold it; into ``out``, the part
        of ``dest[rank]`` in the unit, from the ranks whose stripes hold it."""
        d0, d1 = dest[self.rank]
        if out.numel() != d1 - d0:
            raise ValueError(f"out: expected {d1 - d0} elements, got {out.numel()}")
        for u, ((start, end), every) in enumerate(zip(self.units, self.every)):
            a, b = every[self.rank]
            mine = send(u, a, b).contiguous()
            ov = overlap((d0, d1), (start, end))
            host = out[ov[0] - d0 : ov[1] - d0] if ov is not None else out[:0]
            if self.world == 1:
                host.copy_(mine)
                continue
            ins, outs = exchange_splits(every, dest, self.rank)
            # gloo fills host memory in place; elsewhere a device buffer, then the host
            recv = host if mine.device.type == "cpu" else mine.new_empty(host.numel())
            dist.all_to_all_single(recv, mine, outs, ins, group=self.group)
            if recv is not host:
                host.copy_(recv)

    # -- a load ------------------------------------------------------------------------------
    @torch.no_grad()
    def regather(self) -> None:
        """The shard changed under the units that are materialized now (kept for the step,
        or in ``trainer.gathered()``): gather them again from the new stripes."""
        self.mode.regather()
