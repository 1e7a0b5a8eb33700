r"""Train a small GPT on text that ships with Python, data-parallel with torchshard.

The corpus is Python's own help text (``pydoc_data.topics``, ~0.5 MB, part of
every CPython install), modelled byte by byte. Nothing is downloaded. It is cut
into sequences that a DataLoader serves through torchshard.GlobalBatchSampler:
the global batches are the same at any world size, and the checkpoint records
how many of the epoch's the loop received, so a resume at another world size
continues the epoch exactly (docs/data.md).

    # two processes on this machine (gloo on CPU, NCCL on GPUs)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

    # a world of one, no launcher
    python examples/train_gpt.py --steps 50

    # continue from the latest checkpoint, at another world size (--steps is the
    # schedule's length: a larger value on resume stretches the cosine decay); a latest
    # checkpoint that fails verification is skipped for the newest one that loads
    torchrun --standalone --nproc-per-node 3 examples/train_gpt.py --steps 400 --resume

    # continue from exactly this checkpoint (later ones under --ckpt-dir are set aside)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py \
        --resume-from runs/train_gpt/step-00000200

    # resume with another global batch size: the data position is set anew (see --help)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 400 --resume \
        --batch-size 48 --reset-data-position

    # start again, deleting the earlier run's checkpoints (without it: an error)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --overwrite

    # FSDP-lite: optimizer state and gradients sharded, bf16 weights with an fp32 master
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --shard --bf16

    # fully sharded (ZeRO-3): weights, gradients and optimizer state sharded; each block's
    # weights gathered for its forward and backward only
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --shard full --bf16

    # hybrid sharding: --shard inside groups of 2 ranks, 2 replicas of each group (across
    # nodes, say); its checkpoints resume at any world size, mesh or mode
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --shard --dp-replicate 2

    # tensor parallelism: each block's layers split over 2 ranks (gpt.py's TP_PLAN, Megatron's
    # split), data-parallel over the other 2 with any --shard mode (--dp-replicate too)
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2 --shard

    # pipeline parallelism: the blocks split into 2 stages (1F1B over 4 microbatches per
    # step), each stage data-parallel over 2 ranks (any --shard but full); its checkpoints
    # resume at any --pp, world size or mode
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --pp 2 --microbatches 4

    # gradient compression on a slow link: PowerSGD of rank 4 (dense for the first 10 steps;
    # also bf16, fp16, star, topk:0.01); the log shows the bytes sent per step
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --comm powersgd:4

    # two machines (the same command on each; HOST0 is one of them)
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29500 --rdzv-id my-run examples/train_gpt.py

Rank 0 logs the loss (mean over ranks), tokens per second and the time spent
waiting for gradient communication, and appends them as JSON lines to
<ckpt-dir>/metrics.jsonl; draw the loss curve with

    python examples/plot_metrics.py runs/train_gpt/metrics.jsonl    # -> runs/train_gpt/loss.png

An error (a setting that does not fit, a checkpoint that does not load) is printed by rank 0
only; every rank exits with a non-zero status.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, TP_PLAN, GPTConfig, init_gpt_weights

import torchshard
import torchshard.checkpoint
import torchshard.comm

log = logging.getLogger("train_gpt")

# --optimizer NAME: what the start line calls it and its default peak learning rate (built
# in main(), beside its parameter groups)
OPTIMIZERS = {"adamw": ("AdamW", 2e-3), "sgd": ("SGD with momentum", 0.1)}


class HelpFormatter(argparse.RawTextHelpFormatter):
    """--help with its line breaks kept and each option's default shown (flags are off by
    default; an option whose default is computed says so in its help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False
        if "default" not in text and not unset and action.default != argparse.SUPPRESS:
            text += ("" if text.endswith("\n") else " ") + "(default: %(default)s)"
        return text


@contextlib.contextmanager
def rank0_speaks():
    """Under a launcher, the other ranks' stdout and stderr go nowhere inside the block."""
    with contextlib.ExitStack() as stack:
        if int(os.environ.get("RANK", "0")) != 0:
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        yield


