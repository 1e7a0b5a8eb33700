"""Every way a checkpoint can be broken is a clear CheckpointError, and a failed load changes nothing.

Each test damages a real checkpoint on disk (truncation, flipped bytes, missing
files, malformed or hostile ``metadata.json``, pickles posing as shards, a
different model or optimizer), loads it into a *different* model and
optimizer, and checks that ``load`` raises :class:`CheckpointError` naming the
file or parameter at fault, and that the weights, the optimizer state and its
hyperparameters are bitwise what they were before. Saves that fail (a full
disk, simulated with ``RLIMIT_FSIZE``) or die (SIGKILL mid-write) must leave
the previous checkpoint the latest one, intact and loadable.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from test_checkpoint_integrity import reseal

import torchshard
from torchshard import TorchShardError, checkpoint
from torchshard.checkpoint import CheckpointError
from torchshard.checkpoint._rules import OPTIMIZER_RULES, Invalid

CFG = GPTConfig.preset("tiny")  # 28 parameter slots, 7872 elements: 34 KB of weights
MODEL = "model-00001-of-00001.safetensors"
OPTIM = "optim-00001-of-00001.safetensors"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Models this small gain nothing from intra-op threads; on a busy box they only spin."""
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


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _tree_diff(a: Any, b: Any, where: str) -> list[str]:
    """Where two state trees differ: tensors bitwise, containers by type and content."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_bits(a, b)
        return [] if ok else [where]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in _tree_diff(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _tree_diff(x, y, f"{where}[{i}]")]
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
    if not _same_bits(flat, before["flat"]):
        out.append("flat buffer")
    params = dict(fm.module.named_parameters())
    if params.keys() != before["params"].keys():
        out.append("parameter names")
    out += [f"parameter {n}" for n, p in before["params"].items() if not _same_bits(params[n], p)]
    if opt is not None:
        out += _tree_diff(opt.state_dict(), before["optim"], "optimizer")
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
@pytest.fixture
def saved(tmp_path: Path) -> Path:
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


def _numbers_for_checksums(record: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if k == "size" else 12345678) for k, v in record.items()}


def test_checkpoint_error_is_a_torchshard_error():
    assert issubclass(CheckpointError, TorchShardError)


def test_control_an_intact_checkpoint_loads_and_changes_everything(saved):
    """The harness is sound: a good load changes weights, optimizer state and hyperparameters."""
    fm, opt = target()
    before = snapshot(fm, opt)
    info = checkpoint.load(saved, fm, optimizer=opt)
    assert info.step == 1
    changed = changes(fm, opt, before)
    assert "flat buffer" in changed
    assert any("exp_avg" in c for c in changed)
    assert any("'lr'" in c for c in changed)
    assert any("'step'" in c for c in changed)


# -- 1. truncated shards ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", [MODEL, OPTIM])
@pytest.mark.parametrize("keep", ["half", "header only", "empty"])
def test_truncated_shard(saved, name, keep):
    file = saved / name
    raw = file.read_bytes()
    size = {"half": len(raw) // 2, "header only": header(file)[0], "empty": 0}[keep]
    file.write_bytes(raw[:size])
    message = refused(saved)
    assert name in message
    assert "truncated" in message


# -- 2. flipped bytes ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [MODEL, OPTIM])
@pytest.mark.parametrize("where", ["data start", "data middle", "last byte", "header"])
def test_flipped_byte_fails_the_checksum(saved, name, where):
    file = saved / name
    start, _ = header(file)
    size = file.stat().st_size
    offset = {
        "data start": start,
        "data middle": (start + size) // 2,
        "last byte": size - 1,
        "header": 20,
    }[where]
    flip_byte(file, offset)
    message = refused(saved)
    assert name in message
    assert "checksum mismatch" in message


# -- 3. missing shard files ------------------------------------------------------------------------
@pytest.mark.parametrize("name", [MODEL, OPTIM])
def test_missing_shard(saved, name):
    (saved / name).unlink()
    message = refused(saved)
    assert name in message
    assert "missing" in message


# -- 4. malformed metadata.json --------------------------------------------------------------------
def _text(text: str | bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        data = text.encode() if isinstance(text, str) else text
        (path / "metadata.json").write_bytes(data)

    return write


def _edit(
    *keys: Any,
    value: Any = None,
    drop: bool = False,
    transform: Callable[[Any], Any] | None = None,
) -> Callable[[Path], None]:
    """Set, delete or transform ``meta[k0][k1]...``."""

    def write(path: Path) -> None:
        meta = read_meta(path)
        node = meta
        for k in keys[:-1]:
            node = node[k]
        if drop:
            del node[keys[-1]]
        elif transform is not None:
            node[keys[-1]] = transform(node[keys[-1]])
        else:
            node[keys[-1]] = value
        write_meta(path, meta)

    return write


MALFORMED = {
    # not JSON at all
    "not json": _text("{this is not json"),
    "empty file": _text(""),
    "binary": _text(b"\xff\xfe\x00\x01garbage"),
    "truncated json": _text('{"format_version": 1, "step": 1, "files": {'),
    # JSON, but not an object
    "a list": _text("[1, 2, 3]"),
    "null": _text("null"),
    "a string": _text('"metadata"'),
    # missing keys
    "no format_version": _edit("format_version", drop=True),
    "no step": _edit("step", drop=True),
    "no world_size": _edit("world_size", drop=True),
    "no layout": _edit("layout", drop=True),
    "no layout.slots": _edit("layout", "slots", drop=True),
    "no layout.dtype": _edit("layout", "dtype", drop=True),
    "no files": _edit("files", drop=True),
    "no files record of the model shard": _edit("files", MODEL, drop=True),
    "no files record of the optim shard": _edit("files", OPTIM, drop=True),
    "no size in a files record": _edit("files", MODEL, "size", drop=True),
    "a files record empty": _edit("files", MODEL, value={}),
    "no weights": _edit("weights", drop=True),
    "no weights.shards": _edit("weights", "shards", drop=True),
    "no weights.buffers": _edit("weights", "buffers", drop=True),
    "no file in a weight shard": _edit("weights", "shards", 0, "file", drop=True),
    "no slots in a weight shard": _edit("weights", "shards", 0, "slots", drop=True),
    "weights.shards empty": _edit("weights", "shards", value=[]),
    "weight shards cover only some parameters": _edit(
        "weights", "shards", 0, "slots", value=[0, 5]
    ),
    "no optimizer.class": _edit("optimizer", "class", drop=True),
    "no optimizer.param_groups": _edit("optimizer", "param_groups", drop=True),
    "no params in a param group": _edit("optimizer", "param_groups", 0, "params", drop=True),
    "no optimizer.flat_state": _edit("optimizer", "flat_state", drop=True),
    "no optimizer.scalar_state": _edit("optimizer", "scalar_state", drop=True),
    "no optimizer.stateful": _edit("optimizer", "stateful", drop=True),
    "no optimizer.files": _edit("optimizer", "files", drop=True),
    "optimizer.files empty": _edit("optimizer", "files", value=[]),
    "no range in an optimizer file": _edit("optimizer", "files", 0, "range", drop=True),
    # wrong types
    "format_version a string": _edit("format_version", value="1"),
    "format_version a float": _edit("format_version", value=1.5),
    "step a string": _edit("step", value="one"),
    "step a list": _edit("step", value=[1]),
    "world_size a string": _edit("world_size", value="two"),
    "layout a string": _edit("layout", value="layout"),
    "layout.slots a number": _edit("layout", "slots", value=5),
    "layout.numel a string": _edit("layout", "numel", value="many"),
    "files a list": _edit("files", value=[MODEL, OPTIM]),
    "files record a string": _edit("files", MODEL, value="ok"),
    "checksums numbers": _edit("files", MODEL, transform=_numbers_for_checksums),
    "size a string": _edit("files", MODEL, "size", value="big"),
    "size negative": _edit("files", MODEL, "size", value=-1),
    "weights a string": _edit("weights", value="model"),
    "weights.shards a dict": _edit("weights", "shards", value={"file": MODEL}),
    "slots a string": _edit("weights", "shards", 0, "slots", value="ab"),
    "slots one number": _edit("weights", "shards", 0, "slots", value=[0]),
    "shard file a number": _edit("weights", "shards", 0, "file", value=7),
    "weights.buffers a list": _edit("weights", "buffers", value=[MODEL]),
    "optimizer a string": _edit("optimizer", value="adamw"),
    "optimizer a list": _edit("optimizer", value=[]),
    "optimizer.class a number": _edit("optimizer", "class", value=3),
    "optimizer.param_groups a dict": _edit("optimizer", "param_groups", value={}),
    "param group a number": _edit("optimizer", "param_groups", 0, value=5),
    "optimizer.flat_state a list": _edit("optimizer", "flat_state", value=["exp_avg"]),
    "flat_state dtype unknown": _edit("optimizer", "flat_state", "exp_avg", value="float99"),
    "optimizer.scalar_state a string": _edit("optimizer", "scalar_state", value="step"),
    "scalar_state values too short": _edit("optimizer", "scalar_state", "step", "values", value=[]),
    "scalar_state dtype unknown": _edit(
        "optimizer", "scalar_state", "step", "dtype", value="int99"
    ),
    "optimizer.stateful a number": _edit("optimizer", "stateful", value=5),
    "optimizer.stateful too short": _edit("optimizer", "stateful", value="1"),
    "optimizer.files a string": _edit("optimizer", "files", value=OPTIM),
    "optimizer file range a string": _edit("optimizer", "files", 0, "range", value="all"),
    "extra a string": _edit("extra", value="extra"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_metadata(saved, case):
    MALFORMED[case](saved)
    message = refused(saved)
    assert "metadata.json" in message, message


# -- 5. format version from the future -------------------------------------------------------------
@pytest.mark.parametrize("field", ["format_version", "layout format"])
def test_format_version_from_the_future(saved, field):
    meta = read_meta(saved)
    if field == "format_version":
        meta["format_version"] = 99
    else:
        meta["layout"]["format"] = 99
    meta["something_new"] = {"only": "version 99 knows"}
    write_meta(saved, meta)
    message = refused(saved)
    assert "metadata.json" in message
    assert "99" in message
    assert "upgrade" in message


# -- 5b. metadata.json carries its own checksum ----------------------------------------------------
SEAL = b',"sha256":"'


def test_metadata_ends_with_the_sha256_of_the_bytes_before_it(saved):
    """The documented seal, recomputed here without the library; and the index's record."""
    data = (saved / "metadata.json").read_bytes()
    head, _, tail = data.rpartition(SEAL)
    assert tail == hashlib.sha256(head).hexdigest().encode() + b'"}'
    meta = json.loads(data)
    assert meta["format_version"] == 2
    index = (saved / "model.safetensors.index.json").read_bytes()
    assert meta["index"] == {"size": len(index), "sha256": hashlib.sha256(index).hexdigest()}


