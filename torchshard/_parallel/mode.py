"""A parallel mode: one object behind the seam's three protocols (:mod:`.seam`).

The core (``DistributedTrainer``) plans, checks that every rank built the same model,
binds, broadcasts, launches gradient buckets in the same order on every rank, and owns
the guards, the stats and the public methods. A :class:`Mode` owns what differs: where
the weights live (:class:`~.seam.Storage`: one flat buffer for the bucket modes), how a
bucket travels (its comm, :mod:`.comm`), how the mean is finished and what the optimizer
updates (:class:`~.seam.UpdateShard`). ``shard=`` picks a mode once, at construction,
from the registry (:mod:`.modes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from .._errors import TorchShardError
from .._flat.geometry import Geometry
from .._flat.layout import FlatLayout
from .._flat.module import FlatParamModule
from .buckets import Bucket, plan_buckets
from .comm import AllReduce, BucketComm, Mesh1D
from .comms import AllReduce as AllReduceChoice
from .comms import Comm, build_comm, comm_spec, lossless
from .reducer import BucketReducer, mask_room
from .seam import Context, GradSync, Segment
from .setup import bind_buffers
from .shards import LocalShards
from .units import Unit

__all__ = ["Context", "Mode", "Segment", "clip_grad_norm", "summed_norm", "wire_gradients"]


_DEFAULT = AllReduceChoice()


def summed_norm(
    local: torch.Tensor, norm_type: float, mesh: Mesh1D, replicas: int = 1
) -> torch.Tensor:
    """The ``norm_type`` norm over every rank's part, from this rank's ``local`` norm.

    ``replicas``: each part is held by that many ranks of ``mesh`` (hybrid sharding): the sum
    over ``mesh`` is divided by it. One collective over the whole mesh, so every rank, and
    every replica, gets the same bits (a sum over each shard group alone would rely on
    several communicators rounding alike).

    Example::

        total = summed_norm(torch.linalg.vector_norm(my_part), 2.0, ctx.mesh)
    """
    if mesh.size == 1:
        return local
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=mesh.group)
        return local
    power = local.pow(norm_type)
    dist.all_reduce(power, group=mesh.group)
    if replicas > 1:
        power.div_(replicas)
    return power.pow(1.0 / norm_type)


def clip_grad_norm(
    mode: Mode, ctx: Context, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """Scale the gradient ``mode`` holds on this rank to a total norm of at most
    ``max_norm`` (over every rank's part); the norm before (``trainer.clip_grad_norm_``).

    Example::

        total = clip_grad_norm(mode, ctx, 1.0, 2.0, False)
    """
    grads = mode.local_grads(ctx)
    if not grads:
        return torch.zeros((), device=ctx.device)
    total = mode.norm(ctx, grads, float(norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise TorchShardError(
            f"the total gradient norm is {total.item()}; set error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.dtype))
    return total


def _norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    low = grad.dtype in (torch.bfloat16, torch.float16)  # accumulate those in fp32
    return torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32 if low else None)


class Mode:
    """A parallel mode. The core calls these, in this order:

    1. ``prepare``, ``fingerprint`` (compared across ranks), ``adopt`` (bind, broadcast).
    2. ``bucket_cuts`` adds bucket boundaries; ``setup(ctx, buckets)`` builds the mode's
       state; ``grad_sync(ctx, buckets)`` gives the trainer its gradient sync.
    3. Per step, from the bucket reducer: the comm's ``launch`` once per bucket, in bucket
       order (during backward); ``finish`` and ``attach_grads`` in ``average_gradients``;
       then ``local_grad`` and ``norm`` for ``clip_grad_norm_``; ``after_step``.
    """

    sharded: bool = False
    """Optimizer state for this rank's part only (``trainer.shard``); the gradient it
    updates is this rank's part too, so :meth:`norm` sums over the ranks."""
    pads: bool = False
    """The buffer is padded so that every rank's slice has the same length."""
    whole_weights: bool = True
    """Every rank holds every weight (``broadcast`` and ``all_reduce_parameters`` apply)."""
    reduces_by: str = "bucket"
    """What one reduction covers, for the log: ``stats.buckets`` counts these."""
    bytes_gathered: int = 0
    """Bytes of weights all-gathered so far (at the full buffer's size)."""
    units: tuple[Unit, ...] | list[Unit] = ()
    """The units the mode gathers and frees one at a time (``shard="full"``)."""
    peak_transient: int = 0
    """The most transient bytes held at once since construction or :meth:`reset_peak`."""
    divides_first: bool = False
    """The mode's preference for the division policy (:meth:`ReduceSpec.of`): without a
    native average, scale each bucket by ``1/world_size`` as it launches (DDP's order: the
    bucket is warm, the pass overlaps backward, none is left after)."""
    comm_type: type[BucketComm] = AllReduce
    """How a bucket travels (built over the mesh by :meth:`make_comm`)."""
    hybrid: bool = False
    """A sharded mode that can cut over a mesh's shard group and all-reduce the reduced cut
    across its replicas (``Context.shards``, ``Context.replicas``)."""
    comm: Comm | None = None
    """The ``comm=`` choice (:mod:`.comms`; ``None``: the default), set by the trainer
    before :meth:`prepare`: how buckets travel, on top of :attr:`comm_type`."""
    comm_kinds: frozenset[str] = frozenset({"dense"})
    """The kinds of comm choice the mode takes (``AllReduce.kind``, ...)."""
    comm_refusal: str = (
        "this mode reduces gradients by its own schedule, not bucket by bucket through a "
        "comm; leave comm= at its default, AllReduce()"
    )
    """Why the mode takes no other kinds (for the error)."""
    _fresh: bool = True  # prepare(): the module was not bound yet, the gradient gets mask room
    # (and is not bytes)
    _grad_store: torch.Tensor | None = None  # adopt(): [mask room | flat gradient], if any

    # -- where the weights live (Storage): one flat buffer ------------------------------------
    def prepare(self, fm: FlatParamModule) -> None:
        """Plan from the module alone, before the ranks compare models (fingerprint)."""
        # a mixed layout's gradient is bytes: the used-parameter mask travels on its own
        self._fresh = not fm.is_bound and not fm.layout.mixed

    def fingerprint(self) -> str:
        """Compared across ranks before binding: ranks must agree on the buffers' shape (a
        bound module keeps its gradient buffer, which has no room for the mask)."""
        return "m" if self._fresh and self._fuses_mask() else "-"

    def _fuses_mask(self) -> bool:
        """The used-parameter mask may ride in a bucket: the comm is lossless."""
        return self.comm_type.fuses_mask and lossless(self.comm)

    @torch.no_grad()
    def adopt(
        self,
        fm: FlatParamModule,
        device: torch.device,
        group: dist.ProcessGroup | None,
        src: int,
        init_fn: Callable[[torch.nn.Module], None] | None,
        cut: Mesh1D | None = None,
    ) -> tuple[torch.nn.Parameter, ...]:
        """Bind ``fm`` to one flat buffer and one flat gradient on ``device`` (initializing a
        meta-built model), weights broadcast from ``src`` over ``group``; the parameters by
        slot. ``cut``: the ranks the buffer is cut over (hybrid sharding: a shard group;
        ``None``: ``group``)."""
        mesh = Mesh1D.of(group)
        size = (cut or mesh).size
        n = self.flat_numel(fm.layout, size)
        grad_n = Geometry.of(fm.layout.grad_layout, size, pad=self.pads).total
        fuse = self._fresh and mesh.size > 1 and self._fuses_mask()
        room = mask_room(fm.layout) if fuse else 0
        self._grad_store = bind_buffers(fm, n, device, init_fn, room, grad_n)
        if mesh.size > 1:
            assert fm.flat_param is not None
            dist.broadcast(fm.flat_param, mesh.global_rank(src), group=group)
        return tuple(p for _, p in fm.named_flat_views())

    def flat_numel(self, layout: FlatLayout, world_size: int) -> int:
        """Elements of the flat buffer this mode binds (padded to the world when it pads)."""
        return Geometry.of(layout, world_size, pad=self.pads).total

    def own_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Process groups the mode created, destroyed in this order when the trainer closes."""
        return ()

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """Every weight materialized inside the block (already so unless a mode frees them)."""
        return contextlib.nullcontext()

    def order_digest(self) -> str | None:
        """A digest of the collectives issued so far (``None``: a fixed order, nothing to check)."""
        return None

    def memory(self, ctx: Context, optimizer_bytes: int) -> dict[str, int]:
        """What ``trainer.memory_bytes()`` reports."""
        flat, grad = ctx.flat, ctx.fm.flat_grad
        return {
            "parameters": flat.numel() * flat.element_size(),
            "gradients": 0 if grad is None else grad.numel() * grad.element_size(),
            "optimizer": optimizer_bytes,
            "master": self.master_bytes(),
            "transient": 0,
        }

    # -- how gradients become the mean (GradSync) ----------------------------------------------
    def bucket_cuts(self, ctx: Context) -> tuple[int, ...]:
        return ()

    def setup(self, ctx: Context, buckets: tuple[Bucket, ...]) -> None:
        """Build the mode's state, once the buffers hold the broadcast weights."""

    def make_comm(self, ctx: Context) -> BucketComm:
        """How this mode's buckets travel, and where they land."""
        return self.comm_type(ctx.mesh)  # type: ignore[call-arg]

    def grad_sync(self, ctx: Context, buckets: tuple[Bucket, ...]) -> GradSync:
        """The trainer's gradient sync: the bucket reducer over :meth:`make_comm`, as the
        comm choice builds on it."""
        comm = build_comm(self.comm or _DEFAULT, ctx, buckets, self.make_comm(ctx))
        return BucketReducer(ctx, self, buckets, comm, self._grad_store)

    # -- what the optimizer updates (UpdateShard) ----------------------------------------------
    def finish(self, ctx: Context) -> None:
        """After every bucket's reduction completed: make the gradient the mean."""
        for grad in ctx.fm.layout.grad_layout.typed(ctx.grad):
            ctx.spec.scale_after(grad)

    def optimizer_tensors(self, ctx: Context) -> list[Segment]:
        """What the optimizer updates, one entry per trainable slot (or piece of one)."""
        slots = ctx.fm.layout.slots
        return [(i, slots[i].offset, slots[i].end, ctx.params[i]) for i in ctx.trainable]

    def attach_grads(self, ctx: Context, used: dict[int, bool]) -> None:
        """Give the optimizer's tensors their gradients (``used``: slot -> any rank used it)."""

    def local_grad(self, ctx: Context) -> torch.Tensor | None:
        """The gradient ``clip_grad_norm_`` measures and scales on this rank."""
        return ctx.fm.flat_grad

    def local_grads(self, ctx: Context) -> list[torch.Tensor]:
        """:meth:`local_grad` as typed tensors: one per dtype region of a mixed layout's
        gradient, else the one tensor (none when nothing trains)."""
        grad = self.local_grad(ctx)
        if grad is None:
            return []
        return ctx.fm.layout.grad_layout.typed(grad)

    def norm(self, ctx: Context, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The total ``norm_type`` norm of the gradient, from this rank's ``grads``
        (:meth:`local_grads`): summed over the ranks when each holds a part (``sharded``)."""
        local = _norm(grads[0], norm_type)
        if len(grads) > 1:  # typed pieces: combined in fp32 as one vector's norm would be
            norms = torch.stack([local.float(), *(_norm(g, norm_type).float() for g in grads[1:])])
            local = torch.linalg.vector_norm(norms, norm_type)
        if not self.sharded:
            return local
        return summed_norm(local, norm_type, ctx.mesh, ctx.replica_count)

    def after_step(self, ctx: Context) -> None:
        """After ``optimizer.step()``."""

    def zero_grad(self) -> None:
        """Forget the gradients of the optimizer's own tensors."""

    def gather(self, ctx: Context) -> None:
        """Make every rank's weights whole again after the optimizer changed its part."""

    def local_shards(self, ctx: Context) -> LocalShards | None:
        """What this rank's optimizer updates of the flat buffer (``None``: whole weights)."""
        return None

    def after_load(self, ctx: Context) -> None:
        """A load wrote the weights: refresh what is derived from them now."""

    def reset_peak(self) -> None:
        """Start :attr:`peak_transient` again from what is held now."""

    def refresh_master(self, ctx: Context) -> None:
        """The weights changed other than by a step (a load): refresh derived copies."""

    def master_bytes(self) -> int:
        return 0


def wire_gradients(
    mode: Mode,
    fm: FlatParamModule,
    mesh: Mesh1D,
    device: torch.device,
    params: tuple[torch.nn.Parameter, ...],
    bucket_bytes: float,
    native: dist.ReduceOp.RedOpType | None,
    reduce_dtype: torch.dtype | None = None,
    cut: Mesh1D | None = None,
    replicas: Mesh1D | None = None,
) -> tuple[Context, tuple[Bucket, ...], GradSync]:
    """The gradient path of a trainer whose module ``mode`` adopted (``params``, by slot):
    the division policy, once (:meth:`ReduceSpec.of`: ``native`` is the backend's averaging
    op, else ``None``; gradients reduced in ``reduce_dtype``), the context, the buckets
    (with the mode's cuts), the mode's state and its gradient sync. ``cut`` and
    ``replicas``: hybrid sharding's shard and replicate groups (``mesh`` is the
    data-parallel group, the mean's).

    Example::

        ctx, buckets, sync = wire_gradients(mode, fm, mesh, device, params,
                                            25 * 2**20, native_mean(group, device))
    """
    choice = mode.comm or _DEFAULT
    spec = comm_spec(
        choice, mesh.size, fm.dtypes, native, prefer_pre=mode.divides_first, wire=reduce_dtype
    )
    trainable = fm.layout.trainable
    # gradients, buckets and the optimizer's part live in the trainable slots' space
    grads = Geometry.of(fm.layout.grad_layout, (cut or mesh).size, pad=mode.pads)
    ctx = Context(fm, mesh, device, grads, params, trainable, spec, cut, replicas)
    cuts = mode.bucket_cuts(ctx)
    planned = plan_buckets(fm.layout.grad_layout, bucket_bytes, total=grads.total, cuts=cuts)
    # a bucket names its parameters by their slot in the layout
    buckets = tuple(replace(b, slots=tuple(trainable[k] for k in b.slots)) for b in planned)
    mode.setup(ctx, buckets)
    return ctx, buckets, mode.grad_sync(ctx, buckets)