def parse_quietly(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``; under a launcher only rank 0 prints a usage error (or
    --help), the other ranks exit as quietly with the same status."""
    with rank0_speaks():
        return parser.parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--preset", default="small", help="model size: tiny, small, 125m, ... (gpt.py)")
    p.add_argument(
        "--n-layer", type=int, help="override the preset's layers (default: the preset's)"
    )
    p.add_argument("--n-embd", type=int, help="override the preset's width (default: the preset's)")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=300, help="length of the run and its schedule")
    p.add_argument(
        "--batch-size",
        type=int,
        default=24,
        help="sequences per micro-batch, all ranks together (the global batch;\n"
        "the data-parallel size, world / --tp, must divide it)",
    )
    p.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches (global batches) per step"
    )
    p.add_argument(
        "--num-workers", type=int, default=1, help="DataLoader worker processes per rank (0: none)"
    )
    p.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="adamw",
        help="adamw (betas 0.9, 0.95; weight decay 0.1) or sgd (momentum 0.9, no weight\n"
        "decay; error feedback was analysed for it: see docs/compression.md)",
    )
    p.add_argument(
        "--lr",
        type=float,
        help="peak learning rate (default: "
        + ", ".join(f"{lr:g} with {name}" for name, (_, lr) in OPTIMIZERS.items())
        + ")",
    )
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    p.add_argument(
        "--bucket-mb",
        type=float,
        help="gradient bucket size in MiB (default: 25 on CUDA, as DDP, and 1 on\nthe CPU)",
    )
    p.add_argument(
        "--log-every", type=int, default=10, help="log (and record metrics) every N steps"
    )
    p.add_argument("--seed", type=int, default=0, help="weights' and data order's seed")
    p.add_argument(
        "--ckpt-dir",
        default="runs/train_gpt",
        help="checkpoint root, and where metrics.jsonl goes ('' for neither)\n",
    )
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint (if any) that loads: a damaged one is\n"
        "skipped for the one before, and set aside (renamed step-N.bad); a worker that torchrun\n"
        "restarted (--max-restarts) always resumes",
    )
    p.add_argument(
        "--resume-from",
        metavar="PATH",
        help="continue from exactly this checkpoint directory (no fallback); the run\n"
        "saves under --ckpt-dir, where later checkpoints are set aside (renamed\n"
        "step-N.skipped). A restarted worker continues from --ckpt-dir's latest\n"
        "(default: none)",
    )
    p.add_argument(
        "--reset-data-position",
        action="store_true",
        help="on resume, if the saved data position does not fit this run (another\n"
        "--batch-size, --block-size or --seed), set it anew instead of failing:\n"
        "another --batch-size only continues the saved epoch after the samples it\n"
        "received (none seen twice; under one global batch skipped), otherwise the\n"
        "saved epoch starts again",
    )
    p.add_argument(
        "--stop-at",
        type=int,
        help="stop (and checkpoint) after this step; the schedule spans --steps\n"
        "(default: --steps)",
    )
    p.add_argument(
        "--fail-at",
        type=int,
        help="simulate a crash: the last rank SIGKILLs itself after this step, on the\n"
        "first attempt only (see --max-restarts in the README) (default: no crash)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete the checkpoints of an earlier run first"
    )
    p.add_argument(
        "--shard",
        nargs="?",
        const="optimizer",
        choices=["optimizer", "full"],
        help="--shard: FSDP-lite, optimizer state and gradients sharded; --shard full:\n"
        "fully sharded (ZeRO-3), the weights too, one transformer block gathered\n"
        "at a time (default: neither, the state is replicated)",
    )
    p.add_argument(
        "--dp-replicate",
        type=int,
        default=1,
        metavar="R",
        help="hybrid sharding (with --shard): shard inside groups of world/R ranks and keep\n"
        "R replicas of them (torchshard.init_mesh(dp_replicate=R)); 1: shard over\n"
        "every rank",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="T",
        help="tensor parallelism: split each block's layers, the embedding and the head over\n"
        "T consecutive ranks (gpt.py's TP_PLAN; torchshard.init_mesh(tp=T)); the data\n"
        "parallelism (any --shard mode, --dp-replicate) runs over world/T ranks; T must\n"
        "divide the heads and the vocabulary (256)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="P",
        help="pipeline parallelism: split the model into P stages of consecutive blocks, one\n"
        "per group of world/P ranks (torchshard.Pipeline, torchshard.init_mesh(pp=P)); each\n"
        "stage data-parallel over its world/P ranks (no --shard or --shard)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        metavar="M",
        help="with --pp: pieces each rank's part of the batch is cut into, run through the\n"
        "stages by --schedule (default: 2 x P)",
    )
    p.add_argument(
        "--schedule",
        default="1F1B",
        choices=["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"],
        help="with --pp: the pipeline schedule (torch's; the interleaved ones run 2 stages\n"
        "per rank)",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 weights (with --shard: fp32 master)")
    p.add_argument(
        "--comm",
        type=comm_spec,
        metavar="NAME[:ARG...]",
        help="how gradients travel (torchshard.comm): allreduce (today's exact mean), bf16\n"
        "or fp16 (cast on the wire), star[:ROOT] (reduce to one rank, then broadcast),\n"
        "powersgd[:RANK[:START_STEP]] (low rank, error feedback; dense for the first\n"
        "START_STEP steps, default 10: torch advises about 10%% of the run),\n"
        "topk[:RATIO[:START_STEP]] (the largest RATIO of each bucket, error feedback; dense\n"
        "for the first START_STEP steps, default 0; error feedback wants some, e.g. 10%%),\n"
        "topk-noef[:RATIO[:START_STEP]] (the same without error feedback: an ablation);\n"
        "powersgd and topk need the replicated mode (no --shard) (default: allreduce)",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)"
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_quietly(parser, argv)
    problem = None
    if args.dp_replicate < 1:
        problem = f"expected a number of replicas >= 1, got {args.dp_replicate}"
    elif args.dp_replicate > 1 and args.shard is None:
        problem = "replicas of sharded state need --shard (or --shard full)"
    if problem:
        with rank0_speaks():
            parser.error(f"argument --dp-replicate: {problem}")
    if args.tp < 1:
        with rank0_speaks():
            parser.error(f"argument --tp: expected a number of ranks >= 1, got {args.tp}")
    problem = pipeline_problem(args)
    if problem:
        with rank0_speaks():
            parser.error(f"argument --pp: {problem}")
    if args.microbatches is None:
        args.microbatches = 2 * args.pp
    if args.lr is None:
        args.lr = OPTIMIZERS[args.optimizer][1]
    if args.comm is not None:
        try:  # torchshard checks the value (a rank >= 1, a ratio in (0, 1]) before any launch
            args.comm_object = make_comm(args.comm)
        except (torchshard.TorchShardError, ValueError, TypeError) as e:
            with rank0_speaks():
                parser.error(f"argument --comm: {e}")
    return args


def pipeline_problem(args: argparse.Namespace) -> str | None:
    """What --pp cannot go with (yet), or ``None``."""
    if args.pp < 1:
        return f"expected a number of stages >= 1, got {args.pp}"
    if args.pp == 1:
        return "--microbatches and --schedule need --pp" if args.microbatches else None
    clash = [
        f
        for f, on in [
            ("--tp", args.tp > 1),
            ("--dp-replicate", args.dp_replicate > 1),
            ("--shard full", args.shard == "full"),
            ("--comm", args.comm is not None),
            ("--grad-accum", args.grad_accum > 1),
        ]
        if on
    ]
    if clash:
        return (
            f"pipeline stages do not run with {', '.join(clash)} yet "
            "(--microbatches for accumulation)"
        )
    if args.microbatches is not None and args.microbatches < 1:
        return f"--microbatches: expected >= 1, got {args.microbatches}"
    return None


# --comm NAME[:ARG...]: the torchshard.comm class, the keywords its ARGs set in order with
# their types, and fixed keywords
COMMS = {
    "allreduce": ("AllReduce", (), {}),
    "bf16": ("BF16", (), {}),
    "fp16": ("FP16", (), {}),
    "star": ("Star", (("root", int),), {}),
    "powersgd": ("PowerSGD", (("rank", int), ("start_step", int)), {}),
    "topk": ("TopK", (("ratio", float), ("start_step", int)), {}),
    "topk-noef": ("TopK", (("ratio", float), ("start_step", int)), {"error_feedback": False}),
}


class CommSpec(NamedTuple):
    """``--comm NAME[:ARG...]`` as given: its text, the name, the keywords it sets."""

    text: str
    name: str
    kwargs: dict


def comm_spec(text: str) -> CommSpec:
    """Parse ``--comm NAME[:ARG...]``: the syntax only (torchshard checks the values).

    >>> comm_spec("powersgd:4").kwargs
    {'rank': 4}
    >>> comm_spec("powersgd:4:30").kwargs
    {'rank': 4, 'start_step': 30}
    """
    name, sep, rest = text.partition(":")
    if name not in COMMS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(COMMS)}, with :ARG where it takes one, got {text!r}"
        )
    _, keys, fixed = COMMS[name]
    args = rest.split(":") if sep else []
    if len(args) > len(keys):
        if not keys:
            raise argparse.ArgumentTypeError(f"{name} takes no argument, got {text!r}")
        form = name + "".join(f"[:{k.upper()}" for k, _ in keys) + "]" * len(keys)
        raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
    kwargs = dict(fixed)
    for (key, kind), arg in zip(keys, args):
        try:
            kwargs[key] = kind(arg)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(
                f"{name}:{key.upper()} must be {what}, got {text!r}"
            ) from None
    return CommSpec(text, name, kwargs)


def make_comm(spec: CommSpec):
    """The ``torchshard.comm`` object ``spec`` names; raises what torchshard raises for a
    value out of range."""
    cls = COMMS[spec.name][0]
    try:
        return getattr(torchshard.comm, cls)(**spec.kwargs)
    except TypeError as e:  # a keyword this torchshard does not take
        call = ", ".join(f"{k}={v!r}" for k, v in spec.kwargs.items())
        raise TypeError(f"{spec.text}: torchshard.comm.{cls}({call}): {e}") from e


def fmt_bytes(n: float) -> str:
    """``165.0 KiB``, ``3.2 MiB``.

    >>> fmt_bytes(3 * 2**19)
    '1.5 MiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    text = "\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n = int(0.9 * len(data))
    return data[:n], data[n:]


class TextBlocks(Dataset):
    """Sample i: bytes ``i * block`` to ``(i + 1) * block`` as input, the same shifted by one
    as target (non-overlapping sequences: an epoch reads the text once)."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block : (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


def make_loader(
    data: torch.Tensor,
    block: int,
    global_batch: int,
    seed: int,
    workers: int,
    device,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[torchshard.GlobalBatchSampler, DataLoader]:
    """This rank's part of each global batch of ``global_batch`` sequences, in an order that
    is the same at any world size. ``rank``, ``world_size``: this rank's place among the
    data-parallel ranks (a trainer's ``rank`` and ``world_size``; by default the default
    process group's). Exits with the reason if the world size does not divide
    ``global_batch``."""
    dataset = TextBlocks(data, block)
    try:
        sampler = torchshard.GlobalBatchSampler(
            len(dataset), global_batch, seed=seed, rank=rank, world_size=world_size
        )
    except torchshard.DataError as e:
        dist.barrier()  # every rank fails alike; none leaves while a peer still connects
        raise SystemExit(f"--batch-size {global_batch} (the global batch): {e}") from e
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,  # start them once, not every epoch
        pin_memory=torch.device(device).type == "cuda",
    )
    return sampler, loader


def make_mesh(replicas: int, tp: int = 1, pp: int = 1) -> torchshard.Mesh | None:
    """``--dp-replicate``, ``--tp``, ``--pp``: the mesh of ``replicas`` replicas of shard
    groups, each rank's tensor-parallel group the ``tp`` consecutive ranks, ``pp`` pipeline
    ranks outermost (``None`` for 1, 1 and 1: the trainer shards over every rank). Exits
    with the reason where it does not fit the world size (every rank alike)."""
    if replicas == 1 and tp == 1 and pp == 1:
        return None
    try:
        return torchshard.init_mesh(dp_replicate=replicas, tp=tp, pp=pp)
    except torchshard.MeshError as e:
        dist.barrier()  # every rank fails alike; none leaves while a peer still connects
        flags = [f"--dp-replicate {replicas}"] * (replicas > 1) + [f"--tp {tp}"] * (tp > 1)
        flags += [f"--pp {pp}"] * (pp > 1)
        raise SystemExit(f"{' '.join(flags)}: {e}") from e


def split_model(model, plan, mesh: torchshard.Mesh | None, **kwargs) -> torchshard.FlatParamModule:
    """``FlatParamModule(model, **kwargs)``, split by ``plan`` over ``mesh.tp`` where the mesh
    has ``tp > 1``. Exits with the reason where the plan does not fit (heads, vocabulary
    that the degree does not divide): every rank alike, before any step."""
    if mesh is None or mesh.tp_size == 1:
        return torchshard.FlatParamModule(model, **kwargs)
    try:
        return torchshard.FlatParamModule(model, tp_plan=plan, mesh=mesh, **kwargs)
    except torchshard.TPPlanError as e:
        dist.barrier()  # every rank fails alike; none leaves while a peer still connects
        raise SystemExit(f"--tp {mesh.tp_size}: {e}") from e


def data_rank(mesh: torchshard.Mesh | None) -> dict[str, int]:
    """This rank's place among the data-parallel ranks, as ``make_loader``'s keywords: the
    mesh's ``dp_rank`` and ``dp_size`` (the tensor-parallel ranks of a group read the same
    batches; under hybrid sharding every rank is a data-parallel rank); without a mesh
    none (the default process group's rank and size)."""
    return {} if mesh is None else {"rank": mesh.dp_rank, "world_size": mesh.dp_size}


def describe_mesh(mesh: torchshard.Mesh | None) -> str:
    """For the log: `` (hybrid: 2 replicas x 2 shards)``, `` (tensor parallel: 2
    data-parallel x tp 2)``, both, or ``""``."""
    if mesh is None:
        return ""
    replicas, shards, tp = mesh.shape
    parts = [f"hybrid: {replicas} replicas x {shards} shards"] if replicas > 1 else []
    if tp > 1:
        parts.append(f"tensor parallel: {mesh.dp_size} data-parallel x tp {tp}")
    if mesh.pp_size > 1:
        parts.append(f"pipeline: pp {mesh.pp_size} x {mesh.dp_size} data-parallel")
    return f" ({', '.join(parts)})" if parts else ""


def load_data_state(sampler: torchshard.GlobalBatchSampler, extra: dict, reset: bool) -> None:
    """Continue the data where the checkpoint's loop stopped receiving it (at any world size).
    ``reset`` (--reset-data-position): a saved position that does not fit this run is set
    anew (:func:`reset_data_position`) instead of exiting with the reason."""
    if "data" not in extra:
        log.info("the checkpoint holds no data position: the data starts at epoch 0")
        return
    try:
        sampler.load_state_dict(extra["data"])
    except torchshard.DataError as e:
        if not reset:
            raise SystemExit(
                f"the checkpoint's data position does not fit this run: {e} (--batch-size, "
                "--block-size and --seed must be the saved run's, or --reset-data-position "
                "sets the position anew for this run's)"
            ) from e
        reset_data_position(sampler, extra["data"])
    log.info(
        "data: epoch %d, global batch %d of %d",
        sampler.epoch,
        sampler.state_dict()["consumed"],
        len(sampler),
    )


def reset_data_position(sampler: torchshard.GlobalBatchSampler, saved: dict) -> None:
    """The saved epoch, continued in this run's global batches, said loudly.

    An epoch's order does not depend on the global batch size (GlobalBatchSampler), so when only
    that changed the epoch continues after the samples the saved run received, rounded up
    to this run's next whole global batch: none is seen twice, fewer than one global batch
    is skipped. Another block size (other samples) or seed (another order) cannot be mapped:
    the saved epoch starts again from its first global batch.
    """
    epoch, consumed, old_batch = (
        saved.get(k, 0) for k in ("epoch", "consumed", "global_batch_size")
    )
    same_order = all(
        saved.get(k) == getattr(sampler, k) for k in ("num_samples", "seed", "shuffle")
    )
    seen = consumed * old_batch  # samples of the epoch the saved run received
    position = min(-(-seen // sampler.global_batch_size), len(sampler)) if same_order else 0
    sampler.load_state_dict({**sampler.state_dict(), "epoch": epoch, "consumed": position})
    was = f"epoch {epoch}, {consumed} global batches of {old_batch} received"
    if same_order:
        skipped = max(0, position * sampler.global_batch_size - seen)
        now = (
            f"epoch {epoch}, {position} global batches of {sampler.global_batch_size} received: "
            f"the epoch goes on after its first {seen} sequences ({skipped} skipped, none twice)"
        )
    else:
        now = f"epoch {epoch} from its start (this --block-size or --seed orders it otherwise)"
    log.warning("WARNING: --reset-data-position: the data position %s becomes %s", was, now)


def decided_by_rank0(decide, device):
    """``decide()``, called on rank 0 only; its answer, on every rank.

    Decisions that read the filesystem ("is there a checkpoint?") or the environment must
    be taken once for all ranks. On a shared directory over NFS, attribute caching can show
    one node a checkpoint that another does not see yet (a non-shared directory differs
    for good); ranks that branch on their own look then part ways, some entering a
    collective (a barrier, a load) that the others never join, and the job hangs until
    the collective timeout. ``device``: where the backend's tensors live (the trainer's).
    The answer travels as JSON in a byte tensor (paths become strings): no pickle."""
    data = json.dumps(decide(), default=str).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], device=device)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=device)  # once per run
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().tolist()))


