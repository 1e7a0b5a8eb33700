"""The on-disk format of a checkpoint: names, metadata.json, and its validation (no I/O of tensors)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._errors import CheckpointError, LayoutError
from ._layout import FlatLayout, dtype_from_name, dtype_name
from ._reshard import element_ranges, weight_shards
from ._safetensors import FileRecord, SafetensorsReader, TensorEntry

__all__ = [
    "FORMAT_VERSION",
    "Metadata",
    "OptimMeta",
    "Readers",
    "build_metadata",
    "commit",
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
class OptimMeta:
    """The optimizer section of ``metadata.json``, parsed."""

    cls: str
    flat_state: dict[str, torch.dtype]
    scalar_state: dict[str, Any]
    param_groups: list[dict[str, Any]]
    stateful: str
    files: list[tuple[str, int, int]]  # (file, start, end) in flat-buffer elements


def _parse_optim(meta_path: Path, o: Any) -> OptimMeta | None:
    if o is None:
        return None
    try:
        files = []
        for f in o["files"]:
            start, end = (int(x) for x in f["range"])
            files.append((str(f["file"]), start, end))
        groups = o["param_groups"]
        if not isinstance(groups, list) or not isinstance(o["class"], str):
            raise TypeError("expected 'class' to be a string and 'param_groups' a list")
        for g in groups:
            if not isinstance(g, dict) or not isinstance(g["params"], list):
                raise TypeError("param_groups: expected objects with a 'params' list")
        return OptimMeta(
            cls=o["class"],
            flat_state={str(k): dtype_from_name(v) for k, v in o["flat_state"].items()},
            scalar_state=dict(o["scalar_state"]),
            param_groups=groups,
            stateful=str(o["stateful"]),
            files=files,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # LayoutError is a ValueError
        raise CheckpointError(f"{meta_path}: optimizer: malformed ({type(e).__name__}: {e})") from e


def _structure_problems(
    where: Path, layout: FlatLayout, weights: list[dict[str, Any]], opt: OptimMeta | None
) -> list[str]:
    """What in ``metadata.json`` does not add up (slot and range coverage, per-slot lists)."""
    n, problems, pos = len(layout.slots), [], 0
    for w in weights:
        lo, hi = w["slots"]
        if lo != pos or hi <= lo:
            problems.append(
                f"{where}: weight shard {w['file']} holds slots [{lo}, {hi}), expected [{pos}, ...)"
            )
            break
        pos = hi
    else:
        if pos != n:
            problems.append(f"{where}: the weight shards hold slots [0, {pos}) of {n}")
    if opt is None:
        return problems
    if len(opt.stateful) != n or set(opt.stateful) - {"0", "1"}:
        problems.append(f"{where}: optimizer: 'stateful' is not {n} digits 0/1")
    for key, spec in opt.scalar_state.items():
        values = spec.get("values") if isinstance(spec, dict) else None
        if not isinstance(values, list) or len(values) != n or "dtype" not in spec:
            problems.append(f"{where}: optimizer scalar state {key!r}: expected {n} values")
            continue
        if spec["dtype"] != "python" and not isinstance(
            getattr(torch, str(spec["dtype"]), None), torch.dtype
        ):
            problems.append(
                f"{where}: optimizer scalar state {key!r}: unknown dtype {spec['dtype']!r}"
            )
        if any(v is not None and not isinstance(v, (int, float, bool)) for v in values):
            problems.append(
                f"{where}: optimizer scalar state {key!r}: values must be numbers or null"
            )
    names = {s.name for s in layout}
    for g, group in enumerate(opt.param_groups):
        unknown = [p for p in group["params"] if p not in names]
        if unknown:
            problems.append(f"{where}: optimizer param group {g}: unknown parameters {unknown[:3]}")
    if opt.flat_state:
        pos = 0
        for file, start, end in opt.files:
            if start != pos or end <= start:
                problems.append(
                    f"{where}: optimizer file {file} holds elements [{start}, {end}), "
                    f"expected [{pos}, ...)"
                )
                break
            pos = end
        else:
            if pos != layout.numel:
                problems.append(
                    f"{where}: the optimizer files hold elements [0, {pos}) of {layout.numel}"
                )
    return problems


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
    optim: OptimMeta | None
    extra: dict[str, Any]
    raw: dict[str, Any]
    model_config: dict[str, Any] | None = (
        None  # a transformers model's config.json, when saved from one
    )

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
        optim = _parse_optim(meta_path, raw.get("optimizer"))
        if optim is not None:
            for f, _, _ in optim.files:
                _safe_name(f, str(meta_path))
        layout = FlatLayout.from_dict(raw["layout"])
        extra = raw.get("extra") or {}
        if not isinstance(extra, dict):
            raise TypeError(f"extra: expected a JSON object, got {type(extra).__name__}")
        model_config = raw.get("model_config")
        if model_config is not None and not isinstance(model_config, dict):
            raise TypeError(
                f"model_config: expected a JSON object or null, got {type(model_config).__name__}"
            )
        meta = Metadata(
            path=path,
            step=int(raw["step"]),
            world_size=int(raw["world_size"]),
            layout=layout,
            files=files,
            weights=weights,
            buffers=buffers,
            optim=optim,
            extra=extra,
            raw=raw,
            model_config=model_config,
        )
    except CheckpointError:
        raise
    except LayoutError as e:
        raise CheckpointError(f"{meta_path}: {e}") from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{meta_path}: malformed ({type(e).__name__}: {e})") from e
    problems = _structure_problems(meta_path, meta.layout, weights, optim)
    if problems:
        raise CheckpointError(problems[0])
    referenced = {w["file"] for w in weights} | set(buffers.values())
    if optim is not None:
        referenced |= {f for f, _, _ in optim.files}
    missing = referenced - set(files)
    if missing:
        raise CheckpointError(f"{meta_path}: files {sorted(missing)} have no size/checksum record")
    return meta


class Readers:
    """Opens a checkpoint's files on demand, a few at a time; counts the bytes read."""

    def __init__(self, meta: Metadata, max_open: int = 8) -> None:
        self.meta = meta
        self.max_open = max_open
        self._open: dict[str, SafetensorsReader] = {}  # in order of last use
        self.bytes_read = 0

    def __getitem__(self, name: str) -> SafetensorsReader:
        reader = self._open.pop(name, None)
        if reader is None:
            if len(self._open) >= self.max_open:
                self._close(next(iter(self._open)))
            reader = SafetensorsReader(self.meta.file_path(name), self.meta.files[name])
        self._open[name] = reader
        return reader

    def entry(
        self, file: str, name: str, dtype: torch.dtype | None, shape: tuple[int, ...] | None
    ) -> TensorEntry:
        """Tensor ``name`` of ``file``; raise :class:`CheckpointError` unless it is as expected."""
        reader = self[file]
        e = reader.entries.get(name)
        if e is None or (dtype is not None and e.dtype != dtype) or shape not in (None, e.shape):
            want = f"{dtype_name(dtype) if dtype else 'a tensor'} {list(shape or ())}"
            found = "nothing" if e is None else f"{dtype_name(e.dtype)} {list(e.shape)}"
            raise CheckpointError(f"{reader.path}: tensor {name!r}: expected {want}, found {found}")
        return e

    def _close(self, name: str) -> None:
        reader = self._open.pop(name)
        self.bytes_read += reader.bytes_read
        reader.close()

    def close(self) -> None:
        while self._open:
            self._close(next(iter(self._open)))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON and fsync it."""
    with open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def commit(
    tmp: Path, final: Path, metadata: dict[str, Any], files: dict[str, Any], buffer_bytes: int
) -> None:
    """Write the index and ``metadata.json`` (last) into ``tmp``, then rename it to ``final``.

    ``metadata`` is everything but ``"files"``, which is ``files`` (name ->
    record dict); ``buffer_bytes`` counts the module buffers for the index's
    ``total_size``. The rename is the commit; both directories are fsynced.
    """
    layout = FlatLayout.from_dict(metadata["layout"])
    weight_map, total = {}, buffer_bytes
    for shard in metadata["weights"]["shards"]:
        lo, hi = shard["slots"]
        for s in layout.slots[lo:hi]:
            weight_map[s.name] = shard["file"]
            total += s.numel * layout.torch_dtype.itemsize
    weight_map.update(metadata["weights"]["buffers"])
    write_json(tmp / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(tmp / METADATA, {**metadata, "files": files})  # last: its presence means complete
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def build_metadata(
    layout: FlatLayout,
    world_size: int,
    step: int,
    buffers: list[str],
    optimizer: dict[str, Any] | None,
    extra: dict[str, Any],
    model_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``metadata.json`` of a save at ``world_size``, without ``files`` (pure: no tensors).

    ``optimizer`` holds ``class``, ``param_groups``, ``flat_state``,
    ``scalar_state`` and ``stateful``; the file list is derived here.
    """
    shards = weight_shards(layout, world_size)
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "layout": layout.to_dict(),
        "weights": {
            "shards": [
                {"file": model_file(r, world_size), "slots": [a, b]}
                for r, (a, b) in enumerate(shards)
                if b > a
            ],
            "buffers": {n: model_file(0, world_size) for n in buffers},
        },
        "optimizer": None,
        "extra": extra,
        "model_config": model_config,
    }
    if optimizer is not None:
        align = layout.align_bytes // layout.torch_dtype.itemsize
        ranges = element_ranges(layout.numel, world_size, align)
        files = [
            {"file": optim_file(r, world_size), "range": [a, b]}
            for r, (a, b) in enumerate(ranges)
            if b > a and optimizer["flat_state"]
        ]
        meta["optimizer"] = {**optimizer, "files": files}
    return meta
