"""LoRA (issue 21): frozen parameters cost no gradient or optimizer state, and a LoRA step
against DDP, 2 ranks on gloo (CPU); and a LoRA 7B Llama's gradients per rank, computed.

    python benchmarks/bench_lora.py [--steps 30] [--warmup 3] [--world-7b 8]
                                    [--out benchmarks/results/lora.json]

The model: transformers' ``LlamaForCausalLM`` (:data:`SMALL`: 4 layers, hidden 128, vocab
2048, fp32) wrapped by ``peft.get_peft_model`` with LoRA r=8 on ``q_proj`` and ``v_proj``
(:data:`LORA`): the base weights frozen, 16K of 1.3M parameters train. Four configurations side
by side in ONE pair of processes (fresh, gloo, ``torch.set_num_threads(1)`` per rank), each
built from the same weights (seed 0), every one stepping ``AdamW(lr=1e-3)`` over the
trainable parameters on the same rank-specific batches (4 x 128 random tokens, labels =
inputs):

  ddp       torch DDP (defaults: 25 MiB buckets) on the PEFT model
  ts_repl   ``DistributedTrainer(FlatParamModule(peft_model))`` + ``make_optimizer``
  ts_shard  the same with ``shard=True``
  ts_full   the same with ``shard="full"`` (``units="auto"``: a unit per decoder layer)

1. Memory, measured: after the timed steps, ``trainer.memory_stats()`` on every rank, beside
   the trainable elements x itemsize (the trainable parameters' gradient: target <= 1.01x on
   every rank, in every mode), the optimizer state beside 8 bytes (AdamW's two fp32 states)
   per trainable element (<= 1.01x: Adam's ``step`` scalars on top), and ``plan_memory`` of
   the same layout. "Before": the gradient frozen parameters had before they cost none,
   ``plan_memory``'s gradients for the same model with every parameter trainable (replicated:
   the whole flat buffer, ``layout.numel x itemsize``, also recorded; ``shard=True``: that
   padded to the world size; the fully sharded mode: the rank's stripe of every unit); the
   ratio before / after, on the worst rank of each.
2. Memory, computed: Llama-2-7B (:data:`LLAMA_7B`) with LoRA r=16 on ``q_proj`` and
   ``v_proj`` (:data:`LORA_7B`), built on meta (nothing allocated), laid out in bf16;
   ``plan_memory`` per rank at ``--world-7b`` ranks in each mode, of this layout and of the
   same model with every parameter trainable (before). The fully sharded mode keeps a bf16
   model's trainable stripes and their gradient in the fp32 master (``gradients`` 0; its
   frozen stripes in bf16, under ``parameters``): the gradient is half the ``master``
   (``_interleaved.gradient_bytes``).
3. Speed, measured: a training step (zero_grad + forward + backward + gradient reduction +
   AdamW step, after a barrier; wall-clock and process CPU time) of every configuration,
   interleaved step by step in an order rotated every step (none is always first). Per step
   the max over ranks; a paired ratio is ts_*/ddp of the same step index: their median and
   p10-p90 (target: the replicated mode <= 1.0x DDP; the other modes are information).
   Losses of every step are compared with DDP's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

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

LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
LLAMA_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
)
LORA_7B = dict(LORA, r=16, lora_alpha=32)
TARGET_STEP = 1.0  # ts_repl / ddp, median step time
TARGET_BYTES = 1.01  # gradients / (trainable x itemsize); optimizer / (8 x trainable)
now = time.perf_counter


def peft_llama(config: dict, lora: dict, meta: bool = False, all_trainable: bool = False):
    """transformers' Llama with PEFT LoRA adapters (seed 0), on meta if ``meta``;
    ``all_trainable``: every parameter trains (the "before" twin of the same layout)."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft's call

    torch.manual_seed(0)
    cfg = LlamaConfig(**config, use_cache=False)
    with torch.device("meta" if meta else "cpu"):
        model = peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(**lora))
    if all_trainable:
        model.requires_grad_(True)
    return model


