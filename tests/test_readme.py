"""Everything in the README and docs/ runs: every python block, every linked file, the commands."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import multiprocess
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -c code`` as a user runs a snippet, outside any launcher (multiprocess's
    run_python: a preloaded fork, not 3 s of imports per snippet)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PYTEST_XDIST"))
    }
    return multiprocess.run_python(["-c", code], cwd, env, timeout=240)


BLOCKS = [
    pytest.param(path, i, id=f"{path.name}-{i}")
    for path in (README, *DOCS)
    for i in range(len(python_blocks(path)))
]


@pytest.mark.parametrize(("path", "index"), BLOCKS)
def test_python_block_runs(path, index, tmp_path):
    if path.parent.name == "docs" and "import transformers" in python_blocks(path)[index]:
        pytest.importorskip("transformers")
    out = run_python(python_blocks(path)[index], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr


def test_the_readme_has_a_short_quickstart():
    blocks = python_blocks(README)
    assert blocks and re.search(r"## Quickstart\n\n```python\n", README.read_text())
    code = [ln for ln in blocks[0].splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert len(code) <= 18, len(code)  # 3 of them print the global mean loss, once


def test_the_checkpoint_snippet_resumes_where_it_stopped(tmp_path):
    snippet = python_blocks(README)[1]
    for _ in range(2):
        out = run_python(snippet, tmp_path)
        assert out.returncode == 0, out.stderr
    steps = sorted(p.name for p in (tmp_path / "runs" / "quickstart").iterdir())
    assert steps == ["step-00000019", "step-00000020"]


@pytest.mark.parametrize("path", [README, *DOCS, ROOT / "CONTRIBUTING.md"], ids=lambda p: p.name)
def test_linked_and_named_files_exist(path):
    text = path.read_text()
    links = re.findall(r"\]\(([^)#:]+)\)", text)
    named = re.findall(
        r"(?<![\w/.-])((?:examples|docs|benchmarks|tests)/[\w./-]+\.(?:py|sh|md|json))", text
    )
    for ref in links:
        assert (path.parent / ref).exists(), f"{path.name} links to {ref}"
    for ref in named:
        assert (ROOT / ref).exists(), f"{path.name} names {ref}"


def test_readme_commands_name_real_scripts_and_subcommands():
    from torchshard._cli import main

    text = "\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(), re.S))
    commands = re.findall(r"^(torchshard \w+)", text, re.M)
    assert {"torchshard inspect", "torchshard consolidate", "torchshard estimate"} <= set(commands)
    for sub in {c.split()[1] for c in commands}:
        with pytest.raises(SystemExit) as e:
            main([sub, "--help"])
        assert e.value.code == 0
    for line in re.findall(r"^(?:torchrun|python|bash) .*$", text, re.M):
        scripts = [w for w in line.split() if w.endswith((".py", ".sh"))]
        for s in scripts:
            if s != "quickstart.py":  # the reader saves the snippet as this
                assert (ROOT / s).exists(), line


def test_ci_runs_the_readme_test_command():
    command = re.search(r"Run the tests:\n\n```bash\n(.*?)\n```", README.read_text(), re.S)
    assert command
    ci = (README.parent / ".ci" / "run").read_text()
    assert command.group(1) in ci.splitlines()
