"""Is each benchmark result as new as the code it measured? (A step of .ci/run, after the
tests: it needs the history.)

Each result's ``machine.git_commit`` must be an ancestor of HEAD,
``git log <commit>..HEAD -- <paths it measures>`` (:data:`MEASURES`) must be empty and the
tree must have been clean there when it ran (``machine.git_dirty``). Where git cannot tell
(not installed, not a repository, a shallow clone without the commit, no commit recorded)
that is a failure too, never a pass. Stdlib only.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from .results import COMMAND, FILES, REPO, RUN, Results

# What each result measured: a commit that changed any of these since the result's commit
# makes it stale. The benchmark's own script, the shared helpers and the example model and
# data it runs count too.
_COMMON = ("benchmarks/_common.py", "examples/gpt.py")
_TRAINING = (
    "torchshard/_flat",
    "torchshard/_parallel",
    "torchshard/_dist.py",
    "examples/train_gpt.py",
)
MEASURES: dict[str, tuple[str, ...]] = {
    "flat": ("benchmarks/bench_flat.py", "torchshard/_flat", *_COMMON),
    "trainer": ("benchmarks/bench_trainer.py", *_TRAINING, *_COMMON),
    "sharded": ("benchmarks/bench_sharded.py", *_TRAINING, *_COMMON),
    "full": ("benchmarks/bench_full.py", *_TRAINING, *_COMMON),
    "checkpoint": (
        "benchmarks/bench_checkpoint.py",
        "torchshard/checkpoint",
        "torchshard/_flat",
        "torchshard/_parallel",
        "torchshard/_dist.py",
        *_COMMON,
    ),
    "scale": (
        "benchmarks/scale.py",
        "torchshard/_flat",
        "torchshard/_parallel/memory.py",
        "torchshard/checkpoint",
    ),
}


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60
    )


def stale(results: Results, repo: Path = REPO) -> list[str]:
    """Why results are not known to be current, one line each (empty: every one is).

    A result is current when its ``machine.git_commit`` is an ancestor of HEAD, no commit
    since touched the paths it measures (:data:`MEASURES`), and none of those paths had
    uncommitted changes when it ran (``machine.git_dirty``). Not knowing is a problem too:
    no git, no repository, a shallow clone that lacks the commit, no commit recorded.
    """
    problems: list[str] = []
    try:
        ok = _git(repo, "rev-parse", "--is-inside-work-tree")
    except (OSError, subprocess.SubprocessError) as e:
        return [f"cannot check the results against the code: git failed to run ({e})"]
    if ok.returncode != 0 or ok.stdout.strip() != "true":
        return [f"cannot check the results against the code: {repo} is not a git work tree"]
    shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    for name in FILES:
        if name not in results:
            problems.append(f"{name}.json: missing; run {COMMAND}")
            continue
        machine = results[name].get("machine") or {}
        commit = machine.get("git_commit")
        if not commit:
            problems.append(f"{name}.json: records no commit (machine.git_commit); run {COMMAND}")
            continue
        paths = MEASURES[name]
        if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            hint = (
                "this is a shallow clone: fetch the history (git fetch --unshallow)"
                if shallow
                else f"the commit is not in this repository; run {COMMAND}"
            )
            problems.append(f"{name}.json: measured at {commit[:10]}, unknown here: {hint}")
            continue
        if _git(repo, "merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
            problems.append(
                f"{name}.json: measured at {commit[:10]}, not an ancestor of HEAD; run {COMMAND}"
            )
            continue
        log = _git(repo, "log", "--format=%h %s", f"{commit}..HEAD", "--", *paths)
        if log.returncode != 0:
            problems.append(f"{name}.json: git log failed: {log.stderr.strip()}")
        elif log.stdout.strip():
            changes = log.stdout.strip().splitlines()
            problems.append(
                f"{name}.json: measured at {commit[:10]}; {len(changes)} later commit(s) change "
                f"what it measures ({', '.join(paths)}), e.g. {changes[0]}; run {COMMAND}"
            )
        dirty = machine.get("git_dirty")
        if dirty is None:
            problems.append(
                f"{name}.json: does not record whether the tree was clean; run {COMMAND}"
            )
        else:
            touched = [f for f in dirty if any(f == p or f.startswith(p + "/") for p in paths)]
            if touched:
                problems.append(
                    f"{name}.json: measured with uncommitted changes to {', '.join(touched)}: "
                    f"it belongs to no commit; commit, then run {COMMAND}"
                )
    commits = {
        str((results[n].get("machine") or {}).get("git_commit")) for n in FILES if n in results
    }
    if RUN in results:
        commits.add(str((results[RUN].get("machine") or {}).get("git_commit")))
    else:
        problems.append(f"run.json: missing; run {COMMAND}")
    if len(commits) > 1:
        problems.append(
            f"the results come from {len(commits)} commits ({', '.join(sorted(c[:10] for c in commits))}),"
            f" not one; run {COMMAND}"
        )
    return problems
