"""Fully sharded mode (ZeRO-3 / FSDP): parameters, gradients and optimizer state sharded.

The layout is cut into units (:mod:`.units`): a transformer block each, plus root
units for what lies between. Rank ``r`` persistently holds stripe ``r`` of every
unit (in the master dtype: the weights the optimizer updates), its gradient, and
the optimizer's state for it: 16 bytes per parameter over the world size with
AdamW. A unit's full buffer exists only while the unit runs: its storage is
allocated and gathered in a forward pre-hook (``prefetch`` units ahead), freed
after its forward, gathered again before its backward, freed after it. Its
gradient is reduce-scattered into the stripes as soon as its backward is done.

Parameters are views of the unit buffers, as they are views of the one flat
buffer in the other modes: a freed unit keeps its views, with no storage behind
them (``untyped_storage().resize_(0)``), and a gather refills the same storage.

Order: every rank issues the same collectives in the same order by construction.
Gathers run on a group of their own in the order the forward and backward hooks
fire (the same on every rank: the same model runs); reduce-scatters on another,
in a fixed order: the units freed after their backward in reverse unit order (a
unit whose backward finished waits for the units after it), then the kept units
when backward ends; the step's own collectives (the used-parameter mask, the
norm) on the trainer's group. :meth:`FullyShard.order_digest` lets a test or a debug
run compare the sequences across ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._errors import TorchShardError
from .._flat.hf import clear_init_flags
from .._flat.module import FlatParamModule, _init_own_way
from .._flat.views import Owners
from .buckets import Bucket
from .full_support import FREE, HEAP, PENDING, READY, Materialize, PostBackward
from .mode import Context, Mode, Segment
from .reducer import CommStats
from .shards import LocalShards
from .units import Unit, UnitSpec, resolve_units, unit_geometry

__all__ = ["FullyShard"]


GLOO_COLLECTIVES = "owner"
"""On gloo: ``"owner"`` gathers a unit with one broadcast per owner and reduces it with
one reduce per owner; ``"native"`` uses ``all_gather_single``/``reduce_scatter_single``
(which gloo emulates with a list all-gather and a full all-reduce). ``benchmarks/
bench_full.py`` measures both; NCCL always uses the native, in-place collectives."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FullyShard(Mode):
    """Parameters, gradients and optimizer state of every unit sharded over the ranks."""

    sharded = True
    norm_is_partial = True
    owns_buffers = True
    whole_weights = False
    label = "full"
    reduces_by = "unit"

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
        self.stats = CommStats()
        self._pieces: list[tuple[int, int, int, torch.nn.Parameter]] = []
        # per communicator: gathers ("g"), reduce-scatters ("r"), the trainer's group ("m")
        self._order = {k: hashlib.sha256() for k in "grm"}
        self._pinned = 0
        self._hooks: list[Any] = []
        self._closed = False
        self._filled: set[int] = set()
        self._heap_free = 0

    # -- construction ----------------------------------------------------------------------
    def prepare(self, fm: FlatParamModule) -> None:
        """Resolve the units (no tensors, no collective), before the ranks compare models."""
        self.units = resolve_units(fm.module, fm.layout, self.spec)

    def adopt(
        self,
        fm: FlatParamModule,
        device: torch.device,
        group: dist.ProcessGroup | None,
        src: int,
        init_fn: Callable[[nn.Module], None] | None,
    ) -> tuple[nn.Parameter, ...]:
        """Shard ``fm`` over the group: unit buffers (freed), parameters as their views, this
        rank's stripes filled from ``fm``'s weights (bound, real, or initialized from meta one
        unit at a time) as ``src`` holds them. Returns the parameters by slot."""
        layout = fm.layout
        self.fm, self.device, self.group = fm, device, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.dtype = fm.dtype
        if not self.units:
            self.prepare(fm)
        self.geoms = [unit_geometry(u, self.world, layout.align) for u in self.units]
        self.shard_dtype = self.master_dtype if fm.dtype != self.master_dtype else fm.dtype
        offs, at = [], 0
        for g in self.geoms:
            offs.append(at)
            at += g.per_rank
        self.offsets, self.shard_numel = offs, at
        self.shard = torch.zeros(at, dtype=self.shard_dtype, device=device)
        self.grad_shard = torch.zeros(at, dtype=self.shard_dtype, device=device)
        self.unit_of = [0] * len(layout)
        for u in self.units:
            for i in range(u.lo, u.hi):
                self.unit_of[i] = u.index
        self._groups(group)

        owners = Owners(fm.module)
        flat = fm.flat_param
        originals: list[torch.Tensor | None] = [None] * len(layout)
        if flat is None:
            for i, s in enumerate(layout):
                p = owners.get(s.name)
                originals[i] = None if p.is_meta else p.detach()
        # The unit buffers, with storage, long enough to cut the views; then freed.
        self.buf = [torch.zeros(g.total, dtype=fm.dtype, device=device) for g in self.geoms]
        self.state = [FREE] * len(self.units)
        self.versions = [0] * len(self.units)
        self.works: list[list[dist.Work]] = [[] for _ in self.units]
        self.transient = self.peak_transient = 0
        params: list[nn.Parameter] = []
        with torch.no_grad():
            for i, s in enumerate(layout):
                u = self.units[self.unit_of[i]]
                view = self.buf[u.index][s.offset - u.start : s.end - u.start].view(s.shape)
                old = owners.get(s.name)
                new = nn.Parameter(view, requires_grad=s.requires_grad)
                new.__dict__.update(old.__dict__)
                if s.requires_grad:
                    new.register_post_accumulate_grad_hook(self._grad_hook(i))
                for name in s.names:
                    owners.set(name, new)
                params.append(new)
                del old, new
        for b in self.buf:
            b.untyped_storage().resize_(0)
        fm._detach_buffers()  # the flat buffers, if any, are no longer the parameters'
        fm._materialize_buffers(device)
        self.params = tuple(params)
        self._fill(layout, flat, originals, init_fn, src)
        del flat, originals
        self._trim()
        return self.params

    def _groups(self, group: dist.ProcessGroup | None) -> None:
        """Two more communicators over the same ranks: gathers and reduce-scatters each keep
        their own order, independent of how they interleave with each other.

        Over the default group every rank creates them (``new_group``, as all ranks must).
        Over a subgroup only its members do (``use_local_synchronization``), and torch names
        such a group from its ranks and the number of groups each member knows; where members
        know different numbers, they would wait for each other under different names forever:
        then the trainer's group carries all three orders (the same on every rank as long as
        the ranks use the same parameters; see docs/fully-sharded.md)."""
        self.global_ranks = [
            dist.get_global_rank(group, r) if group is not None else r for r in range(self.world)
        ]
        self.gather_group = self.rs_group = group
        self.made_groups = self.destroy_groups = False
        if self.world == 1:
            return
        backend = dist.get_backend(group)
        default = group is None or group == dist.group.WORLD
        if not default:
            known = torch.tensor([len(dist.distributed_c10d._world.pg_names)], device=self.device)
            lo, hi = known.clone(), known.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            if bool(lo != hi):
                return
        local = not default
        ranks = self.global_ranks
        self.gather_group = dist.new_group(ranks, backend=backend, use_local_synchronization=local)
        self.rs_group = dist.new_group(ranks, backend=backend, use_local_synchronization=local)
        # Destroyed at close() only over the default group: torch names a subgroup made with
        # use_local_synchronization from its ranks and the number of groups its members know,
        # so after a destroy the next trainer's group would get the same name, read the dead
        # group's store keys and hang. Those stay until the default group goes.
        self.made_groups, self.destroy_groups = True, not local

    @torch.no_grad()
    def _fill(
        self,
        layout: Any,
        flat: torch.Tensor | None,
        originals: list[torch.Tensor | None],
        init_fn: Callable[[nn.Module], None] | None,
        src: int,
    ) -> None:
        """Each unit in turn: its weights (copied, or initialized), ``src``'s broadcast, this
        rank's stripe kept; never more than a few units at once."""
        fresh = flat is None and any(o is None for o in originals)
        if not fresh:
            for u in self.units:
                self._alloc(u.index)
                buf = self.buf[u.index]
                if flat is not None:
                    buf[: u.numel].copy_(flat[u.start : u.end])
                else:
                    for i in range(u.lo, u.hi):
                        s = layout.slots[i]
                        o = originals[i]
                        assert o is not None
                        buf[s.offset - u.start : s.end - u.start].copy_(o.reshape(-1))
                        originals[i] = None  # release the old parameter as we go
                self._settle(u.index, src)
            return
        # A meta-built model: run the initializer as today (same order, same random
        # numbers), materializing each unit when an op first touches it and settling
        # units the initializer has moved past (a unit touched again is gathered back).
        with Materialize(self, src):
            clear_init_flags(self.fm.module)
            if init_fn is not None:
                self.fm.module.apply(init_fn)
            else:
                _init_own_way(self.fm.module)
        for u in self.units:
            if self.state[u.index] == READY:
                self._settle(u.index, src)
            elif u.index not in self._filled:
                self._alloc(u.index)  # nothing initialized it: zeros, as the gaps
                self._settle(u.index, src)

    def _settle(self, u: int, src: int) -> None:
        """``src``'s unit ``u`` everywhere; keep this rank's stripe; free the unit."""
        buf = self.buf[u]
        if self.world > 1:
            root = self.global_ranks[src]
            dist.broadcast(buf, root, group=self.group)
        a = self.rank * self.geoms[u].per_rank
        n = self.geoms[u].per_rank
        self.shard[self.offsets[u] : self.offsets[u] + n].copy_(buf[a : a + n])
        self._filled.add(u)
        self._free(u)

    # -- unit storage ------------------------------------------------------------------------
    def _alloc(self, u: int) -> None:
        buf = self.buf[u]
        nbytes = buf.numel() * buf.element_size()
        if buf.untyped_storage().nbytes() == 0:
            buf.untyped_storage().resize_(nbytes)
            with torch.autograd._unsafe_preserve_version_counter(buf):
                buf.zero_()
            self.transient += nbytes
            self.peak_transient = max(self.peak_transient, self.transient)
        self.state[u] = READY

    def _free(self, u: int) -> None:
        buf = self.buf[u]
        if buf.untyped_storage().nbytes():
            self.transient -= buf.untyped_storage().nbytes()
            buf.untyped_storage().resize_(0)
        self.state[u] = FREE

    def gather_unit(self, u: int, *, wait: bool) -> None:
        """Start (and with ``wait``, finish) making unit ``u`` whole from the stripes."""
        if self.state[u] == FREE:
            buf = self.buf[u]
            nbytes = buf.numel() * buf.element_size()
            buf.untyped_storage().resize_(nbytes)
            self.transient += nbytes
            self.peak_transient = max(self.peak_transient, self.transient)
            n = self.geoms[u].per_rank
            a = self.rank * n
            mine = self.shard[self.offsets[u] : self.offsets[u] + n]
            # Saved for backward are views of this storage: refilling it is no modification.
            # The version is put back once the gather is done (gloo's all-gather writes the
            # output when the work completes, on its own thread).
            self.versions[u] = buf._version
            buf[a : a + n].copy_(mine)
            self.works[u] = self._gather_collectives(buf, n) if self.world > 1 else []
            self.state[u] = PENDING
            self._log("g", u)
            self.stats.bytes_gathered += nbytes if self.world > 1 else 0
        if wait and self.state[u] == PENDING:
            for w in self.works[u]:
                w.wait()
            self.works[u] = []
            torch._C._autograd._unsafe_set_version_counter((self.buf[u],), (self.versions[u],))
            self.state[u] = READY

    def _gather_collectives(self, buf: torch.Tensor, n: int) -> list[dist.Work]:
        g = self.gather_group
        if self.device.type == "cuda" or GLOO_COLLECTIVES == "native":
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            a = self.rank * n
            return [gather(buf, buf[a : a + n], group=g, async_op=True)]
        return [
            dist.broadcast(buf[q * n : (q + 1) * n], self.global_ranks[q], group=g, async_op=True)
            for q in range(self.world)
        ]

    def release(self, u: int) -> None:
        """Free unit ``u`` unless it is kept for the step or pinned by :meth:`gathered`."""
        if not self.units[u].kept and not self._pinned and self.state[u] != FREE:
            self.gather_unit(u, wait=True)  # never free under a collective in flight
            self._free(u)

    def gather(self, ctx: Context) -> None:
        """The stripes changed (a load, an edit of ``trainer.optimizer_segments()``): the
        units materialized now hold stale weights; gather them again (the others gather at
        their next use anyway)."""
        self.regather()

    @torch.no_grad()
    def regather(self) -> None:
        """Gather again the units materialized now (kept for the step, or in
        ``trainer.gathered()``) from the stripes. A collective when any is: the units'
        states are the same on every rank (the same calls made them)."""
        live = [u for u, buf in enumerate(self.buf) if buf.untyped_storage().nbytes()]
        if not live:
            return
        self.release_all()
        for u in live:
            self.gather_unit(u, wait=True)

    def release_all(self) -> None:
        for u in range(len(self.units)):
            if self.state[u] != FREE:
                self.gather_unit(u, wait=True)
                self._free(u)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        self._pinned += 1
        try:
            for u in range(len(self.units)):
                self.gather_unit(u, wait=False)
            for u in range(len(self.units)):
                self.gather_unit(u, wait=True)
            yield
        finally:
            self._pinned -= 1
            if not self._pinned:
                self.release_all()

    # -- forward and backward hooks ------------------------------------------------------------
    def setup(self, ctx: Context, buckets: tuple[Bucket, ...]) -> None:
        self.ctx = ctx
        self.trainable = [0] * len(self.units)
        for i in ctx.trainable:
            self.trainable[self.unit_of[i]] += 1
        # Reduce-scatter order, the same on every rank: the units that are freed after their
        # backward, last first, as their backward ends; then the kept ones (root units, ties:
        # their gradients can arrive until backward ends), at its end.
        mine = [u.index for u in reversed(self.units) if self.trainable[u.index]]
        self.rs_units = [u for u in mine if not self.units[u].kept]
        self.rs_units += [u for u in mine if self.units[u].kept]
        self.stats.buckets = len(self.rs_units)
        self._pool_numel = max(
            (g.total for u, g in zip(self.units, self.geoms) if not u.kept), default=0
        )
        self._pool: list[torch.Tensor] = []
        self._mask = torch.zeros(len(ctx.trainable), dtype=torch.int32, device=ctx.device)
        self.sync = True
        self.averaged = False
        self._used = [False] * len(ctx.fm.layout)
        self._inflight: list[tuple[int, list[dist.Work], torch.Tensor, torch.Tensor]] = []
        self._reset_backward()
        root = ctx.fm.module
        self._hooks.append(root.register_forward_pre_hook(self._root_pre_forward))
        for u in self.units:
            if u.root:
                continue
            m = root.get_submodule(u.name)
            self._hooks.append(
                m.register_forward_pre_hook(self._pre_forward(u.index), with_kwargs=True)
            )
            self._hooks.append(m.register_forward_hook(self._post_forward(u.index)))

    def _reset_backward(self) -> None:
        n = len(self.units)
        self.gu: list[torch.Tensor | None] = [None] * n
        self.pending = list(self.trainable)
        self.eligible = [False] * n
        self.calls = [0] * n
        self.backs = [0] * n
        self.reduced = [False] * n
        self.next_rs = 0
        self._queued = False
        self._in_backward_count = 0

    def _root_pre_forward(self, *_: Any) -> None:
        if self._pinned or _in_backward():
            return
        for u in self.units:
            if u.kept:
                self.gather_unit(u.index, wait=False)
        for u in self._ahead(-1, self.prefetch):
            self.gather_unit(u, wait=False)
        for u in self.units:
            if u.kept:
                self.gather_unit(u.index, wait=True)

    def _ahead(self, u: int, k: int, step: int = 1) -> list[int]:
        """The next ``k`` units after ``u`` (before it, ``step=-1``) that are not kept."""
        out, v = [], u + step
        while len(out) < k and 0 <= v < len(self.units):
            if not self.units[v].kept:
                out.append(v)
            v += step
        return out

    def _pre_forward(self, u: int) -> Callable[..., Any]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
            if self._pinned:
                return None
            self.gather_unit(u, wait=True)
            if _in_backward():  # recomputation (activation checkpointing): only the weights
                return None
            for v in self._ahead(u, self.prefetch):
                self.gather_unit(v, wait=False)
            if not torch.is_grad_enabled():
                return None
            self.calls[u] += 1
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
            if self._pinned or _in_backward():
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
                self.release(u)  # (no backward will need it after a forward without grad)

        return hook

    def _queue_end(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _pre_backward(self, u: int) -> None:
        self._queue_end()
        self.gather_unit(u, wait=False)
        for v in self._ahead(u, self.prefetch, step=-1):
            self.gather_unit(v, wait=False)
        self.gather_unit(u, wait=True)

    def _post_backward(self, u: int) -> None:
        self.backs[u] += 1
        if self.backs[u] >= self.calls[u]:
            self.release(u)
            self.eligible[u] = True
            self._launch_ready()

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
        self._queue_end()
        u = self.unit_of[i]
        s = self.fm.layout.slots[i]
        if self.reduced[u]:
            raise TorchShardError(
                f"parameter {s.name!r} received its gradient after unit {self.units[u].name!r} "
                "was reduce-scattered: it is used outside its unit's forward; choose units= "
                "so that each unit's parameters are used only inside it"
            )
        start = self.units[u].start
        gu = self._grad_unit(u)
        gu[s.offset - start : s.end - start].view(s.shape).add_(g)
        if not self._used[i]:
            self._used[i] = True
        self.pending[u] -= 1
        if self.pending[u] == 0 and not self.units[u].kept:
            self.eligible[u] = True
            self._launch_ready()

    def _grad_unit(self, u: int) -> torch.Tensor:
        """Unit ``u``'s gradient buffer, zeros; for a freed unit, from the step's pool of at
        most two of the largest such size (fewer allocations: less for the heap to keep)."""
        gu = self.gu[u]
        if gu is None:
            n = self.geoms[u].total
            if self.units[u].kept or not self._pool_numel:
                gu = torch.zeros(n, dtype=self.dtype, device=self.device)
                self._grow(gu)
            else:
                back = self._pool.pop() if self._pool else self._grow(self._pool_buffer())
                gu = back[:n].zero_()
            self.gu[u] = gu
        return gu

    def _pool_buffer(self) -> torch.Tensor:
        return torch.empty(self._pool_numel, dtype=self.dtype, device=self.device)

    def _grow(self, t: torch.Tensor) -> torch.Tensor:
        self.transient += t.numel() * t.element_size()
        self.peak_transient = max(self.peak_transient, self.transient)
        return t

    def _end_of_backward(self) -> None:
        for u in range(len(self.units)):
            self.eligible[u] = True
        self._launch_ready()
        for u in range(len(self.units)):
            self.release(u)
        self._reset_backward()

    # -- reduce-scatter ---------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self.next_rs < len(self.rs_units) and self.eligible[self.rs_units[self.next_rs]]:
            self._reduce_scatter(self.rs_units[self.next_rs])
            self.next_rs += 1

    @torch.no_grad()
    def _reduce_scatter(self, u: int) -> None:
        ctx = self.ctx
        gu = self._grad_unit(u)
        self.reduced[u] = True
        n = self.geoms[u].per_rank
        if ctx.divide_first:
            gu.mul_(1.0 / self.world)
        self._log("r", u)
        if self.world == 1:
            out, works = gu[:n], []
        else:
            self.stats.bytes_reduced += gu.numel() * gu.element_size()
            op = ctx.mean_op or dist.ReduceOp.SUM
            if self.device.type == "cuda" or GLOO_COLLECTIVES == "native":
                out = torch.empty(n, dtype=gu.dtype, device=gu.device)
                rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                works = [rs(out, gu, op=op, group=self.rs_group, async_op=True)]
            else:
                a = self.rank * n
                out = gu[a : a + n]
                works = [
                    dist.reduce(
                        gu[q * n : (q + 1) * n],
                        self.global_ranks[q],
                        op=op,
                        group=self.rs_group,
                        async_op=True,
                    )
                    for q in range(self.world)
                ]
        self.gu[u] = None
        self._inflight.append((u, works, out, gu))
        # one reduction in flight, one unit's gradient filling: at most two unit gradients
        while len(self._inflight) > 1:
            self._complete()
        if self.world == 1:
            self._complete()

    def _complete(self) -> None:
        u, works, out, gu = self._inflight.pop(0)
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.stats.wait_seconds += time.perf_counter() - t0
        n = self.geoms[u].per_rank
        self.grad_shard[self.offsets[u] : self.offsets[u] + n].add_(out)
        if gu._base is not None:  # a pooled buffer: back to the pool
            self._pool.append(gu._base)
        else:
            self.transient -= gu.numel() * gu.element_size()

    @torch.no_grad()
    def reduce(self) -> None:
        """The gradients of every backward since the last step, averaged into the stripes."""
        ctx = self.ctx
        while self._inflight:
            self._complete()
        used = [self._used[i] for i in ctx.trainable]
        everywhere = all(used)
        if self.world > 1:
            mask = self._mask
            if everywhere:
                mask.fill_(1)
            else:
                mask.copy_(torch.tensor(used, dtype=mask.dtype))
            dist.all_reduce(mask, group=ctx.group)
            self._log("m", 0)
            if not everywhere:
                used = [bool(n) for n in mask.tolist()]
        if ctx.divides_after:
            self.grad_shard.div_(self.world)
        globally = dict(zip(ctx.trainable, used))
        for i, a, b, piece in self._pieces:
            piece.grad = self._stripe(self.grad_shard, a, b) if globally[i] else None
        self._used = [False] * len(ctx.fm.layout)
        self.stats.steps += 1
        self.stats.launched_during_backward = len(self.rs_units)
        self.averaged = True

    # -- the optimizer's side ----------------------------------------------------------------------
    def _stripe(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of the flat buffer (inside one of this rank's stripes) in ``t``,
        a tensor laid out like the shard."""
        u = self.unit_of_offset(a)
        s0 = self.geoms[u].range(self.rank)[0]
        o = self.offsets[u] + (a - s0)
        return t[o : o + (b - a)]

    def unit_of_offset(self, a: int) -> int:
        lo, hi = 0, len(self.units)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.units[mid].start <= a:
                lo = mid
            else:
                hi = mid
        return lo

    def stripes(self) -> list[tuple[int, int]]:
        """This rank's ``[a, b)`` of the flat buffer, one per unit, clipped to the unit."""
        out = []
        for u, g in zip(self.units, self.geoms):
            a, b = g.range(self.rank)
            out.append((min(a, u.end), min(b, u.end)))
        return out

    def optimizer_tensors(self, ctx: Context) -> list[Segment]:
        if not self._pieces:
            slots = ctx.fm.layout.slots
            for (a0, b0), u in zip(self.stripes(), self.units):
                for i in range(u.lo, u.hi):
                    s = slots[i]
                    if not s.requires_grad:
                        continue
                    a, b = max(s.offset, a0), min(s.end, b0)
                    if a < b:
                        piece = torch.nn.Parameter(self._stripe(self.shard, a, b))
                        self._pieces.append((i, a, b, piece))
        return list(self._pieces)

    def local_grad(self, ctx: Context) -> torch.Tensor:
        return self.grad_shard

    @torch.no_grad()
    def after_step(self, ctx: Context) -> None:
        self.grad_shard.zero_()
        self.release_all()  # gathered weights are stale now: the next forward gathers again
        for t in self._pool:
            self.transient -= t.numel() * t.element_size()
        self._pool.clear()
        self._trim(slack=2 * max(g.total for g in self.geoms) * self.dtype.itemsize)

    def _trim(self, *, slack: int = 0) -> None:
        """On CPU, give the heap's free memory back to the system once it holds ``slack``
        bytes more than after the last time. The unit buffers are freed and allocated again
        every step; glibc raises its mmap threshold to the size of the first one freed, then
        serves them from its heap, and what they leave free there stays resident: the RSS
        grew step after step, to 2x the replicated mode's at 4 ranks. Trimming every step
        would cost page faults in steps that reuse what they freed."""
        if self.device.type != "cpu" or HEAP.trim is None:
            return
        if HEAP.free_bytes() > self._heap_free + slack:
            HEAP.trim(0)
            self._heap_free = HEAP.free_bytes()  # what trimming leaves: the new baseline

    @torch.no_grad()
    def zero_grad(self) -> None:
        while self._inflight:
            self._complete()
        for *_, piece in self._pieces:
            piece.grad = None
        self.grad_shard.zero_()
        self._used = [False] * len(self.fm.layout)

    def fingerprint(self) -> str:
        """Units and schedule: ranks that differ would issue other collectives (and hang)."""
        plan = [(u.lo, u.hi, u.kept) for u in self.units], self.prefetch, self.reshard_after_forward
        return "F" + hashlib.sha256(repr(plan).encode()).hexdigest()[:16]

    def master_bytes(self) -> int:
        if self.shard_dtype == self.dtype:
            return 0
        return 2 * self.shard.numel() * self.shard.element_size()

    def local_shards(self, ctx: Context) -> LocalShards:
        every = [g.clipped(u.numel) for u, g in zip(self.units, self.geoms)]
        regions = [(u.start, u.end) for u in self.units]
        return LocalShards.of(self.shard, regions, every, self.rank, self.offsets)

    def after_load(self, ctx: Context) -> None:
        self.regather()

    def reset_peak(self) -> None:
        self.peak_transient = self.transient

    def own_reducer(self) -> FullReducer:
        return FullReducer(self)

    def grad_sync(self, ctx, buckets):  # type: ignore[no-untyped-def]  # shim until the cut
        return FullReducer(self)

    def memory(self, ctx: Context, opt: int) -> dict[str, int]:
        nbytes = self.shard.numel() * self.shard.element_size()
        own = self.shard_dtype == self.dtype
        return {
            "parameters": nbytes if own else 0,
            "gradients": nbytes if own else 0,
            "optimizer": opt,
            "master": 0 if own else 2 * nbytes,
            "transient": self.transient,
        }

    # -- order check -------------------------------------------------------------------------------
    def _log(self, kind: str, u: int) -> None:
        self._order[kind].update(f"{u};".encode())

    def own_groups(self) -> tuple[dist.ProcessGroup, ...]:
        # getattr: a trainer whose construction failed before _groups() is closed at exit too
        return (self.rs_group, self.gather_group) if getattr(self, "destroy_groups", False) else ()

    def order_digest(self) -> str:
        """A digest of the collectives issued so far, in order, on each of the mode's three
        communicators: equal on every rank, or some rank issued another sequence."""
        return " ".join(f"{k}:{h.hexdigest()[:16]}" for k, h in self._order.items())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        while getattr(self, "_inflight", None):
            self._complete()
        for u in range(len(self.units)):
            for w in self.works[u]:
                w.wait()
            self.works[u] = []


class FullReducer:
    """The trainer's reducer interface over :class:`FullyShard` (which schedules its own
    collectives from its hooks): ``finish`` averages the stripes' gradients."""

    def __init__(self, mode: FullyShard) -> None:
        self.mode = mode
        self.stats = mode.stats

    @property
    def sync(self) -> bool:
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

    @property
    def averaged(self) -> bool:
        return self.mode.averaged

    @averaged.setter
    def averaged(self, value: bool) -> None:
        self.mode.averaged = value

    def finish(self) -> None:
        self.mode.reduce()

    def close(self) -> None:
        self.mode.close()
