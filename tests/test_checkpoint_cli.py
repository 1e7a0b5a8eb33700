"""The offline checkpoint CLI: ``torchshard inspect``, ``consolidate`` and ``reshard``.

Checkpoints come from a small GPT (tied ``lm_head``, a frozen parameter, one that never
gets a gradient, persistent float and integer buffers) trained a few steps with AdamW in
one process. Everything is compared bitwise against the trained model and against loading
the original checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_harness import reseal
from gpt import GPT, GPTConfig
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import torchshard
from torchshard import checkpoint
from torchshard._cli import main
from torchshard.checkpoint import _tools
from torchshard.checkpoint._inspect import inspect_checkpoint
from torchshard.checkpoint._tools import Progress, consolidate, reshard

INDEX = "model.safetensors.index.json"

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=24)


class Model(GPT):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.never_used = nn.Linear(3, 5)  # no gradient, so no optimizer state
        self.wpe.weight.requires_grad_(False)  # frozen
        self.register_buffer("scale", torch.randn(CFG.n_embd))
        self.register_buffer("calls", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(2), persistent=False)  # not saved


def make(seed: int) -> tuple[torchshard.FlatParamModule, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    fm = torchshard.FlatParamModule(Model())
    fm.bind(torch.empty(fm.numel, dtype=fm.dtype))
    decay = [p for p in fm.module.parameters() if p.dim() >= 2]
    rest = [p for p in fm.module.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.8, 0.95),
    )
    return fm, opt


def tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1), generator=g)


def train(fm: torchshard.FlatParamModule, opt: torch.optim.Optimizer, step: int) -> None:
    idx = tokens(step)
    opt.zero_grad()
    fm(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()
    fm.module.calls += 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, torchshard.FlatParamModule, torch.optim.Optimizer]:
    """A root with two committed checkpoints (steps 2 and 3); the model and optimizer at step 3."""
    root = tmp_path_factory.mktemp("cli") / "ckpt"
    fm, opt = make(0)
    for step in range(3):
        train(fm, opt, step)
        if step >= 1:
            checkpoint.save(root, fm, step=step + 1, optimizer=opt, extra={"run": "cli"})
    return root, fm, opt


def copy_of(root: Path, tmp_path: Path) -> Path:
    """A private copy of the latest checkpoint directory, to damage."""
    dst = tmp_path / "copy" / "step-00000003"
    shutil.copytree(root / "step-00000003", dst)
    return dst


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("torchshard: error: "), err
    return err[0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same_tensors(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(bits(torch.as_tensor(a[k])), bits(torch.as_tensor(b[k]))), k


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert_same_tensors(sa["state"][i], sb["state"][i])


def loaded(path: Path) -> tuple[torchshard.FlatParamModule, torch.optim.Optimizer]:
    fm, opt = make(seed=123)  # other weights, no optimizer state: everything must come from disk
    checkpoint.load(path, fm, optimizer=opt)
    return fm, opt


# -- inspect ------------------------------------------------------------------------------
def test_inspect_directory_and_root(trained, capsys):
    root, fm, _ = trained
    assert main(["inspect", str(root / "step-00000003")]) == 0
    out = capsys.readouterr().out
    for line in (
        "step         3",
        "world size   1 (at save)",
        "lm_head.weight -> wte.weight",
        "buffers      2: scale, calls",
        "torch.optim.adamw.AdamW",
        "exp_avg (float32), exp_avg_sq (float32), step (scalar, float32)",
        "weight_decay=0.1",
        "betas=[0.8,0.95]",
        '{"run": "cli"}',
        "model-00001-of-00001.safetensors",
        "every checksum verified",
        "metadata     sha256 verified, every value checked",
    ):
        assert line in out, line
    assert "warning" not in out
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step-00000003  (latest of 2 complete under" in out and "OK: 2 files" in out

    report = inspect_checkpoint(root)
    assert report.ok and report.step == 3 and report.steps_under_root == [2, 3]
    assert report.parameters == len(fm.layout) and report.numel == fm.numel
    assert report.tied == {"lm_head.weight": "wte.weight"}
    # wpe is frozen and never_used gets no gradient: no state
    assert report.optimizer["stateful"] == len(fm.layout) - 3
    matrices = sum(p.dim() >= 2 for p in fm.module.parameters())
    assert [g["params"] for g in report.optimizer["param_groups"]] == [
        matrices,
        len(fm.layout) - matrices,
    ]
    assert main(["inspect", str(root), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["ok"] is True and as_json["protected"] is True and as_json["warnings"] == []


def flip_byte(path: Path, where: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x40
    path.write_bytes(bytes(data))


def edit_metadata(path: Path, edit: Any, sealed: bool = True) -> None:
    """Edit ``metadata.json``; ``sealed``: with its checksum made to match the edit."""
    meta = json.loads((path / "metadata.json").read_text())
    edit(meta)
    data = json.dumps(meta).encode()
    (path / "metadata.json").write_bytes(reseal(data) if sealed else data)


def edit_index(path: Path, edit: Any) -> None:
    """Edit ``model.safetensors.index.json`` and make ``metadata.json`` vouch for it."""
    index = json.loads((path / INDEX).read_text())
    edit(index)
    data = json.dumps(index).encode()
    (path / INDEX).write_bytes(data)
    record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    edit_metadata(path, lambda m: m.update(index=record))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: flip_byte(d / "model-00001-of-00001.safetensors", 0.7), "checksum mismatch"),
        (lambda d: flip_byte(d / "optim-00001-of-00001.safetensors", 0.3), "checksum mismatch"),
        (lambda d: flip_byte(d / "model-00001-of-00001.safetensors", 0.0), "checksum mismatch"),
        (
            lambda d: os.truncate(d / "optim-00001-of-00001.safetensors", 1000),
            "truncated",
        ),
        (lambda d: (d / "model-00001-of-00001.safetensors").unlink(), "missing"),
        (lambda d: (d / "model.safetensors.index.json").unlink(), "index.json: missing"),
        (lambda d: (d / "metadata.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "metadata.json").unlink(), "no complete checkpoint"),
        (lambda d: flip_byte(d / "metadata.json", 0.5), "metadata.json: checksum mismatch"),
        (lambda d: flip_byte(d / "metadata.json", 0.999), "metadata.json: checksum mismatch"),
        (lambda d: edit_metadata(d, lambda m: m["optimizer"]["param_groups"][0].update(lr=3e-4),
                                 sealed=False), "metadata.json: checksum missing"),
        (lambda d: edit_metadata(d, lambda m: m["optimizer"].pop("flat_state")),
         "metadata.json: optimizer.flat_state: expected a value, got nothing"),
        (lambda d: edit_metadata(d, lambda m: m["weights"]["shards"][0].update(slots=[0, 5])),
         "metadata.json: weights.shards: expected files holding all"),
        (lambda d: edit_metadata(d, lambda m: m["optimizer"]["param_groups"][1].update(eps=-1)),
         "metadata.json: optimizer.param_groups[1].eps: expected a number >= 0, got -1"),
        (lambda d: flip_byte(d / INDEX, 0.5), f"{INDEX}: expected"),
        (lambda d: edit_index(d, lambda i: i["weight_map"].update({"wte.weight": "x"})),
         f"{INDEX}: weight_map disagrees with metadata.json for wte.weight;"),
        (lambda d: edit_index(d, lambda i: i["metadata"].update(total_size=1)),
         f"{INDEX}: metadata: expected"),
    ],
    ids=["model-byte", "optim-byte", "header-byte", "truncated", "missing-file", "no-index",
         "bad-metadata", "no-metadata", "metadata-byte", "metadata-checksum-byte",
         "metadata-edited", "bad-optimizer-metadata", "slots-not-covered", "bad-eps",
         "index-byte", "index-weight-map", "index-total-size"],
)  # fmt: skip
def test_inspect_finds_damage(trained, tmp_path, capsys, damage, message):
    path = copy_of(trained[0], tmp_path)
    damage(path)
    assert main(["inspect", str(path)]) == 1
    assert message in one_error_line(capsys)


def test_inspect_empty_root_is_an_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "holds no complete checkpoint" in one_error_line(capsys)


# -- consolidate --------------------------------------------------------------------------
def test_consolidate_loads_into_a_fresh_model_bitwise(trained, tmp_path, capsys):
    root, fm, _ = trained
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(root), str(out)]) == 0
    assert "strict=False" in capsys.readouterr().out
    sd = load_file(out)
    # the tied weight once, under its first name; persistent buffers; nothing else
    assert "lm_head.weight" not in sd and "scratch" not in sd
    assert set(sd) == set(fm.module.state_dict()) - {"lm_head.weight"}
    with safe_open(out, "pt") as f:
        assert f.metadata()["format"] == "pt"

    torch.manual_seed(321)
    fresh = Model()
    result = fresh.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == []
    assert fresh.lm_head.weight is fresh.wte.weight
    assert_same_tensors(fresh.state_dict(), fm.module.state_dict())
    idx = tokens(99)
    with torch.no_grad():
        assert torch.equal(bits(fresh(idx[:, :-1])[0]), bits(fm.module(idx[:, :-1])[0]))

    # --with-aliases: strict loading works too
    strict = tmp_path / "strict.safetensors"
    assert main(["consolidate", str(root), str(strict), "--with-aliases"]) == 0
    torch.manual_seed(321)
    fresh = Model()
    fresh.load_state_dict(load_file(strict))
    assert_same_tensors(fresh.state_dict(), fm.module.state_dict())


def test_consolidate_of_a_corrupt_checkpoint_writes_nothing(trained, tmp_path, capsys):
    path = copy_of(trained[0], tmp_path)
    flip_byte(path / "model-00001-of-00001.safetensors", 0.9)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    assert main(["consolidate", str(path), str(out)]) == 1
    assert "checksum mismatch" in one_error_line(capsys)
    assert list(out.parent.iterdir()) == []


# -- reshard ------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [3, 1, 7])
def test_reshard_loads_identically(trained, tmp_path, capsys, monkeypatch, world):
    root, fm, opt = trained
    monkeypatch.setattr(_tools, "_BLOCK_BYTES", 100)  # many blocks per tensor and piece
    out = tmp_path / f"world{world}"
    assert main(["reshard", str(root), str(out), "--world-size", str(world)]) == 0
    capsys.readouterr()
    new = out / "step-00000003"
    report = inspect_checkpoint(new)
    assert report.ok, report.problems
    assert report.world_size == world and report.extra == {"run": "cli"}
    optim_files = [f.name for f in report.files if f.name.startswith("optim-")]
    assert len(optim_files) == sum(b > a for a, b in torchshard_ranges(fm, world))

    fm_a, opt_a = loaded(root)
    fm_b, opt_b = loaded(new)
    assert torch.equal(bits(fm_b.flat_param), bits(fm_a.flat_param))
    assert_same_tensors(fm_b.module.state_dict(), fm_a.module.state_dict())
    assert_same_tensors(fm_b.module.state_dict(), fm.module.state_dict())  # the trained one
    assert_same_optimizer(opt_b, opt_a)
    assert_same_optimizer(opt_b, opt)


def torchshard_ranges(fm: torchshard.FlatParamModule, world: int) -> list[tuple[int, int]]:
    from torchshard._flat.geometry import element_ranges

    return element_ranges(fm.numel, world, fm.layout.align_bytes // fm.dtype.itemsize)


def test_reshard_there_and_back_is_byte_identical(trained, tmp_path):
    root = trained[0]
    three = reshard(root, tmp_path / "three", 3)
    two = reshard(three, tmp_path / "two", 2)
    back = reshard(two, tmp_path / "back", 1)
    original = root / "step-00000003"
    names = sorted(p.name for p in original.iterdir())
    assert names == sorted(p.name for p in back.iterdir())
    for name in names:
        assert (back / name).read_bytes() == (original / name).read_bytes(), name


def test_reshard_refuses_and_cleans_up(trained, tmp_path, capsys):
    root = trained[0]
    out = tmp_path / "out"
    assert main(["reshard", str(root), str(out), "--world-size", "2"]) == 0
    capsys.readouterr()
    assert main(["reshard", str(root), str(out), "--world-size", "2"]) == 2
    assert "already exists" in one_error_line(capsys)

    path = copy_of(root, tmp_path)
    flip_byte(path / "optim-00001-of-00001.safetensors", 0.8)
    bad = tmp_path / "bad"
    assert main(["reshard", str(path), str(bad), "--world-size", "3"]) == 1
    assert "checksum mismatch" in one_error_line(capsys)
    assert list(bad.iterdir()) == []  # neither a step directory nor a temporary one


def test_progress_sees_every_byte(trained, tmp_path):
    class Count(Progress):
        def __init__(self) -> None:
            self.total, self.done, self.files, self.closed = 0, 0, [], False

        def start(self, what: str, total_bytes: int) -> None:
            self.total = total_bytes

        def file(self, name: str) -> None:
            self.files.append(name)

        def advance(self, nbytes: int) -> None:
            self.done += nbytes

        def close(self) -> None:
            self.closed = True

    root = trained[0]
    for run in (
        lambda p: reshard(root, tmp_path / "r", 2, progress=p),
        lambda p: consolidate(root, tmp_path / "c.safetensors", progress=p),
        lambda p: inspect_checkpoint(root, progress=p),
    ):
        p = Count()
        run(p)
        assert p.closed and p.files and p.total > 0 and p.done == p.total


# -- bad arguments ------------------------------------------------------------------------
def test_bad_arguments_exit_2_with_one_line(trained, tmp_path, capsys):
    root = str(trained[0])
    cases = [
        (["inspect", str(tmp_path / "missing")], "no such file or directory"),
        (["consolidate", str(tmp_path / "missing"), str(tmp_path / "o.safetensors")], "no such"),
        (["reshard", root, str(tmp_path / "o"), "--world-size", "0"], "positive integer"),
        (["reshard", root, str(tmp_path / "o"), "--world-size", "two"], "invalid int value"),
        (["reshard", root, str(tmp_path / "o")], "--world-size"),
        (["consolidate", root], "OUT"),
        (
            ["consolidate", root, str(tmp_path / "no" / "dir" / "o.safetensors")],
            "no such directory",
        ),
        (["consolidate", root, root], "not an empty directory"),
        (["consolidate", root, str(tmp_path / "hf")], "carries none"),
        (["reshard", root, str(trained[0] / "step-00000003"), "--world-size", "2"], "inside"),
        (["inspect"], "PATH"),
        ([], "command"),
        (["frobnicate"], "invalid choice"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in one_error_line(capsys), argv
    assert not (tmp_path / "o").exists()


def test_progress_on_a_terminal_without_tqdm(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails: one line per file
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["reshard", str(trained[0]), str(tmp_path / "r"), "--world-size", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0]
        == "torchshard: reshard step-00000003 to world size 2:   0% model-00001-of-00002.safetensors"
    )
    assert len(err) == 4 and err[-1].endswith("optim-00002-of-00002.safetensors")


@pytest.mark.slow
def test_console_script(trained):
    script = Path(sys.executable).parent / "torchshard"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "torchshard._cli"]
    ok = subprocess.run([*cmd, "inspect", str(trained[0])], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "every checksum verified" in ok.stdout and ok.stderr == ""  # no bar: not a terminal
    bad = subprocess.run(
        [*cmd, "reshard", str(trained[0]), "x", "--world-size", "-1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines() == [
        "torchshard: error: world size: expected a positive integer, got -1"
    ]


# -- a checkpoint of format 1 (before metadata.json had a checksum) ---------------------------
GOLDEN = Path(__file__).resolve().parent / "golden" / "v1" / "step-00000005"


class Golden(nn.Module):
    """The model of tests/golden/README.md."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.norm.bias.requires_grad_(False)
        self.register_buffer("scale", torch.zeros(3))
        self.register_buffer("calls", torch.tensor(0, dtype=torch.int64))


