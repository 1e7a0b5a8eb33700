"""FSDP-lite: sharded optimizer state and gradients, against the replicated trainer and DDP."""

from __future__ import annotations

import copy

import introspect
import pytest
import torch
import torch.distributed as dist
from cases import Cases
from multiprocess import run_distributed
from sharded_harness import CFG, KW, Model, batch, no_decay, torch_groups
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule


def _sharded_vs_replicated_vs_ddp(steps: int = 10, clip: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Model()
    models = {name: copy.deepcopy(ref) for name in ("sharded", "replicated")}
    trainers, opts = {}, {}
    for name, model in models.items():
        fm = FlatParamModule(model, align_bytes=4)  # no padding between parameters
        trainers[name] = DistributedTrainer(fm, shard=name == "sharded", bucket_mb=0.002)
        opts[name] = trainers[name].make_optimizer(
            torch.optim.AdamW, groups=[(no_decay, {"weight_decay": 0.0})], **KW
        )
    ddp = DDP(ref)
    ddp_opt = torch.optim.AdamW(torch_groups(ref), **KW)
    worst = 0.0
    for step in range(steps):
        for t in trainers.values():
            t.zero_grad()
            t.module(*batch(rank, step))[1].backward()
            if clip:
                t.clip_grad_norm_(0.5)
            t.step()
        ddp_opt.zero_grad()
        ddp(*batch(rank, step))[1].backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ddp_opt.step()
        for (n, p), q, r in zip(
            models["sharded"].named_parameters(),
            models["replicated"].parameters(),
            ref.parameters(),
        ):
            if world == 2 and not clip:
                assert torch.equal(p, q), f"step {step}: {n}: sharded vs replicated"
                assert torch.equal(p, r), f"step {step}: {n}: sharded vs DDP"
            torch.testing.assert_close(
                p, q, rtol=1e-5, atol=1e-6, msg=f"step {step} {n} vs replicated"
            )
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=f"step {step} {n} vs DDP")
            worst = max(worst, (p - r).abs().max().item())
    trainers["sharded"].assert_in_sync()
    mem = {name: t.memory_bytes() for name, t in trainers.items()}
    pieces = {name: len(t.optimizer_segments()) for name, t in trainers.items()}
    numel = trainers["sharded"].module.layout.numel
    padded = trainers["sharded"].padded_numel
    for t in trainers.values():
        t.close()
    return {"worst": worst, "mem": mem, "numel": numel, "padded": padded, "pieces": pieces}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_training_equals_replicated_and_ddp(world_size):
    results = run_distributed(_sharded_vs_replicated_vs_ddp, world_size, timeout=180)
    numel = results[0]["numel"]
    padded = results[0]["padded"]
    assert numel % world_size != 0 and padded % world_size == 0 and padded - numel < 4 * world_size
    replicated = results[0]["mem"]["replicated"]["optimizer"]
    shards = [r["mem"]["sharded"]["optimizer"] for r in results]
    # Every trainable element's AdamW state (8 bytes) lives on exactly one rank; a parameter
    # split between two slices has one more 4-byte `step` counter.
    extra_pieces = sum(r["pieces"]["sharded"] for r in results) - results[0]["pieces"]["replicated"]
    assert 0 < extra_pieces < world_size
    assert sum(shards) == replicated + 4 * extra_pieces
    # ... and no rank holds more than its slice of the padded buffer (plus its `step`s).
    for r in results:
        elementwise = r["mem"]["sharded"]["optimizer"] - 4 * r["pieces"]["sharded"]
        assert elementwise <= 8 * padded // world_size
        assert elementwise >= 8 * (padded // world_size - (padded - numel))


def test_global_norm_clipping_matches_torch():
    # Clipping rounds differently (per-slice norms, then one all-reduce), hence tolerances.
    results = run_distributed(_sharded_vs_replicated_vs_ddp, 3, 10, True, timeout=180)
    assert all(r["worst"] < 1e-5 for r in results)


# -- checkpoints across modes and world sizes -------------------------------------------------
def flat_state(trainer: DistributedTrainer) -> dict[str, torch.Tensor]:
    """Weights and optimizer state laid out like the flat buffer, the same on every rank."""
    fm, opt = trainer.module, trainer.optimizer
    n = fm.layout.numel
    out = {"weights": fm.flat_param[:n].clone()}
    keys: dict[str, torch.Tensor] = {}
    mine = trainer.rank == 0 or trainer.shard  # replicated: every rank holds everything
    for slot, a, b, t in trainer.optimizer_segments():
        for k, v in opt.state.get(t, {}).items():
            lo, hi = a, b
            if v.dim() == 0:  # Adam's step: one per slot
                k, v, lo, hi = f"{k}/slot", v.reshape(1), slot, slot + 1
                keys.setdefault(k, torch.zeros(len(fm.layout), dtype=v.dtype))
            else:
                keys.setdefault(k, torch.zeros(n, dtype=v.dtype))
            if mine:
                keys[k][lo:hi] = v.reshape(-1)
    for k in sorted(keys):
        if k.endswith("/slot"):  # pieces of a slot share the value: take the max
            dist.all_reduce(keys[k], op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(keys[k])  # each element comes from exactly one rank
        out[k] = keys[k]
    return out


def new_trainer(shard: bool) -> DistributedTrainer:
    torch.manual_seed(0)
    trainer = DistributedTrainer(FlatParamModule(Model(), align_bytes=4), shard=shard)
    trainer.make_optimizer(torch.optim.AdamW, groups=[(no_decay, {"weight_decay": 0.0})], **KW)
    return trainer


def train(trainer: DistributedTrainer, steps: range) -> None:
    for step in steps:
        trainer.zero_grad()
        trainer.module(*batch(trainer.rank, step))[1].backward()
        trainer.step()


def _save_sharded_at_4(root: str, expected: str) -> None:
    from torchshard import checkpoint

    trainer = new_trainer(shard=True)
    train(trainer, range(3))
    checkpoint.save(root, trainer, step=3, optimizer=trainer.optimizer)
    state = flat_state(trainer)
    train(trainer, range(3, 6))  # the uninterrupted run goes on
    state["final"] = trainer.module.flat_param[: trainer.module.layout.numel].clone()
    if trainer.rank == 0:
        torch.save(state, expected)
    trainer.close()


def _resume(root: str, expected: str, shard: bool) -> None:
    from torchshard import checkpoint

    trainer = new_trainer(shard=shard)
    info = checkpoint.load(root, trainer, optimizer=trainer.optimizer)
    assert info.step == 3
    want = torch.load(expected, weights_only=True)
    got = flat_state(trainer)
    assert got.keys() == want.keys() - {"final"}, (got.keys(), want.keys())
    for k, v in got.items():
        assert torch.equal(v, want[k]), f"{k} differs after loading"
    train(trainer, range(3, 6))
    trainer.assert_in_sync()
    if shard and trainer.world_size == 4:  # the same run as the uninterrupted one: bitwise
        assert torch.equal(trainer.module.flat_param[: trainer.module.layout.numel], want["final"])
    trainer.close()


@pytest.mark.slow
def test_sharded_checkpoint_resumes_in_either_mode_at_any_world_size(tmp_path):
    root, expected = str(tmp_path / "ckpt"), str(tmp_path / "expected.pt")
    run_distributed(_save_sharded_at_4, 4, root, expected, timeout=180)
    run_distributed(_resume, 2, root, expected, False, timeout=180)  # replicated at 2
    run_distributed(_resume, 3, root, expected, True, timeout=180)  # sharded at 3
    run_distributed(_resume, 4, root, expected, True, timeout=180)  # as if never stopped


# -- mixed precision ----------------------------------------------------------------------------
def pattern_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable data: arithmetic sequences mod the vocabulary, random starts and strides."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    start = torch.randint(0, CFG.vocab_size, (8, 1), generator=g)
    stride = torch.randint(1, 4, (8, 1), generator=g)
    idx = (start + stride * torch.arange(CFG.block_size + 1)) % CFG.vocab_size
    return idx[:, :-1], idx[:, 1:]


def _loss_curve(dtype: torch.dtype, steps: int) -> dict:
    torch.manual_seed(0)
    fm = FlatParamModule(Model(), dtype=dtype)
    trainer = DistributedTrainer(fm, shard=True)
    opt = trainer.make_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.0)
    # The oracle: a plain fp32 AdamW over copies of the tensors the trainer's optimizer steps
    # (the rank's slice of the master in bf16, of the buffer in fp32), fed each step the same
    # gradients; the trainer's master must follow it bitwise, and the bf16 buffer must hold
    # the master rounded to bf16.
    segments = trainer.optimizer_segments()
    ref_params = {id(t): torch.nn.Parameter(t.detach().clone()) for *_, t in segments}
    ref = torch.optim.AdamW(
        [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [ref_params[id(p)] for p in g["params"]],
            }
            for g in opt.param_groups
            if all(id(p) in ref_params for p in g["params"])
        ]
    )
    assert sum(len(g["params"]) for g in ref.param_groups) == len(segments) > 0
    flat = fm.flat_param
    checks = {"master_dtypes": set(), "grad_dtypes": set(), "master_vs_ref": 0.0}
    checks |= {"slice_vs_master": 0.0, "steps_with_extra_bits": 0, "steps_master_moved": 0}
    losses = []
    for step in range(steps):
        trainer.zero_grad()
        loss = fm(*pattern_batch(trainer.rank, step))[1]
        loss.backward()
        trainer.clip_grad_norm_(1.0)
        before = {id(t): t.detach().clone() for *_, t in segments}
        for *_, t in segments:
            checks["grad_dtypes"].add(str(t.grad.dtype))
            ref_params[id(t)].grad = t.grad.detach().clone()  # the clipped, averaged gradient
        trainer.step()
        ref.step()
        extra_bits = moved = False
        for _, a, b, t in segments:
            checks["master_dtypes"].add(str(t.dtype))
            diff = (t.detach() - ref_params[id(t)].detach()).abs().max().item()
            checks["master_vs_ref"] = max(checks["master_vs_ref"], diff)
            rounded = t.detach().to(flat.dtype)
            diff = (flat[a:b].float() - rounded.float()).abs().max().item()
            checks["slice_vs_master"] = max(checks["slice_vs_master"], diff)
            extra_bits |= bool((t.detach() != rounded.to(t.dtype)).any())
            moved |= bool((t.detach() != before[id(t)]).any())
        checks["steps_with_extra_bits"] += extra_bits
        checks["steps_master_moved"] += moved
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / trainer.world_size)
    mem = trainer.memory_bytes()
    master = introspect.master_slice(trainer)
    out = {
        "losses": losses,
        "checks": checks,
        "mem": mem,
        "master_dtype": None if master is None else str(master.dtype),
        "flat_dtype": str(fm.flat_param.dtype),
        "padded": trainer.padded_numel,
    }
    trainer.close()
    return out


