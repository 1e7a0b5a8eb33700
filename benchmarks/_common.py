"""Helpers shared by the benchmark scripts: machine info, timing, peak RSS, host-read
counting, a multi-process launcher, tables, JSON.

Only the standard library and torch; nothing here imports torchshard (or tests/).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import pickle
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from report.files import write_atomically
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent


def add_examples_to_path() -> None:
    """Make ``import gpt`` find ``examples/gpt.py`` of this checkout."""
    examples = str(REPO / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)


# -- machine ----------------------------------------------------------------------------
def fsdp2_api() -> tuple[Any, Any]:
    """FSDP2's ``fully_shard`` (``None`` on a torch without it) and ``DTensor``, wherever
    this torch keeps them."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # older torch
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            fully_shard = None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        from torch.distributed._tensor import DTensor
    return fully_shard, DTensor


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (goes at the top of every results file)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        # the ATen kernels torch dispatches to here (a VM's "model name" may not tell AVX2
        # from AVX-512 hosts; float results, such as a lossy comm's loss, differ between them)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "mem_total_bytes": _meminfo_bytes("MemTotal"),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meminfo_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


# What a result may depend on: uncommitted changes here make it belong to no commit.
DIRTY_WATCH = ("torchshard", "examples", "benchmarks", ":(exclude)benchmarks/results")


def _git_dirty() -> list[str] | None:
    """Files under :data:`DIRTY_WATCH` that differ from HEAD (``None``: git could not say).

    For humans and for run_all.py, which refuses to run while any are: the tables name the
    commit. Freshness does not use it: each result's ``measured`` hashes say what it ran.
    """
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *DIRTY_WATCH],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sorted(line[3:].split(" -> ")[-1] for line in out.stdout.splitlines() if line[3:])


# -- timing -----------------------------------------------------------------------------
class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.s``: wall seconds of the block.

    Also ``sw.user_s`` and ``sw.sys_s`` (CPU time of all threads of this process)
    and ``sw.minflt`` (minor page faults). Collects garbage first so that freeing
    earlier garbage is not billed to the block.
    """

    def __enter__(self) -> Stopwatch:
        gc.collect()
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.user_s = ru.ru_utime - self._ru0.ru_utime
        self.sys_s = ru.ru_stime - self._ru0.ru_stime
        self.minflt = ru.ru_minflt - self._ru0.ru_minflt


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


class Clock:
    """``with Clock() as c: ...`` then ``c.wall`` and ``c.cpu``: wall seconds of the block and
    the process's CPU seconds in it (every thread). CPU time does not see waiting (for a
    collective, the disk, another process), so the two are reported side by side. No garbage
    collection here (unlike :class:`Stopwatch`): it times steps back to back."""

    def __enter__(self) -> Clock:
        self._c0, self._t0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self.cpu = time.process_time() - self._c0


# -- host reads (a host-device synchronization on CUDA), counted on any device -------------------
HOST_READS = ("_local_scalar_dense", "is_nonzero", "lift_fresh")


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host: ``aten._local_scalar_dense``
    (``.item()``, ``bool()``, ``int()``), ``aten.is_nonzero`` and ``aten.lift_fresh``
    (``torch.tensor`` of Python data), plus ``Tensor.tolist`` (patched: it does not
    dispatch). On CUDA each is a host synchronization. ``seen``: name -> count.

    The same counter as tests/test_parallel_hot_path.py (copied: benchmarks import nothing
    from tests/)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()
        self._tolist = torch.Tensor.tolist

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostReads:
        counter, original = self.seen, self._tolist

        def tolist(t: torch.Tensor) -> Any:
            counter["tolist"] += 1
            return original(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        return super().__exit__(*exc)


# -- memory (Linux /proc, with a getrusage fallback elsewhere) ----------------------------
def rss_bytes() -> int:
    """Resident set size of this process now."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return peak_rss_bytes()  # best effort off Linux


def peak_rss_bytes() -> int:
    """Peak RSS since process start or the last successful :func:`reset_peak_rss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0); ``False`` where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.increase``: peak RSS inside the block minus RSS before.

    ``m.exact`` is False where the peak could not be reset; ``increase`` is then
    only what the block added above the process's earlier peak.
    """

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.before = rss_bytes()
        self.exact = reset_peak_rss()
        self._peak_before = peak_rss_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = peak_rss_bytes()
        self.after = rss_bytes()
        base = self.before if self.exact else self._peak_before
        self.increase = max(0, self.peak - base)


# -- subprocesses -----------------------------------------------------------------------
def run_child(script: str, args: Sequence[str], timeout: float = 600) -> dict[str, Any]:
    """Run ``python script *args`` in a fresh interpreter; it prints one JSON object last on stdout."""
    proc = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {list(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rank_main(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    outdir: str,
    env: dict[str, str],
    comm_timeout_s: float,
) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    timeout = datetime.timedelta(seconds=comm_timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = fn(*args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(outdir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    comm_timeout_s: float = 120,
) -> list[Any]:
    """``fn(*args)`` on ranks 0..world-1, each a fresh process (spawn) with one torch thread,
    in a gloo group (rendezvous on a TCPStore this process binds to port 0) and torchrun's
    environment variables; their return values, by rank. ``fn`` must be importable (module
    level). Raises if a rank fails, or kills them all after ``timeout_s``.

    ``env`` is in each process's environment from its start (set here around the spawn, then
    restored): glibc reads ``MALLOC_*`` before any Python runs, so setting it in the child
    would be too late."""
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    env = dict(env or {})
    saved = {k: os.environ.get(k) for k in env}
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        os.environ.update(env)
        try:
            ctx = mp.spawn(
                _rank_main,
                args=(world, store.port, fn, args, tmp, env, comm_timeout_s),
                nprocs=world,
                join=False,
            )
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        deadline = time.perf_counter() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.perf_counter() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} at {world} ranks: {timeout_s} s")
        return [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world)]


# -- output -----------------------------------------------------------------------------
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [title] if title else []
    out += [line(cells[0]), rule, *(line(r) for r in cells[1:])]
    return "\n".join(out)


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write ``data`` as indented JSON, atomically (``report.files.write_atomically``);
    creates the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path
