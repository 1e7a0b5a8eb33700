"""What a trainer does once: pick the device, bind the buffers, check that every rank
built the same model (agreeing a store token on the way), and compare weights."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._dist import backend_devices, choose_device, exchange_bytes
from .._errors import LayoutError, RankMismatchError, TorchShardError, and_more
from .._flat.layout import FlatLayout
from .._flat.module import FlatParamModule
from .._flat.views import zero_gaps
from .comm import Mesh1D
from .footprint import master_dtype_for
from .seam import Storage

__all__ = [
    "all_reduce_flat",
    "assert_in_sync",
    "bind_buffers",
    "check_master_dtype",
    "check_reduce_dtype",
    "check_requires_grad",
    "check_same_model",
    "check_same_order",
    "native_mean",
    "pick_device",
    "plain_optimizer_refused",
    "resolve_master_dtype",
]


def pick_device(
    fm: FlatParamModule, device: torch.device | str | None, group: dist.ProcessGroup | None
) -> torch.device:
    """``device`` if given, the bound buffer's device, else :func:`choose_device` from what
    the group can do (its backend config, not its name), ``LOCAL_RANK`` and the module."""
    if device is not None:
        return torch.device(device)
    if fm.is_bound:
        return fm.device
    pg = group if group is not None else dist.group.WORLD
    cuda = torch.cuda.is_available()
    real = [p.device for p in fm.module.parameters() if not p.is_meta]
    local = os.environ.get("LOCAL_RANK")
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    return choose_device(
        backends=backend_devices(dist.get_backend_config(group)),
        cuda_available=cuda,
        device_count=torch.cuda.device_count() if cuda else 0,
        local_rank=int(local) if local is not None else None,
        local_world_size=int(local_world) if local_world is not None else None,
        current=torch.cuda.current_device() if cuda else 0,
        module_device=real[0] if real else None,
        bound=getattr(pg, "bound_device_id", None),
    )


def native_mean(group: dist.ProcessGroup | None, device: torch.device) -> dist.ReduceOp | None:
    """``ReduceOp.AVG`` where the group's backend averages natively on ``device`` (NCCL),
    else ``None`` (gloo has no AVG: sum, then divide)."""
    if device.type != "cuda":
        return None
    backends = backend_devices(dist.get_backend_config(group))
    return dist.ReduceOp.AVG if backends.get("cuda") == "nccl" else None


def bind_buffers(
    fm: FlatParamModule,
    n: int,
    device: torch.device,
    init_fn: Callable[[torch.nn.Module], None] | None,
    room: int = 0,
    grad_n: int | None = None,
) -> torch.Tensor | None:
    """Bind ``fm`` to a weight buffer of ``n`` elements and a gradient buffer of ``grad_n``
    (default ``n``) on ``device`` (initializing a meta-built model), or keep its buffers when
    they are already there and large enough.

    ``room``: elements to keep just before a newly allocated gradient (the reducer's
    used-parameter mask, which then rides in the bucket at 0). Returns that store,
    ``[room | gradient]``, when it has room, else ``None``.

    Example::

        store = bind_buffers(fm, geometry.total, device, None, room=mask_room(fm.layout))
    """
    grad_n = n if grad_n is None else grad_n
    if fm.is_bound:
        if fm.device != device:
            fm.to(device)
        flat, grad = fm.flat_param, fm.flat_grad
        assert flat is not None
        if flat.numel() >= n and (grad is None or grad.numel() >= grad_n):
            return None
        # Too small for the padded slices: move into buffers that are not.
        big = flat if flat.numel() >= n else torch.zeros(n, dtype=fm.dtype, device=device)
        fm.bind(big, torch.zeros(grad_n, dtype=fm.dtype, device=device))
        return None
    grad = fm.layout.grad_layout
    was_meta = any(p.is_meta for p in fm.module.parameters())
    flat = torch.empty(n, dtype=fm.dtype, device=device)
    # alignment gaps and padding: all-gathered and broadcast, so defined (and a buffer
    # that is bitwise the same before a save and after its load)
    zero_gaps(flat, fm.layout, frozen=False)
    flat[fm.numel :].zero_()
    store = torch.zeros(room + grad_n, dtype=fm.dtype, device=device) if grad.slots else None
    fm.bind(flat, store[room:] if store is not None else None)
    if was_meta:
        fm.init_weights(init_fn)
    return store if room and store is not None else None


def check_same_model(
    fm: FlatParamModule,
    mode: Storage,
    group: dist.ProcessGroup | None,
    device: torch.device,
    src: int,
) -> str:
    """Compare the layout (and module buffers) of every rank; raise on all ranks if any differ.

    Returns a token that ``src`` drew, the same on every rank: the name of this trainer's
    keys in the store, unique per group and per run attempt (see ``Coordinator``).
    A world of one has nothing to compare (and no store keys): no collective, ``""``.
    """
    if dist.get_world_size(group) == 1:
        return ""
    layout = fm.layout
    buffers = [[n, list(b.shape), str(b.dtype)] for n, b in fm.module.named_buffers()]
    # the trainer's choices that decide which collectives run: ranks that differ would hang
    options = f"{type(mode).__name__} {mode.fingerprint()} comm={getattr(mode, 'comm', None)!r}"
    mine = layout.fingerprint() + hashlib.sha256(json.dumps(buffers).encode()).hexdigest()[:32]
    mine += hashlib.sha256(options.encode()).hexdigest()[:16]
    replies = exchange_bytes(f"{mine} {secrets.token_hex(8)}".encode(), group, device)
    everyone = [r.decode().split(" ")[0] for r in replies]
    bad = [r for r, fp in enumerate(everyone) if fp != everyone[src]]
    if not bad:
        return replies[src].decode().split(" ")[1]
    # Every rank reaches this point (they all saw the same fingerprints), so
    # one more exchange, of the full descriptions, is safe.
    desc = json.dumps({"layout": layout.to_dict(), "buffers": buffers, "options": options})
    descs = [json.loads(d) for d in exchange_bytes(desc.encode(), group, device)]
    first = bad[0]
    ref, other = (FlatLayout.from_dict(descs[r]["layout"]) for r in (src, first))
    diff = ref.first_difference(other)
    if diff is None and descs[src]["buffers"] == descs[first]["buffers"]:
        raise RankMismatchError(
            f"ranks {bad} built their trainer with other options than rank {src}: "
            f"{descs[first]['options']!r} vs {descs[src]['options']!r}; every rank must pass "
            "the same shard=, comm= and mode options (they decide which collectives run)"
        )
    if diff is None:
        diff = f"module buffers: {descs[src]['buffers']} vs {descs[first]['buffers']}"
    raise RankMismatchError(
        f"ranks {bad} built a different model than rank {src}: first difference (rank {src} "
        f"vs rank {first}): {diff}; every rank must build the same model with the same "
        "FlatParamModule arguments"
    )


@torch.no_grad()
def assert_in_sync(
    fm: FlatParamModule,
    group: dist.ProcessGroup | None,
    device: torch.device,
    world_size: int,
    params: tuple[torch.Tensor, ...],
    *,
    slots: list[int] | None = None,
    what: str = "ranks",
) -> None:
    """Raise :class:`RankMismatchError` on every rank if any rank's weights differ, naming
    the first parameter (``params``: by slot; ``slots``: only those) or buffer that differs
    and the ranks (of ``group``: ``what``) that hold other values."""
    names, sums = [], []
    for i, (slot, p) in enumerate(zip(fm.layout.slots, params)):
        if slots is not None and i not in slots:
            continue
        names.append(slot.name)
        sums.append(_bit_checksum(p))
    for name, b in fm.module.named_buffers():
        names.append(f"buffer {name}")
        sums.append(_bit_checksum(b.to(device)))
    if world_size == 1:
        return
    mine = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()  # the one host read
    differs = (table != table[0]).any(dim=0).nonzero()
    if len(differs):
        k = int(differs[0])
        odd = [r for r in range(world_size) if table[r, k] != table[0, k]]
        raise RankMismatchError(
            f"weights out of sync: {names[k]!r} differs between {what[:-1]} 0 and {what} {odd} "
            f"({len(differs)} of {len(names)} tensors differ); call trainer.broadcast() "
            "to resynchronize, and check that every rank runs the same optimizer steps"
        )


def _bit_checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the raw bits of ``t`` (equal values give equal sums), as a
    0-d int64 tensor on ``t``'s device: computed there, read by the caller once for all."""
    flat = t.detach().reshape(-1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(ints) if flat.dtype != torch.bool else flat.to(torch.int8)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    chunk = 1 << 20  # bounds the int64 temporaries at 16 MiB
    for start in range(0, bits.numel(), chunk):
        part = bits[start : start + chunk].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + part.numel(), device=part.device) % 65521
        total = (total + (part * (weights + 1)).sum()) % (1 << 62)
    return total