def _replace_once(old: bytes, new: bytes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        data = (path / "metadata.json").read_bytes()
        assert data.count(old) >= 1, old
        (path / "metadata.json").write_bytes(data.replace(old, new, 1))

    return edit


def _flip_in_checksum(path: Path) -> None:
    file = path / "metadata.json"
    flip_byte(file, file.stat().st_size - 10)  # a hex digit of the checksum itself


def _drop_checksum(path: Path) -> None:
    meta = read_meta(path)
    del meta["sha256"]
    (path / "metadata.json").write_text(json.dumps(meta, separators=(",", ":")))


UNSEALED = {
    "lr digit": _replace_once(b'"lr":0.001', b'"lr":0.002'),
    "step counter": _replace_once(b'"values":[1.0', b'"values":[2.0'),
    "maximize": _replace_once(b'"maximize":false', b'"maximize":true '),
    "a space": _replace_once(b'"step":1,', b'"step": 1,'),
    "a flip in the checksum": _flip_in_checksum,
    "the checksum dropped": _drop_checksum,
}


@pytest.mark.parametrize("case", list(UNSEALED))
def test_any_edit_of_metadata_fails_its_checksum(saved, case):
    UNSEALED[case](saved)
    message = refused(saved)
    assert str(saved / "metadata.json") in message
    assert "checksum" in message, message


def _stateful_slot(path: Path) -> int:
    return read_meta(path)["optimizer"]["stateful"].index("1")


def _set(*keys: Any, value: Any) -> Callable[[dict[str, Any], int], str]:
    """Set ``meta[k0][k1]...`` (``"SLOT"``: the first slot with state); return its key path."""

    def edit(meta: dict[str, Any], slot: int) -> str:
        keys_ = [slot if k == "SLOT" else k for k in keys]
        node = meta
        for k in keys_[:-1]:
            node = node[k]
        node[keys_[-1]] = value
        return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys_).lstrip(".")

    return edit


