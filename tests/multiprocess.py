"""Run a function in N local processes joined by a process group: the harness of every
distributed test.

Usage::

    import torch
    import torch.distributed as dist
    from multiprocess import run_distributed

    def _sum_of_ranks() -> float:  # module level: children import it by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum_of_ranks() -> None:
        assert run_distributed(_sum_of_ranks, 3, timeout=30) == [3.0, 3.0, 3.0]

Children are fresh interpreters (forkserver, never fork), so no pytest/xdist/execnet threads,
sockets or locks are inherited; they receive the parent's *current* os.environ, sys.path and
cwd at each call (the forkserver itself would otherwise hand out those of its own start).
Their stdout/stderr are the forkserver's, i.e. the fds pytest captured when it started.
Any failure raises WorkerError; a hang raises WorkerTimeout with each hung rank's Python stack.

``run_python(argv, cwd, env)`` is ``subprocess.run([sys.executable, *argv], ...)`` for a
script or a ``-c`` snippet run without a launcher (the docs' blocks, one-process example
runs), from the same preloaded server: what python does, without 3 s of imports each time.
"""

from __future__ import annotations

import ast
import atexit
import faulthandler
import importlib.util
import multiprocessing as mp
import os
import pickle
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from functools import cache
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

__all__ = [
    "GRACE_PERIOD",
    "WorkerError",
    "WorkerTimeout",
    "free_port",
    "run_distributed",
    "run_python",
]

GRACE_PERIOD = 3.0  # after the first failure, seconds to collect other ranks' errors

# Start method, measured on the 2-core CI box (torch 2.13 CPU, Python 3.11). Until every child
# had imported torch.distributed: spawn 1.0-1.3 s for 2 children and 2.2-4.7 s for 4 (each
# child imports torch, ~0.9 s of CPU); forkserver preloading torch ~1 s once per test process
# to start the server, then 0.01-0.02 s for 2 or 4. A whole run_distributed(all_reduce) from a
# test module (box busy with other jobs): spawn 5.3 s (2 ranks) / 11 s (4); forkserver 0.10 s /
# 0.18 s, once pytest (imported by every test module) is preloaded too (0.4 s / 0.8 s before).
# Hence forkserver; TORCHSHARD_TEST_START_METHOD=spawn to compare. Never fork: parent threads.
#
# What the server imports once, so that no rank pays for it: besides torch, torch._dynamo
# (every optimizer's add_param_group is @torch._disable_dynamo, which imports it at the first
# optimizer a process builds: seconds of CPU per rank), torchshard and the reference model
# (examples/gpt.py, on sys.path from conftest). This module comes last: importing it in the
# server records what the preloads left there (_AT_IMPORT), and every rank checks that
# record (_check_preloaded), since multiprocessing.forkserver.main skips a preload that
# raises ImportError silently, and a server with a second thread must not fork.
PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "pytest", "torchshard")
_OPTIONAL = ("gpt", "sharded_harness", "models")  # where they are on sys.path (the suite's)
_CTX = mp.get_context(os.environ.get("TORCHSHARD_TEST_START_METHOD", "forkserver"))


class WorkerError(RuntimeError):
    """One or more ranks failed. ``errors``: rank -> traceback (or exit report), in the order
    the parent saw them; ``pids``: rank -> pid of every worker (all dead by the time you see it).
    """

    def __init__(
        self, message: str, errors: dict[int, str] | None = None, pids: dict[int, int] | None = None
    ) -> None:
        super().__init__(message)
        self.errors: dict[int, str] = errors or {}
        self.pids: dict[int, int] = pids or {}


