"""The three wings and the one-way imports between them: buffer -> parallelism -> checkpoint -> CLI."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import tokenize
from pathlib import Path

import torchshard
import torchshard.checkpoint

PACKAGE = Path(torchshard.__file__).parent
REPO = PACKAGE.parent

# The three wings, by dotted path under torchshard. Each module lists what it may import
# from torchshard; a new module must be placed here.
FLAT = {  # the buffer: imports nothing from parallelism or checkpointing
    "_flat.layout": {"_errors"},
    "_flat.geometry": {"_errors", "_flat.layout"},
    "_flat.hf": {"_log"},
    "_flat.views": {"_flat.layout", "_log"},
    "_flat.meta": {"_errors"},
    # tensor parallelism: a plan, resolved (pure) -> the forwards -> each rank's pieces
    "_flat.tp_plan": {"_errors", "_flat.layout"},
    "_flat.tp_layers": set(),
    "_flat.tp": {"_errors", "_flat.layout", "_flat.tp_layers", "_flat.tp_plan"},
    "_flat.module": {
        "_errors",
        "_flat.hf",
        "_flat.layout",
        "_flat.meta",
        "_flat.tp",
        "_flat.views",
        "_log",
        "_stepped",
    },
}
PARALLEL = {  # data parallelism: the trainer core, one file per mode, the protocol
    "_parallel.buckets": {"_flat.layout"},
    "_parallel.footprint": {"_errors", "_flat.geometry", "_flat.layout", "_parallel.units"},
    "_parallel.memory": {
        "_flat.geometry",
        "_flat.layout",
        "_parallel.footprint",
        "_parallel.modes",
        "_parallel.tpcost",
        "_parallel.units",
    },
    # tensor parallelism in the planners: a whole layout split by a plan, by name
    "_parallel.tpcost": {"_errors", "_flat.layout", "_flat.tp_plan", "_parallel.footprint"},
    # the registry: the one module that names the modes
    "_parallel.modes": {
        "_errors",
        "_parallel.footprint",
        "_parallel.full",
        "_parallel.mode",
        "_parallel.replicated",
        "_parallel.sharded",
        "_parallel.units",
    },
    # per-step communication of a plan: the memory planner's arguments, the units' geometry
    "_parallel.traffic": {
        "_flat.geometry",
        "_flat.layout",
        "_parallel.footprint",
        "_parallel.memory",
        "_parallel.modes",
        "_parallel.tpcost",
        "_parallel.units",
    },
    "_parallel.comm": {"_errors", "_parallel.buckets"},
    # the comm choices (comm=): the one place they are named, and the comms they build
    "_parallel.comms": {
        "_parallel.buckets",
        "_parallel.comm",
        "_parallel.feedback",
        "_parallel.powersgd",
        "_parallel.star",
        "_parallel.topk",
    },
    "_parallel.feedback": {"_parallel.comm"},
    "_parallel.star": {"_parallel.buckets", "_parallel.comm"},
    "_parallel.powersgd": {"_parallel.buckets", "_parallel.comm", "_parallel.feedback"},
    "_parallel.topk": {"_parallel.buckets", "_parallel.comm", "_parallel.feedback"},
    # the device mesh: every group created on every rank in one order
    "_parallel.mesh": {"_dist", "_errors", "_parallel.comm"},
    "_parallel.seam": {"_flat.geometry", "_flat.module", "_parallel.comm", "_parallel.shards"},
    "_parallel.mode": {
        "_errors",
        "_flat.geometry",
        "_flat.layout",
        "_flat.module",
        "_parallel.buckets",
        "_parallel.comm",
        "_parallel.comms",
        "_parallel.reducer",
        "_parallel.seam",
        "_parallel.setup",
        "_parallel.shards",
        "_parallel.units",
    },
    "_parallel.optim": {"_flat.layout", "_parallel.seam"},
    "_parallel.scaler": {"_parallel.comm"},
    "_parallel.shards": set(),
    "_parallel.replicated": {"_parallel.comm", "_parallel.mode"},
    "_parallel.sharded": {
        "_flat.geometry",
        "_flat.layout",
        "_flat.module",
        "_parallel.buckets",
        "_parallel.comm",
        "_parallel.mode",
        "_parallel.setup",
        "_parallel.shards",
    },
    "_parallel.reducer": {
        "_errors",
        "_flat.layout",
        "_parallel.buckets",
        "_parallel.comm",
        "_parallel.seam",
    },
    "_parallel.setup": {
        "_dist",
        "_errors",
        "_flat.layout",
        "_flat.module",
        "_flat.views",
        "_parallel.comm",
        "_parallel.footprint",
        "_parallel.seam",
    },
    # a trainer's teardown, in one order (the exit hook's too)
    "_parallel.teardown": {"_dist", "_exit", "_flat.module", "_log"},
    "_parallel.state": {"_dist", "_flat.module", "_parallel.mode", "_parallel.shards"},
    "_parallel.units": {"_errors", "_flat.geometry", "_flat.layout"},
    # a tensor-parallel flat module beside the data-parallel mode
    "_parallel.tp": {
        "_dist",
        "_errors",
        "_flat.module",
        "_parallel.mode",
        "_parallel.seam",
        "_parallel.setup",
    },
    # the fully sharded mode, one way: collectives -> storage -> grads / init -> schedule -> mode
    "_parallel.full.collectives": {"_parallel.comm", "_parallel.reducer"},
    "_parallel.full.storage": {"_flat.layout", "_parallel.full.collectives", "_parallel.units"},
    "_parallel.full.grads": {
        "_errors",
        "_parallel.comm",
        "_parallel.full.storage",
        "_parallel.mode",
    },
    "_parallel.full.init": {
        "_flat.hf",
        "_flat.layout",
        "_flat.module",
        "_flat.views",
        "_parallel.full.storage",
    },
    "_parallel.full.schedule": {"_parallel.full.grads", "_parallel.full.storage"},
    "_parallel.full.mode": {
        "_errors",
        "_flat.geometry",
        "_flat.module",
        "_parallel.buckets",
        "_parallel.comm",
        "_parallel.full.collectives",
        "_parallel.full.grads",
        "_parallel.full.init",
        "_parallel.full.schedule",
        "_parallel.full.storage",
        "_parallel.mode",
        "_parallel.setup",
        "_parallel.shards",
        "_parallel.units",
    },
    "_parallel.trainer": {
        "_dist",
        "_errors",
        "_exit",
        "_flat.geometry",
        "_flat.module",
        "_log",
        "_parallel.buckets",
        "_parallel.comm",
        "_parallel.comms",
        "_parallel.mesh",
        "_parallel.mode",
        "_parallel.modes",
        "_parallel.optim",
        "_parallel.scaler",
        "_parallel.seam",
        "_parallel.setup",
        "_parallel.shards",
        "_parallel.teardown",
        "_parallel.tp",
        "_parallel.units",
        "_stepped",
    },
}
CHECKPOINT = {  # reads the TrainState protocol (in _target, _stripes), never the trainer class
    "checkpoint._rules": {"_flat.layout"},
    "checkpoint._safetensors": {"_errors"},
    "checkpoint._safetensors_writer": {"_errors", "checkpoint._safetensors"},
    "checkpoint._plan": {"_flat.geometry", "_flat.layout"},
    # flat optimizer state as streams: per key, or per key and parameter dtype
    "checkpoint._streams": {"_flat.layout", "checkpoint._plan", "checkpoint._rules"},
    "checkpoint._stripes": {"_parallel.state", "checkpoint._plan", "checkpoint._streams"},
    "checkpoint._format": {
        "_errors",
        "_flat.layout",
        "_log",
        "checkpoint._plan",
        "checkpoint._rules",
    },
    # a lossy comm's state: its metadata section (pure), then its save and load
    "checkpoint._comm_meta": {"_flat.layout", "checkpoint._format", "checkpoint._rules"},
    "checkpoint._comm_state": {
        "_errors",
        "_log",
        "checkpoint._comm_meta",
        "checkpoint._metadata",
        "checkpoint._reads",
        "checkpoint._target",
        "checkpoint._tp_comm",
    },
    # a split module's comm state: the whole picture of the error, each tp rank's Q
    "checkpoint._tp_comm": {
        "checkpoint._comm_meta",
        "checkpoint._metadata",
        "checkpoint._plan",
        "checkpoint._target",
    },
    "checkpoint._metadata": {
        "_errors",
        "_flat.layout",
        "checkpoint._comm_meta",
        "checkpoint._format",
        "checkpoint._rules",
        "checkpoint._safetensors",
        "checkpoint._streams",
    },
    "checkpoint._target": {
        "_dist",
        "_errors",
        "_flat.layout",
        "_flat.module",
        "_flat.tp",
        "_parallel.state",
        "checkpoint._stripes",
    },
    "checkpoint._optim": {"_errors", "_flat.layout", "checkpoint._streams", "checkpoint._target"},
    "checkpoint._load": {
        "_errors",
        "_flat.layout",
        "_log",
        "checkpoint._comm_state",
        "checkpoint._format",
        "checkpoint._metadata",
        "checkpoint._optim",
        "checkpoint._plan",
        "checkpoint._reads",
        "checkpoint._pp_load",
        "checkpoint._rules",
        "checkpoint._streams",
        "checkpoint._target",
        "checkpoint._tp_load",
    },
    # a pipeline's checkpoint: the whole model's files, cut at the stages (issue 26)
    "checkpoint._pp_plan": {
        "_errors",
        "_flat.layout",
        "checkpoint._format",
        "checkpoint._target",
    },
    "checkpoint._pp_save": {
        "_dist",
        "_errors",
        "_flat.hf",
        "_flat.layout",
        "checkpoint._format",
        "checkpoint._optim",
        "checkpoint._plan",
        "checkpoint._pp_commit",
        "checkpoint._pp_plan",
        "checkpoint._share",
        "checkpoint._target",
        "checkpoint._tp_save",
    },
    "checkpoint._pp_commit": {
        "_dist",
        "_errors",
        "checkpoint._format",
        "checkpoint._rendezvous",
        "checkpoint._share",
    },
    "checkpoint._pp_load": {
        "_dist",
        "_errors",
        "_flat.layout",
        "checkpoint._format",
        "checkpoint._metadata",
        "checkpoint._optim",
        "checkpoint._pp_plan",
        "checkpoint._reads",
        "checkpoint._streams",
        "checkpoint._target",
        "checkpoint._tp_load",
    },
    # a tensor-parallel module's load: its pieces of the whole tensors (issue 25)
    "checkpoint._tp_load": {
        "_dist",
        "_errors",
        "_flat.layout",
        "_flat.tp",
        "checkpoint._metadata",
        "checkpoint._optim",
        "checkpoint._plan",
        "checkpoint._reads",
        "checkpoint._streams",
        "checkpoint._target",
    },
    "checkpoint._reads": {
        "_flat.layout",
        "checkpoint._metadata",
        "checkpoint._optim",
        "checkpoint._plan",
        "checkpoint._streams",
        "checkpoint._target",
    },
    "checkpoint._rendezvous": {"_dist", "_errors", "_log", "checkpoint._target"},
    # save: staging, the share from one plan, the writer and commit; never load (the
    # manager is above both)
    "checkpoint._staging": {"_errors"},
    "checkpoint._share": {
        "_errors",
        "_flat.hf",
        "checkpoint._comm_meta",
        "checkpoint._comm_state",
        "checkpoint._format",
        "checkpoint._optim",
        "checkpoint._plan",
        "checkpoint._staging",
        "checkpoint._streams",
        "checkpoint._stripes",
        "checkpoint._target",
    },
    "checkpoint._save": {
        "_errors",
        "_log",
        "checkpoint._format",
        "checkpoint._pp_save",
        "checkpoint._rendezvous",
        "checkpoint._safetensors",
        "checkpoint._safetensors_writer",
        "checkpoint._share",
        "checkpoint._staging",
        "checkpoint._target",
        "checkpoint._tp_save",
    },
    # a tensor-parallel module's save: the whole model's files, slot by slot (issue 25)
    "checkpoint._tp_save": {
        "_dist",
        "_errors",
        "_flat.hf",
        "_flat.tp",
        "checkpoint._comm_meta",
        "checkpoint._comm_state",
        "checkpoint._format",
        "checkpoint._optim",
        "checkpoint._plan",
        "checkpoint._share",
        "checkpoint._streams",
        "checkpoint._target",
    },
    "checkpoint._manager": {
        "_errors",
        "_log",  # fallback=True logs the damaged checkpoints it sets aside
        "checkpoint._format",
        "checkpoint._load",
        "checkpoint._save",
        "checkpoint._target",
    },
    "checkpoint._tools": {
        "_errors",
        "_flat.layout",
        "checkpoint._comm_meta",
        "checkpoint._format",
        "checkpoint._metadata",
        "checkpoint._plan",
        "checkpoint._safetensors",
        "checkpoint._safetensors_writer",
        "checkpoint._streams",
    },
    "checkpoint._inspect": {
        "_errors",
        "_flat.layout",
        "checkpoint._format",
        "checkpoint._metadata",
        "checkpoint._safetensors",
        "checkpoint._streams",
        "checkpoint._tools",
    },
}
ROOT = {  # shared ground floor, and the tools above the wings
    "_errors": set(),
    "_log": set(),
    "_stepped": {"_errors"},  # which optimizers stepped: the flat module and the trainer
    "_exit": {"_log"},  # a clean exit: close every trainer, then the default group
    "_dist": {"_errors", "_exit", "_log"},
    "data": {"_dist", "_errors"},
    "comm": {"_parallel.comms"},  # the public face of the comm choices
    # torchshard estimate: a model on meta -> its estimate -> the table -> its command line
    "_estimate.model": {"_errors", "_flat.hf", "_flat.layout", "_flat.module", "_log"},
    "_estimate.trainable": {"_estimate.model"},  # what trains: LoRA (PEFT), name patterns
    "_estimate.estimate": {
        "_estimate.model",
        "_estimate.trainable",
        "_flat.layout",
        "_parallel.footprint",
        "_parallel.memory",
        "_parallel.modes",
        "_parallel.tpcost",
        "_parallel.traffic",
        "_parallel.units",
    },
    "_estimate.table": {
        "_estimate.estimate",
        "_flat.layout",
        "_parallel.memory",
        "_parallel.traffic",
    },
    "_estimate.command": {
        "_errors",
        "_estimate.estimate",
        "_estimate.model",
        "_estimate.table",
        "_estimate.trainable",
        "_flat.tp_plan",
        "_parallel.modes",
        "_parallel.tpcost",
        "_parallel.units",
    },
    "_cli": {
        "__init__",
        "_errors",
        "_estimate",
        "_estimate.model",
        "_flat.layout",
        "checkpoint._inspect",
        "checkpoint._tools",
    },
}
PIPELINE = {  # issue 26: a plan (pure) -> pruned stages -> torch's stage -> the runner
    "_pipeline.plan": {"_errors", "_flat.layout"},
    "_pipeline.split": {"_flat.hf", "_pipeline.plan"},
    "_pipeline.hf": {"_errors", "_flat.hf"},
    "_pipeline.stage": {"_parallel.trainer"},
    "_pipeline.grads": {"_flat.module", "_parallel.trainer", "_pipeline.runner"},
    "_pipeline.grid": {"_errors", "_pipeline.plan"},
    "_pipeline.optim": set(),
    "_pipeline.cost": {
        "_errors",
        "_flat.layout",
        "_parallel.footprint",
        "_parallel.memory",
        "_pipeline.plan",
        "_pipeline.split",
    },
    "_pipeline.runner": {
        "_dist",
        "_errors",
        "_flat.module",
        "_parallel.mesh",
        "_parallel.seam",
        "_parallel.trainer",
        "_pipeline.grads",
        "_pipeline.grid",
        "_pipeline.hf",
        "_pipeline.optim",
        "_pipeline.plan",
        "_pipeline.split",
        "_pipeline.stage",
    },
}
ALLOWED = FLAT | PARALLEL | CHECKPOINT | ROOT | PIPELINE
WINGS = {"_flat": FLAT, "_parallel": PARALLEL, "checkpoint": CHECKPOINT}


def modules() -> dict[str, Path]:
    """Every module but the faces, by dotted path under torchshard: ``_parallel.trainer``."""
    found = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] != "__init__":
            found[".".join(parts)] = p
    return found


def _absolute(name: str) -> str | None:
    """``torchshard.x.y`` as a dotted path under torchshard (``torchshard``: ``__init__``)."""
    if name == "torchshard":
        return "__init__"
    return name.removeprefix("torchshard.") if name.startswith("torchshard.") else None


def internal_imports(path: Path, source: str | None = None) -> tuple[set[str], list[str]]:
    """What ``path`` (or ``source`` as if it were there) imports from torchshard, relative or
    absolute (dotted paths; the package face is ``__init__``), and the calls it makes."""
    tree = ast.parse(path.read_text() if source is None else source)
    where = path.parent.relative_to(PACKAGE).parts
    found, calls = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(where[: len(where) - node.level + 1])
            found.add(".".join([*base, node.module] if node.module else base) or "__init__")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):  # absolute
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found.update(m for n in names if n and (m := _absolute(n)) is not None)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls.append(node.func.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            calls.append(ast.unparse(node.func))
    return found, calls


def test_import_directions():
    found_modules = modules()
    assert set(found_modules) == set(ALLOWED), "place new modules in ALLOWED"
    for name, allowed in ALLOWED.items():
        found, _ = internal_imports(found_modules[name])
        assert found <= allowed, f"{name} imports {found - allowed}"


def test_absolute_imports_are_seen_too():
    layout = PACKAGE / "_flat" / "layout.py"
    source = (
        "import os\nfrom torchshard.checkpoint import _save\nimport torchshard._parallel.trainer\n"
        "import torchshard\nfrom torchshard._flat import geometry\nfrom .geometry import Geometry\n"
    )
    found, _ = internal_imports(layout, source)
    assert found == {"checkpoint", "_parallel.trainer", "__init__", "_flat", "_flat.geometry"}
    assert not found <= ALLOWED["_flat.layout"]  # test_import_directions would fail on it


def test_each_wing_imports_only_downward():
    for name, allowed in FLAT.items():  # the buffer knows neither trainer nor checkpoint
        assert not any(m.startswith(("_parallel", "checkpoint", "_dist")) for m in allowed), name
    for name, allowed in PARALLEL.items():  # parallelism never reaches into checkpointing
        assert not any(m.startswith("checkpoint") for m in allowed), name
    for name, allowed in CHECKPOINT.items():  # checkpoint reads the protocol, not the class
        parallel = {m for m in allowed if m.startswith("_parallel")}
        assert parallel <= {"_parallel.state"}, name
    for name, allowed in ROOT.items():
        if name in ("_errors", "_log", "_dist", "data"):
            assert not any(m.startswith(tuple(WINGS)) for m in allowed), name


def test_library_neither_prints_nor_configures_logging():
    for name, path in modules().items():
        _, calls = internal_imports(path)
        if name != "_cli":
            assert "print" not in calls, name
        assert "logging.basicConfig" not in calls, name


def test_the_checkpoint_face_only_re_exports():
    face = PACKAGE / "checkpoint" / "__init__.py"
    body = ast.parse(face.read_text()).body
    for node in body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        names = [t.id for t in node.targets] if isinstance(node, ast.Assign) else []
        assert isinstance(node, ast.ImportFrom) or docstring or names == ["__all__"], ast.unparse(
            node
        )
    assert set(torchshard.checkpoint.__all__) == {
        "CheckpointError",
        "CheckpointFuture",
        "CheckpointInfo",
        "Checkpointer",
        "async_save",
        "consolidate",
        "inspect_checkpoint",
        "load",
        "reshard",
        "save",
    }
    # their docstrings: test_public_api_is_exported_and_documented


# Public names whose docstring has no example yet (CONTRIBUTING: "a docstring that has a short
# example"). Frozen: a new public name without an example fails, and so does a name here once
# its example is written (remove it from this set then).
MISSING_EXAMPLES: set[str] = set()


def written_docstring(obj: object) -> str:
    """``obj``'s docstring, or "" where there is none or only the one @dataclass makes up
    (the class name and its __init__ signature)."""
    doc = getattr(obj, "__doc__", None) or ""
    if dataclasses.is_dataclass(obj) and isinstance(obj, type):
        made_up = obj.__name__ + str(inspect.signature(obj)).replace(" -> None", "")
        if doc == made_up:
            return ""
    return doc


def test_written_docstring_sees_through_dataclass_docstrings():
    @dataclasses.dataclass
    class Bare:
        a: int
        b: str = "x"

    @dataclasses.dataclass(frozen=True)
    class Written:
        """Written.

        Example::

            Written(1)
        """

        a: int

    assert Bare.__doc__ and written_docstring(Bare) == ""
    assert "Example" in written_docstring(Written)


def test_public_api_is_exported_and_documented():
    missing_examples = set()
    faces = (torchshard, torchshard.checkpoint)
    for face in faces:
        assert len(set(face.__all__)) == len(face.__all__), face.__name__
        for name in face.__all__:
            obj = getattr(face, name)  # exported: AttributeError otherwise
            qualified = f"{face.__name__}.{name}"
            if not callable(obj):
                assert name == "__version__", qualified
                continue
            doc = written_docstring(obj)
            assert doc.strip(), f"{qualified} has no docstring"
            if isinstance(obj, type) and issubclass(obj, BaseException):
                continue  # errors: a docstring, no example
            if "Example" not in doc:
                missing_examples.add(qualified)
    new = missing_examples - MISSING_EXAMPLES
    assert not new, f"public names without an example in their docstring: {sorted(new)}"
    done = MISSING_EXAMPLES - missing_examples
    assert not done, f"these have an example now; remove them from MISSING_EXAMPLES: {sorted(done)}"


# -- the seam's rules (issue 20) -------------------------------------------------------------
MAX_MODULE_CODE_LINES = 350
MAX_CLASS_CODE_LINES = 250
REGISTRY = PACKAGE / "_parallel" / "modes.py"
MODE_LITERALS = {"full"}  # shard= values that name a mode: spelled only in the registry


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Lines of docstrings and of bare string statements (attribute docstrings)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def code_lines(source: str) -> set[int]:
    """Lines that hold code: not blank, not a comment, not a docstring."""
    docs = _docstring_lines(ast.parse(source))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip or tok.type == tokenize.ENDMARKER:
            continue
        code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return code


def test_code_lines_count_neither_docstrings_nor_comments():
    source = (
        'class A:\n    """Doc.\n\n    More."""\n\n    # a comment\n    x = 1\n    """x\'s doc."""\n'
    )
    assert code_lines(source) == {1, 7}