STEP_VALUE = ("optimizer", "scalar_state", "step", "values", "SLOT")
GROUP = ("optimizer", "param_groups", 0)
# The 21 silent wrong loads of the issue: every one of them is now refused by the checksum;
# re-sealed (a hand edit, a writer bug), the invalid ones are refused by the validation, and
# the valid ones load as written (only a checksum can tell them from the truth).
ISSUE_VALUES = {
    "step 0": (_set(*STEP_VALUE, value=0), False),
    "step -1": (_set(*STEP_VALUE, value=-1), False),
    "step 1.5": (_set(*STEP_VALUE, value=1.5), False),
    "step 2**62": (_set(*STEP_VALUE, value=2**62), True),
    "lr -1": (_set(*GROUP, "lr", value=-1), False),
    "eps 1.5": (_set(*GROUP, "eps", value=1.5), True),
    "betas[1] 0": (_set(*GROUP, "betas", 1, value=0), False),  # torch: floats, not ints
    "betas[1] 0.0": (_set(*GROUP, "betas", 1, value=0.0), True),
    "betas[1] 1.5": (_set(*GROUP, "betas", 1, value=1.5), False),
    "betas[1] x": (_set(*GROUP, "betas", 1, value="x"), False),
    "weight_decay True": (_set(*GROUP, "weight_decay", value=True), False),
    "maximize True": (_set(*GROUP, "maximize", value=True), True),
    "maximize x": (_set(*GROUP, "maximize", value="x"), False),
    "amsgrad None": (_set(*GROUP, "amsgrad", value=None), False),
    "amsgrad True": (_set(*GROUP, "amsgrad", value=True), False),  # no max_exp_avg_sq saved
    "scalar_state {}": (_set("optimizer", "scalar_state", value={}), False),  # was KeyError
    "lr into another key": (_set(*GROUP, "lR", value=0.001), False),
    "top-level step": (_set("step", value=2), False),  # the directory says step-00000001
}


OTHER_PATH = {
    "amsgrad True": "optimizer.flat_state",  # the state amsgrad needs is not there
    "scalar_state {}": "optimizer.scalar_state",
}


@pytest.mark.parametrize("case", list(ISSUE_VALUES))
@pytest.mark.parametrize("sealed", [False, True], ids=["as damaged", "resealed"])
def test_the_issues_wrong_values(saved, case, sealed):
    edit, valid = ISSUE_VALUES[case]
    meta = read_meta(saved)
    where = edit(meta, _stateful_slot(saved))
    if not sealed:  # the damage as it happens: the checksum no longer matches
        del meta["sha256"]
        data = json.dumps(meta, separators=(",", ":")).encode()[:-1]
        (saved / "metadata.json").write_bytes(data + SEAL + b"0" * 64 + b'"}')
        assert "checksum mismatch" in refused(saved)
        return
    write_meta(saved, meta)
    if valid:
        fm, opt = target()
        checkpoint.load(saved, fm, optimizer=opt)  # in range: what was written is what loads
        return
    message = refused(saved)
    assert str(saved / "metadata.json") in message
    # the key path at fault: where the value is, or what it contradicts
    where = OTHER_PATH.get(case, where)
    assert f"{where}: expected" in message, (where, message)


def test_a_failure_after_every_check_is_still_a_checkpoint_error(saved, monkeypatch):
    fm, opt = target()

    def broken(state_dict: dict[str, Any]) -> None:
        raise KeyError("step")

    monkeypatch.setattr(opt, "load_state_dict", broken)
    with pytest.raises(CheckpointError, match=r"applying the checkpoint failed.*KeyError"):
        checkpoint.load(saved, fm, optimizer=opt)


