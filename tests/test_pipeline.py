"""Pipeline parallelism (issue 26): the plan and the pruned stages (pure), then pipelines
on gloo against a one-process run of the same microbatches: bitwise in fp32 untied, a tied
embedding in float64, one global norm, and the errors of bad input on every rank."""

from __future__ import annotations

import warnings

import pytest
import torch
from gpt import GPT, GPTConfig, init_gpt_weights
from multiprocess import run_distributed
from pipeline_models import gpt_loss, meta_gpt
from torch import nn

import torchshard

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)
SPLIT = [["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "lm_head"]]
M = 4  # microbatches


def _meta(tied: bool) -> GPT:
    return meta_gpt(CFG, tied)


_loss = gpt_loss


def _batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 64, (rows, 16), generator=g),
            torch.randint(0, 64, (rows, 16), generator=g),
        )
        for _ in range(steps)
    ]


def _reference(tied: bool) -> torchshard.FlatParamModule:
    """The whole model, initialized in one process from seed 0 as the pipeline is."""
    ref = torchshard.FlatParamModule(_meta(tied))
    ref.bind(torch.empty(ref.numel))
    torch.manual_seed(0)
    ref.init_weights(init_gpt_weights)
    return ref


def _ref_backward(
    ref: torchshard.FlatParamModule, x: torch.Tensor, y: torch.Tensor, backwards: str = "in order"
) -> None:
    """The same microbatches, each loss divided by their count, their gradients summed in
    the schedule's order (LoopedBFS runs the backwards last microbatch first)."""
    pieces = list(zip(x.chunk(M), y.chunk(M)))
    for xs, ys in reversed(pieces) if backwards == "reversed" else pieces:
        (_loss(ref(xs), ys) / M).backward()


def _mine(pipe: torchshard.Pipeline, of: str) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's stages, by name."""
    out = {}
    for h in pipe.stages:
        for name, p in h.fm.module.named_parameters(remove_duplicate=False):
            t = p.detach() if of == "param" else p.grad
            out[name] = t.clone()
    return out