class WorkerTimeout(WorkerError):
    """Not every rank finished within ``timeout``. A WorkerError subclass (not TimeoutError:
    the two built-in bases cannot be combined), so ``except WorkerError`` catches every helper
    failure. ``unfinished``: the ranks that were killed; ``errors``: their Python stacks."""

    def __init__(
        self,
        message: str,
        errors: dict[int, str] | None = None,
        pids: dict[int, int] | None = None,
        unfinished: list[int] | None = None,
    ) -> None:
        super().__init__(message, errors, pids)
        self.unfinished: list[int] = unfinished or []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago. Racy: another process may take it
    before you bind it. Prefer a store bound to port 0 where you can."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class _Config:
    payload: bytes  # pickled (fn, args, kwargs), loaded after sys.path is restored
    world_size: int
    port: int
    backend: str
    init_process_group: bool
    pg_timeout: float
    environ: dict[str, str]
    env: dict[str, str]
    sys_path: list[str]
    cwd: str
    tmpdir: str
    preloads: tuple[str, ...]  # what the forkserver must have imported; () with spawn


def _exit_when_parent_dies(alive: Connection) -> None:
    with suppress(EOFError, OSError):
        alive.recv_bytes()  # nothing is ever sent: returns when the parent's end closes
    os._exit(70)


def _preloads() -> tuple[str, ...]:
    """PRELOAD, and each optional module that this process's sys.path can import."""
    found = tuple(m for m in _OPTIONAL if importlib.util.find_spec(m) is not None)
    return (*PRELOAD, *found)


def _check_preloaded(wanted: tuple[str, ...]) -> None:
    """Raise unless this rank's forkserver imported ``wanted`` before this module, and forked
    it while single-threaded (from _AT_IMPORT: in a rank, the server's record)."""
    loaded, threads = _AT_IMPORT
    missing = [m for m in wanted if m not in loaded]
    if missing or threads != 1:
        raise RuntimeError(
            f"forkserver preload: expected {list(wanted)} imported by a single-threaded server, "
            f"got {missing} not imported and {threads} threads; a preload that raises "
            "ImportError is skipped silently: import each in a fresh interpreter to see why"
        )


# With forkserver, what its server imports: set here, before anything can start the server
# (tests import this module after conftest put examples/ and tests/ on sys.path).
_SERVER_PRELOADS = _preloads() if _CTX.get_start_method() == "forkserver" else ()
if _SERVER_PRELOADS:
    _CTX.set_forkserver_preload([*_SERVER_PRELOADS, __name__])


def _start_server() -> None:
    """Start the forkserver, if not running, with this process's sys.path: Python 3.11's
    forkserver ignores the sys_path it is handed, so its preloads would see PYTHONPATH and
    site-packages only (not tests/ and examples/, which conftest and pytest add)."""
    if not _SERVER_PRELOADS:
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(sys.path)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _child(rank: int, cfg: _Config, conn: Connection, alive: Connection) -> None:
    try:
        if cfg.preloads:
            _check_preloaded(cfg.preloads)  # first: before the thread below starts
        threading.Thread(target=_exit_when_parent_dies, args=(alive,), daemon=True).start()
        os.environ.clear()
        os.environ.update(cfg.environ)
        n = str(cfg.world_size)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=n,
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=n,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(cfg.port),
        )
        os.environ.update(cfg.env)
        sys.path[:] = cfg.sys_path
        os.chdir(cfg.cwd)
        dump = open(os.path.join(cfg.tmpdir, f"rank{rank}.txt"), "w")  # noqa: SIM115 (kept open)
        faulthandler.enable(dump, all_threads=True)  # crash -> stack in the parent's report
        faulthandler.register(signal.SIGUSR1, dump, all_threads=True)  # parent asks on timeout
        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(cfg.payload)
        if cfg.init_process_group:
            td = timedelta(seconds=cfg.pg_timeout)
            store = dist.TCPStore(
                "127.0.0.1", cfg.port, cfg.world_size, is_master=False, timeout=td
            )
            dist.init_process_group(
                cfg.backend, store=store, rank=rank, world_size=cfg.world_size, timeout=td
            )
            dist.barrier()  # else a rank may finish (and tear down) while a peer still connects
        message = pickle.dumps(("ok", fn(*args, **kwargs)))
    except BaseException:
        message = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(message)  # report first: destroying may block on a broken group
    conn.close()
    if dist.is_initialized():
        with suppress(Exception):
            dist.destroy_process_group()


