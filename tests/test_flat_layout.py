"""FlatLayout: pure metadata, no processes, no storage."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch
from gpt import GPT, GPTConfig
from torch import nn

from torchshard import FlatLayout, LayoutError, ParamSlot


def meta_gpt(**overrides) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**{**GPTConfig.preset("tiny").__dict__, **overrides}))


def test_slots_follow_named_parameters_order_and_are_aligned():
    model = meta_gpt()
    layout = FlatLayout.from_module(model)
    assert [s.name for s in layout] == [n for n, _ in model.named_parameters()]
    for s, (_, p) in zip(layout, model.named_parameters()):
        assert s.shape == tuple(p.shape) and s.numel == p.numel()
        assert s.offset * 4 % 16 == 0
    ends = [s.end for s in layout]
    assert all(e <= s.offset for e, s in zip(ends, layout.slots[1:]))
    assert layout.numel % 4 == 0 and layout.numel >= ends[-1]
    assert layout.param_numel == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("dtype", "align_bytes", "align_elems"),
    [(torch.float32, 64, 16), (torch.bfloat16, 16, 8), (torch.float64, 16, 2)],
)
def test_alignment_in_bytes(dtype, align_bytes, align_elems):
    layout = FlatLayout.from_module(meta_gpt(), dtype=dtype, align_bytes=align_bytes)
    assert layout.dtype == str(dtype).removeprefix("torch.")
    assert all(s.offset % align_elems == 0 for s in layout)
    assert layout.numel % align_elems == 0


def test_tied_parameter_has_one_slot_and_an_alias():
    layout = FlatLayout.from_module(meta_gpt())
    slot = layout["wte.weight"]
    assert slot.aliases == ("lm_head.weight",)
    assert layout["lm_head.weight"] is slot
    assert "lm_head.weight" not in [s.name for s in layout]


def test_json_round_trip_and_equality():
    layout = FlatLayout.from_module(meta_gpt())
    text = layout.to_json()
    again = FlatLayout.from_json(text)
    assert again == layout and again.fingerprint() == layout.fingerprint()
    assert json.loads(text)["numel"] == layout.numel
    assert FlatLayout.from_module(meta_gpt(n_layer=3)) != layout


def test_fingerprint_is_pinned():
    # Pins the layout format: a change here invalidates every stored fingerprint.
    with torch.device("meta"):
        layout = FlatLayout.from_module(nn.Linear(4, 3))
    assert layout.to_json() == (
        '{"format":1,"dtype":"float32","align_bytes":16,"numel":16,"slots":[\n'
        '  ["weight",[3,4],0,12,true,[]],\n'
        '  ["bias",[3],12,3,true,[]]\n]}'
    )
    assert layout.fingerprint() == "4160070f1c86b7c30710e924e6b9a41f"


def _base_dict() -> dict:
    d = FlatLayout.from_module(meta_gpt()).to_dict()
    assert d["slots"][0][0] == "wte.weight" and d["slots"][0][5] == ["lm_head.weight"]
    d["numel"] += 8  # room after the last slot, so that its offset can move alone
    return d


def _set_slot(index: int, field: int, value):
    def mutate(d: dict) -> None:
        d["slots"][index][field] = value(d["slots"][index][field])

    return mutate


# One valid mutation per field of the layout's description (to_dict), each alone. A slot's
# dtype is the layout's, its numel the product of its shape and its width 1: no field of
# their own there (a mixed layout's slot dtype: test_mixed_fingerprint_sees_a_slot_dtype).
_MUTATIONS = {
    "dtype": lambda d: d.update(dtype="float64"),  # offsets stay aligned: 16 bytes = 2 elements
    "align_bytes": lambda d: d.update(align_bytes=8),
    "numel": lambda d: d.update(numel=d["numel"] + 4),
    "name": _set_slot(-1, 0, lambda _: "ln_f.renamed"),
    "shape": _set_slot(0, 1, lambda shape: shape[::-1]),  # same numel
    "offset": _set_slot(-1, 2, lambda offset: offset + 4),
    "requires_grad": _set_slot(-1, 4, lambda _: False),
    "aliases": _set_slot(0, 5, lambda _: []),  # untied
}


def test_every_field_has_a_fingerprint_mutation():
    layout_fields = {f.name for f in fields(FlatLayout)} - {"slots"}
    slot_fields = {f.name for f in fields(ParamSlot)} - {"dtype", "numel", "width"}
    assert layout_fields | slot_fields == set(_MUTATIONS)


@pytest.mark.parametrize("field", sorted(_MUTATIONS))
def test_fingerprint_sees_every_field(field):
    base = FlatLayout.from_dict(_base_dict())
    d = _base_dict()
    _MUTATIONS[field](d)
    changed = FlatLayout.from_dict(d)  # a valid layout that differs in this field only
    assert changed.to_dict() == d and changed != base
    assert changed.fingerprint() != base.fingerprint()
    assert changed.first_difference(base) is not None


def test_fingerprint_sees_the_format(monkeypatch):
    import torchshard._flat.layout as layout_module

    layout = FlatLayout.from_dict(_base_dict())
    before = layout.fingerprint()
    monkeypatch.setattr(layout_module, "_LAYOUT_FORMAT", layout_module._LAYOUT_FORMAT + 1)
    assert layout.fingerprint() != before


def test_first_difference_names_the_parameter():
    a = FlatLayout.from_module(meta_gpt())
    b = FlatLayout.from_module(meta_gpt(n_embd=32))
    assert a.first_difference(a) is None
    assert "'wte.weight'" in a.first_difference(b)
    c = FlatLayout.from_module(meta_gpt(n_layer=3))
    assert "blocks.2" in a.first_difference(c)


def test_frozen_flag_is_recorded():
    model = meta_gpt()
    model.wpe.weight.requires_grad_(False)
    layout = FlatLayout.from_module(model)
    assert not layout["wpe.weight"].requires_grad and layout["wte.weight"].requires_grad


def test_mixed_dtypes_keep_their_own_in_a_byte_buffer():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2).half())
    layout = FlatLayout.from_module(model)
    assert layout.mixed and layout.dtype == "uint8" and layout.align == 16
    assert layout.dtypes == (torch.float32, torch.float16)
    # offsets in bytes, 16-aligned; each slot its own dtype, numel in its elements
    got = [(s.dtype, s.offset, s.numel, s.end) for s in layout]
    assert got == [
        ("float32", 0, 6, 24),
        ("float32", 32, 3, 44),
        ("float16", 48, 6, 60),
        ("float16", 64, 2, 68),
    ]
    assert layout.numel == 80 and layout.nbytes == 80
    assert [(r.dtype, r.start, r.end, r.lo, r.hi) for r in layout.regions] == [
        (torch.float32, 0, 48, 0, 2),
        (torch.float16, 48, 80, 2, 4),
    ]
    assert FlatLayout.from_json(layout.to_json()) == layout
    assert layout.to_dict()["format"] == 2
    cast = FlatLayout.from_module(model, dtype=torch.float32)
    assert cast.dtype == "float32" and not cast.mixed and len(cast.regions) == 1


def test_mixed_fingerprint_sees_a_slot_dtype():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).half())
    d = FlatLayout.from_module(model).to_dict()
    base = FlatLayout.from_dict(d)
    d["slots"][0][6] = "bfloat16"
    changed = FlatLayout.from_dict(d)
    assert changed.fingerprint() != base.fingerprint()
    assert "bfloat16" in changed.first_difference(base)
    d["slots"][0] = d["slots"][0][:6]  # a mixed layout's slot without its dtype
    with pytest.raises(LayoutError, match="expected 7 fields"):
        FlatLayout.from_dict(d)


def test_module_without_parameters():
    with pytest.raises(LayoutError, match="ReLU has no parameters"):
        FlatLayout.from_module(nn.ReLU())


@pytest.mark.parametrize("align_bytes", [0, -16, 6])
def test_bad_alignment(align_bytes):
    with pytest.raises(LayoutError, match="align_bytes"):
        FlatLayout.from_module(nn.Linear(2, 2), align_bytes=align_bytes)


def test_integer_dtype_is_refused():
    with pytest.raises(LayoutError, match="floating point"):
        FlatLayout.from_module(nn.Linear(2, 2), dtype=torch.int32)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda d: d.update(format=99),
            "format: expected 1 for a layout of dtype .float32., got 99",
        ),
        (lambda d: d.update(dtype="nonsense"), "dtype"),
        (lambda d: d.pop("slots"), "malformed"),
        (lambda d: d["slots"][1].__setitem__(2, 4), "bad offset"),  # overlaps weight
        (lambda d: d["slots"][1].__setitem__(2, 13), "bad offset"),  # misaligned
        (lambda d: d["slots"][1].__setitem__(0, "weight"), "appears twice"),
        (lambda d: d.update(numel=8), "numel"),
    ],
)
def test_from_json_rejects_bad_descriptions(mutate, match):
    data = FlatLayout.from_module(nn.Linear(4, 3)).to_dict()
    mutate(data)
    with pytest.raises(LayoutError, match=match):
        FlatLayout.from_json(json.dumps(data))


def test_from_json_rejects_non_json():
    with pytest.raises(LayoutError, match="not valid JSON"):
        FlatLayout.from_json("{")
    with pytest.raises(LayoutError, match="JSON object"):
        FlatLayout.from_json("[]")