def trainable_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def before_plans(config: dict, lora: dict, dtype: torch.dtype | None, world: int) -> dict:
    """``plan_memory`` per mode and rank of the same model with every parameter trainable:
    the gradient space frozen parameters had before they cost none."""
    fm = FlatParamModule(peft_llama(config, lora, meta=True, all_trainable=True), dtype=dtype)
    return {
        n: [p.as_dict() for p in plan_memory(fm.layout, world, shard=s)] for n, s in MODES.items()
    }


class Config(Stepper):
    """One configuration: the PEFT model in DDP or a trainer, and its AdamW."""

    def __init__(self, name: str) -> None:
        model = peft_llama(SMALL, LORA)
        self.trainable = trainable_numel(model)
        super().__init__(name, model, None if name == "ddp" else MODES[name], ADAMW)

    def memory(self) -> dict:
        """memory_stats() on this rank beside what the issue compares it with."""
        fm, trainer = self.net, self.trainer
        item = fm.layout.torch_dtype.itemsize
        units = trainer.units or None
        plan = plan_memory(fm.layout, WORLD, shard=trainer.shard, units=units)
        return {
            "memory_stats": {k: getattr(trainer.memory_stats(), k) for k in FIELDS},
            "plan_memory": plan[dist.get_rank()].as_dict(),
            "trainable_elements": self.trainable,
            "itemsize": item,
            "flat_numel": fm.layout.numel,
            "grad_numel": fm.layout.grad_layout.numel,
        }


def run(opts: argparse.Namespace) -> dict:
    """Every configuration on this rank, interleaved step by step: times, losses, memory."""
    return run_configs(Config, opts)


def measured_memory(ranks: list[dict]) -> dict:
    """Per mode: every rank's memory_stats() against the trainable bytes, and "before"."""
    before = before_plans(SMALL, LORA, None, WORLD)
    out = {}
    for name in MODES:
        by_rank = [r["memory"][name] for r in ranks]
        m0 = by_rank[0]
        trainable_bytes = m0["trainable_elements"] * m0["itemsize"]
        grads = [m["memory_stats"]["gradients"] for m in by_rank]
        opt = max(m["memory_stats"]["optimizer"] for m in by_rank)
        old = max(gradient_bytes(p) for p in before[name])
        out[name] = {
            "by_rank": by_rank,
            "trainable_bytes": trainable_bytes,
            "adamw_state_bytes": 8 * m0["trainable_elements"],
            "gradients_by_rank": grads,
            "gradients_max": max(grads),
            "optimizer_max": opt,
            "gradients_vs_trainable": max(grads) / trainable_bytes,
            "optimizer_vs_adamw": opt / (8 * m0["trainable_elements"]),
            "plan_equal": all(
                m["memory_stats"] == {k: m["plan_memory"][k] for k in FIELDS} for m in by_rank
            ),
            "before_flat_bytes": m0["flat_numel"] * m0["itemsize"],  # layout.numel x itemsize
            "before_plan": before[name],
            "before_gradients": old,
            "before_over_after": old / max(grads),
        }
    return out