# -- 5c. every optimizer with rules: torch's own values pass, torch's refusals are refused ---------
KINDS = {
    "SGD": (torch.optim.SGD, dict(lr=0.05)),
    "SGD momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    "SGD nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "Adam": (torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01)),
    "Adam amsgrad": (torch.optim.Adam, dict(lr=1e-3, amsgrad=True)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-3, betas=(0.8, 0.9))),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-3)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-3, momentum_decay=0.005)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-3, decoupled_weight_decay=True, weight_decay=0.1)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2, lr_decay=0.01)),
    "Adadelta": (torch.optim.Adadelta, dict(lr=0.5, rho=0.8)),
    "ASGD (no rules: live types)": (torch.optim.ASGD, dict(lr=1e-2, t0=3.0)),
}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_every_optimizer_with_rules_is_tested():
    assert {_qualname(c) for c, _ in KINDS.values()} - {_qualname(torch.optim.ASGD)} == set(
        OPTIMIZER_RULES
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_of_every_optimizer_passes_its_rules(tmp_path, kind):
    cls, hyper = KINDS[kind]
    fm = build(seed=0)
    named = list(fm.module.named_parameters())
    groups = [
        {"params": [p for n, p in named if p.dim() >= 2]},
        {"params": [p for n, p in named if p.dim() < 2], "lr": hyper["lr"] / 2},
    ]
    opt = cls(groups, **hyper)
    train(fm, opt, 2, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", fm, step=2, optimizer=opt)
    fm2 = build(seed=1)
    opt2 = cls(fm2.parameters(), **hyper)
    opt2 = cls(
        [
            {"params": [p for p in fm2.parameters() if p.dim() >= 2]},
            {"params": [p for p in fm2.parameters() if p.dim() < 2]},
        ],
        **hyper,
    )
    checkpoint.load(path, fm2, optimizer=opt2)
    assert _same_bits(fm2.flat_param, fm.flat_param)
    assert not _tree_diff(opt2.state_dict(), opt.state_dict(), "optimizer")


@pytest.mark.parametrize("name", list(OPTIMIZER_RULES))
def test_required_hyperparameters_are_those_torch_does_not_fill_in(name):
    """What a rule requires is exactly what torch's load_state_dict leaves missing."""
    cls = next(c for c, _ in KINDS.values() if _qualname(c) == name)
    p = torch.nn.Parameter(torch.ones(3))
    opt = cls([p], lr=0.1)
    sd = opt.state_dict()
    keys = [k for k in sd["param_groups"][0] if k != "params"]
    filled = []
    for key in keys:
        group = {k: v for k, v in sd["param_groups"][0].items() if k != key}
        probe = cls([p], lr=0.1)
        probe.load_state_dict({"state": {}, "param_groups": [group]})
        if key in probe.param_groups[0]:
            filled.append(key)
    assert set(OPTIMIZER_RULES[name].required) == set(keys) - set(filled)
    assert set(OPTIMIZER_RULES[name].hyper) >= set(keys), "a hyperparameter without a rule"


BAD = {"lr": -1e-3, "eps": -1.0, "weight_decay": -0.1, "momentum": -0.5, "alpha": -1.0,
       "lr_decay": -1.0, "initial_accumulator_value": -1.0, "momentum_decay": -1.0,
       "rho": 1.5, "betas": (0.9, 1.0)}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIMIZER_RULES))
def test_the_rules_refuse_what_torch_refuses(name):
    cls = next(c for c, _ in KINDS.values() if _qualname(c) == name)
    rules = OPTIMIZER_RULES[name]
    tried = 0
    for key, bad in BAD.items():
        if key not in rules.hyper:
            continue
        tried += 1
        with pytest.raises(ValueError):  # torch's constructor: the reference
            cls([torch.nn.Parameter(torch.ones(2))], **{key: bad})
        with pytest.raises(Exception, match=re.escape(f"group.{key}")) as info:
            rules.hyper[key](list(bad) if isinstance(bad, tuple) else bad, f"group.{key}")
        assert type(info.value) is Invalid
        good = cls([torch.nn.Parameter(torch.ones(2))]).param_groups[0][key]
        rules.hyper[key](list(good) if isinstance(good, tuple) else good, f"group.{key}")
    assert tried >= 3


def _saved_with(tmp_path: Path, make: Callable[..., torch.optim.Optimizer]) -> Path:
    fm = build(seed=0)
    opt = make(fm.parameters())
    train(fm, opt, 1, seed=0)
    return checkpoint.save(tmp_path / "ckpt", fm, step=1, optimizer=opt)


@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        ("t0", "x", "like this optimizer's"),
        ("t0", True, "like this optimizer's"),
        ("lambd", None, "like this optimizer's"),
        ("no_such_hyperparameter", 1.0, "expected a hyperparameter of torch.optim.asgd.ASGD"),
        ("DROP lr", None, "optimizer.param_groups[0].lr: expected a value"),
    ],
)
def test_an_optimizer_without_rules_gets_the_live_types(tmp_path, key, value, expect):
    path = _saved_with(tmp_path, lambda ps: torch.optim.ASGD(ps, lr=1e-2))
    meta = read_meta(path)
    if key.startswith("DROP "):
        del meta["optimizer"]["param_groups"][0][key.split()[1]]
    else:
        meta["optimizer"]["param_groups"][0][key] = value
    write_meta(path, meta)
    fm = build(seed=1)
    message = refused(path, fm, torch.optim.ASGD(fm.parameters(), lr=1e-2))
    assert expect in message, message


