"""Pipeline parallelism (issue 26): ``torchshard.Pipeline``'s bubble against theory, and its
step against torch's own pipelining driven by hand and against torchtitan's FSDP2-per-stage
pipeline. CPU, gloo, one thread per rank, fp32.

    python benchmarks/bench_pipeline.py [--steps 30] [--warmup 3] [--bubble-steps 10]
                                        [--out benchmarks/results/pipeline.json]

The model: a stack of ``BLOCKS`` residual MLP blocks (``x + W2 gelu(W1 x)``, width ``DIM``,
hidden ``4 * DIM``), a mean-squared-error loss: compute-heavy stages with small activations.
The bubble runs ``ROWS`` rows per microbatch: a stage's forward and backward of one
microbatch take about 90 ms here, against about 1-2 ms per forward or backward action
outside the stage's computation (torch's schedule runtime and gloo's p2p, whose latency is
printed beside): the theory counts neither, so the measured bubble sits above it by that
share, which halves when the microbatch doubles. The speed parts run ``SPEED_ROWS``.

1. **Bubble**, pp=2 (2 ranks), ``m`` = 2, 4, 8 microbatches of ``ROWS`` rows each: GPipe and
   1F1B (one stage of ``BLOCKS / 2`` blocks per rank), Interleaved1F1B and LoopedBFS (two
   stages of ``BLOCKS / 4`` per rank: the same work per rank). Per rank and step, ``busy``
   is the time inside the rank's stages' ``forward_one_chunk`` and ``backward_one_chunk``
   (timed by wrappers this script sets on each ``StageHandle.stage`` instance: the library
   is unchanged) and ``step`` the wall time of ``forward_backward``; bubble = 1 - busy/step.
   Theory: (p-1)/(m+p-1) for GPipe and 1F1B (GPipe, Huang et al. 2019; 1F1B has the same
   bubble, PipeDream-Flush, Narayanan et al. 2021), and (p-1)/(v*m+p-1) with v stages per
   rank for the interleaved and the looped breadth-first schedule: Megatron's interleaved
   bubble (Narayanan et al. 2021, section 2.2) is (1/v)(p-1)/m of the ideal time, the
   same as a fraction of the step. Targets: within 0.05 of theory on every rank; the
   interleaved schedules' bubble below 1F1B's at the same m.
2. **Speed against torch's pipelining by hand**, pp=2 (2 ranks), 1F1B, m=8: the same stages
   as plain modules (``torchshard.split_stages`` of the model, the torchshard stage's
   weights copied in), torch's ``PipelineStage`` and ``Schedule1F1B`` with the loss divided
   by m and ``scale_grads=False`` (torchshard's scaling), ``torch.optim.AdamW`` per stage.
   Target: at most 1.05x.
3. **Speed against torchtitan's FSDP2 pipeline**, pp=2 x dp=2 (4 ranks), 1F1B, m=8: each
   stage ``fully_shard`` per block and on its root over the dp dimension of a 2-D
   ``DeviceMesh`` (``("pp", "dp")``, pp outermost as torchshard's grid), with
   ``reshard_after_forward=False`` (torchtitan's default when pipelining), then
   ``PipelineStage`` + ``Schedule1F1B``, AdamW (no clipping in either arm). torchshard ``shard=True`` (the same memory
   class: whole parameters through forward and backward, sharded optimizer state) against
   it; target at most 1.0x; ``shard=False`` for context. **4 processes on 2 cores are
   oversubscribed**: wall-clock ratios scatter; CPU time is printed beside it.

In parts 2 and 3 every configuration is built from the same weights, steps on the same
batches, and they are interleaved step by step in an order rotated every step; a step is
zero_grad + the schedule + the optimizer step, after a barrier; per step the max over
ranks; one paired ratio per step. The last stage's loss is compared with the peer's.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import format_table, fsdp2_api, machine_info, run_ranks, write_json
from report.freshness import hashes
from report.stats import spread_text, verdict
from torch import nn

import torchshard

fully_shard, _ = fsdp2_api()

DIM, BLOCKS = 256, 8  # width, blocks
ROWS, SPEED_ROWS = 1024, 128  # rows per microbatch: bubble (heavy chunks), speed
PP, V = 2, 2  # pipeline degree; stages per rank of the interleaved schedules
MICROBATCHES = (2, 4, 8)
BUBBLE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
INTERLEAVED = ("Interleaved1F1B", "LoopedBFS")
SPEED_M = 8
ADAMW = dict(lr=1e-4)
WITHIN = 0.05  # bubble: the target's distance from theory
CHECKS = (("ts.step / torch.step", 1.05), ("ts_shard.step / fsdp2_pp.step", 1.0))
now = time.perf_counter


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    """``BLOCKS`` blocks; a pipeline stage keeps some (a ``SparseModuleList``) and loops."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def meta_model() -> Stack:
    with torch.device("meta"):
        return Stack()


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def theory(schedule: str, m: int) -> float:
    v = V if schedule in INTERLEAVED else 1
    return (PP - 1) / (v * m + PP - 1)


