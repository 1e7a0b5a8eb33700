"""An optimizer's state seen through the flat layout, as flat ranges and per-slot scalars.

The optimizer updates *segments*: ranges ``[start, end)`` of the flat buffer,
each a whole parameter (an optimizer over ``fm.parameters()``, or the
replicated trainer's) or the part of one in this rank's slice (the sharded
trainer's) or in one of its stripes (the fully sharded trainer's). State shaped
like its segment (``exp_avg``...) is saved as flat ranges in layout order, one
stream per key (per key and parameter dtype, in a layout of several dtypes:
``_streams``); the rest (``step``...) as one JSON value per slot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CheckpointError
from .._flat.layout import FlatLayout, dtype_from_name, dtype_name
from ._streams import MASTER, Stream, canonical, streams_json
from ._target import Target

__all__ = ["MASTER", "OptimizerView", "Segment", "group_problem", "restore_group_values"]


@dataclass(frozen=True)
class Segment:
    slot: int
    start: int
    end: int
    tensor: torch.Tensor  # what the optimizer holds: a parameter or a piece of a slice


@dataclass
class OptimizerView:
    optimizer: torch.optim.Optimizer
    segments: list[Segment]  # in the optimizer's parameter order
    group_names: list[list[str]]  # each param group's parameters, by name
    streams: list[Stream]  # its flat state, in the order found
    masters: frozenset[torch.dtype]  # parameter dtypes whose segments are master weights
    layout: FlatLayout

    @property
    def flat_keys(self) -> set[str]:
        """The state keys saved as flat streams (the master weights' included)."""
        return {s.key for s in self.streams}

    @property
    def has_master(self) -> bool:
        """Whether some segments are master weights in another dtype than their parameter's."""
        return bool(self.masters)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, t: Target) -> OptimizerView:
        fm = t.fm
        layout = fm.layout
        by_id: dict[int, Segment] = {}
        own = t.trainer_segments(optimizer)
        if own is not None:
            for i, a, b, tensor in own[0]:
                by_id[id(tensor)] = Segment(i, a, b, tensor)
        elif not fm.is_bound:
            raise CheckpointError(
                "optimizer: expected trainer.optimizer with shard='full' (the module's own "
                "parameters hold no storage between steps there), got another optimizer; "
                "build it with trainer.make_optimizer()"
            )
        else:
            for slot, p in fm.named_flat_views():
                i = layout.slots.index(slot)
                by_id[id(p)] = Segment(i, slot.offset, slot.end, p)
        segments, names = [], []
        for g, group in enumerate(optimizer.param_groups):
            group_names = []
            for p in group["params"]:
                seg = by_id.get(id(p))
                if seg is None:
                    if p.numel() == 0:  # the sharded trainer's placeholder for an empty slice
                        continue
                    raise CheckpointError(
                        f"optimizer: param group {g} holds a tensor of shape {list(p.shape)} that "
                        "is not a parameter of the wrapped model; build the optimizer over "
                        "fm.parameters() or with trainer.make_optimizer()"
                    )
                segments.append(seg)
                group_names.append(layout.slots[seg.slot].name)
            names.append(group_names)
        if own is not None:
            names = own[1]  # every rank's, not only this slice's
        found: dict[tuple[str, torch.dtype], torch.dtype] = {}  # (key, parameter dtype)
        masters: dict[torch.dtype, torch.dtype] = {}
        for seg in segments:
            param = layout.slots[seg.slot].torch_dtype
            for key, v in optimizer.state.get(seg.tensor, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == seg.tensor.shape:
                    found.setdefault((key, param), v.dtype)
            if seg.tensor.dtype != param:
                masters.setdefault(param, seg.tensor.dtype)
        for param, dtype in masters.items():
            found[(MASTER, param)] = dtype
        streams = canonical([Stream(k, p, d, layout.mixed) for (k, p), d in found.items()], layout)
        return cls(optimizer, segments, names, streams, frozenset(masters), layout)

    def source(self, seg: Segment, stream: Stream) -> torch.Tensor | None:
        """The flat (1-D) state of ``stream`` in ``seg``, or ``None`` where it has none."""
        if stream.key == MASTER:
            master = seg.tensor.dtype != self.layout.slots[seg.slot].torch_dtype
            return seg.tensor.detach().reshape(-1) if master else None
        v = self.optimizer.state.get(seg.tensor, {}).get(stream.key)
        return None if v is None else v.detach().reshape(-1)

    def scalars(self, n_slots: int) -> tuple[dict[str, dict[str, Any]], list[bool]]:
        """Scalar state per slot (``None``: no state) and which slots have state, from this rank.

        Tensor scalars (Adam's ``step``; on the GPU with ``fused`` or ``capturable``) are
        read together, one host read per device and dtype, not one sync per parameter.
        """
        out: dict[str, dict[str, Any]] = {}
        stateful = [False] * n_slots
        pending: dict[tuple[torch.device, torch.dtype], list[tuple[list, int, torch.Tensor]]] = {}
        flat = self.flat_keys
        for seg in self.segments:
            state = self.optimizer.state.get(seg.tensor, {})
            if state:
                stateful[seg.slot] = True
            for key, v in state.items():
                if key in flat:
                    continue
                spec = out.setdefault(key, {"dtype": "python", "values": [None] * n_slots})
                if isinstance(v, torch.Tensor):
                    if v.numel() != 1:
                        raise CheckpointError(
                            f"optimizer state {key!r}: shape {list(v.shape)} is neither its "
                            "parameter's nor a scalar; this optimizer is not supported"
                        )
                    spec["dtype"] = dtype_name(v.dtype)
                    pending.setdefault((v.device, v.dtype), []).append(
                        (spec["values"], seg.slot, v.detach().reshape(()))
                    )
                    continue
                if v is not None and not isinstance(v, (int, float, bool)):
                    raise CheckpointError(
                        f"optimizer state {key!r}: {type(v).__name__} values are not supported"
                    )
                spec["values"][seg.slot] = v
        for items in pending.values():
            read = torch.stack([v for _, _, v in items]).tolist()
            for (values, slot, _), x in zip(items, read):
                values[slot] = x
        return out, stateful

    def groups_json(self) -> list[dict[str, Any]]:
        """Param-group hyperparameters as JSON, with each group's parameters by name."""
        out = []
        for g, (group, names) in enumerate(zip(self.optimizer.param_groups, self.group_names)):
            entry: dict[str, Any] = {}
            for k, v in group.items():
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor):
                    v = v.tolist()
                elif isinstance(v, tuple):
                    v = list(v)
                if not isinstance(v, (int, float, bool, str, list, type(None))):
                    raise CheckpointError(
                        f"optimizer param group {g}: {k!r} is a {type(v).__name__}, not JSON"
                    )
                entry[k] = v
            entry["params"] = names
            out.append(entry)
        return out

    def agree(self, t: Target) -> tuple[dict[str, dict[str, Any]], str]:
        """Scalar state per slot, and which slots have state (``"0"``/``"1"`` each), of every
        rank. The sharded trainer's optimizer knows its own slice only: Adam's ``step``, and
        which state tensors exist at all (a rank whose slice no step touched has none), so
        there the ranks exchange theirs and ``flat_keys`` grows to every rank's; every rank
        calls it then."""
        mine = self.scalars(len(t.fm.layout))
        if not t.owns_state(self.optimizer) or t.world == 1:
            return merge_scalars([mine])
        flat = [[s.key, dtype_name(s.param), dtype_name(s.dtype)] for s in self.streams]
        payload = json.dumps({"scalars": mine, "flat": flat}).encode()
        replies = [json.loads(r) for r in t.exchange(payload)]
        have = {(s.key, s.param) for s in self.streams}
        for r in replies:
            for k, p, d in r["flat"]:
                if (k, dtype_from_name(p)) not in have:
                    have.add((k, dtype_from_name(p)))
                    stream = Stream(k, dtype_from_name(p), dtype_from_name(d), self.layout.mixed)
                    self.streams.append(stream)
        self.streams = canonical(self.streams, self.layout)  # (new keys last, as found)
        return merge_scalars([r["scalars"] for r in replies])

    def metadata(self, scalars: tuple[dict[str, dict[str, Any]], str]) -> dict[str, Any]:
        """The optimizer section of ``metadata.json`` (without its files), given
        :meth:`agree`'s scalars."""
        cls = type(self.optimizer)
        return {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "param_groups": self.groups_json(),
            "flat_state": streams_json(self.streams, self.layout),
            "scalar_state": scalars[0],
            "stateful": scalars[1],
        }


