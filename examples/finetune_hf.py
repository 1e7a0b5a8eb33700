"""Fine-tune a Hugging Face transformers causal LM with torchshard, data-parallel.

The model is a transformers model as it is (Llama or GPT-2 architecture, from
a config or from a local ``from_pretrained`` directory); the text is Python's
own help (``pydoc_data.topics``), byte by byte, served by a DataLoader through
torchshard.GlobalBatchSampler (the same global batches at any world size; the
checkpoint holds the data position, so a resume continues the epoch exactly).
Nothing is downloaded.

    # a small Llama from its config, two processes (gloo on CPU, NCCL on GPUs)
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py

    # continue from the latest checkpoint that loads, at another world size
    torchrun --standalone --nproc-per-node 3 examples/finetune_hf.py --resume --steps 120

    # start again, deleting the earlier run's checkpoints (without it: an error)
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --overwrite

    # LoRA through PEFT: only the adapters get gradients and optimizer state; they are
    # written in PEFT's format to runs/finetune_hf-lora/adapter
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py \\
        --lora-rank 8 --ckpt-dir runs/finetune_hf-lora

    # export for transformers, then load it there
    torchshard consolidate runs/finetune_hf runs/finetune_hf-model
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('runs/finetune_hf-model')"

    # start from a from_pretrained directory (e.g. the export above), GPT-2, FSDP-lite
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py \\
        --init-from runs/finetune_hf-model --ckpt-dir runs/finetune_hf-2 --shard

    # tensor parallelism: the model's own plan (tp_plan="auto": transformers' base_model_tp_plan
    # and _tp_plan) over 2 ranks, data-parallel over the other 2
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --tp 2 --shard

    # accelerate's launcher sets the same environment as torchrun
    accelerate launch --multi_gpu --num_processes 2 examples/finetune_hf.py --ckpt-dir runs/finetune_hf-acc

examples/resume.sh runs the whole path: train at 2 ranks, resume at 1 and at 3
from the same checkpoint, export, and load the result with transformers.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from accelerate import init_empty_weights

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import (
    HelpFormatter,
    data_rank,
    decided_by_rank0,
    describe_mesh,
    forever,
    get_batch,
    load_corpus,
    load_data_state,
    make_loader,
    make_mesh,
    overwrite_or_resume,
    parse_quietly,
    rank0_speaks,
    run_reporting_once,
    split_model,
)

import torchshard
import torchshard.checkpoint

log = logging.getLogger("finetune_hf")

# Small enough for two CPU cores; the tokens are bytes, so the vocabulary is 256.
CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "gpt2": dict(
        model_type="gpt2", n_embd=128, n_layer=4, n_head=4, n_positions=256,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--arch", choices=sorted(CONFIGS), default="llama", help="random init")
    src.add_argument(
        "--config", help="a transformers config.json, random init (default: none, --arch's)"
    )
    src.add_argument(
        "--init-from",
        metavar="DIR",
        help="a local from_pretrained directory (default: none, --arch's random init)",
    )
    p.add_argument("--steps", type=int, default=200, help="length of the run (and its schedule)")
    p.add_argument(
        "--stop-at", type=int, help="stop after this step, as if interrupted (default: --steps)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=12,
        help="sequences per step, all ranks together (the global batch; the data-parallel\n"
        "size, world / --tp, must divide it)",
    )
    p.add_argument(
        "--num-workers", type=int, default=1, help="DataLoader worker processes per rank (0: none)"
    )
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="weights' and data order's seed")
    p.add_argument(
        "--log-every",
        type=int,
        default=25,
        help="log the loss every N steps (its mean over the ranks and those N steps)",
    )
    p.add_argument("--ckpt-dir", default="runs/finetune_hf", help="checkpoint root ('' for none)")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint that loads (a damaged one is skipped\n"
        "for the one before, and set aside)",
    )
    p.add_argument(
        "--resume-from",
        metavar="PATH",
        help="continue from exactly this checkpoint directory (no fallback); the run\n"
        "saves under --ckpt-dir, where later checkpoints are set aside (renamed\n"
        "step-N.skipped) (default: none)",
    )
    p.add_argument(
        "--reset-data-position",
        action="store_true",
        help="on resume, if the saved data position does not fit this run (another\n"
        "--batch-size, --block-size or --seed), set it anew instead of failing\n"
        "(as examples/train_gpt.py --help says)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete the checkpoints of an earlier run first"
    )
    p.add_argument("--shard", action="store_true", help="FSDP-lite: sharded optimizer state")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="T",
        help="tensor parallelism over T consecutive ranks with the model's own plan\n"
        "(tp_plan='auto': transformers' base_model_tp_plan, e.g. Llama's; GPT-2 declares\n"
        "none); data parallelism over world/T ranks; T must divide the heads",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 weights (with --shard: fp32 master)")
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward"
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="LoRA (PEFT): freeze the model and train rank-R adapters on --lora-targets;\n"
        "frozen weights take no gradient or optimizer memory; the adapters are\n"
        "exported in PEFT's format to <ckpt-dir>/adapter at the end (default: 0, off)",
    )
    p.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        help="with --lora-rank: the Linear layers that get adapters, by name suffix\n"
        "(gpt2: c_attn) (default: %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)"
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_quietly(parser, argv)
    problem = None
    if args.tp < 1:
        problem = f"expected a number of ranks >= 1, got {args.tp}"
    elif args.tp > 1 and args.lora_rank:
        problem = "LoRA adapters are not split: --lora-rank needs --tp 1"
    if problem:
        with rank0_speaks():
            parser.error(f"argument --tp: {problem}")
    return args


def build_model(args: argparse.Namespace, rank: int) -> torch.nn.Module:
    """Weights from disk on data-parallel rank 0 only (under --tp, each of its tensor-parallel
    ranks keeps its piece); elsewhere built without storage (rank 0's are broadcast)."""
    if args.init_from:
        config = transformers.AutoConfig.from_pretrained(args.init_from)
        if rank == 0:
            return transformers.AutoModelForCausalLM.from_pretrained(
                args.init_from, dtype=torch.float32
            )
    elif args.config:
        config = transformers.AutoConfig.from_pretrained(args.config)
    else:
        kw = dict(CONFIGS[args.arch])
        config = transformers.AutoConfig.for_model(kw.pop("model_type"), vocab_size=256, **kw)
    if config.vocab_size < 256:
        raise SystemExit(f"the model's vocab_size is {config.vocab_size}; bytes need 256")
    # Parameters on meta, buffers (e.g. rotary frequencies) real; FlatParamModule restores
    # the ties this breaks, and the trainer initializes the model the transformers way.
    with init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config)


