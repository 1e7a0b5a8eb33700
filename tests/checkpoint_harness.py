"""What the checkpoint error tests share: a saved tiny GPT, a different model and optimizer to
load it into, and what a failed load must leave unchanged (bitwise).

Used by ``test_checkpoint_corruption.py``, ``test_checkpoint_metadata.py``,
``test_checkpoint_rules.py``, ``test_checkpoint_mismatch.py`` and ``test_checkpoint_crash.py``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpt import GPT, GPTConfig

import torchshard
from torchshard import checkpoint
from torchshard.checkpoint import CheckpointError

CFG = GPTConfig.preset("tiny")  # 28 parameter slots, 7872 elements: 34 KB of weights
MODEL = "model-00001-of-00001.safetensors"
OPTIM = "optim-00001-of-00001.safetensors"


def one_thread() -> Iterator[None]:
    """Models this small gain nothing from intra-op threads; on a busy box they only spin.

    For a module-scoped autouse fixture: ``yield from one_thread()``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- models, snapshots -----------------------------------------------------------------------------
def build(cfg: GPTConfig = CFG, seed: int = 0) -> torchshard.FlatParamModule:
    torch.manual_seed(seed)
    fm = torchshard.FlatParamModule(GPT(cfg))
    fm.bind(torch.empty(fm.numel))
    return fm


def train(
    fm: torchshard.FlatParamModule,
    opt: torch.optim.Optimizer,
    steps: int,
    seed: int,
    trainer: torchshard.DistributedTrainer | None = None,
) -> None:
    cfg = fm.module.cfg
    for i in range(steps):
        g = torch.Generator().manual_seed(1000 * seed + i)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
        opt.zero_grad()
        fm(idx[:, :-1], idx[:, 1:])[1].backward()
        if trainer is not None:
            trainer.average_gradients()
        opt.step()


def target(cfg: GPTConfig = CFG) -> tuple[torchshard.FlatParamModule, torch.optim.Optimizer]:
    """A model and optimizer that differ from the saved ones in weights, state and hyperparameters."""
    fm = build(cfg, seed=1)
    opt = torch.optim.AdamW(fm.parameters(), lr=2e-3, betas=(0.8, 0.9), weight_decay=0.05)
    train(fm, opt, 2, seed=1)
    return fm, opt


def reseal(data: bytes) -> bytes:
    """``metadata.json`` bytes with the checksum made to vouch for them (docs/checkpoint-format.md:
    the SHA-256 of every byte before ``,"sha256":"``, last in the object); as is when unsealed."""
    meta = json.loads(data)
    if not isinstance(meta, dict) or "sha256" not in meta:
        return data
    meta.pop("sha256")
    body = json.dumps(meta, separators=(",", ":")).encode()[:-1]
    return body + b',"sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'"}'


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def tree_diff(a: Any, b: Any, where: str) -> list[str]:
    """Where two state trees differ: tensors bitwise, containers by type and content."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)
        return [] if ok else [f"{where}: {a!r} vs {b!r}"]
    if type(a) is not type(b):
        return [f"{where}: {a!r} vs {b!r}"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in tree_diff(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tree_diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def snapshot(fm: torchshard.FlatParamModule, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    flat = fm.flat_param
    assert flat is not None
    return {
        "flat_ptr": flat.data_ptr(),
        "flat": flat.detach().clone(),
        "params": {n: p.detach().clone() for n, p in fm.module.named_parameters()},
        "optim": None if opt is None else copy.deepcopy(opt.state_dict()),
    }


def changes(
    fm: torchshard.FlatParamModule, opt: torch.optim.Optimizer | None, before: dict[str, Any]
) -> list[str]:
    """What differs from ``before``: the buffer, any parameter, any optimizer state or hyperparameter."""
    flat = fm.flat_param
    assert flat is not None
    out = []
    if flat.data_ptr() != before["flat_ptr"]:
        out.append("the flat buffer was replaced")
    if not same_bits(flat, before["flat"]):
        out.append("flat buffer")
    params = dict(fm.module.named_parameters())
    if params.keys() != before["params"].keys():
        out.append("parameter names")
    out += [f"parameter {n}" for n, p in before["params"].items() if not same_bits(params[n], p)]
    if opt is not None:
        out += tree_diff(opt.state_dict(), before["optim"], "optimizer")
    return out


def refused(
    path: Path,
    fm: torchshard.FlatParamModule | None = None,
    opt: torch.optim.Optimizer | None = None,
    *,
    with_optimizer: bool = True,
) -> str:
    """Load ``path`` into a fresh target; assert CheckpointError and no change; return the message."""
    if fm is None:
        fm, opt = target()
    before = snapshot(fm, opt)
    try:
        checkpoint.load(path, fm, optimizer=opt if with_optimizer else None)
    except Exception as e:
        error: Exception | None = e
    else:
        error = None
    assert error is not None, f"{path}: loaded without an error"
    changed = changes(fm, opt, before)
    assert not changed, (
        f"a failed load ({type(error).__name__}: {error}) changed {len(changed)} things: "
        f"{changed[:3]}..."
    )
    assert isinstance(error, CheckpointError), (
        f"not a CheckpointError: {type(error).__name__}: {error}"
    )
    return str(error)


# -- checkpoints on disk ---------------------------------------------------------------------------
def save_tiny(tmp_path: Path) -> Path:
    """A committed checkpoint of the tiny GPT with AdamW state, saved at world size 1."""
    fm = build(seed=0)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)
    train(fm, opt, 1, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", fm, step=1, optimizer=opt)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [MODEL, OPTIM, "metadata.json", "model.safetensors.index.json"]
    )
    return path


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "metadata.json").read_text())


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    """Write an edited ``metadata.json`` with its checksum made to match (what a writer bug or
    a hand edit that knows the format produces), so the checks behind the checksum are tested."""
    (path / "metadata.json").write_bytes(reseal(json.dumps(meta).encode()))


def header(file: Path) -> tuple[int, dict[str, Any]]:
    """(start of the data section, JSON header) of a safetensors file."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n, json.loads(raw[8 : 8 + n])


def flip_byte(file: Path, offset: int) -> None:
    raw = bytearray(file.read_bytes())
    raw[offset] ^= 0x5A
    file.write_bytes(bytes(raw))


def rerecord(record: dict[str, Any], data: bytes) -> dict[str, Any]:
    """``metadata.json``'s record of a file, made to vouch for ``data`` instead.

    The size always; per-chunk CRC32s of the whole file where the record keeps
    them. A header checksum cannot apply to bytes with no safetensors header.
    """
    out = dict(record, size=len(data))
    if isinstance(out.get("crc32"), str) and "chunk_bytes" in out:
        chunk = int(out["chunk_bytes"])
        crcs = [zlib.crc32(data[i : i + chunk]) for i in range(0, len(data), chunk)]
        out["crc32"] = "".join(f"{c:08x}" for c in crcs)
    return out


# -- fixtures, for every test module (registered in conftest.py) ---------------------------
@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Use as ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    yield from one_thread()


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A small committed checkpoint (see :func:`save_tiny`)."""
    return save_tiny(tmp_path)
