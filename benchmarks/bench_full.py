"""The fully sharded mode (``shard="full"``) beyond 2 ranks: peak RSS at 4 ranks against the
replicated mode (and FSDP2), and the gloo collectives that gather and reduce-scatter a unit.

    python benchmarks/bench_full.py [--mem-pairs 2] [--mem-steps 2] [--fsdp2]
                                    [--reps 20] [--warmup 2] [--worlds 2,3,4]
                                    [--out benchmarks/results/full.json]

Every rank is a fresh process (spawn), gloo over loopback, ``torch.set_num_threads(1)``.
4 ranks on the project's 2-core machine share 2 cores: times at 3 and 4 ranks include
waiting for a core, which is why the collectives are compared in pairs, never alone.

1. **Memory at 4 ranks.** The example's GPT at n_layer 11, n_embd 512, n_head 8 (34.9M
   parameters, fp32, byte vocabulary, tied embedding and head), built on meta and
   initialized by the trainer (``init_fn=init_gpt_weights``), so the fully sharded mode
   never holds the whole model: ``DistributedTrainer(fm)`` (replicated) and
   ``DistributedTrainer(fm, shard="full")`` (units: the 11 blocks), AdamW from
   ``make_optimizer``, ``--mem-steps`` steps of 1 x 64 tokens per rank (activations small
   beside the weights). With ``--fsdp2`` (not in run_all.py: time) FSDP2 too: ``fully_shard``
   per block and on the root (ZeRO-3) on the meta model, ``to_empty``, the same initializer,
   AdamW. Each mode runs in its own fresh 4 processes (a peak cannot be undone in a
   process), ``--mem-pairs`` rounds, the order rotated every round, under two allocator
   settings (:data:`ALLOCATORS`): glibc as it comes, and ``MALLOC_MMAP_THRESHOLD_=131072``
   (freed tensors of 128 KiB or more go back to the kernel, so the RSS follows the live
   tensors; the fully sharded mode frees and allocates its unit buffers every step, which
   the default adaptive threshold can leave resident). Per rank: the peak RSS from before the
   model is built to after the last step, minus the RSS before (``PeakRSS``: the kernel's
   high-water mark reset first, exact on Linux; the ``ru_maxrss`` growth is recorded beside
   it). Per round: the fully sharded rank's growth over the replicated rank's, the max over
   ranks. Target: <= 0.5 (issue 13). Each trainer's ``memory_bytes()`` and ``plan_memory()``
   are recorded beside it.
2. **gloo collectives for one unit.** The fully sharded mode's two gloo strategies (an
   internal choice, ``FullyShard.native_gloo``; no public option yet):
   ``"owner"`` gathers a unit with one ``broadcast`` per owner and reduce-scatters its
   gradient with one ``reduce`` per owner (all launched, then waited for); ``"native"`` calls
   ``all_gather_single`` (in place: the rank's stripe is its input) and
   ``reduce_scatter_single``. The same calls as the fully sharded mode makes, on a buffer of
   a GPT-2 small block (7.1M fp32 elements) and of the benchmark GPT's block (198K), padded
   to equal stripes, at each of ``--worlds``. Every repetition times a gather and then a
   reduce-scatter with each strategy, in an order rotated every repetition, after a barrier;
   per repetition the max over ranks; the paired ratio owner / native per repetition (wall
   and process CPU time). The faster strategy at a world size is the one that wins at least
   80% of the pairs; otherwise it is unclear.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from _common import (
    PeakRSS,
    add_examples_to_path,
    fmt_bytes,
    format_table,
    fsdp2_api,
    machine_info,
    rss_bytes,
    run_ranks,
    write_json,
)
from report.freshness import hashes
from report.stats import spread_text, verdict

from torchshard import DistributedTrainer, FlatParamModule, plan_memory

fully_shard, DTensor = fsdp2_api()

add_examples_to_path()
from gpt import GPT, GPTConfig, init_gpt_weights  # noqa: E402

MEM_WORLD = 4
MEM_MODEL = dict(vocab_size=256, block_size=128, n_layer=11, n_head=8, n_embd=512)
MEM_BATCH, MEM_BLOCK = 1, 64
MEM_MODES = ("replicated", "full", "fsdp2")
MEM_TARGET = 0.5  # fully sharded peak RSS growth per rank / replicated, at 4 ranks
# glibc as it comes (freed blocks below an adaptive mmap threshold, up to 32 MiB, stay in the
# heap: a unit buffer freed and allocated again every step can fragment it), and a fixed
# 128 KiB threshold (every freed tensor of 128 KiB or more goes back to the kernel: the RSS
# follows the live tensors). Set before each rank starts (glibc reads it before Python runs).
ALLOCATORS = {"glibc": {}, "mmap_128k": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
ADAMW = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
# one unit: a GPT-2 small block (12 d^2 + 13 d at d = 768) and the benchmark GPT's (d = 128)
UNITS = {"gpt2_block": 12 * 768**2 + 13 * 768, "small_block": 12 * 128**2 + 13 * 128}
STRATEGIES = ("owner", "native")
PHASES = ("gather", "reduce_scatter")
KINDS = ("wall", "cpu")
ALIGN = 16  # elements per stripe multiple (64 bytes of fp32)
now = time.perf_counter


# -- 1. memory at 4 ranks ------------------------------------------------------------------------
def ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def local_bytes(tensors: object) -> int:
    """Bytes of the tensors on this rank (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:  # type: ignore[attr-defined]
        t = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def mem_worker(mode: str, steps: int) -> dict:
    """Build, initialize and train the 34.9M GPT in ``mode`` on this rank; the peak RSS growth."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [
        torch.randint(0, MEM_MODEL["vocab_size"], (MEM_BATCH, MEM_BLOCK + 1), generator=gen)
        for _ in range(steps)
    ]
    out: dict = {"rank": rank, "mode": mode}
    ru0 = ru_maxrss_bytes()
    times = []
    with PeakRSS() as peak:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(GPTConfig(**MEM_MODEL))
        out["n_params"] = sum(p.numel() for p in model.parameters())
        trainer = None
        if mode == "fsdp2":
            if fully_shard is None:
                raise ImportError("fully_shard: neither torch.distributed.fsdp nor _composable")
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            model.to_empty(device="cpu")
            model.apply(init_gpt_weights)
            out["tied"] = model.lm_head.weight is model.wte.weight
            net = model
            opt = torch.optim.AdamW(model.parameters(), **ADAMW)
            zero, update = opt.zero_grad, opt.step
        else:
            fm = FlatParamModule(model)
            shard = "full" if mode == "full" else False
            trainer = DistributedTrainer(fm, shard=shard, init_fn=init_gpt_weights)
            net = fm
            opt = trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
            zero, update = trainer.zero_grad, trainer.step
        out["built_rss_growth"] = rss_bytes() - peak.before
        for tokens in batches:
            t0 = now()
            zero()
            loss = net(tokens[:, :-1], tokens[:, 1:])[1]
            loss.backward()
            update()
            times.append(now() - t0)
    out.update(peak_rss_growth=peak.increase, exact=peak.exact, rss_before=peak.before)
    out.update(ru_maxrss_growth=ru_maxrss_bytes() - ru0, rss_after=rss_bytes(), step_s=times)
    out["loss"] = loss.item()
    if trainer is not None:
        out["memory_bytes"] = trainer.memory_bytes()
        layout = trainer.module.layout
        out["plan_memory"] = plan_memory(layout, MEM_WORLD, shard=trainer.shard)[rank].as_dict()
        trainer.close()
    else:
        state = [v for s in opt.state.values() for v in s.values()]
        out["local_bytes"] = {
            "parameters": local_bytes(model.parameters()),
            "optimizer": local_bytes(state),
        }
    return out


def memory(opts: argparse.Namespace) -> dict:
    """Per allocator setting: ``--mem-pairs`` rounds of one fresh 4-rank launch per mode,
    the order rotated every round; the paired ratios to the replicated mode."""
    modes = [m for m in MEM_MODES if m != "fsdp2" or opts.fsdp2]
    out: dict = {}
    for alloc, env in ALLOCATORS.items():
        rounds: list[dict] = []
        errors: dict[str, str] = {}
        for i in range(opts.mem_pairs):
            k = i % len(modes)
            launch = {}
            for mode in modes[k:] + modes[:k]:
                if mode in errors:
                    continue
                t0 = now()
                try:
                    ranks = run_ranks(
                        mem_worker, MEM_WORLD, mode, opts.mem_steps, env=env, timeout_s=600
                    )
                except Exception as e:  # FSDP2 on an old torch, say: reported, not fatal
                    if mode != "fsdp2":
                        raise
                    errors[mode] = f"{type(e).__name__}: {e}".strip()[:2000]
                    continue
                launch[mode] = {"ranks": ranks, "wall_s": now() - t0}
                print(f"memory, {alloc}, round {i}: {mode} in {now() - t0:.0f} s", flush=True)
            rounds.append(launch)
        paired: dict[str, list[float]] = {}
        for mode in ("full", "fsdp2"):
            ratios = [
                max(
                    a["peak_rss_growth"] / b["peak_rss_growth"]
                    for a, b in zip(r[mode]["ranks"], r["replicated"]["ranks"])
                )
                for r in rounds
                if mode in r and "replicated" in r
            ]
            if ratios:
                paired[f"{mode} / replicated"] = ratios
        growth = {
            mode: [max(x["peak_rss_growth"] for x in r[mode]["ranks"]) for r in rounds if mode in r]
            for mode in modes
            if mode not in errors
        }
        out[alloc] = {
            "env": env,
            "rounds": rounds,
            "paired": paired,
            "max_growth_by_round": growth,
            "errors": errors,
        }
    return out


# -- 2. gloo collectives for one unit --------------------------------------------------------------
def gather(strategy: str, buf: torch.Tensor, n: int) -> None:
    """Unit ``buf`` whole from every rank's stripe of ``n`` elements (the fully sharded
    mode's calls)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if strategy == "native":
        works = [dist.all_gather_single(buf, buf[rank * n : (rank + 1) * n], async_op=True)]
    else:
        works = [dist.broadcast(buf[q * n : (q + 1) * n], q, async_op=True) for q in range(world)]
    for w in works:
        w.wait()


def reduce_scatter(strategy: str, grad: torch.Tensor, out: torch.Tensor, n: int) -> None:
    """Stripe ``rank`` of the sum of every rank's ``grad`` (the fully sharded mode's calls)."""
    world = dist.get_world_size()
    op = dist.ReduceOp.SUM
    if strategy == "native":
        works = [dist.reduce_scatter_single(out, grad, op=op, async_op=True)]
    else:
        works = [
            dist.reduce(grad[q * n : (q + 1) * n], q, op=op, async_op=True) for q in range(world)
        ]
    for w in works:
        w.wait()


def collectives_worker(reps: int, warmup: int) -> dict:
    """Per unit size and strategy: (wall, cpu) of a gather and of a reduce-scatter, per rep."""
    world = dist.get_world_size()
    out: dict = {}
    for unit, numel in UNITS.items():
        n = -(-numel // (world * ALIGN)) * ALIGN  # a stripe, padded as unit_geometry pads
        buf = torch.zeros(n * world)
        grad = torch.empty(n * world)
        stripe = torch.empty(n)
        samples = {f"{s}.{phase}": {k: [] for k in KINDS} for s in STRATEGIES for phase in PHASES}
        for i in range(warmup + reps):
            k = i % len(STRATEGIES)
            for s in STRATEGIES[k:] + STRATEGIES[:k]:
                grad.fill_(1.0)  # reduce leaves non-roots' inputs undefined: a fresh gradient
                dist.barrier()
                c0, t0 = time.process_time(), now()
                gather(s, buf, n)
                c1, t1 = time.process_time(), now()
                reduce_scatter(s, grad, stripe, n)
                c2, t2 = time.process_time(), now()
                if i >= warmup:
                    samples[f"{s}.gather"]["wall"].append(t1 - t0)
                    samples[f"{s}.gather"]["cpu"].append(c1 - c0)
                    samples[f"{s}.reduce_scatter"]["wall"].append(t2 - t1)
                    samples[f"{s}.reduce_scatter"]["cpu"].append(c2 - c1)
        out[unit] = {"numel": numel, "stripe": n, "samples": samples}
    return out


def per_rep(ranks: list[dict], unit: str, key: str, kind: str) -> list[float]:
    """One sample per repetition: the max over ranks."""
    return [max(x) for x in zip(*(r[unit]["samples"][key][kind] for r in ranks))]


def collectives(opts: argparse.Namespace) -> dict:
    """Every world size of ``--worlds``: samples by rank, and the paired ratios owner/native."""
    by_world = {}
    for world in opts.worlds:
        t0 = now()
        ranks = run_ranks(collectives_worker, world, opts.reps, opts.warmup, timeout_s=600)
        print(f"collectives at {world} ranks in {now() - t0:.0f} s", flush=True)
        units = {}
        for unit in UNITS:
            seconds = {
                f"{s}.{phase}": {kind: per_rep(ranks, unit, f"{s}.{phase}", kind) for kind in KINDS}
                for s in STRATEGIES
                for phase in PHASES
            }
            for s in STRATEGIES:
                seconds[f"{s}.both"] = {
                    kind: [sum(x) for x in zip(*(seconds[f"{s}.{ph}"][kind] for ph in PHASES))]
                    for kind in KINDS
                }
            paired = {
                phase: {
                    kind: [
                        a / b
                        for a, b in zip(
                            seconds[f"owner.{phase}"][kind], seconds[f"native.{phase}"][kind]
                        )
                    ]
                    for kind in KINDS
                }
                for phase in (*PHASES, "both")
            }
            units[unit] = {
                "numel": ranks[0][unit]["numel"],
                "stripe": ranks[0][unit]["stripe"],
                "seconds": seconds,  # per repetition, the max over ranks
                "paired": paired,  # owner / native, per repetition
                "faster": faster(paired["both"]["wall"]),
            }
        by_world[str(world)] = {"units": units, "wall_s": now() - t0, "samples_by_rank": ranks}
    return by_world


def faster(ratios: list[float]) -> str:
    """``owner`` / ``native`` when it wins at least 80% of the pairs (owner / native below 1 /
    above 1), else ``unclear``: the rule the summary's verdicts use."""
    words = verdict(ratios, 1.0).split()[0]
    return {"met": "owner", "missed": "native"}.get(words, "unclear")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mem-pairs", type=int, default=2, help="rounds of fresh launches per mode")
    p.add_argument("--mem-steps", type=int, default=2, help="training steps per memory launch")
    p.add_argument("--fsdp2", action="store_true", help="FSDP2 ZeRO-3 in the memory rounds too")
    p.add_argument("--reps", type=int, default=20, help="timed collective repetitions")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worlds", default="2,3,4", help="world sizes for the collectives")
    p.add_argument("--out", default="benchmarks/results/full.json")
    opts = p.parse_args()
    opts.worlds = [int(w) for w in opts.worlds.split(",")]
    t_start, machine, code = now(), machine_info(), hashes("full")

    mem = memory(opts)
    first = mem["glibc"]["rounds"][0]
    n_params = first["replicated"]["ranks"][0]["n_params"]
    rows = []
    for alloc, m in mem.items():
        for mode, growth in m["max_growth_by_round"].items():
            ranks = m["rounds"][0][mode]["ranks"]
            mb = ranks[0].get("memory_bytes")
            steps = [
                t for r in m["rounds"] if mode in r for x in r[mode]["ranks"] for t in x["step_s"]
            ]
            rows.append((f"{mode}, {alloc}", " / ".join(fmt_bytes(g) for g in growth),
                         fmt_bytes(sum(mb.values())) if mb else "-",
                         f"{statistics.median(steps):.2f}"))  # fmt: skip
        for mode, err in m["errors"].items():
            rows.append((f"{mode}, {alloc}", "ERROR: " + err.splitlines()[0], "-", "-"))
    title = (
        f"\n{MEM_WORLD} ranks, gloo, 1 thread/rank, GPT {MEM_MODEL} ({n_params / 1e6:.1f}M "
        f"parameters, fp32), AdamW, {opts.mem_steps} steps of {MEM_BATCH}x{MEM_BLOCK} tokens; "
        "a fresh launch per mode and round"
    )
    headers = ["memory", "peak RSS growth, max over ranks, by round", "memory_bytes()", "step s"]
    print(format_table(headers, rows, title))
    rows = [
        (f"{k}, {alloc}", spread_text(v), verdict(v, MEM_TARGET))
        for alloc, m in mem.items()
        for k, v in m["paired"].items()
    ]
    headers = ["peak RSS growth per rank", "paired (max over ranks)", f"<= {MEM_TARGET}"]
    print(format_table(headers, rows))

    coll = collectives(opts)
    rows = []
    for world, w in coll.items():
        for unit, u in w["units"].items():
            p_ = u["paired"]
            rows.append((f"{world} ranks, {unit} ({u['numel'] / 1e6:.2f}M)",
                         spread_text(p_["both"]["wall"]), spread_text(p_["both"]["cpu"]),
                         spread_text(p_["gather"]["wall"]),
                         spread_text(p_["reduce_scatter"]["wall"]), u["faster"]))  # fmt: skip
    headers = ["owner / native", "gather+RS wall", "CPU", "gather wall", "RS wall", "faster"]
    title = (
        f"\ngloo, one unit of fp32: one broadcast/reduce per owner vs all_gather_single/"
        f"reduce_scatter_single; {opts.reps} repetitions (+{opts.warmup}), paired, max over ranks"
    )
    print(format_table(headers, rows, title))

    load, total = os.getloadavg(), now() - t_start
    print(f"\ntotal {total:.0f} s; 1-min load {machine['loadavg'][0]:.1f} at start, "
          f"{load[0]:.1f} at end ({os.cpu_count()} CPUs)")  # fmt: skip
    results = {"benchmark": "full", "machine": machine, "measured": code, "args": vars(opts)}
    results["threads_per_rank"] = 1
    results["memory"] = {
        "world_size": MEM_WORLD,
        "model": MEM_MODEL,
        "n_params": n_params,
        "batch": MEM_BATCH,
        "block": MEM_BLOCK,
        "adamw": ADAMW,
        "target": MEM_TARGET,
        "by_allocator": mem,
    }
    results["collectives"] = {"units": UNITS, "strategies": STRATEGIES, "by_world": coll}
    results.update(loadavg_end=list(load), total_s=total)
    print(f"wrote {write_json(opts.out, results)}")


if __name__ == "__main__":
    main()
