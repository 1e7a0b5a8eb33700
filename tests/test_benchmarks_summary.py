"""benchmarks/summary.py: the README tables are generated from benchmarks/results/*.json, and
those results are not older than the code they measure."""

from __future__ import annotations

import importlib.util
import json
import os
import re
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


summary = load_summary()  # puts benchmarks/ on sys.path: report/ and rows/ import from there
from report import stats  # noqa: E402

RUN_ALL = "python benchmarks/run_all.py"


def regenerate_hint(path: Path) -> str:
    return f"run: {RUN_ALL} (or python benchmarks/summary.py --write {path.relative_to(REPO)})"


# -- the committed tables and results ----------------------------------------------------------------


def test_benchmarks_readme_table_is_up_to_date() -> None:
    path = REPO / "benchmarks" / "README.md"
    assert summary.main(["--check", str(path)]) == 0, regenerate_hint(path)
    assert "not measured yet" not in path.read_text()


def test_top_level_readme_table_is_up_to_date() -> None:
    path = REPO / "README.md"
    # The README must carry the table: without the marker the check would be silenced.
    assert summary.BEGIN in path.read_text(), f"README.md has no '{summary.BEGIN}' marker"
    assert summary.main(["--check", str(path)]) == 0, regenerate_hint(path)


def test_every_row_is_measured_from_the_results() -> None:
    results = summary.load_results(summary.RESULTS)
    assert set(results) == {*summary.FILES, summary.RUN}, f"run: {RUN_ALL}"
    for row in summary.ROWS:
        assert summary.measured(row, results)[0] != summary.NOT_MEASURED, row.what


def test_every_measured_path_exists() -> None:
    # A misspelt path would make `git log -- <path>` empty forever: never stale.
    for name, paths in summary.MEASURES.items():
        for path in paths:
            assert (REPO / path).exists(), (name, path)
    assert set(summary.MEASURES) == set(summary.FILES)


def test_benchmarks_import_nothing_from_tests() -> None:
    for script in (REPO / "benchmarks").rglob("*.py"):
        text = script.read_text()
        assert not re.search(r"""["'/]tests["'/]|from multiprocess |import multiprocess""", text), (
            script.name
        )


# -- the table's mechanics -------------------------------------------------------------------------


@pytest.mark.parametrize("missing", summary.FILES)
def test_missing_results_file_gives_not_measured_rows(missing: str, tmp_path: Path) -> None:
    full = summary.load_results(summary.RESULTS)
    for name in summary.FILES:
        if name != missing and (summary.RESULTS / f"{name}.json").exists():
            shutil.copy(summary.RESULTS / f"{name}.json", tmp_path)
    partial = summary.load_results(tmp_path)
    for row in summary.ROWS:
        if missing in row.needs:
            assert summary.measured(row, partial) == (summary.NOT_MEASURED, "-"), row.what
        else:  # untouched by the missing file
            assert summary.measured(row, partial) == summary.measured(row, full), row.what


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
    assert text.startswith(
        f"# title\n\n{summary.BEGIN}\n| what | how | result | target | verdict |\n"
    )
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


def test_spread_is_p10_p90_from_ten_pairs_on_and_min_max_below() -> None:
    few = stats.Spread.of([1.0, 3.0, 2.0])
    assert (few.median, few.lo, few.hi, few.kind) == (2.0, 1.0, 3.0, "min-max")
    many = stats.Spread.of([float(x) for x in range(1, 22)])  # 1..21
    assert (many.median, many.lo, many.hi, many.kind) == (11.0, 3.0, 19.0, "p10-p90")
    assert stats.spread_text([1.0, 3.0, 2.0]) == "2.00x (min-max 1.00-3.00)"


def test_a_target_is_met_only_when_the_paired_ratios_mostly_meet_it() -> None:
    ratios = [0.9] * 8 + [1.5] * 2  # median 0.9 either way
    assert stats.verdict(ratios, 1.0) == "met (8 of 10 <= 1)"
    assert stats.verdict([0.9] * 7 + [1.5] * 3, 1.0).startswith("unclear (7 of 10")
    assert stats.verdict([0.9] * 2 + [1.5] * 8, 1.0).startswith("missed (2 of 10")
    # the audit's case: a median under the target, most pairs over it
    assert stats.verdict([1.2, 1.25, 1.33, 1.45, 2.49], 1.3).startswith("unclear (2 of 5")


