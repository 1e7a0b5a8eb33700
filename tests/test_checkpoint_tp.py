"""Checkpoints of a tensor-parallel module (issue 25): the files stay the TP=1 picture.

- A (dp2, tp2) save of the tiny GPT (float64, AdamW) writes whole named tensors (equal, bit
  for bit, to the gathered live weights), the whole layout's optimizer ranges (equal to the
  gathered live moments), and ``metadata.json`` records the degree and the plan; ``inspect``,
  ``consolidate`` and ``reshard`` work on it untouched, ``load_file`` gives the whole tensors.
- Saved at (2, 2) in each data-parallel mode, it loads at (1, 1), (2, 1), (1, 2) and (4, 1)
  in another mode; each load saved again gives the same picture (whole weights, every flat
  state stream, the scalar state), bit for bit; at (1, 1) the live optimizer holds it.
- A TP=1 checkpoint loads at tp=2 (and the picture comes back the same); so do a bfloat16
  model's float32 master (a third stream) and frozen parameters, replicated and split.
- A (2, 2) run resumed from its step-2 save is bitwise the uninterrupted one, in each mode.
- A checkpoint whose plan splits a parameter otherwise raises ``CheckpointError`` naming it,
  on every rank; a save or load that fails on one rank fails on all, and nothing hangs.
- A dp_replicate 2 x tp 2 mesh (replicated) saves the same picture; so does hybrid sharding
  (dp_replicate 2 x tp 2, in both sharded modes), which loads at other degrees and resumes.
- ``async_save`` (a finished future) and a ``Checkpointer`` (rotating) save alike.
- ``torchshard consolidate`` of a (2, 2) Llama checkpoint (``tp_plan="auto"``) loads with
  ``AutoModelForCausalLM.from_pretrained``, bitwise the gathered live weights.
- The save's collectives send each element to its writer only (under twice the files' bytes
  in all at (2, 2)).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, TP_PLAN, GPTConfig, init_gpt_weights
from multiprocess import run_distributed
from safetensors.torch import load_file

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, checkpoint
from torchshard.checkpoint import CheckpointError

CFG = GPTConfig.preset("tiny")
MODES = {"rep": False, "shard": True, "full": "full"}
F64 = torch.float64


def _trainer(
    tp: int,
    mode: str,
    plan: dict | None = TP_PLAN,
    dtype: torch.dtype = F64,
    frozen: tuple[str, ...] = (),
    replicate: int = 1,
    preset: str = "tiny",
):
    """The tiny GPT on ``init_mesh(tp=tp)``, split by ``plan``, in ``mode``; the sharded modes
    keep a master copy (float32 for a bfloat16 model); ``frozen`` parameters do not train."""
    torch.set_default_dtype(dtype)
    try:
        mesh = torchshard.init_mesh(dp_replicate=replicate, tp=tp)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(GPTConfig.preset(preset))
    finally:
        torch.set_default_dtype(torch.float32)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    fm = FlatParamModule(model, tp_plan=plan if tp > 1 else None, mesh=mesh if tp > 1 else None)
    kw = {"units": ["blocks.0", "blocks.1"]} if mode == "full" else {}
    master = torch.float32 if dtype == torch.bfloat16 else dtype
    tr = DistributedTrainer(
        fm, mesh=mesh, shard=MODES[mode], master_dtype=master, init_fn=init_gpt_weights, **kw
    )
    return mesh, fm, tr, tr.make_optimizer(torch.optim.AdamW, lr=1e-2)


def _steps(mesh, fm, tr, opt, start: int, stop: int) -> None:
    """Steps ``start .. stop - 1`` of one global batch of 4 per step, cut over dp."""
    n = 4 // mesh.dp_size
    for step in range(start, stop):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randint(0, CFG.vocab_size, (4, 16), generator=g)
        y = torch.randint(0, CFG.vocab_size, (4, 16), generator=g)
        d = mesh.dp_rank
        opt.zero_grad()
        fm(x[n * d : n * (d + 1)], y[n * d : n * (d + 1)])[1].backward()
        tr.average_gradients()
        tr.step()


def _whole_weights(fm, tr) -> dict[str, torch.Tensor]:
    """Every parameter, whole (gathered over dp and tp), by name."""
    out = {}
    with tr.gathered():
        for i, s in enumerate(fm.layout.slots):
            w = fm.module.get_parameter(s.name).detach()
            out[s.name] = (fm.tp.gather(i, w) if fm.tp is not None else w).clone()
    return out


def picture(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """A checkpoint as the TP=1 picture: its whole named tensors (``load_file`` on the model
    files), each flat state stream over the whole layout (its optimizer files in range
    order), and the optimizer's scalar state and param groups."""
    meta = json.loads((path / "metadata.json").read_text())
    weights = {}
    for shard in meta["weights"]["shards"]:
        weights.update(load_file(path / shard["file"]))
    streams: dict[str, list[torch.Tensor]] = {}
    for f in sorted(meta["optimizer"]["files"], key=lambda f: f["range"][0]):
        for k, v in load_file(path / f["file"]).items():
            streams.setdefault(k, []).append(v)
    opt = {k: meta["optimizer"][k] for k in ("scalar_state", "stateful", "param_groups")}
    return weights, {k: torch.cat(v) for k, v in streams.items()}, opt