def computed_memory(world: int) -> dict:
    """Llama-2-7B with LoRA r=16 on meta, bf16: plan_memory per mode and rank, after and
    before (every parameter trainable); the worst rank of each."""
    model = peft_llama(LLAMA_7B, LORA_7B, meta=True)
    fm = FlatParamModule(model, dtype=torch.bfloat16)
    before = before_plans(LLAMA_7B, LORA_7B, torch.bfloat16, world)
    modes = {}
    for name, shard in MODES.items():
        plans = [p.as_dict() for p in plan_memory(fm.layout, world, shard=shard)]
        grads = [gradient_bytes(p) for p in plans]
        old = max(gradient_bytes(b) for b in before[name])
        persistent = max(sum(p[k] for k in FIELDS) for p in plans)
        modes[name] = {"plans": plans, "gradients_by_rank": grads, "gradients_max": max(grads),
                       "before_gradients": old, "before_over_after": old / max(grads),
                       "persistent_max": persistent}  # fmt: skip
    return {
        "model": LLAMA_7B,
        "lora": LORA_7B,
        "dtype": "bfloat16",
        "world_size": world,
        "numel": fm.layout.numel,
        "trainable_elements": trainable_numel(model),
        "before_flat_bytes": fm.layout.numel * 2,  # layout.numel x itemsize
        "before_plans": before,
        "modes": modes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world-7b", type=int, default=8, help="ranks for the computed 7B plan")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the ranks")
    p.add_argument("--out", default="benchmarks/results/lora.json")
    opts = p.parse_args()
    t_start, machine, code = now(), machine_info(), hashes("lora")
    ranks = run_ranks(run, WORLD, opts, timeout_s=opts.timeout)

    title = (
        f"\n{WORLD} ranks, gloo, 1 thread/rank, PEFT Llama (hidden {SMALL['hidden_size']}, "
        f"{SMALL['num_hidden_layers']} layers, LoRA r={LORA['r']} on q_proj/v_proj), "
        f"{BATCH}x{BLOCK} tokens/rank, AdamW; {opts.steps} steps (+{opts.warmup} warm-up) of "
        "each, interleaved; per step the max over ranks, median (p10-p90)"
    )
    paired = speed_report(ranks, CONFIGS, list(MODES), title)

    memory = measured_memory(ranks)
    rows = [
        (name, " / ".join(fmt_bytes(g) for g in m["gradients_by_rank"]),
         fmt_bytes(m["trainable_bytes"]), f"{m['gradients_vs_trainable']:.3f}x",
         fmt_bytes(m["optimizer_max"]), f"{m['optimizer_vs_adamw']:.3f}x",
         fmt_bytes(m["before_gradients"]), f"{m['before_over_after']:.0f}x",
         "yes" if m["plan_equal"] else "NO")
        for name, m in memory.items()
    ]  # fmt: skip
    headers = ["memory", "gradients r0 / r1", "trainable", "max/trainable", "optimizer (max)",
               "/ 8 x trainable", "before (max)", "before/after", "= plan"]  # fmt: skip
    title = f"\nmemory_stats() after the steps, {memory['ts_repl']['by_rank'][0]['trainable_elements']:,} trainable elements, fp32"
    print(format_table(headers, rows, title))

    computed = computed_memory(opts.world_7b)
    rows = [
        (name, fmt_bytes(c["gradients_max"]), fmt_bytes(min(c["gradients_by_rank"])),
         fmt_bytes(c["before_gradients"]), f"{c['before_over_after']:.0f}x",
         fmt_bytes(c["persistent_max"]))
        for name, c in computed["modes"].items()
    ]  # fmt: skip
    title = (
        f"\nLlama-2-7B + LoRA r={LORA_7B['r']} (q_proj, v_proj), bf16, on meta, "
        f"{computed['world_size']} ranks: plan_memory per rank (max); "
        f"{computed['trainable_elements']:,} of {computed['numel']:,} elements train"
    )
    headers = ["computed", "gradients (max)", "(min)", "before (max)", "before/after", "persistent"]
    print(format_table(headers, rows, title))

    targets = {}
    for name, m in memory.items():
        for key in ("gradients_vs_trainable", "optimizer_vs_adamw"):
            ok = m[key] <= TARGET_BYTES
            targets[f"{name}.{key}"] = {"ratio": m[key], "target": TARGET_BYTES, "met": ok}
            print(f"{name}: {key} = {m[key]:.4f} (<= {TARGET_BYTES}): {'met' if ok else 'MISSED'}")
    key = "ts_repl.step / ddp.step"
    v = verdict(paired[key]["wall"], TARGET_STEP)
    targets[key] = {"target": TARGET_STEP, "verdict": v}
    print(f"{key} (wall, <= {TARGET_STEP}): {v}")
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
    results = {"benchmark": "lora", "machine": machine, "measured": code, "args": vars(opts)}
    results.update(world_size=WORLD, threads_per_rank=1, model=SMALL, lora=LORA, batch=BATCH)
    results.update(block=BLOCK, adamw=ADAMW, summary=summary, paired=paired, targets=targets)
    results.update(memory=memory, computed=computed, loadavg_end=list(load), total_s=total)
    results.update(samples_by_rank=[{k: r[k] for k in ("wall", "cpu", "losses")} for r in ranks])
    print(f"wrote {write_json(opts.out, results)}")


if __name__ == "__main__":
    main()
