"""Loading a checkpoint at any world size, reading each byte about once across all ranks.

Rank r of the current world reads only the parts of the saved files that
overlap its element range ``[s, e)`` of the flat buffer, into host memory,
verifying checksums. Only when every rank has read its part without error
does anything change: each rank copies its range into place and the ranges
are broadcast, so every rank ends with the whole buffer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._ckpt_format import Metadata, read_metadata, resolve
from ._ckpt_optim import OptimizerView, restore_group_values
from ._ckpt_target import CheckpointInfo, Target
from ._dist import exchange_bytes
from ._errors import CheckpointError
from ._flat_module import FlatParamModule
from ._layout import dtype_from_name
from ._reshard import element_ranges, overlap
from ._safetensors import SafetensorsReader
from ._trainer import DistributedTrainer

__all__ = ["load"]


class _Readers:
    """Opens each file of the checkpoint at most once; counts the bytes read."""

    def __init__(self, meta: Metadata) -> None:
        self.meta = meta
        self._open: dict[str, SafetensorsReader] = {}
        self.bytes_read = 0

    def __getitem__(self, name: str) -> SafetensorsReader:
        if name not in self._open:
            self._open[name] = SafetensorsReader(self.meta.file_path(name), self.meta.files[name])
        return self._open[name]

    def close(self) -> None:
        for r in self._open.values():
            self.bytes_read += r.bytes_read
            r.close()


def _check_compatible(meta: Metadata, t: Target, optimizer: torch.optim.Optimizer | None) -> None:
    diff = meta.layout.first_difference(t.fm.layout)
    if diff is not None:
        raise CheckpointError(
            f"{meta.path}: the checkpoint is of a different model; first difference "
            f"(checkpoint vs this model): {diff}"
        )
    live = set(t.buffers())
    if set(meta.buffers) != live:
        raise CheckpointError(
            f"{meta.path}: module buffers differ: checkpoint has {sorted(set(meta.buffers) - live)} "
            f"that the model lacks, the model has {sorted(live - set(meta.buffers))} that the checkpoint lacks"
        )
    if optimizer is None:
        return
    saved = meta.optimizer
    if saved is None:
        raise CheckpointError(f"{meta.path}: holds no optimizer state; load with optimizer=None")
    cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if saved["class"] != cls:
        raise CheckpointError(f"{meta.path}: optimizer: checkpoint has {saved['class']}, got {cls}")
    view = OptimizerView.of(optimizer, t.fm)
    names = [s.name for s in t.fm.layout]
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{meta.path}: optimizer: checkpoint has {len(groups)} param groups, got "
            f"{len(optimizer.param_groups)}"
        )
    for g, (sg, group) in enumerate(zip(groups, optimizer.param_groups)):
        mine = [names[view.slot_of[id(p)]] for p in group["params"]]
        if sg["params"] != mine:
            first = next((a, b) for a, b in zip([*sg["params"], None], [*mine, None]) if a != b)
            raise CheckpointError(
                f"{meta.path}: optimizer param group {g}: checkpoint has parameter {first[0]!r} "
                f"where this optimizer has {first[1]!r}"
            )


def _read_share(
    meta: Metadata, t: Target, optimizer: torch.optim.Optimizer | None, readers: _Readers
) -> dict[str, Any]:
    """Read this rank's element range of weights and optimizer state, and the buffers, to host."""
    layout = t.fm.layout
    align = layout.align_bytes // layout.torch_dtype.itemsize
    s, e = element_ranges(layout.numel, t.world, align)[t.rank]
    pin = t.device.type == "cuda"
    weights = torch.zeros(e - s, dtype=layout.torch_dtype, pin_memory=pin)
    for shard in meta.weights:
        lo, hi = shard["slots"]
        reader = None
        for slot in layout.slots[lo:hi]:
            ov = overlap((slot.offset, slot.end), (s, e))
            if ov is None:
                continue
            reader = reader or readers[shard["file"]]
            entry = reader.entries.get(slot.name)
            if entry is None or entry.shape != slot.shape:
                found = "nothing" if entry is None else f"shape {list(entry.shape)}"
                raise CheckpointError(
                    f"{reader.path}: parameter {slot.name!r}: expected shape {list(slot.shape)}, "
                    f"found {found}"
                )
            a, b = ov
            reader.read_into(slot.name, a - slot.offset, b - slot.offset, weights[a - s : b - s])
    buffers = {}
    live = t.buffers()
    for name, file in meta.buffers.items():
        reader = readers[file]
        entry = reader.entries.get(name)
        want = live[name]
        if entry is None or entry.shape != tuple(want.shape) or entry.dtype != want.dtype:
            raise CheckpointError(
                f"{reader.path}: buffer {name!r}: expected {want.dtype} {list(want.shape)}, found "
                f"{'nothing' if entry is None else f'{entry.dtype} {list(entry.shape)}'}"
            )
        host = torch.empty(entry.shape, dtype=entry.dtype)
        reader.read_into(name, 0, host.numel(), host.view(-1))
        buffers[name] = host
    state = {}
    if optimizer is not None:
        assert meta.optimizer is not None
        for key, dname in meta.optimizer["flat_state"].items():
            host = torch.zeros(e - s, dtype=dtype_from_name(dname), pin_memory=pin)
            for f in meta.optimizer["files"]:
                fs, fe = f["range"]
                ov = overlap((fs, fe), (s, e))
                if ov is not None:
                    a, b = ov
                    readers[f["file"]].read_into(key, a - fs, b - fs, host[a - s : b - s])
            state[key] = host
    return {"range": (s, e), "weights": weights, "buffers": buffers, "optim": state}