@pytest.mark.parametrize(
    ("key", "expect"),
    [("capturable", "capturable: expected false"), ("differentiable", "as this optimizer has it")],
)
def test_capturable_on_cpu_and_a_different_differentiable_are_refused(saved, key, expect):
    meta = read_meta(saved)
    meta["optimizer"]["param_groups"][0][key] = True
    write_meta(saved, meta)
    assert expect in refused(saved)


# -- 6. file names that point outside the checkpoint -----------------------------------------------
_AUDIT_LOCK = threading.Lock()
_opened: list[tuple[int, str]] | None = None  # (thread, path) while recording


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is not None and event == "open" and args and isinstance(args[0], (str, bytes, Path)):
        _opened.append((threading.get_ident(), os.fsdecode(args[0])))


_audit_installed = False


def opened_during(fn: Callable[[], Any]) -> list[str]:
    """The paths this thread opened while running ``fn`` (through an audit hook, nothing patched)."""
    global _opened, _audit_installed
    with _AUDIT_LOCK:
        if not _audit_installed:
            sys.addaudithook(_audit)
            _audit_installed = True
        _opened = []
        try:
            fn()
        finally:
            seen, _opened = _opened, None
    me = threading.get_ident()
    return [p for t, p in seen if t == me]


def _point_outside(saved: Path, where: str, name: str) -> None:
    meta = read_meta(saved)
    files = meta["files"]
    if where == "weights":
        files[name] = files.pop(MODEL)
        meta["weights"]["shards"][0]["file"] = name
    elif where == "optimizer":
        files[name] = files.pop(OPTIM)
        meta["optimizer"]["files"][0]["file"] = name
    elif where == "buffers":
        meta["weights"]["buffers"]["some.buffer"] = name
        files[name] = files[MODEL]
    else:  # an unreferenced entry in the files table
        files[name] = files[MODEL]
    write_meta(saved, meta)


@pytest.mark.parametrize("where", ["weights", "optimizer", "buffers", "files table"])
@pytest.mark.parametrize(
    "name", ["../x.safetensors", "/etc/passwd", "sub/dir.safetensors", "ABSOLUTE", "..", ""]
)
def test_file_names_outside_the_checkpoint_are_refused_before_opening(saved, where, name):
    source = saved / (OPTIM if where == "optimizer" else MODEL)
    # Real copies of the shard wherever the names point: following them would load fine.
    (saved.parent / "x.safetensors").write_bytes(source.read_bytes())
    (saved / "sub").mkdir()
    (saved / "sub" / "dir.safetensors").write_bytes(source.read_bytes())
    if name == "ABSOLUTE":
        name = str(source)  # the real shard, by absolute path
    _point_outside(saved, where, name)
    fm, opt = target()
    result: dict[str, str] = {}
    opened = opened_during(lambda: result.update(message=refused(saved, fm, opt)))
    message = result["message"]
    assert "metadata.json" in message
    assert json.dumps(name) in message
    assert "outside" in message
    assert opened == [str(saved / "metadata.json")], opened


# -- 7. a checkpoint of a different model ----------------------------------------------------------
@pytest.mark.parametrize(
    ("saved_cfg", "load_cfg", "names"),
    [
        (
            CFG,
            GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
            ["wte.weight"],
        ),
        (
            CFG,
            GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=16),
            ["wte.weight"],
        ),
        (
            CFG,
            GPTConfig(vocab_size=64, block_size=17, n_layer=2, n_head=2, n_embd=16),
            ["wpe.weight"],
        ),
        (
            CFG,
            GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16),
            ["ln_f.weight", "blocks.2.ln_1.weight"],
        ),
        (
            GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16),
            CFG,
            ["blocks.2.ln_1.weight", "ln_f.weight"],
        ),
    ],
    ids=["n_embd", "vocab", "block_size", "one layer more", "one layer less"],
)
def test_checkpoint_of_a_different_model(tmp_path, saved_cfg, load_cfg, names):
    fm = build(saved_cfg, seed=0)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)
    train(fm, opt, 1, seed=0)
    path = checkpoint.save(tmp_path / "ckpt", fm, step=1, optimizer=opt)
    for with_optimizer in (True, False):
        message = refused(path, *target(load_cfg), with_optimizer=with_optimizer)
        assert "different model" in message
        assert str(path) in message
        for name in names:
            assert repr(name) in message, message
        # the *first* difference: nothing about a later parameter
        assert "ln_f.bias" not in message


# -- 9. optimizer mismatches -----------------------------------------------------------------------
def _groups_two(fm: torchshard.FlatParamModule) -> torch.optim.Optimizer:
    decay = [p for p in fm.parameters() if p.dim() >= 2]
    rest = [p for p in fm.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=2e-3)


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (
            lambda fm: torch.optim.SGD(fm.parameters(), lr=0.1, momentum=0.9),
            ["torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"],
        ),
        (lambda fm: torch.optim.Adam(fm.parameters(), lr=2e-3), ["AdamW", "torch.optim.adam.Adam"]),
        (_groups_two, ["param groups", "1", "2"]),
        (
            lambda fm: torch.optim.AdamW([p for p in fm.parameters() if p.dim() >= 2], lr=2e-3),
            ["param group 0", "'blocks.0.ln_1.weight'", "'blocks.0.attn.qkv.weight'"],
        ),
        (
            lambda fm: torch.optim.AdamW(list(fm.parameters())[::-1], lr=2e-3),
            ["param group 0", "'wte.weight'", "'ln_f.bias'"],
        ),
    ],
    ids=["SGD", "Adam", "two groups", "fewer params", "other order"],
)
def test_optimizer_mismatch(saved, make, expect):
    fm = build(seed=1)
    opt = make(fm)
    train(fm, opt, 2, seed=1)
    message = refused(saved, fm, opt)
    assert str(saved) in message
    assert "optimizer" in message
    for text in expect:
        assert text in message, message