def _exit_report(code: int | None) -> str:
    if code is not None and code < 0:
        with suppress(ValueError):
            return f"killed by signal {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(procs: list[Any]) -> None:
    """Terminate, then kill after 1 s, and reap every process in ``procs``."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    end = time.monotonic() + 1.0
    for p in alive:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    for p in procs:
        p.close()  # frees the sentinel fd now rather than at garbage collection


def _text(path: str) -> str:
    """The file's text, or "" if it cannot be read (a process that died before writing it)."""
    with suppress(OSError), open(path, errors="replace") as f:
        return f.read()
    return ""


def _dumped(tmpdir: str, rank: int) -> str:
    return _text(os.path.join(tmpdir, f"rank{rank}.txt"))


DUMP_DEADLINE = 10.0  # seconds a hung rank gets to write its stacks after SIGUSR1


def _in_handler(pid: int, signum: int) -> bool | None:
    """Whether ``signum`` is pending on process ``pid`` or blocked in one of its threads (Linux,
    from /proc): True while its handler has yet to run or is still running (the kernel blocks
    the signal in the handling thread for the handler's duration; faulthandler.register without
    ``chain`` does not ask for SA_NODEFER). None where /proc cannot tell."""
    bit = 1 << (signum - 1)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # the thread has exited
        if any(int(fields.get(k, "0"), 16) & bit for k in ("SigPnd", "ShdPnd", "SigBlk")):
            return True
    return False


