"""The compression state in a checkpoint: ``metadata.json``'s ``"comm"`` section and the
``comm-*.safetensors`` files it names, built at save (:func:`comm_json`) and parsed and
checked at read (:func:`parse_comm`). Pure: no tensors, no process group.

A lossy comm (``PowerSGD``, ``TopK``) hands out its state as named tensors
(``trainer.comm_state()``): 1-D ones are saved as flat ranges, split in equal parts
(:func:`comm_ranges`) across one file per saving rank, like the optimizer state, so that a
load at any world size reads ranges; 0-d ones (``steps``) as integers in the section::

    "comm": {"class": "PowerSGD",
             "settings": {"rank": 4, "start_step": 10, "min_compression": 2.0},
             "scalars": {"steps": 57},
             "flat": {"error": {"dtype": "float32", "numel": 4160},
                      "powersgd_q": {"dtype": "float32", "numel": 256}},
             "files": [{"file": "comm-00001-of-00002.safetensors",
                        "ranges": {"error": [0, 2080], "powersgd_q": [0, 128]}}, ...]}

``"error"`` is the mean of the ranks' error feedback (laid out like the gradient space).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .._flat.layout import FlatLayout, dtype_name
from ._format import COMM_VERSION, comm_file
from ._rules import (
    Invalid,
    at,
    expect_dict,
    expect_dtype,
    expect_file_name,
    expect_int,
    expect_key,
    expect_list,
    expect_str,
)

__all__ = [
    "ERROR",
    "CommMeta",
    "comm_json",
    "comm_ranges",
    "describe",
    "parse_comm",
    "with_comm",
]

ERROR = "error"
"""The error feedback's name: saved as the mean over the ranks, laid out like the gradients."""


