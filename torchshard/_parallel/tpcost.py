"""What tensor parallelism changes in the planners, from the layout alone (no model, no
process group): the local layout each tp rank lays out, and the activations its split
layers hand to collectives.

A plan (module-name globs to styles, as ``FlatParamModule(tp_plan=...)`` takes) is resolved
by name against the layout's slot names, each name ``module.leaf``: the first glob that
names a slot's module gives it :func:`split_of` of its style, as :func:`resolve_plan` does
for a model. Local shapes do not depend on fused parts, so ``packed_colwise`` costs what
``colwise`` costs; what needs the modules (their types, heads, ``tp_packed``) is checked
when the module is split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .._errors import TPPlanError
from .._flat.layout import FlatLayout
from .._flat.tp_plan import Split, local_layout, match_plan, split_of
from .footprint import PlanError

__all__ = ["TPTraffic", "tp_dims", "tp_layout", "tp_traffic"]


def _degree(tp: object) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlanError(f"tp: expected a positive integer (init_mesh(tp=T)), got {tp!r}")
    return tp


def _styles(layout: FlatLayout, tp_plan: object) -> dict[str, str]:
    """Each split module's style, by every module name the layout's slots are reached by."""
    if tp_plan == "auto":
        raise PlanError(
            "tp_plan: 'auto' needs the model; pass the plan it resolves to (a dict "
            "{glob: style}), or the split module's fm.layout with tp=1"
        )
    if not isinstance(tp_plan, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items()
    ):
        raise PlanError(f"tp_plan: expected a dict {{glob: style}}, got {tp_plan!r}")
    modules = dict.fromkeys(n.rpartition(".")[0] for s in layout for n in s.names)
    try:
        return match_plan(tp_plan, modules, "the layout")
    except TPPlanError as e:
        raise PlanError(str(e)) from None


def tp_dims(layout: FlatLayout, tp: int, tp_plan: Mapping[str, str]) -> dict[str, int]:
    """The dimension each split slot is split along, by its first name: the plan resolved
    by name against ``layout`` (the whole model's), checked to fit ``tp`` ranks (a layout
    does not say how many projections a module fuses: the local shape does not depend on
    it). Raises :class:`PlanError` for a glob naming no module, an unknown style, a split
    dimension ``tp`` does not divide, or a tied parameter whose names get different splits.

    Example::

        tp_dims(layout, 2, {"blocks.*.mlp.0": "colwise"})["blocks.0.mlp.0.weight"]   # 0
    """
    tp = _degree(tp)
    styles = _styles(layout, tp_plan)
    out: dict[str, int] = {}
    for s in layout:
        got = {}
        for name in s.names:
            module, _, leaf = name.rpartition(".")
            split = None if module not in styles else split_of(styles[module], leaf)
            got[name] = None if split is None else split.dim
        kinds = set(got.values())
        if len(kinds) > 1:
            shown = ", ".join(f"{n}: {'replicated' if k is None else f'dim {k}'}"
                              for n, k in got.items())  # fmt: skip
            raise PlanError(f"tp_plan: tied parameter {s.name} gets different splits ({shown})")
        dim = kinds.pop()
        if dim is None:
            continue
        size = s.shape[dim] if dim < len(s.shape) else 0
        if size % tp:
            raise PlanError(
                f"tp_plan: {s.name}: its dimension {dim} ({size}) does not divide over tp={tp}"
            )
        out[s.name] = dim
    return out


def tp_layout(
    layout: FlatLayout, tp: int = 1, tp_plan: Mapping[str, str] | None = None
) -> FlatLayout:
    """The layout each of ``tp`` ranks lays out for the whole model's ``layout`` split by
    ``tp_plan``: what ``FlatParamModule(model, tp_plan=tp_plan, mesh=mesh).layout`` is at
    ``mesh.tp_size == tp``. ``tp=1`` without a plan: ``layout`` itself.

    Example::

        tp_layout(whole, 2, TP_PLAN) == fm.layout   # fm split over init_mesh(tp=2)
    """
    tp = _degree(tp)
    if tp_plan is None:
        if tp > 1:
            raise PlanError(
                f"tp_plan: tp={tp} needs the plan that splits the layout ({{glob: style}}); or "
                "pass the split module's fm.layout with tp=1"
            )
        return layout
    dims = tp_dims(layout, tp, tp_plan)
    return local_layout(layout, {n: Split(d) for n, d in dims.items()}, tp)


@dataclass(frozen=True)
class TPTraffic:
    """Activation bytes one tp rank hands to the split layers' collectives per token of its
    micro-batch, each buffer at its full size: ``forward`` (a rowwise output and a split
    embedding's lookups all-reduced, a gathered head's logits all-gathered) and
    ``backward`` (a column-split layer's input gradient all-reduced).

    Example::

        t = tp_traffic(whole, 2, TP_PLAN)
        t.forward * batch * seq   # bytes all-reduced and all-gathered in one forward
    """

    forward: int = 0
    backward: int = 0
    forward_calls: int = 0
    backward_calls: int = 0

    def step_bytes(self, tokens: int) -> int:
        """Bytes over ``tokens`` tokens (a rank's micro-batches in one step), both ways."""
        return (self.forward + self.backward) * tokens


def tp_traffic(layout: FlatLayout, tp: int, tp_plan: Mapping[str, str] | None) -> TPTraffic:
    """The tensor-parallel activation traffic of ``layout`` (the whole model's) split by
    ``tp_plan`` over ``tp`` ranks, per token, in each split weight's dtype (the dtype its
    layer computes in), each split module called once a forward (a module called twice
    costs twice). Megatron's mappings, as :mod:`torchshard._flat.tp_layers` runs them:

    - ``colwise``, ``packed_colwise``: none forward; backward, an all-reduce of the input
      gradient (``in_features``). Each column-split module reduces its own: separate
      ``q``, ``k``, ``v`` projections cost three, a fused one one.
    - ``colwise_gather_output``: that, and forward an all-gather of the output
      (``out_features``, the whole logits).
    - ``rowwise``: forward, an all-reduce of the output (``out_features``); none backward.
    - ``embedding_rowwise``: forward, an all-reduce of the lookups (``embedding_dim``).

    Nothing without tensor parallelism (``tp=1``).

    Example::

        tp_traffic(whole, 2, TP_PLAN).backward   # 2 * C * itemsize per block for a GPT
    """
    tp = _degree(tp)
    if tp == 1 or tp_plan is None:
        tp_layout(layout, tp, tp_plan)  # the same errors
        return TPTraffic()
    tp_dims(layout, tp, tp_plan)  # checked as the memory plan checks it
    styles = _styles(layout, tp_plan)
    weights = {n: s for s in layout for n in s.names if n.endswith(".weight")}
    fwd = bwd = nf = nb = 0
    for module, style in styles.items():
        w = weights.get(f"{module}.weight")
        if w is None or len(w.shape) != 2:
            continue
        b = w.torch_dtype.itemsize
        out_features, in_features = w.shape
        if style == "embedding_rowwise":
            fwd, nf = fwd + in_features * b, nf + 1
            continue
        if style == "rowwise":
            fwd, nf = fwd + out_features * b, nf + 1
            continue
        bwd, nb = bwd + in_features * b, nb + 1
        if style == "colwise_gather_output":
            fwd, nf = fwd + out_features * b, nf + 1
    return TPTraffic(fwd, bwd, nf, nb)
