"""make_optimizer's param groups as pure arithmetic on a layout (no process group)."""

from __future__ import annotations

import torch
from torch import nn

from torchshard import FlatParamModule
from torchshard._parallel.optim import param_groups


def _fm() -> FlatParamModule:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)
    return FlatParamModule(model)


def test_the_first_matching_rule_picks_the_group_and_the_rest_go_to_group_0():
    fm = _fm()
    slots = fm.layout.slots
    trainable = [i for i, s in enumerate(slots) if s.requires_grad]
    segments = [(i, slots[i].offset, slots[i].end, torch.zeros(slots[i].numel)) for i in trainable]
    rules = [
        (lambda n: n.endswith("bias"), {"weight_decay": 0.0}),
        (lambda n: n.startswith("2."), {"lr": 1.0}),  # 2.bias matched the first rule already
    ]
    groups, names = param_groups(fm.layout, trainable, segments, rules, torch.device("cpu"))
    assert names == [["0.weight"], ["0.bias", "1.bias", "2.bias"], ["2.weight"]]
    assert [len(g["params"]) for g in groups] == [1, 3, 1]
    assert groups[1]["weight_decay"] == 0.0 and groups[2]["lr"] == 1.0 and len(groups[0]) == 1


def test_a_rank_without_segments_steps_an_empty_tensor_but_knows_every_name():
    fm = _fm()
    trainable = [i for i, s in enumerate(fm.layout.slots) if s.requires_grad]
    groups, names = param_groups(fm.layout, trainable, [], [], torch.device("cpu"))
    assert names == [["0.weight", "0.bias", "1.bias", "2.weight", "2.bias"]]
    (empty,) = groups[0]["params"]
    assert isinstance(empty, nn.Parameter) and empty.numel() == 0
    torch.optim.SGD(groups, lr=0.1).step()  # torch accepts it
