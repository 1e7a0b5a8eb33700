"""bench_mixed.py (mixed.json): a bf16 Llama with fp32 norms, its parameters each in their own
dtype in one byte buffer: memory per rank against the trainable bytes and against the same
model cast to fp32, every step's loss against DDP's, and the training step against DDP.

Stdlib only: rows of the benchmark table, read from the results by `summary.py`.
"""

from __future__ import annotations

from report.results import Results
from report.table import PAIRED, Cell, Row

from .lora import MODES, step_cells

TARGET_BYTES = 1.01  # replicated gradients / the trainable parameters' bytes in their dtypes


def _kib(n: float) -> str:
    return f"{n / 2**10:.1f} KiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _model(r: Results) -> str:
    mixed = r["mixed"]
    m, by_dtype = mixed["model"], mixed["memory"]["ts_repl"]["by_rank"][0]
    trainable = by_dtype["trainable_bytes_by_dtype"]
    return (
        f"Llama ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
        f"{by_dtype['numel']:,} elements, all trainable: {_mib(trainable['bfloat16'])} bf16, "
        f"{_kib(trainable['float32'])} fp32 norms)"
    )


def _plan(mem: dict) -> str:
    """Whether memory_stats() equals plan_memory() on every rank, mode by mode (reported)."""
    same = [mem[k]["plan_equal"] for _, k in MODES]
    if all(same):
        return "`memory_stats()` = `plan_memory()`: yes"
    parts = [
        f"{label} yes"
        if mem[k]["plan_equal"]
        else f"{label} NO ({', '.join(mem[k]['plan_differs'])})"
        for label, k in MODES
    ]
    return f"`memory_stats()` = `plan_memory()`: {'; '.join(parts)}"


def _gradients(r: Results) -> Cell:
    mem = r["mixed"]["memory"]
    repl = mem["ts_repl"]
    shard, full = (mem[k]["gradients_vs_trainable"] for _, k in MODES[1:])
    cell = (
        f"{repl['gradients_vs_trainable']:.3f}x (replicated, the worst rank: "
        f"{_mib(repl['gradients_max'])} vs {_mib(repl['trainable_bytes'])}; `shard=True` "
        f'{shard:.3f}x; `shard="full"` {full:.3f}x, half its fp32 master) on a {_model(r)}; '
        f"{_plan(mem)} (reported, not a target)"
    )
    return cell, "met" if repl["gradients_vs_trainable"] <= TARGET_BYTES else "missed"


def _parameters(r: Results) -> Cell:
    mixed = r["mixed"]
    p, mem = mixed["parameters"], mixed["memory"]
    measured = " / ".join(_mib(x) for x in mem["ts_repl"]["parameters_by_rank"])
    persistent = "/".join(f"{mem[k]['persistent_vs_fp32']:.2f}x" for _, k in MODES)
    cell = (
        f"{p['mixed_vs_fp32']:.3f}x ({_mib(p['mixed_layout_nbytes'])} vs "
        f"{_mib(p['fp32_layout_nbytes'])}, `layout.nbytes`; replicated `memory_stats()` by "
        f"rank: {measured}); persistent bytes per rank (parameters, gradients, optimizer, "
        f"master) vs the fp32 model's `plan_memory()`: {persistent} (replicated / "
        '`shard=True` / `shard="full"`: the sharded modes keep an fp32 master of every element)'
    )
    return cell, "-"


def _losses(r: Results) -> Cell:
    mixed = r["mixed"]
    diffs = [mixed["summary"][k]["max_abs_loss_diff_vs_ddp"] for _, k in MODES]
    steps = len(mixed["samples_by_rank"][0]["losses"]["ddp"])
    cell = (
        f"{' / '.join(f'{d:.2g}' for d in diffs)} (replicated / `shard=True` / "
        f'`shard="full"`; every step of {steps} on both ranks; the sharded modes step fp32 '
        "masters of the bf16 weights, DDP's AdamW the bf16 weights)"
    )
    return cell, "met" if diffs[0] == 0 else "missed"


_step, _step_sharded = step_cells("mixed")


ROWS = (
    Row(
        "bf16 model with fp32 norms: gradient bytes per rank vs the trainable parameters', "
        "each in its own dtype, 2 ranks",
        "measured (`memory_stats()`)",
        _gradients,
        "<= 1.01x (replicated)",
        ("mixed",),
    ),
    Row(
        "bf16 model with fp32 norms: parameter bytes vs the same model cast to fp32 "
        "(`FlatParamModule(model, dtype=torch.float32)`)",
        "computed (`layout.nbytes`), measured (`memory_stats()`)",
        _parameters,
        "-",
        ("mixed",),
    ),
    Row(
        "bf16 model with fp32 norms: loss at every step vs DDP's on the same model, max "
        "absolute difference",
        "measured",
        _losses,
        "0 (replicated: identical)",
        ("mixed",),
    ),
    Row(
        "training step vs DDP on the same bf16 model with fp32 norms, replicated, 2 ranks",
        PAIRED,
        _step,
        "<= 1.0",
        ("mixed",),
    ),
    Row(
        'training step vs DDP, bf16 with fp32 norms: `shard=True` / `shard="full"`',
        PAIRED,
        _step_sharded,
        "-",
        ("mixed",),
    ),
)
