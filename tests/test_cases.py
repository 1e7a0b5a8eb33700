"""Tests of tests/cases.py (a world size's cases in one spawn), with real processes."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from cases import Cases
from multiprocess import WorkerError, WorkerTimeout


def _case(name: str) -> dict:
    """Fails on rank 1 in case "fails", hangs in case "hangs"; else reports what a fresh
    process would see (and then disturbs it, for the next case to not see)."""
    if name == "fails" and dist.get_rank() == 1:
        raise ValueError("boom")
    if name == "hangs" and dist.get_rank() == 0:  # rank 1 waits for it in the all-reduce
        time.sleep(3600)
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    seen = {
        "sum": t.item(),
        "torch": torch.rand(1).item(),
        "random": random.random(),
        "env": os.environ.get("CASES_TEST_LEFTOVER"),
    }
    torch.manual_seed(1234)
    random.seed(1234)
    os.environ["CASES_TEST_LEFTOVER"] = name
    return seen


def _spawn(names: list[str], timeout: float = 60) -> dict:
    cases = Cases(_case, params=["name"], timeout=timeout)
    return cases._spawn(2, {repr((n,)): (n,) for n in names}, budget=timeout * len(names))


def test_each_case_starts_from_a_fresh_process_state():
    got = _spawn(["a", "b", "c"])
    a, b, c = (got[repr((n,))] for n in "abc")
    assert [r["sum"] for r in a] == [3.0, 3.0]
    assert a == b == c  # the random states and the environment as at the start of the rank
    assert a[0]["env"] is None


def test_a_failing_case_fails_alone_and_the_cases_after_it_still_run():
    got = _spawn(["a", "fails", "c"])
    assert isinstance(got["('fails',)"], WorkerError)
    assert "case ('fails',) failed on rank 1" in str(got["('fails',)"])
    assert "ValueError: boom" in str(got["('fails',)"])
    assert [r["sum"] for r in got["('a',)"]] == [3.0, 3.0]
    assert [r["sum"] for r in got["('c',)"]] == [3.0, 3.0]  # in a fresh spawn


@pytest.mark.timeout(60)
def test_a_hanging_case_times_out_alone_with_the_stacks():
    got = _spawn(["a", "hangs", "c"], timeout=2)
    error = got["('hangs',)"]
    assert isinstance(error, WorkerTimeout), error
    assert "case ('hangs',): ranks" in str(error) and "within 2 s" in str(error), error
    assert 'test_cases.py", line' in str(error) and "in _case" in str(error)  # the stacks
    assert [r["sum"] for r in got["('c',)"]] == [3.0, 3.0]
