"""Parameters of several dtypes in one checkpoint (format 4, docs/checkpoint-format.md).

The model is a mixed-precision transformer's shape: bf16 linears, fp32 LayerNorms and an fp32
router between them (forward casts), so the flat buffer is bytes and its regions alternate
between the two dtypes. Every tensor keeps its own dtype in the model files and in
``consolidate``'s output; the optimizer state keeps its own dtype per parameter dtype, in one
stream per state key and parameter dtype. A load into a fresh model is bitwise, and a step
after it equals the uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_harness import header, read_meta, refused, write_meta
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import torchshard
from torchshard import checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

BF16, FP32 = torch.bfloat16, torch.float32


class Block(nn.Module):
    """fp32 norm and router, bf16 feed-forward; the residual stream stays fp32."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, 2)
        self.up = nn.Linear(d, 2 * d).to(BF16)
        self.down = nn.Linear(2 * d, d).to(BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gate = torch.softmax(self.router(h), dim=-1)[..., :1]
        y = self.down(torch.nn.functional.gelu(self.up(h.to(BF16)))).float()
        return x + gate * y


class Mixed(nn.Module):
    def __init__(self, d: int = 12, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d).to(BF16)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.final = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3).to(BF16)
        self.register_buffer("scale", torch.arange(3, dtype=FP32))
        self.register_buffer("mask", torch.tensor([True, False, True]))  # 3 bytes: then weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.to(BF16)).float()
        for block in self.blocks:
            h = block(h)
        return self.head(self.final(h).to(BF16)).float() * self.scale * self.mask


def build(
    seed: int, freeze: bool = False
) -> tuple[torchshard.FlatParamModule, torch.optim.Optimizer]:
    """The model (weights from ``seed``) and AdamW in two groups; ``freeze``: the input layer
    and the first block's norm are frozen (optimizer state for the trainable ones alone)."""
    torch.manual_seed(seed)
    model = Mixed()
    if freeze:
        model.embed.requires_grad_(False)
        model.blocks[0].norm.requires_grad_(False)
    fm = torchshard.FlatParamModule(model)
    fm.bind(torch.empty(fm.numel, dtype=fm.dtype))
    named = [(n, p) for n, p in fm.module.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    return fm, torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95))


