"""Tensor-parallel plans: which parameter is split along which dimension, checked.

A plan maps module-name globs to styles (transformers' names). Pure metadata: resolving a
plan reads module types, names and shapes only, so it works on a model built on meta, and
every rank resolves it alike (a bad plan raises on every rank, before any collective).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from .._errors import TPPlanError, and_more
from .layout import FlatLayout

__all__ = [
    "STYLES",
    "Split",
    "auto_plan",
    "local_layout",
    "match_plan",
    "matches",
    "resolve_plan",
    "split_of",
]

STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "packed_colwise",
    "embedding_rowwise",
)
"""The plan styles: a Linear split by output features (``colwise``; its output gathered:
``colwise_gather_output``; its fused parts each split: ``packed_colwise``), by input
features (``rowwise``), or an Embedding split by vocabulary (``embedding_rowwise``)."""

_EMBEDDING = ("embedding_rowwise",)


@dataclass(frozen=True)
class Split:
    """How a parameter is split over ``T`` tensor-parallel ranks: along ``dim``, in
    ``parts`` equal fused parts (1: plain), each cut into ``T`` contiguous pieces; rank ``r``
    holds piece ``r`` of every part, the parts back to back.

    Example::

        Split(0, 3).local_shape((12, 4), 2)   # (6, 4): a fused q/k/v split over 2 ranks
    """

    dim: int
    parts: int = 1

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] //= tp
        return tuple(out)

    def pieces(self, size: int, rank: int, tp: int) -> list[tuple[int, int]]:
        """``[a, b)`` along :attr:`dim` of the whole tensor that rank ``rank`` holds, in its
        order (one per part)."""
        part = size // self.parts
        step = part // tp
        return [(j * part + rank * step, j * part + (rank + 1) * step) for j in range(self.parts)]

    def take(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """Rank ``rank``'s piece of the whole tensor ``full`` (a view when it is one piece)."""
        got = [
            full.narrow(self.dim, a, b - a) for a, b in self.pieces(full.shape[self.dim], rank, tp)
        ]
        return got[0] if len(got) == 1 else torch.cat(got, self.dim)

    def put(self, full: torch.Tensor, local: torch.Tensor, rank: int, tp: int) -> None:
        """Write rank ``rank``'s piece ``local`` into its place in ``full``."""
        at = 0
        for a, b in self.pieces(full.shape[self.dim], rank, tp):
            full.narrow(self.dim, a, b - a).copy_(local.narrow(self.dim, at, b - a))
            at += b - a

    def to_json(self) -> list[int]:
        return [self.dim, self.parts]


def split_of(style: str, leaf: str, parts: int = 2) -> Split | None:
    """The split a style gives a module's parameter ``leaf`` (``"weight"``, ``"bias"``);
    ``None``: replicated (a rowwise bias, added once after the reduction)."""
    if style in ("colwise", "colwise_gather_output"):
        return Split(0)
    if style == "packed_colwise":
        return Split(0, parts)
    if style == "rowwise":
        return Split(1) if leaf == "weight" else None
    if style == "embedding_rowwise":
        return Split(0)
    raise TPPlanError(f"tp_plan: unknown style {style!r}; expected one of {', '.join(STYLES)}")


def matches(glob: str, name: str) -> bool:
    """Whether a plan glob names a module: dot-separated tokens matched one by one
    (``*`` never crosses a dot), as ``torch.distributed.tensor.parallel`` matches.

    Example::

        matches("layers.*.mlp.up_proj", "layers.3.mlp.up_proj")  # True
    """
    a, b = glob.split("."), name.split(".")
    return len(a) == len(b) and all(fnmatchcase(y, x) for x, y in zip(a, b))


