"""The on-disk format of a checkpoint: directory and file names, ``metadata.json`` built
(:func:`build_metadata`) and sealed by its own SHA-256 (:func:`seal`), and a directory's life:
prepared under a temporary name, committed by a rename, rotated out (no I/O of tensors).
Reading it back is ``_metadata``'s job."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._errors import CheckpointError
from .._flat.layout import FlatLayout, ParamSlot
from .._log import get_logger
from ._plan import state_ranges, trainable_only, weight_runs
from ._rules import ADVICE

__all__ = [
    "COMM_VERSION",
    "DENSE_VERSION",
    "FORMAT_VERSION",
    "INDEX",
    "METADATA",
    "MIXED_VERSION",
    "SPARSE_VERSION",
    "build_metadata",
    "check_save_args",
    "comm_file",
    "commit",
    "complete_checkpoints",
    "fsync_dir",
    "holds_frozen",
    "index_json",
    "model_file",
    "optim_file",
    "prepare",
    "resolve",
    "rotate",
    "saved_slots",
    "seal",
    "step_dir",
    "step_of",
    "tmp_dir",
    "unseal",
    "write_bytes",
]

# 2: metadata.json ends with its own SHA-256; the index's is recorded. 3: optimizer files may
# store the trainable parameters' state alone ("stored": "trainable"); only such checkpoints
# say 3, the rest stay 2 (byte for byte what they were). 4: parameters of several dtypes (a
# layout of format 2; optimizer state in one stream per key and parameter dtype: _streams);
# only such checkpoints say 4. 5: the compression state of a lossy comm ("comm", comm
# files: _comm_meta); only such checkpoints say 5 (a reader of 4 would drop it silently).
FORMAT_VERSION = 5
DENSE_VERSION = 2
SPARSE_VERSION = 3
MIXED_VERSION = 4
COMM_VERSION = 5
METADATA = "metadata.json"
INDEX = "model.safetensors.index.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")

logger = get_logger(__name__)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a directory named ``step-N`` is for; ``None`` for any other name."""
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def model_file(rank: int, world: int) -> str:
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def optim_file(rank: int, world: int) -> str:
    return f"optim-{rank + 1:05d}-of-{world:05d}.safetensors"


def comm_file(rank: int, world: int) -> str:
    return f"comm-{rank + 1:05d}-of-{world:05d}.safetensors"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every committed checkpoint under ``root``, oldest first.

    Committed means: the directory has its final name (the rename is the
    commit) and holds ``metadata.json``, written last.
    """
    found = []
    if root.is_dir():
        for p in root.iterdir():
            step = step_of(p)
            if step is not None and (p / METADATA).is_file():
                found.append((step, p))
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


# -- the checksum of metadata.json --------------------------------------------------------
_SEAL = b',"sha256":"'
_SEAL_LEN = len(_SEAL) + 64 + 2  # the marker, 64 hex digits, '"}'


def seal(content: dict[str, Any]) -> bytes:
    """``content`` as compact JSON, ending with ``"sha256"``: the SHA-256 of every byte before
    ``,"sha256":"``. A flipped bit anywhere, the checksum included, no longer matches."""
    if "sha256" in content:
        raise ValueError("metadata: 'sha256' is the checksum's key")
    body = json.dumps(content, separators=(",", ":")).encode()
    head = body[:-1]  # without the closing brace
    return head + _SEAL + hashlib.sha256(head).hexdigest().encode() + b'"}'


def unseal(meta_path: Path, data: bytes) -> bool:
    """Whether ``data`` ends with a checksum (then verified); raise if it does not match."""
    tail = data[-_SEAL_LEN:]
    if len(data) <= _SEAL_LEN or not tail.startswith(_SEAL) or not tail.endswith(b'"}'):
        return False
    recorded = tail[len(_SEAL) : -2]
    actual = hashlib.sha256(data[:-_SEAL_LEN]).hexdigest().encode()
    if recorded != actual:
        raise CheckpointError(
            f"{meta_path}: checksum mismatch: its content hashes to sha256 {actual.decode()}, "
            f"the file records {recorded.decode(errors='replace')!r}; {ADVICE}"
        )
    return True


# -- writing and committing --------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def saved_slots(layout: FlatLayout, lo: int, hi: int, metadata: dict[str, Any]) -> list[ParamSlot]:
    """The slots of ``[lo, hi)`` that a model file of the checkpoint whose ``metadata.json``
    is ``metadata`` holds: every one, or the trainable ones of a checkpoint saved with
    ``frozen=False`` (``"weights": {"frozen": false}``: a LoRA checkpoint of the adapters).

    Example::

        names = [s.name for s in saved_slots(meta.layout, lo, hi, meta.raw)]
    """
    frozen = holds_frozen(metadata)
    return [s for s in layout.slots[lo:hi] if frozen or s.requires_grad]


def holds_frozen(metadata: dict[str, Any]) -> bool:
    """Whether the model files hold the frozen parameters' weights (``False``: the checkpoint
    was saved with ``frozen=False``)."""
    return metadata["weights"].get("frozen", True) is not False