def train(fm: torchshard.FlatParamModule, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        fm(torch.randn(5, 8, generator=g)).square().mean().backward()
        opt.step()


def differences(fm, opt, ref_fm, ref_opt) -> list[str]:
    """Where two models and their optimizers differ: weights and state bitwise, dtypes, groups."""
    out = []
    for (name, p), q in zip(fm.module.named_parameters(), ref_fm.module.parameters()):
        if p.dtype != q.dtype or not torch.equal(p, q):
            out.append(f"parameter {name}")
    for g, (group, ref) in enumerate(zip(opt.param_groups, ref_opt.param_groups)):
        if {k: v for k, v in group.items() if k != "params"} != {
            k: v for k, v in ref.items() if k != "params"
        }:
            out.append(f"param group {g}")
    for (name, p), q in zip(fm.module.named_parameters(), ref_fm.module.parameters()):
        st, ref_st = opt.state.get(p, {}), ref_opt.state.get(q, {})
        if st.keys() != ref_st.keys():
            out.append(f"state keys of {name}: {sorted(st)} vs {sorted(ref_st)}")
            continue
        for k in st:
            a, b = torch.as_tensor(st[k]), torch.as_tensor(ref_st[k])
            if a.dtype != b.dtype or not torch.equal(a, b):
                out.append(f"state {k} of {name}")
    return out


@pytest.fixture(params=[False, True], ids=["all-train", "frozen"])
def saved(request, tmp_path: Path) -> tuple[Path, bool]:
    fm, opt = build(seed=0, freeze=request.param)
    train(fm, opt, range(3))
    return checkpoint.save(tmp_path / "ckpt", fm, step=3, optimizer=opt), request.param


def test_the_model_is_mixed():
    fm, _ = build(0)
    assert fm.dtype == torch.uint8 and fm.dtypes == (BF16, FP32)
    assert len(fm.layout.regions) >= 6  # bf16 and fp32 regions alternate


def test_load_into_a_fresh_model_is_bitwise_and_training_goes_on_as_uninterrupted(saved):
    path, freeze = saved
    ref, ref_opt = build(seed=0, freeze=freeze)  # the uninterrupted run
    train(ref, ref_opt, range(3))
    fm, opt = build(seed=1, freeze=freeze)  # other weights and state
    train(fm, opt, range(10, 12))
    info = checkpoint.load(path, fm, optimizer=opt)
    assert info.step == 3
    assert not differences(fm, opt, ref, ref_opt)
    assert {p.dtype for p in fm.parameters()} == {BF16, FP32}
    assert torch.equal(fm.module.scale, ref.module.scale)
    train(fm, opt, range(3, 5))
    train(ref, ref_opt, range(3, 5))
    assert not differences(fm, opt, ref, ref_opt)


def test_every_tensor_is_stored_in_its_own_dtype(saved):
    path, freeze = saved
    fm, _ = build(seed=0, freeze=freeze)
    meta = read_meta(path)
    assert meta["format_version"] == 4 and meta["layout"]["format"] == 2
    assert meta["layout"]["dtype"] == "uint8"
    params = dict(fm.module.named_parameters())
    with safe_open(path / "model-00001-of-00001.safetensors", "pt") as f:
        names = f.keys()
        assert set(names) == {*params, "scale", "mask"}
        buffers = dict(fm.module.named_buffers())
        for name in names:
            want = params[name] if name in params else buffers[name]
            assert f.get_tensor(name).dtype == want.dtype, name
            assert f.get_tensor(name).shape == want.shape, name
    index = json.loads((path / "model.safetensors.index.json").read_text())
    nbytes = sum(p.numel() * p.element_size() for p in params.values()) + 3 * 4 + 3
    assert index["metadata"]["total_size"] == nbytes
    # the state of each parameter dtype, in that dtype (AdamW over the parameters themselves)
    state = {"bfloat16": "bfloat16", "float32": "float32"}
    assert meta["optimizer"]["flat_state"] == {"exp_avg": state, "exp_avg_sq": state}
    trains = [s for s in fm.layout.slots if s.requires_grad]
    with safe_open(path / "optim-00001-of-00001.safetensors", "pt") as f:
        assert set(f.keys()) == {f"{k}/{d}" for k in ("exp_avg", "exp_avg_sq") for d in state}
        for dtype in (BF16, FP32):
            got = f.get_tensor(f"exp_avg/{str(dtype)[6:]}")
            assert got.dtype == dtype
            # the parameters of that dtype (alignment gaps between them too), not their bytes
            elements = sum(s.numel for s in trains if s.torch_dtype == dtype)
            assert elements <= got.numel() < elements + 8 * len(fm.layout.regions)


def test_a_save_in_the_background_writes_the_same_bytes(saved, tmp_path):
    """Staged into host memory (after a 3-byte buffer: the weights' bytes are placed where
    each dtype can view them) and written by the background thread, as written in place."""
    path, freeze = saved
    fm, opt = build(seed=0, freeze=freeze)
    train(fm, opt, range(3))
    with checkpoint.Checkpointer(tmp_path / "async") as ckpt:
        ckpt.save(fm, step=3, optimizer=opt).wait()
    staged = tmp_path / "async" / "step-00000003"
    for f in sorted(path.iterdir()):
        assert (staged / f.name).read_bytes() == f.read_bytes(), f.name


def test_consolidate_keeps_each_dtype(saved, tmp_path):
    path, freeze = saved
    out = checkpoint.consolidate(path, tmp_path / "mixed.safetensors")
    assert out.tensors == len(list(Mixed().state_dict()))
    weights = load_file(tmp_path / "mixed.safetensors")
    ref, ref_opt = build(seed=0, freeze=freeze)
    train(ref, ref_opt, range(3))
    for name, value in ref.module.state_dict().items():
        assert weights[name].dtype == value.dtype and torch.equal(weights[name], value), name
    plain = Mixed()  # a plain model takes them as they are
    plain.load_state_dict(weights)
    assert plain.blocks[1].up.weight.dtype == BF16 and plain.blocks[1].norm.weight.dtype == FP32


def test_inspect_verifies_it_and_reshard_loads_as_the_original(saved, tmp_path, capsys):
    path, freeze = saved
    report = checkpoint.inspect_checkpoint(path)
    assert report.ok, report.problems
    assert report.dtypes == ["bfloat16", "float32"] and report.format_version == 4
    fm, _ = build(0, freeze=freeze)
    assert report.param_bytes == sum(p.numel() * p.element_size() for p in fm.parameters())
    from torchshard._cli import main

    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "bfloat16, float32" in text and "exp_avg (bfloat16: bfloat16, float32: float32)" in text
    direct, direct_opt = build(seed=1, freeze=freeze)
    checkpoint.load(path, direct, optimizer=direct_opt)
    for world in (2, 3):
        resharded = checkpoint.reshard(path, tmp_path / f"at-{world}", world)
        report = checkpoint.inspect_checkpoint(resharded)
        assert report.ok and report.world_size == world, report.problems
        assert len(list(resharded.glob("optim-*"))) == world
        fm, opt = build(seed=2, freeze=freeze)
        checkpoint.load(resharded, fm, optimizer=opt)
        assert not differences(fm, opt, direct, direct_opt), world


def test_state_in_another_dtype_than_its_parameters(tmp_path):
    """fp32 moments of bf16 parameters (what an fp32 master's optimizer keeps) are saved as
    fp32, and load back as torch's load_state_dict casts them, to the parameter's dtype."""
    fm, opt = build(seed=0)
    train(fm, opt, range(2))
    for p in fm.parameters():
        if p.dtype == BF16:
            for key in ("exp_avg", "exp_avg_sq"):
                opt.state[p][key] = opt.state[p][key].float()
    path = checkpoint.save(tmp_path, fm, step=2, optimizer=opt)
    state = read_meta(path)["optimizer"]["flat_state"]
    assert state["exp_avg"] == {"bfloat16": "float32", "float32": "float32"}
    with safe_open(path / "optim-00001-of-00001.safetensors", "pt") as f:
        assert f.get_tensor("exp_avg/bfloat16").dtype == FP32
    other, other_opt = build(seed=1)
    checkpoint.load(path, other, optimizer=other_opt)
    for p, q in zip(fm.parameters(), other.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            got = other_opt.state[q][key]
            assert got.dtype == p.dtype and torch.equal(got, opt.state[p][key].to(p.dtype))


def test_adapters_alone_load_over_the_base_the_model_holds(tmp_path):
    """``frozen=False``: the model files hold the trainable weights alone, each in its dtype;
    a load keeps the frozen ones the model holds."""
    fm, opt = build(seed=0, freeze=True)
    train(fm, opt, range(2))
    path = checkpoint.save(tmp_path, fm, step=2, optimizer=opt, frozen=False)
    trains = {n for n, p in fm.module.named_parameters() if p.requires_grad}
    with safe_open(path / "model-00001-of-00001.safetensors", "pt") as f:
        assert set(f.keys()) == trains | {"scale", "mask"}
    other, other_opt = build(seed=1, freeze=True)
    base = {n: p.detach().clone() for n, p in other.module.named_parameters() if n not in trains}
    checkpoint.load(path, other, optimizer=other_opt)
    for (name, p), q in zip(other.module.named_parameters(), fm.module.parameters()):
        assert torch.equal(p, base.get(name, q)), name
    assert checkpoint.inspect_checkpoint(path).ok


def test_a_file_whose_range_holds_no_state_of_a_dtype(tmp_path):
    """State for the fp32 parameters alone: an optimizer file whose range holds bf16
    parameters only holds no tensor; it is written, verified and resharded as any other."""
    fm, _ = build(seed=0)
    opt = torch.optim.AdamW([p for p in fm.parameters() if p.dtype == FP32], lr=1e-2)
    train(fm, opt, range(2))
    path = checkpoint.save(tmp_path / "one", fm, step=2, optimizer=opt)
    assert read_meta(path)["optimizer"]["flat_state"]["exp_avg"] == {"float32": "float32"}
    resharded = checkpoint.reshard(path, tmp_path / "many", 6)
    empty = [f for f in resharded.glob("optim-*") if len(header(f)[1]) == 1]  # metadata only
    assert empty, "expected a range of bf16 parameters alone"
    assert checkpoint.inspect_checkpoint(resharded).ok
    direct, direct_opt = build(seed=1)
    direct_opt = torch.optim.AdamW([p for p in direct.parameters() if p.dtype == FP32], lr=1e-2)
    checkpoint.load(path, direct, optimizer=direct_opt)
    other, _ = build(seed=2)
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.dtype == FP32], lr=1e-2)
    checkpoint.load(resharded, other, optimizer=other_opt)
    assert not differences(other, other_opt, direct, direct_opt)


