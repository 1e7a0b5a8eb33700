"""Is each benchmark result as new as the code it measured? By content, not by history.

Each results file records ``measured: {path: hash}``: the files its benchmark depends on
(:data:`MEASURES`), hashed when it started. :func:`stale` hashes the same paths in the
working tree and names every result where one changed, appeared or disappeared. Like DVC's
``dvc.lock`` or Bazel's action keys: no git needed, so it works in a tarball and in a
shallow clone, and a result measured with uncommitted changes is stale unless exactly those
changes were committed. Stdlib only.

A Python file is hashed by its code, not its bytes (:func:`digest`): ``ast.unparse`` of it
without its docstrings, so a comment, a docstring or a reformatting leaves the results
fresh, and any change to what runs makes them stale. The code hash comes from the
checking Python's ``ast``; where that is another version than the one the result was
measured with, a mismatch says so. A recorded bare SHA-256 (results written before code
hashes) is checked against the file's bytes; ``summary.py --rehash`` turns the byte hashes
of a result that is fresh by them into code hashes.

A path of :data:`MEASURES` is a file, a directory (its ``*.py`` files, at any depth) or a
glob; one that starts with ``!`` removes what it matches. Directories and globs survive a
module becoming a package (``torchshard/_parallel/full.py`` -> ``full/``).
"""

from __future__ import annotations

import ast
import glob
import hashlib
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path

from .results import COMMAND, FILES, REPO, SLOW, Results

# Every benchmark's helpers (_common writes its JSON through report/files.py) ...
_HELPERS = ("benchmarks/_common.py", "benchmarks/report/files.py")
# ... and, for those that train it, the example model.
_COMMON = (*_HELPERS, "examples/gpt.py")
# What a trainer runs outside the parallel wing: the flat module, process group, exit, guards.
_TRAINER = (
    "torchshard/_flat",
    "torchshard/_dist.py",
    "torchshard/_exit.py",
    "torchshard/_stepped.py",
)
# The modes that keep whole buckets (replicated, shard=True) run every file of the parallel
# wing but the fully sharded mode's.
_BUCKET_MODES = (*_TRAINER, "torchshard/_parallel", "!torchshard/_parallel/full*")
_ALL_MODES = (*_TRAINER, "torchshard/_parallel")
_STEPS = "benchmarks/_interleaved.py"  # the DDP-paired stepping of bench_lora and bench_mixed
_COMM = ("torchshard/comm.py",)  # the comms' public face (their code: torchshard/_parallel)
_COMM_PATH = tuple(  # the comms' code: what a bucket's bytes go through
    f"torchshard/_parallel/{m}.py"
    for m in ("comm", "comms", "powersgd", "topk", "feedback", "star", "reducer", "buckets")
)