def test_optimizer_state_from_a_checkpoint_saved_without_one(tmp_path):
    fm = build(seed=0)
    path = checkpoint.save(tmp_path / "ckpt", fm, step=3)
    message = refused(path)
    assert str(path) in message
    assert "no optimizer state" in message
    assert "optimizer=None" in message
    # and without an optimizer it loads (the control)
    fm2, _ = target()
    assert checkpoint.load(path, fm2).step == 3
    assert _same_bits(fm2.flat_param, fm.flat_param)


# -- 10. nothing there -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nonexistent", "empty root", "only a .tmp dir", "a file"])
def test_load_from_nothing(tmp_path, kind):
    root = tmp_path / "root"
    if kind == "empty root":
        root.mkdir()
    elif kind == "only a .tmp dir":
        (root / ".tmp-step-00000005").mkdir(parents=True)
        (root / "step-00000004").mkdir()  # no metadata.json: not committed
    elif kind == "a file":
        root.write_text("not a checkpoint")
    message = refused(root)
    assert str(root) in message
    assert checkpoint.Checkpointer(root).latest() is None
    fm, opt = target()
    before = snapshot(fm, opt)
    with pytest.raises(CheckpointError, match="checkpoint"):
        checkpoint.Checkpointer(root).load(fm, optimizer=opt)
    assert not changes(fm, opt, before)


def test_step_dir_without_metadata(saved):
    (saved / "metadata.json").unlink()
    message = refused(saved)
    assert str(saved) in message


# -- 11. loading never unpickles -------------------------------------------------------------------
class _Payload:
    """Unpickling this creates a directory: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("fmt", ["pickle", "torch.save"])
@pytest.mark.parametrize("name", [MODEL, OPTIM])
def test_loading_never_unpickles(saved, tmp_path, fmt, name):
    marker = tmp_path / "code-ran"
    file = saved / name
    if fmt == "pickle":
        file.write_bytes(pickle.dumps(_Payload(str(marker))))
    else:
        torch.save({"wte.weight": _Payload(str(marker))}, file)
    data = file.read_bytes()
    meta = read_meta(saved)
    meta["files"][name] = rerecord(meta["files"][name], data)  # the size agrees: only the format
    write_meta(saved, meta)
    message = refused(saved)
    assert name in message
    assert "not a valid safetensors file" in message
    assert not marker.exists(), "loading the checkpoint ran code from a pickle"
    # the control: the payload is live
    if fmt == "pickle":
        pickle.loads(data)
    else:
        torch.load(io.BytesIO(data), weights_only=False)  # by name, torch would use safetensors
    assert marker.is_dir()


# -- subprocess scripts: a full disk, a SIGKILL ----------------------------------------------------
_PRELUDE = r"""
import json, os, resource, signal, sys, threading, time
from pathlib import Path
import torch
import torchshard
from gpt import GPT, GPTConfig
from torchshard import checkpoint
from torchshard.checkpoint import CheckpointError

torch.set_num_threads(1)
torch.manual_seed(0)
fm = torchshard.FlatParamModule(GPT(GPTConfig.preset("tiny")))
fm.bind(torch.empty(fm.numel))
opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)


def train(step):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 64, (2, 17), generator=g)
    opt.zero_grad()
    fm(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()


root, expected = Path(sys.argv[1]), sys.argv[2]
"""

_DISK = (
    _PRELUDE
    + r"""
report = {}


def attempt(what, fn):
    try:
        fn()
        report[what] = None
    except BaseException as e:
        report[what] = {"type": type(e).__name__, "checkpoint_error": isinstance(e, CheckpointError),
                        "message": str(e)}
    report["dirs after " + what] = sorted(os.listdir(root))


signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)


def disk_full(full):
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 if full else soft, hard))  # shard: 34 KB


train(0)
"""
)

_FULL_DISK = (
    _DISK
    + r"""
checkpoint.save(root, fm, step=1, optimizer=opt)
torch.save({"flat": fm.flat_param.clone(), "optim": opt.state_dict()}, expected)
disk_full(True)
train(1)
future = checkpoint.async_save(root, fm, step=2, optimizer=opt)
train(2)  # training goes on while the save fails in the background
attempt("async", future.wait)
attempt("blocking", lambda: checkpoint.save(root, fm, step=3, optimizer=opt))
future = checkpoint.async_save(root, fm, step=4, optimizer=opt)
while not future.done():  # fails in the background; nobody calls wait()
    time.sleep(0.01)
disk_full(False)
attempt("next save", lambda: checkpoint.async_save(root, fm, step=5, optimizer=opt))
attempt("a later save", lambda: checkpoint.save(root, fm, step=6, optimizer=opt))
train(3)
print("REPORT " + json.dumps(report))
"""
)

_FULL_DISK_CHECKPOINTER = (
    _DISK
    + r"""
