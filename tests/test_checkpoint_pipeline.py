"""Pipeline checkpoints (issue 26): the files are the one-process picture. A save at
pp=2 x dp=2 is loaded by a plain trainer at dp=4, by pipelines at pp=4 and at another
split, and saved again: each save holds bitwise the same weights, optimizer state, param
groups and scalar state. Continuing after a load is bitwise the uninterrupted run; a plain
trainer's checkpoint loads into a pipeline; tied replicas are never written and equal their
owner after a load; consolidate exports the same file; a wrong model is named."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gpt import GPT, GPTConfig, init_gpt_weights
from multiprocess import run_distributed
from pipeline_models import gpt_loss, meta_gpt
from safetensors.torch import load_file

import torchshard
from torchshard import checkpoint

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)
SPLIT = [["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "lm_head"]]
OTHER = [["wte", "wpe", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head"]]
NO_DECAY = [(lambda name: name.endswith("bias") or ".ln" in name, {"weight_decay": 0.0})]


def _meta(tied: bool = False) -> GPT:
    return meta_gpt(CFG, tied)


_loss = gpt_loss


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
        for _ in range(steps)
    ]


def _pipe(pp: int, seed: int = 0, tied: bool = False, **kw: object) -> torchshard.Pipeline:
    torch.manual_seed(seed)
    kw.setdefault("stages", SPLIT if pp == 2 else "auto")
    pipe = torchshard.Pipeline(
        _meta(tied), pp=pp, microbatches=4, loss_fn=_loss, init_fn=init_gpt_weights, **kw
    )
    return pipe


def _train(pipe: torchshard.Pipeline, opt: torch.optim.Optimizer, batches: list) -> None:
    dp, d = pipe.dp_size, pipe.dp_rank
    rows = 8 // dp
    for x, y in batches:
        pipe.zero_grad()
        pipe.forward_backward(x[d * rows : (d + 1) * rows], target=y[d * rows : (d + 1) * rows])
        pipe.step()


def _mine(pipe: torchshard.Pipeline) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for h in pipe.stages
        for n, p in h.fm.module.named_parameters(remove_duplicate=False)
    }


def _plain(root: Path, src: str, dst: str) -> None:
    """A plain trainer over the whole model at the world's size: load, then save."""
    torch.manual_seed(5)
    trainer = torchshard.DistributedTrainer(
        torchshard.FlatParamModule(_meta()), init_fn=init_gpt_weights
    )
    opt = trainer.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    checkpoint.load(root / src, trainer, optimizer=opt)
    checkpoint.save(root / dst, trainer, step=2, optimizer=opt)
    trainer.close()


def _reload(root: Path, src: str, dst: str, pp: int, **kw: object) -> dict[str, torch.Tensor]:
    """A pipeline (another seed) loads ``src`` and saves it to ``dst``; its weights after."""
    pipe = _pipe(pp, seed=7, **kw)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    info = checkpoint.load(root / src, pipe, optimizer=opt)
    assert info.step == 2
    checkpoint.save(root / dst, pipe, step=2, optimizer=opt)
    out = _mine(pipe)
    pipe.close()
    return out


def _matrix(root: Path) -> dict:
    """pp=2 x dp=2 (shard=True) saves at step 2, trains on to 4; the others load step 2."""
    torch.set_default_dtype(torch.float32)
    batches = _batches(4)
    pipe = _pipe(2, shard=True)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    _train(pipe, opt, batches[:2])
    checkpoint.save(root / "pp2", pipe, step=2, optimizer=opt)
    _train(pipe, opt, batches[2:])
    uninterrupted = _mine(pipe)
    with checkpoint.Checkpointer(root / "pp2-4") as saver:  # as a trainer's
        saver.save(pipe, step=4, optimizer=opt, blocking=True)
    pipe.close()

    _plain(root, "pp2", "pp1")  # pp=1 x dp=4
    _reload(root, "pp2", "pp4", 4)  # pp=4 x dp=1
    _reload(root, "pp2", "other", 2, stages=OTHER)  # another split, shard=False

    pipe = _pipe(2, seed=9, shard=True)  # a plain trainer's checkpoint, then on to step 4
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    checkpoint.Checkpointer(root / "pp1").load(pipe, optimizer=opt, fallback=True)
    _train(pipe, opt, batches[2:])
    resumed = _mine(pipe)
    checkpoint.save(root / "resumed", pipe, step=4, optimizer=opt)
    pipe.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def _one(root: Path) -> Path:
    """The one checkpoint under ``root``."""
    (path,) = root.glob("step-*")
    return path


def _picture(path: Path) -> dict:
    """A checkpoint's content, whatever its cut: weights by name, each optimizer stream
    over the whole flat layout, and the metadata's optimizer sections."""
    path = _one(path)
    meta = json.loads((path / "metadata.json").read_text())
    weights = {}
    for shard in meta["weights"]["shards"]:
        weights.update(load_file(path / shard["file"]))
    optim = meta["optimizer"]
    streams: dict[str, list[torch.Tensor]] = {}
    for f in optim["files"]:
        for name, x in sorted(load_file(path / f["file"]).items()):
            streams.setdefault(name, []).append(x)
    return {
        "layout": meta["layout"],
        "weights": weights,
        "streams": {k: torch.cat(v) for k, v in streams.items()},
        "groups": optim["param_groups"],
        "scalars": optim["scalar_state"],
        "stateful": optim["stateful"],
        "files": sorted(meta["files"]),
    }