def match_plan(plan: Mapping[str, str], modules: Iterable[str], owner: str) -> dict[str, str]:
    """Each module of ``modules`` (names; ``""``, the root, is never split) that a glob of
    ``plan`` names, with the style of the first glob naming it. A glob without wildcards is
    one module's own name (a resolved plan has one per module) and is looked up, not matched
    against every name. ``owner`` names what the modules belong to, for the error. Raises
    :class:`TPPlanError` for an unknown style or a glob that names no module.

    Example::

        match_plan({"blocks.*.attn.c_attn": "packed_colwise"}, names, "GPT")
        # {"blocks.0.attn.c_attn": "packed_colwise", "blocks.1.attn.c_attn": ...}
    """
    known = [m for m in modules if m]
    names = set(known)
    styles: dict[str, str] = {}
    for glob, style in plan.items():
        split_of(style, "weight")  # a known style
        if any(c in glob for c in "*?["):
            hit = [m for m in known if matches(glob, m)]
        else:
            hit = [glob] if glob in names else []
        if not hit:
            raise TPPlanError(
                f"tp_plan: {glob!r} names no module of {owner} (module names look like "
                f"{and_more(known)})"
            )
        for m in hit:
            styles.setdefault(m, style)
    return styles


def auto_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's own plan: its config's ``base_model_tp_plan`` under the base
    model's prefix, and the model's ``_tp_plan`` (e.g. ``lm_head``). An ``nn.Embedding``
    that no glob names but whose weight is tied to one the plan splits by vocabulary (a
    ``colwise`` head) gets ``"embedding_rowwise"``, as transformers 5 adds to its own plans
    (older plans name only the head, and the tied pair would get different splits).

    Example::

        auto_plan(llama)["model.embed_tokens"]   # "embedding_rowwise"
    """
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base and not getattr(model, "_tp_plan", None):
        raise TPPlanError(
            f"tp_plan='auto': {type(model).__name__} declares no tensor-parallel plan "
            "(a transformers model's config.base_model_tp_plan); pass tp_plan={glob: style}"
        )
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    plan = {(f"{prefix}.{k}" if inner else k): v for k, v in base.items()}
    plan.update(dict(getattr(model, "_tp_plan", None) or {}))
    return _split_tied_embeddings(model, plan)


def _split_tied_embeddings(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` and ``"embedding_rowwise"`` for each unnamed ``nn.Embedding`` tied to a weight
    that a ``colwise`` style splits by rows (its vocabulary)."""

    def style(name: str) -> str | None:
        return next((s for g, s in plan.items() if matches(g, name)), None)

    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        p = m._parameters.get("weight")
        if p is not None and mname:
            owners.setdefault(id(p), []).append((mname, m))
    out = dict(plan)
    for group in owners.values():
        if any(style(n) in ("colwise", "colwise_gather_output") for n, _ in group):
            for n, m in group:
                if type(m) is nn.Embedding and style(n) is None:
                    out[n] = "embedding_rowwise"
    return out


@dataclass(frozen=True)
class Resolved:
    """A resolved plan: each split module's style (by name), and each split parameter's
    :class:`Split` (by every name it has)."""

    styles: dict[str, str]
    splits: dict[str, Split]


def resolve_plan(model: nn.Module, plan: Mapping[str, str] | str, tp: int) -> Resolved:
    """Match ``plan`` against ``model``'s modules and check that it fits ``tp`` ranks:
    every glob names a module, each style fits its module type, every split dimension
    (heads, hidden size, vocabulary) divides by ``tp`` (times its fused parts), a tied
    parameter gets one split under all its names, a module that declares fused parts
    (``tp_packed = k``) is split ``packed_colwise``. Raises :class:`TPPlanError` else."""
    if plan == "auto":
        plan = auto_plan(model)
    if not isinstance(plan, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in plan.items()
    ):
        raise TPPlanError(f"tp_plan: expected 'auto' or a dict {{glob: style}}, got {plan!r}")
    modules = dict(model.named_modules())
    styles = match_plan(plan, modules, type(model).__name__)
    _check_heads(model, tp)
    splits: dict[str, Split] = {}
    for name, style in styles.items():
        splits.update(_module_splits(name, modules[name], style, tp))
    _check_ties(model, splits)
    return Resolved(styles, splits)


