"""Imports flow one way: layout -> flat module -> communication / trainer -> (checkpoint) -> CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import torchshard

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
    "_safetensors": {"_errors"},
    "_ckpt_format": {"_errors", "_layout", "_reshard", "_safetensors"},
    "_ckpt_optim": {"_errors", "_flat_module", "_layout", "_trainer"},
    "_ckpt_target": {"_errors", "_flat_module", "_trainer"},
    "_ckpt_load": {
        "_ckpt_format",
        "_ckpt_optim",
        "_ckpt_target",
        "_dist",
        "_errors",
        "_flat_module",
        "_layout",
        "_reshard",
        "_safetensors",
        "_trainer",
    },
    "_ckpt_tools": {"_ckpt_format", "_errors", "_layout", "_reshard", "_safetensors"},
    "_estimate": {"_errors", "_flat_module", "_layout", "_log", "_memory"},
    "_cli": {"__init__", "_ckpt_tools", "_errors", "_estimate", "_layout"},
}
# save: load's world, load itself, and a transformers model's config
ALLOWED["_checkpoint"] = ALLOWED["_ckpt_load"] | {"_ckpt_load", "_hf", "_log"}
# The trainer side never reaches into checkpointing.
CHECKPOINT = {m for m in ALLOWED if m.startswith("_ck") or m == "_checkpoint"}


def internal_imports(path: Path) -> tuple[set[str], list[str]]:
    tree = ast.parse(path.read_text())
    found, calls = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add(node.module or "__init__")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls.append(node.func.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            calls.append(ast.unparse(node.func))
    return found, calls


def test_import_directions():
    modules = {p.stem for p in PACKAGE.glob("_*.py") if p.stem != "__init__"}
    assert modules == set(ALLOWED), "place new modules in ALLOWED"
    for name, allowed in ALLOWED.items():
        found, _ = internal_imports(PACKAGE / f"{name}.py")
        assert found <= allowed, f"{name} imports {found - allowed}"
    for name in ("_layout", "_flat_module", "_buckets", "_dist", "_trainer"):
        assert not ALLOWED[name] & CHECKPOINT, name


def test_library_neither_prints_nor_configures_logging():
    for path in PACKAGE.glob("_*.py"):
        _, calls = internal_imports(path)
        if path.stem != "_cli":
            assert "print" not in calls, path.name
        assert "logging.basicConfig" not in calls, path.name


def test_public_api_is_exported_and_documented():
    for name in torchshard.__all__:
        obj = getattr(torchshard, name)
        if callable(obj):
            assert obj.__doc__, f"{name} has no docstring"
