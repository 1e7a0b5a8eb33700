"""DistributedTrainer: one flat buffer per rank, gradients averaged in buckets during backward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._dist import Coordinator, init_distributed
from .._errors import TorchShardError
from .._exit import track, untrack
from .._flat.geometry import Geometry
from .._flat.module import FlatParamModule
from .._log import get_logger
from .._stepped import allow, forbid, held_state_bytes
from .comm import Mesh1D
from .comms import Comm, check_comm, comm_state, comm_unscaled, load_comm_state, reset_comm_error
from .mesh import Mesh, split_dp
from .mode import Mode, Segment, clip_grad_norm, wire_gradients
from .modes import Choice, choose, entry_for
from .optim import GroupRule
from .optim import param_groups as group_params
from .scaler import agree_on_inf, agreed_inf
from .seam import CommStats
from .setup import (
    all_reduce_flat,
    assert_in_sync,
    check_reduce_dtype,
    check_requires_grad,
    check_same_model,
    check_same_order,
    native_mean,
    pick_device,
    plain_optimizer_refused,
)
from .shards import LocalShards, MemoryStats
from .teardown import teardown
from .tp import agree_tp, check_tp, clip_tp, sync_replicated, tp_in_sync
from .units import Unit, UnitSpec

__all__ = ["CommStats", "DistributedTrainer"]

logger = get_logger(__name__)


class DistributedTrainer:
    """Data-parallel training over one flat buffer per rank.

    Binds ``fm`` to one parameter and one gradient buffer on ``device`` if it
    is not bound yet (initializing meta-built weights), checks that every
    rank built the same model, and broadcasts the weights and module buffers
    from ``src``. During backward, each bucket of the flat gradient (a
    contiguous range of about ``bucket_mb``) starts its all-reduce as soon as
    all its parameters have their gradients, in the same bucket order on every
    rank; :meth:`average_gradients` finishes the job.

    Args:
        fm: the wrapped model, built identically on every rank.
        device: where the buffers live (default: the bound buffer's device, else
            the local CUDA device under NCCL, else CPU).
        process_group: default: the default group, initialized from torchrun's
            environment if needed (see :func:`init_distributed`).
        mesh: a :class:`Mesh` from :func:`init_mesh` instead of ``process_group``
            (not both): the trainer runs over its data-parallel group ``mesh.dp``; with
            ``dp_replicate > 1`` and ``shard=True`` or ``"full"``, hybrid sharding: state
            cut over the shard group, each reduced slice or stripe all-reduced across the
            replicas (the mean, the used-parameter mask and the norm over ``mesh.dp``). ``rank`` and
            ``world_size`` are the data-parallel rank and size.
        bucket_mb: bucket size in MiB; fractions allowed.
        src: the rank whose weights everyone starts from.
        init_fn: how to initialize a meta-built model, as in
            :meth:`FlatParamModule.init_weights` (default: ``reset_parameters()``).
        shard: the parallel mode: :class:`Replicate` (``False``, the default),
            :class:`ShardOptimizer` (``True``) or :class:`FullShard`, whose fields hold
            its settings; the aliases take the loose keywords below. ``True``:
            FSDP-lite: each rank owns one contiguous, equal slice of the
            (padded) flat buffer; gradients are reduced to the slice's owner
            bucket by bucket during backward, the optimizer built by
            :meth:`make_optimizer` keeps state for the rank's slice only, and
            :meth:`step` all-gathers the updated slices.
            ``shard="full"``: fully sharded (ZeRO-3): each rank persistently
            holds only its stripe of every unit's weights, gradients and
            optimizer state; a unit's weights are gathered for its forward and
            its backward and freed after each (see :meth:`gathered`).
        master_dtype: sharded modes with a lower-precision flat buffer (e.g.
            bf16): the optimizer updates a copy of the rank's part in this dtype.
            A wider model (float64) keeps its own dtype, with no master.
        units: ``shard="full"``: the modules gathered one at a time: ``"auto"``
            (a transformers model's ``_no_split_modules`` blocks, else each child
            of the largest ``nn.ModuleList``), module names or classes, or a
            callable ``(name, module) -> bool``. Parameters outside every unit
            form root units, gathered for the whole step.
        prefetch: ``shard="full"``: units gathered ahead of the one running.
        reshard_after_forward: ``shard="full"``: free a unit after its forward
            (gather it again for backward); ``False`` keeps it until its backward.
        reduce_dtype: the dtype gradients are summed over the ranks in (e.g.
            ``torch.float32`` for a bf16 model: each bucket or unit travels in it, and
            lands in the fp32 master gradient where there is one, else back in the
            model's dtype, rounded once); ``None``: the gradients' own dtype.
        comm: how gradient buckets travel, from :mod:`torchshard.comm`: ``AllReduce()``
            (``None``, the default: the exact mean), ``BF16()``, ``FP16()``, ``Star()``
            (``shard=False`` or ``True``), ``PowerSGD()``, ``TopK()`` (``shard=False``);
            :attr:`comm` holds it, :attr:`stats` counts its ``payload_bytes``, and
            :meth:`comm_state` is the state a lossy one keeps.

    Example::

        fm = torchshard.FlatParamModule(model)
        trainer = torchshard.DistributedTrainer(fm)
        opt = torch.optim.AdamW(fm.parameters(), lr=3e-4)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(fm(x), y).backward()
            trainer.average_gradients()
            trainer.clip_grad_norm_(1.0)
            opt.step()
        trainer.close()
    """

    def __init__(
        self,
        fm: FlatParamModule,
        *,
        device: torch.device | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        mesh: Mesh | None = None,
        bucket_mb: float = 25,
        src: int = 0,
        init_fn: Callable[[torch.nn.Module], None] | None = None,
        shard: bool | str | Choice = False,
        master_dtype: torch.dtype = torch.float32,
        units: UnitSpec = "auto",
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        reduce_dtype: torch.dtype | None = None,
        comm: Comm | None = None,
    ) -> None:
        if not isinstance(fm, FlatParamModule):
            raise TorchShardError(
                f"fm: expected a torchshard.FlatParamModule, got {type(fm).__name__}; "
                "wrap the model first: FlatParamModule(model)"
            )
        if not bucket_mb > 0:
            raise TorchShardError(f"bucket_mb: expected a positive size, got {bucket_mb}")
        check_reduce_dtype(reduce_dtype)
        if process_group is None:
            init_distributed()
        # the one place modes are chosen
        loose = (master_dtype, units, prefetch, reshard_after_forward)
        self._mode, self.shard = _pick_mode(shard, *loose)
        # the data-parallel group; hybrid sharding's shard and replicate groups, if any
        self._group, self._cut, self._across = _groups(mesh, process_group, self._mode, shard)
        check_tp(fm, mesh)  # a split module and its mesh go together
        self._mesh = Mesh1D.of(self._group)
        self.rank, self.world_size = self._mesh.rank, self._mesh.size
        if not 0 <= src < self.world_size:
            raise TorchShardError(f"src: expected a rank in [0, {self.world_size}), got {src}")
        self.comm = self._mode.comm = _check_comm(comm, self, fm, reduce_dtype)
        self.module = fm
        self.mesh = mesh  # the Mesh given (None: process_group=)
        self.device = pick_device(fm, device, self._group)
        layout = fm.layout
        cut = self._cut or self._mesh  # the ranks the buffer is cut over
        self._geometry = Geometry.of(layout, cut.size, pad=self._mode.pads)
        self.padded_numel = self._geometry.total
        self._closed = False
        track(self)  # closed at interpreter exit if nobody closes it before
        # One program for every mode: plan from the module alone, check that every rank
        # built the same model (before the first collective that depends on it and before
        # anything is allocated), bind (initializing meta weights), broadcast from src.
        self._mode.prepare(fm)
        token = check_same_model(fm, self._mode, self._group, self.device, src)
        agree_tp(fm, self.device)  # tensor parallel: same split; tp ranks draw alike
        self._params = self._mode.adopt(fm, self.device, self._group, src, init_fn, self._cut)
        self._flat = fm.flat_param
        with fm.meta_buffers.preserved():  # src's zeros are no value: still unwritten
            _broadcast_buffers(self.module, self._mesh, src)
            sync_replicated(fm, self._params, self._flat is not None)
        self._coordinator = (
            Coordinator(token, self.rank, self.world_size) if self.world_size > 1 else None
        )
        if self._mode.sharded:  # a plain optimizer would update unreduced or absent gradients
            forbid(self._params, plain_optimizer_refused(self.shard))
        self._mean_op = native_mean(self._group, self.device)  # ReduceOp.AVG on NCCL
        self._ctx, self._buckets, self._reducer = wire_gradients(
            self._mode,
            fm,
            self._mesh,
            self.device,
            self._params,
            bucket_mb * 2**20,
            self._mean_op,
            reduce_dtype,
            self._cut,
            self._across,
        )
        self._optimizer: torch.optim.Optimizer | None = None
        self.group_names: list[list[str]] = []  # per param group of make_optimizer's optimizer
        self.stats = self._reducer.stats
        _log_start(self)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the trainer communicates over (``None``: the default group)."""
        return self._group

    @property
    def replicas(self) -> int:
        """Hybrid sharding: how many replicas hold each shard (1: none besides this one)."""
        return 1 if self._across is None else self._across.size

    @property
    def coordinator(self) -> Coordinator | None:
        """Store keys private to this trainer's group and run attempt, and the ranks'
        heartbeats (``None`` in a world of one); the checkpoint layer coordinates through it."""
        return self._coordinator

    # -- gradient averaging --------------------------------------------------------------
    def average_gradients(self) -> None:
        """Finish the gradient reduction: afterwards the flat gradient holds the mean over ranks.

        Call it after ``loss.backward()`` (and after the last backward of an
        accumulation done inside :meth:`no_sync`). A parameter used on some
        ranks gets the mean over all ranks, zeros counting for ranks that did
        not use it; a parameter no rank used keeps ``.grad is None``. In
        sharded mode only the rank's own slice holds the mean (the rest of
        ``fm.flat_grad`` is undefined); :meth:`step` calls this for you.
        """
        self._check_open()
        check_requires_grad(self.module.layout, self._params)
        self._reducer.finish()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, like DDP's ``no_sync``.

        Example::

            with trainer.no_sync():
                for x in micro_batches[:-1]:
                    loss_fn(fm(x)).backward()
            loss_fn(fm(micro_batches[-1])).backward()   # communicates everything
            trainer.average_gradients()
        """
        previous, self._reducer.sync = self._reducer.sync, False
        try:
            yield
        finally:
            self._reducer.sync = previous

    def comm_state(self) -> dict[str, torch.Tensor]:
        """The state :attr:`comm` keeps across steps, as named flat tensors (the live
        buffers; ``{}`` for a comm that keeps none). See :mod:`torchshard.comm`.

        Example::

            saved = {k: v.clone() for k, v in trainer.comm_state().items()}
            trainer.load_comm_state(saved)
        """
        return comm_state(self._reducer)

    def load_comm_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (what :meth:`comm_state` returns, possibly another rank's or the
        mean over ranks) into the comm's buffers; :class:`CommError` if it does not fit."""
        load_comm_state(self._reducer, state)

    def reset_comm_error(self) -> None:
        """Zero the error feedback of a lossy :attr:`comm` (nothing for the others)."""
        reset_comm_error(self._reducer)

    # -- other collectives ------------------------------------------------------------------
    @torch.no_grad()
    def broadcast(self, src: int = 0) -> None:
        """Copy ``src``'s flat parameter buffer and module buffers to every rank."""
        self._check_open()
        _not_full(self._mode, self.shard, "broadcast()")
        if not 0 <= src < self.world_size:
            raise TorchShardError(f"src: expected a rank in [0, {self.world_size}), got {src}")
        if self.world_size == 1:
            return
        flat = self.module.flat_param
        assert flat is not None
        # torch's broadcast takes a global rank; src is a rank of our group.
        dist.broadcast(flat, self._mesh.global_rank(src), group=self._group)
        _broadcast_buffers(self.module, self._mesh, src)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter materialized and equal on all ranks, inside the block.

        For evaluation, generation, export or ``fm.state_dict()`` in fully sharded
        mode; on exit the units are freed again. Every rank must enter it (it
        gathers). In the other modes the weights are always whole: a no-op.

        Example::

            with trainer.gathered():
                sd = {k: v.clone() for k, v in fm.state_dict().items()}
        """
        self._check_open()
        with torch.no_grad(), self._mode.gathered():
            yield

    @torch.no_grad()
    def all_reduce_parameters(self, op: str = "mean") -> None:
        """Reduce the flat parameter buffer across ranks (``mean``, ``sum``, ``max`` or ``min``).

        Example::

            if step % 100 == 0:          # local SGD: average the weights now and then
                trainer.all_reduce_parameters()
        """
        self._check_open()
        _not_full(self._mode, self.shard, "all_reduce_parameters()")
        flat = self.module.flat_param
        assert flat is not None
        for typed in self.module.layout.typed(flat):  # each dtype apart
            all_reduce_flat(typed, op, self._mesh, self._mean_op)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged gradient to a total norm of ``max_norm``; returns the norm before.

        One norm over all parameters, as ``torch.nn.utils.clip_grad_norm_``
        computes it; in sharded mode the global norm over every rank's slice.
        Averages the gradients first if that has not happened since backward.
        """
        self._check_open()
        if not self._reducer.averaged:
            self.average_gradients()
        clip = clip_grad_norm if self.module.tp is None else clip_tp
        return clip(self._mode, self._ctx, max_norm, norm_type, error_if_nonfinite)

    # -- optimizer (both modes; required in sharded mode) ------------------------------------
    def make_optimizer(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        groups: list[GroupRule] | None = None,
        **defaults: Any,
    ) -> torch.optim.Optimizer:
        """Build an elementwise optimizer over what this rank updates.

        Replicated: every trainable parameter. Sharded: the pieces of the
        rank's slice (a parameter that straddles two slices is updated in two
        pieces, by two ranks). ``groups`` puts parameters into param groups
        by name: the first predicate that matches a parameter's name picks the
        group's overrides; the rest go to a default group (group 0).

        Example::

            no_decay = lambda name: name.endswith("bias") or ".ln" in name
            opt = trainer.make_optimizer(
                torch.optim.AdamW, lr=3e-4, weight_decay=0.1,
                groups=[(no_decay, {"weight_decay": 0.0})],
            )
            for x, y in data:
                trainer.zero_grad()
                loss_fn(fm(x), y).backward()
                trainer.step()
        """
        self._check_open()
        if self._optimizer is not None:
            raise TorchShardError("make_optimizer: this trainer already has an optimizer")
        segments = self._mode.optimizer_tensors(self._ctx)
        param_groups, self.group_names = group_params(
            self.module.layout, self._ctx.trainable, segments, list(groups or []), self.device
        )
        self._optimizer = optimizer_class(param_groups, **defaults)
        return self._optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer built by :meth:`make_optimizer` (``None`` before)."""
        return self._optimizer

    def optimizer_segments(self) -> list[Segment]:
        """``(slot, start, end, tensor)`` for each tensor :meth:`make_optimizer` handed to the optimizer.

        ``[start, end)`` is the tensor's range of the flat buffer (a whole
        parameter, or in sharded mode the part in this rank's slice).
        """
        return self._mode.optimizer_tensors(self._ctx)

    @torch.no_grad()
    def step(self, scaler: torch.amp.GradScaler | None = None) -> None:
        """Average (reduce) the gradients if not done yet, step the optimizer, and in sharded
        mode write the updated slice back, all-gather every rank's slice, and drop the
        module's full-size ``.grad`` (so ``optimizer.zero_grad()`` suffices, as usual).

        ``scaler``: a ``torch.amp.GradScaler`` (fp16): unscales first unless
        :meth:`unscale_` did, and steps through it, so that every rank skips the step when
        any rank found an inf or NaN. Call ``scaler.update()`` after, as usual.
        """
        self._averaged_for("step()")
        if scaler is None:
            self._optimizer.step()
        else:
            if not agreed_inf(scaler, self._optimizer):
                self.unscale_(scaler)
            scaler.step(self._optimizer)  # type: ignore[arg-type]
        before = self._mode.bytes_gathered
        self._mode.after_step(self._ctx)
        self.stats.bytes_gathered += self._mode.bytes_gathered - before
        self._reducer.averaged = False

    @torch.no_grad()
    def unscale_(self, scaler: torch.amp.GradScaler) -> None:
        """``scaler.unscale_(optimizer)`` on every rank at once: each rank checks the gradients
        it holds (its slice or stripes when sharded) and the ranks agree, so an inf or NaN
        that any rank finds makes every rank skip :meth:`step` and lower the scale. A lossy
        :attr:`comm`'s error feedback forgets an overflow (it holds the inf too) and follows
        the scale from step to step.

        Example::

            scaler = torch.amp.GradScaler("cuda")
            for x, y in loader:
                trainer.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = loss_fn(fm(x), y)
                scaler.scale(loss).backward()
                trainer.unscale_(scaler)          # before clipping the true gradient
                trainer.clip_grad_norm_(1.0)
                trainer.step(scaler)              # skipped on every rank after an overflow
                scaler.update()
        """
        self._averaged_for("unscale_()")
        scaler.unscale_(self._optimizer)
        found = agree_on_inf(scaler, self._optimizer, self._mesh, self.device)
        if found is not None:  # a lossy comm's error forgets an overflow, follows the scale
            comm_unscaled(self._reducer, scaler, found)

    def gather_slices(self) -> None:
        """After this rank's part was changed other than by :meth:`step` (e.g. by a load):
        ``shard=True`` copies the master slice into the flat buffer and all-gathers every
        rank's slice; ``shard="full"`` gathers the units materialized now again from the
        stripes; otherwise nothing. Every rank calls it."""
        self._mode.gather(self._ctx)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients: the next backward writes into the flat gradient afresh."""
        self.module.zero_grad(set_to_none=set_to_none)
        self._mode.zero_grad()
        self._reducer.averaged = False

    def refresh_master(self) -> None:
        """Sharded mixed precision: copy the rank's slice of the weights into the master copy
        (after the weights were changed other than by :meth:`step`, e.g. by a load)."""
        self._mode.refresh_master(self._ctx)

    def memory_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds: ``parameters``, ``gradients``, ``optimizer`` state, ``master``
        (persistent), and ``transient``: unit buffers allocated now (``shard="full"``; else 0).

        ``optimizer`` counts the state of :meth:`make_optimizer`'s optimizer and the state
        any other optimizer keeps for this trainer's tensors (``fm.parameters()``, those of
        :meth:`optimizer_segments`, ``fm.flat_param``), from its first step on: a
        process-wide post-step hook remembers every ``torch.optim.Optimizer`` that steps,
        weakly (before its first step an optimizer has no state). Pass ``optimizer`` to
        count one that has state without having stepped (after ``load_state_dict``), or one
        that is no ``torch.optim.Optimizer`` (torch runs no hooks for it); one that holds
        none of this trainer's tensors raises :class:`TorchShardError`.

        Example::

            opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)   # not make_optimizer's
            ...                                                  # after a step
            m = trainer.memory_bytes()                           # m["optimizer"] counts it
            print(sum(m.values()) / 2**20, "MiB")
        """
        mine = [*self._params, *(t for *_, t in self._mode.optimizer_tensors(self._ctx))]
        if self.module.flat_param is not None:
            mine.append(self.module.flat_param)
        opt = held_state_bytes(self._optimizer, optimizer, mine)
        return self._mode.memory(self._ctx, opt)

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryStats:
        """:meth:`memory_bytes` as a :class:`MemoryStats`, with the peak of ``transient``
        since construction or :meth:`reset_peak_memory`.

        Example::

            trainer.reset_peak_memory()
            trainer.step()
            stats = trainer.memory_stats()
            print(stats.persistent, stats.peak_transient)
        """
        m = self.memory_bytes(optimizer)
        return MemoryStats(**m, peak_transient=max(self._mode.peak_transient, m["transient"]))

    def reset_peak_memory(self) -> None:
        """Start ``memory_stats().peak_transient`` again from what is held now (as
        ``torch.cuda.reset_peak_memory_stats`` does for the allocator).

        Example::

            trainer.reset_peak_memory()   # measure one step's peak only
        """
        self._mode.reset_peak()

    @property
    def units(self) -> tuple[Unit, ...]:
        """The units a fully sharded trainer gathers one at a time (``()`` in the other
        modes): what :func:`torchshard.plan_memory` takes as ``units=``.

        Example::

            plan = torchshard.plan_memory(fm.layout, world, shard="full", units=trainer.units)
        """
        return tuple(self._mode.units)

    def local_shards(self) -> LocalShards | None:
        """What this rank's optimizer updates of the flat buffer: its runs of the flat
        buffer and where they lie in the tensor (``None``: every rank holds every weight).

        Example::

            shards = trainer.local_shards()
            mine = sum(end - start for start, end, _ in shards.runs) if shards else 0
        """
        return self._mode.local_shards(self._ctx)

    def after_load(self) -> None:
        """A load wrote the weights (the flat buffer or :meth:`local_shards`' tensor):
        gather the units that are materialized now again (``shard="full"``; a collective
        then, every rank calls it). The checkpoint layer calls it."""
        self._mode.after_load(self._ctx)

    def check_collective_order(self) -> None:
        """Raise :class:`RankMismatchError` on every rank if the ranks issued different
        sequences of gathers and reductions so far (``shard="full"``; a debug check, one
        small exchange; the other modes launch in a fixed bucket order and pass).

        Example::

            trainer.step()
            trainer.check_collective_order()   # e.g. after the first steps of a new model
        """
        self._check_open()
        check_same_order(self._mode.order_digest(), self._group, self.device)

    @torch.no_grad()
    def assert_in_sync(self) -> None:
        """Raise :class:`RankMismatchError` on every rank if any rank's weights differ.

        Compares a bitwise checksum per parameter and module buffer, and names
        the first one that differs and the ranks that hold other values.
        """
        self._check_open()
        with self.gathered():
            assert_in_sync(self.module, self._group, self.device, self.world_size, self._params)
            tp_in_sync(self.module, self.device, self._params)  # what tp ranks replicate

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Finish communication in flight, wait until every rank of the group has closed
        too, then stop the heartbeat and destroy the groups the trainer created.
        Idempotent; every rank calls it (the exit hook does, for a trainer never closed).

        A rank that waited :data:`torchshard._exit.EXIT_TIMEOUT` seconds (60) for the
        others leaves anyway, with a warning naming them. The default process group, if
        :func:`init_distributed` created it, stays until interpreter exit (or your own
        ``dist.destroy_process_group()``, which works after ``close()``).

        Example::

            trainer.close()
            dist.destroy_process_group()   # optional: torchshard does it at exit
        """
        self._close(failed=False)

    def _close(self, *, failed: bool) -> None:
        """``failed``: leaving on an exception (which a peer may not share): skip the waits
        and the agreement, which could hang on peers stuck in a collective; only stop the
        threads."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        untrack(self)
        allow(getattr(self, "_params", ()))
        mode = getattr(self, "_mode", None)  # None too when construction failed half-way
        teardown(
            self.module,
            getattr(self, "_reducer", None),
            getattr(self, "_coordinator", None),
            mode.own_groups() if mode is not None else (),
            getattr(self, "device", None),
            failed=failed,
        )

    def __enter__(self) -> DistributedTrainer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._close(failed=exc_type is not None)

    def _averaged_for(self, what: str) -> None:
        """Before the optimizer runs: it exists, and the gradients are the mean."""
        self._check_open()
        if self._optimizer is None:
            raise TorchShardError(
                f"{what}: build the optimizer with trainer.make_optimizer() first"
            )
        if not self._reducer.averaged:
            self.average_gradients()

    def _check_open(self) -> None:
        if self._closed:
            raise TorchShardError("the trainer is closed; create a new DistributedTrainer")
        if self.module.flat_param is not self._flat:
            raise TorchShardError(
                "the FlatParamModule was bound to another buffer after the trainer was created "
                "(fm.bind(), fm.to(), ...); create the trainer after moving the model"
            )


def grad_pieces(trainer: DistributedTrainer) -> list[tuple[int, torch.Tensor]]:
    """``(layout slot, gradient)`` of each piece ``trainer``'s rank updates (replicated:
    every trainable slot's; sharded: its slice's), for a norm over several trainers.

    Example::

        power = sum(g.norm() ** 2 for _, g in grad_pieces(trainer))
    """
    pieces = trainer._mode.optimizer_tensors(trainer._ctx)
    return [(slot, t.grad) for slot, _, _, t in pieces if t.grad is not None]


def _broadcast_buffers(fm: FlatParamModule, mesh: Mesh1D, src: int) -> None:
    if mesh.size > 1:
        for b in fm.module.buffers():
            dist.broadcast(b, mesh.global_rank(src), group=mesh.group)


def _check_comm(
    comm: object, t: DistributedTrainer, fm: FlatParamModule, reduce_dtype: torch.dtype | None
) -> Comm:
    """``comm=`` checked against the trainer's mode, group and dtypes (every rank alike)."""
    mode = t._mode
    return check_comm(
        comm,
        kinds=mode.comm_kinds,
        refusal=mode.comm_refusal,
        shard=t.shard,
        replicas=1 if t._across is None else t._across.size,
        world_size=t.world_size,
        dtypes=fm.dtypes,
        reduce_dtype=reduce_dtype,
        tp=fm.tp.size if fm.tp is not None else 1,
    )