def index_json(metadata: dict[str, Any], buffer_bytes: int) -> dict[str, Any]:
    """``model.safetensors.index.json`` of a checkpoint whose ``metadata.json`` is ``metadata``
    (``buffer_bytes``: the module buffers' bytes, for ``total_size``)."""
    layout = FlatLayout.from_dict(metadata["layout"])
    weight_map, total = {}, buffer_bytes
    for shard in metadata["weights"]["shards"]:
        lo, hi = shard["slots"]
        for s in saved_slots(layout, lo, hi, metadata):
            weight_map[s.name] = shard["file"]
            total += s.numel * s.torch_dtype.itemsize  # each in its own dtype
    weight_map.update(metadata["weights"]["buffers"])
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def commit(
    tmp: Path, final: Path, metadata: dict[str, Any], files: dict[str, Any], buffer_bytes: int
) -> None:
    """Write the index and ``metadata.json`` (last) into ``tmp``, then rename it to ``final``.

    ``metadata`` is everything but ``"files"``, which is ``files`` (name ->
    record dict); ``buffer_bytes`` counts the module buffers for the index's
    ``total_size``. ``metadata.json`` records the index's size and SHA-256 and
    ends with its own (:func:`seal`). The rename is the commit; both
    directories are fsynced.
    """
    index = json.dumps(index_json(metadata, buffer_bytes), separators=(",", ":")).encode()
    write_bytes(tmp / INDEX, index)
    content = {k: v for k, v in metadata.items() if k not in ("files", "index", "sha256")}
    content["format_version"] = metadata.get("format_version", FORMAT_VERSION)
    content["index"] = {"size": len(index), "sha256": hashlib.sha256(index).hexdigest()}
    content["files"] = files
    write_bytes(tmp / METADATA, seal(content))  # last: its presence means complete
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def prepare(root: Path, tmp: Path, final: Path) -> None:
    if final.exists():
        raise CheckpointError(
            f"{final}: a checkpoint for this step already exists; save under a new step or delete it"
        )
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by a save that crashed
        shutil.rmtree(tmp)
    tmp.mkdir()


def rotate(root: Path, keep_last: int, keep: Path) -> None:
    done = complete_checkpoints(root)
    for _, path in done[: max(0, len(done) - keep_last)]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
            logger.info("checkpoint rotated out: %s", path)


def build_metadata(
    layout: FlatLayout,
    world_size: int,
    step: int,
    buffers: list[str],
    optimizer: dict[str, Any] | None,
    extra: dict[str, Any],
    model_config: dict[str, Any] | None = None,
    frozen: bool = True,
) -> dict[str, Any]:
    """``metadata.json`` of a save at ``world_size``, without ``files`` (pure: no tensors).

    ``optimizer`` holds ``class``, ``param_groups``, ``flat_state``,
    ``scalar_state`` and ``stateful``; the file list is derived here.
    """
    shards = weight_runs(layout, world_size)
    meta: dict[str, Any] = {
        "format_version": DENSE_VERSION,
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
    if not frozen and trainable_only(layout):  # the model files hold no frozen weight
        meta["weights"]["frozen"] = False
        meta["format_version"] = SPARSE_VERSION
    if optimizer is not None:
        ranges = state_ranges(layout, world_size)
        files = [
            {"file": optim_file(r, world_size), "range": [a, b]}
            for r, (a, b) in enumerate(ranges)
            if b > a and optimizer["flat_state"]
        ]
        meta["optimizer"] = {**optimizer, "files": files}
        if trainable_only(layout):  # no zeros for the frozen parameters (stored_parts)
            meta["optimizer"]["stored"] = "trainable"
            meta["format_version"] = SPARSE_VERSION
    if layout.mixed:
        meta["format_version"] = MIXED_VERSION
    return meta


def check_save_args(step: Any, extra: Any) -> dict[str, Any]:
    """``extra`` as it will load back (``{}`` for ``None``), once ``step`` is a non-negative
    integer and ``extra`` a dict of JSON values with string keys; else :class:`CheckpointError`.

    Example::

        check_save_args(100, {"data": {"epoch": 2}})  # {'data': {'epoch': 2}}
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step: expected a non-negative integer, got {step!r}")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise CheckpointError(
            f"extra: expected a dict of JSON values or None, got {type(extra).__name__}"
        )
    odd = [k for k in _keys(extra) if not isinstance(k, str)]
    if odd:  # JSON would turn them into strings: another dict comes back than was saved
        raise CheckpointError(
            f"extra: expected string keys, got {odd[0]!r} ({type(odd[0]).__name__}); "
            "JSON would load it back as a string"
        )
    try:
        return json.loads(json.dumps(extra, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"extra: expected a dict of JSON values ({e}); NaN and infinity are not JSON: "
            "store None or a string instead"
        ) from e


def _keys(value: Any) -> Iterator[Any]:
    """Every dict key in ``value``, at any depth."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _keys(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _keys(v)
