"""Run the independent cases of one world size in one spawn, and still show (and fail) one
pytest item per case.

This is torch's ``run_subtests`` pattern, which "amortizes the costly setup overhead (including
process spawn and initializing the process group) over the subtests": the first item of a world
size runs every selected case of that world size in one :func:`run_distributed` call; each item
then asserts on its own case's per-rank results. A case that fails (or hangs) fails its own item
only: the spawn stops there, and the cases after it run again in a fresh spawn.

Usage::

    import torch
    import torch.distributed as dist
    from cases import Cases

    def _scaled_sum(scale: float) -> float:  # module level: children import it by reference
        t = torch.tensor([scale])
        dist.all_reduce(t)
        return t.item()

    SUMS = Cases(_scaled_sum, params=["scale"], timeout=60)

    @pytest.mark.parametrize("world_size", SUMS.world_sizes(2, 3, cases=2))
    @pytest.mark.parametrize("scale", [1.0, 2.0])
    def test_scaled_sum(request, scale, world_size):
        assert SUMS.results(request) == [world_size * scale] * world_size

Each world size's items carry ``xdist_group`` (``conftest.py`` has ``-n`` schedule by group):
one worker runs them, so no case runs twice. Between two cases a rank gets back the state a
fresh process would have (torch's and Python's random state, ``os.environ``, the working
directory), and a case's function must close what it opens (trainers, groups), as it would
have to for the next test of a pytest process.
"""

from __future__ import annotations

import faulthandler
import math
import os
import pickle
import random
import tempfile
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import WorkerError, WorkerTimeout, run_distributed

__all__ = ["CaseFailed", "Cases"]


class CaseFailed(RuntimeError):
    """Raised in a rank when one case's function raised, naming the case (the cause chained)."""


def _run_cases(
    fn: Callable[..., Any], cases: list[tuple[str, tuple]], outdir: str, timeout: float
) -> None:
    """In each rank: run ``cases`` in order, each from the state the rank started in; after
    each, write its result to ``outdir/<index>.<rank>`` (so the parent sees how far it got).
    A case still running after ``timeout`` s writes every thread's stack to
    ``outdir/<index>.<rank>.hung`` and exits the rank (faulthandler's watchdog: it fires
    even while the rank waits in a collective)."""
    rank = dist.get_rank()
    rng, py_rng = torch.get_rng_state(), random.getstate()
    environ, cwd = dict(os.environ), os.getcwd()
    for i, (name, args) in enumerate(cases):
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        with open(os.path.join(outdir, f"{i}.{rank}.hung"), "w") as hung:
            faulthandler.dump_traceback_later(timeout, exit=True, file=hung)
            try:
                value = fn(*args)
            except BaseException as e:
                raise CaseFailed(f"case {name} failed on rank {rank}") from e
            finally:
                faulthandler.cancel_dump_traceback_later()
        with open(os.path.join(outdir, f"{i}.{rank}"), "wb") as f:
            pickle.dump(value, f)


def _hung(
    outdir: str, i: int, world_size: int, error: WorkerError, case: str, timeout: float
) -> WorkerError:
    """``error`` as a WorkerTimeout naming case ``i``'s ranks that hung, with their stacks."""
    stacks = {}
    for r in range(world_size):
        with suppress(OSError), open(os.path.join(outdir, f"{i}.{r}.hung")) as f:
            if text := f.read():
                stacks[r] = text
    if not stacks:
        return error
    head = f"case {case}: ranks {list(stacks)} did not finish within {timeout:g} s; their stacks:"
    body = "".join(f"\n--- rank {r} ---\n{t.rstrip()}" for r, t in stacks.items())
    return WorkerTimeout(head + body, stacks, error.pids, list(stacks))