def with_lora(model: torch.nn.Module, rank: int, targets: list[str]) -> torch.nn.Module:
    """The model with PEFT LoRA adapters of ``rank`` on ``targets``, everything else frozen.
    On meta (ranks other than 0 with --init-from, or every rank from a config) the adapters
    are built on meta too; torchshard initializes them PEFT's way (lora_B zeros)."""
    import peft  # only for --lora-rank

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    return peft.get_peft_model(model, config)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    info = torchshard.init_distributed()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    # Rank 0 logs; the others, whose lines would repeat its own, say nothing.
    handler = logging.StreamHandler() if info.rank == 0 else logging.NullHandler()
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler])
    ckpt = torchshard.checkpoint.Checkpointer(args.ckpt_dir, keep_last=2) if args.ckpt_dir else None
    # one answer for every rank
    latest = decided_by_rank0(ckpt.latest if ckpt else lambda: None, info.device)
    args.resume = args.resume or args.resume_from is not None
    if not args.resume and not args.overwrite and latest is not None:  # never lose a run
        if info.rank == 0:
            print(
                f"finetune_hf: {args.ckpt_dir} holds checkpoints (latest: {latest}); "
                "--resume continues them, --overwrite deletes them and starts again, "
                "--ckpt-dir picks another directory",
                file=sys.stderr,
            )
        sys.exit(2)
    transformers.logging.set_verbosity_error()

    train, val = load_corpus()
    mesh = make_mesh(1, args.tp)  # --tp: the tensor-parallel groups, data-parallel across
    # the data-parallel ranks' parts of each global batch (under --tp: the tensor-parallel
    # ranks of a group read the same part)
    place = data_rank(mesh)
    sampler, loader = make_loader(
        train, args.block_size, args.batch_size, args.seed, args.num_workers, info.device, **place
    )
    torch.manual_seed(args.seed)
    model = build_model(args, place.get("rank", info.rank))
    if args.gradient_checkpointing:  # transformers 5 renamed gradient_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    if args.lora_rank:
        model = with_lora(model, args.lora_rank, args.lora_targets.split(","))
    fm = split_model(model, "auto", mesh, dtype=torch.bfloat16 if args.bf16 else None)
    trainer = torchshard.DistributedTrainer(fm, device=info.device, mesh=mesh, shard=args.shard)
    opt = trainer.make_optimizer(
        torch.optim.AdamW,
        lr=args.lr,
        weight_decay=0.1,
        groups=[(lambda n: n.endswith("bias") or "norm" in n or ".ln_" in n, {"weight_decay": 0})],
    )
    # The checkpoint stores the model's transformers config: `torchshard consolidate`
    # turns it into a directory that from_pretrained loads.
    start = 0
    resumed = overwrite_or_resume(args, ckpt, trainer, opt, latest)
    if resumed is not None:
        start = resumed.step
        load_data_state(sampler, resumed.extra, args.reset_data_position)
    if start >= args.steps:
        log.info("already at step %d of %d: nothing to train (raise --steps)", start, args.steps)
    log.info(
        "%s, %.2fM parameters (%d train%s), world %d on %s, %s%s",
        type(model).__name__,
        (fm.layout if fm.tp is None else fm.tp.whole).param_numel / 1e6,
        fm.layout.grad_layout.param_numel,
        "" if fm.tp is None else " on this rank",
        info.world_size,
        info.device,
        "sharded" if args.shard else "replicated",
        describe_mesh(mesh),
    )

    # The loss summed on the device since the last log, read (a host sync) only at log steps.
    loss_sum, n_summed, last_loss = torch.zeros(1, device=info.device), 0, float("nan")
    batches = forever(sampler.track(loader))  # counts what the loop received: saved below
    last = min(args.steps, args.stop_at or args.steps)
    for step in range(start + 1, last + 1):
        # linear warm-up, then cosine to a tenth
        lr = args.lr * min(1.0, step / 10) * (0.55 + 0.45 * math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        # (input, shifted): input only; pinned by the DataLoader on CUDA, so the copy is async
        x = next(batches)[0].to(info.device, non_blocking=True)
        trainer.zero_grad()
        loss = fm(input_ids=x, labels=x).loss  # transformers shifts the labels
        loss.backward()
        trainer.clip_grad_norm_(1.0)
        trainer.step()
        loss_sum += loss.detach().float()
        n_summed += 1
        if step % args.log_every == 0 or step == last:  # the mean over ranks and these steps
            mean = loss_sum / n_summed
            dist.all_reduce(mean)
            last_loss = mean.item() / info.world_size
            log.info("step %4d  loss %.4f  lr %.3g", step, last_loss, lr)
            loss_sum.zero_()
            n_summed = 0
        if ckpt is not None and (step % args.save_every == 0 or step == last):
            extra = {
                "world_size": info.world_size,
                "tp": args.tp,
                "loss": last_loss if math.isfinite(last_loss) else None,  # JSON has no NaN
                "data": sampler.state_dict(),
            }
            ckpt.save(trainer, step=step, optimizer=opt, extra=extra)
    if ckpt is not None:
        ckpt.close()

    fm.eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1234)
        x, _ = get_batch(val, args.batch_size, args.block_size, gen, info.device)
        val_loss = fm(input_ids=x, labels=x).loss.item()
        prompt = torch.tensor([list(b"def ")], device=info.device)
        out = model.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)
    sample = bytes(out[0].tolist()).decode("utf-8", "replace")
    # PEFT's own format: PeftModel.from_pretrained(base, path) loads it
    if args.lora_rank and args.ckpt_dir:
        path = Path(args.ckpt_dir) / "adapter"
        with trainer.gathered():
            if info.rank == 0:
                model.save_pretrained(path)
        log.info("adapters (PEFT format): %s", path)
    log.info("validation loss %.4f; greedy sample: %r", val_loss, sample)
    if ckpt is not None:
        log.info(
            "checkpoints: %s",
            ", ".join(p.name for p in sorted(Path(args.ckpt_dir).glob("step-*"))),
        )
    trainer.close()
    return {"val_loss": val_loss, "last_loss": last_loss}


if __name__ == "__main__":
    run_reporting_once(main)
