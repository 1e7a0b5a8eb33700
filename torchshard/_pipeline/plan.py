"""Pipeline stages, planned: which modules each stage keeps, which slots of the whole
model's layout it owns (one contiguous run, in stage order) and which it holds as a replica
(a tied weight reached from another stage). Pure: no tensor data, no process group."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .._errors import PipelineError
from .._flat.layout import FlatLayout

__all__ = [
    "StagePlan",
    "Tie",
    "layer_list",
    "parameterless_units",
    "plan_stages",
    "stage_units",
]


@dataclass(frozen=True)
class Tie:
    """A slot of the whole layout held by two stages: ``owner`` keeps it under ``name``
    (and counts it), ``holder`` keeps a replica under ``alias``."""

    slot: int
    name: str
    owner: int
    holder: int
    alias: str


@dataclass(frozen=True)
class StagePlan:
    """What each pipeline stage keeps, as the whole model's names and layout slots.

    Example::

        plan = torchshard.plan_stages(model, 2, pp=2)
        plan.modules[1]          # ('blocks.1', 'ln_f', 'lm_head')
        plan.owned[1]            # (lo, hi): slots of FlatLayout.from_module(model)
    """

    modules: tuple[tuple[str, ...], ...]
    """Per stage, the module (or root parameter) names it keeps, in model order."""
    owned: tuple[tuple[int, int], ...]
    """Per stage, its slots ``[lo, hi)`` of the whole layout; they tile the layout in order."""
    replicas: tuple[tuple[str, ...], ...]
    """Per stage, the names under which it holds a slot another stage owns."""
    ties: tuple[Tie, ...]
    pp: int

    @property
    def num_stages(self) -> int:
        return len(self.modules)

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that runs ``stage`` (loop style: ``stage % pp``)."""
        return stage % self.pp

    def stages_of_rank(self, pp_rank: int) -> tuple[int, ...]:
        """The stages a pipeline rank runs, in order: ``pp_rank, pp_rank + pp, ...``."""
        return tuple(range(pp_rank, self.num_stages, self.pp))


