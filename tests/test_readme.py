"""The README's quickstart runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quickstart_runs():
    snippet = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert snippet, "README has no quickstart snippet"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run(
        [sys.executable, "-c", snippet.group(1)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr


def test_ci_runs_the_readme_test_command():
    command = re.search(r"Run the tests:\n\n```bash\n(.*?)\n```", README.read_text(), re.S)
    assert command
    ci = (README.parent / ".ci" / "run").read_text()
    assert command.group(1) in ci.splitlines()