def _parity(schedule: str, tied: bool, dtype: torch.dtype, clip: float | None, pp: int = 2) -> dict:
    """dp=1: per step, every stage's grads and weights against the one-process run."""
    torch.set_default_dtype(dtype)
    ref = _reference(tied)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    pipe = torchshard.Pipeline(
        _meta(tied),
        pp=pp,
        microbatches=M,
        loss_fn=_loss,
        stages=SPLIT
        if pp == 2 and "Interleaved" not in schedule and "Looped" not in schedule
        else "auto",
        schedule=schedule,
        init_fn=init_gpt_weights,
    )
    pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False)
    report: dict = {"init": _diffs(pipe, ref, "param"), "grads": [], "weights": [], "norms": []}
    x, y = _batches(1, 8)[0]
    report["eval"] = (pipe.evaluate(x, target=y), _ref_loss(ref, x, y))
    for x, y in _batches(3, 8):
        pipe.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.forward_backward(x, target=y)
        _ref_backward(ref, x, y, "reversed" if schedule == "LoopedBFS" else "in order")
        report.setdefault("losses", []).append((float(loss), float(_ref_loss(ref, x, y))))
        if clip is not None:
            norm = pipe.clip_grad_norm_(clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            report["norms"].append((norm.clone(), ref_norm.clone()))
        else:
            pipe._finish()
        report["grads"].append(_diffs(pipe, ref, "grad"))
        pipe.step()
        ref_opt.step()
        report["weights"].append(_diffs(pipe, ref, "param"))
    report["final"] = _mine(pipe, "param")
    pipe.close()
    return report


@torch.no_grad()
def _ref_loss(ref: torchshard.FlatParamModule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return sum(_loss(ref(xs), ys) / M for xs, ys in zip(x.chunk(M), y.chunk(M)))


def _diffs(pipe: torchshard.Pipeline, ref: torchshard.FlatParamModule, of: str) -> dict:
    """Per parameter of this stage: the largest relative difference to the reference."""
    out = {}
    for name, t in _mine(pipe, of).items():
        r = ref.module.get_parameter(name)
        r = r.detach() if of == "param" else r.grad
        d, scale = float((t - r).abs().max()), float(r.abs().max())
        out[name] = d / scale if scale else d
    return out


@pytest.mark.parametrize(
    ("schedule", "pp"),
    [("GPipe", 2), ("1F1B", 2), ("1F1B", 4), ("Interleaved1F1B", 2), ("LoopedBFS", 2)],
)
def test_pipeline_matches_one_process_bitwise(schedule: str, pp: int) -> None:
    got_all = run_distributed(_parity, pp, schedule, False, torch.float32, None, pp)
    for rank, got in enumerate(got_all):
        assert got["init"] and all(v == 0 for v in got["init"].values()), (rank, got["init"])
        for step, (g, w) in enumerate(zip(got["grads"], got["weights"])):
            assert all(v == 0 for v in g.values()), (rank, step, g)
            assert all(v == 0 for v in w.values()), (rank, step, w)
        assert all(a == b for a, b in got["losses"]), got["losses"]
        assert torch.equal(*got["eval"]), got["eval"]  # forward only, every rank


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_tied_embedding_across_stages_float64(schedule: str) -> None:
    s0, s1 = run_distributed(_parity, 2, schedule, True, torch.float64, None)
    for got in (s0, s1):
        assert all(v == 0 for v in got["init"].values()), got["init"]
        for g, w in zip(got["grads"], got["weights"]):
            assert max(g.values()) <= 1e-12 and max(w.values()) <= 1e-12, (g, w)
    assert "wte.weight" in s0["final"] and "lm_head.weight" in s1["final"]
    assert torch.equal(s0["final"]["wte.weight"], s1["final"]["lm_head.weight"])
    # first step: only the tied slot may differ by rounding (Σh + Σe against Σ(h + e))
    tied = {"wte.weight", "lm_head.weight"}
    for got in (s0, s1):
        assert all(v == 0 for n, v in got["grads"][0].items() if n not in tied), got["grads"][0]


@pytest.mark.parametrize("schedule", ["1F1B", "LoopedBFS"])
def test_one_global_norm_matches_torch_float64(schedule: str) -> None:
    s0, s1 = run_distributed(_parity, 2, schedule, True, torch.float64, 0.1)
    for (a, ref), (b, _) in zip(s0["norms"], s1["norms"]):
        assert torch.equal(a, b)  # bitwise on every rank
        assert abs(float(a) - float(ref)) <= 1e-12 * float(ref), (float(a), float(ref))
        assert float(ref) > 0.1  # the clip acted
    for got in (s0, s1):
        for w in got["weights"]:
            assert max(w.values()) <= 1e-12, w


def _grid(
    pp: int, shard: bool, tied: bool = False, clip: float | None = None, schedule: str = "1F1B"
) -> tuple[int, list[dict]]:
    """Three steps of this data-parallel replica's half of each batch; every weight after each
    (and the norm, clipping at ``clip``)."""
    dtype = torch.float64 if tied else torch.float32
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    kw = {"master_dtype": dtype} if shard else {}  # float64 all the way (the default is fp32)
    if pp == 1:  # the oracle: a plain trainer over the whole model
        fm = torchshard.FlatParamModule(_meta(tied))
        trainer = torchshard.DistributedTrainer(fm, shard=shard, init_fn=init_gpt_weights, **kw)
        trainer.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False)
        dp_rank = torch.distributed.get_rank()
    else:
        pipe = torchshard.Pipeline(
            _meta(tied),
            pp=pp,
            microbatches=2,
            loss_fn=_loss,
            shard=shard,
            init_fn=init_gpt_weights,
            schedule=schedule,
            **kw,
        )
        pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False)
        dp_rank = pipe.dp_rank
    out = []
    for x, y in _batches(3, 8):
        mine = slice(dp_rank * 4, dp_rank * 4 + 4)
        if pp == 1:
            trainer.zero_grad()
            with trainer.no_sync():
                _ref_backward_one(fm, x[mine][:2], y[mine][:2])
            _ref_backward_one(fm, x[mine][2:], y[mine][2:])
            norm = trainer.clip_grad_norm_(clip) if clip else None
            trainer.step()
            params = {
                n: p.detach().clone() for n, p in fm.module.named_parameters(remove_duplicate=False)
            }
        else:
            pipe.zero_grad()
            pipe.forward_backward(x[mine], target=y[mine])
            norm = pipe.clip_grad_norm_(clip) if clip else None
            pipe.step()
            params = _mine(pipe, "param")
            params["launched"] = (pipe.stats.launched_during_backward, pipe.stats.buckets)
        out.append({**params, "norm": norm})
    (trainer if pp == 1 else pipe).close()
    return dp_rank, out


def _ref_backward_one(fm: torchshard.FlatParamModule, x: torch.Tensor, y: torch.Tensor) -> None:
    (_loss(fm(x), y) / 2).backward()


