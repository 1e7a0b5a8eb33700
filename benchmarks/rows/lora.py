"""bench_lora.py (lora.json): what frozen parameters cost (issue 21), measured on a small PEFT
Llama and computed for Llama-2-7B, and the LoRA training step against DDP.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from report.results import Results
from report.stats import gib, mib, paired, pairs_of, verdict, wall_cpu
from report.table import PAIRED, Cell, Row

MODES = (("replicated", "ts_repl"), ("`shard=True`", "ts_shard"), ('`shard="full"`', "ts_full"))
TARGET_BYTES = 1.01  # gradients / trainable bytes; optimizer state / 8 bytes per trainable


def _kib(n: float) -> str:
    return f"{n / 2**10:.1f} KiB"


def _model(r: Results) -> str:
    lora = r["lora"]
    m, trainable = lora["model"], lora["memory"]["ts_repl"]["by_rank"][0]
    return (
        f"PEFT Llama ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, LoRA "
        f"r={lora['lora']['r']} on q_proj/v_proj: {trainable['trainable_elements']:,} of "
        f"{trainable['flat_numel']:,} elements train), fp32"
    )


def _gradients(r: Results) -> Cell:
    mem = r["lora"]["memory"]
    ratios = "/".join(f"{mem[k]['gradients_vs_trainable']:.3f}x" for _, k in MODES)
    before = "/".join(f"{mem[k]['before_over_after']:.0f}x" for _, k in MODES)
    full = " / ".join(_kib(g) for g in mem["ts_full"]["gradients_by_rank"])
    same = all(mem[k]["plan_equal"] for _, k in MODES)
    cell = (
        f"{ratios} ({' / '.join(label for label, _ in MODES)}; the worst rank, "
        f'{_kib(mem["ts_repl"]["trainable_bytes"])} trainable; `shard="full"` by rank: '
        f"{full}) on a {_model(r)}; before (every parameter with a gradient: the whole flat "
        f"buffer, {mib(mem['ts_repl']['before_flat_bytes'])}; fully sharded its stripe): "
        f"{before} as much; `memory_stats()` = `plan_memory()`: {'yes' if same else 'NO'}"
    )
    ok = all(mem[k]["gradients_vs_trainable"] <= TARGET_BYTES for _, k in MODES) and same
    return cell, "met" if ok else "missed"


def _optimizer(r: Results) -> Cell:
    mem = r["lora"]["memory"]
    ratios = "/".join(f"{mem[k]['optimizer_vs_adamw']:.3f}x" for _, k in MODES)
    sizes = " / ".join(_kib(mem[k]["optimizer_max"]) for _, k in MODES)
    cell = f"{ratios} ({sizes}; the worst rank; the same model)"
    ok = all(mem[k]["optimizer_vs_adamw"] <= TARGET_BYTES for _, k in MODES)
    return cell, "met" if ok else "missed"


def _computed_7b(r: Results) -> Cell:
    c = r["lora"]["computed"]
    trainable_bytes = 2 * c["trainable_elements"]  # bf16
    parts = []
    for label, key in MODES:
        m = c["modes"][key]
        parts.append(
            f"{label} {m['gradients_max'] / 1e6:.1f} MB vs {m['before_gradients'] / 1e9:.2f} GB "
            f"({m['before_over_after']:.0f}x less)"
        )
    cell = (
        f"{'; '.join(parts)}; the worst rank of {c['world_size']} "
        f"({c['trainable_elements']:,} of {c['numel']:,} elements train; fully sharded: the "
        f"fp32 master's gradient, {gib(c['modes']['ts_full']['persistent_max'], 2)} persistent)"
    )
    ok = all(c["modes"][k]["gradients_max"] <= TARGET_BYTES * trainable_bytes for _, k in MODES)
    return cell, "met" if ok else "missed"


def step_cells(name: str) -> tuple[Callable[[Results], Cell], Callable[[Results], Cell]]:
    """The cells of the step-vs-DDP rows of result ``name`` (``lora``, ``mixed``: the same
    configurations, ``benchmarks/_interleaved.py``): the replicated mode against its target,
    and the sharded modes as information."""

    def replicated(r: Results) -> Cell:
        p = paired(r, name, "ts_repl.step / ddp.step")
        return f"{wall_cpu(p)}; {pairs_of(p, 'steps')}", verdict(p["wall"], 1.0)

    def sharded(r: Results) -> Cell:
        parts = []
        for label, key in MODES[1:]:
            p = paired(r, name, f"{key}.step / ddp.step")
            parts.append(f"{label}: {wall_cpu(p)}")
        return "; ".join(parts) + f"; {len(p['wall'])} steps", "-"

    return replicated, sharded


_step, _step_sharded = step_cells("lora")


ROWS = (
    Row(
        "LoRA: gradient bytes per rank vs the trainable parameters' (replicated / `shard=True` "
        '/ `shard="full"`), 2 ranks',
        "measured (`memory_stats()`)",
        _gradients,
        "<= 1.01x",
        ("lora",),
    ),
    Row(
        "LoRA: AdamW state per rank vs 8 bytes per trainable parameter (replicated / "
        '`shard=True` / `shard="full"`), 2 ranks',
        "measured (`memory_stats()`)",
        _optimizer,
        "<= 1.01x",
        ("lora",),
    ),
    Row(
        "Llama-2-7B + LoRA r=16 on q_proj/v_proj, bf16: gradients per rank, after vs before "
        "(every parameter with a gradient)",
        "computed (`plan_memory` on meta)",
        _computed_7b,
        "about 17 MB (issue 21; before 13.5 GB): <= 1.01x the trainable parameters' bf16 bytes",
        ("lora",),
    ),
    Row(
        "LoRA training step vs DDP on the same PEFT model, replicated, 2 ranks",
        PAIRED,
        _step,
        "<= 1.0",
        ("lora",),
    ),
    Row(
        'LoRA training step vs DDP: `shard=True` / `shard="full"`',
        PAIRED,
        _step_sharded,
        "-",
        ("lora",),
    ),
)
