"""What each value read from ``metadata.json`` must be: typed checks that name the key path
(:class:`Invalid`), and the rules of torch's optimizers for their hyperparameters and state."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._flat.layout import BYTES

__all__ = [
    "ADVICE",
    "MISSING",
    "OPTIMIZER_RULES",
    "Invalid",
    "OptimRules",
    "Rule",
    "at",
    "check_group",
    "check_layout",
    "expect_dict",
    "expect_dtype",
    "expect_file_name",
    "expect_flag",
    "expect_int",
    "expect_key",
    "expect_list",
    "expect_str",
]

# -- checking values read from metadata.json ----------------------------------------------
MISSING = object()
ADVICE = "the file is corrupt or was edited; restore it or load an earlier checkpoint"


class Invalid(Exception):
    """A value a reader cannot accept: its key path, what was expected, what was found."""

    def __init__(self, path: str, expected: str, got: Any = MISSING) -> None:
        super().__init__(path)
        self.path, self.expected, self.got = path, expected, got

    def message(self, file: Path) -> str:
        return f"{file}: {self.path}: expected {self.expected}, got {_show(self.got)}; {ADVICE}"


def _show(v: Any) -> str:
    if v is MISSING:
        return "nothing (the key is missing)"
    try:
        text = json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 200 else f"{text[:197]}..."


def at(path: str, key: str | int) -> str:
    """``path`` extended by a key: ``a.b``, ``a[0]``, ``a["model-00001.safetensors"]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}[{json.dumps(key)}]"
    return f"{path}.{key}" if path else key


def expect_key(d: dict[str, Any], key: str, path: str) -> Any:
    if key not in d:
        raise Invalid(at(path, key), "a value")
    return d[key]


