"""The seam between the trainer's mode-free core and a parallel mode.

The core (``DistributedTrainer``) binds the buffers, checks that every rank built
the same model, launches gradient buckets in the same order on every rank, owns
the guards, the stats and the public methods. A :class:`Mode` owns what differs:
the collective that reduces a bucket, how the mean is finished, what the
optimizer updates, and what happens after its step. ``shard=`` picks a mode once,
at construction (:func:`pick_mode`); adding a mode is adding a file and a line there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._flat.geometry import Geometry
from .._flat.module import FlatParamModule
from .buckets import Bucket
from .shards import LocalShards
from .units import Unit

__all__ = ["Context", "Mode", "Segment"]

Segment = tuple[int, int, int, torch.Tensor]
"""``(slot, start, end, tensor)``: a tensor the optimizer updates, and its flat range."""


@dataclass(frozen=True)
class Context:
    """What a mode may use of the trainer: the module, the group and the buffer's geometry."""

    fm: FlatParamModule
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    geometry: Geometry
    params: tuple[torch.nn.Parameter, ...]
    """The module's parameters (views of the flat buffer), by slot."""
    trainable: tuple[int, ...]
    """Slot indices of the parameters that require grad."""
    divide_first: bool
    """Scale each bucket by ``1/world_size`` before reducing it (float16, where a sum over
    ranks would overflow, or a mode that prefers it; never with ``mean_op``)."""
    mean_op: dist.ReduceOp | None = None
    """``ReduceOp.AVG`` when the backend averages natively (NCCL): no division pass after."""

    @property
    def divides_after(self) -> bool:
        """The reduced gradient is a sum that the mode must still divide by the world size."""
        return self.world_size > 1 and not self.divide_first and self.mean_op is None

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    @property
    def flat(self) -> torch.Tensor:
        assert self.fm.flat_param is not None
        return self.fm.flat_param

    @property
    def grad(self) -> torch.Tensor:
        assert self.fm.flat_grad is not None
        return self.fm.flat_grad


class Mode:
    """A parallel mode. The core calls these, in this order:

    1. ``pads`` and ``mask_elements`` size the buffers; ``bind(store, k)`` gets them.
    2. ``bucket_cuts`` adds bucket boundaries; ``setup(ctx, buckets)`` builds the mode's state.
    3. Per step: ``launch`` once per bucket, in bucket order (during backward); then
       ``sent_mask`` and ``finish`` in ``average_gradients``; ``attach_grads``;
       ``local_grad`` for ``clip_grad_norm_``; ``after_step`` after the optimizer's step.
    """

    sharded: bool = False
    """Optimizer state for this rank's slice only (``trainer.shard``)."""
    pads: bool = False
    """The buffer is padded so that every rank's slice has the same length."""
    norm_is_partial: bool = False
    """``local_grad`` is this rank's part only: the norm is summed across ranks."""
    owns_buffers: bool = False
    """The mode binds the module itself (:meth:`prepare`, :meth:`adopt`) instead of one flat
    buffer, and reduces through its own reducer (:meth:`own_reducer`)."""
    whole_weights: bool = True
    """Every rank holds every weight (``broadcast`` and ``all_reduce_parameters`` apply)."""
    label: str = ""
    """What ``trainer.shard`` reports when it is not a plain bool."""
    reduces_by: str = "bucket"
    """What one reduction covers, for the log: ``stats.buckets`` counts these."""
    bytes_gathered: int = 0
    """Bytes of weights all-gathered so far (at the full buffer's size)."""
    units: tuple[Unit, ...] | list[Unit] = ()
    """The units the mode gathers and frees one at a time (``shard="full"``)."""
    peak_transient: int = 0
    """The most transient bytes held at once since construction or :meth:`reset_peak`."""
    divides_first: bool = False
    """Without a native average, scale each bucket by ``1/world_size`` as it launches
    (DDP's order: the bucket is warm, the pass overlaps backward, none is left after)."""

    # -- a mode that binds the module itself (owns_buffers) -----------------------------------
    def prepare(self, fm: FlatParamModule) -> None:
        """Plan from the module alone, before the ranks compare models (fingerprint)."""

    def adopt(
        self,
        fm: FlatParamModule,
        device: torch.device,
        group: dist.ProcessGroup | None,
        src: int,
        init_fn: Callable[[torch.nn.Module], None] | None,
    ) -> tuple[torch.nn.Parameter, ...]:
        """Bind ``fm`` to the mode's own storage, weights as ``src`` holds them; the params."""
        raise NotImplementedError

    def own_reducer(self) -> Any:
        """The reducer the trainer uses instead of the bucket reducer (``None``: that one)."""
        return None

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

    # -- buffers and buckets ----------------------------------------------------------------------
    def mask_elements(self, n_trainable: int, world_size: int, align: int) -> int:
        """Elements to reserve just before the flat gradient for the used-parameter mask."""
        return 0

    def bind(self, store: torch.Tensor, k: int, n_trainable: int) -> None:
        """``store`` is ``[mask (k elements) | gradient]``, when the core allocated it."""

    def bucket_cuts(self, ctx: Context) -> tuple[int, ...]:
        return ()

    def setup(self, ctx: Context, buckets: tuple[Bucket, ...]) -> None:
        """Build the mode's state, once the buffers hold the broadcast weights."""

    def launch(self, ctx: Context, bucket: Bucket, view: torch.Tensor) -> dist.Work:
        """Start reducing ``view`` (the bucket's gradient, pre-divided if ``divide_first``).

        Called during backward, on the autograd thread: no host synchronization here.
        """
        raise NotImplementedError

    def sent_mask(self) -> torch.Tensor | None:
        """The used-parameter mask if it rode in a bucket this step (else the core sends one)."""
        return None

    def finish(self, ctx: Context) -> None:
        """After every bucket's reduction completed: make the gradient the mean."""
        raise NotImplementedError

    def optimizer_tensors(self, ctx: Context) -> list[Segment]:
        """What the optimizer updates, one entry per trainable slot (or piece of one)."""
        slots = ctx.fm.layout.slots
        return [(i, slots[i].offset, slots[i].end, ctx.params[i]) for i in ctx.trainable]

    def attach_grads(self, ctx: Context, used: dict[int, bool]) -> None:
        """Give the optimizer's tensors their gradients (``used``: slot -> any rank used it)."""

    def local_grad(self, ctx: Context) -> torch.Tensor | None:
        """The gradient ``clip_grad_norm_`` measures and scales on this rank."""
        return ctx.fm.flat_grad

    def after_step(self, ctx: Context) -> None:
        """After ``optimizer.step()``."""

    def zero_grad(self) -> None:
        """Forget the gradients of the optimizer's own tensors."""

    def gather(self, ctx: Context) -> None:
        """Make every rank's weights whole again after the optimizer changed its part."""

    def fingerprint(self) -> str:
        """Compared across ranks at construction: ranks must agree on the buffers' shape."""
        return "-"

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