def assert_same_picture(a: Path, b: Path, streams: int = 2) -> None:
    (wa, sa, oa), (wb, sb, ob) = picture(a), picture(b)
    assert wa.keys() == wb.keys() and sa.keys() == sb.keys() and len(sa) == streams
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert oa == ob


def _one(root: Path) -> Path:
    """The one checkpoint under ``root``."""
    (path,) = root.glob("step-*")
    return path


# -- workers -----------------------------------------------------------------------------------
def _save(root: str, tp: int, mode: str, steps: int, **kw) -> dict | None:
    mesh, fm, tr, opt = _trainer(tp, mode, **kw)
    if mode == "full":  # a Checkpointer keeping the last one: step 1 is rotated out
        _steps(mesh, fm, tr, opt, 0, 1)
        ckpt = checkpoint.Checkpointer(root, keep_last=1)
        ckpt.save(tr, step=1, optimizer=opt)
        _steps(mesh, fm, tr, opt, 1, steps)
        ckpt.save(tr, step=steps, optimizer=opt, extra={"seen": steps}).wait()
        ckpt.close()
    else:
        _steps(mesh, fm, tr, opt, 0, steps)
    if mode == "shard":  # async_save of a split module: a finished future
        checkpoint.async_save(root, tr, step=steps, optimizer=opt, extra={"seen": steps}).wait()
    elif mode == "rep":
        checkpoint.save(root, tr, step=steps, optimizer=opt, extra={"seen": steps})
    weights = _whole_weights(fm, tr)
    moments = {}
    if mode == "rep":  # the live moments, whole: each slot's, gathered over tp
        for i, _a, _, p in tr.optimizer_segments():
            for k in ("exp_avg", "exp_avg_sq"):
                m = opt.state[p][k].view(fm.layout.slots[i].shape)
                moments[(k, i)] = fm.tp.gather(i, m) if fm.tp is not None else m
    tr.close()
    return {"weights": weights, "moments": moments} if dist.get_rank() == 0 else None


def _load_and_save(src: str, dst: str, tp: int, mode: str, **kw) -> dict | None:
    _, _, tr, opt = _trainer(tp, mode, **kw)
    info = checkpoint.load(src, tr, optimizer=opt)
    checkpoint.save(dst, tr, step=info.step, optimizer=opt, extra=info.extra)
    out = {"read": info.bytes_read}
    if dist.get_world_size() == 1:  # the live optimizer's state, whole parameters
        for i, _, _, p in tr.optimizer_segments():
            st = opt.state[p]
            out[i] = {k: v.clone() for k, v in st.items()}
    tr.close()
    return out


def _resume(root: str, mode: str, stop: int, at: int | None, **kw) -> dict | None:
    mesh, fm, tr, opt = _trainer(2, mode, **kw)
    start = 0
    if at is not None:
        start = checkpoint.load(root, tr, optimizer=opt).step
    _steps(mesh, fm, tr, opt, start, stop)
    weights = _whole_weights(fm, tr)
    tr.close()
    return weights if dist.get_rank() == 0 else None