def merge_scalars(parts: list[tuple[dict[str, dict[str, Any]], list[bool]]]) -> tuple[dict, str]:
    """Combine the per-rank scalar state of a sharded optimizer (each rank knows its slots)."""
    merged: dict[str, dict[str, Any]] = {}
    stateful: list[bool] = []
    for scalars, flags in parts:
        stateful = [a or b for a, b in zip(stateful, flags)] if stateful else list(flags)
        for key, spec in scalars.items():
            into = merged.setdefault(key, {"dtype": spec["dtype"], "values": list(spec["values"])})
            for i, v in enumerate(spec["values"]):
                if v is not None:
                    into["values"][i] = v
            if spec["dtype"] != "python":
                into["dtype"] = spec["dtype"]
    return merged, "".join("1" if f else "0" for f in stateful)


def restore_group_values(current: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """Saved hyperparameters in the types the live param group uses (tuples, tensors)."""
    out = {}
    for k, v in saved.items():
        now = current.get(k)
        if isinstance(now, tuple) and isinstance(v, list):
            v = tuple(v)
        elif isinstance(now, torch.Tensor):
            v = torch.tensor(v, dtype=now.dtype, device=now.device)
        out[k] = v
    return out


def _same_kind(v: Any, live: Any) -> bool:
    """Whether JSON value ``v`` can stand for ``live`` (a hyperparameter's current value)."""
    if isinstance(live, torch.Tensor):
        flat = v if isinstance(v, list) and live.dim() > 0 else [v]
        return len(flat) == live.numel() and all(_same_kind(x, 0.0) for x in flat)
    if isinstance(live, bool) or live is None or isinstance(live, str):
        return type(v) is type(live)
    if isinstance(live, (int, float)):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if isinstance(live, (list, tuple)):
        return isinstance(v, list) and len(v) == len(live) and all(map(_same_kind, v, live))
    if isinstance(live, dict):
        return (
            isinstance(v, dict)
            and v.keys() == live.keys()
            and all(_same_kind(v[k], live[k]) for k in v)
        )
    return False


def _show(v: Any) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else f"{text[:77]}..."


def group_problem(
    saved: list[dict[str, Any]],
    optimizer: torch.optim.Optimizer,
    checked: Collection[str] | None,
    device: torch.device,
) -> str | None:
    """What in the saved param groups this optimizer cannot take, or ``None``.

    ``checked``: the hyperparameters whose types and ranges were already checked
    by the rules of the optimizer's class (``None``: a class without rules, whose
    every live hyperparameter must then be in the checkpoint). Every other
    saved value must be of the live value's kind; keys the live optimizer lacks
    are refused; ``capturable`` needs parameters on an accelerator, and
    ``differentiable`` must stay what it is (torchshard's parameters are leaves).
    """
    cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    for g, (sg, lg) in enumerate(zip(saved, optimizer.param_groups)):
        where = f"optimizer.param_groups[{g}]"
        for key, value in sg.items():
            if key == "params":
                continue
            path = f"{where}.{key}"
            if key not in lg:
                keys = ", ".join(k for k in lg if k != "params")
                return f"{path}: expected a hyperparameter of {cls} ({keys}), got {key!r} = {_show(value)}"
            if (checked is None or key not in checked) and not _same_kind(value, lg[key]):
                return f"{path}: expected a value like this optimizer's {_show(_plain(lg[key]))}, got {_show(value)}"
        if checked is None:
            missing = [k for k in lg if k != "params" and k not in sg]
            if missing:
                return (
                    f"{where}.{missing[0]}: expected a value (this optimizer has one), got nothing"
                )
        if sg.get("capturable") is True and device.type == "cpu":
            return (
                f"{where}.capturable: expected false for parameters on cpu (torch steps a "
                "capturable optimizer on an accelerator only), got true"
            )
        if "differentiable" in sg and sg["differentiable"] != lg.get("differentiable", False):
            return (
                f"{where}.differentiable: expected {_show(lg.get('differentiable', False))} "
                f"as this optimizer has it, got {_show(sg['differentiable'])}"
            )
    return None


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return list(v) if isinstance(v, tuple) else v