# -- what is refused ---------------------------------------------------------------------------
def test_a_checkpoint_of_other_dtypes_is_another_model(tmp_path):
    mixed, mixed_opt = build(seed=0)
    train(mixed, mixed_opt, range(1))
    path = checkpoint.save(tmp_path / "mixed", mixed, step=1, optimizer=mixed_opt)
    torch.manual_seed(0)
    fm = torchshard.FlatParamModule(Mixed(), dtype=FP32)  # the same model, all float32
    fm.bind(torch.empty(fm.numel))
    opt = torch.optim.AdamW(fm.parameters())
    message = refused(path, fm, opt)
    assert "parameter 'embed.weight': bfloat16 in the checkpoint, float32 in this model" in message
    single = checkpoint.save(tmp_path / "fp32", fm, step=1, optimizer=opt)
    other, other_opt = build(seed=1)  # a float32 checkpoint into the mixed model
    message = refused(single, other, other_opt)
    assert "parameter 'embed.weight': float32 in the checkpoint, bfloat16 in this model" in message


def test_a_mixed_layout_in_an_older_format_version_is_refused(saved):
    path, _ = saved
    meta = read_meta(path)
    meta["format_version"] = 3
    write_meta(path, meta)
    fm, opt = build(seed=1)
    message = refused(path, fm, opt)
    assert "format_version" in message and "several dtypes" in message, message


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda s: {**s, "exp_avg": "bfloat16"}, "optimizer.flat_state.exp_avg"),
        (lambda s: {**s, "exp_avg": {"float16": "float32"}}, "optimizer.flat_state.exp_avg"),
        (lambda s: {**s, "exp_avg": {}}, "optimizer.flat_state.exp_avg"),
        (
            lambda s: {**s, "exp_avg": {"bfloat16": "float99", "float32": "float32"}},
            "optimizer.flat_state.exp_avg.bfloat16",
        ),
    ],
    ids=["one dtype", "unknown parameter dtype", "empty", "unknown state dtype"],
)
def test_flat_state_of_a_mixed_layout_is_checked(saved, edit, where):
    path, _ = saved
    meta = read_meta(path)
    meta["optimizer"]["flat_state"] = edit(meta["optimizer"]["flat_state"])
    write_meta(path, meta)
    fm, opt = build(seed=1)
    message = refused(path, fm, opt)
    assert f"{where}:" in message, message


