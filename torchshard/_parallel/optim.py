"""Param groups by name for ``make_optimizer``: pure, from a layout and the mode's segments."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._flat.layout import FlatLayout
from .seam import Segment

__all__ = ["GroupRule", "param_groups"]

GroupRule = tuple[Callable[[str], bool], dict[str, Any]]
"""``(predicate on a parameter name, that group's overrides)``."""


def param_groups(
    layout: FlatLayout,
    trainable: Sequence[int],
    segments: Sequence[Segment],
    rules: Sequence[GroupRule],
    device: torch.device,
) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """The optimizer's param groups, and the names of the parameters in each.

    The first rule whose predicate matches one of a slot's names picks its group (rule
    ``k`` is group ``k + 1``); the rest go to group 0, with no overrides. Every rank gets
    the same names, whatever part of a parameter its segments hold. A rank whose segments
    are all empty (its slice holds only padding) steps an empty tensor: torch refuses an
    optimizer without parameters.

    Example::

        groups, names = param_groups(fm.layout, trainable, segments,
                                     [(lambda n: n.endswith("bias"), {"weight_decay": 0.0})],
                                     torch.device("cpu"))
        opt = torch.optim.AdamW(groups, lr=3e-4)
    """

    def group_of(i: int) -> int:
        names = layout.slots[i].names
        for g, (pred, _) in enumerate(rules):
            if any(pred(n) for n in names):
                return g + 1
        return 0

    members: list[list[torch.Tensor]] = [[] for _ in range(len(rules) + 1)]
    group_names: list[list[str]] = [[] for _ in range(len(rules) + 1)]
    for i in trainable:
        group_names[group_of(i)].append(layout.slots[i].name)
    for i, _, _, tensor in segments:
        members[group_of(i)].append(tensor)
    if not any(members):
        members[0].append(torch.nn.Parameter(torch.empty(0, device=device)))
    groups: list[dict[str, Any]] = [{"params": members[0]}]
    groups += [{"params": m, **over} for m, (_, over) in zip(members[1:], rules)]
    return groups, group_names