# What each result measured: its own script, the library code it runs, the example model
# and data it trains.
MEASURES: dict[str, tuple[str, ...]] = {
    "flat": ("benchmarks/bench_flat.py", "torchshard/_flat", *_COMMON),
    "trainer": ("benchmarks/bench_trainer.py", *_BUCKET_MODES, "examples/train_gpt.py", *_COMMON),
    "sharded": ("benchmarks/bench_sharded.py", *_ALL_MODES, "examples/train_gpt.py", *_COMMON),
    "full": ("benchmarks/bench_full.py", *_ALL_MODES, *_COMMON),
    "hsdp": ("benchmarks/bench_hsdp.py", *_ALL_MODES, "examples/train_gpt.py", *_COMMON),
    # the replicated mode's comms (torchshard.comm), on the example's model and data
    "comm": ("benchmarks/bench_comm.py", *_BUCKET_MODES, *_COMM, "examples/train_gpt.py", *_COMMON),
    "checkpoint": (
        "benchmarks/bench_checkpoint.py",
        "torchshard/checkpoint",
        *_BUCKET_MODES,
        *_COMMON,
    ),
    "scale": (
        "benchmarks/scale.py",
        "torchshard/_flat",
        "torchshard/_parallel/memory.py",
        "torchshard/_parallel/footprint.py",  # plan_memory's models (memory.py reads them)
        "torchshard/_parallel/modes.py",  # the registry memory.py resolves shard= through
        "torchshard/_parallel/units.py",
        "torchshard/checkpoint",
    ),
    # a PEFT Llama (transformers, peft: not hashed, as torch is not) in every mode
    "lora": ("benchmarks/bench_lora.py", *_ALL_MODES, *_HELPERS, _STEPS),
    # a transformers Llama in bf16 with fp32 norms (not hashed, as torch is not), every mode
    "mixed": ("benchmarks/bench_mixed.py", *_ALL_MODES, *_HELPERS, _STEPS),
    # tensor parallelism against DTensor TP and FSDP2 + TP on torch's test Transformer (torch's
    # own model: not hashed, as torch is not), every mode over a (dp, tp) mesh
    "tp": ("benchmarks/bench_tp.py", *_ALL_MODES, *_HELPERS),
    # pipelines (torchshard/_pipeline) of replicated and shard=True stages, against torch's own
    # pipelining and FSDP2 per stage, on a model of the script's own
    "pipeline": (
        "benchmarks/bench_pipeline.py",
        "torchshard/_pipeline",
        *_BUCKET_MODES,
        *_HELPERS,
    ),
    # SLOW (50 to 75 minutes): the example's whole runs, without checkpoints (--ckpt-dir '').
    # What it certifies is each comm's effect on the loss, so it holds the comms' own path
    # (the choices, the bucket comms, the reducer that drives them, the buckets they cut)
    # and the example, not the rest of the trainer: that is held bitwise to DDP by the
    # tests, and a rerun for every change to it would cost each change an hour.
    "convergence": (
        "benchmarks/bench_convergence.py",
        *_COMM,
        *_COMM_PATH,
        "torchshard/data.py",
        "examples/train_gpt.py",
        *_COMMON,
    ),
}


def expand(spec: str, repo: Path = REPO) -> list[str]:
    """The files one path of :data:`MEASURES` stands for, relative to ``repo``, sorted.

    >>> "torchshard/_flat/layout.py" in expand("torchshard/_flat")
    True
    """
    hits = glob.glob(spec, root_dir=repo) if any(c in spec for c in "*?[") else [spec]
    out: set[str] = set()
    for hit in hits:
        path = repo / hit
        if path.is_file():
            out.add(Path(hit).as_posix())
        elif path.is_dir():
            out.update(p.relative_to(repo).as_posix() for p in path.rglob("*.py") if p.is_file())
    return sorted(out)


def files(specs: Iterable[str], repo: Path = REPO) -> list[str]:
    """Every file ``specs`` name (``!spec`` removes), relative to ``repo``, sorted.

    >>> "torchshard/_parallel/full.py" in files(MEASURES["trainer"])
    False
    """
    specs = list(specs)
    keep = {f for s in specs if not s.startswith("!") for f in expand(s, repo)}
    drop = {f for s in specs if s.startswith("!") for f in expand(s[1:], repo)}
    return sorted(keep - drop)


def sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes.

    >>> len(sha256(Path(__file__)))
    64
    """
    return hashlib.sha256(path.read_bytes()).hexdigest()


CODE = "code:"  # the prefix of a code hash (:func:`digest`); a bare hex digest is of bytes


def code(source: str) -> str | None:
    r"""What runs of a Python source, as text: ``ast.unparse`` of it with every docstring (of
    the module, a class or a function) taken out. Comments and layout do not reach the AST.
    None where the source does not parse.

    >>> code("'Doc.'\nx  =  1  # one\n\n\ndef f():\n    'Doc.'\n") == code("x = 1\ndef f(): pass")
    True
    >>> code("x = 1") == code("x = 2")
    False
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def digest(path: Path) -> str:
    """What ``measured`` records of a file: ``code:`` and the SHA-256 of :func:`code` for a
    ``.py`` file that parses, otherwise the SHA-256 of its bytes.

    >>> digest(Path(__file__)).startswith(CODE)
    True
    """
    if path.suffix == ".py":
        text = code(path.read_text(encoding="utf-8", errors="surrogateescape"))
        if text is not None:
            return CODE + hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    return sha256(path)


