"""Frozen parameters cost no gradient, bucket, reduction, optimizer state or master copy
(issue 21): the gradient lives in the trainable slots' own space (``layout.grad_layout``).

The model is LoRA's shape: frozen linears (and a frozen input layer and head) with rank-4
adapters and a trainable norm between them, so frozen and trainable parameters alternate in
the flat buffer. The oracle is torch DDP on the same model: bitwise at 2 ranks in all three
modes, within 1e-5 relative per tensor at 3; the frozen weights stay bitwise what they were;
each rank's gradient bytes are the trainable elements' (at most 1.01x: alignment and padding).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import Cases
from multiprocess import run_distributed
from sharded_harness import differences, flat_state
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatLayout, FlatParamModule, LayoutError, checkpoint

MODES = [False, True, "full"]
MODE_IDS = ["replicated", "sharded", "full"]


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update, as PEFT's LoRA layer computes it."""

    def __init__(self, d_in: int, d_out: int, r: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(d_in, r, bias=False)
        self.lora_B = nn.Linear(r, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


class LoRANet(nn.Module):
    def __init__(self, width: int = 48, n: int = 3, r: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(
            # pre-norm, as a transformer block: the block's input is used twice in all (the
            # norm, the residual), so the fully sharded mode's hook on it sums its gradient
            # in DDP's order (three uses would round otherwise, as under FSDP2)
            nn.Sequential(nn.LayerNorm(width), LoRALinear(width, width, r), nn.GELU())
            for _ in range(n)
        )
        self.head = nn.Linear(width, 1)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)


def trainable_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# -- one process -----------------------------------------------------------------------------
def test_the_gradient_holds_the_trainable_parameters_alone():
    torch.manual_seed(0)
    ref = LoRANet()
    fm = FlatParamModule(copy.deepcopy(ref))
    fm.bind(torch.empty(fm.numel))
    fm.load_state_dict(ref.state_dict())
    grads = fm.layout.grad_layout
    assert [s.name for s in grads] == [n for n, p in ref.named_parameters() if p.requires_grad]
    assert fm.flat_grad is not None and fm.flat_grad.numel() == fm.grad_numel == grads.numel
    assert fm.grad_numel * 4 == trainable_bytes(ref)  # no padding between these fp32 shapes
    assert fm.grad_numel * 6 < fm.numel  # LoRA: most of the model is frozen
    x, y = data(0, 0)
    F.mse_loss(fm(x), y).backward()
    F.mse_loss(ref(x), y).backward()
    for (name, p), q in zip(fm.module.named_parameters(), ref.parameters()):
        if q.requires_grad:
            s = grads[name]
            assert p.grad.data_ptr() == fm.flat_grad[s.offset :].data_ptr(), name
            assert torch.equal(p.grad, q.grad), name
        else:
            assert p.grad is None, name


def test_trainable_runs_map_the_flat_buffer_onto_the_gradient():
    layout = FlatLayout.from_module(LoRANet())
    grads = layout.grad_layout
    runs = layout.trainable_runs()
    covered = 0
    for a, b, c in runs:
        for k, i in enumerate(layout.trainable):
            s = layout.slots[i]
            if a <= s.offset < b:
                assert grads.slots[k].offset == c + s.offset - a, s.name
                covered += 1
    assert covered == len(layout.trainable)
    assert FlatLayout.from_module(nn.Linear(4, 3)).grad_layout == FlatLayout.from_module(
        nn.Linear(4, 3)
    )


def test_a_layout_without_frozen_parameters_is_its_own_gradient_layout():
    layout = FlatLayout.from_module(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    assert layout.grad_layout is layout
    assert layout.trainable_runs() == [(0, layout.slots[-1].end, 0)]


# -- several ranks, against DDP ----------------------------------------------------------------
def frozen_first() -> LoRANet:
    """Only the input layer frozen (a frozen embedding or encoder): the trainable slots are
    the layout's last ones, and a sharded optimizer slices the flat buffer in place."""
    net = LoRANet()
    net.requires_grad_(True)
    net.embed.requires_grad_(False)
    return net


def _lora_vs_ddp(shard: bool | str, model: str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = LoRANet() if model == "lora" else frozen_first()
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    fm = FlatParamModule(copy.deepcopy(ref), align_bytes=4)
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.002)
    opt = trainer.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    for step in range(4):
        x, y = data(rank, step)
        trainer.zero_grad()
        F.mse_loss(fm(x), y).backward()
        trainer.step()
        ref_opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        ref_opt.step()
    stats = trainer.memory_stats()
    with trainer.gathered():
        got = {n: p.detach().clone() for n, p in fm.module.named_parameters()}
    trainer.close()
    want = dict(ref.named_parameters())
    return {
        "bitwise": [n for n in got if not torch.equal(got[n], want[n])],
        "relative": max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in got),
        "frozen_changed": [n for n in frozen if not torch.equal(got[n], frozen[n])],
        "gradients": stats.gradients,
        "optimizer": stats.optimizer,
        "master": stats.master,
        "trainable": trainable_bytes(ref),
        "state_tensors": len(opt.state),
    }


PARITY = Cases(_lora_vs_ddp, params=["shard", "model"], timeout=120)


@pytest.mark.parametrize("world_size", PARITY.world_sizes(2, 3, cases=6))
@pytest.mark.parametrize("model", ["lora", "frozen-first"])
@pytest.mark.parametrize("shard", MODES, ids=MODE_IDS)
def test_lora_trains_like_ddp_with_gradients_for_the_adapters_only(
    request, shard, model, world_size
):
    ranks = PARITY.results(request)
    for r in ranks:
        assert r["frozen_changed"] == [], r
        if world_size == 2:
            assert r["bitwise"] == [], r
        else:
            assert r["relative"] < 1e-5, r
    trainable = ranks[0]["trainable"]
    # AdamW keeps two fp32 tensors per trainable element (and a step per piece): nothing
    # for the frozen ones, in any mode
    opt_elements = sum(r["optimizer"] for r in ranks) if shard else ranks[0]["optimizer"]
    assert 2 * trainable <= opt_elements <= 2.02 * trainable + 4 * 64 * world_size
    if shard == "full":  # each rank holds the gradients of its stripes' trainable parts
        assert sum(r["gradients"] for r in ranks) == trainable
    else:  # each rank holds the whole (padded) gradient of the trainable parameters
        for r in ranks:
            assert trainable <= r["gradients"] <= 1.01 * trainable, r
    # shard=True slices a copy of the trainable weights when frozen ones lie between them,
    # the flat buffer itself when they all come first (fp32: no master either)
    for r in ranks:
        if shard is True and model == "lora":
            assert trainable <= r["master"] <= 1.01 * trainable, r
        else:
            assert r["master"] == 0, r


# -- a bf16 model: no master copy of a frozen weight -----------------------------------------------
def _bf16_lora(shard: bool | str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = LoRANet(width=64).to(torch.bfloat16)
    frozen = {n: p.detach().clone() for n, p in net.named_parameters() if not p.requires_grad}
    fm = FlatParamModule(net)
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.002)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x, y = data(rank, step)
        trainer.zero_grad()
        F.mse_loss(fm(x.bfloat16()).float(), y).backward()
        trainer.step()
    stats = trainer.memory_stats()
    with trainer.gathered():
        got = {n: p.detach().clone() for n, p in fm.module.named_parameters()}
    trainer.close()
    return {
        "weights": got,
        "frozen_changed": [n for n in frozen if not torch.equal(got[n], frozen[n])],
        "stats": stats,
        "frozen": sum(p.numel() for p in frozen.values()),
        "trainable": sum(p.numel() for p in net.parameters() if p.requires_grad),
    }


def test_a_bf16_lora_fully_sharded_keeps_its_frozen_weights_in_bf16():
    """shard="full" holds what trains in an fp32 master (and its gradient) and every frozen
    weight in bf16 only, as shard=True does: 2 bytes per frozen element, not an fp32 stripe;
    and it trains bitwise as shard=True (the same fp32 masters, the same bf16 sums)."""
    full = run_distributed(_bf16_lora, 2, "full", timeout=120)
    sharded = run_distributed(_bf16_lora, 2, True, timeout=120)
    for f, s in zip(full, sharded):
        assert f["frozen_changed"] == [] and s["frozen_changed"] == []
        assert [n for n in f["weights"] if not torch.equal(f["weights"][n], s["weights"][n])] == []
    frozen, trainable = full[0]["frozen"], full[0]["trainable"]
    stats = [r["stats"] for r in full]
    # the frozen weights, in bf16, once over the ranks (plus the padding of the units' stripes)
    held = sum(st.parameters for st in stats)
    assert 2 * frozen <= held <= 1.05 * 2 * frozen, (held, frozen)
    # an fp32 master and its gradient of the trainable elements alone (alignment aside)
    master = sum(st.master for st in stats)
    assert 8 * trainable <= master <= 1.01 * 8 * trainable, (master, trainable)
    assert sum(st.gradients for st in stats) == 0  # the master's gradient holds them


# -- checkpoints -------------------------------------------------------------------------------
def _net(model: str) -> nn.Module:
    if model == "bf16":  # the LoRA model in bf16: fp32 masters of what trains alone
        return LoRANet().to(torch.bfloat16)
    return LoRANet() if model == "lora" else frozen_first()


def _lora_save(
    root: str, shard: bool | str, snapshot: str, frozen: bool = True, model: str = "lora"
) -> None:
    torch.manual_seed(0)
    fm = FlatParamModule(_net(model))
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.002)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    dtype = fm.dtype
    for step in range(3):
        x, y = data(dist.get_rank(), step)
        trainer.zero_grad()
        F.mse_loss(fm(x.to(dtype)).float(), y).backward()
        trainer.step()
    checkpoint.save(root, trainer, step=3, optimizer=trainer.optimizer, frozen=frozen)
    state = flat_state(trainer)
    if dist.get_rank() == 0:
        torch.save(state, snapshot)
    trainer.close()


def _lora_load(root: str, shard: bool | str, snapshot: str, model: str = "lora") -> list[str]:
    torch.manual_seed(1)  # other weights: the load must bring every one back
    return _loaded_differences(_net(model), root, shard, snapshot)


def _loaded_differences(net: nn.Module, root: str, shard: bool | str, snapshot: str) -> list[str]:
    """Load ``root`` into a trainer of ``net``: what differs from the saved ``snapshot``."""
    fm = FlatParamModule(net)
    trainer = DistributedTrainer(fm, shard=shard, bucket_mb=0.002)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    got = flat_state(trainer)
    trainer.close()
    return differences(got, torch.load(snapshot, weights_only=True))


@pytest.mark.parametrize(
    ("save", "load", "model"),
    [
        ((2, True), (3, True), "lora"),
        ((3, "full"), (2, False), "lora"),
        ((2, False), (3, "full"), "lora"),
        ((2, True), (3, True), "frozen-first"),
        ((2, "full"), (3, "full"), "bf16"),
        ((3, "full"), (2, True), "bf16"),
        ((2, True), (3, "full"), "bf16"),
    ],
    ids=[
        "sharded2-to-sharded3",
        "full3-to-replicated2",
        "replicated2-to-full3",
        "frozen-first-sharded2-to-sharded3",
        "bf16-full2-to-full3",
        "bf16-full3-to-sharded2",
        "bf16-sharded2-to-full3",
    ],
)
def test_a_lora_checkpoint_resumes_bitwise_at_another_world_size_and_mode(
    tmp_path, save, load, model
):
    root, snapshot = str(tmp_path / "ckpt"), str(tmp_path / "state.pt")
    run_distributed(_lora_save, save[0], root, save[1], snapshot, True, model, timeout=120)
    for r in run_distributed(_lora_load, load[0], root, load[1], snapshot, model, timeout=120):
        assert r == [], r


# -- requires_grad after wrapping -----------------------------------------------------------------
def test_a_parameter_unfrozen_after_wrapping_is_named():
    model = LoRANet()
    fm = FlatParamModule(model)
    trainer = DistributedTrainer(fm)
    model.head.weight.requires_grad_(True)  # after the layout was made: no gradient room
    F.mse_loss(fm(data(0, 0)[0]), data(0, 0)[1]).backward()
    with pytest.raises(LayoutError, match=r"head\.weight: requires_grad changed after"):
        trainer.average_gradients()
    trainer.close()


def _lora_trainer(seed: int) -> tuple[FlatParamModule, DistributedTrainer]:
    torch.manual_seed(seed)
    fm = FlatParamModule(LoRANet(width=96))
    trainer = DistributedTrainer(fm, shard=True)
    trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)
    return fm, trainer


