"""The comm choices: what ``DistributedTrainer(comm=...)`` takes, one frozen dataclass each.

The one place a comm is named. A choice is user-facing configuration; the
:class:`~torchshard._parallel.comm.BucketComm` it builds over the trainer's mesh (how a
bucket's bytes travel) is internal. ``kind`` groups the choices by what a mode must offer
for them (:attr:`Mode.comm_kinds`):

- ``"dense"``: :class:`AllReduce`, today's exact mean (the default);
- ``"cast"``: :class:`BF16`, :class:`FP16`, a lower-precision wire;
- ``"star"``: :class:`Star`, reduce to one rank, then from there to every rank;
- ``"compress"``: :class:`PowerSGD`, :class:`TopK`, lossy, with error feedback over whole
  parameters of replicated buckets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .buckets import Bucket
from .comm import BucketComm, CommError, ReduceSpec, ReduceToOwner
from .feedback import ErrorFeedback
from .powersgd import PowerSGDComm
from .star import StarComm
from .topk import TopKComm

__all__ = [
    "BF16",
    "FP16",
    "AllReduce",
    "Comm",
    "CommError",
    "PowerSGD",
    "Star",
    "TopK",
    "build_comm",
    "check_comm",
    "comm_spec",
    "comm_state",
    "load_comm_state",
    "lossless",
    "reset_comm_error",
]


def _int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CommError(f"{name}: expected an int >= {low}, got {value!r}")


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class AllReduce:
    """Every bucket all-reduced at full precision: the exact mean (the default).

    Example::

        trainer = torchshard.DistributedTrainer(fm, comm=torchshard.comm.AllReduce())
    """

    kind: ClassVar[str] = "dense"


@dataclass(frozen=True)
class BF16:
    """Gradients travel as bfloat16: each bucket cast, multiplied by ``1 / world_size``
    before it travels (a sum never overflows), summed in bfloat16 and written back in the
    gradient's dtype, as DDP's ``bf16_compress_hook``. Half the bytes of float32; no
    residual is kept.

    Example::

        trainer = torchshard.DistributedTrainer(fm, comm=torchshard.comm.BF16())
    """

    kind: ClassVar[str] = "cast"
    wire: ClassVar[torch.dtype] = torch.bfloat16


@dataclass(frozen=True)
class FP16:
    """Gradients travel as float16, pre-divided as :class:`BF16` (float16 tops out at
    65504; a gradient above ``65504`` in magnitude, or below about ``6e-8 * world_size``,
    does not survive the cast: prefer :class:`BF16`).

    Example::

        trainer = torchshard.DistributedTrainer(fm, comm=torchshard.comm.FP16())
    """

    kind: ClassVar[str] = "cast"
    wire: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True)
class Star:
    """Each bucket reduced to one rank, ``root``, then sent from there: broadcast to every
    rank (``shard=False``) or sent to the owner of its slice (``shard=True``). The
    parameter-server topology; exact, but the root moves ``world_size - 1`` times the bytes
    of any other rank.

    Example::

        trainer = torchshard.DistributedTrainer(fm, comm=torchshard.comm.Star(root=0))
    """

    root: int = 0
    """The aggregating rank, a rank of the trainer's (data-parallel) group."""
    kind: ClassVar[str] = "star"

    def __post_init__(self) -> None:
        _int("Star(root=...)", self.root, 0)


@dataclass(frozen=True)
class PowerSGD:
    """Low-rank gradient compression with error feedback and a warm-started ``Q`` (Vogels
    et al., NeurIPS 2019; torch's ``powerSGD_hook``). Each matrix parameter's gradient plus
    its error, ``M`` (viewed as ``shape[0] x rest``), is approximated as ``P Q^T`` with two
    all-reduces (``P = M Q``, orthogonalized; ``Q = M^T P``); the rest of ``M`` is kept as
    the error for the next step. ``shard=False`` only.

    Example::

        comm = torchshard.comm.PowerSGD(rank=4, start_step=100)
        trainer = torchshard.DistributedTrainer(fm, comm=comm)
    """

    rank: int = 4
    """The rank ``r`` of the approximation (of each matrix: at most its smaller side)."""
    start_step: int = 10
    """Synchronized steps (``average_gradients()`` calls) all-reduced densely first; torch
    advises at least the warm-up, or 10% of the run."""
    min_compression: float = 2.0
    """A matrix ``n x m`` is compressed only if ``n * m > min_compression * (n + m) * r``;
    the others, and every vector, travel densely."""
    kind: ClassVar[str] = "compress"

    def __post_init__(self) -> None:
        _int("PowerSGD(rank=...)", self.rank, 1)
        _int("PowerSGD(start_step=...)", self.start_step, 0)
        if not _real(self.min_compression) or self.min_compression < 1:
            raise CommError(
                f"PowerSGD(min_compression=...): expected a number >= 1, got "
                f"{self.min_compression!r}"
            )