def overwrite_or_resume(
    args: argparse.Namespace,
    ckpt: torchshard.checkpoint.Checkpointer | None,
    trainer: torchshard.DistributedTrainer,
    opt: torch.optim.Optimizer,
    latest: str | None,
) -> torchshard.checkpoint.CheckpointInfo | None:
    """``--overwrite``: delete the earlier run's checkpoints (``latest``: rank 0's look);
    ``--resume``/``--resume-from``: load one (see :func:`resume`). What was loaded, if any."""
    if not args.resume and latest is not None:  # --overwrite
        log.info("--overwrite: removing %s's old checkpoints", args.ckpt_dir)
        if dist.get_rank() == 0:
            for old in Path(args.ckpt_dir).glob("step-*"):
                shutil.rmtree(old)
        dist.barrier()  # no rank saves into the directory before they are gone
    if not args.resume:
        return None
    return resume(ckpt, trainer, opt, args.resume_from, latest, args.ckpt_dir)


def resume(
    ckpt: torchshard.checkpoint.Checkpointer | None,
    trainer: torchshard.DistributedTrainer,
    opt: torch.optim.Optimizer,
    resume_from: str | None,
    latest: str | None,
    ckpt_dir: str,
) -> torchshard.checkpoint.CheckpointInfo | None:
    """Load ``resume_from`` exactly, or else the newest checkpoint under ``ckpt_dir`` that
    loads (``fallback=True``: one that fails verification is skipped, rank 0 says which and
    why); ``None`` if ``latest`` (rank 0's look) is none. Exits with the reason when nothing
    loads: every rank fails alike, having changed nothing.

    The checkpoints of ``ckpt_dir`` after the one loaded are set aside: the damaged ones
    the fallback skipped by the Checkpointer (renamed ``step-N.bad``), those after
    ``resume_from`` here (renamed ``step-N.skipped``): this run saves those steps again,
    and a save never replaces a checkpoint."""
    try:
        if resume_from is not None:
            resumed = torchshard.checkpoint.load(resume_from, trainer, optimizer=opt)
        elif latest is None:
            log.info("--resume: no checkpoint under %r, starting from scratch", ckpt_dir)
            return None
        else:
            resumed = ckpt.load(trainer, optimizer=opt, fallback=True)
    except torchshard.checkpoint.CheckpointError as e:
        raise SystemExit(f"{Path(sys.argv[0]).stem}: cannot resume: {e}") from e
    loss = resumed.extra.get("loss")
    tp, pp = resumed.extra.get("tp", 1), resumed.extra.get("pp", 1)
    log.info(
        "resumed from %s (saved at world size %s%s%s, loss %s)",
        resumed.path,
        resumed.extra.get("world_size", "-"),
        f", tp {tp}" if tp > 1 else "",
        f", pp {pp}" if pp > 1 else "",
        "-" if loss is None else f"{loss:.4f}",
    )
    if ckpt is not None:
        if dist.get_rank() == 0:
            later = [p for p in Path(ckpt_dir).glob("step-*") if p.name[5:].isdigit()]
            for path in sorted(p for p in later if int(p.name[5:]) > resumed.step):
                aside, n = path.with_name(f"{path.name}.skipped"), 1
                while aside.exists():  # one set aside before: keep both
                    n += 1
                    aside = path.with_name(f"{path.name}.skipped-{n}")
                path.rename(aside)
                log.warning(
                    "WARNING: %s is after the checkpoint resumed: renamed %s", path, aside.name
                )
        dist.barrier()  # no rank saves before they are out of the way
    return resumed