def _module_splits(name: str, m: nn.Module, style: str, tp: int) -> Iterator[tuple[str, Split]]:
    want = nn.Embedding if style in _EMBEDDING else nn.Linear
    if type(m) is not want:
        raise TPPlanError(
            f"tp_plan: {name!r} is a {type(m).__name__}; style {style!r} splits an "
            f"nn.{want.__name__}"
        )
    packed = getattr(m, "tp_packed", 1)
    if style == "colwise" and packed > 1:
        raise TPPlanError(
            f"tp_plan: {name!r} fuses {packed} projections (tp_packed={packed}); a plain "
            "'colwise' split would give rank 0 the first parts whole; use 'packed_colwise'"
        )
    if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.sparse or m.scale_grad_by_freq):
        raise TPPlanError(
            f"tp_plan: {name!r}: a split embedding cannot renorm, be sparse or scale its "
            "gradient by frequency (each rank sees only its own ids)"
        )
    for leaf, p in m.named_parameters(recurse=False):
        split = split_of(style, leaf, packed if packed > 1 else 2)
        if split is None:
            continue
        size = p.shape[split.dim]
        if size % (split.parts * tp):
            what = "vocabulary" if style in _EMBEDDING else f"dimension {split.dim}"
            raise TPPlanError(
                f"tp_plan: {name}.{leaf}: its {what} ({size}"
                + (f" in {split.parts} fused parts" if split.parts > 1 else "")
                + f") does not divide over tp={tp}; pad it (e.g. the vocabulary) to a "
                f"multiple of {split.parts * tp}"
            )
        yield f"{name}.{leaf}", split


def _check_heads(model: nn.Module, tp: int) -> None:
    """Attention heads split with their projections: each count must divide by ``tp``."""
    for mname, m in model.named_modules():
        config = getattr(m, "config", None)
        for holder, keys in (
            (config, ("num_attention_heads", "num_key_value_heads")),
            (m, ("n_head", "n_heads", "num_heads")),
        ):
            for key in keys:
                n = getattr(holder, key, None) if holder is not None else None
                if isinstance(n, int) and n % tp:
                    where = f"{mname or type(model).__name__}" + (
                        ".config" if holder is config else ""
                    )
                    raise TPPlanError(
                        f"tp_plan: {where}.{key} = {n} heads do not divide over tp={tp}; "
                        "each rank must hold whole heads"
                    )


def _check_ties(model: nn.Module, splits: dict[str, Split]) -> None:
    """Every name of a tied parameter gets the same split (or none); the map then holds
    all its names."""
    names: dict[int, list[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for leaf, p in m.named_parameters(recurse=False):
            full = f"{mname}.{leaf}" if mname else leaf
            if full not in names.setdefault(id(p), []):
                names[id(p)].append(full)
    for group in names.values():
        got = {n: splits.get(n) for n in group}
        kinds = set(got.values())
        if len(kinds) > 1:
            shown = ", ".join(f"{n}: {s.to_json() if s else 'replicated'}" for n, s in got.items())
            raise TPPlanError(
                f"tp_plan: tied parameter {group[0]} gets different splits under its names "
                f"({shown}); give its modules styles that split it alike"
            )
        split = kinds.pop()
        if split is not None:
            for n in group:
                splits[n] = split


def local_layout(whole: FlatLayout, splits: Mapping[str, Split | None], tp: int) -> FlatLayout:
    """The layout each of ``tp`` ranks lays out its pieces in: ``whole`` with every slot that
    ``splits`` names (by its first name) at its local shape. A pure function of the whole
    layout, the splits and the degree: a checkpoint computes any degree's from its own.

    Example::

        local_layout(fm.tp.whole, fm.tp.split_map(), 2) == fm.layout
    """
    shapes = {}
    for i, slot in enumerate(whole.slots):
        split = splits.get(slot.name)
        if split is not None:
            shapes[i] = split.local_shape(slot.shape, tp)
    return whole.with_shapes(shapes)
