"""FSDP-lite beyond this machine: a 70B Llama layout on meta at 8 to 1024 ranks, computed.

    python benchmarks/scale.py [--out benchmarks/results/scale.json]

Builds transformers' Llama architecture at 70B size under torch.device("meta")
(no weights), lays it out in bf16, and prints per rank: the padded buffer and
slice, bytes of parameters, gradients, AdamW state and fp32 master (with its
gradient), from ``plan_memory`` (tests/test_parallel_sharded.py and test_estimate.py
check ``plan_memory`` against real trainers), and the size of a checkpoint's
metadata.json, next to the 12 bytes per parameter (fp32 AdamW state and master) a
replicated rank would hold. Nothing here is measured: every number is computed.

metadata.json is built by the save path's own functions (``OptimizerView.metadata`` over
a real ``torch.optim.AdamW``'s param group, ``build_metadata``, ``index_json``,
``FileRecord``, ``seal``), as a sharded bf16 trainer's save at step 1000 writes it; only
the files' sizes (their data bytes, without the safetensors header) and checksums are
stand-ins. tests/test_scale.py compares :func:`metadata_bytes` with real saves of a small
Llama at 1 to 3 ranks and asserts the memory numbers against their formulas.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _common import machine_info, write_json
from report.freshness import hashes

import torchshard
from torchshard._flat.hf import transformers_config
from torchshard._parallel.memory import padded_numel
from torchshard.checkpoint._format import (
    FORMAT_VERSION,
    build_metadata,
    index_json,
    model_file,
    seal,
)
from torchshard.checkpoint._optim import MASTER, OptimizerView
from torchshard.checkpoint._plan import weight_runs
from torchshard.checkpoint._safetensors import FileRecord
from torchshard.checkpoint._streams import Stream

LLAMA_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
)
WORLD_SIZES = (8, 64, 512, 1024)
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def llama(**config: int) -> torchshard.FlatParamModule:
    """transformers' Llama (70B unless ``config`` overrides a field), on meta, laid out in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**LLAMA_70B, **config})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return torchshard.FlatParamModule(model, dtype=torch.bfloat16)


def llama_layout(num_hidden_layers: int = 80) -> torchshard.FlatLayout:
    return llama(num_hidden_layers=num_hidden_layers).layout


def metadata_bytes(
    fm: torchshard.FlatParamModule, world: int, *, step: int = 1000, extra: dict | None = None
) -> int:
    """Size of metadata.json for an AdamW (:data:`ADAMW`) checkpoint of a sharded bf16 trainer
    (fp32 master) saved at ``world`` ranks after ``step`` optimizer steps, built as the save
    path builds it; file sizes are their data bytes and checksums are stand-ins."""
    layout, dtype = fm.layout, fm.layout.torch_dtype
    names = {n for s in layout for n in s.names}
    buffers = {k: v for k, v in fm.module.state_dict(keep_vars=True).items() if k not in names}
    trainable = [s.requires_grad for s in layout]
    # The optimizer section, from a real AdamW's param group (every hyperparameter torch keeps)
    # through the checkpoint's own OptimizerView, as a sharded trainer's optimizer has it.
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.empty(0))], **ADAMW)
    streams = [Stream(k, dtype, torch.float32) for k in ("exp_avg", "exp_avg_sq", MASTER)]
    group = [[s.name for s, t in zip(layout, trainable) if t]]
    view = OptimizerView(adamw, [], group, streams, frozenset({dtype}), layout)
    steps = {
        "step": {"dtype": "float32", "values": [float(step) if t else None for t in trainable]}
    }
    optim = view.metadata((steps, "".join("1" if t else "0" for t in trainable)))
    config = transformers_config(fm.module, dtype)
    meta = build_metadata(layout, world, step, list(buffers), optim, extra or {}, config)
    # The files' records, as the ranks report them (FileRecord.to_dict); sizes: data bytes.
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers.values())
    sizes = {
        model_file(r, world): sum(s.numel for s in layout.slots[lo:hi]) * dtype.itemsize
        for r, (lo, hi) in enumerate(weight_runs(layout, world))
        if hi > lo
    }
    if buffers:  # rank 0 writes them into its model file
        sizes[model_file(0, world)] = sizes.get(model_file(0, world), 0) + buffer_bytes
    for f in meta["optimizer"]["files"]:
        a, b = f["range"]
        sizes[f["file"]] = (b - a) * 4 * len(streams)
    files = {name: FileRecord(size, 0xDEADBEEF).to_dict() for name, size in sizes.items()}
    # commit(): the index's record, the files, then the seal.
    index = json.dumps(index_json(meta, buffer_bytes), separators=(",", ":")).encode()
    content = {k: v for k, v in meta.items() if k not in ("files", "index", "sha256")}
    content["format_version"] = FORMAT_VERSION
    content["index"] = {"size": len(index), "sha256": "0" * 64}
    content["files"] = files
    return len(seal(content))


def table(fm: torchshard.FlatParamModule) -> list[dict]:
    layout, rows = fm.layout, []
    for world in WORLD_SIZES:
        plan = torchshard.plan_memory(layout, world, shard=True, optimizer="adamw")
        worst = max(plan, key=lambda r: r.total)
        padded = padded_numel(layout, world, True)
        rows.append(
            {
                "world": world,
                "padded_numel": padded,
                "padding": padded - layout.numel,
                "slice": padded // world,
                "parameters": worst.parameters,
                "gradients": worst.gradients,
                "optimizer": worst.optimizer,
                "master": worst.master,
                # what replicated mixed precision holds instead: fp32 AdamW state + master
                "replicated_12_bytes": 12 * layout.param_numel,
                "metadata_bytes": metadata_bytes(fm, world),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale.json"))
    args = p.parse_args(argv)
    t_start, code = time.perf_counter(), hashes("scale")
    fm = llama()
    layout = fm.layout
    rows = table(fm)
    gib = 2**30
    print(f"Llama 70B in bf16: {layout.param_numel:,} parameters in {len(layout)} slots")
    head = f"{'ranks':>6} {'padding':>8} {'slice':>14} {'params':>9} {'grads':>9} {'AdamW':>9} {'master':>9} {'12 B/param':>12} {'metadata':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['world']:>6} {r['padding']:>8} {r['slice']:>14,} {r['parameters'] / gib:>7.1f}Gi "
            f"{r['gradients'] / gib:>7.1f}Gi {r['optimizer'] / gib:>7.2f}Gi {r['master'] / gib:>7.2f}Gi "
            f"{r['replicated_12_bytes'] / gib:>10.1f}Gi {r['metadata_bytes'] / 1024:>7.0f}Ki"
        )
    out = {"benchmark": "scale", "machine": machine_info(), "measured": code}
    out.update(model="llama-70b", rows=rows)
    out["computed"] = {
        "memory": "plan_memory(layout, world, shard=True, optimizer='adamw'): the rank with the most",
        "metadata_bytes": metadata_bytes.__doc__.split("\n\n")[0].replace("\n", " "),
    }
    out["total_s"] = time.perf_counter() - t_start
    write_json(args.out, out)
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