def golden_target() -> tuple[torchshard.FlatParamModule, torch.optim.Optimizer]:
    """Other weights, buffers, hyperparameters and no state: everything must come from disk."""
    torch.manual_seed(1)
    fm = torchshard.FlatParamModule(Golden())
    fm.bind(torch.empty(fm.numel))
    named = list(fm.module.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if not n.endswith("weight")]},
        ],
        lr=1e-2,
    )
    return fm, opt


def golden_copy(tmp_path: Path) -> Path:
    path = tmp_path / "v1" / GOLDEN.name
    shutil.copytree(GOLDEN, path)
    return path


def test_format_1_loads_as_its_files_hold_it(tmp_path):
    path = golden_copy(tmp_path)
    fm, opt = golden_target()
    info = checkpoint.load(path, fm, optimizer=opt)
    assert info.step == 5 and info.extra == {"note": "format 1"}
    # weights and buffers: as safetensors itself reads the file
    assert_same_tensors(
        fm.module.state_dict(), load_file(path / "model-00001-of-00001.safetensors")
    )
    # optimizer: each slot's range of the flat state, the step counters and hyperparameters
    meta = json.loads((path / "metadata.json").read_text())
    flat = load_file(path / "optim-00001-of-00001.safetensors")
    slots = {s[0]: (i, s) for i, s in enumerate(meta["layout"]["slots"])}
    names = {id(p): n for n, p in fm.module.named_parameters()}
    sd, pid = opt.state_dict(), 0
    for group, saved in zip(sd["param_groups"], meta["optimizer"]["param_groups"]):
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"
        }
    for group in opt.param_groups:
        for p in group["params"]:
            i, (_, shape, offset, numel, _, _) = slots[names[id(p)]]
            step = meta["optimizer"]["scalar_state"]["step"]["values"][i]
            if step is None:
                assert pid not in sd["state"]
            else:
                expect = {k: v[offset : offset + numel].view(shape) for k, v in flat.items()}
                expect["step"] = torch.tensor(step)
                assert_same_tensors(sd["state"][pid], expect)
            pid += 1
    assert pid == 4 and len(sd["state"]) == 3