def test_a_slot_without_its_dtype_is_refused(saved):
    path, _ = saved
    meta = read_meta(path)
    meta["layout"]["slots"][0] = meta["layout"]["slots"][0][:6]
    write_meta(path, meta)
    fm, opt = build(seed=1)
    assert "layout.slots[0]" in refused(path, fm, opt)


# -- a transformers model -------------------------------------------------------------------------
def test_a_transformers_model_exports_for_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from models import tiny_hf_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")).to(BF16)
    for module in model.modules():
        if "norm" in type(module).__name__.lower():
            module.float()  # RMSNorm weights in float32, as mixed-precision training keeps them
    fm = torchshard.FlatParamModule(model)
    assert fm.dtypes == (BF16, FP32)
    fm.bind(torch.empty(fm.numel, dtype=fm.dtype))
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = checkpoint.save(tmp_path / "ckpt", fm, step=1)
    assert read_meta(path)["model_config"]["dtype"] == "bfloat16"  # as save_pretrained says
    out = tmp_path / "hf"
    checkpoint.consolidate(path, out)
    with safe_open(out / "model.safetensors", "pt") as f:
        names = f.keys()
        assert set(names) == set(want)
        for name in names:
            assert f.get_tensor(name).dtype == want[name].dtype, name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=FP32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, want[name].float()), name