# -- the fully sharded rows, on made-up results --------------------------------------------------


def row(what: str) -> summary.Row:
    (found,) = (r for r in summary.ROWS if r.what.startswith(what))
    return found


def full_results(by_world: dict[str, list[float]], memory: dict[str, list[float]]) -> dict:
    """A full.json with owner/native ratios per world size and full/replicated RSS ratios
    per allocator (every other number made up)."""
    ranks = [{"memory_bytes": {k: 1 << 20 for k in stats.PERSISTENT}}]
    launch = {k: {"ranks": ranks} for k in ("full", "replicated")}
    return {
        "full": {
            "memory": {
                "target": 0.5,
                "by_allocator": {
                    alloc: {
                        "paired": {"full / replicated": xs},
                        "max_growth_by_round": {"full": [1.0], "replicated": [2.0]},
                        "rounds": [launch],
                    }
                    for alloc, xs in memory.items()
                },
            },
            "collectives": {
                "by_world": {
                    world: {
                        "units": {
                            unit: {"paired": {"both": {"wall": xs, "cpu": xs}}}
                            for unit in ("gpt2_block", "small_block")
                        }
                    }
                    for world, xs in by_world.items()
                }
            },
        }
    }


def test_gloo_rows_name_the_faster_strategy_at_each_world_size() -> None:
    results = full_results(
        {"2": [0.5] * 10, "3": [1.5] * 10, "4": [0.5] * 6 + [1.5] * 4}, {"glibc": [0.4]}
    )
    cell, verdict_cell = summary.measured(row("gloo: gather + reduce-scatter"), results)
    assert verdict_cell == (
        "2: owner (10 of 10 owner <= native); 3: native (0 of 10 owner <= native); "
        "4: unclear (6 of 10 owner <= native)"
    )
    assert cell.startswith("2 ranks: wall 0.50x") and cell.endswith("; 10 repetitions")


def test_the_memory_row_gives_one_verdict_per_allocator() -> None:
    results = full_results({"2": [1.0]}, {"glibc": [0.6, 0.7], "mmap_128k": [0.4, 0.45]})
    cell, verdict_cell = summary.measured(row("peak RSS growth per rank"), results)
    assert verdict_cell == (
        "glibc: missed (0 of 2 <= 0.5); `MALLOC_MMAP_THRESHOLD_=131072`: met (2 of 2 <= 0.5)"
    )
    assert "2 rounds of fresh launches" in cell


def test_the_bytes_row_is_met_only_within_one_percent_of_the_analytic() -> None:
    def results(measured: float) -> dict:
        ratio = {"measured": measured, "analytic": 1.47, "all_elements": 100, "kept_elements": 6}
        comm = {"zero_bytes": 1, "bytes_gathered": 1, "bytes_reduced": 1, "constant": True}
        names = ("ts_repl", "ts_shard", "ts_full")
        return {
            "sharded": {
                "bytes_ratio": {"ts_full / ts_repl": ratio, "ts_full_bf16 / ts_shard_bf16": ratio},
                "comm_bytes": {name: dict(comm) for name in names},
            }
        }

    what = row("bytes communicated per step")
    assert summary.measured(what, results(1.47 * 1.009))[1] == "met"
    assert summary.measured(what, results(1.5))[1] == "missed"
    assert summary.measured(what, {"sharded": {}}) == (summary.NOT_MEASURED, "-")  # older file


# -- staleness, on a scratch repository ------------------------------------------------------------

GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def commit_file(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    git(repo, "add", path)
    git(repo, "commit", "-q", "-m", f"change {path}")
    return git(repo, "rev-parse", "HEAD")


def results_at(commit: str | None, dirty: list[str] | None = None) -> dict:
    machine = {"git_commit": commit, "git_dirty": [] if dirty is None else dirty}
    return {name: {"machine": dict(machine)} for name in (*summary.FILES, summary.RUN)}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.fail("git is required: the freshness check of the benchmark results uses it")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for paths in summary.MEASURES.values():
        for path in paths:
            target = f"{path}/x.py" if not path.endswith(".py") else path
            (repo / target).parent.mkdir(parents=True, exist_ok=True)
            (repo / target).write_text("v1\n")
    (repo / "docs").mkdir()
    (repo / "docs/notes.md").write_text("v1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "initial")
    return repo


def stale_names(problems: list[str]) -> set[str]:
    return {p.split(".json:")[0] for p in problems if ".json:" in p}


def test_fresh_results_pass(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    assert summary.stale(results_at(head), repo) == []


def test_a_commit_to_measured_code_makes_exactly_its_results_stale(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    commit_file(repo, "docs/notes.md", "v2\n")  # measured by nothing
    assert summary.stale(results_at(head), repo) == []
    commit_file(repo, "torchshard/checkpoint/x.py", "v2\n")
    problems = summary.stale(results_at(head), repo)
    assert stale_names(problems) == {"checkpoint", "scale"}, problems
    assert all("run python benchmarks/run_all.py" in p for p in problems)
    commit_file(repo, "benchmarks/bench_flat.py", "v2\n")  # the benchmark's own script
    assert stale_names(summary.stale(results_at(head), repo)) == {"flat", "checkpoint", "scale"}


def test_uncommitted_changes_when_measured_make_results_stale(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    problems = summary.stale(results_at(head, dirty=["torchshard/_parallel/x.py"]), repo)
    assert stale_names(problems) == {"trainer", "sharded", "full", "checkpoint"}, problems
    assert summary.stale(results_at(head, dirty=["docs/notes.md"]), repo) == []
    unknown = results_at(head)
    unknown["flat"]["machine"]["git_dirty"] = None
    assert stale_names(summary.stale(unknown, repo)) == {"flat"}


def test_results_from_several_commits_fail(repo: Path) -> None:
    first = git(repo, "rev-parse", "HEAD")
    second = commit_file(repo, "docs/notes.md", "v2\n")
    results = results_at(second)
    results["flat"]["machine"]["git_commit"] = first
    problems = summary.stale(results, repo)
    assert any("not one" in p for p in problems), problems


def test_unknown_commit_or_none_recorded_fails(repo: Path) -> None:
    problems = summary.stale(results_at("f" * 40), repo)
    assert stale_names(problems) == set(summary.FILES), problems
    assert "unknown here" in problems[0]
    problems = summary.stale(results_at(None), repo)
    assert stale_names(problems) == set(summary.FILES)
    assert "records no commit" in problems[0]


def test_a_commit_off_this_branch_fails(repo: Path) -> None:
    base = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "-b", "side")
    side = commit_file(repo, "docs/notes.md", "side\n")
    git(repo, "checkout", "-q", "-")
    assert git(repo, "rev-parse", "HEAD") == base
    problems = summary.stale(results_at(side), repo)
    assert "not an ancestor of HEAD" in problems[0], problems


def test_a_shallow_clone_without_the_commit_fails_and_says_so(repo: Path, tmp_path: Path) -> None:
    old = git(repo, "rev-parse", "HEAD")
    commit_file(repo, "docs/notes.md", "v2\n")
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow))
    problems = summary.stale(results_at(old), shallow)
    assert stale_names(problems) == set(summary.FILES), problems
    assert "shallow clone" in problems[0] and "git fetch --unshallow" in problems[0]


def test_no_repository_or_no_git_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    problems = summary.stale(results_at("a" * 40), tmp_path)  # not a git work tree
    assert len(problems) == 1 and "not a git work tree" in problems[0]
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH
    problems = summary.stale(results_at("a" * 40), REPO)
    assert len(problems) == 1 and "git failed to run" in problems[0]


def test_stale_cli_exits_1_with_the_reasons(tmp_path: Path) -> None:
    for name in (*summary.FILES, summary.RUN):
        (tmp_path / f"{name}.json").write_text(json.dumps({"machine": {"git_commit": None}}))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--stale", "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "records no commit" in proc.stderr
