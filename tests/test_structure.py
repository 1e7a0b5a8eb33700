"""Imports flow one way: layout -> flat module -> communication / trainer -> (checkpoint) -> CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import torchshard
import torchshard.checkpoint

PACKAGE = Path(torchshard.__file__).parent

# What each module may import from torchshard. A new module must be placed here.
ALLOWED = {
    "_errors": set(),
    "_layout": {"_errors"},
    "_buckets": {"_layout"},
    "_flat_module": {"_errors", "_hf", "_layout", "_log"},
    "_hf": {"_log"},
    "_log": set(),
    "_dist": {"_errors", "_log"},
    "_trainer": {
        "_buckets",
        "_dist",
        "_errors",
        "_flat_module",
        "_layout",
        "_log",
        "_memory",
        "_reshard",
    },
    "_reshard": {"_layout"},
    "_memory": {"_layout", "_reshard"},
    "_estimate": {"_errors", "_flat_module", "_layout", "_log", "_memory"},
    "_cli": {
        "__init__",
        "_errors",
        "_estimate",
        "_layout",
        "checkpoint._inspect",
        "checkpoint._tools",
    },
    # The checkpoint wing, keyed by dotted path under torchshard. Only _target knows the
    # trainer; only _plan the shared range arithmetic.
    "checkpoint._rules": set(),
    "checkpoint._safetensors": {"_errors"},
    "checkpoint._plan": {"_layout", "_reshard"},
    "checkpoint._format": {"_errors", "_layout", "_log", "checkpoint._plan", "checkpoint._rules"},
    "checkpoint._metadata": {
        "_errors",
        "_layout",
        "checkpoint._format",
        "checkpoint._rules",
        "checkpoint._safetensors",
    },
    "checkpoint._target": {"_dist", "_errors", "_flat_module", "_trainer"},
    "checkpoint._optim": {"_errors", "_layout", "checkpoint._target"},
    "checkpoint._load": {
        "_errors",
        "_layout",
        "checkpoint._format",
        "checkpoint._metadata",
        "checkpoint._optim",
        "checkpoint._plan",
        "checkpoint._rules",
        "checkpoint._target",
    },
    "checkpoint._rendezvous": {"_dist", "_errors", "_log", "checkpoint._target"},
    # save: the writer, staging and commit; it never imports load (the manager is above both)
    "checkpoint._save": {
        "_errors",
        "_hf",
        "_log",
        "checkpoint._format",
        "checkpoint._optim",
        "checkpoint._plan",
        "checkpoint._rendezvous",
        "checkpoint._safetensors",
        "checkpoint._target",
    },
    "checkpoint._manager": {
        "_errors",
        "checkpoint._format",
        "checkpoint._load",
        "checkpoint._save",
        "checkpoint._target",
    },
    "checkpoint._tools": {
        "_errors",
        "checkpoint._format",
        "checkpoint._metadata",
        "checkpoint._plan",
        "checkpoint._safetensors",
    },
    "checkpoint._inspect": {
        "_errors",
        "_layout",
        "checkpoint._format",
        "checkpoint._metadata",
        "checkpoint._safetensors",
        "checkpoint._tools",
    },
}
# The trainer side never reaches into checkpointing.
CHECKPOINT = {"checkpoint"} | {m for m in ALLOWED if m.startswith("checkpoint.")}


def modules() -> dict[str, Path]:
    """Every private module, by dotted path under torchshard: ``_trainer``, ``checkpoint._save``."""
    found = {p.stem: p for p in PACKAGE.glob("_*.py")}
    found |= {f"checkpoint.{p.stem}": p for p in (PACKAGE / "checkpoint").glob("_*.py")}
    return {name: p for name, p in found.items() if not name.endswith("__init__")}


def internal_imports(path: Path) -> tuple[set[str], list[str]]:
    """What ``path`` imports from torchshard (dotted paths; the package face is ``__init__``)."""
    tree = ast.parse(path.read_text())
    where = path.parent.relative_to(PACKAGE).parts
    found, calls = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(where[: len(where) - node.level + 1])
            found.add(".".join([*base, node.module] if node.module else base) or "__init__")
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
    for name in ("_layout", "_flat_module", "_buckets", "_dist", "_trainer"):
        assert not ALLOWED[name] & CHECKPOINT, name


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
    for name in torchshard.checkpoint.__all__:
        assert getattr(torchshard.checkpoint, name).__doc__, f"{name} has no docstring"


def test_public_api_is_exported_and_documented():
    for name in torchshard.__all__:
        obj = getattr(torchshard, name)
        if callable(obj):
            assert obj.__doc__, f"{name} has no docstring"
