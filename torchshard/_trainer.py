"""DistributedTrainer: one flat buffer per rank, gradients averaged in buckets during backward."""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._buckets import Bucket, plan_buckets
from ._dist import Coordinator, destroy_owned_group, exchange_bytes, init_distributed
from ._errors import RankMismatchError, TorchShardError
from ._flat_module import FlatParamModule
from ._layout import FlatLayout
from ._log import get_logger
from ._parallel.mode import Context, Mode, Segment
from ._parallel.replicated import Replicated
from ._parallel.sharded import ShardedOptimizer
from ._reshard import Geometry

__all__ = ["CommStats", "DistributedTrainer"]

logger = get_logger(__name__)

_REDUCE_OPS = {
    "mean": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


@dataclass
class CommStats:
    """Counters of the gradient communication (for logs and tests)."""

    steps: int = 0
    """``average_gradients()`` calls so far."""
    buckets: int = 0
    """Buckets that carry gradients."""
    launched_during_backward: int = 0
    """Buckets of the last step whose all-reduce started inside backward."""
    wait_seconds: float = 0.0
    """Total time ``average_gradients()`` spent waiting for communication."""


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
        bucket_mb: bucket size in MiB; fractions allowed.
        src: the rank whose weights everyone starts from.
        init_fn: how to initialize a meta-built model, as in
            :meth:`FlatParamModule.init_weights` (default: ``reset_parameters()``).
        shard: FSDP-lite: each rank owns one contiguous, equal slice of the
            (padded) flat buffer; gradients are reduced to the slice's owner
            bucket by bucket during backward, the optimizer built by
            :meth:`make_optimizer` keeps state for the rank's slice only, and
            :meth:`step` all-gathers the updated slices.
        master_dtype: sharded mode with a lower-precision flat buffer (e.g.
            bf16): the optimizer updates a copy of the rank's slice in this dtype.

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
        bucket_mb: float = 25,
        src: int = 0,
        init_fn: Callable[[torch.nn.Module], None] | None = None,
        shard: bool = False,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        if not isinstance(fm, FlatParamModule):
            raise TorchShardError(
                f"fm: expected a torchshard.FlatParamModule, got {type(fm).__name__}; "
                "wrap the model first: FlatParamModule(model)"
            )
        if not bucket_mb > 0:
            raise TorchShardError(f"bucket_mb: expected a positive size, got {bucket_mb}")
        if process_group is None:
            init_distributed()
        self._group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if not 0 <= src < self.world_size:
            raise TorchShardError(f"src: expected a rank in [0, {self.world_size}), got {src}")
        self.module = fm
        self.device = self._pick_device(fm, device)
        self._mode = _pick_mode(shard, master_dtype)  # the one place modes are chosen
        self.shard = self._mode.sharded
        layout = fm.layout
        self._geometry = Geometry.of(layout, self.world_size, pad=self._mode.pads)
        self.padded_numel = self._geometry.total
        self._bind(fm, init_fn)
        self._flat = fm.flat_param
        self._closed = False
        self._coordinator: Coordinator | None = None
        self._check_same_model(src)
        unwritten = fm.unwritten_buffers()  # the same on every rank: the same model and init
        self.broadcast(src)
        fm._still_unwritten(unwritten)  # src's zeros are no value: check at the first forward

        self._params = tuple(p for _, p in fm.named_flat_views())
        self._trainable = tuple(i for i, s in enumerate(layout.slots) if s.requires_grad)
        # float16 tops out at 65504: a sum over ranks overflows where the mean would not,
        # so divide before reducing (as DDP does). bf16 and fp32 keep divide-after (exact
        # for a power-of-two world, and what the bitwise tests against DDP pin).
        self._divide_first = fm.dtype == torch.float16
        self._ctx = Context(
            fm=fm,
            group=self._group,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            geometry=self._geometry,
            params=self._params,
            trainable=self._trainable,
            divide_first=self._divide_first,
        )
        self._buckets: tuple[Bucket, ...] = plan_buckets(
            layout,
            bucket_mb * 2**20,
            total=self.padded_numel,
            cuts=self._mode.bucket_cuts(self._ctx),
        )
        self._mode.setup(self._ctx, self._buckets)
        self._slot_buckets: list[list[int]] = [[] for _ in layout.slots]
        for b in self._buckets:
            for i in b.slots:
                self._slot_buckets[i].append(b.index)
        self._optimizer: torch.optim.Optimizer | None = None
        self._averaged = False
        self._hooks = [
            self._params[i].register_post_accumulate_grad_hook(self._make_hook(i))
            for i in self._trainable
        ]
        self._sync = True
        self._works: list[dist.Work] = []
        self._reset_step()
        self.stats = CommStats(buckets=sum(b.trainable > 0 for b in self._buckets))
        logger.info(
            "DistributedTrainer: rank %d of %d on %s, %d parameters in %d bucket(s)",
            self.rank,
            self.world_size,
            self.device,
            layout.param_numel,
            self.stats.buckets,
        )

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the trainer communicates over (``None``: the default group)."""
        return self._group

    @property
    def coordinator(self) -> Coordinator | None:
        """Store keys private to this trainer's group and run attempt, and the ranks'
        heartbeats (``None`` in a world of one); the checkpoint layer coordinates through it."""
        return self._coordinator

    # -- set-up ---------------------------------------------------------------------
    def _pick_device(self, fm: FlatParamModule, device: torch.device | str | None) -> torch.device:
        if device is not None:
            return torch.device(device)
        if fm.is_bound:
            return fm.device
        if torch.cuda.is_available() and dist.get_backend(self._group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _bind(self, fm: FlatParamModule, init_fn: Callable[[torch.nn.Module], None] | None) -> None:
        n = self.padded_numel
        if fm.is_bound:
            if fm.device != self.device:
                fm.to(self.device)
            flat, grad = fm.flat_param, fm.flat_grad
            assert flat is not None
            if flat.numel() >= n and (grad is None or grad.numel() >= n):
                return
            # Too small for the padded slices: move into buffers that are not.
            big = flat if flat.numel() >= n else torch.zeros(n, dtype=fm.dtype, device=self.device)
            fm.bind(big, torch.zeros(n, dtype=fm.dtype, device=self.device))
            return
        was_meta = any(p.is_meta for p in fm.module.parameters())
        flat = torch.empty(n, dtype=fm.dtype, device=self.device)
        flat[fm.numel :].zero_()  # padding: all-gathered and checkpointed, so defined
        # A mode may keep a few elements just before the gradient (replicated: the
        # used-parameter mask, which then rides in the all-reduce of the bucket at 0).
        n_mask = sum(s.requires_grad for s in fm.layout.slots)
        k = self._mode.mask_elements(n_mask, self.world_size, fm.layout.align)
        store = torch.zeros(k + n, dtype=fm.dtype, device=self.device)
        fm.bind(flat, store[k:])
        self._mode.bind(store, k, n_mask)
        if was_meta:
            fm.init_weights(init_fn)

    def _check_same_model(self, src: int) -> None:
        """Compare the layout (and module buffers) of every rank; raise on all ranks if any differ."""
        layout = self.module.layout
        buffers = [[n, list(b.shape), str(b.dtype)] for n, b in self.module.module.named_buffers()]
        mine = layout.fingerprint() + hashlib.sha256(json.dumps(buffers).encode()).hexdigest()[:32]
        mine += self._mode.fingerprint()
        # The same exchange agrees a token (rank src's) naming this trainer's keys in the
        # store: unique per group and per run attempt, see Coordinator.
        replies = exchange_bytes(
            f"{mine} {secrets.token_hex(8)}".encode(), self._group, self.device
        )
        everyone = [r.decode().split(" ")[0] for r in replies]
        bad = [r for r, fp in enumerate(everyone) if fp != everyone[src]]
        if not bad:
            if self.world_size > 1:
                token = replies[src].decode().split(" ")[1]
                self._coordinator = Coordinator(token, self.rank, self.world_size)
            return
        # Every rank reaches this point (they all saw the same fingerprints), so
        # one more exchange, of the full descriptions, is safe.
        desc = json.dumps({"layout": layout.to_dict(), "buffers": buffers}).encode()
        descs = [json.loads(d) for d in exchange_bytes(desc, self._group, self.device)]
        first = bad[0]
        ref, other = (FlatLayout.from_dict(descs[r]["layout"]) for r in (src, first))
        diff = ref.first_difference(other)
        if diff is None:
            diff = f"module buffers: {descs[src]['buffers']} vs {descs[first]['buffers']}"
        raise RankMismatchError(
            f"ranks {bad} built a different model than rank {src}: first difference (rank {src} "
            f"vs rank {first}): {diff}; every rank must build the same model with the same "
            "FlatParamModule arguments"
        )

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._on_grad_ready(i)

        return hook

    # -- gradient averaging --------------------------------------------------------------
    def _reset_step(self) -> None:
        self._mask_sent = False
        self._ready = [False] * len(self.module.layout)
        self._pending = [b.trainable for b in self._buckets]
        self._next = 0
        self._launched_in_backward = 0

    def _on_grad_ready(self, i: int) -> None:
        self._averaged = False
        if not self._sync:
            return
        if self._ready[i]:
            name = self.module.layout.slots[i].name
            raise TorchShardError(
                f"parameter {name!r} received a second gradient before average_gradients(); "
                "call trainer.average_gradients() after every backward, or accumulate "
                "inside `with trainer.no_sync():`"
            )
        self._ready[i] = True
        for b in self._slot_buckets[i]:
            self._pending[b] -= 1
        # Launch in bucket order only: a collective issued out of order on one
        # rank deadlocks (NCCL) or mixes up buckets (gloo).
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            self._launch(self._buckets[self._next], in_backward=True)
            self._next += 1

    def _launch(self, bucket: Bucket, *, in_backward: bool) -> None:
        if bucket.trainable == 0:
            return
        grad = self.module.flat_grad
        assert grad is not None
        if not in_backward:
            # Parameters without a gradient on this rank contribute zeros.
            for i in bucket.slots:
                if self.module.layout.slots[i].requires_grad and self._params[i].grad is None:
                    s = self.module.layout.slots[i]
                    grad[s.offset : s.end].zero_()
        if self.world_size > 1:
            view = grad[bucket.start : bucket.end]
            if self._divide_first:
                view.div_(self.world_size)
            self._works.append(self._mode.launch(self._ctx, bucket, view))
        self._launched_in_backward += in_backward

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
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next], in_backward=False)
            self._next += 1
        used = [self._params[i].grad is not None for i in self._trainable]
        if self.world_size > 1:
            # Which parameters have a gradient anywhere: in a bucket already, or in one
            # small all-reduce, always issued last so the order is the same on every rank.
            mask = self._mode.sent_mask()
            if mask is None:
                mask = torch.tensor(used, dtype=torch.int32, device=self.device)
                self._works.append(dist.all_reduce(mask, group=self._group, async_op=True))
            t0 = time.perf_counter()
            for work in self._works:
                work.wait()
            self.stats.wait_seconds += time.perf_counter() - t0
            used = [bool(n) for n in mask.tolist()]
        self._mode.finish(self._ctx)
        grad = self.module.flat_grad
        assert grad is not None
        globally_used = dict(zip(self._trainable, used))
        for i in self._trainable:
            p = self._params[i]
            if globally_used[i] and p.grad is None:
                s = self.module.layout.slots[i]
                p.grad = grad[s.offset : s.end].view(s.shape)
        self._mode.attach_grads(self._ctx, globally_used)
        self._works.clear()
        self.stats.steps += 1
        self.stats.launched_during_backward = self._launched_in_backward
        self._averaged = True
        self._reset_step()

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
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- other collectives ------------------------------------------------------------------
    @torch.no_grad()
    def broadcast(self, src: int = 0) -> None:
        """Copy ``src``'s flat parameter buffer and module buffers to every rank."""
        self._check_open()
        if not 0 <= src < self.world_size:
            raise TorchShardError(f"src: expected a rank in [0, {self.world_size}), got {src}")
        if self.world_size == 1:
            return
        flat = self.module.flat_param
        assert flat is not None
        # torch's broadcast takes a global rank; src is a rank of our group.
        root = src if self._group is None else dist.get_global_rank(self._group, src)
        dist.broadcast(flat, root, group=self._group)
        for b in self.module.module.buffers():
            dist.broadcast(b, root, group=self._group)

    @torch.no_grad()
    def all_reduce_parameters(self, op: str = "mean") -> None:
        """Reduce the flat parameter buffer across ranks (``mean``, ``sum``, ``max`` or ``min``).

        Example::

            if step % 100 == 0:          # local SGD: average the weights now and then
                trainer.all_reduce_parameters()
        """
        self._check_open()
        if op not in _REDUCE_OPS:
            raise TorchShardError(f"op: expected one of {sorted(_REDUCE_OPS)}, got {op!r}")
        if self.world_size == 1:
            return
        flat = self.module.flat_param
        assert flat is not None
        if op == "mean" and self._divide_first:
            flat.div_(self.world_size)
        dist.all_reduce(flat, op=_REDUCE_OPS[op], group=self._group)
        if op == "mean" and not self._divide_first:
            flat.div_(self.world_size)

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
        if not self._averaged:
            self.average_gradients()
        grad = self._mode.local_grad(self._ctx)
        if grad is None:
            return torch.zeros((), device=self.device)
        norm_type = float(norm_type)
        low = grad.dtype in (torch.bfloat16, torch.float16)  # accumulate those in fp32
        local = torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32 if low else None)
        if self._mode.norm_is_partial and self.world_size > 1:
            if norm_type == float("inf"):
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)
                total = local
            else:
                power = local.pow(norm_type)
                dist.all_reduce(power, group=self._group)
                total = power.pow(1.0 / norm_type)
        else:
            total = local
        if error_if_nonfinite and not torch.isfinite(total):
            raise TorchShardError(
                f"the total gradient norm is {total.item()}; set error_if_nonfinite=False to clip anyway"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grad.mul_(coef.to(grad.dtype))
        return total

    # -- optimizer (both modes; required in sharded mode) ------------------------------------
    def make_optimizer(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        groups: list[tuple[Callable[[str], bool], dict[str, Any]]] | None = None,
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
        rules = list(groups or [])
        layout = self.module.layout

        def group_of(i: int) -> int:
            names = layout.slots[i].names
            for g, (pred, _) in enumerate(rules):
                if any(pred(n) for n in names):
                    return g + 1
            return 0

        members: list[list[torch.Tensor]] = [[] for _ in range(len(rules) + 1)]
        self.group_names = [[] for _ in range(len(rules) + 1)]
        for i in self._trainable:
            self.group_names[group_of(i)].append(layout.slots[i].name)
        for i, _, _, tensor in self._mode.optimizer_tensors(self._ctx):
            members[group_of(i)].append(tensor)
        if not any(members):
            # torch refuses an optimizer without parameters; a rank whose slice
            # holds only padding steps an empty tensor instead.
            members[0].append(torch.nn.Parameter(torch.empty(0, device=self.device)))
        param_groups = [{"params": members[0]}]
        param_groups += [{"params": m, **over} for m, (_, over) in zip(members[1:], rules)]
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
    def step(self) -> None:
        """Average (reduce) the gradients if not done yet, step the optimizer, and in sharded
        mode write the updated slice back, all-gather every rank's slice, and drop the
        module's full-size ``.grad`` (so ``optimizer.zero_grad()`` suffices, as usual)."""
        self._check_open()
        if self._optimizer is None:
            raise TorchShardError("step(): build the optimizer with trainer.make_optimizer() first")
        if not self._averaged:
            self.average_gradients()
        self._optimizer.step()
        self._mode.after_step(self._ctx)
        self._averaged = False

    def gather_slices(self) -> None:
        """Sharded mode: copy the master slice into the flat buffer and all-gather every
        rank's slice (after the slices were changed, e.g. by a load); otherwise nothing."""
        self._mode.gather(self._ctx)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients: the next backward writes into the flat gradient afresh."""
        self.module.zero_grad(set_to_none=set_to_none)
        self._mode.zero_grad()
        self._averaged = False

    def refresh_master(self) -> None:
        """Sharded mixed precision: copy the rank's slice of the weights into the master copy
        (after the weights were changed other than by :meth:`step`, e.g. by a load)."""
        self._mode.refresh_master(self._ctx)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: ``parameters``, ``gradients``, ``optimizer`` state, ``master``."""
        flat, grad = self._flat, self.module.flat_grad
        opt = 0
        if self._optimizer is not None:
            for state in self._optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        opt += v.numel() * v.element_size()
        master = self._mode.master_bytes()
        return {
            "parameters": flat.numel() * flat.element_size(),
            "gradients": 0 if grad is None else grad.numel() * grad.element_size(),
            "optimizer": opt,
            "master": master,
        }

    @torch.no_grad()
    def assert_in_sync(self) -> None:
        """Raise :class:`RankMismatchError` on every rank if any rank's weights differ.

        Compares a bitwise checksum per parameter and module buffer, and names
        the first one that differs and the ranks that hold other values.
        """
        self._check_open()
        names, sums = [], []
        for slot, p in self.module.named_flat_views():
            names.append(slot.name)
            sums.append(_bit_checksum(p))
        for name, b in self.module.module.named_buffers():
            names.append(f"buffer {name}")
            sums.append(_bit_checksum(b))
        mine = torch.tensor(sums, dtype=torch.int64, device=self.device)
        if self.world_size == 1:
            return
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self._group)
        table = torch.stack(everyone).cpu()
        differs = (table != table[0]).any(dim=0).nonzero()
        if len(differs):
            k = int(differs[0])
            odd = [r for r in range(self.world_size) if table[r, k] != table[0, k]]
            raise RankMismatchError(
                f"weights out of sync: {names[k]!r} differs between rank 0 and ranks {odd} "
                f"({len(differs)} of {len(names)} tensors differ); call trainer.broadcast() "
                "to resynchronize, and check that every rank runs the same optimizer steps"
            )

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the hooks, wait for communication in flight, and tear down the process
        group if torchshard initialized it. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._coordinator is not None:
            self._coordinator.close()
        for h in self._hooks:
            h.remove()
        for work in self._works:
            work.wait()
        self._works.clear()
        destroy_owned_group()

    def __enter__(self) -> DistributedTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TorchShardError("the trainer is closed; create a new DistributedTrainer")
        if self.module.flat_param is not self._flat:
            raise TorchShardError(
                "the FlatParamModule was bound to another buffer after the trainer was created "
                "(fm.bind(), fm.to(), ...); create the trainer after moving the model"
            )


def _bit_checksum(t: torch.Tensor, chunk: int = 1 << 20) -> int:
    """A position-weighted sum of the raw bits of ``t`` (equal values give equal sums)."""
    flat = t.detach().reshape(-1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(ints) if flat.dtype != torch.bool else flat.to(torch.int8)
    total = 0
    for start in range(0, bits.numel(), chunk):
        part = bits[start : start + chunk].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + part.numel(), device=part.device) % 65521
        total = (total + int((part * (weights + 1)).sum())) % (1 << 62)
    return total


def _pick_mode(shard: bool, master_dtype: torch.dtype) -> Mode:
    """The parallel mode for ``shard=``: read once, here (a new mode is a file and a line)."""
    if shard is True or shard == 1:
        return ShardedOptimizer(master_dtype)
    if shard is False or shard == 0:
        return Replicated()
    raise TorchShardError(f"shard: expected True or False, got {shard!r}")
