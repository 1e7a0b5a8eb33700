"""A malformed or edited ``metadata.json`` is a clear CheckpointError, and the failed load
changes nothing.

Not JSON, missing or mistyped keys, a format from the future, any edit that
breaks its SHA-256, values out of range even when resealed, and file names
that point outside the checkpoint (refused before anything is opened). Each
is loaded into a *different* model and optimizer; the error names the key
path at fault, and the weights and optimizer are bitwise unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from checkpoint_harness import (
    MODEL,
    OPTIM,
    flip_byte,
    read_meta,
    refused,
    target,
    write_meta,
)

from torchshard import checkpoint
from torchshard.checkpoint import CheckpointError


def _numbers_for_checksums(record: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if k == "size" else 12345678) for k, v in record.items()}


pytestmark = pytest.mark.usefixtures("single_thread")


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