def comm_ranges(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Each saving rank's range ``[start, end)`` of a flat comm tensor of ``numel`` elements:
    equal parts (the first ones one element shorter when it does not divide).

    Example::

        comm_ranges(10, 4)  # [(0, 2), (2, 5), (5, 7), (7, 10)]
    """
    return [(r * numel // world_size, (r + 1) * numel // world_size) for r in range(world_size)]


def describe(cls: str, settings: dict[str, Any]) -> str:
    """A comm as it was built: ``PowerSGD(rank=4, start_step=10, min_compression=2.0)``."""
    return f"{cls}({', '.join(f'{k}={v!r}' for k, v in settings.items())})"


@dataclass(frozen=True)
class CommMeta:
    """The ``"comm"`` section of ``metadata.json``, parsed: the comm's class and settings, its
    integer state (``scalars``), its flat tensors' dtype and size, and each file's ranges."""

    cls: str
    settings: dict[str, Any]
    scalars: dict[str, int]
    flat: dict[str, tuple[torch.dtype, int]]  # name -> (dtype, numel)
    files: list[tuple[str, dict[str, tuple[int, int]]]]  # (file, name -> [start, end))

    def __str__(self) -> str:
        return describe(self.cls, self.settings)

    def pieces(self, name: str, start: int, end: int) -> list[tuple[str, int, int, int]]:
        """Where flat ``[start, end)`` of tensor ``name`` lies in the files: ``(file, a, b,
        at)``: the file's tensor ``[a, b)`` is ``[at, at + b - a)`` of ``[start, end)``.

        Example::

            meta.comm.pieces("error", 0, 100)  # [("comm-00001-of-00002.safetensors", 0, 100, 0)]
        """
        out = []
        for file, ranges in self.files:
            fs, fe = ranges.get(name, (0, 0))
            a, b = max(fs, start), min(fe, end)
            if a < b:
                out.append((file, a - fs, b - fs, a - start))
        return out

    def to_json(self, world_size: int) -> dict[str, Any]:
        """The section as a save at ``world_size`` writes it (``reshard``: another world size)."""
        return comm_json(self.cls, self.settings, self.scalars, self.flat, world_size)


def comm_json(
    cls: str,
    settings: dict[str, Any],
    scalars: dict[str, int],
    flat: dict[str, tuple[torch.dtype, int]],
    world_size: int,
) -> dict[str, Any]:
    """The ``"comm"`` section of a save at ``world_size``: rank ``r`` writes
    ``comm_file(r, world_size)`` with its :func:`comm_ranges` of each flat tensor (a file only
    where it has elements; in it, only the tensors it has elements of).

    Example::

        comm_json("TopK", {"ratio": 0.01, "error_feedback": True}, {"steps": 3},
                  {"error": (torch.float32, 10)}, 2)["files"][1]
        # {"file": "comm-00002-of-00002.safetensors", "ranges": {"error": [5, 10]}}
    """
    cuts = {name: comm_ranges(n, world_size) for name, (_, n) in flat.items()}
    files = []
    for r in range(world_size):
        ranges = {name: list(c[r]) for name, c in cuts.items() if c[r][1] > c[r][0]}
        if ranges:
            files.append({"file": comm_file(r, world_size), "ranges": ranges})
    return {
        "class": cls,
        "settings": dict(settings),
        "scalars": dict(scalars),
        "flat": {n: {"dtype": dtype_name(d), "numel": k} for n, (d, k) in flat.items()},
        "files": files,
    }


def with_comm(metadata: dict[str, Any], section: dict[str, Any] | None) -> dict[str, Any]:
    """``metadata`` (of :func:`~._format.build_metadata`) with the ``"comm"`` section, if any:
    then it says format :data:`~._format.COMM_VERSION`; without, it is left as it was."""
    if section is None:
        return metadata
    return {**metadata, "format_version": COMM_VERSION, "comm": section}


def _setting(v: Any, path: str) -> None:
    ok = v is None or isinstance(v, (bool, int, str))
    if not (ok or (isinstance(v, float) and math.isfinite(v))):
        raise Invalid(path, "a number, string, true, false or null", v)


def parse_comm(v: Any, layout: FlatLayout, version: int) -> CommMeta | None:
    """The ``"comm"`` section (``None`` when absent), checked: its types, the error's size
    (the layout's gradient space), and files whose ranges tile each tensor in order; else
    :class:`~._rules.Invalid` naming the key path."""
    if v is None:
        return None
    path = "comm"
    if version < COMM_VERSION:
        what = f"{COMM_VERSION} or more (the checkpoint holds compression state)"
        raise Invalid("format_version", what, version)
    d = expect_dict(v, path)
    cls = expect_str(expect_key(d, "class", path), at(path, "class"))
    settings = expect_dict(expect_key(d, "settings", path), at(path, "settings"))
    for k, x in settings.items():
        _setting(x, at(at(path, "settings"), k))
    raw_scalars = expect_dict(expect_key(d, "scalars", path), at(path, "scalars"))
    scalars = {k: expect_int(x, at(at(path, "scalars"), k)) for k, x in raw_scalars.items()}
    flat = {}
    for name, spec in expect_dict(expect_key(d, "flat", path), at(path, "flat")).items():
        where = at(at(path, "flat"), name)
        spec = expect_dict(spec, where)
        dtype = expect_dtype(expect_key(spec, "dtype", where), at(where, "dtype"))
        flat[name] = (dtype, expect_int(expect_key(spec, "numel", where), at(where, "numel")))
    grads = layout.grad_layout.numel
    if ERROR in flat and flat[ERROR][1] != grads:
        what = f"{grads} (the gradient space of the layout)"
        raise Invalid(at(at(at(path, "flat"), ERROR), "numel"), what, flat[ERROR][1])
    files, pos = [], dict.fromkeys(flat, 0)
    for i, f in enumerate(expect_list(expect_key(d, "files", path), at(path, "files"))):
        where = at(at(path, "files"), i)
        f = expect_dict(f, where)
        file = expect_file_name(expect_key(f, "file", where), at(where, "file"))
        ranges = {}
        for name, r in expect_dict(expect_key(f, "ranges", where), at(where, "ranges")).items():
            rw = at(at(where, "ranges"), name)
            if name not in flat:
                raise Invalid(rw, f"a range of one of {sorted(flat)}", r)
            a, b = (expect_int(x, at(rw, j)) for j, x in enumerate(expect_list(r, rw, 2)))
            if a != pos[name] or b <= a:
                raise Invalid(rw, f"[{pos[name]}, ...) (ranges in order)", r)
            ranges[name], pos[name] = (a, b), b
        files.append((file, ranges))
    short = next((n for n, (_, k) in flat.items() if pos[n] != k), None)
    if short is not None:
        what = f"ranges of {short!r} covering [0, {flat[short][1]})"
        raise Invalid(at(path, "files"), what, f"[0, {pos[short]})")
    return CommMeta(cls, settings, scalars, flat, files)
