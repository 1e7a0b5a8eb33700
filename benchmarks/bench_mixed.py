"""Parameters of several dtypes: a bf16 Llama that keeps its RMSNorm weights in fp32, trained
against DDP on the same model, 2 ranks on gloo (CPU), in every mode.

    python benchmarks/bench_mixed.py [--steps 30] [--warmup 3]
                                     [--out benchmarks/results/mixed.json]

The model: transformers' ``LlamaForCausalLM`` (:data:`SMALL`: 4 layers, hidden 128, vocab
2048; random init, seed 0) cast to bf16, then every norm module (``*norm*``: the RMSNorms)
cast back to fp32 explicitly (:func:`mixed_llama`; not through ``_keep_in_fp32_modules``).
Llama's RMSNorm multiplies its fp32 weight into the bf16 activations and so returns fp32;
a forward hook on each norm hands its output on in the dtype it came in (bf16), so the
bf16 linears after it get bf16 (the norm itself computes in fp32, as the model's own code
does). ``FlatParamModule`` keeps each parameter's dtype in one byte buffer
(``fm.dtypes == (bf16, fp32)``). Four configurations side by side in ONE pair of processes
(fresh, gloo, ``torch.set_num_threads(1)`` per rank), each built from the same weights,
every one stepping ``AdamW(lr=1e-3)`` on the same rank-specific batches (4 x 128 random
tokens, labels = inputs):

  ddp       torch DDP (defaults: 25 MiB buckets; it buckets by dtype) on the mixed model
  ts_repl   ``DistributedTrainer(FlatParamModule(model))`` + ``make_optimizer``
  ts_shard  the same with ``shard=True`` (one fp32 master over the rank's slice, the fp32
            norms' elements too)
  ts_full   the same with ``shard="full"`` (``units="auto"``: a unit per decoder layer)

1. Speed, measured: a training step (zero_grad + forward + backward + gradient reduction +
   AdamW step, after a barrier; wall-clock and process CPU time) of every configuration,
   interleaved step by step in an order rotated every step (none is always first). Per step
   the max over ranks; a paired ratio is ts_*/ddp of the same step index: their median and
   p10-p90 (target: the replicated mode <= 1.0x DDP; the other modes are information).
2. Correctness, measured: every step's loss beside DDP's, the max absolute difference over
   steps and ranks. The replicated mode steps the bf16 parameters themselves, as DDP's
   AdamW does: identical. The sharded modes step fp32 masters of the bf16 parameters and
   round back: they drift from DDP after the first step (information).
3. Memory, measured: after the timed steps, ``trainer.memory_stats()`` on every rank. The
   gradients beside the trainable parameters' bytes, each in its own dtype (target: the
   replicated mode <= 1.01x; the others information; the fully sharded mode keeps a mixed
   model's stripe and its gradient in the fp32 master, ``gradients`` 0: its gradient is
   half the master). The parameters beside the same model cast to fp32
   (``FlatParamModule(model, dtype=torch.float32)``: what a user had to do before), from the
   layouts (``layout.nbytes``) and per rank from ``plan_memory`` of the fp32 layout; the
   persistent bytes (parameters, gradients, optimizer, master) per rank beside the fp32
   twin's plan. ``plan_memory`` of the mixed layout beside every measured rank (reported,
   not asserted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from _common import fmt_bytes, format_table, machine_info, run_ranks, write_json
from _interleaved import (
    ADAMW,
    BATCH,
    BLOCK,
    CONFIGS,
    FIELDS,
    MODES,
    SMALL,
    WORLD,
    Stepper,
    gradient_bytes,
    loss_diff,
    per_step,
    run_configs,
    speed_report,
)
from report.freshness import hashes
from report.stats import verdict

from torchshard import FlatParamModule, plan_memory

DTYPE, KEEP, KEEP_DTYPE = torch.bfloat16, "norm", torch.float32  # bf16; *norm* modules fp32
TARGET_STEP = 1.0  # ts_repl / ddp, median step time
TARGET_BYTES = 1.01  # replicated gradients / trainable bytes in their own dtypes
now = time.perf_counter


def _same_dtype_out(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """A norm's output in the dtype its input came in (Llama's RMSNorm returns its fp32
    weight times the bf16 activations: fp32, which the bf16 linears after it refuse)."""
    return out.to(args[0].dtype)


def mixed_llama(meta: bool = False) -> torch.nn.Module:
    """transformers' Llama (seed 0) in bf16 with every norm module's parameters in fp32,
    cast explicitly; on meta if ``meta``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SMALL, use_cache=False)
    with torch.device("meta" if meta else "cpu"):
        model = LlamaForCausalLM(cfg).to(DTYPE)
    for name, module in model.named_modules():
        if KEEP in name.rsplit(".", 1)[-1]:
            module.to(KEEP_DTYPE)
            module.register_forward_hook(_same_dtype_out)
    for name, p in model.named_parameters():
        assert p.dtype == (KEEP_DTYPE if KEEP in name else DTYPE), (name, p.dtype)
    return model