@dataclass(frozen=True)
class TopK:
    """Experimental: each rank sends the ``ratio`` largest entries (in magnitude) of each
    bucket's gradient plus its error, and keeps the rest as error for the next step; the
    ranks all-gather every rank's values and indices and sum them. ``shard=False`` only, and
    no tensor parallelism (``tp=1``).

    Error feedback wants a dense start (Lin et al., ICLR 2018, "warm-up training"): what the
    first steps do not send, many times the size of later gradients, would otherwise crowd
    out the current ones for about ``1 / ratio`` steps. ``start_step=0`` compresses from the
    first step, as the systems this project grew from describe it.

    Example::

        trainer = torchshard.DistributedTrainer(fm, comm=torchshard.comm.TopK(ratio=0.01))
        comm = torchshard.comm.TopK(ratio=0.01, start_step=30)   # dense for 30 steps first
    """

    ratio: float = 0.01
    """The fraction of each bucket's entries sent, in (0, 1] (at least one entry)."""
    error_feedback: bool = True
    """Keep what was not sent for the next step (``False``: drop it, for comparison)."""
    start_step: int = 0
    """Synchronized steps (``average_gradients()`` calls) all-reduced densely first, as
    :attr:`PowerSGD.start_step`; with error feedback, start later than the first steps
    (on the example, 30 of 300 steps: ``docs/compression.md``)."""
    kind: ClassVar[str] = "compress"

    def __post_init__(self) -> None:
        if not _real(self.ratio) or not 0 < self.ratio <= 1:
            raise CommError(f"TopK(ratio=...): expected a number in (0, 1], got {self.ratio!r}")
        if not isinstance(self.error_feedback, bool):
            raise CommError(
                f"TopK(error_feedback=...): expected True or False, got {self.error_feedback!r}"
            )
        _int("TopK(start_step=...)", self.start_step, 0)


Comm = AllReduce | BF16 | FP16 | Star | PowerSGD | TopK
"""What ``DistributedTrainer(comm=...)`` takes."""

_CHOICES = (AllReduce, BF16, FP16, Star, PowerSGD, TopK)
_LOSSLESS = (AllReduce, Star)  # the result is exact and reaches where the mean is kept


def lossless(comm: object) -> bool:
    """Whether ``comm`` delivers the exact sum (so the used-parameter mask may ride in a
    bucket): the default (``None``), :class:`AllReduce` and :class:`Star`.

    Example::

        lossless(BF16())   # False: the mask travels on its own, as int32
    """
    return comm is None or isinstance(comm, _LOSSLESS)


def check_comm(
    comm: object,
    *,
    kinds: frozenset[str],
    refusal: str,
    shard: object,
    replicas: int,
    world_size: int,
    dtypes: tuple[torch.dtype, ...],
    reduce_dtype: torch.dtype | None,
    tp: int = 1,
) -> Comm:
    """``comm`` (``None``: :class:`AllReduce`) checked against the mode (``kinds`` it
    offers; ``refusal``: why it offers no others), its replicas, the group's size, the
    gradients' dtypes, ``reduce_dtype`` and the tensor-parallel degree ``tp``;
    :class:`CommError` otherwise. Pure: every rank given the same arguments raises alike.

    Example::

        check_comm(TopK(), kinds=frozenset({"dense"}), refusal="...", shard=True, replicas=1,
                   world_size=2, dtypes=(torch.float32,), reduce_dtype=None)   # raises
    """
    if comm is None:
        return AllReduce()
    if not isinstance(comm, _CHOICES):
        names = ", ".join(f"{c.__name__}()" for c in _CHOICES)
        raise CommError(
            f"comm: expected one of torchshard.comm's {names}, got {comm!r}; e.g. "
            "comm=torchshard.comm.BF16()"
        )
    kind = comm.kind
    if kind not in kinds:
        raise CommError(f"comm={comm!r}: not available with shard={shard!r}: {refusal}")
    if kind == "star" and replicas > 1:
        raise CommError(
            f"comm={comm!r}: not available with hybrid sharding ({replicas} replicas): a bucket "
            "is reduced in its shard group, then across replicas; use a mesh with "
            "dp_replicate=1, or the default comm"
        )
    if isinstance(comm, Star) and comm.root >= world_size:
        raise CommError(
            f"Star(root=...): expected a rank in [0, {world_size}) of the trainer's group, "
            f"got {comm.root}"
        )
    if kind in ("cast", "compress") and reduce_dtype is not None:
        raise CommError(
            f"reduce_dtype={reduce_dtype}: comm={comm!r} decides the dtype gradients travel "
            "in; leave reduce_dtype=None"
        )
    if isinstance(comm, TopK) and tp > 1:
        raise CommError(
            f"comm={comm!r}: not available with tensor parallelism (tp={tp}): each tp rank "
            "picks its entries over a bucket that mixes split and replicated parameters, so "
            "the tp ranks would update the replicated ones differently; use PowerSGD (which "
            "compresses each matrix apart) or a dense comm"
        )
    if kind == "compress" and (len(dtypes) != 1 or dtypes[0] not in _COMPRESSED):
        got = ", ".join(str(d) for d in dtypes)
        raise CommError(
            f"comm={comm!r}: gradients of dtype {got}: expected one of float32 or float64 "
            "(the error feedback is kept in the gradient's dtype); use a float32 model, or "
            "BF16() to halve the bytes of a low-precision one"
        )
    return comm