def pipeline(schedule: str, m: int, shard: bool = False) -> torchshard.Pipeline:
    torch.manual_seed(0)
    pipe = torchshard.Pipeline(
        meta_model(), pp=PP, microbatches=m, loss_fn=loss_fn, schedule=schedule, shard=shard
    )
    pipe.make_optimizer(torch.optim.AdamW, **ADAMW)
    return pipe


def batches(n: int, m: int, rows: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(m * rows, DIM, generator=g) for _ in "xy") for _ in range(n)]  # type: ignore[misc]


# -- 1. bubble --------------------------------------------------------------------------------
class Busy:
    """Wraps a stage instance's ``forward_one_chunk`` and ``backward_one_chunk``: ``seconds``
    inside them since the last :meth:`reset`."""

    def __init__(self, stages: list) -> None:
        self.seconds = 0.0
        for st in stages:
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(st, name, self._timed(getattr(st, name)))

    def _timed(self, fn):  # type: ignore[no-untyped-def]
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += now() - t0

        return timed


def run_bubble(opts: argparse.Namespace) -> dict:
    """Every (schedule, m) on this rank, interleaved step by step: per step the bubble."""
    names = [(s, m) for m in MICROBATCHES for s in BUBBLE_SCHEDULES]
    pipes, busy, data, errors = {}, {}, {}, {}
    for s, m in names:
        key = f"{s} m={m}"
        try:
            pipes[key] = pipeline(s, m)
        except torchshard.PipelineError as e:
            errors[key] = str(e)
            continue
        busy[key] = Busy([h.stage for h in pipes[key].stages])
        data[key] = batches(opts.warmup + opts.bubble_steps, m, ROWS, 1000)
    keys = list(pipes)
    out: dict = {"bubble": {k: [] for k in keys}, "step": {k: [] for k in keys}, "errors": errors}
    for i in range(opts.warmup + opts.bubble_steps):
        k0 = i % len(keys)
        for key in keys[k0:] + keys[:k0]:
            pipe, x, y = pipes[key], *data[key][i]
            dist.barrier()
            pipe.zero_grad()
            busy[key].seconds = 0.0
            t0 = now()
            pipe.forward_backward(x, target=y)
            step = now() - t0
            pipe.step()
            if i >= opts.warmup:
                out["bubble"][key].append(1.0 - busy[key].seconds / step)
                out["step"][key].append(step)
    for pipe in pipes.values():
        pipe.close()
    out["p2p_s"] = ping_pong(opts.warmup + opts.bubble_steps)
    return out


def ping_pong(n: int) -> list[float]:
    """One-way seconds of a microbatch's activation (``ROWS x DIM`` fp32) between the two
    ranks on gloo: half a ping-pong's round trip, ``n`` times (what a stage waits per p2p
    on the critical path beyond theory)."""
    t, rank = torch.zeros(ROWS, DIM), dist.get_rank()
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = now()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        out.append((now() - t0) / 2)
    return out


