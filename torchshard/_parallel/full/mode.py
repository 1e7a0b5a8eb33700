"""Fully sharded mode (ZeRO-3 / FSDP): parameters, gradients and optimizer state sharded.

The layout is cut into units (:mod:`..units`): a transformer block each, plus root
units for what lies between. Rank ``r`` persistently holds stripe ``r`` of every
unit (in the master dtype: the weights the optimizer updates), its gradient, and
the optimizer's state for it: 16 bytes per parameter over the world size with
AdamW; of a frozen parameter, only its weights, in their own dtype. A unit's full buffer exists only while the unit runs: it is gathered in a
forward pre-hook (``prefetch`` units ahead), freed after its forward, gathered
again before its backward, freed after it. Its gradient is reduce-scattered into
the stripes as soon as its backward is done.

:class:`FullyShard` composes objects that each own their state, imported one way:

- :class:`~.collectives.UnitComm`: the communicators, the collectives, the order log;
- :class:`~.storage.UnitBuffers`: the stripes and the unit buffers (gather, free);
- :class:`~.grads.UnitGradReducer`: gradients to stripes; the trainer's gradient sync;
- :func:`~.init.adopt_units`: parameters as views of the units, stripes filled;
- :class:`~.schedule.UnitSchedule`: the forward and backward hooks.

Order: every rank issues the same collectives in the same order by construction; see
[Note: one order per communicator] in ``docs/fully-sharded.md``.
:meth:`FullyShard.order_digest` lets a test or a debug run compare the sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..._errors import TorchShardError
from ..._flat.module import FlatParamModule
from ..buckets import Bucket
from ..comm import Mesh1D
from ..mode import Context, Mode, Segment
from ..setup import resolve_master_dtype
from ..shards import LocalShards
from ..units import Unit, UnitSpec, resolve_units
from .collectives import UnitComm
from .grads import UnitGradReducer
from .init import adopt_units
from .schedule import UnitSchedule
from .storage import UnitBuffers

__all__ = ["FullyShard"]


class FullyShard(Mode):
    """Parameters, gradients and optimizer state of every unit sharded over the ranks.

    Args:
        master_dtype: the stripes' dtype (what the optimizer updates).
        units: which modules are units (:func:`~..units.resolve_units`).
        prefetch: units gathered ahead of the one running.
        reshard_after_forward: free each unit after its forward.
    """

    sharded = True
    whole_weights = False
    reduces_by = "unit"
    hybrid = True  # stripes over a shard group, each reduced stripe all-reduced across replicas
    native_gloo: bool = False
    """On gloo, gather and reduce with gloo's all-gather and reduce-scatter instead of a
    broadcast and a reduce per owner (:class:`~.collectives.UnitComm`'s ``native``; NCCL
    always does). A class default that benchmarks and tests flip to compare the two."""

    def __init__(
        self,
        master_dtype: torch.dtype = torch.float32,
        units: UnitSpec = "auto",
        prefetch: int = 1,
        reshard_after_forward: bool = True,
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise TorchShardError(f"prefetch: expected an int >= 0, got {prefetch!r}")
        if reshard_after_forward not in (True, False):
            raise TorchShardError(
                f"reshard_after_forward: expected True or False, got {reshard_after_forward!r}"
            )
        self.master_dtype = master_dtype
        self.spec = units
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.units: list[Unit] = []
        self.params: tuple[nn.Parameter, ...] = ()
        self.comm: UnitComm | None = None
        self.storage: UnitBuffers | None = None
        self.grads: UnitGradReducer | None = None
        self.schedule: UnitSchedule | None = None

    # -- construction ----------------------------------------------------------------------
    def prepare(self, fm: FlatParamModule) -> None:
        """Resolve the units (no tensors, no collective), before the ranks compare models."""
        self.master_dtype = resolve_master_dtype(fm.layout, self.master_dtype)
        self.units = resolve_units(fm.module, fm.layout, self.spec)

    def adopt(
        self,
        fm: FlatParamModule,
        device: torch.device,
        group: dist.ProcessGroup | None,
        src: int,
        init_fn: Callable[[nn.Module], None] | None,
        cut: Mesh1D | None = None,
    ) -> tuple[nn.Parameter, ...]:
        """Shard ``fm`` over the group (hybrid sharding: over ``cut``, a shard group): unit
        buffers (freed), parameters as their views, this rank's stripes filled from ``fm``'s
        weights (bound, real, or initialized from meta one unit at a time) as ``src`` of
        ``group`` holds them. Returns the parameters by slot."""
        if not self.units:
            self.prepare(fm)
        if cut is None:
            self.comm = UnitComm(group, device, native=self.native_gloo)
        else:  # stripes over the shard group; the starting weights from src, in every replica
            dp = Mesh1D.of(group)
            self.comm = UnitComm(cut.group, device, native=self.native_gloo, dp=dp)
        layout = fm.layout
        self.storage = UnitBuffers(self.units, layout, fm.dtype, self.master_dtype, self.comm)
        self.params = adopt_units(fm, self.storage, src, init_fn)
        return self.params

    def setup(self, ctx: Context, buckets: tuple[Bucket, ...]) -> None:
        """The gradient sync over the stripes, and the hooks that gather the units."""
        assert self.storage is not None
        self.grads = UnitGradReducer(ctx, self.storage, self.params)
        self.schedule = UnitSchedule(
            ctx.fm.module,
            self.storage,
            self.grads,
            prefetch=self.prefetch,
            reshard_after_forward=self.reshard_after_forward,
        )

    def grad_sync(self, ctx: Context, buckets: tuple[Bucket, ...]) -> UnitGradReducer:
        """How gradients become the mean: the units' reduce-scatters into the stripes (one
        object per trainer, the same on every call)."""
        assert self.grads is not None
        return self.grads

    # -- what the units hold ---------------------------------------------------------------------
    def _adopted(self) -> UnitBuffers:
        assert self.storage is not None, "the mode has not adopted a module yet"
        return self.storage

    @property
    def transient(self) -> int:
        """Bytes of unit buffers and unit gradients held now."""
        return self.storage.transient if self.storage is not None else 0

    @property  # type: ignore[override]
    def peak_transient(self) -> int:
        return self.storage.peak_transient if self.storage is not None else 0

    def gather(self, ctx: Context) -> None:
        """The stripes changed (a load, an edit of ``trainer.optimizer_segments()``): the
        units materialized now hold stale weights; gather them again (the others gather at
        their next use anyway)."""
        self._adopted().regather()

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return self._adopted().gathered()

    # -- the optimizer's side ----------------------------------------------------------------------
    def optimizer_tensors(self, ctx: Context) -> list[Segment]:
        grads, storage = self.grads, self._adopted()
        assert grads is not None
        if not grads.pieces:
            slots = ctx.fm.layout.slots
            for (a0, b0), u in zip(storage.stripe_ranges(), self.units):
                for i in range(u.lo, u.hi):
                    s = slots[i]
                    if not s.requires_grad:
                        continue
                    a, b = max(s.offset, a0), min(s.end, b0)
                    if a < b:
                        piece = nn.Parameter(storage.stripe_of(storage.stripe_weights, a, b))
                        grads.pieces.append((i, a, b, piece))
        return list(grads.pieces)

    def local_grad(self, ctx: Context) -> torch.Tensor:
        assert self.grads is not None
        return self.grads.stripe_grads

    def local_grads(self, ctx: Context) -> list[torch.Tensor]:
        return [self.local_grad(ctx)]  # in the master dtype, however many the model has

    @torch.no_grad()
    def after_step(self, ctx: Context) -> None:
        assert self.grads is not None
        storage = self._adopted()
        self.grads.after_step()
        storage.release_all()  # gathered weights are stale now: the next forward gathers again
        storage.trim_heap(
            slack=2 * max(g.total for g in storage.geometries) * storage.dtype.itemsize
        )

    def zero_grad(self) -> None:
        if self.grads is not None:
            self.grads.zero_grad()

    def after_load(self, ctx: Context) -> None:
        self._adopted().regather()

    def reset_peak(self) -> None:
        storage = self._adopted()
        storage.peak_transient = storage.transient

    # -- what the trainer reports ------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Units and schedule: ranks that differ would issue other collectives (and hang)."""
        plan = [(u.lo, u.hi, u.kept) for u in self.units], self.prefetch, self.reshard_after_forward
        return "F" + hashlib.sha256(repr(plan).encode()).hexdigest()[:16]

    def _stripe_bytes(self) -> tuple[int, int, int]:
        """Bytes of this rank's stripes: the weights the optimizer updates, their gradients,
        and the rest (frozen weights, in their own dtype)."""
        storage = self._adopted()
        weights, rest = storage.stripe_weights, storage.frozen_weights
        grads = self.grads.stripe_grads if self.grads is not None else weights
        nbytes = [t.numel() * t.element_size() for t in (weights, grads, rest)]
        return nbytes[0], nbytes[1], nbytes[2]

    def master_bytes(self) -> int:
        if self.master_dtype == self._adopted().dtype:
            return 0
        weights, grads, _ = self._stripe_bytes()
        return weights + grads

    def memory(self, ctx: Context, optimizer_bytes: int) -> dict[str, int]:
        storage = self._adopted()
        weights, grads, rest = self._stripe_bytes()
        own = self.master_dtype == storage.dtype
        return {
            "parameters": rest + (weights if own else 0),
            "gradients": grads if own else 0,
            "optimizer": optimizer_bytes,
            "master": 0 if own else weights + grads,
            "transient": storage.transient,
        }

    def local_shards(self, ctx: Context) -> LocalShards:
        """The stripes' weights the optimizer updates, by unit piece (one piece per unit
        when every parameter trains and the layout has one dtype); with frozen parameters,
        the rest as :attr:`LocalShards.frozen`."""
        storage = self._adopted()
        pieces = [[(x, min(y, u.end)) for x, y, _ in p] for u, p in zip(self.units, storage.pieces)]
        shards = self._shards(storage.stripe_weights, pieces, storage.element)
        if not storage.frozen:
            return shards
        rest = []  # per unit, what its pieces leave of it
        for u, mine in zip(self.units, pieces):
            edges = [u.start, *(e for piece in mine for e in piece), u.end]
            rest.append([(a, b) for a, b in zip(edges[::2], edges[1::2]) if a < b])
        frozen = self._shards(storage.frozen_weights, rest, storage.kept_at)
        return dataclasses.replace(shards, frozen=frozen)

    def _shards(
        self, tensor: torch.Tensor, spans: list[list[tuple[int, int]]], at: Callable[[int], int]
    ) -> LocalShards:
        """``spans`` (per unit, flat ranges of it) as regions cut by the units' geometries,
        this rank's cut of each at ``at(start)`` in ``tensor``."""
        storage = self._adopted()
        regions, cuts, offsets = [], [], []
        for g, mine in zip(storage.geometries, spans):
            for x, y in mine:
                if x >= y:
                    continue
                ranges = [(min(max(a, x), y), min(max(b, x), y)) for a, b in g.ranges()]
                regions.append((x, y))
                cuts.append(ranges)
                a, b = ranges[storage.rank]
                offsets.append(at(a) if a < b else 0)
        return LocalShards.of(tensor, regions, cuts, storage.rank, offsets)

    def own_groups(self) -> tuple[dist.ProcessGroup, ...]:
        # a trainer whose construction failed before the communicators is closed at exit too
        return self.comm.own_groups() if self.comm is not None else ()

    def order_digest(self) -> str:
        """A digest of the collectives issued so far, in order, on each of the mode's three
        communicators: equal on every rank, or some rank issued another sequence."""
        assert self.comm is not None
        return self.comm.order.digest()

    def close(self) -> None:
        """Hooks off, collectives in flight waited for (the trainer's reducer close)."""
        if self.grads is not None:
            self.grads.close()
        elif self.storage is not None:
            self.storage.wait_all()