@pytest.mark.parametrize(
    ("shard", "schedule"), [(False, "1F1B"), (True, "1F1B"), (True, "Interleaved1F1B")]
)
def test_pp2_dp2_matches_pp1_dp2_bitwise(shard: bool, schedule: str) -> None:
    flat = run_distributed(_grid, 2, 1, shard)  # pp=1 x dp=2, a plain trainer
    piped = run_distributed(_grid, 4, 2, shard, False, None, schedule)  # pp=2 x dp=2
    for dp_rank in range(2):
        want = next(steps for d, steps in flat if d == dp_rank)
        parts = [steps for d, steps in piped if d == dp_rank]
        assert len(parts) == 2
        for step, ref in enumerate(want):
            got = {**parts[0][step], **parts[1][step]}
            assert set(got) - {"launched"} == set(ref)
            for name, t in ref.items():
                if name != "norm":
                    assert torch.equal(got[name], t), (dp_rank, step, name)
            for part in parts:  # each stage's reduction started in its last backward
                launched, buckets = part[step]["launched"]
                assert launched == buckets > 0, part[step]["launched"]


def _bad_inputs() -> list[str]:
    """Each bad input's error, as this rank saw it (class: message)."""
    cases = {
        "world % pp": dict(pp=3),
        "split leaves out": dict(
            stages=[["wte", "wpe", "blocks.0"], ["blocks.2", "blocks.3", "ln_f", "lm_head"]]
        ),
        "split repeats": dict(
            stages=[
                ["wte", "wpe", "blocks.0", "blocks.1"],
                ["blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head"],
            ]
        ),
        "split order": dict(
            stages=[
                ["wte", "wpe", "blocks.0", "blocks.2"],
                ["blocks.1", "blocks.3", "ln_f", "lm_head"],
            ]
        ),
        "stage count": dict(stages=3),
        "schedule": dict(schedule="ZBVZeroBubble"),
        "shard full": dict(shard="full"),
        "stages per rank": dict(stages=4),
    }
    seen = []
    for what, kw in cases.items():
        args = dict(pp=2, microbatches=M, loss_fn=_loss, init_fn=init_gpt_weights) | kw
        try:
            torchshard.Pipeline(_meta(what != "split order"), **args).close()
            seen.append(f"{what}: no error")
        except torchshard.TorchShardError as e:
            seen.append(f"{what}: {type(e).__name__}: {e}")
    pipe = torchshard.Pipeline(_meta(True), pp=2, microbatches=3, loss_fn=_loss)
    pipe.make_optimizer(torch.optim.SGD, lr=0.1)
    x, y = _batches(1, 8)[0]
    try:
        pipe.forward_backward(x, target=y)
        seen.append("batch % microbatches: no error")
    except torchshard.TorchShardError as e:
        seen.append(f"batch % microbatches: {type(e).__name__}: {e}")
    pipe.close()
    return seen


def test_bad_inputs_raise_on_every_rank_before_the_first_step() -> None:
    r0, r1 = run_distributed(_bad_inputs, 2)
    assert r0 == r1
    want = {
        "world % pp": "divisor of the world size 2, got 3",
        "split leaves out": "blocks.1.ln_1.weight is in no stage",
        "split repeats": "blocks.1 is in stages 0 and 1",
        "split order": "contiguous run",
        "stage count": "expected a multiple of pp=2 stages",
        "schedule": "ZBVZeroBubble",
        "shard full": 'a fully sharded stage (shard="full") is not supported',
        "stages per rank": "GPipe and 1F1B run one stage per rank",
        "batch % microbatches": "local batch 8 is not divisible by microbatches 3",
    }
    for line, (what, text) in zip(r0, want.items()):
        assert line.startswith(f"{what}: PipelineError: "), line
        assert text in line, line


def test_plan_tiles_the_layout_and_finds_the_tie() -> None:
    model = _meta(True)
    layout = torchshard.FlatLayout.from_module(model)
    for stages in (2, 3, SPLIT):
        plan = torchshard.plan_stages(
            model, stages, pp=len(stages) if isinstance(stages, list) else stages
        )
        assert plan.owned[0][0] == 0 and plan.owned[-1][1] == len(layout.slots)
        assert all(a[1] == b[0] for a, b in zip(plan.owned, plan.owned[1:]))
        assert [t.alias for t in plan.ties] == ["lm_head.weight"]
        assert plan.replicas[-1] == ("lm_head.weight",) and not any(plan.replicas[:-1])
    assert torchshard.plan_stages(model, SPLIT, pp=2).modules == tuple(map(tuple, SPLIT))
    # "auto" keeps what the forward uses together: the embeddings, and the norm with the head
    six = torchshard.plan_stages(model, 6).modules
    assert six[0] == ("wte", "wpe") and six[-1] == ("ln_f", "lm_head"), six
    assert [m for (m,) in six[1:-1]] == [f"blocks.{i}" for i in range(4)]
    with pytest.raises(torchshard.PipelineError, match="at least 7 groups"):
        torchshard.plan_stages(model, 7)
    assert not torchshard.plan_stages(_meta(False), 2).ties


