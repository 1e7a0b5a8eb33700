"""The fully sharded mode (``shard="full"``) against its oracles: torch DDP, the replicated
and the sharded modes, and the initialization of a meta-built model.

The test model is the sharded tests' tiny GPT (a tied embedding and head: one root unit)
plus two auxiliary heads: ``aux`` is used on some ranks in some steps, ``aux2`` by rank 0
only, every fourth step, so in the others no rank uses it and AdamW must skip it; the
position embedding is frozen. Bitwise at 2 ranks (a sum of two divided by two rounds as
DDP's sum of halves does); at 3 within 1e-5 relative.
"""

from __future__ import annotations

import copy

import introspect
import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from multiprocess import run_distributed
from sharded_harness import KW, Checkpointed, Heads, Model, batch, no_decay
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from torchshard import DistributedTrainer, FlatParamModule, RankMismatchError, TorchShardError
from torchshard._flat.layout import FlatLayout
from torchshard._parallel.units import resolve_units

ADAMW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1)


def flags(rank: int, step: int) -> dict:
    return dict(use_aux=(step + rank) % 3 == 0, use_aux2=step % 4 == 0 and rank == 0)


def heads(seed: int = 0) -> Heads:
    torch.manual_seed(seed)
    m = Heads()
    m.wpe.weight.requires_grad_(False)
    return m


def weights(trainer: DistributedTrainer) -> list[torch.Tensor]:
    """Every parameter's values, by slot (copies: in full mode the views are freed after)."""
    with trainer.gathered():
        return [p.detach().clone() for _, p in _slots(trainer)]


def trained(model: nn.Module, steps: int, rank: int, **kw) -> list[torch.Tensor]:
    """``model`` fully sharded (``kw``: trainer options) after ``steps`` AdamW steps on
    ``batch(rank, step)``: its weights by slot."""
    t = DistributedTrainer(FlatParamModule(model, align_bytes=4), shard="full", **kw)
    t.make_optimizer(torch.optim.AdamW, **ADAMW)
    for step in range(steps):
        t.zero_grad()
        t.module(*batch(rank, step))[1].backward()
        t.step()
    out = weights(t)
    t.close()
    return out


def _slots(trainer: DistributedTrainer):
    fm = trainer.module
    params = dict(fm.module.named_parameters(remove_duplicate=False))
    return [(s, params[s.name]) for s in fm.layout.slots]


def optimizer_flat(trainer: DistributedTrainer) -> dict[str, torch.Tensor]:
    """The optimizer's tensors and state laid out like the flat buffer, every rank's part
    summed in (each element comes from exactly one rank), identical on every rank."""
    n = trainer.module.layout.numel
    opt = trainer.optimizer
    out = {"master": torch.zeros(n, dtype=torch.float32)}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = torch.zeros(n, dtype=torch.float32)
    for _, a, b, t in trainer.optimizer_segments():
        out["master"][a:b] = t.detach().float().reshape(-1)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in opt.state.get(t, {}):
                out[key][a:b] = opt.state[t][key].float().reshape(-1)
    for v in out.values():
        dist.all_reduce(v, group=trainer.process_group)
    return out