def hashes(name: str, repo: Path = REPO) -> dict[str, str]:
    """``{path: digest}`` of what the benchmark ``name`` measures: its results' ``measured``.

    >>> sorted(hashes("flat"))[0]
    'benchmarks/_common.py'
    """
    return current({}, name, repo)


def current(recorded: Mapping[str, str], name: str, repo: Path = REPO) -> dict[str, str]:
    """The hashes of what ``name`` measures now, each in the form ``recorded`` holds for its
    path: by bytes where a result from before code hashes recorded a bare SHA-256, by
    :func:`digest` otherwise (``recorded`` empty: :func:`hashes`)."""
    out = {}
    for f in files(MEASURES[name], repo):
        old = recorded.get(f)
        bare = isinstance(old, str) and not old.startswith(CODE)
        out[f] = sha256(repo / f) if bare else digest(repo / f)
    return out


def changes(recorded: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """``path (changed)``, ``path (new)``, ``path (gone)``: how ``now`` differs, sorted.

    >>> changes({"a.py": "1", "b.py": "2"}, {"a.py": "1", "b.py": "3", "c.py": "4"})
    ['b.py (changed)', 'c.py (new)']
    """
    out = [f"{p} (changed)" for p in recorded if p in now and now[p] != recorded[p]]
    out += [f"{p} (new)" for p in now if p not in recorded]
    out += [f"{p} (gone)" for p in recorded if p not in now]
    return sorted(out)


def _python(result: Mapping) -> str | None:
    """The ``major.minor`` of the Python a result was measured with, where it says."""
    machine = result.get("machine")
    version = machine.get("python") if isinstance(machine, Mapping) else None
    return ".".join(str(version).split(".")[:2]) if version else None


def rehash(result: dict, name: str, repo: Path = REPO) -> bool:
    """Turn the byte hashes of ``result`` (benchmark ``name``) into code hashes, in place,
    where every recorded hash is a bare SHA-256 that the file's bytes still match and the
    files are the same: the code is then exactly what was measured. True if it did.

    >>> rehash({"measured": {"x.py": "0" * 64}}, "flat")  # not what the tree holds
    False
    """
    recorded = result.get("measured")
    if not isinstance(recorded, dict) or not recorded:
        return False
    if any(not isinstance(v, str) or v.startswith(CODE) for v in recorded.values()):
        return False
    if changes(recorded, current(recorded, name, repo)):
        return False
    result["measured"] = hashes(name, repo)
    return True


def stale(results: Results, repo: Path = REPO) -> list[str]:
    """Why results are not known to be current, one line each (empty: every one is).

    A result is current when its ``measured`` hashes equal those of the same paths in
    ``repo`` now. A missing file, or one that records no hashes, is stale too. Each line
    names the command that regenerates the result (run_all.py, or :data:`SLOW`'s).

    >>> stale({"flat": {"measured": hashes("flat")}})[0]  # doctest: +ELLIPSIS
    'trainer.json: missing; run python benchmarks/run_all.py'
    """
    problems: list[str] = []
    for name, command in [*((n, COMMAND) for n in FILES), *SLOW.items()]:
        if name not in results:
            problems.append(f"{name}.json: missing; run {command}")
            continue
        recorded = results[name].get("measured")
        if not isinstance(recorded, dict) or not recorded:
            problems.append(
                f"{name}.json: records no hashes of the code it measured (`measured`); "
                f"run {command}"
            )
            continue
        now = current(recorded, name, repo)
        changed = changes(recorded, now)
        if changed:
            where = ""
            here, there = ".".join(platform.python_version_tuple()[:2]), _python(results[name])
            by_code = any(  # a code hash differs: ast.unparse may differ between Pythons
                str(h).startswith(CODE) and now.get(p, h) != h for p, h in recorded.items()
            )
            if by_code and there and there != here:
                where = f" (hashed by Python {here}'s ast; the result was measured on {there})"
            problems.append(
                f"{name}.json: the code it measures changed since: {', '.join(changed)}"
                f"{where}; run {command}"
            )
    return problems