@pytest.mark.slow
def test_bf16_with_fp32_master_follows_the_fp32_loss_curve():
    steps = 60
    fp32 = run_distributed(_loss_curve, 2, torch.float32, steps, timeout=180)[0]
    bf16 = run_distributed(_loss_curve, 2, torch.bfloat16, steps, timeout=180)[0]
    assert bf16["flat_dtype"] == "torch.bfloat16" and bf16["master_dtype"] == "torch.float32"
    assert fp32["master_dtype"] is None
    # The master is what the optimizer steps, and it is used: every step it follows a plain
    # fp32 AdamW fed the same (bf16-reduced, fp32-clipped) gradients bitwise, it moves, it
    # holds bits bf16 cannot (it is not a bf16 tensor in fp32 clothes), and the bf16 buffer
    # holds exactly the master rounded to bf16. A trainer that stepped the bf16 slice
    # directly, never copied the master back, or lost the master's low bits fails here.
    c = bf16["checks"]
    assert c["master_dtypes"] == {"torch.float32"} and c["grad_dtypes"] == {"torch.float32"}, c
    assert c["master_vs_ref"] == 0.0, c
    assert c["slice_vs_master"] == 0.0, c
    assert c["steps_master_moved"] == steps, c
    assert c["steps_with_extra_bits"] == steps, c
    # fp32: the optimizer steps the buffer itself, the same oracle holds, no extra bits
    c = fp32["checks"]
    assert c["master_vs_ref"] == 0.0 and c["slice_vs_master"] == 0.0, c
    assert c["steps_with_extra_bits"] == 0 and c["steps_master_moved"] == steps, c
    a, b = torch.tensor(fp32["losses"]), torch.tensor(bf16["losses"])
    assert a[-10:].mean() < 0.5 * a[:5].mean()  # the task is learnt
    # bf16 keeps 8 bits of mantissa (relative rounding 2**-9 = 0.2%); forward and backward in
    # bf16 perturb every step's loss by about a percent, and the trajectories drift apart
    # slowly. The curves must stay within 5% of each other at every step, and the final
    # losses within 5%, while the loss itself falls by more than half.
    assert torch.all((a - b).abs() <= 0.05 * a), (a - b).abs().max()
    # Memory per rank: the bf16 buffers take 2 bytes per element; the fp32 master slice and
    # its gradient 8 bytes per element of the rank's slice; AdamW's state is fp32 either way.
    n16, n32 = bf16["padded"], fp32["padded"]
    assert bf16["mem"]["parameters"] == bf16["mem"]["gradients"] == 2 * n16
    assert fp32["mem"]["parameters"] == 4 * n32 and fp32["mem"]["master"] == 0
    assert bf16["mem"]["master"] == 8 * (n16 // 2)
    assert abs(bf16["mem"]["optimizer"] - fp32["mem"]["optimizer"]) <= 8 * (n16 - n32) + 8


# -- memory accounting -------------------------------------------------------------------------
def _measured_memory(shard: bool, dtype: torch.dtype, kind: str) -> dict:
    torch.manual_seed(0)
    model = Model()
    model.wpe.weight.requires_grad_(False)
    trainer = DistributedTrainer(FlatParamModule(model, dtype=dtype), shard=shard)
    if kind == "adamw":
        trainer.make_optimizer(torch.optim.AdamW, lr=1e-3)
    else:
        trainer.make_optimizer(torch.optim.SGD, lr=1e-3, momentum=0.9)
    train(trainer, range(2))  # the optimizer's state exists after a step
    out = trainer.memory_bytes()
    trainer.close()
    return out


MEMORY = Cases(_measured_memory, params=["shard", "dtype", "kind"], timeout=120)


@pytest.mark.parametrize("world_size", MEMORY.world_sizes(1, 3, 4, cases=3))
@pytest.mark.parametrize(
    ("shard", "dtype", "kind"),
    [
        (True, torch.bfloat16, "adamw"),
        (True, torch.float32, "sgd"),
        (False, torch.float32, "adamw"),
    ],
)
def test_memory_plan_matches_what_the_trainer_allocates(request, world_size, shard, dtype, kind):
    from torchshard import FlatLayout, plan_memory

    measured = MEMORY.results(request)
    model = Model()
    model.wpe.weight.requires_grad_(False)
    layout = FlatLayout.from_module(model, dtype=dtype)
    planned = plan_memory(layout, world_size, shard=shard, optimizer=kind)
    assert measured == [p.as_dict() for p in planned]


def _optimizer_zero_grad_is_enough() -> bool:
    """The usual idiom, ``optimizer.zero_grad()``, with a sharded trainer."""
    results = []
    for use_optimizer in (True, False):
        trainer = new_trainer(shard=True)
        for step in range(4):
            if use_optimizer:
                trainer.optimizer.zero_grad()  # reaches only the optimizer's slice pieces
            else:
                trainer.zero_grad()
            trainer.module(*batch(trainer.rank, step))[1].backward()
            trainer.step()
        results.append(trainer.module.flat_param[: trainer.module.numel].clone())
        trainer.close()
    return torch.equal(*results)


def test_optimizer_zero_grad_does_not_let_sharded_gradients_accumulate():
    # Before: the module's full-size .grad survived optimizer.zero_grad() and every
    # backward added to all the earlier ones (and a resumed run, starting clean, diverged).
    assert run_distributed(_optimizer_zero_grad_is_enough, 2, timeout=60) == [True, True]


class _HalfUnused(torch.nn.Module):
    """The first half of the flat buffer is a layer no step uses: rank 0 of 2 holds no state."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(16, 16)
        self.used = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.used(x)


def _state_only_on_rank_1(root: str) -> list[bool]:
    from torchshard import checkpoint

    def make():
        torch.manual_seed(0)
        trainer = DistributedTrainer(FlatParamModule(_HalfUnused(), align_bytes=4), shard=True)
        return trainer, trainer.make_optimizer(torch.optim.AdamW, lr=1e-2)

    trainer, opt = make()
    for step in range(3):
        opt.zero_grad()
        trainer.module(
            torch.randn(2, 16, generator=torch.Generator().manual_seed(step))
        ).sum().backward()
        trainer.step()
    has_state = bool(opt.state)
    checkpoint.save(root, trainer, step=3, optimizer=opt)
    fresh, opt2 = make()
    checkpoint.load(root, fresh, optimizer=opt2)
    same = [has_state == (trainer.rank == 1)]
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        st, st2 = opt.state.get(p, {}), opt2.state.get(q, {})
        same.append(st.keys() == st2.keys() and all(torch.equal(st[k], st2[k]) for k in st))
    trainer.close()
    fresh.close()
    return same


def test_sharded_save_keeps_state_that_only_a_rank_other_than_0_holds(tmp_path):
    # Before: the state keys were rank 0's, so rank 1's exp_avg/exp_avg_sq were never written.
    for same in run_distributed(_state_only_on_rank_1, 2, str(tmp_path), timeout=60):
        assert all(same), same
