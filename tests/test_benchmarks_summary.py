"""benchmarks/summary.py: the README tables are generated from benchmarks/results/*.json."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "summary.py"


def load_summary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmarks_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


summary = load_summary()


def regenerate_hint(path: Path) -> str:
    return f"run: python benchmarks/summary.py --write {path.relative_to(REPO)}"


def test_benchmarks_readme_table_is_up_to_date() -> None:
    path = REPO / "benchmarks" / "README.md"
    assert summary.main(["--check", str(path)]) == 0, regenerate_hint(path)
    assert "not measured yet" not in path.read_text()


def test_top_level_readme_table_is_up_to_date() -> None:
    path = REPO / "README.md"
    if summary.BEGIN not in path.read_text():
        pytest.skip(f"README.md has no '{summary.BEGIN}' marker: no generated table there yet")
    assert summary.main(["--check", str(path)]) == 0, regenerate_hint(path)


def test_every_row_is_measured_from_the_results() -> None:
    results = summary.load_results(summary.RESULTS)
    assert set(results) == set(summary.FILES)
    for row in summary.ROWS:
        assert summary.measured(row, results) != summary.NOT_MEASURED, row.what


@pytest.mark.parametrize("missing", summary.FILES)
def test_missing_results_file_gives_not_measured_rows(
    missing: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in summary.FILES:
        if name != missing:
            shutil.copy(summary.RESULTS / f"{name}.json", tmp_path)
    assert summary.main(["--results", str(tmp_path)]) == 0
    rows = {
        line.split(" | ")[0].removeprefix("| "): line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and " | measured | " not in line
    }
    assert len(rows) == len(summary.ROWS)
    for row in summary.ROWS:
        assert (summary.NOT_MEASURED in rows[row.what]) == (missing in row.needs), row.what


def test_no_results_at_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert summary.main(["--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(summary.NOT_MEASURED) == len(summary.ROWS) + 1  # + the machine line


def test_write_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "doc.md"
    path.write_text(f"# title\n\n{summary.BEGIN}\nold table\n{summary.END}\n\ntail\n")
    assert summary.main(["--check", str(path)]) == 1
    assert str(path) in capsys.readouterr().err
    assert summary.main(["--write", str(path)]) == 0
    text = path.read_text()
    assert text.startswith(f"# title\n\n{summary.BEGIN}\n| what | measured | target |\n")
    assert text.endswith(f"\n{summary.END}\n\ntail\n")
    assert "old table" not in text
    assert summary.main(["--check", str(path)]) == 0


def test_write_without_markers_exits_2_naming_the_file(tmp_path: Path) -> None:
    marked = tmp_path / "marked.md"
    marked.write_text(f"{summary.BEGIN}\n{summary.END}\n")
    plain = tmp_path / "plain.md"
    plain.write_text("# no markers here\n")
    cmd = [sys.executable, str(SCRIPT), "--write", str(marked), str(plain)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert str(plain) in proc.stderr
    assert plain.read_text() == "# no markers here\n"
    assert marked.read_text() == f"{summary.BEGIN}\n{summary.END}\n"  # nothing written
