"""The suite's own guards: a misspelt marker is an error, a venv without pytest-timeout
stops at start (without it every timeout is inert and a hung collective hangs the run), and
the project's bytecode is written before the tests start processes."""

from __future__ import annotations

import os
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
    import importlib.util

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