def _load_other_plan(src: str) -> str:
    plan = {k: v for k, v in TP_PLAN.items() if k != "blocks.*.mlp.0"}
    plan["blocks.*.mlp.0"] = "colwise_gather_output"  # same split: loads
    _, _, tr, opt = _trainer(2, "rep", plan)
    checkpoint.load(src, tr, optimizer=opt)
    tr.close()
    plan = {k: v for k, v in TP_PLAN.items() if k not in ("blocks.*.mlp.0", "blocks.*.mlp.2")}
    _, _, tr, opt = _trainer(2, "rep", plan)  # the MLP replicated: another plan
    try:
        checkpoint.load(src, tr, optimizer=opt)
    except CheckpointError as e:
        return str(e)
    finally:
        tr.close()
    return "loaded"


def _bytes_sent(root: str, mode: str) -> int:
    """Bytes this rank sends in the collectives of one save (counted per call: gather and
    broadcast from their sources, all-to-all but its own part, all-gather to the others)."""
    mesh, fm, tr, opt = _trainer(2, mode)
    _steps(mesh, fm, tr, opt, 0, 1)
    me, sent, real = dist.get_rank(), [0], {}

    def nb(x: torch.Tensor) -> int:
        return x.numel() * x.element_size()

    def a2a(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **_):
        own = input_split_sizes[dist.get_group_rank(group, me)] if input_split_sizes else 0
        return nb(inp) - own * inp.element_size()

    counts = {
        "gather": lambda t, gather_list=None, dst=0, **_: 0 if me == dst else nb(t),
        "broadcast": lambda t, src=0, **_: nb(t) if me == src else 0,
        "all_gather": lambda tl, t, **_: nb(t) * (len(tl) - 1),
        "all_to_all_single": a2a,
    }
    for name, count in counts.items():
        real[name] = getattr(dist, name)

        def counted(*a, _f=real[name], _c=count, **k):
            sent[0] += _c(*a, **k)
            return _f(*a, **k)

        setattr(dist, name, counted)
    try:
        checkpoint.save(root, tr, step=1, optimizer=opt)
    finally:
        for name, f in real.items():
            setattr(dist, name, f)
    tr.close()
    return sent[0]


def _llama(root: str) -> dict | None:
    """A tiny LlamaForCausalLM (random init from a LlamaConfig, nothing downloaded) split
    with tp_plan="auto" at (dp 2, tp 2), float32, 2 AdamW steps (shard=True), saved."""
    import transformers

    mesh = torchshard.init_mesh(tp=2)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    fm = FlatParamModule(model, tp_plan="auto", mesh=mesh)
    tr = DistributedTrainer(fm, mesh=mesh, shard=True)
    opt = tr.make_optimizer(torch.optim.AdamW, lr=1e-2)
    d = mesh.dp_rank
    for step in range(2):
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(10 + step))
        opt.zero_grad()
        fm(input_ids=x[2 * d : 2 * d + 2], labels=x[2 * d : 2 * d + 2]).loss.backward()
        tr.average_gradients()
        tr.step()
    checkpoint.save(root, tr, step=2, optimizer=opt)
    weights = _whole_weights(fm, tr)
    tr.close()
    return weights if dist.get_rank() == 0 else None


