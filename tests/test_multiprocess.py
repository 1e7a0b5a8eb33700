"""Tests of the multi-process test harness itself (tests/multiprocess.py), with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from multiprocess import WorkerError, WorkerTimeout, free_port, run_distributed, run_python

# --- workers: module level so that the children can import them by reference -------------


def _all_reduce_rank_plus_one(scale: float, *, offset: float = 0.0) -> float:
    t = torch.tensor([scale * (dist.get_rank() + 1) + offset])
    dist.all_reduce(t)
    return t.item()


def _report_env() -> dict[str, str]:
    keys = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "MP_TEST_EXTRA",
        "MP_TEST_PARENT",
    ]
    env = {k: os.environ[k] for k in keys if k in os.environ}
    env["threads"] = str(torch.get_num_threads())
    env["initialized"] = str(dist.is_initialized())
    return env


def _rank1_raises_while_rank0_waits(how: str) -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom")
    if how == "collective":
        dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins (or fails: the peer is gone)
    else:
        threading.Event().wait()  # blocks for good: nothing but the parent ends it


def _every_rank_raises() -> None:
    raise KeyError(f"bad rank {dist.get_rank()}")


def _write_pid_then_hang(tmp_path: Path) -> None:
    (tmp_path / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(1000)


def _stopped_when_asked_for_stacks(tmp_path: Path, seconds: float) -> None:
    # A helper stops this rank now and resumes it `seconds` later: a rank that is not scheduled
    # when the parent asks for its stacks (SIGUSR1 stays pending until SIGCONT). The helper's
    # sleep is the simulated stall, not a synchronisation.
    pid = os.getpid()
    script = f"kill -STOP {pid}; sleep {seconds}; kill -CONT {pid}"
    helper = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    (tmp_path / "helper").write_text(str(helper.pid))
    threading.Event().wait()


def _rank1_exits_3() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def _large_result(nbytes: int) -> bytes:
    return bytes([dist.get_rank()]) * nbytes


def _return_lambda() -> object:
    return lambda: None


def _init_from_env() -> tuple[int, float]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo")  # env://, as under torchrun
    try:
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        return dist.get_rank(), t.item()
    finally:
        dist.destroy_process_group()


# --- tests ----------------------------------------------------------------------------------


def _assert_dead(pids: list[int]) -> None:
    for pid in pids:
        assert not psutil.pid_exists(pid), f"worker pid {pid} survived"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_returns_values_by_rank(world_size: int) -> None:
    results = run_distributed(_all_reduce_rank_plus_one, world_size, 2.0, offset=0.5, timeout=60)
    expected = 2.0 * world_size * (world_size + 1) / 2 + 0.5 * world_size
    assert results == [expected] * world_size


def test_env_is_torchrun_like(monkeypatch: pytest.MonkeyPatch) -> None:
    # set after the forkserver may have started: children still see the parent's current env
    monkeypatch.setenv("MP_TEST_PARENT", "yes")
    envs = run_distributed(_report_env, 2, env={"MP_TEST_EXTRA": "x"}, timeout=60)
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, e in enumerate(envs):
        assert (e["RANK"], e["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert (e["MP_TEST_EXTRA"], e["MP_TEST_PARENT"]) == ("x", "yes")
        assert (e["threads"], e["initialized"]) == ("1", "True")


@pytest.mark.parametrize("how", ["collective", "forever"])
def test_exception_on_one_rank_kills_blocked_peer(how: str) -> None:
    # The timeout is far beyond the test's own (pytest-timeout): only the grace period after
    # the first failure can end this call, and a harness that waited for the timeout instead
    # fails as a test timeout, not on a wall-clock assertion.
    with pytest.raises(WorkerError) as info:
        run_distributed(_rank1_raises_while_rank0_waits, 2, how, timeout=3600)
    assert not isinstance(info.value, WorkerTimeout)
    if how == "forever":  # rank 0 cannot fail by itself: it was killed at the grace's end
        assert "ranks [0] were still running and were killed" in str(info.value)
        assert list(info.value.errors) == [1]
    assert "rank 1" in str(info.value)
    assert "ValueError: boom" in info.value.errors[1]
    assert "ValueError" in str(info.value) and "boom" in str(info.value)
    assert next(iter(info.value.errors)) == 1  # the root cause is reported first
    _assert_dead(list(info.value.pids.values()))


def test_exceptions_on_all_ranks_are_collected() -> None:
    with pytest.raises(WorkerError) as info:
        run_distributed(_every_rank_raises, 3, timeout=60)
    assert sorted(info.value.errors) == [0, 1, 2]
    for rank, text in info.value.errors.items():
        assert f"KeyError: 'bad rank {rank}'" in text


def test_hang_times_out_and_kills_workers(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        run_distributed(_write_pid_then_hang, 2, tmp_path, timeout=5)
    assert time.monotonic() - start >= 5  # waited the whole timeout (no upper bound: a busy box)
    assert info.value.unfinished == [0, 1]
    assert "ranks [0, 1] of 2 did not finish within 5 s" in str(info.value)
    # the Python stack of each hung rank, dumped by faulthandler before the kill
    assert "in barrier" in info.value.errors[0]
    assert "in _write_pid_then_hang" in info.value.errors[1]
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    assert pids == [info.value.pids[0], info.value.pids[1]]
    _assert_dead(pids)


def test_hang_stacks_are_read_once_written(tmp_path: Path) -> None:
    # The rank is stopped from before the 3 s timeout until about 6 s after its start, so its
    # faulthandler dump is written only then: the parent must wait for it (up to its
    # deadline), not read the file after a fixed pause ("(no stack dumped)").
    try:
        with pytest.raises(WorkerTimeout) as info:
            run_distributed(_stopped_when_asked_for_stacks, 1, tmp_path, 6, timeout=3)
        assert "in _stopped_when_asked_for_stacks" in info.value.errors[0]
        _assert_dead([info.value.pids[0]])
    finally:
        with suppress(OSError, ValueError):  # the helper's session: sh and its sleep
            os.killpg(int((tmp_path / "helper").read_text()), signal.SIGKILL)


def test_exit_without_exception_is_reported() -> None:
    with pytest.raises(WorkerError) as info:
        run_distributed(_rank1_exits_3, 2, timeout=60)
    assert "exit code 3" in info.value.errors[1]
    assert "rank 1" in str(info.value) and "exit code 3" in str(info.value)


def test_crash_is_reported_with_signal_and_stack() -> None:
    with pytest.raises(WorkerError) as info:
        run_distributed(_segfault, 1, timeout=60)
    assert "killed by signal SIGSEGV" in info.value.errors[0]
    assert "_segfault" in info.value.errors[0]  # faulthandler's Python stack


def test_large_results_do_not_deadlock() -> None:
    nbytes = 16 * 2**20  # far beyond a pipe's buffer
    results = run_distributed(_large_result, 2, nbytes, timeout=60)
    assert [r[:1] for r in results] == [b"\0", b"\1"] and {len(r) for r in results} == {nbytes}


def test_unpicklable_result_is_an_error() -> None:
    with pytest.raises(WorkerError, match=r"PicklingError|Can't pickle|cannot pickle"):
        run_distributed(_return_lambda, 1, timeout=60)


def test_init_process_group_false_uses_torchrun_env() -> None:
    assert run_distributed(_init_from_env, 2, init_process_group=False, timeout=60) == [
        (0, 2.0),
        (1, 2.0),
    ]


def test_free_port() -> None:
    port = free_port()
    assert 0 < port < 65536


# --- run_python: `python ...` from a preloaded fork ----------------------------------------

PROBE = """
import atexit, importlib.util, json, multiprocessing, os, sys
import torch
import torchshard._exit as e

