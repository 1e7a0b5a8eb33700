"""The suite's own guards: a misspelt marker is an error, a venv without pytest-timeout
stops at start (without it every timeout is inert and a hung collective hangs the run), the
project's bytecode is written before the tests start processes, and the test extra installs
every module a test would skip without."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_run(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | env
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_misspelt_marker_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "test_typo.py").write_text(
        "import pytest\n\n\n@pytest.mark.slwo\ndef test_typo():\n    pass\n"
    )
    run = pytest_run("-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "test_typo.py", cwd=tmp_path)  # fmt: skip
    assert run.returncode != 0, run.stdout
    assert "'slwo' not found in `markers`" in run.stdout, run.stdout


def test_the_suite_stops_at_start_without_the_timeout_plugin() -> None:
    # No entry-point plugins: pytest-timeout is not loaded, as in a venv without it.
    run = pytest_run(
        "--collect-only", "-q", "tests/test_flat_layout.py", cwd=ROOT, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"
    )  # fmt: skip
    assert run.returncode == 4, run.stdout + run.stderr
    assert "pytest-timeout: expected the plugin" in run.stdout + run.stderr
    assert "test_flat_layout.py::" not in run.stdout  # nothing collected, let alone run


def test_the_projects_bytecode_is_written_before_the_tests_run() -> None:
    """conftest.py compiled every module of torchshard/ and examples/ at start (the fresh
    interpreters the launch tests start would compile them again where
    PYTHONDONTWRITEBYTECODE is set); each cached file is current as python checks it (the
    source's mtime and size, or its hash)."""
    if not os.access(ROOT / "torchshard", os.W_OK):
        pytest.skip("a read-only tree: no bytecode can be written there")
    stale = []
    sources = [*(ROOT / "torchshard").rglob("*.py"), *(ROOT / "examples").glob("*.py")]
    for source in sorted(sources):
        cached = Path(importlib.util.cache_from_source(str(source)))
        header = cached.read_bytes()[:16] if cached.exists() else b""
        flags, st = int.from_bytes(header[4:8], "little"), source.stat()
        if flags == 0:  # timestamp-checked: the source's mtime and size
            current = header[8:16] == (
                (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
            )
        else:  # hash-checked (compileall's default when SOURCE_DATE_EPOCH is set)
            current = header[8:16] == importlib.util.source_hash(source.read_bytes())
        current = current and len(header) == 16
        if not current:
            stale.append(str(source.relative_to(ROOT)))
    assert not stale, f"no current bytecode for {stale}"


def _extra_closure(extra: str) -> set[str]:
    """The distributions that ``pip install -e '.[extra]'`` asks for by name, through the
    project's own extras (``torchshard-lite[hf,peft]`` inside ``test``), normalized; read
    from the installed metadata (Python 3.10 has no tomllib)."""
    name = "torchshard-lite"
    requires = importlib.metadata.requires(name) or []
    wanted, seen, todo = set(), set(), [extra]
    while todo:
        if (current := todo.pop()) in seen:
            continue
        seen.add(current)
        for req in requires:
            if f'extra == "{current}"' not in req:
                continue
            dist = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
            if dist == name:
                todo += re.search(r"\[(.*?)\]", req).group(1).split(",")
            else:
                wanted.add(dist)
    return wanted


def test_the_test_extra_installs_every_module_a_test_would_skip_without() -> None:
    """A test whose optional module is missing skips (``pytest.importorskip``), so an
    install without it passes with tests quietly not run: matplotlib, not in the test extra
    until now, skipped the plot test on every machine that lacked it. Each module the suite
    importorskips must come with the README's test install, and be there."""
    skipped_without = set()
    for path in (ROOT / "tests").glob("*.py"):
        skipped_without |= set(re.findall(r"importorskip\(\"(\w+)\"\)", path.read_text()))
    assert {"transformers", "matplotlib"} <= skipped_without  # the scan finds them
    extra = _extra_closure("test")
    owners = importlib.metadata.packages_distributions()
    for module in sorted(skipped_without):
        dists = {d.lower().replace("_", "-") for d in owners.get(module, [module])}
        assert dists & extra, f"tests importorskip {module!r}: add it to the test extra"
        assert importlib.util.find_spec(module) is not None, (
            f"{module!r}: expected with the test extra, got none installed; "
            "pip install -e '.[test]'"
        )