# -- parity: DDP, the replicated mode ---------------------------------------------------------
def _parity(steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = heads()
    full_model, rep_model = copy.deepcopy(ref), copy.deepcopy(ref)
    full = DistributedTrainer(FlatParamModule(full_model, align_bytes=4), shard="full")
    rep = DistributedTrainer(FlatParamModule(rep_model, align_bytes=4), bucket_mb=0.004)
    ddp = DDP(ref, find_unused_parameters=True)
    full.make_optimizer(torch.optim.AdamW, **ADAMW)
    rep.make_optimizer(torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    units = [(u.name, u.root, u.kept) for u in full.units]
    aux2 = {i for i, s in enumerate(full.module.layout.slots) if s.name.startswith("aux2.")}
    worst = {"ddp": 0.0, "replicated": 0.0}
    checked = 0
    for step in range(steps):
        for t in (full, rep):
            t.zero_grad()
            t.module(*batch(rank, step), **flags(rank, step))[1].backward()
            t.step()
        ref_opt.zero_grad()
        ddp(*batch(rank, step), **flags(rank, step))[1].backward()
        ref_opt.step()
        for slot, _, _, piece in full.optimizer_segments():
            if slot in aux2:  # no rank used it: AdamW skipped it, as DDP's grad None does
                assert (piece.grad is None) == (step % 4 != 0), step
                checked += 1
        got = weights(full)
        for name, want in (
            ("ddp", [p for _, p in _named(ref, full)]),
            ("replicated", weights(rep)),
        ):
            for (s, _), a, b in zip(_slots(full), got, want):
                if world == 2:
                    assert torch.equal(a, b), f"step {step}: {s.name} differs from {name}"
                else:
                    close(a, b, f"step {step}: {s.name} vs {name}")
                worst[name] = max(worst[name], (a - b).abs().max().item())
    full.check_collective_order()
    full.assert_in_sync()
    memory = full.memory_bytes()
    full.close()
    rep.close()
    return {"worst": worst, "units": units, "aux2_checked": checked, "memory": memory}


def close(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    """Within 1e-5 relative, as a tensor: ``|a - b| <= 1e-5 |b|`` in the 2-norm. Elementwise
    it cannot hold: where a gradient is nearly zero (the key projection's: softmax ignores a
    shift of the keys) AdamW divides a last-bit difference of a mean of three by sqrt(v)."""
    err, scale = (a - b).double().norm().item(), b.double().norm().item()
    assert err <= 1e-5 * scale, f"{where}: |a - b| = {err:.3g}, |b| = {scale:.3g}"


def _named(ref: nn.Module, trainer: DistributedTrainer):
    params = dict(ref.named_parameters(remove_duplicate=False))
    return [(s, params[s.name].detach()) for s in trainer.module.layout.slots]


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_matches_ddp_and_the_replicated_mode_every_step(world_size):
    results = run_distributed(_parity, world_size, 6, timeout=240)
    r0 = results[0]
    assert r0["units"] == [
        ("<root gain..wpe.weight>", True, True),
        ("blocks.0", False, False),
        ("blocks.1", False, False),
        ("<root ln_f.weight..aux2.bias>", True, True),
    ]
    if world_size == 2:
        assert all(r["worst"] == {"ddp": 0.0, "replicated": 0.0} for r in results), results
    assert sum(r["aux2_checked"] for r in results) > 0  # some rank's stripe holds aux2
    # between steps nothing is gathered: only the stripes persist
    assert all(r["memory"]["transient"] == 0 for r in results)


# -- bf16 with an fp32 master: the sharded mode ------------------------------------------------
def _bf16(steps: int) -> dict:
    rank = dist.get_rank()
    out = {}
    trainers = {}
    for shard in (True, "full"):
        torch.manual_seed(0)
        fm = FlatParamModule(Model(), align_bytes=4, dtype=torch.bfloat16)
        t = DistributedTrainer(fm, shard=shard, bucket_mb=0.004)
        t.make_optimizer(torch.optim.AdamW, groups=[(no_decay, {"weight_decay": 0.0})], **KW)
        trainers[shard] = t
    for step in range(steps):
        for t in trainers.values():
            t.zero_grad()
            t.module(*batch(rank, step))[1].backward()
            t.clip_grad_norm_(1e9)  # the global norm, not clipping
            t.step()
    states = {k: optimizer_flat(t) for k, t in trainers.items()}
    for key in states[True]:
        assert torch.equal(states[True][key], states["full"][key]), key
    for (s, _), a, b in zip(
        _slots(trainers[True]), weights(trainers[True]), weights(trainers["full"])
    ):
        assert torch.equal(a, b), s.name
    out["memory"] = trainers["full"].memory_bytes()
    out["shard_dtype"] = str(introspect.stripes(trainers["full"]).dtype)
    for t in trainers.values():
        t.close()
    return out


def test_bf16_with_an_fp32_master_matches_the_sharded_mode_bitwise():
    results = run_distributed(_bf16, 2, 4, timeout=240)
    for r in results:
        assert r["shard_dtype"] == "torch.float32"
        m = r["memory"]
        # no bf16 copy persists: the fp32 master stripes and their gradient, and AdamW's state
        assert m["parameters"] == m["gradients"] == 0 and m["master"] > 0
        assert m["optimizer"] >= m["master"]  # exp_avg and exp_avg_sq, both fp32


# -- initialization from meta ------------------------------------------------------------------
BIG = GPTConfig(vocab_size=60, block_size=8, n_layer=6, n_head=2, n_embd=24)


def _meta_init(hf: bool) -> dict:
    out = {}
    got = {}
    for shard in (False, "full"):
        torch.manual_seed(1234)
        with torch.device("meta"):
            model = _hf_model() if hf else GPT(BIG)
        t = DistributedTrainer(FlatParamModule(model), shard=shard)
        if shard == "full":
            item = t.module.dtype.itemsize
            largest = max(g.total for g in introspect.unit_geometries(t)) * item
            out["peak"], out["largest"] = t.memory_stats().peak_transient, largest
            out["model"] = t.module.layout.numel * item
            out["units"] = len(t.units)
        got[shard] = weights(t)
        t.close()
    for a, b in zip(got[False], got["full"]):
        assert torch.equal(a, b)
    return out


def _hf_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=5, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("hf", [False, True], ids=["gpt", "transformers"])
def test_meta_init_unit_by_unit_equals_todays_initialization(hf):
    r = run_distributed(_meta_init, 2, hf, timeout=240)[0]
    assert r["units"] >= 6
    # never the whole model: at most three units materialized at once
    assert r["peak"] <= 3 * r["largest"] < r["model"], r


# -- gradient accumulation, no_sync, activation checkpointing, options -------------------------
def _accumulate() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = Model()  # every parameter used: DDP without find_unused_parameters
    ref.wpe.weight.requires_grad_(False)
    model = copy.deepcopy(ref)
    full = DistributedTrainer(FlatParamModule(model, align_bytes=4), shard="full")
    ddp = DDP(ref)
    full.make_optimizer(torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    with pytest.raises(TorchShardError, match=r"no_sync.*shard=.full."), full.no_sync():
        pass
    worst, reduced = 0.0, []
    for step in range(3):
        full.zero_grad()
        for micro in range(3):  # every backward reduce-scatters into the stripes
            before = full.stats.bytes_reduced
            full.module(*batch(rank, 10 * step + micro))[1].backward()
            reduced.append(full.stats.bytes_reduced - before)
        full.step()
        ref_opt.zero_grad()
        with ddp.no_sync():
            for micro in range(2):
                ddp(*batch(rank, 10 * step + micro))[1].backward()
        ddp(*batch(rank, 10 * step + 2))[1].backward()
        ref_opt.step()
        for (s, p), a in zip(_named(ref, full), weights(full)):
            # sums of three micro-batches per rank in another order than DDP's
            close(a, p, f"step {step}: {s.name}")
            worst = max(worst, (a - p).abs().max().item())
    full.close()
    return {"worst": worst, "reduced": reduced}


def test_gradient_accumulation_reduce_scatters_every_backward_and_no_sync_raises():
    results = run_distributed(_accumulate, 2, timeout=240)
    assert max(r["worst"] for r in results) < 1e-5
    for r in results:  # each of the 9 backwards reduce-scattered every unit, in backward
        assert len(r["reduced"]) == 9 and r["reduced"][0] > 0, r
        assert set(r["reduced"]) == {r["reduced"][0]}, r


def unit_storage(t: DistributedTrainer) -> int:
    """Bytes the fully sharded mode's unit buffers hold now: real storage, not its counter."""
    return introspect.unit_storage_bytes(t)


def _variants() -> dict:
    rank = dist.get_rank()
    variants = {
        "default": (Model, {}),
        "checkpointed": (Checkpointed, {}),
        "prefetch 0": (Model, {"prefetch": 0}),
        "prefetch 2": (Model, {"prefetch": 2}),
        "kept after forward": (Model, {"reshard_after_forward": False}),
        # units other than the default's (each block): each block's MLP; block 0 alone
        "units by class": (Model, {"units": [nn.Sequential]}),
        "units by callable": (Model, {"units": lambda n, m: n == "blocks.0"}),
    }
    got, units = {}, {}
    for name, (cls, kw) in variants.items():
        torch.manual_seed(0)
        t = DistributedTrainer(FlatParamModule(cls(), align_bytes=4), shard="full", **kw)
        t.make_optimizer(torch.optim.AdamW, **ADAMW)
        units[name] = [(u.name, u.kept) for u in t.units]
        for step in range(3):
            t.zero_grad()
            t.module(*batch(rank, step))[1].backward()
            t.step()
            # freed between steps: by the mode's counter, and in storage
            assert t.memory_bytes()["transient"] == 0 and unit_storage(t) == 0, name
        got[name] = weights(t)
        t.close()
    for name in variants:
        for a, b in zip(got["default"], got[name]):
            assert torch.equal(a, b), name
    return units


def test_checkpointing_prefetch_and_units_options_train_bitwise_alike():
    units = run_distributed(_variants, 2, timeout=240)[0]
    root = [("<root gain..wpe.weight>", True), ("<root ln_f.weight..ln_f.bias>", True)]
    assert units["default"] == [root[0], ("blocks.0", False), ("blocks.1", False), root[1]]
    # the units= options act: each resolves to other units than the default
    assert units["units by class"] == [
        ("<root gain..blocks.0.ln_2.bias>", True),
        ("blocks.0.mlp", False),
        ("<root blocks.1.ln_1.weight..blocks.1.ln_2.bias>", True),
        ("blocks.1.mlp", False),
        root[1],
    ], units["units by class"]
    assert units["units by callable"] == [
        root[0],
        ("blocks.0", False),
        ("<root blocks.1.ln_1.weight..ln_f.bias>", True),
    ], units["units by callable"]
    # (prefetch's effect on memory shows with more blocks: test_only_a_few_units_...)


class UnitStorage(TorchDispatchMode):
    """At every op: the real storage of the unit buffers, which must never exceed what the
    mode counts as transient (weights and gradients); and its largest value."""

    def __init__(self, t: DistributedTrainer) -> None:
        super().__init__()
        self.t, self.peak, self.undercounted = t, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        real, counted = unit_storage(self.t), introspect.transient_bytes(self.t)
        self.peak = max(self.peak, real)
        if real > counted and len(self.undercounted) < 3:
            self.undercounted.append(f"{func}: {real} bytes gathered, {counted} counted")
        return out


def _peaks() -> dict:
    rank = dist.get_rank()
    out = {}
    for name, kw in {
        "default": {},
        "prefetch 0": {"prefetch": 0},
        "prefetch 2": {"prefetch": 2},
        "kept after forward": {"reshard_after_forward": False},
        "a head no rank uses": {},
    }.items():
        torch.manual_seed(0)
        model = GPT(BIG)
        if name == "a head no rank uses":  # in the last root unit: reduced when backward ends
            model.unused = nn.Linear(BIG.n_embd, 2)
        t = DistributedTrainer(FlatParamModule(model), shard="full", **kw)
        t.make_optimizer(torch.optim.AdamW, **ADAMW)
        t.reset_peak_memory()  # from here: training only
        idx = torch.randint(
            0,
            BIG.vocab_size,
            (2, BIG.block_size + 1),
            generator=torch.Generator().manual_seed(rank),
        )
        storage = UnitStorage(t)
        for _ in range(2):
            with storage:
                t.zero_grad()
                t.module(idx[:, :-1], idx[:, 1:])[1].backward()
                t.step()
            assert unit_storage(t) == 0, name  # nothing stays gathered between steps
        assert not storage.undercounted, (name, storage.undercounted)
        item = t.module.dtype.itemsize
        geoms = list(zip(t.units, introspect.unit_geometries(t)))
        blocks = [g.total * item for u, g in geoms if not u.kept]
        kept = sum(g.total * item for u, g in geoms if u.kept)
        out[name] = {
            "peak": t.memory_stats().peak_transient,
            "stored": storage.peak,  # the unit weights alone, measured
            "block": max(blocks),
            "n": len(blocks),
            "kept": kept,
        }
        t.close()
    return out


def test_only_a_few_units_are_ever_gathered_at_once():
    r = run_distributed(_peaks, 2, timeout=240)[0]
    d, p0, p2, keep = r["default"], r["prefetch 0"], r["prefetch 2"], r["kept after forward"]
    # the planner's bound: kept units (weights and gradients), (3 + prefetch) blocks
    assert d["peak"] <= 2 * d["kept"] + 4 * d["block"], d
    u = r["a head no rank uses"]  # the blocks are not held back by the kept units
    assert u["peak"] <= 2 * u["kept"] + 4 * u["block"], u
    assert p2["peak"] <= 2 * p2["kept"] + 5 * p2["block"], p2
    assert d["peak"] < d["kept"] + d["n"] * d["block"]  # less than the whole model
    # prefetch acts: each unit more ahead holds one block more at the peak
    assert p0["peak"] < d["peak"] < p2["peak"], (p0, d, p2)
    # measured in storage (weights only): the kept units and a few blocks, never more
    for name, x in r.items():
        assert x["kept"] < x["stored"] <= x["peak"], (name, x)
    # the running block and `prefetch` more (the default's is 1)
    for prefetch, x in enumerate((p0, d, p2)):
        assert x["stored"] == x["kept"] + (1 + prefetch) * x["block"], (prefetch, x)
    # keeping every block from its forward to its backward holds them all at once
    assert keep["peak"] >= keep["kept"] + keep["n"] * keep["block"] > d["peak"]
    assert keep["stored"] == keep["kept"] + keep["n"] * keep["block"], keep


def _gathered() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    t = DistributedTrainer(FlatParamModule(Model(), align_bytes=4), shard="full")
    t.make_optimizer(torch.optim.AdamW, **ADAMW)
    t.zero_grad()
    t.module(*batch(rank, 0))[1].backward()
    t.step()
    with t.gathered():
        sd = {k: v.clone() for k, v in t.module.state_dict().items()}
        inside = t.memory_bytes()["transient"]
        with torch.no_grad():
            loss = t.module(*batch(0, 99))[1]  # the same batch on every rank
    after = t.memory_bytes()["transient"]
    # evaluation outside gathered() works too: each unit gathered and freed in turn
    with torch.no_grad():
        loss2 = t.module(*batch(0, 99))[1]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v.sum().item() for k, v in sd.items()})
    t.close()
    return {
        "same": all(e == everyone[0] for e in everyone),
        "inside": inside,
        "after": after,
        "losses": (loss.item(), loss2.item()),
        "keys": len(sd),
    }


def _compiled() -> None:
    rank = dist.get_rank()
    got = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Model()
        if compiled:  # each block's inner forward: the unit's hooks stay outside the graph
            for block in model.blocks:
                block.forward = torch.compile(block.forward, backend="aot_eager", dynamic=False)
        got[compiled] = trained(model, 2, rank)
    for a, b in zip(got[False], got[True]):
        close(a, b, "compiled per block")


@pytest.mark.slow
def test_torch_compile_per_block_trains_like_eager():
    run_distributed(_compiled, 2, timeout=300)


def test_gathered_materializes_every_parameter_equal_on_every_rank_and_frees_on_exit():
    results = run_distributed(_gathered, 2, timeout=120)
    for r in results:
        assert r["same"] and r["inside"] > 0 and r["after"] == 0
        assert r["losses"][0] == r["losses"][1]
        assert r["keys"] > 20


class SharedAcrossUnits(Model):
    """A weight of block 0 used again by block 1 (tied across units: FSDP2 refuses this)."""

    def __init__(self) -> None:
        super().__init__()
        b0, b1 = self.blocks
        fc0 = next(m for m in b0.modules() if isinstance(m, nn.Linear))
        fc1 = next(m for m in b1.modules() if isinstance(m, nn.Linear))
        fc1.weight = fc0.weight


def _tied_across_units() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = SharedAcrossUnits()
    model = copy.deepcopy(ref)
    full = DistributedTrainer(FlatParamModule(model, align_bytes=4), shard="full")
    ddp = DDP(ref)
    full.make_optimizer(torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(3):
        full.zero_grad()
        full.module(*batch(rank, step))[1].backward()
        full.step()
        ref_opt.zero_grad()
        ddp(*batch(rank, step))[1].backward()
        ref_opt.step()
        for (s, p), a in zip(_named(ref, full), weights(full)):
            assert torch.equal(a, p), (step, s.name)
    kept = [u.name for u in full.units if u.kept and not u.root]
    full.close()
    return {"kept": kept}


def test_a_weight_tied_across_units_keeps_its_unit_gathered_and_trains_like_ddp():
    r = run_distributed(_tied_across_units, 2, timeout=120)[0]
    assert r["kept"] == ["blocks.0"]


# -- bad inputs -----------------------------------------------------------------------------------
def test_a_unit_that_is_not_a_contiguous_run_of_the_layout_is_refused():
    # named_parameters() order keeps a module's parameters together; a layout made in
    # another order (here: by hand) can split one
    outer = nn.Module()
    outer.a, outer.c = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
    root = nn.Module()
    root.outer, root.b = outer, nn.Linear(2, 2, bias=False)
    names = ["outer.a.weight", "b.weight", "outer.c.weight"]
    layout = FlatLayout.from_dict(
        {
            "format": 1,
            "dtype": "float32",
            "align_bytes": 16,
            "numel": 12,
            "slots": [[n, [2, 2], 4 * i, 4, True, []] for i, n in enumerate(names)],
        }
    )
    with pytest.raises(
        TorchShardError, match=r"module 'outer' is not a contiguous run .*slot 1 \('b.weight'\)"
    ):
        resolve_units(root, layout, ["outer"])
    assert [(u.name, u.lo, u.hi) for u in resolve_units(root, layout, ["outer.a", "outer.c"])] == [
        ("outer.a", 0, 1),
        ("<root b.weight..b.weight>", 1, 2),
        ("outer.c", 2, 3),
    ]


def _errors() -> list[str]:
    msgs = []

    def expect(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except TorchShardError as e:
            msgs.append(str(e))
            return
        msgs.append("no error")

    mk = lambda m, **kw: DistributedTrainer(FlatParamModule(m), **kw)  # noqa: E731
    expect(mk, Model(), shard="full", units=["blocks.7"])
    expect(mk, Model(), shard="full", units="blocks")
    expect(mk, Model(), shard="full", units=[3])
    expect(mk, Model(), shard="full", prefetch=-1)
    expect(mk, Model(), shard="full", reshard_after_forward="yes")
    expect(mk, Model(), shard=True, units=["blocks.0"])
    expect(mk, Model(), shard=False, prefetch=2)
    t = mk(Model(), shard="full")
    expect(t.broadcast)
    expect(t.all_reduce_parameters)
    t.close()
    return msgs


def test_bad_inputs_name_what_is_wrong():
    msgs = run_distributed(_errors, 1, timeout=120)[0]
    assert "no module named 'blocks.7'" in msgs[0]
    assert msgs[1].startswith("units: expected 'auto'")
    assert "got 3" in msgs[2]
    assert msgs[3].startswith("prefetch: expected an int >= 0, got -1")
    assert msgs[4].startswith("reshard_after_forward: expected True or False")
    assert msgs[5].startswith("units: only with shard='full'")
    assert msgs[6].startswith("prefetch: only with shard='full'")
    assert msgs[7].startswith("broadcast(): not available with shard='full'")
    assert msgs[8].startswith("all_reduce_parameters(): not available with shard='full'")


def _world_of_one() -> None:
    torch.manual_seed(0)
    ref = Model()
    model = copy.deepcopy(ref)
    t = DistributedTrainer(FlatParamModule(model, align_bytes=4), shard="full")
    t.make_optimizer(torch.optim.AdamW, **ADAMW)
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(3):
        t.zero_grad()
        t.module(*batch(0, step))[1].backward()
        t.step()
        opt.zero_grad()
        ref(*batch(0, step))[1].backward()
        opt.step()
    for (s, p), a in zip(_named(ref, t), weights(t)):
        assert torch.equal(a, p), s.name
    t.close()


def test_full_in_a_world_of_one_trains_like_plain_pytorch():

    run_distributed(_world_of_one, 1, timeout=120)


def _different_schedules(what: str) -> dict:
    rank = dist.get_rank()
    kw = {"prefetch": 1 + rank} if what == "prefetch" else {"units": [["blocks.0"], "auto"][rank]}
    # sharding the weights: buffers filled and broadcast from src, units gathered
    with introspect.record_unit_mode_calls("adopt", "gather") as calls:
        try:
            DistributedTrainer(FlatParamModule(Model()), shard="full", **kw)
        except RankMismatchError as e:
            return {"message": str(e), "calls": calls}
    return {"message": "no error", "calls": calls}


@pytest.mark.parametrize("what", ["units", "prefetch"])
def test_ranks_with_different_units_or_prefetch_are_refused_before_any_gather(what):
    results = run_distributed(_different_schedules, 2, what, timeout=120)
    for r in results:
        # the model is the same: the message names the options
        assert "ranks [1] built their trainer with other options than rank 0" in r["message"], r
        assert r["calls"] == [], r  # refused before the mode touched a weight


def _one_op_over_every_unit() -> bool:
    def init(m: nn.Module) -> None:
        if m is model:  # one foreach op over every parameter: every unit at once
            torch._foreach_mul_(list(m.parameters()), 0.5)
        else:
            for p in m.parameters(recurse=False):
                nn.init.normal_(p)

    got = []
    for shard in (False, "full"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(BIG)
        t = DistributedTrainer(FlatParamModule(model), shard=shard, init_fn=init)
        got.append(weights(t))
        t.close()
    return all(torch.equal(a, b) for a, b in zip(*got))


def test_an_init_op_that_touches_every_unit_at_once_sees_them_all():
    assert run_distributed(_one_op_over_every_unit, 2, timeout=120) == [True, True]


def _gloo_strategies() -> None:
    rank = dist.get_rank()
    got = {}
    for how in ("owner", "native"):
        torch.manual_seed(0)
        with introspect.gloo_collectives(how):
            got[how] = trained(Model(), 3, rank)
    for a, b in zip(got["owner"], got["native"]):
        if dist.get_world_size() == 2:
            assert torch.equal(a, b)
        else:  # gloo sums three in another order in a reduce than in an all-reduce
            close(a, b, "native vs owner")


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_all_gather_and_reduce_scatter_train_as_broadcast_and_reduce_per_owner(world_size):
    # gloo's all-gather writes its output when the work completes: the unit's version
    # counter must not count that as a change of what backward saved
    run_distributed(_gloo_strategies, world_size, timeout=180)


def _over_a_subgroup(uneven: bool) -> bool | None:
    group = dist.new_group([1, 2])
    if uneven:  # rank 2 knows one group more than rank 1: torch would name a local group apart
        dist.new_group([0, 2])
    # rank 0 leaves next: not before rank 2 is connected to it too (gloo connects the pair
    # from both ends; a peer that exits first fails the other's connectFullMesh)
    dist.barrier()
    if dist.get_rank() not in (1, 2):
        return None
    got, own = {}, None
    for shard in (False, "full"):
        torch.manual_seed(0)
        t = DistributedTrainer(
            FlatParamModule(Model(), align_bytes=4), shard=shard, process_group=group
        )
        t.make_optimizer(torch.optim.AdamW, **ADAMW)
        for step in range(2):
            t.zero_grad()
            t.module(*batch(t.rank, step))[1].backward()
            t.step()
        got[shard] = weights(t)
        if shard == "full":
            own = introspect.made_groups(t)
        t.close()
    for a, b in zip(got[False], got["full"]):
        assert torch.equal(a, b)
    return own


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_a_subgroup_trains_like_the_replicated_mode_and_never_hangs_creating_groups(uneven):
    own = run_distributed(_over_a_subgroup, 3, uneven, timeout=180)
    # own gather and reduce-scatter groups where the members can agree on them
    assert own == [None, not uneven, not uneven]
