"""What a trainer does once: pick the device, bind the buffers, check that every rank
built the same model (agreeing a store token on the way), and compare weights."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._dist import exchange_bytes
from .._errors import RankMismatchError
from .._flat.layout import FlatLayout
from .._flat.module import FlatParamModule
from .mode import Mode

__all__ = ["assert_in_sync", "bind_buffers", "check_same_model", "pick_device"]


def pick_device(
    fm: FlatParamModule, device: torch.device | str | None, group: dist.ProcessGroup | None
) -> torch.device:
    if device is not None:
        return torch.device(device)
    if fm.is_bound:
        return fm.device
    if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bind_buffers(
    fm: FlatParamModule,
    mode: Mode,
    n: int,
    device: torch.device,
    world_size: int,
    init_fn: Callable[[torch.nn.Module], None] | None,
) -> None:
    """Bind ``fm`` to buffers of ``n`` elements on ``device`` (initializing a meta-built model),
    or keep its buffers when they are already there and large enough."""
    if fm.is_bound:
        if fm.device != device:
            fm.to(device)
        flat, grad = fm.flat_param, fm.flat_grad
        assert flat is not None
        if flat.numel() >= n and (grad is None or grad.numel() >= n):
            return
        # Too small for the padded slices: move into buffers that are not.
        big = flat if flat.numel() >= n else torch.zeros(n, dtype=fm.dtype, device=device)
        fm.bind(big, torch.zeros(n, dtype=fm.dtype, device=device))
        return
    was_meta = any(p.is_meta for p in fm.module.parameters())
    flat = torch.empty(n, dtype=fm.dtype, device=device)
    flat[fm.numel :].zero_()  # padding: all-gathered and checkpointed, so defined
    # A mode may keep a few elements just before the gradient (replicated: the
    # used-parameter mask, which then rides in the all-reduce of the bucket at 0).
    n_mask = sum(s.requires_grad for s in fm.layout.slots)
    k = mode.mask_elements(n_mask, world_size, fm.layout.align)
    store = torch.zeros(k + n, dtype=fm.dtype, device=device)
    fm.bind(flat, store[k:])
    mode.bind(store, k, n_mask)
    if was_meta:
        fm.init_weights(init_fn)


def check_same_model(
    fm: FlatParamModule,
    mode: Mode,
    group: dist.ProcessGroup | None,
    device: torch.device,
    src: int,
) -> str:
    """Compare the layout (and module buffers) of every rank; raise on all ranks if any differ.

    Returns a token that ``src`` drew, the same on every rank: the name of this trainer's
    keys in the store, unique per group and per run attempt (see ``Coordinator``).
    """
    layout = fm.layout
    buffers = [[n, list(b.shape), str(b.dtype)] for n, b in fm.module.named_buffers()]
    mine = layout.fingerprint() + hashlib.sha256(json.dumps(buffers).encode()).hexdigest()[:32]
    mine += mode.fingerprint()
    replies = exchange_bytes(f"{mine} {secrets.token_hex(8)}".encode(), group, device)
    everyone = [r.decode().split(" ")[0] for r in replies]
    bad = [r for r, fp in enumerate(everyone) if fp != everyone[src]]
    if not bad:
        return replies[src].decode().split(" ")[1]
    # Every rank reaches this point (they all saw the same fingerprints), so
    # one more exchange, of the full descriptions, is safe.
    desc = json.dumps({"layout": layout.to_dict(), "buffers": buffers}).encode()
    descs = [json.loads(d) for d in exchange_bytes(desc, group, device)]
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


@torch.no_grad()
def assert_in_sync(
    fm: FlatParamModule, group: dist.ProcessGroup | None, device: torch.device, world_size: int
) -> None:
    """Raise :class:`RankMismatchError` on every rank if any rank's weights differ, naming
    the first parameter or buffer that differs and the ranks that hold other values."""
    names, sums = [], []
    for slot, p in fm.named_flat_views():
        names.append(slot.name)
        sums.append(_bit_checksum(p))
    for name, b in fm.module.named_buffers():
        names.append(f"buffer {name}")
        sums.append(_bit_checksum(b))
    mine = torch.tensor(sums, dtype=torch.int64, device=device)
    if world_size == 1:
        return
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    differs = (table != table[0]).any(dim=0).nonzero()
    if len(differs):
        k = int(differs[0])
        odd = [r for r in range(world_size) if table[r, k] != table[0, k]]
        raise RankMismatchError(
            f"weights out of sync: {names[k]!r} differs between rank 0 and ranks {odd} "
            f"({len(differs)} of {len(names)} tensors differ); call trainer.broadcast() "
            "to resynchronize, and check that every rank runs the same optimizer steps"
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