_REDUCE_OPS = {
    "mean": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


@torch.no_grad()
def all_reduce_flat(
    flat: torch.Tensor, op: str, mesh: Mesh1D, mean_op: dist.ReduceOp | None
) -> None:
    """Reduce ``flat`` over the mesh in place (``mean``, ``sum``, ``max`` or ``min``); a mean
    by the backend's own average where it has one (``mean_op``), float16 divided first."""
    if op not in _REDUCE_OPS:
        raise TorchShardError(f"op: expected one of {sorted(_REDUCE_OPS)}, got {op!r}")
    if mesh.size == 1:
        return
    if op == "mean" and mean_op is not None:
        dist.all_reduce(flat, op=mean_op, group=mesh.group)
        return
    fp16 = flat.dtype == torch.float16  # a sum could overflow: divide first
    if op == "mean" and fp16:
        flat.div_(mesh.size)
    dist.all_reduce(flat, op=_REDUCE_OPS[op], group=mesh.group)
    if op == "mean" and not fp16:
        flat.div_(mesh.size)


def check_same_order(
    digest: str | None, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Raise :class:`RankMismatchError` on every rank if the ranks' digests of the
    collectives they issued differ (``None``: a mode with one fixed order; nothing to do)."""
    if digest is None or dist.get_world_size(group) == 1:
        return
    everyone = [r.decode() for r in exchange_bytes(digest.encode(), group, device)]
    odd = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if odd:
        raise RankMismatchError(
            f"ranks {odd} issued other collectives than rank 0 (digests per communicator: "
            f"rank 0 {everyone[0]}, rank {odd[0]} {everyone[odd[0]]}); every rank must run "
            "the same modules in the same order (a branch taken on some ranks only?)"
        )


def check_requires_grad(layout: FlatLayout, params: tuple[torch.nn.Parameter, ...]) -> None:
    """Raise :class:`LayoutError` naming the parameters whose ``requires_grad`` changed after
    wrapping: the gradient has room for the parameters that trained then (one that trains
    now would get a gradient nothing reduces; one frozen now, room nothing fills).

    Example::

        check_requires_grad(fm.layout, params)   # before every reduction is finished
    """
    changed = [s.name for s, p in zip(layout.slots, params) if p.requires_grad != s.requires_grad]
    if changed:
        raise LayoutError(
            f"parameters {and_more(changed)}: requires_grad changed after FlatParamModule(model) "
            "laid them out (gradients exist for the parameters that trained then); set "
            "requires_grad before wrapping"
        )


def resolve_master_dtype(layout: FlatLayout, master_dtype: torch.dtype) -> torch.dtype:
    """What a sharded mode keeps the optimizer's part in: ``master_dtype``, or the
    parameters' own dtype where it is wider (:func:`master_dtype_for`), checked against a
    layout of several dtypes (:func:`check_master_dtype`).

    Example::

        resolve_master_dtype(fm.layout, torch.float32)   # float64 for a float64 model
    """
    dtype = master_dtype_for(layout, master_dtype)
    check_master_dtype(layout, dtype)
    return dtype


def check_master_dtype(layout: FlatLayout, master_dtype: torch.dtype) -> None:
    """Raise :class:`TorchShardError` when one ``master_dtype`` master of a layout of several
    dtypes would round some trainable parameters (fp32 norms under a bf16 master).

    Example::

        check_master_dtype(fm.layout, torch.float32)   # the default: nothing to say
    """
    if not layout.mixed:
        return
    wider = [d for d in layout.grad_layout.dtypes if d.itemsize > master_dtype.itemsize]
    if wider:
        names = [s.name for s in layout.grad_layout if s.torch_dtype in wider]
        raise TorchShardError(
            f"master_dtype: {master_dtype} would round the {wider[0]} parameters "
            f"{and_more(names)} at every step (one master holds every trainable element of "
            "a model of several dtypes); use master_dtype=torch.float32"
        )


def check_reduce_dtype(reduce_dtype: object) -> None:
    """Raise :class:`TorchShardError` unless ``reduce_dtype`` is a floating dtype or ``None``."""
    if reduce_dtype is not None and not (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        raise TorchShardError(
            f"reduce_dtype: expected a floating point torch.dtype or None, got {reduce_dtype!r}"
        )


def plain_optimizer_refused(shard: object) -> str:
    """Why a sharded trainer refuses an optimizer over ``fm.parameters()``."""
    return (
        f"optimizer: with shard={shard!r} an optimizer over fm.parameters() would step "
        "gradients that are not the mean (shard=True reduces each rank's slice only) or that "
        "never exist (shard='full'), and nothing would gather the result; build it with "
        "trainer.make_optimizer(torch.optim.AdamW, lr=...) and call trainer.step()"
    )