# -- several ranks: replicated and shard=True --------------------------------------------------------
SAVE_AT, MORE = 3, 2  # steps before the save, and after it


def new_trainer(
    shard: bool | str, seed: int, frozen: bool = False, width: int = 160
) -> torchshard.DistributedTrainer:
    """The model (weights from ``seed``; ``frozen``: as :func:`build`'s) in a trainer, AdamW in
    two groups by name."""
    torch.manual_seed(seed)
    model = Mixed(d=width)
    if frozen:
        model.embed.requires_grad_(False)
        model.blocks[0].norm.requires_grad_(False)
    fm = torchshard.FlatParamModule(model)
    trainer = torchshard.DistributedTrainer(fm, shard=shard, bucket_mb=0.001)
    no_decay = [(lambda n: n.endswith("bias") or "norm" in n, {"weight_decay": 0.0})]
    trainer.make_optimizer(torch.optim.AdamW, groups=no_decay, lr=1e-2, weight_decay=0.1)
    return trainer


def train_ranks(trainer: torchshard.DistributedTrainer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + trainer.rank)
        trainer.zero_grad()
        trainer.module(torch.randn(5, 8, generator=g)).square().mean().backward()
        trainer.step()


def state_by_name(trainer: torchshard.DistributedTrainer) -> dict[str, torch.Tensor]:
    """Every parameter's weights (``name``), master (``name/master``: what the sharded
    optimizer updates) and optimizer state (``name/key``), whole, assembled from every
    rank's pieces: the same on every rank (a collective)."""
    fm, opt = trainer.module, trainer.optimizer
    assert opt is not None
    layout = fm.layout
    mine: dict[str, list] = {}  # name -> [(start, end, tensor)] in the parameter's elements
    for i, a, b, t in trainer.optimizer_segments():
        s = layout.slots[i]
        at = ((a - s.offset) // s.width, (b - s.offset) // s.width)
        if trainer.shard:
            mine.setdefault(f"{s.name}/master", []).append((*at, t.detach().reshape(-1)))
        for key, v in opt.state.get(t, {}).items():
            part = v.detach().reshape(-1) if v.dim() else v.detach().reshape(1)
            mine.setdefault(f"{s.name}/{key}", []).append((*at, part))
    every: list[dict] = [{} for _ in range(trainer.world_size)]
    dist.all_gather_object(every, mine if trainer.shard or trainer.rank == 0 else {})
    with trainer.gathered():  # shard="full": the weights exist inside this block only
        out = {n: p.detach().clone() for n, p in fm.module.named_parameters()}
    for name in sorted({n for d in every for n in d}):
        pieces = [p for d in every for p in d.get(name, [])]
        if pieces[0][2].numel() == 1 and name.endswith("/step"):  # a scalar: every piece's
            out[name] = pieces[0][2].clone()
            continue
        whole = torch.zeros(max(b for _, b, _ in pieces), dtype=pieces[0][2].dtype)
        for a, b, t in pieces:
            whole[a:b] = t
        out[name] = whole
    return out


def as_mode(state: dict[str, torch.Tensor], shard: bool) -> dict[str, torch.Tensor]:
    """A state saved in the other mode, as a load into ``shard``'s optimizer makes it: the
    replicated optimizer steps the parameters themselves (state in their dtype, as torch's
    load_state_dict casts it; no master), the sharded one an fp32 master of each (the
    weights, or the saved master of a bf16 parameter) with fp32 state."""
    names = {k for k in state if "/" not in k}
    out = {}
    for k, v in state.items():
        name, _, key = k.partition("/")
        if not key:
            out[k] = v
        elif key == "master" and not shard:
            continue
        elif key != "step":
            out[k] = v.to(FP32 if shard else state[name].dtype)
        else:
            out[k] = v
    if shard:
        for name in names:
            if f"{name}/exp_avg" in out:  # a trained parameter: its master
                out.setdefault(f"{name}/master", state[name].float())
    return out


def differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if got.keys() != want.keys():
        return [f"keys: {sorted(got.keys() ^ want.keys())}"]
    return [
        k
        for k in sorted(got)
        if got[k].dtype != want[k].dtype or not torch.equal(got[k].reshape(-1), want[k].reshape(-1))
    ]


def _save_at_2(root: str, expected: str, shard: bool, frozen: bool) -> None:
    """Save at step 3, then go on to step 5: the uninterrupted run."""
    trainer = new_trainer(shard, seed=0, frozen=frozen)
    train_ranks(trainer, range(SAVE_AT))
    checkpoint.save(root, trainer, step=SAVE_AT, optimizer=trainer.optimizer)
    saved = state_by_name(trainer)
    train_ranks(trainer, range(SAVE_AT, SAVE_AT + MORE))
    final = state_by_name(trainer)
    if trainer.rank == 0:
        torch.save({"saved": saved, "final": final}, expected)
    trainer.close()


def _resume(root: str, expected: str, saved_shard: bool, shard: bool, frozen: bool) -> dict:
    trainer = new_trainer(shard, seed=1, frozen=frozen)  # other weights
    train_ranks(trainer, range(10, 11))  # and state
    info = checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    want = torch.load(expected, weights_only=True)
    got = state_by_name(trainer)
    out = {"step": info.step, "read": info.bytes_read}
    out["after_load"] = differ(got, as_mode(want["saved"], shard))
    train_ranks(trainer, range(SAVE_AT, SAVE_AT + MORE))
    trainer.assert_in_sync()
    if shard == saved_shard and trainer.world_size == 2:  # the uninterrupted run's
        out["continued"] = differ(state_by_name(trainer), want["final"])
    trainer.close()
    return out


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory) -> dict[tuple[bool, bool], tuple[str, str]]:
    """Checkpoints saved at 2 ranks, replicated (False) and sharded (True), with and without
    frozen parameters, and what they hold; made on first use."""
    from multiprocess import run_distributed

    made: dict[tuple[bool, bool], tuple[str, str]] = {}

    def get(shard: bool, frozen: bool) -> tuple[str, str]:
        if (shard, frozen) not in made:
            tmp = tmp_path_factory.mktemp(f"mixed-{shard}-{frozen}")
            root, expected = str(tmp / "ckpt"), str(tmp / "expected.pt")
            run_distributed(_save_at_2, 2, root, expected, shard, frozen, timeout=180)
            made[shard, frozen] = root, expected
        return made[shard, frozen]

    return get