def summarize_bubble(ranks: list[dict]) -> dict:
    keys = list(ranks[0]["bubble"])
    rows, out = [], {}
    for key in keys:
        s, m = key.split(" m=")
        th = theory(s, int(m))
        by_rank = [r["bubble"][key] for r in ranks]
        dev = [max(abs(b - th) for b in step) for step in zip(*by_rank)]
        out[key] = dict(schedule=s, m=int(m), theory=th, by_rank=by_rank, max_dev=dev,
                        verdict=verdict(dev, WITHIN))  # fmt: skip
        med = [sorted(b)[len(b) // 2] for b in by_rank]
        step = 1e3 * sorted(ranks[0]["step"][key])[len(ranks[0]["step"][key]) // 2]
        rows.append((key, f"{th:.3f}", *(spread_text(b, 3, "") for b in by_rank),
                     f"{max(abs(x - th) for x in med):.3f}", out[key]["verdict"],
                     f"{step:.0f}"))  # fmt: skip
    title = (
        f"\nbubble = 1 - busy/step per rank, pp={PP}, {BLOCKS} blocks of width {DIM}, "
        f"{ROWS} rows per microbatch; interleaved: {V} stages per rank; median (spread) over steps"
    )
    heads = [
        "schedule",
        "theory",
        *(f"rank {q}" for q in range(len(ranks))),
        "|med - th|",
        "<=0.05",
    ]
    print(format_table(heads, rows, title))
    below = {}
    for key in keys:
        s, m = key.split(" m=")
        base = f"1F1B m={m}"
        if s in INTERLEAVED and base in out:
            ratios = [
                max(a) / max(b)
                for a, b in zip(zip(*out[key]["by_rank"]), zip(*out[base]["by_rank"]))
            ]
            below[key] = dict(ratios=ratios, verdict=verdict(ratios, 1.0))
            print(f"{key} bubble / 1F1B m={m} (max over ranks, per step): "
                  f"{spread_text(ratios)}: {below[key]['verdict']}")  # fmt: skip
    for key, err in ranks[0]["errors"].items():
        print(f"{key}: {err}")
    p2p = ranks[0]["p2p_s"]
    print(
        f"p2p of one activation ({ROWS}x{DIM} fp32), one way: {spread_text([1e3 * x for x in p2p], 2, ' ms')}"
    )
    return dict(configs=out, below_1f1b=below, errors=ranks[0]["errors"], p2p_s=p2p)


# -- 2 and 3. speed -----------------------------------------------------------------------------
class Torch:
    """The same stages as plain modules in torch's ``PipelineStage`` + schedule (+ FSDP2)."""

    def __init__(self, like: torchshard.Pipeline, group, dp_mesh=None) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        (h,) = like.stages
        (mod,) = torchshard.split_stages(meta_model(), like.plan, [h.index])
        mod = mod.to_empty(device="cpu")
        mod.load_state_dict(h.fm.module.state_dict())
        if dp_mesh is not None:  # torchtitan: FSDP2 per block and on the stage's root
            if fully_shard is None:
                raise ImportError("fully_shard: neither torch.distributed.fsdp nor _composable")
            for b in mod.blocks:
                fully_shard(b, mesh=dp_mesh, reshard_after_forward=False)
            fully_shard(mod, mesh=dp_mesh, reshard_after_forward=False)
        self.is_first, self.is_last = like.is_first, like.is_last
        self.opt = torch.optim.AdamW(mod.parameters(), **ADAMW)
        stage = PipelineStage(mod, h.index, like.plan.num_stages, torch.device("cpu"), group=group)
        m = like.microbatches
        self.schedule = Schedule1F1B(
            stage, m, loss_fn=lambda o, y: loss_fn(o, y) / m, scale_grads=False
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad()
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *((x,) if self.is_first else ()),
            target=y if self.is_last else None,
            losses=losses if self.is_last else None,
        )
        self.opt.step()
        return float(sum(v.detach() for v in losses)) if self.is_last else float("nan")


class Ts:
    def __init__(self, pipe: torchshard.Pipeline) -> None:
        self.pipe = pipe

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.pipe.zero_grad()
        loss = self.pipe.forward_backward(x, target=y)
        self.pipe.step()
        return float(loss) if self.pipe.is_last else float("nan")


def run_speed(part: str, opts: argparse.Namespace) -> dict:
    """``"pp2"``: torchshard against torch by hand (2 ranks); ``"pp2dp2"``: torchshard
    (``shard=True``, ``False``) against FSDP2 per stage (4 ranks). Interleaved per step."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if part == "pp2":
        ts = pipeline("1F1B", SPEED_M)
        configs = {"ts": Ts(ts), "torch": Torch(ts, dist.group.WORLD)}
    else:
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        dmesh = init_device_mesh("cpu", (PP, world // PP), mesh_dim_names=("pp", "dp"))
        shard, repl = pipeline("1F1B", SPEED_M, True), pipeline("1F1B", SPEED_M, False)
        assert list(dmesh.get_coordinate()) == [shard.pp_rank, shard.dp_rank], "meshes disagree"
        peer = Torch(shard, dmesh["pp"].get_group(), dmesh["dp"])
        configs = {"ts_shard": Ts(shard), "fsdp2_pp": peer, "ts_repl": Ts(repl)}
        ts = shard
    dp_rank = ts.dp_rank
    data = batches(opts.warmup + opts.steps, SPEED_M, SPEED_ROWS, 2000 + dp_rank)
    names = list(configs)
    out: dict = {k: {n: [] for n in names} for k in ("wall", "cpu", "losses")}
    for i, (x, y) in enumerate(data):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            c0, t0 = time.process_time(), now()
            loss = configs[name].step(x, y)
            c1, t1 = time.process_time(), now()
            out["losses"][name].append(loss)
            if i >= opts.warmup:
                out["wall"][name].append(t1 - t0)
                out["cpu"][name].append(c1 - c0)
    for c in configs.values():
        if isinstance(c, Ts):
            c.pipe.close()
    return out


def per_step(ranks: list[dict], kind: str, name: str) -> list[float]:
    """One sample per step: the max over ranks."""
    return [max(x) for x in zip(*(r[kind][name] for r in ranks))]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def summarize_speed(part: str, ranks: list[dict]) -> dict:
    names = list(ranks[0]["wall"])
    base = "torch" if part == "pp2" else "fsdp2_pp"
    world = len(ranks)
    times = {n: {k: per_step(ranks, k, n) for k in ("wall", "cpu")} for n in names}
    diffs = {}
    for n in names:
        if n != base:  # the last stage's loss, on the ranks that hold it
            d = [abs(a - b) for r in ranks for a, b in zip(r["losses"][n], r["losses"][base])
                 if a == a and b == b]  # fmt: skip
            diffs[n] = max(d)
    rows = [
        (n, *(spread_text([1e3 * v for v in times[n][k]], 1, "") for k in ("wall", "cpu")),
         "-" if n == base else f"{diffs[n]:.2e}")
        for n in names
    ]  # fmt: skip
    over = world > cores()
    title = (
        f"\n{part}: {world} ranks ({PP} pp x {world // PP} dp) on {cores()} cores"
        + (" (OVERSUBSCRIBED: wall-clock ratios scatter)" if over else "")
        + f", 1F1B, m={SPEED_M} x {SPEED_ROWS} rows per dp rank; per step the max over ranks,"
        " median (p10-p90)"
    )
    print(format_table(["step time (ms)", "wall", "CPU", f"max |loss - {base}|"], rows, title))
    paired = {
        f"{n}.step / {base}.step": {
            k: [a / b for a, b in zip(times[n][k], times[base][k])] for k in ("wall", "cpu")
        }
        for n in names
        if n != base
    }
    rows = [(k, spread_text(v["wall"]), spread_text(v["cpu"])) for k, v in paired.items()]
    print(format_table(["paired step ratio", "wall", "CPU"], rows, "\nmedian (p10-p90) over steps"))
    return dict(world=world, oversubscribed=over, baseline=base, loss_diff=diffs, paired=paired)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per speed configuration")
    p.add_argument("--bubble-steps", type=int, default=10, help="timed steps per schedule and m")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds for each part")
    p.add_argument("--comm-timeout", type=float, default=120, help="gloo collective timeout (s)")
    p.add_argument("--parts", default="bubble,pp2,pp2dp2", help="a comma list: what to run")
    p.add_argument("--out", default="benchmarks/results/pipeline.json")
    opts = p.parse_args()
    t_start, machine, code = now(), machine_info(), hashes("pipeline")
    kw = dict(timeout_s=opts.timeout, comm_timeout_s=opts.comm_timeout)
    todo = opts.parts.split(",")
    bubble, parts, samples = {}, {}, {}
    if "bubble" in todo:
        samples["bubble"] = run_ranks(run_bubble, PP, opts, **kw)
        bubble = summarize_bubble(samples["bubble"])
    for part, world in (("pp2", PP), ("pp2dp2", 2 * PP)):
        if part not in todo:
            continue
        ranks = run_ranks(run_speed, world, part, opts, **kw)
        parts[part], samples[part] = summarize_speed(part, ranks), ranks
    paired = {k: v for s in parts.values() for k, v in s["paired"].items()}
    checks = {}
    for key, target in CHECKS:
        part = next((name for name, s in parts.items() if key in s["paired"]), None)
        if part is None:  # not run (--parts)
            continue
        v = verdict(paired[key]["wall"], target)
        if parts[part]["oversubscribed"] and not v.startswith("met"):
            v += f" ({parts[part]['world']} processes on {cores()} cores: oversubscribed)"
        checks[key] = {"kind": "wall", "target": target, "verdict": v}
        print(f"{key} (wall, <= {target}): {v}")
    load, total = os.getloadavg(), now() - t_start
    print(f"\ntotal {total:.0f} s; 1-min load {machine['loadavg'][0]:.1f} at start, "
          f"{load[0]:.1f} at end ({cores()} cores)")  # fmt: skip
    results = {"benchmark": "pipeline", "machine": machine, "measured": code, "args": vars(opts)}
    results.update(
        dim=DIM,
        blocks=BLOCKS,
        rows=ROWS,
        speed_rows=SPEED_ROWS,
        pp=PP,
        v=V,
        speed_m=SPEED_M,
        adamw=ADAMW,
    )
    results.update(cores=cores(), within=WITHIN, bubble=bubble, parts=parts, paired=paired)
    results.update(checks=checks, loadavg_end=list(load), total_s=total, samples_by_rank=samples)
    print(f"wrote {write_json(opts.out, results)}")


if __name__ == "__main__":
    main()
