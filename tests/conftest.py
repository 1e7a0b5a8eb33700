from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

# -- a hermetic CPU suite: GPUs are hidden unless asked for --------------------------------------
# On a GPU box, code that picks its backend from torch.cuda.is_available() (init_distributed:
# NCCL, one GPU per local rank) would turn the gloo tests into NCCL runs, with 3 ranks on 2 GPUs
# ("Duplicate GPU detected"). So the CPU suite runs with CUDA_VISIBLE_DEVICES="": set here, at
# conftest import, the earliest a conftest runs (before any test module imports torch's CUDA
# state; importing torch does not initialize CUDA, and CUDA reads the variable when it does).
# Every child inherits it: run_distributed copies os.environ into each rank, subprocess and
# torchrun calls build their env from os.environ, and xdist workers start after this point.
#
# GPUs stay visible with `-m gpu` (only the GPU tests) or `--gpu` (the whole suite, GPUs
# visible); pytest_configure restores the original value then, before anything used CUDA.
_HIDDEN = "CUDA_VISIBLE_DEVICES"
_ORIGINAL = os.environ.get(_HIDDEN)  # None: unset
os.environ[_HIDDEN] = ""

# The example's GPT model is the project's reference model for tests and benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

# Shared fixtures of the checkpoint tests (single_thread, saved).
pytest_plugins = ["checkpoint_harness"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu",
        action="store_true",
        default=False,
        help="keep CUDA devices visible and run the tests marked gpu "
        "(default: CUDA_VISIBLE_DEVICES='' for the whole session, gpu tests skipped)",
    )


def _selects_gpu(markexpr: str) -> bool:
    """Whether ``-m markexpr`` selects a test marked ``gpu`` (and nothing else)."""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser

        return bool(Expression.compile(markexpr).evaluate(lambda name, **_: name == "gpu"))
    except Exception:  # a private API: fall back to reading the words
        words = markexpr.replace("(", " ").replace(")", " ").split()
        return "gpu" in words and "not gpu" not in " ".join(words)


def gpus_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("--gpu")) or _selects_gpu(config.getoption("markexpr") or "")


def _require_timeouts(config: pytest.Config) -> None:
    """Stop at start when pytest-timeout is missing: without it ``timeout = 300`` and every
    ``@pytest.mark.timeout`` are inert (pytest only warns of an unknown option) and a hung
    collective hangs the run instead of failing its test. ``-p no:timeout`` is a choice, and
    allowed (under a debugger, say)."""
    plugins = config.pluginmanager
    if plugins.hasplugin("timeout") or plugins.is_blocked("timeout"):
        return
    pytest.exit(
        "pytest-timeout: expected the plugin (every multi-process test relies on its timeout), "
        "got none loaded; install the test extra (pip install -e '.[test]'), or pass "
        "-p no:timeout to run without timeouts on purpose",
        returncode=pytest.ExitCode.USAGE_ERROR,
    )


def _schedule_by_group(config: pytest.Config) -> None:
    """With ``-n``: ``--dist loadgroup`` in place of xdist's default ``load``, in the order
    the workers collected (see :func:`_ordered_for_workers`). The items that share one spawn
    (``cases.Cases``) or one module-scoped fixture carry an ``xdist_group``: ``load`` would
    spread them over the workers, and each worker would run the spawn or fixture again."""
    if getattr(config.option, "numprocesses", None) and config.getoption("dist") == "load":
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput.get("torchshard_loadgroup"):
        # a worker takes loadgroup from the command line, not from the controller's options
        config.option.loadgroup = True


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, in the controller: tell each worker that the run schedules by group."""
    if node.config.getoption("dist") == "loadgroup":
        node.workerinput["torchshard_loadgroup"] = True


_SOURCES = ("torchshard", "examples", "tests", "benchmarks")


def _compile_sources(config: pytest.Config) -> None:
    """Write the bytecode of the project's own sources once, in the controller, before any
    process starts. Each fresh interpreter the suite starts (about 200: torchrun's workers,
    the command-line tools) otherwise compiles torchshard again when PYTHONDONTWRITEBYTECODE
    is set, as on the CI machines: about 0.5 CPU-s a worker, measured on a 2-rank launch of
    the example. Python reads the cached bytecode all the same and checks it against each
    source's mtime and size, as on any machine without that variable; the installed
    packages (torch, transformers) have theirs from pip. A file it cannot write it skips."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller did it
        return
    import compileall

    root = Path(__file__).resolve().parent.parent
    for name in _SOURCES:
        compileall.compile_dir(root / name, quiet=2)


def pytest_configure(config: pytest.Config) -> None:
    _require_timeouts(config)
    _schedule_by_group(config)
    _compile_sources(config)
    if gpus_requested(config):
        if _ORIGINAL is None:
            os.environ.pop(_HIDDEN, None)
        else:
            os.environ[_HIDDEN] = _ORIGINAL
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # A plugin initialized CUDA before this file ran: this process keeps its GPUs (the
        # children, which read the variable afresh, still see none).
        config.issue_config_time_warning(
            pytest.PytestConfigWarning(
                "CUDA was initialized before tests/conftest.py could hide the GPUs; "
                "the pytest process itself may still use them"
            ),
            stacklevel=2,
        )


def _module_fixture_group(item: pytest.Item) -> str | None:
    """The group of an item that uses a fixture of its own module broader than a function
    (a save, an oracle run): every item of the module that uses one runs on one worker."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    module = getattr(getattr(item, "module", None), "__name__", None)
    for fixturedefs in defs.values():
        for d in fixturedefs:
            if d.scope != "function" and getattr(d.func, "__module__", None) == module:
                return f"{module}-module-fixtures"
    return None


def _ordered_for_workers(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker scheduling by group: group the items that share a module-scoped
    fixture, then put the longest work first so that the workers end together: the ``slow``
    items (real launchers, mostly), then the groups (one spawn or fixture for many items),
    then the rest in collection order. Every worker computes the same order."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        group = None if item.get_closest_marker("xdist_group") else _module_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))

    def cost(item: pytest.Item) -> int:
        if item.get_closest_marker("slow"):
            return 0
        return 1 if item.get_closest_marker("xdist_group") else 2

    items.sort(key=cost)  # stable: collection order within each tier


@pytest.hookimpl(tryfirst=True)  # before xdist names the groups in the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _ordered_for_workers(config, items)
    if gpus_requested(config):
        return
    skip = pytest.mark.skip(
        reason="GPU test: run `python -m pytest -m gpu` (this session hides CUDA: "
        "CUDA_VISIBLE_DEVICES='')"
    )
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _as_at_exit():
    """After each test, what interpreter exit does: close the trainers it left open and destroy
    the process group init_distributed made (since close() leaves that to exit). The tests
    share a process, and a later one may need to start uninitialized."""
    yield
    from torchshard import _exit

    _exit._at_exit()
