"""A rank's local shards, as a checkpoint saves and loads them: arithmetic on
:class:`~torchshard._parallel.shards.LocalShards` plus one exchange.

A trainer that shards what its optimizer updates publishes it as data
(``trainer.local_shards()``): the tensor, this rank's runs of the flat buffer in
it, the regions cut over the ranks and every rank's cut of each. The files keep
one format whatever the cut (rank ``q`` of a save writes its run of whole
parameters and its ``state_ranges`` range of optimizer state). Where this rank's
runs hold the range it writes, it writes in place; otherwise :meth:`Stripes.assemble`
moves the runs to those ranges: per region and per tensor (the weights, each flat
state key) one ``all_to_all_single``, in which every element crosses the network
once: about ``itemsize x numel / world`` bytes per rank and tensor, never a
gathered region; transient, one run (and on a GPU the region's part of the range,
on its way to host memory). A load needs no exchange into the shards: each rank
reads exactly its runs from the files.

With hybrid sharding the runs are cut over a shard group, and every replica holds the same
runs: the group's ranks are data-parallel ranks ``first .. first + world - 1``, whose
ranges of the files tile one block of the buffer. The exchange then runs inside the shard
group, for that block only (the regions outside it are skipped by the whole group alike):
each rank sends its runs' part in the block, and the replicas split the files between them.

Nothing here knows the mode that cut the regions.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._parallel.state import LocalShards
from ._plan import exchange_splits, overlap
from ._streams import Space

__all__ = ["Stripes"]


class Stripes:
    """This rank's runs of the flat buffer in the tensor its optimizer updates, where each
    flat element lies in that tensor, and the exchange a save runs to the files' ranges.

    Example::

        stripes = Stripes(trainer.local_shards(), group, rank, world)
        stripes.covers(state_ranges(layout, world)[rank])  # write in place, or exchange
    """

    def __init__(
        self,
        shards: LocalShards,
        group: dist.ProcessGroup | None,
        rank: int,
        world: int,
        dtypes: list[torch.dtype] | None = None,
        first: int = 0,
    ) -> None:
        self.shards, self.group, self.rank, self.world = shards, group, rank, world
        self.first = first
        """The data-parallel rank of the group's rank 0 (hybrid sharding: ``replica x
        world``): a save's ranges are every data-parallel rank's, the group's from here."""
        self.dtypes = dtypes
        """Each region's dtype where the buffer is bytes of several (its positions are bytes,
        the tensor's elements that dtype's); ``None``: positions are the tensor's elements."""
        self.starts = [a for a, _ in shards.regions]
        self.end = shards.regions[-1][1] if shards.regions else 0
        # where region k's run starts in the tensor (its runs come in region order; a region
        # where this rank's cut is empty has none: nothing of it is sent from the tensor)
        runs = iter(shards.runs)
        self.at = [next(runs)[2] if b > a else 0 for a, b in (e[rank] for e in shards.every)]

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor the optimizer updates (in the master dtype when there is one)."""
        return self.shards.tensor

    @property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """``(start, end, at)`` of each non-empty run: flat elements ``[start, end)`` are the
        tensor's ``[at, at + end - start)``."""
        return self.shards.runs

    def covers(self, span: tuple[int, int], rank: int | None = None) -> bool:
        """Whether data-parallel rank ``rank``'s runs (default: this rank's) hold every flat
        element of ``span`` (an empty one: yes). Every rank's cuts are data: no exchange (a
        replica's rank holds what the same rank of this group does).

        Example::

            shards = LocalShards(t, ((0, 8, 0),), ((0, 16),), (((0, 8), (8, 16)),))
            Stripes(shards, None, 0, 2).covers((0, 8))  # True: rank 0 holds [0, 8)
        """
        q = self.rank if rank is None else rank % self.world
        pos, end = span
        for a, b in sorted(every[q] for every in self.shards.every):
            if a <= pos < b:
                pos = b
        return pos >= end

    def region_of(self, a: int) -> int:
        """The region holding flat element ``a``."""
        if not self.starts or not self.starts[0] <= a < self.end:
            raise ValueError(f"a: expected an element of the regions' [0, {self.end}), got {a}")
        return bisect.bisect_right(self.starts, a) - 1

    def position(self, a: int) -> int:
        """Where flat element ``a`` (in one of this rank's runs) lies in the tensor."""
        k = self.region_of(a)
        return (a - self.shards.every[k][self.rank][0]) // self._width(k) + self.at[k]

    def _width(self, k: int) -> int:
        return self.dtypes[k].itemsize if self.dtypes is not None else 1

    def in_space(self, space: Space) -> Stripes:
        """The same cuts in a stream's space (:class:`~._streams.Space`): only the regions
        of its dtype, in its elements; for an exchange of that stream's state."""
        assert self.dtypes is not None
        regions, every = [], []
        for k, (region, cuts) in enumerate(zip(self.shards.regions, self.shards.every)):
            if self.dtypes[k] == space.param:
                regions.append(tuple(space.element(x) for x in region))
                every.append([tuple(space.element(x) for x in c) for c in cuts])
        mapped = LocalShards.of(self.tensor, regions, every, self.rank, [0] * len(regions))
        return Stripes(mapped, self.group, self.rank, self.world, None, self.first)

    # -- a load ------------------------------------------------------------------------------
    @torch.no_grad()
    def copy_from(self, flat: torch.Tensor) -> None:
        """Copy this rank's runs of the loaded flat buffer ``flat`` into the tensor, where
        that is a tensor of its own (a master copy in another dtype), not a view of ``flat``."""
        tensor = self.tensor
        if tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            return  # loaded already
        for a, b, at in self.runs:
            tensor[at : at + b - a].copy_(flat[a:b])

    @torch.no_grad()
    def copy_from_bytes(self, host: torch.Tensor, packed: list[tuple[int, int, int]]) -> None:
        """A buffer of several dtypes: copy this rank's runs, read as bytes one after another
        into ``host`` (``packed``: each run's ``(a, b, at)``, ``at`` in bytes), into the
        tensor's elements, each in its region's dtype."""
        assert self.dtypes is not None
        for (a, b, at), (_, _, byte) in zip(self.runs, packed):
            dtype = self.dtypes[self.region_of(a)]
            n = (b - a) // dtype.itemsize
            self.tensor[at : at + n].copy_(host[byte : byte + b - a].view(dtype))

    # -- a save ------------------------------------------------------------------------------
    @torch.no_grad()
    def assemble(
        self,
        dest: list[tuple[int, int]],
        out: torch.Tensor,
        parts: list[tuple[int, int, torch.Tensor | None]] | None,
    ) -> None:
        """Fill host tensor ``out`` with flat elements ``dest[rank]`` of the weights (``parts``
        ``None``: the tensor, in ``out``'s dtype) or of one optimizer state: ``parts`` are this
        rank's ``(start, end, tensor)`` of it (``None``: no state; zeros, as between them).

        A collective, region by region: every rank of the group calls it with the same
        ``dest`` (every data-parallel rank's range in rank order, tiling ``[0,
        layout.numel)``; ``rank`` is this one's). One run's part is transient.
        """
        by_region: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for a, b, x in parts or ():
            if x is not None:
                by_region.setdefault(self.region_of(a), []).append((a, b, x))
        tensor = self.tensor

        def send(k: int, a: int, b: int) -> torch.Tensor:
            at = self.at[k] + (a - self.shards.every[k][self.rank][0]) // self._width(k)
            if parts is None and self.dtypes is not None:  # bytes, from elements of dtype k
                n = (b - a) // self._width(k)
                return tensor[at : at + n].to(self.dtypes[k]).view(torch.uint8)
            if parts is None:
                return tensor[at : at + b - a].to(out.dtype)
            mine = torch.zeros(b - a, dtype=out.dtype, device=tensor.device)
            for s, e, x in by_region.get(k, ()):
                ov = overlap((s, e), (a, b))
                if ov is not None:
                    mine[ov[0] - a : ov[1] - a] = x.reshape(-1)[ov[0] - s : ov[1] - s]
            return mine

        self._exchange(send, dest, out)

    def _exchange(
        self,
        send: Callable[[int, int, int], torch.Tensor],
        dest: list[tuple[int, int]],
        out: torch.Tensor,
    ) -> None:
        """For each region ``k`` that meets the group's block (its ranks' ``dest``): the part
        ``[a, b)`` of this rank's cut of it in the block, ``send(k, a, b)`` (on the trainer's
        device), to the ranks whose ``dest`` ranges hold it; into ``out``, the part of this
        rank's range in the region, from the ranks whose cuts hold it."""
        dest = dest[self.first : self.first + self.world]  # the group's ranges: its block
        block = (dest[0][0], dest[-1][1])
        d0, d1 = dest[self.rank]
        if out.numel() != d1 - d0:
            raise ValueError(f"out: expected {d1 - d0} elements, got {out.numel()}")
        for k, (region, every) in enumerate(zip(self.shards.regions, self.shards.every)):
            if region[1] <= block[0] or region[0] >= block[1]:
                continue  # another replica's files: the whole group skips it
            a, b = every[self.rank]
            mine = send(k, *(overlap((a, b), block) or (a, a))).contiguous()
            ov = overlap((d0, d1), region)
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
