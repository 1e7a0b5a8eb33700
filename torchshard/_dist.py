"""Process-group set-up from the torchrun environment, and small exchanges the trainer needs."""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ._errors import TorchShardError
from ._log import get_logger

__all__ = ["DistInfo", "init_distributed"]

logger = get_logger(__name__)

# Whether init_distributed() created the default process group (then torchshard
# also tears it down: at trainer.close() or at interpreter exit).
_owns_default_group = False


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, ``local_rank`` on its node, ``device``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError as e:
        raise TorchShardError(
            f"environment variable {name}: expected an integer, got {value!r}"
        ) from e


def init_distributed(
    backend: str | None = None, timeout: float | timedelta | None = None
) -> DistInfo:
    """Initialize the default process group from torchrun's environment, once.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``; uses NCCL when CUDA is available, else gloo; sets the
    CUDA device to the local rank. Without torchrun (no ``WORLD_SIZE``) it is
    a world of one, backed by an in-process store. Calling it again returns
    the same answer; a group initialized by someone else is used as it is.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... (default: by device).
        timeout: collective timeout, seconds or a ``timedelta`` (default: torch's).

    Example::

        info = torchshard.init_distributed()   # under `torchrun --nproc-per-node 2 train.py`
        print(info.rank, info.world_size, info.device)
    """
    global _owns_default_group
    local_rank = _env_int("LOCAL_RANK", 0)
    cuda = torch.cuda.is_available() and backend in (None, "nccl", "cuda:nccl")
    if cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = backend or ("nccl" if cuda else "gloo")
        kwargs = {}
        if timeout is not None:
            kwargs["timeout"] = (
                timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
            )
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, **kwargs)
        else:  # a world of one, no rendezvous needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        _owns_default_group = True
        atexit.register(_destroy_at_exit)
        logger.debug("initialized %s process group", backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def destroy_owned_group() -> None:
    """Destroy the default process group if :func:`init_distributed` created it."""
    global _owns_default_group
    if _owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_default_group = False


def _destroy_at_exit() -> None:
    try:
        destroy_owned_group()
    except Exception:  # at exit, never mask the real error with a teardown one
        logger.debug("process group teardown at exit failed", exc_info=True)


def exchange_bytes(
    data: bytes, group: dist.ProcessGroup | None, device: torch.device
) -> list[bytes]:
    """All-gather one byte string per rank (no pickle): lengths first, then padded payloads."""
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(lengths, n, group=group)
    width = max(int(t.item()) for t in lengths)
    mine = torch.zeros(max(width, 1), dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [bytes(p[: int(k.item())].cpu().tolist()) for p, k in zip(parts, lengths)]