def test_split_stages_keep_names_and_compose_to_the_whole_model() -> None:
    torch.manual_seed(0)
    whole = GPT(CFG)  # real weights: the copies keep them
    plan = torchshard.plan_stages(whole, SPLIT, pp=2)
    s0, s1 = torchshard.split_stages(whole, plan, [0, 1])
    assert s0.lm_head is None and s1.wte is None and s1.wpe is None
    assert len(s1.blocks) == 2 and s1.blocks[3] is list(s1.blocks)[1]
    names = dict(whole.named_parameters(remove_duplicate=False))
    for stage in (s0, s1):
        for name, p in stage.named_parameters(remove_duplicate=False):
            assert torch.equal(p, names[name]), name
    got = {n for s in (s0, s1) for n, _ in s.named_parameters(remove_duplicate=False)}
    assert got == set(names)
    x = torch.randint(0, 64, (2, 16))
    logits, loss = s1(s0(x))
    want, _ = whole(x)
    assert loss is None and torch.equal(logits, want)


def test_plan_errors_name_the_module() -> None:
    net = nn.Sequential()
    net.add_module("a", nn.Linear(2, 2))
    net.add_module("drop", nn.Dropout())
    net.add_module("b", nn.Linear(2, 2))
    assert torchshard.plan_stages(net, 2).modules == (("a", "drop"), ("b",))
    with pytest.raises(torchshard.PipelineError, match="drop is in no stage"):
        torchshard.plan_stages(net, [["a"], ["b"]])
    with pytest.raises(torchshard.PipelineError, match=r"did you mean 'blocks\.0'"):
        torchshard.plan_stages(_meta(True), [["wte", "wpe", "block.0"], ["blocks.1"]])
    with pytest.raises(torchshard.PipelineError, match="stage 1 holds no parameters"):
        torchshard.plan_stages(net, [["a", "b"], ["drop"]])


def _left_open(dp_shard: bool) -> int:
    """A pipeline never closed: the exit hook closes its trainer; nothing hangs."""
    torch.manual_seed(0)
    pipe = torchshard.Pipeline(_meta(True), pp=2, microbatches=2, loss_fn=_loss, stages=SPLIT)
    pipe.make_optimizer(torch.optim.SGD, lr=0.1)
    x, y = _batches(1, 4)[0]
    pipe.forward_backward(x, target=y)
    pipe.step()
    return pipe.pp_rank


def test_an_unclosed_pipeline_exits_cleanly() -> None:
    assert run_distributed(_left_open, 2, False, timeout=60) == [0, 1]


@pytest.mark.parametrize("shard", [False, True])
def test_tie_with_dp2_stays_in_sync_and_matches_pp1_float64(shard: bool) -> None:
    """A plain trainer over the whole model is the oracle; clipped at 0.1, so the one global
    norm (bitwise the same on all four ranks) scales every stage alike."""
    flat = dict(run_distributed(_grid, 2, 1, shard, True, 0.1))  # pp=1 x dp=2, by dp rank
    piped = run_distributed(_grid, 4, 2, shard, True, 0.1)  # (stage 0: dp 0, 1), (stage 1: ...)
    for dp_rank in range(2):
        (_, first), (_, last) = piped[dp_rank], piped[2 + dp_rank]
        for step, ref in enumerate(flat[dp_rank]):
            assert torch.equal(first[step]["wte.weight"], last[step]["lm_head.weight"])
            norms = [steps[step]["norm"] for _, steps in piped]
            assert all(torch.equal(n, norms[0]) for n in norms), norms
            want = float(ref["norm"])
            assert want > 0.1 and abs(float(norms[0]) - want) <= 1e-12 * want, (norms[0], want)
            got = {**first[step], **last[step]}
            for name, t in ref.items():
                if name in ("norm", "launched"):
                    continue
                scale = float(t.abs().max())
                assert float((got[name] - t).abs().max()) <= 1e-12 * scale, (dp_rank, step, name)