def _log_start(t: DistributedTrainer) -> None:
    logger.info(
        "DistributedTrainer: rank %d of %d on %s, %d parameters in %d %s(s), comm=%r",
        t.rank,
        t.world_size,
        t.device,
        t.module.layout.param_numel,
        t.stats.buckets,
        t._mode.reduces_by,
        t.comm,
    )


def _not_full(mode: Mode, shard: object, what: str) -> None:
    """Refuse ``what`` where the weights are not whole on every rank."""
    if not mode.whole_weights:
        raise TorchShardError(
            f"{what}: not available with shard={shard!r}: each rank holds only its stripes "
            "of the weights (they are the same everywhere by construction); use "
            "`with trainer.gathered():` to see every weight"
        )


def _groups(
    mesh: Mesh | None, process_group: dist.ProcessGroup | None, mode: Mode, shard: object
) -> tuple[dist.ProcessGroup | None, Mesh1D | None, Mesh1D | None]:
    """The trainer's data-parallel group, and the shard and replicate groups of a hybrid
    mode over a mesh with replicas (:func:`split_dp`)."""
    return split_dp(mesh, process_group, sharded=mode.sharded, hybrid=mode.hybrid, shard=shard)


def _pick_mode(
    shard: object,
    master_dtype: torch.dtype,
    units: UnitSpec,
    prefetch: int,
    reshard_after_forward: bool,
) -> tuple[Mode, bool | str]:
    """The parallel mode for ``shard=`` (a choice, or its alias with the loose keywords) and
    what ``trainer.shard`` reports: read once, here, from the registry (``modes.py``)."""
    loose = {"units": units, "prefetch": prefetch, "reshard_after_forward": reshard_after_forward}
    choice = choose(shard, strict=True, master_dtype=master_dtype, **loose)
    entry = entry_for(choice)
    return entry.build(choice), entry.alias
