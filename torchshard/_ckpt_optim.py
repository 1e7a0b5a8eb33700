"""An optimizer's state seen through the flat layout: flat per-parameter tensors and scalars."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._errors import CheckpointError
from ._flat_module import FlatParamModule
from ._layout import dtype_from_name, dtype_name

__all__ = ["OptimizerView", "restore_group_values"]


@dataclass
class OptimizerView:
    """Which slot each optimizer parameter is, and how its state splits.

    ``flat_keys``: state entries shaped like their parameter (``exp_avg``...),
    saved as flat ranges in layout order; ``scalars``: the rest (``step``...),
    one JSON value per slot (``None`` where a parameter has no state yet).
    """

    optimizer: torch.optim.Optimizer
    slot_of: dict[int, int]  # id(param) -> slot index
    params: list[torch.Tensor]  # by slot index
    flat_keys: dict[str, torch.dtype]
    scalars: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, fm: FlatParamModule) -> OptimizerView:
        params = [p for _, p in fm.named_flat_views()]
        slot_of = {id(p): i for i, p in enumerate(params)}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in slot_of:
                    raise CheckpointError(
                        f"optimizer: param group {g} holds a tensor of shape {list(p.shape)} that is "
                        "not a parameter of the wrapped model; build the optimizer over fm.parameters()"
                    )
        flat_keys: dict[str, torch.dtype] = {}
        scalar_keys: set[str] = set()
        for p, state in optimizer.state.items():
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                    flat_keys.setdefault(key, v.dtype)
                else:
                    scalar_keys.add(key)
        clash = scalar_keys & set(flat_keys)
        for key in sorted(clash):  # 0-dim parameters: their tensors look like scalars
            if all(isinstance(v, torch.Tensor) and v.shape == p.shape for p, st in
                   optimizer.state.items() for k, v in st.items() if k == key):  # fmt: skip
                scalar_keys.discard(key)
            else:
                raise CheckpointError(f"optimizer state {key!r}: mixes tensors and scalars")
        scalars = {}
        for key in sorted(scalar_keys):
            values: list[Any] = [None] * len(params)
            kind = "python"
            for p, state in optimizer.state.items():
                if key not in state:
                    continue
                v = state[key]
                if isinstance(v, torch.Tensor):
                    if v.numel() != 1:
                        raise CheckpointError(
                            f"optimizer state {key!r} of {fm.layout.slots[slot_of[id(p)]].name!r}: "
                            f"shape {list(v.shape)} is neither the parameter's nor a scalar; "
                            "this optimizer is not supported"
                        )
                    kind = dtype_name(v.dtype)
                    v = v.item()
                elif v is not None and not isinstance(v, (int, float, bool)):
                    raise CheckpointError(
                        f"optimizer state {key!r}: {type(v).__name__} values are not supported"
                    )
                values[slot_of[id(p)]] = v
            scalars[key] = {"dtype": kind, "values": values}
        return cls(optimizer, slot_of, params, flat_keys, scalars)

    def groups_json(self, names: list[str]) -> list[dict[str, Any]]:
        """Param-group hyperparameters as JSON, with each group's parameters by name."""
        out = []
        for g, group in enumerate(self.optimizer.param_groups):
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
            entry["params"] = [names[self.slot_of[id(p)]] for p in group["params"]]
            out.append(entry)
        return out

    def state_value(self, key: str, spec: dict[str, Any], value: Any, param: torch.Tensor) -> Any:
        if spec["dtype"] == "python" or value is None:
            return value
        return torch.tensor(value, dtype=dtype_from_name(spec["dtype"]))


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