def test_a_lora_checkpoint_stores_optimizer_state_for_the_adapters_alone(tmp_path, monkeypatch):
    import json

    from torchshard.checkpoint import _format

    fm, trainer = _lora_trainer(0)
    for step in range(2):
        trainer.zero_grad()
        F.mse_loss(fm(data(0, step)[0]), data(0, step)[1]).backward()
        trainer.step()
    path = checkpoint.save(tmp_path / "new", trainer, step=2, optimizer=trainer.optimizer)
    meta = json.loads((path / "metadata.json").read_text().rsplit("\n", 1)[0])
    assert meta["format_version"] == 3 and meta["optimizer"]["stored"] == "trainable"
    state = sum(f.stat().st_size for f in path.glob("optim-*.safetensors"))
    adam = 2 * trainable_bytes(fm.module)  # exp_avg, exp_avg_sq
    assert adam <= state <= 1.05 * adam, (state, adam)
    # last week's writer stored zeros for the frozen parameters: such a checkpoint still loads
    monkeypatch.setattr(_format, "trainable_only", lambda layout: False)
    monkeypatch.setattr(checkpoint._plan, "trainable_only", lambda layout: False)
    old = checkpoint.save(tmp_path / "old", trainer, step=2, optimizer=trainer.optimizer)
    monkeypatch.undo()
    assert sum(f.stat().st_size for f in old.glob("optim-*.safetensors")) > 10 * state
    want = flat_state(trainer)
    trainer.close()
    # resharded offline to 3 ranks, each form keeps its own storage
    again = [checkpoint.reshard(p, tmp_path / f"re-{p.parent.name}", 3) for p in (path, old)]
    for p, q in zip((path, old), again):
        assert json.loads((q / "metadata.json").read_text().rsplit("\n", 1)[0]).get(
            "format_version"
        ) == (3 if p == path else 2)
    for root in (path, old, *again):
        _, other = _lora_trainer(1)
        checkpoint.load(root, other, optimizer=other.optimizer)
        assert differences(flat_state(other), want) == [], root
        other.close()