ckpt = checkpoint.Checkpointer(root, keep_last=2)
ckpt.save(fm, step=1, optimizer=opt, blocking=True)
torch.save({"flat": fm.flat_param.clone(), "optim": opt.state_dict()}, expected)
disk_full(True)
train(1)
attempt("async", ckpt.save(fm, step=2, optimizer=opt).wait)
attempt("blocking", lambda: ckpt.save(fm, step=3, optimizer=opt, blocking=True))
disk_full(False)
report["latest"] = ckpt.latest().name
# roll back to the last good checkpoint: the failures above were seen and handled
attempt("load", lambda: report.update(loaded=ckpt.load(fm, optimizer=opt).step))
attempt("close after seen failures", ckpt.close)

ckpt = checkpoint.Checkpointer(root, keep_last=2)
disk_full(True)
future = ckpt.save(fm, step=4, optimizer=opt)
while not future.done():  # fails in the background; nobody calls wait()
    time.sleep(0.01)
disk_full(False)
attempt("close after an unseen failure", ckpt.close)
print("REPORT " + json.dumps(report))
"""
)

_KILLED = (
    _PRELUDE
    + r"""
kill_at = sys.argv[3]
ckpt = checkpoint.Checkpointer(root, keep_last=1)
train(0)
ckpt.save(fm, step=1, optimizer=opt, blocking=True)
torch.save({"flat": fm.flat_param.clone(), "optim": opt.state_dict()}, expected)
main = threading.main_thread()


def die_mid_write(event, args):
    # SIGKILL this process when the background writer opens `kill_at` in .tmp-step-*
    if event != "open" or threading.current_thread() is main or not args:
        return
    if isinstance(args[0], (str, bytes, os.PathLike)):
        p = Path(os.fsdecode(args[0]))
        if p.parent.name.startswith(".tmp-step-") and p.name.startswith(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)


sys.addaudithook(die_mid_write)
for step in range(2, 20):
    train(step - 1)  # the save of the previous step is still being written
    ckpt.save(fm, step=step, optimizer=opt)