def _lr_schedule() -> list[list[float]]:
    """Two stages per rank, two param groups each, under one LambdaLR."""
    torch.manual_seed(0)
    pipe = torchshard.Pipeline(
        _meta(False), pp=2, microbatches=2, loss_fn=_loss, schedule="Interleaved1F1B"
    )
    opt = pipe.make_optimizer(
        torch.optim.AdamW, lr=1.0, groups=[(lambda n: n.endswith("bias"), {"weight_decay": 0})]
    )
    assert isinstance(opt, torch.optim.Optimizer) and len(opt.parts) == 2
    warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" fails
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    seen = []
    x, y = _batches(1, 4)[0]
    for _ in range(2):
        pipe.zero_grad()
        pipe.forward_backward(x, target=y)
        pipe.step()
        sched.step()
        seen.append([g["lr"] for part in opt.parts for g in part.param_groups])
    pipe.close()
    return seen


def test_one_optimizer_over_local_stages_follows_an_lr_scheduler() -> None:
    got = run_distributed(_lr_schedule, 2)
    assert got == [[[0.5] * 4, [0.25] * 4]] * 2, got


def _with_mesh() -> tuple[int, int, list[dict]]:
    """``mesh=init_mesh(pp=2)`` instead of ``pp=2``: the same ranks, the same steps."""
    torch.manual_seed(0)
    mesh = torchshard.init_mesh(pp=2)
    pipe = torchshard.Pipeline(
        _meta(False), mesh=mesh, microbatches=2, loss_fn=_loss, init_fn=init_gpt_weights
    )
    assert (pipe.pp_rank, pipe.dp_rank) == (mesh.pp_rank, mesh.dp_rank)
    assert torchshard.GlobalBatchSampler(64, 8).rank == pipe.dp_rank  # the sampler's default
    pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, foreach=False)
    out = []
    for x, y in _batches(2, 8):
        mine = slice(pipe.dp_rank * 4, pipe.dp_rank * 4 + 4)
        pipe.zero_grad()
        pipe.forward_backward(x[mine], target=y[mine])
        pipe.step()
        out.append(_mine(pipe, "param"))
    pipe.close()
    return pipe.pp_rank, pipe.dp_rank, out


def test_a_mesh_with_pp_builds_the_same_pipeline() -> None:
    got = run_distributed(_with_mesh, 4)
    assert [(p, d) for p, d, _ in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    flat = dict(run_distributed(_grid, 2, 1, False))  # a plain trainer at dp=2
    for _, d, steps in got:
        for step, params in enumerate(steps):
            assert all(torch.equal(t, flat[d][step][n]) for n, t in params.items())


def test_the_optimizer_follows_its_parts_groups_when_they_are_replaced() -> None:
    """A load replaces each stage optimizer's group dicts: LR changes must still land."""
    from torchshard._pipeline.optim import PipelineOptimizer

    a, b = (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0) for _ in range(2))
    opt = PipelineOptimizer([a, b], lambda: None)
    a.load_state_dict(a.state_dict())  # new dicts, as torch's load_state_dict makes
    for g in opt.param_groups:
        g["lr"] = 0.5
    assert [g["lr"] for p in (a, b) for g in p.param_groups] == [0.5, 0.5]


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.spare = nn.Linear(8, 8), nn.Linear(8, 8)  # spare: never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _unused() -> dict:
    """pp=2: a parameter no forward uses keeps no gradient and its weight, as in a trainer."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _Net()
    mse = torch.nn.functional.mse_loss
    pipe = torchshard.Pipeline(model, pp=2, microbatches=2, loss_fn=mse)
    pipe.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=False)
    before = _mine(pipe, "param")
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        pipe.zero_grad()
        pipe.forward_backward(x, target=y)
        pipe._finish()
        grads = {n: p.grad for h in pipe.stages for n, p in h.fm.module.named_parameters()}
        pipe.step()
    after = _mine(pipe, "param")
    pipe.close()
    return {
        "none": sorted(n for n, g in grads.items() if g is None),
        "before": before,
        "after": after,
    }


def test_unused_parameters_keep_no_gradient_and_their_weight() -> None:
    for got in run_distributed(_unused, 2):
        spare = sorted(n for n in got["before"] if ".spare." in n)
        assert got["none"] == spare and len(spare) == 4, got["none"]
        for n in got["before"]:
            same = torch.equal(got["before"][n], got["after"][n])
            assert same == (n in spare), n  # decay skips a parameter without a gradient
