"""The units' storage: this rank's stripes of every unit, and each unit's whole buffer,
which has storage only while the unit is gathered.

A freed unit keeps its tensor (the parameters are views of it) with no storage behind it
(``untyped_storage().resize_(0)``); a gather refills the same storage. :class:`UnitBuffers`
counts the bytes held that way (transient, and their peak) and gives a CPU heap's free
memory back. FSDP2: ``FSDPParam.alloc_storage``/``free_storage`` and
``FSDPParamGroup.unshard``/``wait_for_unshard``/``reshard``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..._flat.layout import FlatLayout, Region, as_dtype
from ..units import Unit, stripe_parts, unit_geometry, unit_pieces
from .collectives import UnitComm

__all__ = ["FREE", "HEAP", "PENDING", "READY", "UnitBuffers", "slot_units"]

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


def slot_units(units: list[Unit], n_slots: int) -> list[int]:
    """The unit of each of the layout's ``n_slots`` slots.

    Example::

        unit_of = slot_units(units, len(fm.layout))
    """
    unit_of = [0] * n_slots
    for u in units:
        for i in range(u.lo, u.hi):
            unit_of[i] = u.index
    return unit_of


class UnitBuffers:
    """Every unit's whole buffer (freed), this rank's stripes and the states of the buffers.

    A stripe is held in two tensors: its :func:`~..units.unit_pieces` (what trains: every
    weight unless some are frozen) as elements of ``stripe_dtype`` in :attr:`stripe_weights`
    (what the optimizer updates), the rest (frozen weights, the gaps and padding around
    them) as the buffer holds it in :attr:`frozen_weights`. A frozen weight of a bf16 model
    so keeps its 2 bytes per element: no master copy of what never trains.

    Args:
        units: the units, in layout order.
        layout: the flat layout (alignment, dtypes, which parameters train).
        dtype: the model's dtype (the units' buffers; bytes for parameters of several).
        stripe_dtype: the stripes' dtype (the master dtype).
        comm: the communicators (its world size cuts the units).

    Example::

        storage = UnitBuffers(units, fm.layout, fm.dtype, torch.float32, comm)
        storage.gather(0, wait=True)   # unit 0 whole
        storage.release(0)             # and freed again
    """

    def __init__(
        self,
        units: list[Unit],
        layout: FlatLayout,
        dtype: torch.dtype,
        stripe_dtype: torch.dtype,
        comm: UnitComm,
    ) -> None:
        self.units, self.dtype, self.comm, self.device = units, dtype, comm, comm.device
        self.rank = comm.rank
        self.regions: tuple[Region, ...] = layout.regions if layout.mixed else ()
        """A mixed layout's regions (bytes of several dtypes); ``()`` otherwise."""
        self.frozen = layout.grad_layout is not layout
        """Some parameters are frozen: the stripes hold the trainable runs alone."""
        self.geometries = [unit_geometry(u, comm.world, layout.align) for u in units]
        self.pieces = [unit_pieces(layout, u, g) for u, g in zip(units, self.geometries)]
        """Per unit, what :attr:`stripe_weights` holds of it (:func:`~..units.unit_pieces`)."""
        self._cuts = [
            [stripe_parts(p, *g.range(q)) for q in range(comm.world)]
            for p, g in zip(self.pieces, self.geometries)
        ]  # per unit and rank: its parts and rest, computed once (a backward reads them)
        self.stripe_offsets: list[int] = []
        """Where unit ``u``'s stripe starts in :attr:`stripe_weights`."""
        self.mine: list[list[tuple[int, int, torch.dtype, int]]] = []
        """Per unit, this rank's parts (:meth:`parts`), each with where its elements start
        in :attr:`stripe_weights`: ``(start, end, dtype, at)``."""
        self.rest: list[list[tuple[int, int, int]]] = []
        """Per unit, the rest of this rank's stripe: flat ``[start, end)`` is
        :attr:`frozen_weights` ``[at, at + end - start)``."""
        at = kept = 0
        for u in range(len(units)):
            parts, rest = self._cuts[u][self.rank]
            self.stripe_offsets.append(at)
            self.mine.append([])
            for a, b, d in parts:
                self.mine[u].append((a, b, d, at))
                at += (b - a) * dtype.itemsize // d.itemsize
            self.rest.append([])
            for a, b in rest:
                self.rest[u].append((a, b, kept))
                kept += b - a
        self.stripe_weights = torch.zeros(at, dtype=stripe_dtype, device=self.device)
        self.frozen_weights = torch.zeros(kept, dtype=dtype, device=self.device)
        # with storage, long enough to cut the parameters' views; freed once they are cut
        self.buffers = [
            torch.zeros(g.total, dtype=dtype, device=self.device) for g in self.geometries
        ]
        self.state = [FREE] * len(units)
        self.versions = [0] * len(units)
        self.works: list[list[dist.Work]] = [[] for _ in units]
        self.transient = self.peak_transient = 0
        self.pinned = 0
        """Open :meth:`gathered` blocks: nothing is freed while one is."""
        self._heap_free = 0

    def stripe(self, u: int) -> torch.Tensor:
        """This rank's stripe of unit ``u`` in :attr:`stripe_weights` (every part's elements)."""
        a = self.stripe_offsets[u]
        n = sum((y - x) * self.dtype.itemsize // d.itemsize for x, y, d, _ in self.mine[u])
        return self.stripe_weights[a : a + n]

    def parts(self, u: int, rank: int) -> list[tuple[int, int, torch.dtype]]:
        """Rank ``rank``'s stripe of unit ``u`` (flat ``[start, end)``, padding included) as
        :attr:`stripe_weights` holds it: its share of the unit's pieces, ``(start, end,
        dtype)``; the whole stripe in one part when every parameter trains and the layout
        has one dtype.

        Example::

            for a, b, dtype in storage.parts(u, q):
                typed = storage.buffers[u][a - unit.start : b - unit.start].view(dtype)
        """
        return self._cuts[u][rank][0]

    def typed(self, t: torch.Tensor, u: int, a: int, b: int, d: torch.dtype) -> torch.Tensor:
        """Flat ``[a, b)`` of ``t``, a buffer laid out like unit ``u``'s, as ``d``."""
        return as_dtype(t[a - self.units[u].start : b - self.units[u].start], d)

    @torch.no_grad()
    def copy_stripe(self, u: int, *, into_buffer: bool) -> None:
        """This rank's stripe of unit ``u`` into the unit's buffer, or back: from
        :attr:`stripe_weights` (cast to each part's dtype) and :attr:`frozen_weights`."""
        for a, b, d, at in self.mine[u]:
            typed = self.typed(self.buffers[u], u, a, b, d)
            stripe = self.stripe_weights[at : at + typed.numel()]
            typed.copy_(stripe) if into_buffer else stripe.copy_(typed)
        start = self.units[u].start
        for a, b, at in self.rest[u]:  # as the buffer holds it
            raw = self.buffers[u][a - start : b - start]
            kept = self.frozen_weights[at : at + b - a]
            raw.copy_(kept) if into_buffer else kept.copy_(raw)

    def element(self, a: int) -> int:
        """Where flat position ``a`` (in one of this rank's stripes) is in :attr:`stripe_weights`."""
        for x, y, d, at in self.mine[self.unit_at(a)]:
            if x <= a <= y:
                return at + (a - x) * self.dtype.itemsize // d.itemsize
        raise AssertionError(f"position {a} is not in this rank's stripes")

    def kept_at(self, a: int) -> int:
        """Where flat position ``a`` (in the rest of one of this rank's stripes) is in
        :attr:`frozen_weights`."""
        for x, y, at in self.rest[self.unit_at(a)]:
            if x <= a <= y:
                return at + a - x
        raise AssertionError(f"position {a} is not in the rest of this rank's stripes")

    def stripe_ranges(self) -> list[tuple[int, int]]:
        """This rank's ``[a, b)`` of the flat buffer, one per unit, clipped to the unit."""
        out = []
        for u, g in zip(self.units, self.geometries):
            a, b = g.range(self.rank)
            out.append((min(a, u.end), min(b, u.end)))
        return out

    def stripe_of(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of the flat buffer (inside one of this rank's stripes) in ``t``,
        a tensor laid out like :attr:`stripe_weights`."""
        for x, y, d, at in self.mine[self.unit_at(a)]:
            if x <= a and b <= y:
                w = d.itemsize // self.dtype.itemsize
                return t[at + (a - x) // w : at + (b - x) // w]
        raise AssertionError(f"[{a}, {b}) is not inside one part of this rank's stripes")

    def unit_at(self, a: int) -> int:
        """The unit that holds flat element ``a``."""
        lo, hi = 0, len(self.units)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.units[mid].start <= a:
                lo = mid
            else:
                hi = mid
        return lo

    def account(self, nbytes: int) -> None:
        """``nbytes`` more (or fewer) transient bytes held; the peak follows."""
        self.transient += nbytes
        self.peak_transient = max(self.peak_transient, self.transient)

    def free_all_storage(self) -> None:
        """Drop the storage the buffers were created with (the views are cut)."""
        for b in self.buffers:
            b.untyped_storage().resize_(0)

    # -- one unit -----------------------------------------------------------------------------
    def alloc(self, u: int) -> None:
        """Unit ``u`` with storage, zeros (unless it has storage already): ready to write."""
        buf = self.buffers[u]
        nbytes = buf.numel() * buf.element_size()
        if buf.untyped_storage().nbytes() == 0:
            buf.untyped_storage().resize_(nbytes)
            with torch.autograd._unsafe_preserve_version_counter(buf):
                buf.zero_()
            self.account(nbytes)
        self.state[u] = READY

    def free(self, u: int) -> None:
        """Unit ``u`` without storage (its views stay)."""
        buf = self.buffers[u]
        if buf.untyped_storage().nbytes():
            self.account(-buf.untyped_storage().nbytes())
            buf.untyped_storage().resize_(0)
        self.state[u] = FREE

    def gather(self, u: int, *, wait: bool) -> None:
        """Start (and with ``wait``, finish) making unit ``u`` whole from the stripes."""
        if self.state[u] == FREE:
            buf = self.buffers[u]
            nbytes = buf.numel() * buf.element_size()
            buf.untyped_storage().resize_(nbytes)
            self.account(nbytes)
            n = self.geometries[u].per_rank
            # Saved for backward are views of this storage: refilling it is no modification.
            # The version is put back once the gather is done (gloo's all-gather writes the
            # output when the work completes, on its own thread).
            self.versions[u] = buf._version
            self.copy_stripe(u, into_buffer=True)
            self.works[u] = self.comm.gather(u, buf, n)
            self.state[u] = PENDING
        if wait and self.state[u] == PENDING:
            for w in self.works[u]:
                w.wait()
            self.works[u] = []
            torch._C._autograd._unsafe_set_version_counter((self.buffers[u],), (self.versions[u],))
            self.state[u] = READY

    def release(self, u: int) -> None:
        """Free unit ``u`` unless it is kept for the step or pinned by :meth:`gathered`."""
        if not self.units[u].kept and not self.pinned and self.state[u] != FREE:
            self.gather(u, wait=True)  # never free under a collective in flight
            self.free(u)

    # -- every unit ---------------------------------------------------------------------------
    def release_all(self) -> None:
        """Free every unit, kept ones too (after a step their weights are stale)."""
        for u in range(len(self.units)):
            if self.state[u] != FREE:
                self.gather(u, wait=True)
                self.free(u)

    @torch.no_grad()
    def regather(self) -> None:
        """Gather again the units materialized now (kept for the step, or in
        :meth:`gathered`) from the stripes, which changed. A collective when any is: the
        units' states are the same on every rank (the same calls made them)."""
        live = [u for u, buf in enumerate(self.buffers) if buf.untyped_storage().nbytes()]
        if not live:
            return
        self.release_all()
        for u in live:
            self.gather(u, wait=True)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit whole inside the block (and none freed by the hooks)."""
        self.pinned += 1
        try:
            for u in range(len(self.units)):
                self.gather(u, wait=False)
            for u in range(len(self.units)):
                self.gather(u, wait=True)
            yield
        finally:
            self.pinned -= 1
            if not self.pinned:
                self.release_all()

    def wait_all(self) -> None:
        """Wait for every gather in flight (before the groups that run them go)."""
        for u in range(len(self.units)):
            for w in self.works[u]:
                w.wait()
            self.works[u] = []

    def trim_heap(self, *, slack: int = 0) -> None:
        """On CPU, give the heap's free memory back to the system once it holds ``slack``
        bytes more than after the last time. See [Note: trimming the heap] in
        ``docs/fully-sharded.md``."""
        if self.device.type != "cpu" or HEAP.trim is None:
            return
        if HEAP.free_bytes() > self._heap_free + slack:
            HEAP.trim(0)
            self._heap_free = HEAP.free_bytes()  # what trimming leaves: the new baseline