def test_format_1_inspects_as_unprotected(tmp_path, capsys):
    path = golden_copy(tmp_path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "format       1" in out
    assert "metadata     UNPROTECTED: no checksum (format 1)" in out
    assert "warning: " in out and "carries no checksum" in out
    report = inspect_checkpoint(path)
    assert report.ok and not report.protected and report.format_version == 1
    assert len(report.warnings) == 1 and "metadata.json" in report.warnings[0]


def test_format_1_values_are_still_checked(tmp_path):
    path = golden_copy(tmp_path)
    edit_metadata(path, lambda m: m["optimizer"]["param_groups"][0].update(lr=-1), sealed=False)
    fm, opt = golden_target()
    before = fm.flat_param.clone()
    with pytest.raises(
        checkpoint.CheckpointError, match=r"param_groups\[0\]\.lr: expected a number >= 0, got -1"
    ):
        checkpoint.load(path, fm, optimizer=opt)
    assert torch.equal(fm.flat_param, before) and not opt.state


def test_reshard_writes_format_1_as_a_protected_format_2(tmp_path):
    out = reshard(golden_copy(tmp_path), tmp_path / "out", 2)
    report = inspect_checkpoint(out)
    assert report.ok and report.protected and report.format_version == 2, report.problems
    fm_a, opt_a = golden_target()
    checkpoint.load(GOLDEN, fm_a, optimizer=opt_a)
    fm_b, opt_b = golden_target()
    checkpoint.load(out, fm_b, optimizer=opt_b)
    assert torch.equal(bits(fm_b.flat_param), bits(fm_a.flat_param))
    assert_same_tensors(fm_b.module.state_dict(), fm_a.module.state_dict())
    assert_same_optimizer(opt_b, opt_a)
