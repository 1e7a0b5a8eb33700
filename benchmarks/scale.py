"""FSDP-lite beyond this machine: a 70B Llama layout on meta at 8 to 1024 ranks, pure arithmetic.

    python benchmarks/scale.py [--out benchmarks/results/scale.json]

Builds transformers' Llama architecture at 70B size under torch.device("meta")
(no weights), lays it out in bf16, and prints per rank: the padded buffer and
slice, bytes of parameters, gradients, AdamW state and fp32 master (with its
gradient), and the size of a checkpoint's metadata.json, next to the 12 bytes
per parameter (fp32 AdamW state and master) a replicated rank would hold.
tests/test_scale.py asserts the same numbers against their formulas.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import torchshard
from torchshard._parallel.memory import padded_numel
from torchshard.checkpoint._format import build_metadata, model_file, optim_file

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


def llama_layout(num_hidden_layers: int = 80) -> torchshard.FlatLayout:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**LLAMA_70B, "num_hidden_layers": num_hidden_layers})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return torchshard.FlatParamModule(model, dtype=torch.bfloat16).layout


def metadata_bytes(layout: torchshard.FlatLayout, world: int) -> int:
    """Size of metadata.json for an AdamW checkpoint saved sharded at ``world`` ranks."""
    n = len(layout)
    optim = {
        "class": "torch.optim.adamw.AdamW",
        "param_groups": [
            {
                "lr": 3e-4,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "params": [s.name for s in layout],
            },
        ],
        "flat_state": {"exp_avg": "float32", "exp_avg_sq": "float32", "master": "float32"},
        "scalar_state": {"step": {"dtype": "float32", "values": [1000.0] * n}},
        "stateful": "1" * n,
    }
    meta = build_metadata(layout, world, 1000, [], optim, {"loss": 1.5})
    names = [model_file(r, world) for r in range(world)] + [
        optim_file(r, world) for r in range(world)
    ]
    meta["files"] = {f: {"size": 10**11, "header_crc32": "0123abcd"} for f in names}
    return len(json.dumps(meta, separators=(",", ":")))  # as write_json writes it


def table(layout: torchshard.FlatLayout) -> list[dict]:
    rows = []
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
                "metadata_bytes": metadata_bytes(layout, world),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale.json"))
    args = p.parse_args(argv)
    layout = llama_layout()
    rows = table(layout)
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": "llama-70b", "rows": rows}, indent=1))
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