def open_metrics(ckpt_dir: str, start: int) -> io.TextIOBase:
    """``ckpt_dir/metrics.jsonl``, for appending a JSON line per log step (on rank 0).

    A fresh run starts the file anew; a resumed one keeps the lines up to its checkpoint's
    step and drops those after it (logged by an attempt that did not reach a checkpoint, or
    a branch given up by --resume-from), so the file tells one run's story."""
    path = Path(ckpt_dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if start and path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a crash
                if json.loads(line)["step"] <= start:
                    kept.append(line + "\n")
    f = path.open("w")
    f.writelines(kept)
    f.flush()
    return f


def run_reporting_once(main) -> None:
    """Call ``main()``: an error it exits with (a message, the same on every rank) is printed
    by rank 0 only; the other ranks exit with the same status, quietly."""
    try:
        main()
    except SystemExit as e:
        if e.code in (None, 0) or int(os.environ.get("RANK", "0")) == 0:
            raise
        sys.exit(e.code if isinstance(e.code, int) else 1)


def forever(batches):
    """Pass after pass (epoch after epoch) over ``batches``."""
    while True:
        yield from batches


def batch_generator(seed: int, rank: int, step: int, micro: int) -> torch.Generator:
    """Random windows that depend only on (seed, rank, step, micro), for the benchmarks (the
    example reads sequences through make_loader)."""
    return torch.Generator().manual_seed(
        ((seed * 1_000_003 + rank) * 1_000_003 + step) * 64 + micro
    )


def get_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator, device):
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + block] for s in starts])
    if torch.device(device).type == "cuda":  # page-locked, so that the copies are asynchronous
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    # torchrun restarted this worker after a failure: continue from the last checkpoint.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    args.resume = args.resume or restarted
    info = torchshard.init_distributed()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    # Rank 0 logs; the others, whose lines would repeat its own, say nothing (not even the
    # warnings that Python prints where no handler is configured).
    handler = logging.StreamHandler() if info.rank == 0 else logging.NullHandler()
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler])
    ckpt = (
        torchshard.checkpoint.Checkpointer(args.ckpt_dir, keep_last=args.keep_last)
        if args.ckpt_dir
        else None
    )

    # Rank 0 looks for a checkpoint (and whether this is a restart) and every rank acts on
    # its answer: resume it, refuse to start over it, or delete it (--overwrite). A worker
    # restarted after --resume-from's run saved continues from that run's latest instead.
    def look() -> tuple[bool, str | None, str | None]:
        latest = ckpt.latest() if ckpt is not None else None
        resume_from = None if restarted and latest is not None else args.resume_from
        return args.resume or resume_from is not None, latest, resume_from

    args.resume, latest, args.resume_from = decided_by_rank0(look, info.device)
    if not args.resume and not args.overwrite and latest is not None:
        if info.rank == 0:  # never lose a run by launching the same command again
            print(
                f"train_gpt: {args.ckpt_dir} holds checkpoints (latest: {latest}); "
                "--resume continues them, --overwrite deletes them and starts again, "
                "--ckpt-dir picks another directory",
                file=sys.stderr,
            )
        sys.exit(2)

    train, val = load_corpus()
    overrides = {k: v for k, v in dict(n_layer=args.n_layer, n_embd=args.n_embd).items() if v}
    base = GPTConfig.preset(args.preset)
    # bytes are the tokens: vocab_size 256 whatever the preset says
    cfg = GPTConfig(
        **{**base.__dict__, **overrides, "block_size": args.block_size, "vocab_size": 256}
    )
    # Build without storage; the trainer allocates one flat buffer on the device,
    # and every rank starts from rank 0's weights.
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = GPT(cfg)
    mesh = make_mesh(args.dp_replicate, args.tp, args.pp)
    dtype = torch.bfloat16 if args.bf16 else None
    if args.bucket_mb is None:
        args.bucket_mb = 25.0 if info.device.type == "cuda" else 1.0
    pipe = make_pipeline(model, mesh, args, info.device, dtype) if args.pp > 1 else None
    # --tp: each rank lays out its own pieces; the one-process init, sliced (bitwise)
    fm = None if pipe else split_model(model, TP_PLAN, mesh, dtype=dtype)
    comm = {} if args.comm is None else {"comm": args.comm_object}
    try:
        trainer = pipe or torchshard.DistributedTrainer(
            fm,
            device=info.device,
            mesh=mesh,
            bucket_mb=args.bucket_mb,
            init_fn=init_gpt_weights,
            shard={None: False, "optimizer": True, "full": "full"}[args.shard],
            **comm,
        )
    except torchshard.MeshError as e:  # a mode without hybrid sharding: every rank alike
        dist.barrier()
        raise SystemExit(f"--dp-replicate {args.dp_replicate}: {e}") from e
    except torchshard.CommError as e:  # a comm this mode does not run: every rank alike
        dist.barrier()
        raise SystemExit(f"--comm {args.comm.text}: {e}") from e
    # the data-parallel ranks' parts of each global batch (under hybrid sharding: every rank;
    # under --tp: the tensor-parallel ranks of a group read the same part)
    sampler, loader = make_loader(
        train,
        args.block_size,
        args.batch_size,
        args.seed,
        args.num_workers,
        info.device,
        **data_rank(mesh),
    )

    # No weight decay for biases, LayerNorms and position embeddings; the same groups in
    # both modes, so a checkpoint of one resumes in the other.
    def no_decay(name: str) -> bool:
        return name.endswith("bias") or ".ln_" in name or name.startswith(("ln_", "wpe"))

    if args.optimizer == "sgd":
        opt = trainer.make_optimizer(torch.optim.SGD, lr=args.lr, momentum=0.9)
    else:
        opt = trainer.make_optimizer(
            torch.optim.AdamW,
            lr=args.lr,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            groups=[(no_decay, {"weight_decay": 0.0})],
        )
    start, elapsed = 0, 0.0  # steps and training seconds before this launch
    resumed = overwrite_or_resume(args, ckpt, trainer, opt, latest)
    if resumed is not None:
        start, elapsed = resumed.step, resumed.extra.get("elapsed_s", 0.0)
        load_data_state(sampler, resumed.extra, args.reset_data_position)
    # Rank 0 records what it logs, for examples/plot_metrics.py.
    metrics = open_metrics(args.ckpt_dir, start) if args.ckpt_dir and info.rank == 0 else None
    log.info(
        "world %d on %s, %s: %.2fM parameters, corpus %d bytes, %d %s, %s at lr %g",
        info.world_size,
        info.device,
        {None: "replicated", "optimizer": "sharded", "full": "fully sharded"}[args.shard]
        + describe_mesh(mesh),
        torchshard.FlatLayout.from_module(model).param_numel / 1e6,
        len(train) + len(val),
        trainer.stats.buckets,
        "units" if args.shard == "full" else f"buckets of {args.bucket_mb:g} MiB",
        OPTIMIZERS[args.optimizer][0],
        args.lr,
    )

    tokens_per_step = args.batch_size * args.block_size * args.grad_accum  # all ranks
    # Counted as the loop receives them (the workers draw ahead): what a checkpoint saves.
    batches = forever(sampler.track(loader))
    t_last, wait_last, n_logged, first_loss = time.perf_counter(), 0.0, 0, None
    wire_last = (0, 0)  # --comm: bytes on the wire and their dense equivalent, at the last log
    t_start = t_last
    # The loss summed on the device since the last log, read (a host sync) only at log steps.
    loss_sum = torch.zeros(1, device=info.device)
    mean_loss = float("nan")
    last = min(args.steps, args.stop_at or args.steps)
    for step in range(start + 1, last + 1):
        lr = args.lr * min(1.0, step / args.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        trainer.zero_grad()
        if pipe is not None:  # --pp: the stages run the step's microbatches (--schedule)
            x, y = (t.to(info.device, non_blocking=True) for t in next(batches))
            loss_sum += pipe.forward_backward(x, target=y).float()
        for micro in range(args.grad_accum if pipe is None else 0):
            # pinned by the DataLoader on CUDA: the host queues the copies and goes on
            x, y = (t.to(info.device, non_blocking=True) for t in next(batches))
            # fully sharded: every backward reduce-scatters (no unsharded gradient to keep)
            sync_later = micro < args.grad_accum - 1 and trainer.shard != "full"
            with trainer.no_sync() if sync_later else contextlib.nullcontext():
                _, loss = fm(x, y)
                (loss / args.grad_accum).backward()
            loss_sum += loss.detach().float() / args.grad_accum
        trainer.clip_grad_norm_(args.max_grad_norm)  # averages (or reduces) the gradients first
        trainer.step()  # the optimizer step; sharded: then all-gathers the updated slices
        n_logged += 1

        if step % args.log_every == 0 or step == args.steps:
            mean = loss_sum / n_logged
            dist.all_reduce(mean)
            mean_loss = mean.item() / info.world_size
            first_loss = first_loss or mean_loss
            now, wait = time.perf_counter(), trainer.stats.wait_seconds
            steps_done, n_logged = n_logged, 0
            tok_per_s = tokens_per_step * steps_done / (now - t_last)
            wait_ms = 1000 * (wait - wait_last) / steps_done
            sent = ""
            if args.comm is not None:  # what compression saves: this rank's payload per step
                wire = (trainer.stats.payload_bytes, trainer.stats.bytes_reduced)
                payload, dense = ((a - b) / steps_done for a, b in zip(wire, wire_last))
                sent = f"  sent {fmt_bytes(payload)}/step (dense {fmt_bytes(dense)})"
                wire_last = wire
            log.info(
                "step %4d  loss %.4f  lr %.3g  %6.0f tok/s  comm wait %.1f ms/step%s",
                step,
                mean_loss,
                lr,
                tok_per_s,
                wait_ms,
                sent,
            )
            if metrics is not None:  # rounded as printed: no float noise in the file either
                record = {
                    "step": step,
                    "loss": round(mean_loss, 6),
                    "lr": float(f"{lr:.6g}"),
                    "tokens_per_s": round(tok_per_s, 1),
                    "comm_wait_ms_per_step": round(wait_ms, 3),
                    "elapsed_s": round(elapsed + now - t_start, 3),
                }
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            t_last, wait_last = now, wait
            loss_sum.zero_()
        if step == args.fail_at and info.rank == info.world_size - 1 and not restarted:
            print(f"train_gpt: --fail-at {step}: rank {info.rank} kills itself", file=sys.stderr)
            os.kill(os.getpid(), signal.SIGKILL)
        if ckpt is not None and (step % args.save_every == 0 or step == last):
            # Returns at once; the weights are staged in the background and written
            # while training goes on (the next optimizer step waits for the staging copy).
            # The data position: world-size free, the same on every rank, JSON.
            extra = {
                "world_size": info.world_size,
                "tp": args.tp,
                "pp": args.pp,
                "loss": mean_loss if math.isfinite(mean_loss) else None,  # JSON has no NaN
                "data": sampler.state_dict(),
                "elapsed_s": elapsed + time.perf_counter() - t_start,  # training time so far
            }
            ckpt.save(trainer, step=step, optimizer=opt, extra=extra)

    if metrics is not None:
        metrics.close()
    if ckpt is not None:
        ckpt.close()  # waits for the last save to be committed
        log.info(
            "checkpoints: %s", ", ".join(p.name for p in sorted(Path(args.ckpt_dir).glob("step-*")))
        )
    val_loss = evaluate(pipe or fm, val, args, info.device)
    log.info(
        "done: first logged loss %.4f, validation loss %.4f", first_loss or float("nan"), val_loss
    )
    trainer.close()
    return val_loss


@torch.no_grad()
def evaluate(model, data: torch.Tensor, args, device) -> float:
    """The mean loss of 4 batches of ``data`` (the same on every rank): ``model`` a
    FlatParamModule, or a Pipeline (forward only, through its schedule)."""
    gen = torch.Generator().manual_seed(1234)
    batches = [get_batch(data, args.batch_size, args.block_size, gen, device) for _ in range(4)]
    if isinstance(model, torchshard.Pipeline):
        return torch.stack([model.evaluate(x, target=y) for x, y in batches]).mean().item()
    model.eval()
    losses = [model(x, y)[1] for x, y in batches]
    model.train()
    return torch.stack(losses).mean().item()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A microbatch's mean cross-entropy, as GPT's forward computes it (the last stage's)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_pipeline(model, mesh: torchshard.Mesh, args, device, dtype) -> torchshard.Pipeline:
    """--pp: the model in stages of consecutive blocks over the mesh's pipeline ranks, each
    stage a trainer over its data-parallel ranks. Exits with the reason where the model
    does not split or the batch does not cut into --microbatches (every rank alike)."""
    local = args.batch_size // mesh.dp_size
    if args.batch_size % mesh.dp_size or local % args.microbatches:
        dist.barrier()  # every rank fails alike; none leaves while a peer still connects
        raise SystemExit(
            f"--batch-size {args.batch_size}: each of the {mesh.dp_size} data-parallel ranks "
            f"must get a part that --microbatches {args.microbatches} divides"
        )
    try:
        return torchshard.Pipeline(
            model,
            mesh=mesh,
            microbatches=args.microbatches,
            loss_fn=gpt_loss,
            schedule=args.schedule,
            shard=args.shard == "optimizer",
            dtype=dtype,
            init_fn=init_gpt_weights,
            device=device,
            bucket_mb=args.bucket_mb,
        )
    except torchshard.PipelineError as e:
        dist.barrier()
        raise SystemExit(f"--pp {args.pp}: {e}") from e


if __name__ == "__main__":
    run_reporting_once(main)
