"""``torchshard estimate``'s command line: its arguments, parsed, and the text it prints.

The modes it offers (``--replicated``, ``--shard``, ...) are the registry's
(``_parallel/modes.py``); sizes and ``--set`` overrides are parsed here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._errors import TorchShardError
from .._flat.tp_plan import resolve_plan
from .._parallel.modes import MODES
from .._parallel.tpcost import tp_layout
from .._parallel.units import resolve_units
from .estimate import DTYPES, OPTIMIZERS, estimate_memory
from .model import EstimateError, build_factory, build_hf_model, is_factory, layout_of
from .table import format_estimate
from .trainable import DEFAULT_LORA_TARGETS, Trainable

__all__ = ["add_parser", "parse_bytes", "parse_override", "run", "trainable_of"]

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}  # bare letters: binary
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"80GiB"`` / ``"24G"`` (binary), ``"80GB"`` (decimal), ``"1e9"`` / ``"1000"`` (bytes).

    Example::

        parse_bytes("80GiB") == 80 * 2**30
    """
    m = _SIZE.fullmatch(text)
    if m is None:
        try:
            value = float(text)  # 1e9
        except ValueError:
            value = -1.0
        if not (value > 0 and math.isfinite(value)):
            raise EstimateError(
                f"device memory: expected a size such as 80GiB, 80GB, 24G or a number of "
                f"bytes, got {text!r}"
            ) from None
        return int(value)
    number, prefix, binary, b = m.groups()
    prefix = prefix.lower()
    if binary and not prefix:
        raise EstimateError(f"device memory: expected a unit such as GiB, got {text!r}")
    unit = _UNITS[prefix] if binary or not b else 1000 ** "_kmgt".index(prefix)
    value = int(float(number) * unit)
    if value <= 0:
        raise EstimateError(f"device memory: expected a positive size, got {text!r}")
    return value


