"""One model stepped side by side by torch DDP and by torchshard trainers, in one pair of
processes, interleaved step by step (``bench_lora.py``, ``bench_mixed.py``).

:class:`Stepper` is one configuration: the model in DDP (``"ddp"``) or in a
``DistributedTrainer`` of a mode, with its AdamW; :func:`interleave` runs every one on the
same batches, in an order rotated every step, and :func:`per_step` takes the max over the
ranks of each step (a paired ratio is two configurations' at the same step index).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, FlatParamModule

__all__ = [
    "ADAMW",
    "BATCH",
    "BLOCK",
    "CONFIGS",
    "FIELDS",
    "MODES",
    "SMALL",
    "WORLD",
    "Stepper",
    "gradient_bytes",
    "interleave",
    "loss_diff",
    "per_step",
    "run_configs",
    "run_steppers",
    "speed_report",
]

# What both benchmarks step: a small transformers Llama, 2 ranks, these batches, DDP and each
# mode, AdamW; and the memory fields they compare with plan_memory.
WORLD, BATCH, BLOCK = 2, 4, 128
SMALL = dict(
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=2048,
    max_position_embeddings=256,
)
MODES = {"ts_repl": False, "ts_shard": True, "ts_full": "full"}
CONFIGS = ("ddp", *MODES)
ADAMW = dict(lr=1e-3)
FIELDS = ("parameters", "gradients", "optimizer", "master")


class Stepper:
    """``model`` in DDP (``shard`` ``None``) or in a trainer of ``shard``, and AdamW over its
    trainable parameters (``adamw``: its arguments)."""

    def __init__(
        self, name: str, model: torch.nn.Module, shard: bool | str | None, adamw: dict[str, Any]
    ) -> None:
        self.name = name
        self.trainer: DistributedTrainer | None = None
        self.net: torch.nn.Module
        if shard is None:
            self.net = DDP(model)
            trains = [p for p in model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(trains, **adamw)
            self.zero, self.update = self.opt.zero_grad, self.opt.step
        else:
            fm = FlatParamModule(model)
            self.trainer = DistributedTrainer(fm, shard=shard)
            self.net = fm
            self.opt = self.trainer.make_optimizer(torch.optim.AdamW, **adamw)
            self.zero, self.update = self.trainer.zero_grad, self.trainer.step

    def step(self, x: torch.Tensor) -> tuple[float, float, float]:
        """One step after a barrier: wall and CPU seconds, and the loss (read after)."""
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        self.zero()
        loss = self.net(input_ids=x, labels=x).loss
        loss.backward()
        self.update()
        c1, t1 = time.process_time(), time.perf_counter()
        return t1 - t0, c1 - c0, loss.item()


def interleave(
    steppers: Sequence[Stepper], batches: Sequence[torch.Tensor], warmup: int
) -> dict[str, dict[str, list[float]]]:
    """Every stepper on every batch, rotated every step (none is always first): the timed
    steps' ``wall`` and ``cpu`` seconds (after ``warmup``) and every step's ``losses``."""
    out: dict[str, dict[str, list[float]]] = {"wall": {}, "cpu": {}, "losses": {}}
    for kind in out.values():
        for s in steppers:
            kind[s.name] = []
    for i, x in enumerate(batches):
        k = i % len(steppers)
        for s in [*steppers[k:], *steppers[:k]]:
            w, c, loss = s.step(x)
            out["losses"][s.name].append(loss)
            if i >= warmup:
                out["wall"][s.name].append(w)
                out["cpu"][s.name].append(c)
    return out


def run_configs(make: Callable[[str], Stepper], opts: Any) -> dict:
    """:func:`run_steppers` of ``make(name)`` for every one of :data:`CONFIGS`, on batches
    of :data:`BATCH` x :data:`BLOCK` tokens of :data:`SMALL`'s vocabulary."""
    steppers = {name: make(name) for name in CONFIGS}
    return run_steppers(steppers, list(MODES), SMALL["vocab_size"], (BATCH, BLOCK), opts)


def run_steppers(
    steppers: dict[str, Any], modes: Sequence[str], vocab: int, shape: tuple[int, int], opts: Any
) -> dict:
    """Every stepper on this rank on the same random token batches (``shape``, from a seed of
    the rank), ``opts.warmup`` + ``opts.steps`` of them, interleaved; then each mode's
    ``memory()`` and its trainer closed: times, losses, memory."""
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    n = opts.warmup + opts.steps
    batches = [torch.randint(0, vocab, shape, generator=gen) for _ in range(n)]
    timed = interleave(list(steppers.values()), batches, opts.warmup)
    memory = {name: steppers[name].memory() for name in modes}
    for name in modes:
        steppers[name].trainer.close()
    return {**timed, "memory": memory}


def gradient_bytes(memory: dict) -> int:
    """A rank's gradient bytes in a ``memory_stats()`` or ``plan_memory`` dict. The fully
    sharded mode keeps a low-precision or mixed model's trainable stripes in an fp32 master
    with their fp32 gradient, equal in size, in ``master`` (``gradients`` 0): the gradient
    is half of it."""
    return memory["gradients"] or memory["master"] // 2


def per_step(ranks: list[dict], kind: str, name: str) -> list[float]:
    """One sample per step: the max over ranks."""
    return [max(x) for x in zip(*(r[kind][name] for r in ranks))]


def loss_diff(ranks: list[dict], name: str) -> float:
    """The largest |loss - DDP's loss| over every step (warm-up included) and rank."""
    return max(abs(a - b) for r in ranks for a, b in zip(r["losses"][name], r["losses"]["ddp"]))


def speed_report(
    ranks: list[dict], names: Sequence[str], modes: Sequence[str], title: str
) -> dict[str, dict[str, list[float]]]:
    """Print every configuration's step times (median, p10-p90; ``title`` above) and each
    mode's paired ratios to DDP's; the ratios, ``"<mode>.step / ddp.step"`` by wall and CPU."""
    from _common import format_table
    from report.stats import spread_text

    rows = []
    for name in names:
        cells = [
            spread_text([1e3 * v for v in per_step(ranks, k, name)], 1, "") for k in ("wall", "cpu")
        ]
        rows.append((name, *cells, f"{loss_diff(ranks, name):.2e}"))
    print(format_table(["step time (ms)", "wall", "CPU", "max |loss - DDP|"], rows, title))
    paired = {
        f"{name}.step / ddp.step": {
            kind: [a / b for a, b in zip(per_step(ranks, kind, name), per_step(ranks, kind, "ddp"))]
            for kind in ("wall", "cpu")
        }
        for name in modes
    }
    rows = [(k, spread_text(v["wall"]), spread_text(v["cpu"])) for k, v in paired.items()]
    print(format_table(["paired step ratio", "wall", "CPU"], rows, "\nmedian (p10-p90) over steps"))
    return paired