def trainable_bytes(model: torch.nn.Module) -> dict[str, int]:
    """The trainable parameters' bytes, each in its own dtype, by dtype."""
    out: dict[str, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            key = str(p.dtype).removeprefix("torch.")
            out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


class Config(Stepper):
    """One configuration: the mixed model in DDP or a trainer, and its AdamW."""

    def __init__(self, name: str) -> None:
        model = mixed_llama()
        self.trainable = trainable_bytes(model)
        super().__init__(name, model, None if name == "ddp" else MODES[name], ADAMW)
        if self.trainer is not None:
            fm = self.trainer.module
            assert fm.dtype == torch.uint8 and fm.dtypes == (DTYPE, KEEP_DTYPE), fm.dtypes

    def memory(self) -> dict:
        """memory_stats() on this rank beside plan_memory of the same layout."""
        fm, trainer = self.net, self.trainer
        units = trainer.units or None
        plan = plan_memory(fm.layout, WORLD, shard=trainer.shard, units=units)
        return {
            "memory_stats": {k: getattr(trainer.memory_stats(), k) for k in FIELDS},
            "plan_memory": plan[dist.get_rank()].as_dict(),
            "trainable_bytes_by_dtype": self.trainable,
            "dtypes": [str(d).removeprefix("torch.") for d in fm.dtypes],
            "layout_nbytes": fm.layout.nbytes,
            "grad_layout_nbytes": fm.layout.grad_layout.nbytes,
            "numel": sum(s.numel for s in fm.layout.slots),
        }


def run(opts: argparse.Namespace) -> dict:
    """Every configuration on this rank, interleaved step by step: times, losses, memory."""
    return run_configs(Config, opts)


def fp32_twin() -> dict:
    """The same model cast to fp32 (``FlatParamModule(model, dtype=torch.float32)``, on
    meta): its layout's bytes and ``plan_memory`` per mode and rank."""
    fm = FlatParamModule(mixed_llama(meta=True), dtype=torch.float32)
    plans = {n: [p.as_dict() for p in plan_memory(fm.layout, WORLD, shard=s)] for n, s in MODES.items()}  # fmt: skip
    return {"layout_nbytes": fm.layout.nbytes, "numel": fm.layout.numel, "plans": plans}


def measured_memory(ranks: list[dict], twin: dict) -> dict:
    """Per mode: every rank's memory_stats() against the trainable bytes, the fp32 twin's
    plan and the mixed layout's plan."""
    out = {}
    for name in MODES:
        by_rank = [r["memory"][name] for r in ranks]
        m0 = by_rank[0]
        trainable = sum(m0["trainable_bytes_by_dtype"].values())
        grads = [gradient_bytes(m["memory_stats"]) for m in by_rank]
        params = [m["memory_stats"]["parameters"] for m in by_rank]
        persistent = [sum(m["memory_stats"][k] for k in FIELDS) for m in by_rank]
        planned = [sum(m["plan_memory"][k] for k in FIELDS) for m in by_rank]
        fp32_plans = twin["plans"][name]
        fp32_persistent = [sum(p[k] for k in FIELDS) for p in fp32_plans]
        out[name] = {
            "by_rank": by_rank,
            "trainable_bytes": trainable,
            "gradients_by_rank": grads,
            "gradients_max": max(grads),
            "gradients_vs_trainable": max(grads) / trainable,
            "parameters_by_rank": params,
            "fp32_parameters_by_rank": [p["parameters"] for p in fp32_plans],
            "persistent_by_rank": persistent,
            "plan_persistent_by_rank": planned,
            "fp32_persistent_by_rank": fp32_persistent,
            "persistent_vs_fp32": max(persistent) / max(fp32_persistent),
            "optimizer_max": max(m["memory_stats"]["optimizer"] for m in by_rank),
            "master_max": max(m["memory_stats"]["master"] for m in by_rank),
            "plan_equal": all(
                m["memory_stats"] == {k: m["plan_memory"][k] for k in FIELDS} for m in by_rank
            ),
            "plan_differs": [  # the fields where plan_memory differs on some rank
                k
                for k in FIELDS
                if any(m["memory_stats"][k] != m["plan_memory"][k] for m in by_rank)
            ],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds for the ranks")
    p.add_argument("--out", default="benchmarks/results/mixed.json")
    opts = p.parse_args()
    t_start, machine, code = now(), machine_info(), hashes("mixed")
    ranks = run_ranks(run, WORLD, opts, timeout_s=opts.timeout)

    title = (
        f"\n{WORLD} ranks, gloo, 1 thread/rank, Llama (hidden {SMALL['hidden_size']}, "
        f"{SMALL['num_hidden_layers']} layers) in bf16 with fp32 norms, {BATCH}x{BLOCK} "
        f"tokens/rank, AdamW; {opts.steps} steps (+{opts.warmup} warm-up) of each, "
        "interleaved; per step the max over ranks, median (p10-p90)"
    )
    paired = speed_report(ranks, CONFIGS, list(MODES), title)

    twin = fp32_twin()
    memory = measured_memory(ranks, twin)
    m0 = memory["ts_repl"]["by_rank"][0]
    params_ratio = m0["layout_nbytes"] / twin["layout_nbytes"]
    rows = [
        (name, " / ".join(fmt_bytes(g) for g in m["gradients_by_rank"]),
         f"{m['gradients_vs_trainable']:.3f}x",
         " / ".join(fmt_bytes(g) for g in m["parameters_by_rank"]),
         " / ".join(fmt_bytes(g) for g in m["fp32_parameters_by_rank"]),
         fmt_bytes(m["master_max"]), fmt_bytes(m["optimizer_max"]),
         " / ".join(fmt_bytes(g) for g in m["persistent_by_rank"]),
         f"{m['persistent_vs_fp32']:.3f}x",
         "yes" if m["plan_equal"] else f"NO: {', '.join(m['plan_differs'])}")
        for name, m in memory.items()
    ]  # fmt: skip
    headers = ["memory", "gradients r0 / r1", "/trainable", "parameters r0 / r1", "fp32 twin",
               "master (max)", "optimizer (max)", "persistent r0 / r1", "/fp32 twin",
               "= plan"]  # fmt: skip
    by_dtype = ", ".join(f"{fmt_bytes(b)} {d}" for d, b in m0["trainable_bytes_by_dtype"].items())
    title = (
        f"\nmemory_stats() after the steps; {m0['numel']:,} elements, all trainable "
        f"({by_dtype}); fp32 twin: plan_memory of the same model cast to fp32"
    )
    print(format_table(headers, rows, title))
    rows = [
        (name, " / ".join(fmt_bytes(g) for g in m["persistent_by_rank"]),
         " / ".join(fmt_bytes(g) for g in m["plan_persistent_by_rank"]),
         ", ".join(m["plan_differs"]) or "-")
        for name, m in memory.items()
    ]  # fmt: skip
    headers = ["persistent", "memory_stats() r0 / r1", "plan_memory() r0 / r1", "differ"]
    print(
        format_table(
            headers, rows, "\nthe mixed layout: measured vs plan_memory (reported, not asserted)"
        )
    )
    print(
        f"\nparameters, layouts: mixed {fmt_bytes(m0['layout_nbytes'])} vs fp32 "
        f"{fmt_bytes(twin['layout_nbytes'])}: {params_ratio:.3f}x"
    )

    targets = {}
    key = "ts_repl.gradients_vs_trainable"
    ratio = memory["ts_repl"]["gradients_vs_trainable"]
    ok = ratio <= TARGET_BYTES
    targets[key] = {"ratio": ratio, "target": TARGET_BYTES, "met": ok}
    print(f"{key} = {ratio:.4f} (<= {TARGET_BYTES}): {'met' if ok else 'MISSED'}")
    key = "ts_repl.step / ddp.step"
    v = verdict(paired[key]["wall"], TARGET_STEP)
    targets[key] = {"target": TARGET_STEP, "verdict": v}
    print(f"{key} (wall, <= {TARGET_STEP}): {v}")
    diff = loss_diff(ranks, "ts_repl")
    targets["ts_repl.loss_diff_vs_ddp"] = {"target": 0.0, "max_abs": diff, "met": diff == 0.0}
    print(f"ts_repl: max |loss - DDP| = {diff:.2e} (identical: {'yes' if diff == 0 else 'NO'})")
    summary = {
        name: {
            "median_seconds": {
                k: statistics.median(per_step(ranks, k, name)) for k in ("wall", "cpu")
            },
            "max_abs_loss_diff_vs_ddp": loss_diff(ranks, name),
        }
        for name in CONFIGS
    }
    load, total = os.getloadavg(), now() - t_start
    print(f"\ntotal {total:.0f} s; 1-min load {machine['loadavg'][0]:.1f} at start, "
          f"{load[0]:.1f} at end ({os.cpu_count()} CPUs)")  # fmt: skip
    results = {"benchmark": "mixed", "machine": machine, "measured": code, "args": vars(opts)}
    results.update(world_size=WORLD, threads_per_rank=1, model=SMALL, dtypes=m0["dtypes"])
    results.update(batch=BATCH, block=BLOCK, adamw=ADAMW, summary=summary, paired=paired)
    results.update(targets=targets, memory=memory, loadavg_end=list(load), total_s=total)
    results.update(
        parameters={
            "mixed_layout_nbytes": m0["layout_nbytes"],
            "fp32_layout_nbytes": twin["layout_nbytes"],
            "mixed_vs_fp32": params_ratio,
        },
        fp32_twin=twin,
    )
    results.update(samples_by_rank=[{k: r[k] for k in ("wall", "cpu", "losses")} for r in ranks])
    print(f"wrote {write_json(opts.out, results)}")


if __name__ == "__main__":
    main()