def _dump_stacks(procs: dict[int, Any], ranks: list[int], tmpdir: str) -> dict[int, str]:
    """Ask each rank in ``ranks`` (alive, hung) for its Python stacks (faulthandler on SIGUSR1)
    and read them once written: polls until each rank's dump is non-empty and its handler has
    returned (or the rank is gone), up to DUMP_DEADLINE; no fixed sleep to race a busy box."""
    for rank in ranks:
        with suppress(OSError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    waiting, deadline = set(ranks), time.monotonic() + DUMP_DEADLINE
    while waiting and time.monotonic() < deadline:
        for rank in sorted(waiting):
            alive = procs[rank].is_alive()
            written = bool(_dumped(tmpdir, rank)) and not _in_handler(
                procs[rank].pid, signal.SIGUSR1
            )
            if written or not alive:
                waiting.discard(rank)
        if waiting:
            time.sleep(0.02)  # poll interval, not a synchronisation
    return {rank: _dumped(tmpdir, rank) or "(no stack dumped)" for rank in ranks}


def _collect(
    procs: dict[int, Any],
    conns: dict[int, Connection],
    timeout: float,
    tmpdir: str,
) -> tuple[dict[int, Any], dict[int, str], list[int]]:
    """Wait for the children: (results, errors in the order seen, ranks still running)."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}

    def receive(rank: int) -> None:  # each child sends exactly one message
        try:
            kind, value = pickle.loads(conns[rank].recv_bytes())
            (results if kind == "ok" else errors)[rank] = value
        except (EOFError, OSError):
            pass  # died without a report: its sentinel tells how
        except Exception:
            errors[rank] = f"unpickling its result failed:\n{traceback.format_exc()}"
        conns[rank].close()

    pending = set(procs)
    deadline, failed = time.monotonic() + timeout, False
    while pending and time.monotonic() < deadline:
        # Read messages as they come, so no child blocks forever writing a large result.
        ready = wait(
            [conns[r] for r in pending if not conns[r].closed]
            + [procs[r].sentinel for r in pending],
            deadline - time.monotonic(),
        )
        for rank in sorted(pending):
            if conns[rank] in ready:
                receive(rank)
            if procs[rank].sentinel in ready:  # exited
                if not conns[rank].closed and conns[rank].poll():
                    receive(rank)
                procs[rank].join()
                pending.discard(rank)
                how = _exit_report(procs[rank].exitcode)
                if rank not in results and rank not in errors:
                    errors[rank] = f"exited with {how} without reporting a result\n"
                    errors[rank] += _dumped(tmpdir, rank)  # faulthandler's stack, if it crashed
                elif procs[rank].exitcode != 0 and rank in results:
                    errors[rank] = f"returned, then exited with {how}"
        if errors and not failed:  # give the other ranks' errors a moment to arrive
            failed, deadline = True, min(deadline, time.monotonic() + GRACE_PERIOD)
    return results, errors, sorted(pending)


def _message(head: str, texts: dict[int, str], pids: dict[int, int]) -> str:
    body = "".join(f"\n--- rank {r} (pid {pids[r]}) ---\n{t.rstrip()}" for r, t in texts.items())
    return head + body


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ranks 0..world_size-1, one fresh process each, and return
    their (picklable) return values by rank.

    Each child gets torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) updated with ``env``, and ``torch.set_num_threads(1)``. With
    ``init_process_group`` the child joins a ``backend`` group before ``fn`` (rendezvous on a
    TCPStore this process binds to port 0: no port race) and destroys it afterwards; without
    it, ``fn`` initializes itself from the env, and MASTER_PORT comes from free_port() (racy,
    rarely). Raises WorkerError (GRACE_PERIOD s after the first failure, with every error seen
    by then) or WorkerTimeout; no worker outlives this call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    payload = pickle.dumps((fn, args, kwargs))  # fail here, not in every child
    store = None
    if init_process_group:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        port = store.port
    else:
        port = free_port()
    procs: dict[int, Any] = {}
    conns: dict[int, Connection] = {}
    alive_r, alive_w = mp.Pipe(duplex=False)  # children exit when alive_w closes
    with tempfile.TemporaryDirectory(prefix="run_distributed-") as tmpdir:
        cfg = _Config(
            payload,
            world_size,
            port,
            backend,
            init_process_group,
            timeout + 30.0,
            dict(os.environ),
            dict(env or {}),
            list(sys.path),
            os.getcwd(),
            tmpdir,
            _SERVER_PRELOADS,
        )
        try:
            _start_server()
            for rank in range(world_size):
                conns[rank], child_end = mp.Pipe(duplex=False)
                procs[rank] = _CTX.Process(
                    target=_child,
                    args=(rank, cfg, child_end, alive_r),
                    name=f"run_distributed-rank{rank}",
                )
                procs[rank].start()
                child_end.close()
            pids = {rank: p.pid for rank, p in procs.items()}
            results, errors, pending = _collect(procs, conns, timeout, tmpdir)
            if errors:
                ranks = ", ".join(map(str, errors))
                head = f"rank{'s' * (len(errors) > 1)} {ranks} of {world_size} failed"
                if pending:
                    head += f"; ranks {pending} were still running and were killed"
                raise WorkerError(_message(head, errors, pids), errors, pids)
            if pending:
                stacks = _dump_stacks(procs, pending, tmpdir)  # each hung rank's (faulthandler)
                head = (
                    f"ranks {pending} of {world_size} did not finish within {timeout:g} s"
                    " and were killed; their stacks:"
                )
                raise WorkerTimeout(_message(head, stacks, pids), stacks, pids, pending)
            return [results[rank] for rank in range(world_size)]
        finally:
            _stop(list(procs.values()))
            for c in [*conns.values(), alive_r, alive_w]:
                c.close()
            del store  # the rendezvous server


_SUITE_DIRS = tuple(
    str(Path(__file__).resolve().parent.parent / d) + os.sep for d in ("tests", "examples")
)


@cache
def _fresh_sys_path() -> tuple[str, ...]:
    """sys.path of ``python -c`` (without PYTHONPATH): '' first, then the standard library
    and site-packages, with the editable install's entries; not tests/ or examples/."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import sys; print(repr(sys.path))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return tuple(ast.literal_eval(out.stdout))


def _python(
    argv: list[str], cwd: str, env: dict[str, str], path: tuple[str, ...], out: str
) -> None:
    """In the child: what ``python *argv`` does, then leave with its exit code."""
    os.setpgrp()  # the parent kills the program's own children with it on a timeout
    if _SERVER_PRELOADS:
        _check_preloaded(_SERVER_PRELOADS)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (fd 1 stays open)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # torch read it at import, in the server, with the server's env
        torch.set_num_threads(int(threads))
    os.chdir(cwd)
    for name, module in list(sys.modules.items()):  # the suite's own: not on a fresh path
        where = getattr(module, "__file__", None) or ""
        if where.startswith(_SUITE_DIRS):
            del sys.modules[name]
    mp.set_start_method(None, force=True)  # the platform's default again, not forkserver
    how = argv[0] if argv[0] in ("-c", "-m") else "script"
    # python puts the script's directory first on sys.path, the cwd for -m, '' for -c
    first = {"script": os.path.dirname(os.path.abspath(argv[0])), "-m": os.getcwd(), "-c": ""}
    # then PYTHONPATH's entries as site leaves them: absolute ('' is the cwd), each once
    extra = [os.path.abspath(d or ".") for d in env.get("PYTHONPATH", "").split(os.pathsep)]
    extra = [d for d in dict.fromkeys(extra) if d not in path]
    sys.path[:] = [first[how], *extra, *path[1:]]
    sys.argv[:] = argv if how == "script" else [how, *argv[2:]]  # -m: runpy sets argv[0]
    status = 0
    try:
        if how == "script":
            runpy.run_path(argv[0], run_name="__main__")
        elif how == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:  # as python does (torchshard's exit hook reads sys.last_value)
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.excepthook(*sys.exc_info())
        status = 1
    atexit._run_exitfuncs()  # what interpreter exit runs (torchshard's exit hook among them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_python(
    argv: list[str], cwd: str | os.PathLike[str], env: dict[str, str], timeout: float = 240.0
) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)`` returns, for ``argv`` a script and its arguments,
    ``["-c", code, ...]`` or ``["-m", module, ...]``, run in a child of the preloaded
    forkserver: about 0.02 s to start instead of about 3 s of CPU for the imports (torch,
    torch._dynamo, torchshard) each time.

    The child gets ``env``, ``cwd``, a fresh interpreter's sys.path (first the script's
    directory, the cwd for ``-m``, '' for ``-c``, then ``env``'s PYTHONPATH), sys.argv and
    ``__main__``, and exits with
    the code python would (1 and the traceback on an exception), after the atexit functions.
    Unlike a fresh interpreter it starts with those modules imported, and it leaves by
    ``os._exit`` after atexit, without the interpreter's finalization: an abort at teardown
    is for real launches to catch (tests/test_exit.py); so is anything about start-up
    itself. On a timeout its process group (the program and the processes it started) is
    killed, with whatever runs below it in other sessions (a launcher's workers), and
    ``subprocess.TimeoutExpired`` raised.
    """
    args = [sys.executable, *map(str, argv)]
    path = _fresh_sys_path()
    with tempfile.TemporaryDirectory(prefix="run_python-") as out:
        _start_server()
        proc = _CTX.Process(target=_python, args=(args[1:], os.fspath(cwd), dict(env), path, out))
        proc.start()
        try:
            proc.join(timeout)
            expired = proc.exitcode is None
        finally:
            if proc.exitcode is None:  # its descendants in other sessions (torchrun's workers)
                _kill_descendants(proc.pid)
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what it left running, if anything
            proc.join()
            returncode = proc.exitcode
            proc.close()
        stdout, stderr = (_text(os.path.join(out, name)) for name in ("stdout", "stderr"))
        if expired:
            raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
        return subprocess.CompletedProcess(args, returncode, stdout, stderr)


def _kill_descendants(pid: int) -> None:
    """SIGKILL every process below ``pid``, found while ``pid`` still holds them (a launcher
    starts each worker in a session of its own, where a kill of its group does not reach)."""
    with suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with suppress(psutil.NoSuchProcess):
                child.kill()


# Last, so that in the forkserver it records what the preloads before it left: the modules
# imported and the threads running (see PRELOAD). In any other process: unused.
# (Python threads: importing torch starts one native thread of its own, as it always did.)
_AT_IMPORT = (frozenset(sys.modules), threading.active_count())