def _same(a: dict, b: dict) -> None:
    for key in ("layout", "groups", "scalars", "stateful"):
        assert a[key] == b[key], key
    for key in ("weights", "streams"):
        assert a[key].keys() == b[key].keys(), key
        for name, x in a[key].items():
            assert torch.equal(x, b[key][name]), (key, name)


def test_pp2_dp2_save_loads_anywhere_bitwise(tmp_path: Path) -> None:
    got = run_distributed(_matrix, 4, tmp_path, timeout=300)
    saved = _picture(tmp_path / "pp2")
    n = len(dict(_meta().named_parameters()))  # 53: two embeddings, 4 x 12, ln_f, lm_head
    assert len(saved["weights"]) == n and len(saved["streams"]) == 2
    meta = json.loads((_one(tmp_path / "pp2") / "metadata.json").read_text())
    assert meta["format_version"] == 2 and meta["world_size"] == 4
    assert meta["pipeline"]["owned_slots"] == [[0, 26], [26, n]]
    assert [g["weight_decay"] for g in saved["groups"]] == [0.01, 0.0]
    assert saved["scalars"]["step"]["values"] == [2.0] * n and saved["stateful"] == "1" * n
    for where in ("pp1", "pp4", "other"):
        _same(saved, _picture(tmp_path / where))
    _same(_picture(tmp_path / "pp2-4"), _picture(tmp_path / "resumed"))
    for rank in got:
        assert rank["uninterrupted"].keys() == rank["resumed"].keys()
        for name, x in rank["uninterrupted"].items():
            assert torch.equal(x, rank["resumed"][name]), name
    assert checkpoint.inspect_checkpoint(tmp_path / "pp2").ok
    resharded = checkpoint.reshard(_one(tmp_path / "pp2"), tmp_path / "re", 3)
    _same(saved, _picture(resharded.parent))
    a = checkpoint.consolidate(_one(tmp_path / "pp2"), tmp_path / "a.safetensors")
    b = checkpoint.consolidate(_one(tmp_path / "pp1"), tmp_path / "b.safetensors")
    assert a and b
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def _tied(root: Path, schedule: str) -> dict:
    """A tied embedding (shard=False) or Interleaved1F1B: save, load elsewhere, save again."""
    torch.set_default_dtype(torch.float32)
    tied = schedule == "1F1B"
    kw = {"schedule": schedule, "stages": SPLIT if tied else "auto"}
    pipe = _pipe(2, tied=tied, **kw)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    _train(pipe, opt, _batches(2))
    checkpoint.async_save(root / "a", pipe, step=2, optimizer=opt).wait()
    errors = {}
    try:  # not the pipeline's optimizer
        checkpoint.save(root / "x", pipe, step=2, optimizer=opt.parts[0])
    except checkpoint.CheckpointError as e:
        errors["not the pipeline's"] = str(e)
    pipe.close()
    out = _reload(root, "a", "b", 2, tied=tied, **kw)
    pipe = _pipe(2, tied=not tied, stages=SPLIT)  # another model: the layouts differ
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False, groups=NO_DECAY)
    try:
        checkpoint.load(root / "a", pipe, optimizer=opt)
    except checkpoint.CheckpointError as e:
        errors["model"] = str(e)
    pipe.close()
    pipe = _pipe(2, tied=tied, **kw)
    opt = pipe.make_optimizer(torch.optim.SGD, lr=1e-2, groups=NO_DECAY)
    try:
        checkpoint.load(root / "a", pipe, optimizer=opt)
    except checkpoint.CheckpointError as e:
        errors["optimizer"] = str(e)
    pipe.close()
    return {"weights": out, "errors": errors}


def test_tied_embedding_replica_is_not_written_and_equals_its_owner(tmp_path: Path) -> None:
    got = run_distributed(_tied, 4, tmp_path, "1F1B", timeout=300)
    saved = _picture(tmp_path / "a")
    assert "wte.weight" in saved["weights"] and "lm_head.weight" not in saved["weights"]
    _same(saved, _picture(tmp_path / "b"))
    first, last = got[0]["weights"], got[2]["weights"]  # pp rank 0 and 1, dp rank 0
    assert torch.equal(first["wte.weight"], last["lm_head.weight"])
    assert torch.equal(first["wte.weight"], saved["weights"]["wte.weight"])
    for rank in got:
        assert "different model" in rank["errors"]["model"], rank["errors"]
        assert "lm_head.weight" in rank["errors"]["model"], rank["errors"]
        assert "AdamW" in rank["errors"]["optimizer"], rank["errors"]
        assert "pipe.make_optimizer" in rank["errors"]["not the pipeline's"], rank["errors"]


def test_interleaved_two_stages_per_rank(tmp_path: Path) -> None:
    run_distributed(_tied, 4, tmp_path, "Interleaved1F1B", timeout=300)
    saved = _picture(tmp_path / "a")
    meta = json.loads((_one(tmp_path / "a") / "metadata.json").read_text())
    assert meta["pipeline"]["stages"] == 4 and meta["world_size"] == 8
    _same(saved, _picture(tmp_path / "b"))