def test_a_22_llama_exports_for_from_pretrained_bitwise(tmp_path):
    """``torchshard consolidate`` of a (dp 2, tp 2) Llama checkpoint (tp_plan="auto"): the
    directory ``AutoModelForCausalLM.from_pretrained`` loads holds every parameter bit for
    bit as the trainer held it, gathered over dp and tp."""
    transformers = pytest.importorskip("transformers")
    from torchshard._cli import main

    live = run_distributed(_llama, 4, str(tmp_path / "ckpt"), timeout=180)[0]
    meta = json.loads((_one(tmp_path / "ckpt") / "metadata.json").read_text())
    assert meta["tp"]["tp"] == 2 and meta["tp"]["splits"]  # split, saved at (2, 2)
    assert main(["consolidate", str(_one(tmp_path / "ckpt")), str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    loaded = dict(model.named_parameters())
    assert loaded.keys() == live.keys()
    for name, w in live.items():
        assert loaded[name].dtype == w.dtype and torch.equal(loaded[name].detach(), w), name


def _mixed(tp: int):
    """The tiny GPT in bfloat16 with float32 LayerNorms (a buffer of several dtypes)."""
    mesh = torchshard.init_mesh(tp=tp)
    with torch.device("meta"):
        model = GPT(CFG).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if ".ln" in name or name.startswith("ln"):
            p.data = p.data.float()
    split = {"tp_plan": TP_PLAN, "mesh": mesh} if tp > 1 else {}
    fm = FlatParamModule(model, **split)
    assert fm.layout.mixed
    return DistributedTrainer(fm, mesh=mesh, init_fn=init_gpt_weights)


def _mixed_save(root: str) -> None:
    tr = _mixed(1)
    checkpoint.save(root, tr, step=1)
    tr.close()


def _mixed_refused(root: str, other: str) -> list[str]:
    tr, out = _mixed(2), []
    for call in (lambda: checkpoint.save(other, tr, step=1), lambda: checkpoint.load(root, tr)):
        try:
            call()
            out.append("no error")
        except CheckpointError as e:
            out.append(str(e))
    tr.close()
    return out


def _failures(root: str) -> list[str]:
    """A save at a step that exists, then a load that fails on tp rank 1 alone: each raises
    on every rank."""
    from torchshard.checkpoint import _tp_load

    _, _, tr, opt = _trainer(2, "rep")
    out = []
    checkpoint.save(root, tr, step=1, optimizer=opt)
    try:
        checkpoint.save(root, tr, step=1, optimizer=opt)
    except CheckpointError as e:
        out.append(str(e))
    if dist.get_rank() == 1:

        def broken(*args, **kwargs):
            raise CheckpointError("a damaged chunk")

        _tp_load._Whole.weights = broken
    try:
        checkpoint.load(root, tr, optimizer=opt)
    except CheckpointError as e:
        out.append(str(e))
    tr.close()
    return out


# -- tests -------------------------------------------------------------------------------------
def test_a_22_save_is_the_tp1_picture(tmp_path):
    root = tmp_path / "ckpt"
    got = run_distributed(_save, 4, str(root), 2, "rep", 2, timeout=120)[0]
    path = _one(root)
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["world_size"] == 4 and meta["tp"]["tp"] == 2
    assert meta["tp"]["tp_plan"]["blocks.0.attn.qkv"] == "packed_colwise"
    assert meta["tp"]["splits"]["blocks.0.attn.qkv.weight"] == [0, 3]
    assert meta["tp"]["splits"]["blocks.0.mlp.2.weight"] == [1, 1]
    with torch.device("meta"):
        one = FlatParamModule(GPT(CFG).to(F64))  # the one-process layout
    assert meta["layout"] == one.layout.to_dict()
    weights, streams, _ = picture(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights) == set(got["weights"])
    for name, w in got["weights"].items():
        assert weights[name].shape == w.shape and torch.equal(weights[name], w), name
    assert len(got["moments"]) == 2 * len(one.layout.slots)
    for (k, i), m in got["moments"].items():
        s = one.layout.slots[i]
        assert torch.equal(streams[k][s.offset : s.end].view(s.shape), m), (k, s.name)
    # the offline tools, untouched
    report = checkpoint.inspect_checkpoint(path)
    assert report.ok, report.problems
    out = checkpoint.consolidate(path, tmp_path / "model.safetensors")
    merged = load_file(out.path)
    for name, w in got["weights"].items():
        assert torch.equal(merged[name], w), name
    checkpoint.reshard(path, tmp_path / "one", world_size=1)
    assert_same_picture(path, _one(tmp_path / "one"))


@pytest.mark.parametrize(
    "saved, loads",
    [
        ("rep", [(1, 1, "rep"), (2, 1, "shard"), (1, 2, "full"), (4, 1, "full")]),
        ("shard", [(1, 1, "full"), (2, 1, "rep"), (1, 2, "shard"), (4, 1, "rep")]),
        ("full", [(1, 1, "shard"), (2, 1, "full"), (1, 2, "rep"), (4, 1, "shard")]),
    ],
)
def test_a_22_save_loads_at_any_degree_and_mode(tmp_path, saved, loads):
    src = tmp_path / "src"
    run_distributed(_save, 4, str(src), 2, saved, 2, timeout=120)
    path = _one(src)
    _weights, streams, scal = picture(path)
    layout = None
    for dp, tp, mode in loads:
        dst = tmp_path / f"{dp}x{tp}-{mode}"
        got = run_distributed(_load_and_save, dp * tp, str(path), str(dst), tp, mode, timeout=120)
        assert_same_picture(path, _one(dst))
        if dp * tp == 1:  # the live optimizer holds the saved moments and step
            meta = json.loads((path / "metadata.json").read_text())
            from torchshard._flat.layout import FlatLayout

            layout = FlatLayout.from_dict(meta["layout"])
            assert len(got[0]) == len(layout.slots) + 1
            for i, st in ((i, st) for i, st in got[0].items() if i != "read"):
                s = layout.slots[i]
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(st[k].reshape(-1), streams[k][s.offset : s.end]), (k, i)
                assert float(st["step"]) == scal["scalar_state"]["step"]["values"][i] == 2.0
    assert layout is not None


def test_a_tp1_checkpoint_loads_at_tp2(tmp_path):
    src = tmp_path / "src"
    run_distributed(_save, 2, str(src), 1, "shard", 2, timeout=120)
    dst = tmp_path / "dst"
    run_distributed(_load_and_save, 2, str(_one(src)), str(dst), 2, "full", timeout=120)
    assert "tp" in json.loads((_one(dst) / "metadata.json").read_text())
    assert_same_picture(_one(src), _one(dst))


def test_frozen_parameters_and_a_master_copy_load_at_other_degrees(tmp_path):
    """bfloat16 weights with a float32 master (a third flat stream), a replicated and a split
    parameter frozen (the optimizer files store the trainable runs only)."""
    kw = {"dtype": torch.bfloat16, "frozen": ("wpe.weight", "blocks.0.mlp.0.weight")}
    src = tmp_path / "src"
    run_distributed(_save, 4, str(src), 2, "shard", 2, timeout=120, **kw)
    meta = json.loads((_one(src) / "metadata.json").read_text())
    assert meta["optimizer"]["stored"] == "trainable"
    for dp, tp, mode in [(1, 2, "full"), (2, 1, "shard")]:
        dst = tmp_path / f"{dp}x{tp}"
        run_distributed(
            _load_and_save, dp * tp, str(_one(src)), str(dst), tp, mode, timeout=120, **kw
        )
        assert_same_picture(_one(src), _one(dst), streams=3)


@pytest.mark.parametrize("mode", ["rep", "shard", "full"])
def test_a_resumed_22_run_is_bitwise_the_uninterrupted_one(tmp_path, mode):
    root = tmp_path / "ckpt"
    run_distributed(_save, 4, str(root), 2, mode, 2, timeout=120)
    resumed = run_distributed(_resume, 4, str(root), mode, 4, 2, timeout=120)[0]
    straight = run_distributed(_resume, 4, str(root), mode, 4, None, timeout=120)[0]
    assert resumed.keys() == straight.keys()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name


def test_another_plan_is_refused_naming_the_parameter(tmp_path):
    root = tmp_path / "ckpt"
    run_distributed(_save, 2, str(root), 2, "rep", 1, timeout=120)
    got = run_distributed(_load_other_plan, 2, str(_one(root)), timeout=120)
    for message in got:  # every rank, no hang
        assert "'blocks.0.mlp.0.weight'" in message and "replicated" in message, message


@pytest.mark.parametrize("mode", ["rep", "full"])
def test_a_save_moves_each_element_to_its_writer_only(tmp_path, mode):
    """Each element crosses at most twice (to the writer's dp rank, then inside its tp group):
    the collectives of a (2, 2) save send less than twice the files' bytes in all, where
    gathering every whole slot on every rank would send more than the files per rank."""
    sent = run_distributed(_bytes_sent, 4, str(tmp_path), mode, timeout=120)
    files = sum(p.stat().st_size for p in _one(tmp_path).glob("*.safetensors"))
    assert 0 < sum(sent) < 2 * files, (sent, files)
    assert max(sent) < files / 2, (sent, files)


def test_a_replicated_mesh_saves_the_22_picture(tmp_path):
    """A (dp_replicate 2) x tp 2 mesh trains replicated over mesh.dp: its save is the picture
    a (2, 2) one writes."""
    a, b = tmp_path / "a", tmp_path / "b"
    run_distributed(_save, 4, str(a), 2, "rep", 1, timeout=120, replicate=2)
    run_distributed(_save, 4, str(b), 2, "rep", 1, timeout=120)
    assert_same_picture(_one(a), _one(b))


@pytest.mark.parametrize("mode", ["shard", "full"])
def test_hybrid_sharding_with_tp_saves_loads_and_resumes(tmp_path, mode):
    """Hybrid sharding (dp_replicate 2 x tp 2, one shard per replica): the save is the picture
    a (2, 2) save of the same run writes; it loads at (1, 1), (2, 1), (1, 2) and hybrid
    (2, 2) again (each saved again: the same picture, bit for bit), and a hybrid run resumed
    from it is bitwise the uninterrupted one."""
    root, plain = tmp_path / "ckpt", tmp_path / "plain"
    got = run_distributed(_save, 4, str(root), 2, mode, 2, timeout=120, replicate=2)[0]
    run_distributed(_save, 4, str(plain), 2, mode, 2, timeout=120)
    path = _one(root)
    assert_same_picture(path, _one(plain))
    weights, _, _ = picture(path)
    for name, w in got["weights"].items():
        assert torch.equal(weights[name], w), name
    for dp, tp, other, kw in [
        (1, 1, "rep", {}),
        (2, 1, "full", {}),
        (1, 2, "shard", {}),
        (2, 2, mode, {"replicate": 2}),
    ]:
        dst = tmp_path / f"{dp}x{tp}-{other}"
        run_distributed(_load_and_save, dp * tp, str(path), str(dst), tp, other, timeout=120, **kw)
        assert_same_picture(path, _one(dst))
    resumed = run_distributed(_resume, 4, str(root), mode, 4, 2, timeout=120, replicate=2)[0]
    straight = run_distributed(_resume, 4, str(root), mode, 4, None, timeout=120, replicate=2)
    for name in straight[0]:
        assert torch.equal(resumed[name], straight[0][name]), name


def test_a_load_reads_the_files_about_once(tmp_path):
    """The small GPT (20 MB of files): a load at (1, 2) or (2, 2) reads each byte about once
    across the ranks (a rowwise weight: each tp rank an equal block of rows, exchanged after),
    where reading a dim-1 split whole on each tp rank would read 1.4x the files."""
    src = tmp_path / "src"
    run_distributed(_save, 4, str(src), 2, "rep", 1, timeout=120, preset="small")
    files = sum(p.stat().st_size for p in _one(src).glob("*.safetensors"))
    for dp, tp, mode in [(1, 2, "rep"), (2, 2, "full")]:
        dst = str(tmp_path / f"{dp}x{tp}")
        got = run_distributed(
            _load_and_save, dp * tp, str(_one(src)), dst, tp, mode, timeout=120, preset="small"
        )
        read = sum(r["read"] for r in got)
        assert files <= read < 1.2 * files, (dp, tp, mode, read, files)


def test_a_split_module_of_several_dtypes_is_refused_on_every_rank(tmp_path):
    """Not supported yet (see docs/checkpoint-format.md): its save, and its load of a TP=1
    checkpoint of the same mixed model, raise a CheckpointError saying what to do."""
    run_distributed(_mixed_save, 1, str(tmp_path / "one"), timeout=120)
    got = run_distributed(_mixed_refused, 2, str(tmp_path / "one"), str(tmp_path / "x"))
    for save, load in got:
        assert "several dtypes" in save and "tp=1" in save, save
        assert "several dtypes" in load and "load it at tp=1" in load, load


def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path):
    got = run_distributed(_failures, 2, str(tmp_path / "ckpt"), timeout=120)
    for save, load in got:
        assert "already exists" in save, save
        assert "a damaged chunk" in load, load
    assert "tp rank 1" in got[0][1]