_COMPRESSED = (torch.float32, torch.float64)


def comm_spec(
    comm: Comm,
    world_size: int,
    dtypes: tuple[torch.dtype, ...],
    native: dist.ReduceOp.RedOpType | None,
    *,
    prefer_pre: bool,
    wire: torch.dtype | None,
) -> ReduceSpec:
    """The division policy (:meth:`ReduceSpec.of`) for ``comm``: a cast comm travels in its
    dtype, multiplied by ``1 / world_size`` first and summed (never a native average: the
    same rounding on every backend); the others as :meth:`ReduceSpec.of` decides.

    Example::

        comm_spec(BF16(), 2, (torch.float32,), None, prefer_pre=False, wire=None)
        # ReduceSpec(op=SUM, dtype=torch.bfloat16, pre=0.5, post=1.0)
    """
    if isinstance(comm, (BF16, FP16)):
        if world_size == 1:
            return ReduceSpec(dist.ReduceOp.SUM)
        cast = None if all(d == comm.wire for d in dtypes) else comm.wire
        return ReduceSpec(dist.ReduceOp.SUM, cast, pre=1.0 / world_size)
    return ReduceSpec.of(world_size, dtypes, native, prefer_pre=prefer_pre, wire=wire)


def build_comm(comm: Comm, ctx: Any, buckets: tuple[Bucket, ...], dense: BucketComm) -> BucketComm:
    """The :class:`BucketComm` ``comm`` asks for over the trainer's context ``ctx``
    (:class:`~torchshard._parallel.seam.Context`), given ``dense``: the one the mode
    builds for itself (all-reduce, or reduce to the owner of a slice), which the default
    and the cast comms use as it is (the cast is in the spec).

    Example::

        bucket_comm = build_comm(PowerSGD(rank=4), ctx, buckets, AllReduce(ctx.mesh))
    """
    if isinstance(comm, Star):
        if isinstance(dense, ReduceToOwner):  # a sharded mode: the root sends each to its owner
            owner: Callable[[Bucket], int] | None = dense.owner
            return StarComm(ctx.mesh, comm.root, owner, dense.sink)
        return StarComm(ctx.mesh, comm.root)
    if isinstance(comm, PowerSGD):
        return PowerSGDComm(ctx, buckets, dense, comm.rank, comm.start_step, comm.min_compression)
    if isinstance(comm, TopK):
        return TopKComm(ctx, buckets, dense, comm.ratio, comm.error_feedback, comm.start_step)
    return dense


def _feedback(sync: object) -> ErrorFeedback | None:
    comm = getattr(sync, "comm", None)  # a bucket reducer's; the unit mode's has none
    return comm if isinstance(comm, ErrorFeedback) else None


def comm_state(sync: object) -> dict[str, torch.Tensor]:
    """The state of the gradient sync ``sync``'s comm (``trainer.comm_state()``): ``{}``
    unless it keeps error feedback.

    Example::

        comm_state(trainer_reducer)["error"].shape == fm.flat_grad.shape
    """
    fb = _feedback(sync)
    return {} if fb is None else fb.state()


def load_comm_state(sync: object, state: dict[str, torch.Tensor]) -> None:
    """``trainer.load_comm_state(state)``: into ``sync``'s comm; a comm without state takes
    only ``{}``.

    Example::

        load_comm_state(trainer_reducer, saved)
    """
    fb = _feedback(sync)
    if fb is None:
        if state:
            raise CommError(
                f"load_comm_state: this trainer's comm keeps no state, got {sorted(state)}; "
                "build the trainer with the comm that saved it, or drop the state"
            )
        return
    fb.load_state(state)


def reset_comm_error(sync: object) -> None:
    """``trainer.reset_comm_error()``: zero ``sync``'s comm's error feedback, if it has one.

    Example::

        reset_comm_error(trainer_reducer)
    """
    fb = _feedback(sync)
    if fb is not None:
        fb.reset_error()


def comm_unscaled(sync: object, scaler: Any, found_inf: torch.Tensor) -> None:
    """``trainer.unscale_(scaler)``, after the ranks agreed on ``found_inf``: an error
    feedback forgets an overflow and follows the loss scale (``ErrorFeedback.unscaled``).

    Example::

        comm_unscaled(trainer_reducer, scaler, torch.zeros(()))
    """
    fb = _feedback(sync)
    if fb is not None:
        fb.unscaled(scaler, found_inf)