def parse_override(item: str) -> tuple[str, Any]:
    """``"num_hidden_layers=80"`` -> ``("num_hidden_layers", 80)``: JSON values, else strings.

    Example::

        parse_override("tie_word_embeddings=false") == ("tie_word_embeddings", False)
    """
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not key.isidentifier():
        raise EstimateError(f"--set: expected key=value (e.g. num_hidden_layers=80), got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _number(cast: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable:
    """An argparse ``type``: ``cast(text)`` when ``ok`` holds for it, else the error naming
    ``what`` was expected."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_count = _number(int, lambda v: v >= 0, "an integer >= 0")
_fraction = _number(float, lambda v: 0.0 <= v < 1.0, "a fraction in [0, 1)")


def _device_memory(text: str) -> int:
    try:
        return parse_bytes(text)
    except EstimateError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("device memory: ")) from e


def _override(text: str) -> tuple[str, Any]:
    try:
        return parse_override(text)
    except EstimateError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--set: ")) from e


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``estimate`` subcommand to ``sub`` (``parser.add_subparsers()``); returns it.

    Example::

        p = add_parser(parser.add_subparsers(dest="command"))
        p.set_defaults(run=lambda args: print(run(args)))
    """
    p = sub.add_parser(
        "estimate",
        help="per-rank memory to train a model (built on meta: no weights, no GPU)",
        description="Print the bytes each rank holds to train MODEL with torchshard's trainer "
        "(parameters, gradients, optimizer state, fp32 master weights and their gradient; "
        "fully sharded, also the unit buffers gathered during a step), replicated, sharded "
        "and fully sharded, "
        "and with --device-memory the smallest world size that fits (and, at N ranks, the "
        "smallest hybrid-sharding shard group). Activations, temporary "
        "buffers, the CUDA context and allocator fragmentation are not counted.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a transformers config JSON file, a transformers model_type (llama, gpt2, ...) "
        "with its defaults, or 'module:callable' returning an nn.Module",
    )
    p.add_argument("--world-size", type=_positive_int, required=True, metavar="N")
    p.add_argument(
        "--dp-replicate",
        type=_positive_int,
        default=1,
        metavar="R",
        help="hybrid sharding, init_mesh(dp_replicate=R): the sharded modes cut their state "
        "over shard groups of N / R ranks and all-reduce it across R replicas (default: 1)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=_positive_int,
        metavar="G",
        help="ranks per node: say which groups' traffic crosses nodes (prints the per-step "
        "communication)",
    )
    p.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        metavar="T",
        help="tensor parallelism, init_mesh(tp=T): each rank holds 1/T of every parameter the "
        "plan splits; N counts every rank (N / T data-parallel); T divides the heads, the kv "
        "heads and G (default: 1)",
    )
    p.add_argument(
        "--tp-plan",
        default="auto",
        metavar="PLAN",
        help="with --tp: 'auto' (the transformers model's own plan: q/k/v/o, gate/up/down, "
        "lm_head), a JSON file {glob: style}, or 'module:NAME' (e.g. gpt:TP_PLAN)",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="default: bf16")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default: adamw")
    p.add_argument(
        "--device-memory",
        type=_device_memory,
        metavar="SIZE",
        help="memory per device: 80GiB, 24G (binary), 80GB (decimal) or bytes",
    )
    p.add_argument(
        "--reserve",
        type=_fraction,
        default=0.0,
        metavar="FRACTION",
        help="part of --device-memory kept for what is not counted (default: 0)",
    )
    for e in MODES:
        p.add_argument(e.flag, dest=f"mode_{e.name}", action="store_true", help=e.help)
    p.add_argument(
        "--prefetch",
        type=_count,
        default=1,
        metavar="K",
        help="fully sharded: units gathered ahead (default: 1)",
    )
    p.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fully sharded: free each unit after its forward (default: yes)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        type=_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value (JSON values), e.g. --set num_hidden_layers=80",
    )
    p.add_argument(
        "--lora-rank",
        type=_positive_int,
        metavar="R",
        help="train PEFT LoRA adapters of rank R (needs peft), the base model frozen",
    )
    p.add_argument(
        "--lora-targets",
        type=_names,
        metavar="NAMES",
        help="with --lora-rank: the modules that get adapters, by the end of their names "
        f"(default: {','.join(DEFAULT_LORA_TARGETS)})",
    )
    p.add_argument(
        "--trainable",
        dest="patterns",
        type=_names,
        action="append",
        default=[],
        metavar="REGEX",
        help="train only the parameters whose names match (re.search; repeatable or a comma "
        "list); with --lora-rank, these train besides the adapters",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


def _names(text: str) -> tuple[str, ...]:
    """A comma list, blanks dropped: ``"q_proj, v_proj"`` -> ``("q_proj", "v_proj")``; a
    comma inside braces, brackets or parentheses is a regex's (``"h{1,3}"`` stays whole)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c in "{[(") - (c in ")]}")
        if c == "," and depth <= 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    names = tuple(n.strip() for n in parts if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected one name or more, got {text!r}")
    return names


def trainable_of(args: argparse.Namespace) -> Trainable:
    """What trains, from ``--lora-rank``, ``--lora-targets`` and ``--trainable``.

    Example::

        trainable_of(parser.parse_args(["estimate", "llama", "--world-size", "8",
                                        "--lora-rank", "16"])).lora_rank == 16
    """
    if args.lora_targets and args.lora_rank is None:
        raise EstimateError(
            f"--lora-targets {','.join(args.lora_targets)}: expected --lora-rank R with it, "
            "got none"
        )
    targets = args.lora_targets or DEFAULT_LORA_TARGETS
    patterns = tuple(n for names in args.patterns for n in names)
    return Trainable(lora_rank=args.lora_rank, lora_targets=targets, patterns=patterns)


def _check_tp(args: argparse.Namespace) -> None:
    """``--tp`` divides the world size and the node, and goes without LoRA."""
    t, n, g = args.tp, args.world_size, args.gpus_per_node
    if n % t:
        raise EstimateError(
            f"--tp {t}: expected a divisor of --world-size {n} (N = data-parallel x "
            "tensor-parallel ranks)"
        )
    if g is not None and g % t:
        raise EstimateError(
            f"--tp {t}: expected a divisor of --gpus-per-node {g}: a tensor-parallel group "
            "stays inside a node (its collectives run every layer)"
        )
    if t > 1 and args.lora_rank is not None:
        raise EstimateError(
            f"--tp {t}: expected no --lora-rank with it: LoRA's wrapped layers are not the "
            "nn.Linear a tensor-parallel plan splits"
        )


def _tp_styles(model: Any, args: argparse.Namespace) -> dict[str, str] | None:
    """The plan of ``--tp-plan`` resolved against ``model`` at ``--tp`` ranks (the checks
    ``FlatParamModule(tp_plan=...)`` makes: heads, kv heads, vocabulary, ties), as each
    split module's style by name; ``None`` at ``--tp 1``."""
    if args.tp == 1:
        return None
    spec = args.tp_plan
    try:
        if spec == "auto":
            plan: Any = "auto"
        elif is_factory(spec):
            mod_name, _, attr = spec.partition(":")
            if "" not in sys.path:  # as for a factory: modules in the working directory
                sys.path.insert(0, "")
            plan = getattr(importlib.import_module(mod_name), attr)
        else:
            plan = json.loads(Path(spec).read_text())
    except (ImportError, AttributeError, OSError, ValueError) as e:
        raise EstimateError(
            f"--tp-plan {spec!r}: expected 'auto', a JSON file {{glob: style}} or "
            f"'module:NAME', got {type(e).__name__}: {e}"
        ) from None
    try:
        return resolve_plan(model, plan, args.tp).styles
    except TorchShardError as e:
        raise EstimateError(f"--tp {args.tp}: {e}") from None


def run(args: argparse.Namespace) -> str:
    """What ``torchshard estimate`` prints for the parsed ``args``: a table, or JSON.

    Example::

        print(run(parser.parse_args(["estimate", "gpt2", "--world-size", "8"])))
    """
    overrides = dict(args.overrides)
    trainable = trainable_of(args)  # checked before the model is built
    _check_tp(args)
    dp = args.world_size // args.tp
    if dp % args.dp_replicate:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        of = f"--world-size {args.world_size}" + (
            f" / --tp {args.tp} = {dp}" if args.tp > 1 else ""
        )
        raise EstimateError(
            f"--dp-replicate {args.dp_replicate}: expected a divisor of {of} (the shard groups "
            f"must tile the data-parallel ranks), one of "
            f"{', '.join(map(str, divisors[:12]))}{', ...' if len(divisors) > 12 else ''}"
        )
    dtype = DTYPES[args.dtype]
    if is_factory(args.model):
        if overrides:
            raise EstimateError(
                f"--set: expected a transformers config or model_type to change, got the "
                f"factory {args.model!r}; change the factory instead"
            )
        model, cast = build_factory(args.model), dtype
    else:
        # built in dtype, what transformers keeps in fp32 in fp32: each keeps its own
        model, cast = build_hf_model(args.model, overrides, dtype), None
    model_class = type(model).__name__
    model = trainable.apply(model)  # with LoRA, PEFT's model wrapping it
    chosen = [e for e in MODES if getattr(args, f"mode_{e.name}")] or list(MODES)
    layout = layout_of(model, cast)
    styles = _tp_styles(model, args)  # None without tensor parallelism
    local = tp_layout(layout, args.tp, styles)
    report = estimate_memory(
        layout,
        world_size=args.world_size,
        tp=args.tp,
        tp_plan=styles,
        modes=tuple(e.alias for e in chosen),
        # the units DistributedTrainer(shard=FullShard(units="auto")) would choose for this model
        units=resolve_units(model, local) if any(e.gathers for e in chosen) else None,
        prefetch=args.prefetch,
        reshard_after_forward=args.reshard_after_forward,
        optimizer=args.optimizer,
        device_memory=args.device_memory,
        reserve=args.reserve,
        model=args.model,
        model_class=model_class,
        trainable=trainable,
        dp_replicate=args.dp_replicate,
        gpus_per_node=args.gpus_per_node,
    )
    if args.json:
        return json.dumps(report.to_dict(), indent=1)
    return format_estimate(report)
