"""The fully sharded mode's gradients: each parameter's gradient into its unit's gradient,
each unit's gradient reduce-scattered into this rank's stripes in a fixed order.

Hybrid sharding (``ctx.replicas``): the stripes are cut over a shard group; once a unit's
reduce-scatter is done, its reduced stripe is all-reduced across the replicas (issued in
the same unit order on every rank, from the thread that runs backward) and added into the
stripes' gradient one unit behind, or at :meth:`UnitGradReducer.finish`.

:class:`UnitGradReducer` is the trainer's gradient sync for this mode (``sync``,
``averaged``, ``stats``, ``finish()``, ``close()``, as the bucket reducer): the schedule
tells it when a unit's backward is done, and :meth:`finish` makes the stripes' gradients the
mean. FSDP2: ``FSDPParamGroup.post_backward`` and ``foreach_reduce``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..._errors import TorchShardError
from ..comm import fill_mask
from ..mode import Context
from .storage import UnitBuffers, slot_units

__all__ = ["UnitGradReducer"]


class UnitGradReducer:
    """Hears each trainable parameter's gradient (a hook per parameter), accumulates it into
    its unit's gradient, and reduce-scatters the units in :attr:`reduce_order`.

    Args:
        ctx: the trainer's context (its group, the division policy, the parameters).
        storage: the units' storage (geometry, stripes, transient bytes).
        params: the parameters, by slot (views of the unit buffers).

    Example::

        grads = UnitGradReducer(ctx, storage, params)
        loss.backward()   # each unit reduce-scattered as its backward ends
        grads.finish()    # the stripes' gradients are the mean
    """

    def __init__(
        self, ctx: Context, storage: UnitBuffers, params: tuple[nn.Parameter, ...]
    ) -> None:
        self.ctx, self.storage, self.comm = ctx, storage, storage.comm
        self.units, self.world = storage.units, storage.comm.world
        self.layout = ctx.fm.layout
        self.stats = self.comm.stats
        self.unit_of = slot_units(self.units, len(self.layout))
        self.trainable = [0] * len(self.units)
        for i in ctx.trainable:
            self.trainable[self.unit_of[i]] += 1
        # The same on every rank: the units freed after their backward, last first, as their
        # backward ends; then the kept ones (root units, ties: their gradients can arrive
        # until backward ends), at its end.
        mine = [u.index for u in reversed(self.units) if self.trainable[u.index]]
        self.reduce_order = [u for u in mine if not self.units[u].kept]
        self.reduce_order += [u for u in mine if self.units[u].kept]
        self.stats.buckets = len(self.reduce_order)
        self.stripe_grads = torch.zeros_like(storage.stripe_weights)
        """This rank's stripes of every unit's gradient, laid out like the stripes' weights
        (their trainable runs only, when some parameters are frozen)."""
        self.pool_numel = max(
            (g.total for u, g in zip(self.units, storage.geometries) if not u.kept), default=0
        )
        self.pool: list[torch.Tensor] = []
        self.mask = torch.zeros(len(ctx.trainable), dtype=torch.int32, device=ctx.device)
        self.averaged = False
        """Whether the stripes' gradients are the mean since the last backward."""
        self.used = [False] * len(self.layout)
        self.inflight: list[
            tuple[int, list[dist.Work], torch.Tensor | list[torch.Tensor], torch.Tensor]
        ] = []
        self.replicas = ctx.replicas if ctx.replicas is not None and ctx.replicas.size > 1 else None
        self.across: list[tuple[int, list[dist.Work], torch.Tensor | list[torch.Tensor], int]] = []
        """Hybrid sharding: the all-reduces across replicas in flight, in unit order
        ``(unit, handles, reduced parts, bytes of them held apart from the pool)``."""
        self.pieces: list[tuple[int, int, int, nn.Parameter]] = []
        """The optimizer's tensors ``(slot, start, end, piece)``, given their gradients."""
        self.on_gradient: Callable[[], None] = lambda: None
        """Called at every gradient (the schedule hears the backward from it)."""
        self.on_close: list[Callable[[], None]] = []
        """Called first by :meth:`close` (the schedule's hooks off)."""
        self._closed = False
        self.reset_backward()
        for i, p in enumerate(params):
            if self.layout.slots[i].requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_hook(i))

    def grad_of(self, a: int, b: int) -> torch.Tensor:
        """The gradient of flat ``[a, b)``: one trainable parameter's part of one of this
        rank's stripes (an optimizer piece)."""
        return self.storage.stripe_of(self.stripe_grads, a, b)

    @property
    def sync(self) -> bool:
        """Always on: every backward reduce-scatters."""
        return True

    @sync.setter
    def sync(self, value: bool) -> None:
        if not value:
            raise TorchShardError(
                "no_sync(): not available with shard='full': the unsharded gradients it would "
                "keep are the whole model's size, which this mode exists to avoid; every "
                "backward reduce-scatters and accumulates into this rank's stripes instead, so "
                "gradient accumulation needs no context manager"
            )

    def reset_backward(self) -> None:
        """Forget the last backward's per-unit state."""
        n = len(self.units)
        self.unit_grad: list[torch.Tensor | None] = [None] * n
        self.pending = list(self.trainable)
        self.reducible = [False] * n
        self.reduced = [False] * n
        self.next_reduce = 0

    # -- during backward ---------------------------------------------------------------------
    def _grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            p.grad = None  # the stripe's gradient is the one the optimizer sees
            self._on_grad(i, g)

        return hook

    @torch.no_grad()
    def _on_grad(self, i: int, g: torch.Tensor) -> None:
        self.averaged = False
        self.on_gradient()
        u = self.unit_of[i]
        s = self.layout.slots[i]
        if self.reduced[u]:
            raise TorchShardError(
                f"parameter {s.name!r} received its gradient after unit {self.units[u].name!r} "
                "was reduce-scattered: it is used outside its unit's forward; choose units= "
                "so that each unit's parameters are used only inside it"
            )
        s.view(self._unit_grad(u), base=self.units[u].start).add_(g)
        self.used[i] = True
        self.pending[u] -= 1
        if self.pending[u] == 0 and not self.units[u].kept:
            self.unit_done(u)

    def _unit_grad(self, u: int) -> torch.Tensor:
        """Unit ``u``'s gradient buffer, zeros; for a freed unit, from the step's pool of at
        most two of the largest such size (fewer allocations: less for the heap to keep)."""
        grad = self.unit_grad[u]
        if grad is None:
            n, device = self.storage.geometries[u].total, self.ctx.device
            dtype = self.ctx.spec.dtype or self.storage.dtype  # reduce_dtype: summed in it
            if self.storage.regions:  # bytes of several dtypes: a piece travels in it
                dtype = self.storage.dtype
            if self.units[u].kept or not self.pool_numel:
                grad = self._held(torch.zeros(n, dtype=dtype, device=device))
            else:
                if self.pool:
                    back = self.pool.pop()
                else:
                    back = self._held(torch.empty(self.pool_numel, dtype=dtype, device=device))
                grad = back[:n].zero_()
            self.unit_grad[u] = grad
        return grad

    def _held(self, t: torch.Tensor) -> torch.Tensor:
        self.storage.account(t.numel() * t.element_size())
        return t

    def unit_done(self, u: int) -> None:
        """Unit ``u``'s gradient is complete: reduce what the fixed order allows now."""
        self.reducible[u] = True
        self._launch_ready()

    def end_of_backward(self) -> None:
        """Backward is over: reduce every unit not reduced yet."""
        for u in range(len(self.units)):
            self.reducible[u] = True
        self._launch_ready()

    # -- reduce-scatter ------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        order = self.reduce_order
        while self.next_reduce < len(order) and self.reducible[order[self.next_reduce]]:
            self._reduce_scatter(order[self.next_reduce])
            self.next_reduce += 1

    @torch.no_grad()
    def _reduce_scatter(self, u: int) -> None:
        ctx = self.ctx
        grad = self._unit_grad(u)
        self.reduced[u] = True
        out: torch.Tensor | list[torch.Tensor]
        if self.storage.regions or self.storage.frozen:
            out, works = self._reduce_parts(u, grad)
        else:
            ctx.spec.scale_before(grad)
            n = self.storage.geometries[u].per_rank
            out, works = self.comm.reduce_scatter(u, grad, n, ctx.spec.op)
        self.unit_grad[u] = None
        self.inflight.append((u, works, out, grad))
        # one reduction in flight, one unit's gradient filling: at most two unit gradients
        while len(self.inflight) > 1:
            self._complete()
        if self.world == 1:
            self._complete()

    def _reduce_parts(
        self, u: int, grad: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Unit ``u``'s gradient by parts (:meth:`UnitBuffers.parts`: of one dtype each; with
        frozen parameters, the trainable runs alone: a frozen weight's zeros never travel),
        each reduced to its owner (in the reduce dtype where there is one); this rank's
        parts (valid once the handles are waited for) and the handles."""
        spec, storage = self.ctx.spec, self.storage
        pieces, mine = [], []
        for q in range(self.world):
            for a, b, d in storage.parts(u, q):
                wire = spec.on_wire(storage.typed(grad, u, a, b, d))
                spec.scale_before(wire)
                pieces.append((q, wire))
                if q == storage.rank:
                    mine.append(wire)
        return mine, self.comm.reduce_to_owners(u, pieces, spec.op)

    def _add(self, u: int, out: torch.Tensor | list[torch.Tensor]) -> None:
        """This rank's reduced stripe of unit ``u`` (or its parts) into the stripes' gradient."""
        if isinstance(out, list):
            for (*_, at), wire in zip(self.storage.mine[u], out):
                self.stripe_grads[at : at + wire.numel()].add_(wire)
        else:
            a = self.storage.stripe_offsets[u]
            self.stripe_grads[a : a + self.storage.geometries[u].per_rank].add_(out)

    def _complete(self) -> None:
        u, works, out, grad = self.inflight.pop(0)
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.stats.wait_seconds += time.perf_counter() - t0
        if self.replicas is not None:
            self._across(u, out, grad)
        else:
            self._add(u, out)
        if grad._base is not None:  # a pooled buffer: back to the pool
            self.pool.append(grad._base)
        else:
            self.storage.account(-grad.numel() * grad.element_size())

    def _across(self, u: int, out: torch.Tensor | list[torch.Tensor], grad: torch.Tensor) -> None:
        """Start all-reducing unit ``u``'s reduced stripe across the replicas; a part that
        lies in the unit's gradient (gloo's reduce per owner) is copied out first, so the
        gradient goes back to the pool now. One all-reduce waits in flight at most."""
        parts, held = out if isinstance(out, list) else [out], 0
        store = grad.untyped_storage().data_ptr()
        for k, t in enumerate(parts):
            if t.untyped_storage().data_ptr() == store:
                parts[k] = t.clone()
                held += t.numel() * t.element_size()
        self.storage.account(held)
        assert self.replicas is not None
        works = self.comm.all_reduce(u, parts, self.ctx.spec.op, self.replicas)
        self.across.append((u, works, parts if isinstance(out, list) else parts[0], held))
        while len(self.across) > 1:
            self._land()

    def _land(self) -> None:
        """The oldest all-reduce across replicas done: its stripe into the stripes' gradient."""
        u, works, out, held = self.across.pop(0)
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.stats.wait_seconds += time.perf_counter() - t0
        self._add(u, out)
        self.storage.account(-held)

    def _drain(self) -> None:
        while self.inflight:
            self._complete()
        while self.across:
            self._land()

    # -- the trainer's gradient-sync protocol ---------------------------------------------------
    @torch.no_grad()
    def finish(self) -> None:
        """The gradients of every backward since the last step, averaged into the stripes."""
        ctx = self.ctx
        self._drain()
        used = [self.used[i] for i in ctx.trainable]
        if ctx.world_size > 1:  # the data-parallel group: every replica alike
            everywhere = fill_mask(self.mask, used)
            dist.all_reduce(self.mask, group=ctx.group)
            self.comm.order.log("m", 0)
            if not everywhere:
                used = [bool(n) for n in self.mask.tolist()]
        ctx.spec.scale_after(self.stripe_grads)
        globally = dict(zip(ctx.trainable, used))
        for i, a, b, piece in self.pieces:
            piece.grad = self.grad_of(a, b) if globally[i] else None
        self.used = [False] * len(self.layout)
        self.stats.steps += 1
        self.stats.launched_during_backward = len(self.reduce_order)
        self.averaged = True

    def close(self) -> None:
        """Hooks off; every collective in flight waited for."""
        if self._closed:
            return
        self._closed = True
        for close in self.on_close:
            close()
        self._drain()
        self.storage.wait_all()

    # -- the optimizer's side -------------------------------------------------------------------
    @torch.no_grad()
    def zero_grad(self) -> None:
        """Forget the gradients accumulated since the last step."""
        self._drain()
        for *_, piece in self.pieces:
            piece.grad = None
        self.stripe_grads.zero_()
        self.used = [False] * len(self.layout)

    @torch.no_grad()
    def after_step(self) -> None:
        """The step consumed the gradients: zeros, and the pool's buffers freed."""
        self.stripe_grads.zero_()
        for t in self.pool:
            self.storage.account(-t.numel() * t.element_size())
        self.pool.clear()