def _agree(t: Target, error: str | None, path: Path) -> None:
    """Raise on every rank if any rank failed (or they resolved different checkpoints)."""
    if t.world == 1:
        if error:
            raise CheckpointError(error)
        return
    mine = f"{path}\0{error or ''}".encode()
    replies = [r.decode().split("\0", 1) for r in exchange_bytes(mine, t.group, t.device)]
    for r, (_, err) in enumerate(replies):
        if err:
            raise CheckpointError(err if r == t.rank else f"rank {r} failed to load: {err}")
    paths = sorted({p for p, _ in replies})
    if len(paths) > 1:
        raise CheckpointError(f"ranks resolved different checkpoints: {paths}; pass one directory")


@torch.no_grad()
def _apply(
    meta: Metadata, t: Target, share: dict[str, Any], optimizer: torch.optim.Optimizer | None
) -> None:
    layout = t.fm.layout
    align = layout.align_bytes // layout.torch_dtype.itemsize
    ranges = element_ranges(layout.numel, t.world, align)
    s, e = share["range"]
    flat = t.fm.flat_param
    assert flat is not None

    def fill(full: torch.Tensor, mine: torch.Tensor) -> None:
        full[s:e].copy_(mine, non_blocking=True)
        if t.world > 1:
            for q, (a, b) in enumerate(ranges):
                if b > a:
                    dist.broadcast(full[a:b], t.global_rank(q), group=t.group)

    fill(flat, share["weights"])
    live = t.buffers()
    for name, value in share["buffers"].items():
        live[name].copy_(value)
    if optimizer is None:
        return
    assert meta.optimizer is not None
    full = {}
    for key, host in share["optim"].items():
        full[key] = torch.zeros(layout.numel, dtype=host.dtype, device=t.device)
        fill(full[key], host)
    view = OptimizerView.of(optimizer, t.fm)
    scalars = meta.optimizer["scalar_state"]
    stateful = meta.optimizer["stateful"]
    state, groups, pid = {}, [], 0
    for group, saved in zip(optimizer.param_groups, meta.optimizer["param_groups"]):
        ids = []
        for p in group["params"]:
            i = view.slot_of[id(p)]
            slot = layout.slots[i]
            if stateful[i] == "1":
                st: dict[str, Any] = {
                    k: v[slot.offset : slot.end].view(slot.shape) for k, v in full.items()
                }
                for key, spec in scalars.items():
                    v = spec["values"][i]
                    if v is not None:
                        st[key] = (
                            v
                            if spec["dtype"] == "python"
                            else torch.tensor(v, dtype=dtype_from_name(spec["dtype"]))
                        )
                state[pid] = st
            ids.append(pid)
            pid += 1
        hyper = restore_group_values(group, {k: v for k, v in saved.items() if k != "params"})
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load(
    path_or_root: str | os.PathLike[str],
    trainer: DistributedTrainer | FlatParamModule,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> CheckpointInfo:
    """Load a checkpoint into ``trainer`` (and ``optimizer``), at any world size.

    ``path_or_root`` is a checkpoint directory or a root (then its latest
    complete checkpoint). Every rank calls it. Each rank reads only its
    share of the files, verified against their checksums; if any rank fails,
    every rank raises :class:`CheckpointError` and nothing has changed. The
    optimizer's hyperparameters are restored as ``optimizer.load_state_dict``
    restores them.

    Example::

        info = torchshard.checkpoint.load("ckpt", trainer, optimizer=opt)
        start_step = info.step + 1
    """
    t = Target(trainer)
    error, share, path = None, None, Path(path_or_root)
    readers = None
    try:
        path = resolve(path)
        meta = read_metadata(path)
        _check_compatible(meta, t, optimizer)
        readers = _Readers(meta)
        share = _read_share(meta, t, optimizer, readers)
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"{e.filename or path}: {e.strerror or e}"
    finally:
        if readers is not None:
            readers.close()
    _agree(t, error, path)
    assert share is not None
    _apply(meta, t, share, optimizer)
    return CheckpointInfo(meta.step, meta.extra, path, readers.bytes_read if readers else 0)
