"""Process-group set-up from the torchrun environment, and small exchanges the trainer needs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._errors import DeviceError, TorchShardError
from ._exit import own_default_group
from ._log import get_logger

__all__ = [
    "Coordinator",
    "DistInfo",
    "RankLostError",
    "backend_devices",
    "choose_device",
    "init_distributed",
]

logger = get_logger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, ``local_rank`` on its node, ``device``.

    Example::

        info = torchshard.init_distributed()
        batch = batch.to(info.device)
    """

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


_DATA_PARALLEL: list[tuple[int, int, int]] = []  # (dp rank, dp size, world size): the last mesh's


def set_data_parallel(rank: int, size: int, world: int) -> None:
    """Record the last mesh's data-parallel place (``init_mesh``), for the samplers' default."""
    _DATA_PARALLEL[:] = [(rank, size, world)]


def data_parallel() -> tuple[int, int]:
    """This rank's data-parallel ``(rank, size)``: the last :func:`init_mesh`'s (with tensor
    parallelism the tp ranks read the same data), else the default group's, else ``(0, 1)``."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    world = dist.get_world_size()
    if _DATA_PARALLEL and _DATA_PARALLEL[0][2] == world:
        return _DATA_PARALLEL[0][:2]
    return dist.get_rank(), world


def backend_devices(config: str) -> dict[str, str]:
    """Which backend serves which device type, from a backend string or config.

    ``"nccl"`` -> ``{"cuda": "nccl"}``; ``"cpu:gloo,cuda:nccl"`` -> both;
    ``"undefined"`` (``init_process_group()`` without a backend) -> torch's
    defaults, gloo for CPU and NCCL for CUDA.
    """
    config = config.strip().lower()
    if ":" in config:
        pairs = (part.split(":", 1) for part in config.split(",") if part.strip())
        return {d.strip(): b.strip() for d, b in pairs}
    if config in ("", "undefined"):
        return {"cpu": "gloo", "cuda": "nccl"}
    if config == "gloo":
        return {"cpu": "gloo", "cuda": "gloo"}
    if config == "nccl":
        return {"cuda": "nccl"}
    return {"cpu": config}


def choose_device(
    *,
    backends: dict[str, str],
    cuda_available: bool,
    device_count: int,
    local_rank: int | None,
    local_world_size: int | None,
    current: int,
    module_device: torch.device | None = None,
    bound: torch.device | None = None,
) -> torch.device:
    """The device a rank trains on, from what the group can do and where the rank sits.

    A pure function of its arguments (the trainer and :func:`init_distributed`
    gather them). In order: the group's bound device (``init_process_group(device_id=)``);
    CPU unless CUDA is available and NCCL serves CUDA tensors; the GPU the
    module's parameters are already on; ``cuda:LOCAL_RANK``; else the current
    CUDA device (a script that called ``torch.cuda.set_device`` itself).

    Raises:
        DeviceError: more ranks on this node than visible GPUs (NCCL would fail
            with "Duplicate GPU detected"), or a local rank with no GPU.

    Example::

        >>> choose_device(backends=backend_devices("cpu:gloo,cuda:nccl"), cuda_available=True,
        ...               device_count=8, local_rank=3, local_world_size=8, current=0)
        device(type='cuda', index=3)
    """
    if bound is not None:
        return bound
    if not cuda_available or backends.get("cuda") != "nccl":
        return torch.device("cpu")
    if module_device is not None and module_device.type == "cuda":
        return module_device
    if local_world_size is not None and local_world_size > device_count:
        raise DeviceError(
            f"{local_world_size} ranks on this node (LOCAL_WORLD_SIZE) but {device_count} "
            f"visible CUDA device(s): NCCL needs one GPU per rank; launch at most "
            f"{device_count} per node (torchrun --nproc-per-node {device_count}), or use gloo "
            "on CPU (init_distributed(backend='gloo'))"
        )
    if local_rank is not None:
        if not 0 <= local_rank < device_count:
            raise DeviceError(
                f"LOCAL_RANK={local_rank} but {device_count} visible CUDA device(s): no GPU "
                "for this rank"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cuda", current)


def init_distributed(
    backend: str | None = None, timeout: float | timedelta | None = None
) -> DistInfo:
    """Initialize the default process group from torchrun's environment, once.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``; uses NCCL when CUDA is available, else gloo; picks the
    device with :func:`choose_device` (``cuda:LOCAL_RANK`` under NCCL), sets it
    and binds the group to it. Without torchrun (no ``WORLD_SIZE``) it is
    a world of one, backed by an in-process store. Calling it again returns
    the same answer; a group initialized by someone else is used as it is.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ... (default: by device).
        timeout: collective timeout, seconds or a ``timedelta`` (default: torch's).

    Raises:
        DeviceError: under NCCL, more ranks on the node than GPUs, or no ``LOCAL_RANK``.

    Example::

        info = torchshard.init_distributed()   # under `torchrun --nproc-per-node 2 train.py`
        print(info.rank, info.world_size, info.device)
    """
    local_rank = _env_int("LOCAL_RANK", 0)
    creating = not dist.is_initialized()
    if creating:
        config = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    else:
        config = dist.get_backend_config()
    device = choose_device(
        backends=backend_devices(config),
        cuda_available=torch.cuda.is_available(),
        device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        local_rank=_env_int("LOCAL_RANK", -1) if "LOCAL_RANK" in os.environ else None,
        local_world_size=(
            _env_int("LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in os.environ else None
        ),
        current=torch.cuda.current_device() if torch.cuda.is_available() else 0,
    )
    cuda = device.type == "cuda"
    if cuda and creating and _env_int("WORLD_SIZE", 1) > 1 and "LOCAL_RANK" not in os.environ:
        raise DeviceError(
            "init_distributed: WORLD_SIZE is set but LOCAL_RANK is not, so which GPU this rank "
            "should use is unknown (every rank would take cuda:0); launch with torchrun, or "
            "export LOCAL_RANK (e.g. from SLURM_LOCALID)"
        )
    if cuda:
        torch.cuda.set_device(device)
    if creating:
        backend = config
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = (
                timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
            )
        if cuda:  # NCCL communicators made now, for this GPU (and split for subgroups)
            kwargs["device_id"] = device
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one store for the whole job, across restarts: a
            # restarted worker would read the previous attempt's keys (gloo's peer
            # addresses, NCCL's unique id) and fail to connect (pytorch#135712).
            dist.init_process_group(
                backend,
                store=_attempt_store(kwargs.get("timeout")),
                rank=_env_int("RANK", 0),
                world_size=_env_int("WORLD_SIZE", 1),
                **kwargs,
            )
        elif "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, **kwargs)
        else:  # a world of one, no rendezvous needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        own_default_group()  # destroyed at interpreter exit, once every rank is done
        logger.debug("initialized %s process group", backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _attempt_store(timeout: timedelta | None) -> dist.Store:
    """A client of torchrun's agent store whose keys are private to this run attempt."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT", 29500),
        _env_int("WORLD_SIZE", 1),
        is_master=False,
        timeout=timeout or timedelta(minutes=10),
    )
    # A failure restarts with the next count; a membership change (--nnodes MIN:MAX) restarts
    # with the same count at another world size. A node replaced at the same world size can
    # see counts differ per node: there, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (README).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world = _env_int("WORLD_SIZE", 1)
    return dist.PrefixStore(f"torchshard/attempt-{attempt}/world-{world}/", store)