class Cases:
    """The items of one test function that differ in ``params`` only, per world size:
    ``fn(*(the item's value of each of params))`` in every rank of the item's world size.

    Args:
        fn: a module-level function, run as by :func:`run_distributed`.
        params: the test's parameter names that make a case (besides ``world_size``), in the
            order of ``fn``'s positional arguments.
        timeout: seconds one case may take (a spawn of n cases gets n times as long).
        world_size: for a test without a ``world_size`` parameter: the world of every case.
        **kwargs: further keyword arguments of :func:`run_distributed` (``env``, ...).

    Example::

        PARITY = Cases(_parity_with_ddp, params=["case", "shard"], timeout=180)
        ranks = PARITY.results(request)   # [rank 0's return value, rank 1's, ...]
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        params: Sequence[str],
        timeout: float,
        world_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.fn, self.params, self.timeout, self.kwargs = fn, tuple(params), timeout, kwargs
        self.world_size = world_size
        self._got: dict[int, dict[str, list[Any] | BaseException]] = {}

    def marks(self, world_size: int, *, cases: int) -> list[pytest.MarkDecorator]:
        """The marks of the items of one world size: an ``xdist_group`` of their own, and a
        pytest timeout for the spawn of their ``cases`` cases.

        Example::

            @pytest.mark.parametrize("world_size", [pytest.param(2, marks=PARITY.marks(2, cases=6))])
        """
        group = f"{self.fn.__module__}.{self.fn.__name__}-{world_size}"
        return [pytest.mark.xdist_group(group), pytest.mark.timeout(self.timeout * cases + 60)]

    def mark(self, *, cases: int) -> Callable[[Any], Any]:
        """:meth:`marks` of ``self.world_size`` as one decorator, for a test of one world size.

        Example::

            READS = Cases(_reads, params=["shard"], timeout=120, world_size=2)

            @pytest.mark.parametrize("shard", [False, True])
            @READS.mark(cases=2)
            def test_reads(request, shard): ...
        """
        assert self.world_size is not None, "Cases(world_size=...) for a test of one world"

        def apply(test: Any) -> Any:
            for m in self.marks(self.world_size, cases=cases):
                test = m(test)
            return test

        return apply

    def world_sizes(self, *sizes: int, cases: int) -> list[Any]:
        """``sizes`` as ``pytest.param`` values of a ``world_size`` parameter, each with
        :meth:`marks` (``cases``: how many cases one world size has).

        Example::

            @pytest.mark.parametrize("world_size", PARITY.world_sizes(2, 3, cases=6))
        """
        return [pytest.param(n, marks=self.marks(n, cases=cases), id=str(n)) for n in sizes]

    def results(self, request: pytest.FixtureRequest) -> list[Any]:
        """This item's case's return value in each rank, by rank: from the spawn of every case
        of its world size that this session runs (started at the first of them). Raises the
        spawn's :class:`WorkerError` where this case failed or hung.

        Example::

            assert all(r["worst"] == 0.0 for r in PARITY.results(request))
        """
        world_size, case, args = self._case(request.node)
        got = self._got.setdefault(world_size, {})
        if case not in got:
            todo = {k: a for k, a in self._selected(request, world_size).items() if k not in got}
            todo.setdefault(case, args)
            try:
                got.update(self._spawn(world_size, todo, _budget(request.node)))
            except BaseException as e:  # pytest-timeout's, ^C: the other items fail at once
                got.update({k: e for k in todo if k not in got})
                raise
        value = got[case]
        if isinstance(value, BaseException):
            raise value
        return value

    def _case(self, item: pytest.Item) -> tuple[int, str, tuple]:
        params = item.callspec.params  # type: ignore[attr-defined]
        args = tuple(params[p] for p in self.params)
        return params.get("world_size", self.world_size), repr(args), args

    def _selected(self, request: pytest.FixtureRequest, world_size: int) -> dict[str, tuple]:
        """The cases of this test function at ``world_size`` among the session's items (after
        ``-k`` and the like), in session order: case -> ``fn``'s arguments."""
        out = {}
        for item in request.session.items:
            if getattr(item, "function", None) is not request.function:
                continue
            n, case, args = self._case(item)
            if n == world_size:
                out[case] = args
        return out

    def _spawn(
        self, world_size: int, cases: dict[str, tuple], budget: float
    ) -> dict[str, list[Any] | BaseException]:
        """Run ``cases`` in one spawn; where a case fails, it gets the error and the cases
        after it run in a fresh spawn."""
        out: dict[str, list[Any] | BaseException] = {}
        pending = list(cases)
        while pending:
            # an outer bound only: each rank's watchdog ends a hung case after self.timeout
            timeout = min(self.timeout * len(pending) + 30, budget)
            with tempfile.TemporaryDirectory(prefix="cases-") as outdir:
                error: WorkerError | None = None
                try:
                    run_distributed(
                        _run_cases,
                        world_size,
                        self.fn,
                        [(k, cases[k]) for k in pending],
                        outdir,
                        self.timeout,
                        timeout=timeout,
                        **self.kwargs,
                    )
                except WorkerError as e:
                    error = e
                done = 0
                for i, case in enumerate(pending):
                    paths = [os.path.join(outdir, f"{i}.{r}") for r in range(world_size)]
                    if not all(os.path.exists(p) for p in paths):
                        break
                    out[case] = [_load(p) for p in paths]
                    done += 1
                if error is not None and done < len(pending):
                    error = _hung(outdir, done, world_size, error, pending[done], self.timeout)
            if error is None and done == len(pending):
                break
            # the first case not finished on every rank is where a rank failed or hung
            out[pending[done]] = error or WorkerError(f"case {pending[done]}: no result")
            pending = pending[done + 1 :]
        return out


def _budget(item: pytest.Item) -> float:
    """Seconds for a spawn started by ``item``: within its pytest timeout, so a hang fails
    as a WorkerTimeout with each rank's stack rather than as pytest-timeout's."""
    mark = item.get_closest_marker("timeout")
    if mark and mark.args:
        limit = float(mark.args[0])
    else:
        try:
            limit = float(item.config.getini("timeout") or math.inf)
        except ValueError:  # -p no:timeout: no such ini key
            limit = math.inf
    return max(limit - 30.0, 1.0)


def _load(path: str) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)