ckpt.close()
print("NOT KILLED")
"""
)


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def assert_loads_as_saved(root: Path, expected: Path, step: int) -> None:
    state = torch.load(expected, weights_only=True)
    fm, opt = target()
    info = checkpoint.load(root, fm, optimizer=opt)
    assert info.step == step
    assert _same_bits(fm.flat_param, state["flat"])
    assert not _tree_diff(opt.state_dict(), state["optim"], "optimizer")


# -- 8. a full disk --------------------------------------------------------------------------------
def run_disk_script(script: str, tmp_path: Path) -> tuple[dict[str, Any], Path, Path]:
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    proc = run_script(script, str(root), str(expected))
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT ")), root, expected


def assert_save_failed(report: dict[str, Any], what: str, dirs: list[str]) -> None:
    failure = report[what]
    assert failure is not None, f"{what}: the save into a full disk succeeded"
    assert failure["checkpoint_error"], failure
    assert os.strerror(errno.EFBIG) in failure["message"], failure
    # no step-N directory for the failed step; its .tmp-step-N is removed
    assert report[f"dirs after {what}"] == dirs, (what, report[f"dirs after {what}"])


@pytest.mark.slow
def test_full_disk(tmp_path):
    report, root, expected = run_disk_script(_FULL_DISK, tmp_path)
    only_step1 = ["step-00000001"]
    assert_save_failed(report, "async", only_step1)  # from wait()
    assert_save_failed(report, "blocking", only_step1)  # from save()
    # a failure nobody waited for surfaces from the next save, which does not start
    assert_save_failed(report, "next save", only_step1)
    assert "previous checkpoint save failed" in report["next save"]["message"]
    # ... once: the writer is usable again
    assert report["a later save"] is None
    assert report["dirs after a later save"] == ["step-00000001", "step-00000006"]
    # the previous checkpoint is intact
    assert_loads_as_saved(root / "step-00000001", expected, 1)
    # the messages name the file that could not be written
    for what in ("async", "blocking", "next save"):
        message = report[what]["message"]
        assert MODEL in message, f"{what}: the message does not name the file: {message!r}"


@pytest.mark.slow
def test_full_disk_checkpointer(tmp_path):
    report, root, expected = run_disk_script(_FULL_DISK_CHECKPOINTER, tmp_path)
    only_step1 = ["step-00000001"]
    assert_save_failed(report, "async", only_step1)
    assert_save_failed(report, "blocking", only_step1)
    assert report["latest"] == "step-00000001"
    assert_loads_as_saved(root, expected, 1)
    # a save failure that was seen does not come back: rolling back works, closing works
    assert report["load"] is None, f"Checkpointer.load after a failed save: {report['load']}"
    assert report["loaded"] == 1
    assert report["close after seen failures"] is None, report["close after seen failures"]
    # one nobody saw surfaces from close()
    assert_save_failed(report, "close after an unseen failure", only_step1)


# -- a process killed in the middle of an async write ----------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["model-", "optim-", "metadata.json"])
def test_killed_mid_write(tmp_path, kill_at):
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    proc = run_script(_KILLED, str(root), str(expected), kill_at)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    tmp = root / ".tmp-step-00000002"
    assert tmp.is_dir()  # killed mid-write
    if kill_at == "metadata.json":  # every shard was written: the kill came at the last moment
        assert {MODEL, OPTIM} <= {p.name for p in tmp.iterdir()}
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001"]
    ckpt = checkpoint.Checkpointer(root, keep_last=1)
    assert ckpt.latest() == root / "step-00000001"
    assert_loads_as_saved(root, expected, 1)
    # training resumes: the next save of that step replaces the leftover and commits
    fm = build(seed=2)
    ckpt.save(fm, step=2, blocking=True)
    ckpt.close()
    assert not tmp.exists()
    assert ckpt.latest() == root / "step-00000002"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]


# -- 12. multi-rank: one rank's part is corrupt, every rank raises ---------------------------------
CFG_2RANKS = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)  # 4 KB chunks


def _byte_only_rank_reads(path: Path, bad_rank: int) -> tuple[Path, int]:
    """A data byte of a model shard that, loading at world size 2, only ``bad_rank`` reads."""
    meta = read_meta(path)
    ranges = [f["range"] for f in meta["optimizer"]["files"]]  # element ranges at world size 2
    lo, hi = ranges[bad_rank]
    slots = meta["layout"]["slots"]  # [name, shape, offset, numel, requires_grad, aliases]
    inside = [s for s in slots if lo <= s[2] and s[2] + s[3] <= hi]
    name = max(inside, key=lambda s: s[3])[0]
    shard = next(
        w["file"]
        for w in meta["weights"]["shards"]
        if name in [s[0] for s in slots[w["slots"][0] : w["slots"][1]]]
    )
    file = path / shard
    start, head = header(file)
    begin, end = head[name]["data_offsets"]
    # The middle of a tensor of 48 KiB or more: with the 4 KiB checksum chunks of files this
    # small, no chunk around it holds bytes that another rank reads.
    assert end - begin >= 48 * 1024, (name, end - begin)
    return file, start + (begin + end) // 2


def _corrupt_one_rank(root: str, bad_rank: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    fm = torchshard.FlatParamModule(GPT(CFG_2RANKS))
    trainer = torchshard.DistributedTrainer(fm)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)
    train(fm, opt, 1, seed=rank, trainer=trainer)
    path = checkpoint.save(root, trainer, step=1, optimizer=opt)
    file, offset = _byte_only_rank_reads(path, bad_rank)
    dist.barrier()
    if rank == 0:
        flip_byte(file, offset)
    dist.barrier()
    torch.manual_seed(1)
    fm2 = torchshard.FlatParamModule(GPT(CFG_2RANKS))
    trainer2 = torchshard.DistributedTrainer(fm2)
    opt2 = torch.optim.AdamW(fm2.parameters(), lr=2e-3, betas=(0.8, 0.9))
    train(fm2, opt2, 2, seed=10 + rank, trainer=trainer2)
    before = snapshot(fm2, opt2)
    outcome: dict[str, Any] = {"type": None, "message": ""}
    try:
        checkpoint.load(root, trainer2, optimizer=opt2)
    except Exception as e:
        outcome = {"type": type(e).__name__, "checkpoint_error": isinstance(e, CheckpointError)}
        outcome["message"] = str(e)
    outcome["changed"] = changes(fm2, opt2, before)
    outcome["file"] = file.name
    dist.barrier()  # the group still works after the failed load
    trainer.close()
    trainer2.close()
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_one_rank_corrupt_every_rank_raises(tmp_path, bad_rank):
    out = run_distributed(_corrupt_one_rank, 2, str(tmp_path / "ckpt"), bad_rank, timeout=60)
    for rank, o in enumerate(out):
        assert o["type"] is not None, f"rank {rank}: the load did not fail"
        assert o["checkpoint_error"], (rank, o)
        assert not o["changed"], f"rank {rank}: a failed load changed {o['changed']}"
        assert "checksum mismatch" in o["message"], (rank, o)
        assert o["file"] in o["message"], (rank, o)
        if rank != bad_rank:
            assert f"rank {bad_rank} failed to load" in o["message"], (rank, o)


def _save_to_own_directory(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    fm = torchshard.FlatParamModule(torch.nn.Linear(64, 64))
    trainer = torchshard.DistributedTrainer(fm)
    outcome: dict[str, Any] = {"type": None, "message": ""}
    try:
        checkpoint.save(f"{root}/rank{rank}", trainer, step=1)  # a bug: per-rank directories
    except Exception as e:
        outcome = {"type": type(e).__name__, "message": str(e)}
    dist.barrier()  # the group still works after the failed save
    trainer.close()
    return outcome


def test_ranks_saving_to_different_directories_all_raise_naming_it(tmp_path):
    out = run_distributed(_save_to_own_directory, 2, str(tmp_path), timeout=60)
    for rank, o in enumerate(out):
        assert o["type"] == "CheckpointError", (rank, o)
        assert "every rank must save to the same directory" in o["message"], (rank, o)
        assert "rank 1" in o["message"], (rank, o)
    assert not list(tmp_path.glob("*/step-*")), "nothing may be committed"


def _store_connections() -> list[bool]:
    from torchshard.checkpoint._target import Target

    trainer = torchshard.DistributedTrainer(torchshard.FlatParamModule(torch.nn.Linear(4, 4)))
    first, second = Target(trainer).store, Target(trainer).store
    default = dist.distributed_c10d._get_default_store()
    trainer.close()
    return [first is second, first is not default]


def test_saves_reuse_one_extra_store_connection():
    # TCPStore.clone() sometimes takes seconds: one connection per process group, not per save
    assert run_distributed(_store_connections, 2, timeout=60) == [[True, True]] * 2