def expect_dict(v: Any, path: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise Invalid(path, "a JSON object", v)
    return v


def expect_list(v: Any, path: str, n: int | None = None) -> list[Any]:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise Invalid(path, "a list" if n is None else f"a list of {n}", v)
    return v


def expect_int(v: Any, path: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise Invalid(path, f"an integer >= {lo}", v)
    return v


def expect_str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise Invalid(path, "a non-empty string", v)
    return v


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _real(v: Any) -> bool:
    """A JSON number that a float32 kernel can take as a scalar (torch raises on overflow)."""
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and abs(v) <= _FLOAT32_MAX
    )


def expect_file_name(v: Any, path: str, what: str = "a plain file name") -> str:
    if not isinstance(v, str) or not v or Path(v).name != v or v in (".", ".."):
        raise Invalid(path, f"{what} (no path that could point outside the checkpoint)", v)
    return v


def expect_dtype(v: Any, path: str) -> torch.dtype:
    dtype = getattr(torch, v, None) if isinstance(v, str) else None
    if not isinstance(dtype, torch.dtype):
        raise Invalid(path, "a torch dtype name such as 'float32'", v)
    return dtype


def check_layout(v: Any) -> dict[str, Any]:
    """The layout's JSON, strictly typed, before :class:`FlatLayout` checks how it adds up.
    A layout of several dtypes (a buffer of bytes) gives each slot its dtype, 7th."""
    d = expect_dict(v, "layout")
    expect_int(expect_key(d, "format", "layout"), "layout.format", 1)
    dtypes = [expect_dtype(expect_key(d, "dtype", "layout"), "layout.dtype")]
    mixed = d["dtype"] == BYTES
    align = expect_int(expect_key(d, "align_bytes", "layout"), "layout.align_bytes", 1)
    expect_int(expect_key(d, "numel", "layout"), "layout.numel")
    for i, slot in enumerate(expect_list(expect_key(d, "slots", "layout"), "layout.slots")):
        where = f"layout.slots[{i}]"
        name, shape, offset, numel, requires_grad, aliases, *own = expect_list(
            slot, where, 6 + mixed
        )
        expect_str(name, f"{where}[0]")
        for j, dim in enumerate(expect_list(shape, f"{where}[1]")):
            expect_int(dim, f"{where}[1][{j}]")
        expect_int(offset, f"{where}[2]")
        expect_int(numel, f"{where}[3]")
        expect_flag(requires_grad, f"{where}[4]")
        for j, alias in enumerate(expect_list(aliases, f"{where}[5]")):
            expect_str(alias, f"{where}[5][{j}]")
        if own:
            dtypes.append(expect_dtype(own[0], f"{where}[6]"))
            if not (dtypes[-1].is_floating_point or dtypes[-1].is_complex):
                raise Invalid(f"{where}[6]", "a floating point dtype", own[0])
    for dtype in dtypes:
        if align % dtype.itemsize:
            raise Invalid("layout.align_bytes", f"a multiple of {dtype.itemsize} ({dtype})", align)
    return d


# -- what torch's optimizers accept, class by class ---------------------------------------
Rule = Callable[[Any, str], None]


@dataclass(frozen=True)
class _Number:
    """A finite number in a range (``floats``: a JSON float, as torch's Adam demands of betas)."""

    lo: float | None = 0.0
    hi: float | None = None
    hi_open: bool = False
    floats: bool = False

    def __call__(self, v: Any, path: str) -> None:
        ok = _real(v) and (isinstance(v, float) or not self.floats)
        ok = ok and (self.lo is None or v >= self.lo)
        if ok and (self.hi is None or v < self.hi or (v == self.hi and not self.hi_open)):
            return
        kind = "a float" if self.floats else "a number"
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if self.lo is None or (number and not _real(v)):  # finite, beyond float32
            raise Invalid(path, f"{kind} within float32's range (|x| <= {_FLOAT32_MAX:.4g})", v)
        span = (
            f">= {self.lo:g}"
            if self.hi is None
            else f"in [{self.lo:g}, {self.hi:g}" + (")" if self.hi_open else "]")
        )
        raise Invalid(path, f"{kind} {span}", v)


@dataclass(frozen=True)
class _Pair:
    item: _Number

    def __call__(self, v: Any, path: str) -> None:
        for i, x in enumerate(expect_list(v, path, 2)):
            self.item(x, at(path, i))


def expect_choice(v: Any, path: str, choices: tuple[str, ...]) -> str:
    """``v`` if it is one of ``choices``, else :class:`Invalid`."""
    if v not in choices:
        raise Invalid(path, " or ".join(map(repr, choices)), v)
    return v


def expect_flag(v: Any, path: str) -> None:
    if not isinstance(v, bool):
        raise Invalid(path, "true or false", v)


def _flag_or_null(v: Any, path: str) -> None:
    if v is not None and not isinstance(v, bool):
        raise Invalid(path, "true, false or null", v)


@dataclass(frozen=True)
class _Scalar:
    """Per-parameter scalar state (Adam's ``step``): a tensor of a float dtype, each value a
    finite number in ``[lo, hi]`` (``whole``: integral) that the dtype holds exactly."""

    lo: float = 0.0
    hi: float | None = None
    whole: bool = False

    def __call__(self, spec: dict[str, Any], path: str) -> None:
        name = expect_key(spec, "dtype", path)
        if name not in ("float32", "float64"):
            raise Invalid(at(path, "dtype"), '"float32" or "float64"', name)
        what = "a whole number" if self.whole else "a number"
        what += f" >= {self.lo:g}" if self.hi is None else f" in [{self.lo:g}, {self.hi:g}]"
        for i, v in enumerate(spec["values"]):
            if v is None:
                continue
            ok = _real(v) and v >= self.lo and (self.hi is None or v <= self.hi)
            if not ok or (self.whole and v != int(v)):
                raise Invalid(at(at(path, "values"), i), f"null or {what}", v)
            held = struct.unpack("<f", struct.pack("<f", v))[0] if name == "float32" else float(v)
            if held != v:
                raise Invalid(at(at(path, "values"), i), f"a value that {name} holds", v)


@dataclass(frozen=True)
class OptimRules:
    """What one torch optimizer accepts: its hyperparameters' types and ranges (as its
    constructor checks them), and the state it keeps per parameter."""

    hyper: dict[str, Rule]
    required: tuple[str, ...]  # the keys torch's load_state_dict does not fill in when missing
    flat: Callable[[dict[str, Any]], set[str]]  # state shaped like the parameter, per group
    scalars: dict[str, _Scalar]  # per-parameter scalar state


_GE0 = _Number()
_COMMON: dict[str, Rule] = {
    "lr": _GE0,
    "weight_decay": _GE0,
    "maximize": expect_flag,
    "foreach": _flag_or_null,
    "differentiable": expect_flag,
}
_ADAM_LIKE: dict[str, Rule] = {
    **_COMMON,
    "eps": _GE0,
    "betas": _Pair(_Number(0.0, 1.0, hi_open=True)),
    "capturable": expect_flag,
    "decoupled_weight_decay": expect_flag,
}
# Torch creates this state in the step that first updates the parameter, and counts that
# step: a saved count is >= 1 (Adagrad alone creates its state, at step 0, in its constructor).
_STEP = {"step": _Scalar(lo=1.0, whole=True)}
_ADAM = OptimRules(
    {
        **_ADAM_LIKE,
        "betas": _Pair(_Number(0.0, 1.0, hi_open=True, floats=True)),
        "amsgrad": expect_flag,
        "fused": _flag_or_null,
    },
    ("lr", "betas", "eps", "weight_decay"),
    lambda g: {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if g.get("amsgrad") else set()),
    _STEP,
)
OPTIMIZER_RULES: dict[str, OptimRules] = {
    "torch.optim.sgd.SGD": OptimRules(
        {
            **_COMMON,
            "momentum": _GE0,
            "dampening": _Number(lo=None),
            "nesterov": expect_flag,
            "fused": _flag_or_null,
        },
        ("lr", "momentum", "dampening", "weight_decay"),
        lambda g: {"momentum_buffer"} if g["momentum"] != 0 else set(),
        {},
    ),
    "torch.optim.adam.Adam": _ADAM,
    "torch.optim.adamw.AdamW": _ADAM,
    "torch.optim.adamax.Adamax": OptimRules(
        _ADAM_LIKE,
        ("lr", "betas", "eps", "weight_decay"),
        lambda g: {"exp_avg", "exp_inf"},
        _STEP,
    ),
    "torch.optim.nadam.NAdam": OptimRules(
        {**_ADAM_LIKE, "momentum_decay": _GE0},
        ("lr", "betas", "eps", "weight_decay", "momentum_decay"),
        lambda g: {"exp_avg", "exp_avg_sq"},
        {**_STEP, "mu_product": _Scalar(0.0, 1.0)},
    ),
    "torch.optim.radam.RAdam": OptimRules(
        _ADAM_LIKE,
        ("lr", "betas", "eps", "weight_decay"),
        lambda g: {"exp_avg", "exp_avg_sq"},
        _STEP,
    ),
    "torch.optim.rmsprop.RMSprop": OptimRules(
        {
            **_COMMON,
            "eps": _GE0,
            "alpha": _GE0,
            "momentum": _GE0,
            "centered": expect_flag,
            "capturable": expect_flag,
        },
        ("lr", "alpha", "eps", "weight_decay"),
        lambda g: (
            {"square_avg"}
            | ({"momentum_buffer"} if g.get("momentum", 0) > 0 else set())
            | ({"grad_avg"} if g.get("centered") else set())
        ),
        _STEP,
    ),
    "torch.optim.adagrad.Adagrad": OptimRules(
        {
            **_COMMON,
            "eps": _GE0,
            "lr_decay": _GE0,
            "initial_accumulator_value": _GE0,
            "fused": _flag_or_null,
        },
        ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"),
        lambda g: {"sum"},
        {"step": _Scalar(whole=True)},
    ),
    "torch.optim.adadelta.Adadelta": OptimRules(
        {**_COMMON, "eps": _GE0, "rho": _Number(0.0, 1.0), "capturable": expect_flag},
        ("lr", "rho", "eps", "weight_decay"),
        lambda g: {"square_avg", "acc_delta"},
        _STEP,
    ),
}
"""The optimizers whose checkpointed values are checked against torch's own rules. Any
other optimizer's values are checked against the live optimizer's types at load."""


def check_group(g: dict[str, Any], path: str, rules: OptimRules | None) -> None:
    """One param group's hyperparameters, by the rules of its optimizer class."""
    if rules is None:
        return
    for key in rules.required:
        expect_key(g, key, path)
    for key, value in g.items():
        if key in rules.hyper:
            rules.hyper[key](value, at(path, key))
    if "nesterov" in rules.hyper and g.get("nesterov") and (g["momentum"] <= 0 or g["dampening"]):
        raise Invalid(
            at(path, "nesterov"), "false unless momentum > 0 and dampening == 0", g["nesterov"]
        )
    if g.get("fused") and (g.get("differentiable") or g.get("foreach")):
        raise Invalid(at(path, "fused"), "false or null with differentiable or foreach", True)