def layer_list(model: nn.Module) -> str | None:
    """The name of ``model``'s layer list, wherever it lies: the non-empty ``ModuleList``
    holding the most parameters (GPT's ``blocks``, a Llama's ``model.layers``), as the fully
    sharded mode finds its units; ``None`` without one."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))[0]


def _lists(model: nn.Module) -> set[str]:
    """The lists a split cuts inside: every top-level ``ModuleList`` and the layer list."""
    out = {n for n, c in model.named_children() if isinstance(c, nn.ModuleList)}
    deep = layer_list(model)
    return out | {deep} if deep else out


def stage_units(model: nn.Module) -> list[str]:
    """The names a split may cut between, in model order: each child of a top-level
    ``ModuleList`` and of the layer list (:func:`layer_list`, e.g. ``model.layers.3``),
    every other child of the modules on the way to a list, and their own parameters."""
    lists = _lists(model)
    units: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        units.extend(prefix + n for n, _ in module.named_parameters(recurse=False))
        for name, child in module.named_children():
            fqn = prefix + name
            if fqn in lists:
                units.extend(f"{fqn}.{i}" for i, _ in child.named_children())
            elif any(_under(x, fqn) for x in lists):
                walk(child, fqn + ".")
            else:
                units.append(fqn)

    walk(model, "")
    return units


def parameterless_units(model: nn.Module) -> list[str]:
    """The :func:`stage_units` that hold no parameter (a rotary embedding's module: buffers
    only), which a stage forward for transformers models keeps on every stage."""
    known = dict(model.named_modules())
    return [
        u for u in stage_units(model) if u in known and next(known[u].parameters(), None) is None
    ]


def plan_stages(
    model: nn.Module, stages: int | Sequence[Sequence[str]], *, pp: int | None = None
) -> StagePlan:
    """Plan a split of ``model`` (the whole model, on meta) into pipeline stages.

    ``stages``: a count (contiguous units balanced by parameter count, see
    :func:`stage_units`) or, per stage, the names of the modules (or root parameters) it
    keeps. Every module with parameters must be in exactly one stage, and the stages must
    follow ``named_parameters()`` order. ``pp``: the pipeline degree (default: one stage
    per rank); the stage count must be a multiple of it, stage ``k`` running on pipeline
    rank ``k % pp`` (the loop placement of interleaved schedules). Raises
    :class:`PipelineError`.

    Example::

        plan = torchshard.plan_stages(model, [["wte", "wpe", "blocks.0"],
                                              ["blocks.1", "ln_f", "lm_head"]], pp=2)
    """
    layout = FlatLayout.from_module(model)
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple)):
        raise PipelineError(f"stages: expected a count or lists of module names, got {stages!r}")
    n = stages if isinstance(stages, int) else len(stages)
    pp = n if pp is None else pp
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise PipelineError(f"pp: expected a positive int, got {pp!r}")
    if n < 1 or n % pp:
        raise PipelineError(
            f"stages: expected a multiple of pp={pp} stages (each pipeline rank runs the "
            f"same number), got {n}"
        )
    lists = _auto(model, layout, n) if isinstance(stages, int) else _named(model, stages)
    plan = _plan(layout, lists, pp)
    listed = [name for names in lists for name in names]
    for u in stage_units(model):  # one without parameters would be pruned everywhere
        if not any(_under(u, x) or _under(x, u) for x in listed):
            raise PipelineError(
                f"stages: {u} is in no stage; a module without parameters still runs on one "
                "stage: list it with its neighbours"
            )
    return plan


def _named(model: nn.Module, stages: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    known = dict(model.named_modules(remove_duplicate=False))
    params = set(stage_units(model)) - set(known)  # the parameters a split may name
    out = []
    for k, names in enumerate(stages):
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise PipelineError(f"stages[{k}]: expected a list of module names, got {names!r}")
        for name in names:
            if not isinstance(name, str) or not name or (name not in known and name not in params):
                near = difflib.get_close_matches(str(name), [*known, *params], n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise PipelineError(
                    f"stages[{k}]: no module or parameter {name!r} in {type(model).__name__}{hint}"
                )
        out.append(tuple(names))
    return out


def _auto(model: nn.Module, layout: FlatLayout, n: int) -> list[tuple[str, ...]]:
    """Contiguous groups of units, cut where the running parameter count crosses k/n of the
    total. The units before a model's layer list go together (an embedding and a position
    embedding that the forward adds), and so do those after it (a final norm and a head)."""
    groups = _groups(model)
    sizes = []
    for g in groups:
        slots = {i for u in g for i in _slot_names_under(layout, u)}
        sizes.append(sum(layout.slots[i].numel for i in slots))
    if sum(1 for s in sizes if s) < n:
        raise PipelineError(
            f"stages: {n} stages need at least {n} groups of modules with parameters (the "
            f"layers, the modules before them, those after), {type(model).__name__} has "
            f"{sum(1 for s in sizes if s)}"
        )
    total, run, k, have = sum(sizes), 0, 0, False
    cuts: list[list[str]] = [[] for _ in range(n)]
    for i, (g, size) in enumerate(zip(groups, sizes)):
        left = sum(1 for s in sizes[i:] if s)  # groups with parameters from here on
        if size and have and k < n - 1 and (run >= total * (k + 1) / n or left <= n - 1 - k):
            k, have = k + 1, False
        cuts[k].extend(g)
        run, have = run + size, have or size > 0
    return [tuple(c) for c in cuts]


def _groups(model: nn.Module) -> list[list[str]]:
    """:func:`stage_units`, the units before the first list's children joined into one
    group and those after the last joined into another (each unit alone without a list)."""
    units, lists = stage_units(model), _lists(model)
    inner = [i for i, u in enumerate(units) if any(_under(u, x) for x in lists)]
    if not inner:
        return [[u] for u in units]
    lo, hi = inner[0], inner[-1] + 1
    head, tail = units[:lo], units[hi:]
    return [head] * bool(head) + [[u] for u in units[lo:hi]] + [tail] * bool(tail)


def _slot_names_under(layout: FlatLayout, name: str) -> list[int]:
    """Slots whose canonical name is ``name`` or lies under it."""
    return [i for i, s in enumerate(layout.slots) if _under(s.name, name)]


def _under(param: str, module: str) -> bool:
    return param == module or param.startswith(module + ".")


def _plan(layout: FlatLayout, lists: list[tuple[str, ...]], pp: int) -> StagePlan:
    where: dict[str, int] = {}
    for k, names in enumerate(lists):
        for name in names:
            if name in where:
                raise PipelineError(f"stages: {name} is in stages {where[name]} and {k}")
            where[name] = k
    owner: list[int] = []
    for s in layout.slots:
        ks = sorted({k for name, k in where.items() if _under(s.name, name)})
        if not ks:
            raise PipelineError(
                f"stages: {s.name} is in no stage; every module with parameters must be in "
                "exactly one stage"
            )
        if len(ks) > 1:
            raise PipelineError(f"stages: {s.name} is in stages {ks[0]} and {ks[1]}")
        owner.append(ks[0])
    owned = []
    for k in range(len(lists)):
        mine = [i for i, o in enumerate(owner) if o == k]
        if not mine:
            raise PipelineError(
                f"stages: stage {k} holds no parameters (modules: {list(lists[k])}); merge it "
                "into a neighbour or use fewer stages"
            )
        owned.append((mine[0], mine[-1] + 1))
    for k, (lo, hi) in enumerate(owned):
        if any(owner[i] != k for i in range(lo, hi)) or (k and owned[k - 1][1] != lo):
            stray = next(i for i in range(owned[k - 1][1] if k else 0, hi) if owner[i] != k)
            raise PipelineError(
                f"stages: stage {k} owns {layout.slots[lo].name}..{layout.slots[hi - 1].name} "
                f"but {layout.slots[stray].name} (stage {owner[stray]}) lies between or before "
                "them: a stage's parameters must be one contiguous run of named_parameters() "
                "order, and stages must follow it; list modules in model order"
            )
    replicas: list[list[str]] = [[] for _ in lists]
    ties = []
    for i, s in enumerate(layout.slots):
        for alias in s.aliases:
            ks = {k for name, k in where.items() if _under(alias, name)}
            for k in sorted(ks - {owner[i]}):
                replicas[k].append(alias)
                ties.append(Tie(i, s.name, owner[i], k, alias))
    return StagePlan(
        modules=tuple(lists),
        owned=tuple(owned),
        replicas=tuple(tuple(r) for r in replicas),
        ties=tuple(ties),
        pp=pp,
    )
