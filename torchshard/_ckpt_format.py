"""The on-disk format of a checkpoint: names, metadata.json, and its validation (no I/O of tensors)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import CheckpointError, LayoutError
from ._layout import FlatLayout
from ._safetensors import FileRecord

__all__ = [
    "FORMAT_VERSION",
    "Metadata",
    "complete_checkpoints",
    "model_file",
    "optim_file",
    "read_metadata",
    "step_dir",
]

FORMAT_VERSION = 1
METADATA = "metadata.json"
INDEX = "model.safetensors.index.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def model_file(rank: int, world: int) -> str:
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def optim_file(rank: int, world: int) -> str:
    return f"optim-{rank + 1:05d}-of-{world:05d}.safetensors"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every committed checkpoint under ``root``, oldest first.

    Committed means: the directory has its final name (the rename is the
    commit) and holds ``metadata.json``, written last.
    """
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / METADATA).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def resolve(path: Path) -> Path:
    """A checkpoint directory as given, or the latest complete one under a root."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or checkpoint root")
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: holds no complete checkpoint (step-*/{METADATA})")
    return found[-1][1]


@dataclass(frozen=True)
class Metadata:
    """A parsed, validated ``metadata.json``."""

    path: Path
    step: int
    world_size: int
    layout: FlatLayout
    files: dict[str, FileRecord]
    weights: list[dict[str, Any]]  # [{"file", "slots": [lo, hi]}], one per saving rank with weights
    buffers: dict[str, str]  # buffer name -> file
    optimizer: dict[str, Any] | None
    extra: dict[str, Any]
    raw: dict[str, Any]

    def file_path(self, name: str) -> Path:
        return self.path / name


def _safe_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise CheckpointError(
            f"{where}: file name {name!r} points outside the checkpoint directory"
        )
    return name


def read_metadata(path: Path) -> Metadata:
    """Read and validate ``path/metadata.json``; raise :class:`CheckpointError` on anything wrong."""
    meta_path = path / METADATA
    try:
        raw = json.loads(meta_path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{meta_path}: missing; {path} is not a complete checkpoint") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{meta_path}: expected a JSON object")
    version = raw.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"{meta_path}: format_version: expected an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: format_version {version} is newer than this torchshard reads "
            f"({FORMAT_VERSION}); upgrade torchshard to load it"
        )
    try:
        files = {
            _safe_name(name, str(meta_path)): FileRecord.from_dict(rec)
            for name, rec in raw["files"].items()
        }
        weights = []
        for w in raw["weights"]["shards"]:
            lo, hi = (int(x) for x in w["slots"])
            weights.append({"file": _safe_name(w["file"], str(meta_path)), "slots": [lo, hi]})
        buffers = {
            str(k): _safe_name(v, str(meta_path)) for k, v in raw["weights"]["buffers"].items()
        }
        optimizer = raw.get("optimizer")
        if optimizer is not None:
            for f in optimizer["files"]:
                _safe_name(f["file"], str(meta_path))
        layout = FlatLayout.from_dict(raw["layout"])
        extra = raw.get("extra") or {}
        meta = Metadata(
            path=path,
            step=int(raw["step"]),
            world_size=int(raw["world_size"]),
            layout=layout,
            files=files,
            weights=weights,
            buffers=buffers,
            optimizer=optimizer,
            extra=extra,
            raw=raw,
        )
    except CheckpointError:
        raise
    except LayoutError as e:
        raise CheckpointError(f"{meta_path}: {e}") from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{meta_path}: malformed ({type(e).__name__}: {e})") from e
    referenced = {w["file"] for w in weights} | set(buffers.values())
    if optimizer is not None:
        referenced |= {f["file"] for f in optimizer["files"]}
    missing = referenced - set(files)
    if missing:
        raise CheckpointError(f"{meta_path}: files {sorted(missing)} have no size/checksum record")
    return meta