def test_modules_and_classes_stay_small():
    over = []
    for name, path in modules().items():
        source = path.read_text()
        code = code_lines(source)
        if len(code) > MAX_MODULE_CODE_LINES:
            over.append(f"module {name}: {len(code)} code lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                n = sum(node.lineno <= x <= node.end_lineno for x in code)
                if n > MAX_CLASS_CODE_LINES:
                    over.append(f"class {name}.{node.name}: {n} code lines")
    assert not over, f"over {MAX_MODULE_CODE_LINES}/{MAX_CLASS_CODE_LINES} code lines: {over}"


def _private_reads(path: Path) -> list[str]:
    """``x._mode`` and ``getattr(x, "_private")`` in ``path``: reaching into another object."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "_mode":
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
        ):
            found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_checkpoint_and_benchmarks_read_public_state_only():
    paths = [*(PACKAGE / "checkpoint").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]
    found = [hit for p in paths for hit in _private_reads(p)]
    assert not found, f"read the trainer's public state instead: {found}"


def test_private_reads_are_seen(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        'm = trainer._mode\nn = getattr(trainer, "_mode")\nok = getattr(t, "__doc__")\n'
    )
    assert len(_private_reads(probe)) == 2


def test_mode_literals_only_in_the_registry():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == REGISTRY:
            continue
        tree = ast.parse(path.read_text())
        docs = _docstring_lines(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value in MODE_LITERALS
                and node.lineno not in docs
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert REGISTRY.exists(), "the registry of modes: torchshard/_parallel/modes.py"
    assert not found, f"mode literals outside {REGISTRY.name}: {found}"


def _parameters(fn: object) -> list[tuple[str, object, bool]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values()]


def compatible(base: object, override: object) -> bool:
    """``override`` accepts every call ``base`` accepts: the same parameters in the same
    order and kind, plus only ones with defaults (or ``*args``/``**kwargs``)."""
    have, want = _parameters(override), _parameters(base)
    kinds = {k for _, k, _ in have}
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
        return True
    if [(n, k) for n, k, _ in have[: len(want)]] != [(n, k) for n, k, _ in want]:
        return False
    return all(
        default or k in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        for _, k, default in have[len(want) :]
    )


def test_strategy_overrides_keep_their_base_signatures():
    bad = []
    for name in modules():
        if not name.startswith("_parallel"):
            continue
        module = importlib.import_module(f"torchshard.{name}")
        for cls in vars(module).values():
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            for base in cls.__mro__[1:]:
                if not base.__module__.startswith("torchshard."):
                    continue
                for attr, fn in vars(cls).items():
                    theirs = vars(base).get(attr)
                    if attr.startswith("__") or not (
                        inspect.isfunction(fn) and inspect.isfunction(theirs)
                    ):
                        continue
                    if not compatible(theirs, fn):
                        bad.append(f"{cls.__qualname__}.{attr} vs {base.__qualname__}.{attr}")
    assert not bad, f"overrides with another signature than their base: {bad}"


def test_an_incompatible_override_is_seen():
    class Base:
        def gather(self, ctx): ...

    class Ok(Base):
        def gather(self, ctx, extra=1): ...

    class Bad(Base):
        def gather(self, u, *, wait): ...

    assert compatible(Base.gather, Ok.gather)
    assert not compatible(Base.gather, Bad.gather)