# -- a checkpoint of the adapters alone ----------------------------------------------------------
def _adapters_load(root: str, shard: bool | str, snapshot: str, model: str = "lora") -> list[str]:
    torch.manual_seed(0)  # the same base: as if loaded from its pretrained weights
    model = _net(model)
    with torch.no_grad():  # adapters and norms elsewhere: the load must bring them back
        for p in model.parameters():
            if p.requires_grad:
                p.uniform_(-1, 1)
    return _loaded_differences(model, root, shard, snapshot)


@pytest.mark.parametrize(
    ("save", "load", "model"),
    [
        ((2, True), (3, "full"), "lora"),
        ((3, "full"), (2, False), "lora"),
        ((2, "full"), (3, "full"), "bf16"),
    ],
    ids=["sharded2-to-full3", "full3-to-replicated2", "bf16-full2-to-full3"],
)
def test_a_checkpoint_of_the_adapters_alone_resumes_over_the_base(tmp_path, save, load, model):
    root, snapshot = str(tmp_path / "ckpt"), str(tmp_path / "state.pt")
    run_distributed(_lora_save, save[0], root, save[1], snapshot, False, model, timeout=120)
    (path,) = (tmp_path / "ckpt").glob("step-*")
    weights = sum(f.stat().st_size for f in path.glob("model-*.safetensors"))
    state = sum(f.stat().st_size for f in path.glob("optim-*.safetensors"))
    adapters = trainable_bytes(LoRANet())  # fp32: a bf16 model's masters and state are
    # the adapters (and the trainable norms), their AdamW state; headers aside
    assert weights + state <= 1.05 * 3 * adapters + 4096 * save[0], (weights, state, adapters)
    args = (root, load[1], snapshot, model)
    for r in run_distributed(_adapters_load, load[0], *args, timeout=120):
        assert r == [], r
    with pytest.raises(checkpoint.CheckpointError, match="saved with frozen=False"):
        checkpoint.consolidate(path, tmp_path / "model.safetensors")


def test_a_reshard_of_the_adapters_alone_keeps_its_format_version(tmp_path):
    """A ``frozen=False`` checkpoint without optimizer state is version 3 (its model files
    leave frozen weights out), and so is its offline reshard: a reader of version 2 would
    take the missing base for a corrupt checkpoint, not for one that leaves it out."""
    import json

    torch.manual_seed(0)
    fm = FlatParamModule(LoRANet())
    fm.bind(torch.empty(fm.numel))
    fm.init_weights()
    path = checkpoint.save(tmp_path / "ckpt", fm, step=1, frozen=False)
    again = checkpoint.reshard(path, tmp_path / "re", 2)
    for p in (path, again):
        meta = json.loads((p / "metadata.json").read_text())
        assert meta["format_version"] == 3 and meta["weights"]["frozen"] is False, p