atexit.register(lambda: print("at exit: failing", e.failing()))
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
    "foo": os.environ.get("FOO"), "start": multiprocessing.get_start_method(),
    "threads": torch.get_num_threads(),
    "suite": [m for m in ("gpt", "multiprocess") if importlib.util.find_spec(m)],
}))
code = sys.argv[-1]
if code == "raise":
    raise RuntimeError("raised here")
if code != "ok":
    raise SystemExit(int(code) if code.isdigit() else code)
"""


@pytest.mark.parametrize("how", ["ok", "3", "a message", "raise"])
@pytest.mark.parametrize("run", ["script", "-m"])
def test_run_python_is_what_python_does(tmp_path: Path, how: str, run: str) -> None:
    """The oracle is python itself: the same script (or module), arguments, env and cwd give
    the same output, exit code and exit-time state (at exit, whether an exception is
    leaving)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"FOO": "bar", "OMP_NUM_THREADS": "1"}
    argv = [str(script) if run == "script" else "-m", *(["probe"] if run == "-m" else [])]
    argv += ["--flag", how]
    want = subprocess.run(
        [sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    got = run_python(argv, tmp_path, env)
    assert got.args == [sys.executable, *argv]
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout), (got, want)
    assert want.stdout.count("at exit: failing") == 1, want
    # the traceback names one more frame (the harness's exec): compare its last lines
    assert got.stderr.splitlines()[-1:] == want.stderr.splitlines()[-1:], (got, want)
    code = run_python(["-c", "import sys; print(sys.argv, sys.path[0] == '')", "x"], tmp_path, env)
    assert (code.returncode, code.stdout) == (0, "['-c', 'x'] True\n"), code


def test_run_python_puts_pythonpath_where_python_does(tmp_path: Path) -> None:
    """PYTHONPATH's entries come after the first entry and before the standard library,
    absolute ('' is the cwd), each once; python itself is the oracle (``-c`` without torch:
    a fresh start is cheap)."""
    for d, value in (("a", "from a"), ("b", "from b")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "probe_mod.py").write_text(f"WHERE = {value!r}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(["a", "", str(tmp_path / "b"), str(tmp_path / "a")])
    code = "import sys, probe_mod; print(probe_mod.WHERE, sys.path[1:4])"
    want = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    got = run_python(["-c", code], tmp_path, env)
    assert want.returncode == 0, want.stderr
    assert want.stdout.startswith("from a ") and str(tmp_path / "b") in want.stdout, want
    assert (got.returncode, got.stdout) == (0, want.stdout), (got, want)


def test_run_python_kills_what_it_started_on_a_timeout(tmp_path: Path) -> None:
    """What the program forked dies with it, in its process group or in a session of its
    own (as torchrun starts its workers)."""
    code = (
        "import os, sys, time\n"
        "for name in ('child', 'session'):\n"
        "    if os.fork() == 0:\n"
        "        if name == 'session':\n"
        "            os.setsid()\n"
        "        open(name, 'w').write(str(os.getpid()))\n"
        "        time.sleep(600)\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", code], tmp_path, dict(os.environ), timeout=3)
    # SIGKILLed: dead once the kernel gets to it; an orphan, it stays a zombie until init
    # reaps it (not this process's child), so "dead" is gone or a zombie
    for name in ("child", "session"):
        pid, status = int((tmp_path / name).read_text()), "gone"
        deadline = time.monotonic() + 30  # a bound for a busy box, not a wait in the good case
        with suppress(psutil.NoSuchProcess):
            while (status := psutil.Process(pid).status()) != psutil.STATUS_ZOMBIE:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        assert status in ("gone", psutil.STATUS_ZOMBIE), f"{name} pid {pid} survived: {status}"