def exchange_bytes(
    data: bytes, group: dist.ProcessGroup | None, device: torch.device
) -> list[bytes]:
    """All-gather one byte string per rank (no pickle): lengths first, then padded payloads."""
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(lengths, n, group=group)
    sizes = torch.cat(lengths).tolist()  # one host read, not one per rank
    width = max(sizes)
    mine = torch.zeros(max(width, 1), dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    table = torch.stack(parts).cpu()
    return [bytes(table[r, :k].tolist()) for r, k in enumerate(sizes)]


# -- coordination through the store ------------------------------------------------------------
# One extra connection per default store, made once: checkpoint saves wait on the store from a
# background thread while the training thread may use the default one, and TCPStore.clone()
# now and then takes seconds (its connect backs off), so it must not run per save.
_CLONES: dict[int, tuple[Any, Any]] = {}
_CLONES_LOCK = threading.Lock()


def own_connection() -> Any:
    """This process's second connection to the default group's store (made once)."""
    store = dist.distributed_c10d._get_default_store()
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    with _CLONES_LOCK:
        cached = _CLONES.get(id(store))
        if cached is None or cached[0] is not store:
            _CLONES.clear()  # a new process group: the old connection is of no use
            cached = _CLONES[id(store)] = (store, clone())
        return cached[1]


class RankLostError(TorchShardError):
    """A rank stopped beating while others waited for it (its process died or froze)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class Coordinator:
    """Store keys private to one trainer's group and run attempt, and a heartbeat per rank.

    ``token`` is agreed by the ranks of the group when the trainer is built, so keys of
    an earlier attempt (torchrun's agent store outlives its workers) or of another group
    using the same store at the same time are never read. Each rank sets its heartbeat
    key every ``interval`` seconds from a daemon thread; :meth:`wait` gives up on a rank
    whose heartbeat has not moved for ``silence`` seconds instead of waiting for the
    full timeout.
    """

    def __init__(self, token: str, rank: int, world_size: int, interval: float = 1.0) -> None:
        self.prefix = f"torchshard/{token}"
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self._seq = 0
        self.lost: set[int] = set()
        """Ranks a :meth:`wait` found silent (their process died or froze)."""
        self._stop = threading.Event()
        # The thread holds the key and the event, not the coordinator: a trainer dropped
        # without close() stops beating when it is collected (__del__).
        self._thread = threading.Thread(
            target=_beat,
            args=(self.key("alive", rank), interval, self._stop),
            name=f"torchshard-heartbeat-{rank}",
            daemon=True,
        )
        self._thread.start()

    def key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def next_sequence(self) -> int:
        """The next save's number: the same sequence on every rank of the group."""
        self._seq += 1
        return self._seq

    @property
    def store(self) -> Any:
        return own_connection()

    def wait(
        self, keys: list[str], ranks: Iterable[int], *, timeout: float, silence: float, what: str
    ) -> None:
        """Wait until every key in ``keys`` is set (by ``ranks``).

        Polls (a store's timed wait logs a warning each time it expires), 10 ms at
        first, backing off to 0.25 s.

        Raises:
            RankLostError: a rank in ``ranks`` has not beaten for ``silence`` seconds
                (never having beaten counts from the start of the wait).
            TimeoutError: ``timeout`` seconds passed with every rank alive.
        """
        store, ranks = self.store, sorted(set(ranks))
        start = time.monotonic()
        seen = {r: (-1, start) for r in ranks}  # heartbeat count, when it last moved
        pause = 0.01
        while not store.check(keys):
            time.sleep(pause)
            pause = min(2 * pause, 0.25)
            now = time.monotonic()
            for r in ranks:
                count = store.add(self.key("alive", r), 0)  # read without blocking
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] >= silence:
                    self.lost.add(r)  # leave() need not wait for its silence again
                    raise RankLostError(
                        f"rank {r} stopped responding while rank {self.rank} waited for {what}: "
                        f"no heartbeat for {now - seen[r][1]:.1f} s (its process died or froze)",
                        r,
                    )
            if now - start >= timeout:
                raise TimeoutError(f"rank {self.rank}: {what}: not done after {timeout:.0f} s")

    def delete(self, keys: Iterable[str]) -> None:
        store = self.store
        for k in keys:
            store.delete_key(k)

    def leave(self, timeout: float, silence: float | None = None) -> list[int]:
        """Say that this rank is done and wait until every rank of the group has said so
        (at most ``timeout`` seconds), then stop beating. Through the store, not a
        collective: a rank on an error path would never match one. A rank that has not
        arrived and whose heartbeat has not moved for ``silence`` seconds (default: 5
        intervals, at least 5 s) died or froze: it is not waited for. Returns the ranks
        that did not arrive (empty when all did).

        The waiting polls (1 ms, backing off to 50 ms) with the GIL released, which is
        also what gloo's threads need to finish their bookkeeping (see ``_exit``)."""
        silence = max(5.0, 5 * self.interval) if silence is None else silence
        missing: list[int] = []
        try:
            store = self.store
            store.set(self.key("done", self.rank), b"1")
            count, start, pause = store.add(self.key("done"), 1), time.monotonic(), 0.001
            seen: dict[int, tuple[int, float]] = {}  # heartbeat count, when it last moved
            looked = start - 1.0 if self.lost else start  # known lost: look at once
            while count < self.world_size:
                now = time.monotonic()
                if now - looked >= min(0.5, silence / 4):
                    looked = now
                    waiting = [r for r in range(self.world_size) if r != self.rank]
                    waiting = [r for r in waiting if not store.check([self.key("done", r)])]
                    for r in waiting:
                        beats = store.add(self.key("alive", r), 0)
                        if seen.get(r, (None,))[0] != beats:
                            seen[r] = (beats, now)
                    silent = [r for r in waiting if r in self.lost or now - seen[r][1] >= silence]
                    if waiting and silent == waiting:  # only the dead are left
                        missing = waiting
                        break
                if now - start >= timeout:
                    missing = [
                        r for r in range(self.world_size) if not store.check([self.key("done", r)])
                    ]
                    break
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
                count = store.add(self.key("done"), 0)
        except Exception:  # the store's host left: it does so only once everyone arrived
            logger.debug("rank %d: the store went away while leaving", self.rank, exc_info=True)
        self.close()
        return missing

    def close(self) -> None:
        """Stop the heartbeat and wait for its thread (a daemon thread left inside a store
        call when the interpreter finalizes aborts the process)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.interval))

    def __del__(self) -> None:
        self._stop.set()


def _beat(key: str, interval: float, stop: threading.Event) -> None:
    """Bump ``key`` every ``interval`` seconds until ``stop`` is set."""
    try:
        store = own_connection()
        while not stop.is_set():
            store.add(key, 1)
            stop.wait(interval)
    except Exception:  # the group is gone (teardown, interpreter exit): stop beating
        logger.debug("heartbeat %s stopped", key, exc_info=True)