MODE = {False: "replicated", True: "sharded", "full": "full"}
RESUMES = [  # (saved mode, loaded mode, at world, some parameters frozen)
    *((False, False, w, False) for w in (2, 1, 3)),
    *((False, True, w, False) for w in (2, 3)),
    *((True, True, w, False) for w in (2, 1, 3)),
    *((True, False, w, False) for w in (2, 3)),
    (True, True, 2, True),
    (True, True, 3, True),
    (True, False, 1, True),
    (False, True, 3, True),
    # the fully sharded mode: its stripes exchanged to and from the files' ranges
    *(("full", "full", w, False) for w in (2, 3)),
    ("full", False, 1, False),
    ("full", True, 3, False),
    (False, "full", 3, False),
    (True, "full", 2, False),
    ("full", "full", 2, True),
    ("full", True, 2, True),
    (True, "full", 3, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_shard", "shard", "world", "frozen"),
    [
        pytest.param(*c, id=f"{MODE[c[0]]}-to-{MODE[c[1]]}-at-{c[2]}" + "-frozen" * c[3])
        for c in RESUMES
    ],
)
def test_saved_at_2_resumes_bitwise(saved_at_2, saved_shard, shard, world, frozen):
    """Saved replicated or sharded at 2 ranks; loaded at 1, 2 or 3, in either mode: bitwise
    the saved weights, masters and state (cast as the other mode keeps them); at 2 in the
    same mode the run goes on as the uninterrupted one."""
    from multiprocess import run_distributed

    root, expected = saved_at_2(saved_shard, frozen)
    args = (root, expected, saved_shard, shard, frozen)
    results = run_distributed(_resume, world, *args, timeout=180)
    files = sorted(Path(root).glob("step-*/*.safetensors"))
    for rank, r in enumerate(results):
        assert r["step"] == SAVE_AT
        assert not r["after_load"], f"rank {rank}: differs from the saved state: {r['after_load']}"
        if "continued" in r:
            assert not r["continued"], f"rank {rank}: the continuation differs: {r['continued']}"
    # each byte the load needs read about once by all ranks together, not once per rank: at
    # most the two chunks (verified whole) at the ends of each rank's part of each tensor
    # more (the weights of a model file are one part, back to back)
    need, ends = 0, 0
    for f in files:
        _, head = header(f)
        chunk = int(head.pop("__metadata__")["torchshard.chunk_bytes"])
        masters = [e for n, e in head.items() if n.startswith("master/")]
        unread = 0 if shard else sum(b - a for a, b in (e["data_offsets"] for e in masters))
        need += f.stat().st_size - unread
        parts = 1 if f.name.startswith("model") else len(head) - (0 if shard else len(masters))
        ends += 2 * chunk * world * parts
    total = sum(r["read"] for r in results)
    assert 0.97 * need <= total <= need + ends, (world, total, need, ends)


def _save_adapters_alone(root: str, expected: str, shard: bool | str) -> None:
    trainer = new_trainer(shard, seed=0, frozen=True)
    train_ranks(trainer, range(2))
    checkpoint.save(root, trainer, step=2, optimizer=trainer.optimizer, frozen=False)
    saved = state_by_name(trainer)
    if trainer.rank == 0:
        torch.save(saved, expected)
    trainer.close()


def _load_over_own_base(root: str, expected: str, shard: bool | str) -> list[str]:
    trainer = new_trainer(shard, seed=1, frozen=True)  # another base
    with trainer.gathered():
        base = {n: p.detach().clone() for n, p in trainer.module.module.named_parameters()}
    checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    got, saved = state_by_name(trainer), torch.load(expected, weights_only=True)
    trains = {n for n, p in trainer.module.module.named_parameters() if p.requires_grad}
    wrong = [n for n in base if not torch.equal(got[n], saved[n] if n in trains else base[n])]
    trainer.close()
    return wrong


@pytest.mark.parametrize(
    ("saved", "loaded"), [("full", "full"), (True, "full"), ("full", False)],
    ids=["full2-to-full3", "sharded2-to-full3", "full2-to-replicated3"],
)  # fmt: skip
def test_adapters_alone_resume_over_the_base_in_the_fully_sharded_mode(tmp_path, saved, loaded):
    """``frozen=False`` from or into the stripes of a fully sharded trainer: the trainable
    weights come back, each in its dtype; the frozen ones stay the model's own."""
    from multiprocess import run_distributed

    root, expected = str(tmp_path / "ckpt"), str(tmp_path / "saved.pt")
    run_distributed(_save_adapters_alone, 2, root, expected, saved, timeout=120)
    assert run_distributed(_load_over_own_base, 3, root, expected, loaded, timeout=120) == [[]] * 3
