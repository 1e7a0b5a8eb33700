"""Helpers shared by the benchmark scripts: machine info, timing, peak RSS, tables, JSON.

Only the standard library and torch; nothing here imports torchshard.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent


def add_examples_to_path() -> None:
    """Make ``import gpt`` find ``examples/gpt.py`` of this checkout."""
    examples = str(REPO / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)


# -- machine ----------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (goes at the top of every results file)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "mem_total_bytes": _meminfo_bytes("MemTotal"),
        "git_commit": _git_commit(),
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
    """Write ``data`` as indented JSON, atomically (via ``path.tmp``); creates the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path
