"""The flat layout: where every parameter of a module lives in one 1-D buffer.

Pure metadata. Building a layout reads only shapes, dtypes and identities of
parameters, so it works on modules built under ``torch.device("meta")``.
This module imports nothing from torchshard except its errors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import nn

from .._errors import LayoutError

__all__ = [
    "BYTES",
    "FlatLayout",
    "ParamSlot",
    "Region",
    "as_dtype",
    "dtype_from_name",
    "dtype_name",
]

_LAYOUT_FORMAT = 1
_MIXED_FORMAT = 2  # slots of several dtypes: written only for such layouts

BYTES = "uint8"
"""The buffer dtype of a layout whose parameters have several dtypes: its offsets, sizes and
alignment count bytes, and each parameter is a typed view of its bytes."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; raises :class:`LayoutError` for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"dtype: expected a torch dtype name such as 'float32', got {name!r}")
    return dtype


@dataclass(frozen=True)
class ParamSlot:
    """One unique parameter's place in the flat buffer.

    ``aliases`` are the other names under which the same ``Parameter`` is
    registered (tied weights); they share this slot. ``offset`` and :attr:`end` are
    positions in the buffer; ``numel`` counts the parameter's elements, each ``width``
    buffer elements wide (1, except in a layout of several dtypes, whose buffer is bytes).

    Example::

        slot = fm.layout["lm_head.weight"]
        weight = slot.view(fm.flat_param)   # flat_param[slot.offset : slot.end], typed
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int
    requires_grad: bool
    aliases: tuple[str, ...] = ()
    width: int = 1

    @property
    def end(self) -> int:
        return self.offset + self.span

    @property
    def span(self) -> int:
        """Buffer elements the parameter takes (``numel``, or its bytes in a mixed layout)."""
        return self.numel * self.width

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def view(self, buffer: torch.Tensor, base: int = 0) -> torch.Tensor:
        """The parameter's values in ``buffer`` (a flat buffer, or a piece of one that
        starts at position ``base``), in the parameter's dtype and shape.

        Example::

            slot.view(fm.flat_param).dtype == slot.torch_dtype
        """
        piece = buffer[self.offset - base : self.end - base]
        return as_dtype(piece, self.torch_dtype).view(self.shape)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class Region:
    """Buffer positions ``[start, end)``, slots ``[lo, hi)``, all of ``dtype``.

    Example::

        typed = region.view(fm.flat_param)   # flat_param[start:end] as a tensor of dtype
    """

    dtype: torch.dtype
    start: int
    end: int
    lo: int
    hi: int

    def view(self, buffer: torch.Tensor, base: int = 0) -> torch.Tensor:
        """The region of ``buffer`` (which starts at position ``base``), typed."""
        return as_dtype(buffer[self.start - base : self.end - base], self.dtype)


@dataclass(frozen=True)
class FlatLayout:
    """Names, shapes and offsets of a module's unique parameters in one flat buffer.

    Slots are in ``named_parameters()`` order; every offset is a multiple of
    ``align_bytes``; ``numel`` (the buffer size) is rounded up to it too. The
    layout does not depend on the world size.

    Example::

        with torch.device("meta"):
            model = nn.Linear(4, 3)
        layout = FlatLayout.from_module(model)
        layout.numel, layout["weight"].offset, layout["bias"].offset  # (16, 0, 12)
        assert FlatLayout.from_json(layout.to_json()) == layout
    """

    slots: tuple[ParamSlot, ...]
    dtype: str
    align_bytes: int
    numel: int

    @classmethod
    def from_module(
        cls, module: nn.Module, *, dtype: torch.dtype | None = None, align_bytes: int = 16
    ) -> FlatLayout:
        """Lay out ``module``'s unique parameters, casting them all to ``dtype`` if given.

        Parameters of several dtypes without ``dtype=`` keep their own: the buffer is then
        bytes (:data:`BYTES`), each parameter a typed view at an aligned byte offset, in
        ``named_parameters()`` order as always (:attr:`regions` are the runs of one dtype).

        Raises :class:`LayoutError` for a module without parameters, a parameter that is
        not floating point, and a bad ``align_bytes``.
        """
        # remove_duplicate=False lists a tied Parameter under each of its names.
        by_id: dict[int, list[str]] = {}
        params: list[torch.nn.Parameter] = []
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in by_id:
                by_id[id(p)] = []
                params.append(p)
            by_id[id(p)].append(name)
        if not params:
            raise LayoutError(
                f"{type(module).__name__} has no parameters: nothing to put in a flat buffer"
            )
        dtypes = [dtype] * len(params) if dtype is not None else [p.dtype for p in params]
        for d, p in zip(dtypes, params):
            if not (d.is_floating_point or d.is_complex):
                raise LayoutError(
                    f"dtype: expected a floating point dtype, got {d} "
                    f"(parameter {by_id[id(p)][0]!r})"
                )
        mixed = len(set(dtypes)) > 1
        for d in set(dtypes):
            itemsize = d.itemsize
            if align_bytes <= 0 or align_bytes % itemsize:
                raise LayoutError(
                    f"align_bytes: expected a positive multiple of the {d} item size "
                    f"({itemsize}), got {align_bytes}"
                )
        buffer_dtype = BYTES if mixed else dtype_name(dtypes[0])
        align = align_bytes if mixed else align_bytes // dtypes[0].itemsize
        slots, offset = [], 0
        for p, d in zip(params, dtypes):
            names = by_id[id(p)]
            slot = ParamSlot(
                name=names[0],
                shape=tuple(p.shape),
                dtype=dtype_name(d),
                offset=offset,
                numel=p.numel(),
                requires_grad=p.requires_grad,
                aliases=tuple(names[1:]),
                width=d.itemsize if mixed else 1,
            )
            slots.append(slot)
            offset = _round_up(slot.end, align)
        return cls(tuple(slots), buffer_dtype, align_bytes, offset)

    def with_shapes(self, shapes: dict[int, tuple[int, ...]]) -> FlatLayout:
        """This layout with slot ``i`` of shape ``shapes[i]`` (the rest as they are), laid
        out again by the same rules: what a tensor-parallel rank's pieces take.

        Example::

            layout.with_shapes({0: (2, 4)}).slots[0].numel   # 8
        """
        align = self.align_bytes if self.mixed else self.align_bytes // self.torch_dtype.itemsize
        slots, offset = [], 0
        for i, slot in enumerate(self.slots):
            shape = tuple(shapes.get(i, slot.shape))
            slot = replace(slot, shape=shape, numel=math.prod(shape), offset=offset)
            slots.append(slot)
            offset = _round_up(slot.end, align)
        return FlatLayout(tuple(slots), self.dtype, self.align_bytes, offset)

    def __post_init__(self) -> None:
        # Cheap structural checks so a layout read from JSON cannot describe
        # overlapping or out-of-range slots.
        align = self.align
        end, seen = 0, set()
        for s in self.slots:
            if s.offset < end or s.offset % align or s.numel != math.prod(s.shape):
                raise LayoutError(f"layout slot {s.name!r}: bad offset/shape/numel {s}")
            if self.mixed:
                if s.width != dtype_from_name(s.dtype).itemsize:
                    raise LayoutError(f"layout slot {s.name!r}: width {s.width} != its dtype's")
            elif s.dtype != self.dtype or s.width != 1:
                raise LayoutError(f"layout slot {s.name!r}: dtype {s.dtype} != {self.dtype}")
            for n in s.names:
                if n in seen:
                    raise LayoutError(f"layout: name {n!r} appears twice")
                seen.add(n)
            end = s.end
        if self.numel < end:
            raise LayoutError(f"layout: numel {self.numel} < end of last slot {end}")

    # -- lookup ---------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        """The buffer's dtype: the parameters', or ``torch.uint8`` when they have several."""
        return dtype_from_name(self.dtype)

    @property
    def mixed(self) -> bool:
        """The parameters have several dtypes: the buffer is bytes, each slot a typed view."""
        return self.dtype == BYTES

    @cached_property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The parameters' dtypes, each once, in layout order.

        Example::

            layout.dtypes   # (torch.bfloat16, torch.float32): bf16 linears, fp32 norms
        """
        return tuple(dict.fromkeys(s.torch_dtype for s in self.slots))

    @cached_property
    def regions(self) -> tuple[Region, ...]:
        """Maximal runs of slots of one dtype, tiling ``[0, numel)`` (a gap belongs to the
        run before it): what arithmetic on the buffer views as one typed tensor. One region
        when every parameter has the layout's dtype.

        Example::

            for r in layout.regions:
                typed = flat[r.start : r.end].view(r.dtype)
        """
        slots = self.slots
        if not slots:
            return ()
        cuts = [0] + [i for i in range(1, len(slots)) if slots[i].dtype != slots[i - 1].dtype]
        bounds = [0 if k == 0 else self.slots[i].offset for k, i in enumerate(cuts)] + [self.numel]
        his = [*cuts[1:], len(self.slots)]
        return tuple(
            Region(self.slots[lo].torch_dtype, bounds[k], bounds[k + 1], lo, hi)
            for k, (lo, hi) in enumerate(zip(cuts, his))
        )

    def typed(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """``buffer`` (a flat buffer of this layout) as typed tensors: one per region of a
        mixed layout, else ``[buffer]`` itself (padding past ``numel`` included).

        Example::

            for t in fm.layout.typed(fm.flat_param):
                t.mul_(0.5)   # arithmetic on every parameter, each in its own dtype
        """
        return [r.view(buffer) for r in self.regions] if self.mixed else [buffer]

    def region_of(self, position: int) -> Region:
        """The region holding buffer position ``position``."""
        for r in self.regions:
            if r.start <= position < r.end:
                return r
        raise LayoutError(f"position {position} is outside the layout's [0, {self.numel})")

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    @property
    def align(self) -> int:
        """The alignment in elements: every offset (and every rank boundary) is a multiple."""
        return self.align_bytes // self.torch_dtype.itemsize

    @cached_property
    def grad_layout(self) -> FlatLayout:
        """Where the trainable parameters' gradients live: the trainable slots alone, in
        layout order, each at an offset aligned as here (the layout itself when every
        parameter trains). Frozen parameters cost no gradient, bucket, reduction, optimizer
        state or master copy: those all live in this space.

        Example::

            layout.grad_layout.numel   # 131072 for rank-8 LoRA on 8 frozen Linear(1024, 1024)
            layout.grad_layout.slots[k].name == layout.slots[layout.trainable[k]].name
        """
        if all(s.requires_grad for s in self.slots):
            return self
        align, offset, slots = self.align, 0, []
        for s in self.slots:
            if s.requires_grad:
                slots.append(replace(s, offset=offset))
                offset = _round_up(offset + s.span, align)
        return FlatLayout(tuple(slots), self.dtype, self.align_bytes, offset)

    @cached_property
    def trainable(self) -> tuple[int, ...]:
        """Indices of the slots that train, in layout order (``grad_layout``'s slots)."""
        return tuple(i for i, s in enumerate(self.slots) if s.requires_grad)

    def trainable_runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of trainable slots that lie back to back in both spaces:
        ``(start, end, grad_start)``, flat ``[start, end)`` being the gradient space's
        ``[grad_start, grad_start + end - start)`` (alignment gaps inside included).

        Example::

            [(0, 16, 0)] == FlatLayout.from_module(nn.Linear(4, 3)).trainable_runs()
        """
        return list(self._trainable_runs)

    @cached_property
    def _trainable_runs(self) -> tuple[tuple[int, int, int], ...]:
        runs: list[tuple[int, int, int]] = []
        grad, align = self.grad_layout, self.align
        for k, i in enumerate(self.trainable):
            s, g = self.slots[i], grad.slots[k]
            # the next slot, right after the run's alignment gap: the gradient space has the
            # same gap (both runs start aligned), so the run goes on in both
            if k and self.trainable[k - 1] == i - 1 and s.offset == _round_up(runs[-1][1], align):
                runs[-1] = (runs[-1][0], s.end, runs[-1][2])
            else:
                runs.append((s.offset, s.end, g.offset))
        return tuple(runs)

    @cached_property
    def trainable_suffix(self) -> int | None:
        """Where the trainable slots start when they are the layout's last slots, back to back
        (frozen ones only before them: a frozen embedding or encoder): from there on the flat
        buffer is laid out like the gradient, so a sharded optimizer slices it in place.
        ``None`` otherwise (and when everything trains, or nothing does).

        Example::

            layout.trainable_suffix   # 1536: everything from slot 2 on trains
        """
        runs = self.trainable_runs()
        if self.grad_layout is self or len(runs) != 1 or runs[0][1] != self.slots[-1].end:
            return None
        return runs[0][0]

    @property
    def param_numel(self) -> int:
        """Elements that belong to parameters (``numel`` minus alignment padding)."""
        return sum(s.numel for s in self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[ParamSlot]:
        return iter(self.slots)

    def __getitem__(self, name: str) -> ParamSlot:
        """The slot of ``name``, which may be an alias of a tied parameter."""
        for s in self.slots:
            if name in s.names:
                return s
        raise KeyError(name)

    # -- serialization ----------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-ready description; a mixed layout's slots add their dtype (format 2)."""
        own = (lambda s: [s.dtype]) if self.mixed else (lambda s: [])
        return {
            "format": _MIXED_FORMAT if self.mixed else _LAYOUT_FORMAT,
            "dtype": self.dtype,
            "align_bytes": self.align_bytes,
            "numel": self.numel,
            "slots": [
                [
                    s.name,
                    list(s.shape),
                    s.offset,
                    s.numel,
                    s.requires_grad,
                    list(s.aliases),
                    *own(s),
                ]
                for s in self.slots
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> FlatLayout:
        try:
            dtype = data["dtype"]
            mixed = dtype == BYTES
            fmt = _MIXED_FORMAT if mixed else _LAYOUT_FORMAT
            if data["format"] != fmt:
                raise LayoutError(
                    f"layout format: expected {fmt} for a layout of dtype {dtype!r}, got "
                    f"{data['format']!r}; upgrade torchshard to read it"
                )
            dtype_from_name(dtype)
            slots = []
            for name, shape, offset, numel, rg, aliases, *own in data["slots"]:
                if len(own) != mixed:
                    raise LayoutError(f"layout slot {name!r}: expected {6 + mixed} fields")
                d = str(own[0]) if mixed else dtype
                slots.append(
                    ParamSlot(
                        name=str(name),
                        shape=tuple(int(x) for x in shape),
                        dtype=d,
                        offset=int(offset),
                        numel=int(numel),
                        requires_grad=bool(rg),
                        aliases=tuple(str(a) for a in aliases),
                        width=dtype_from_name(d).itemsize if mixed else 1,
                    )
                )
            return cls(tuple(slots), dtype, int(data["align_bytes"]), int(data["numel"]))
        except LayoutError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"layout: malformed description ({type(e).__name__}: {e})") from e

    def to_json(self) -> str:
        """A compact, deterministic JSON text (one slot per line)."""
        d = self.to_dict()
        slots = ",\n  ".join(json.dumps(s, separators=(",", ":")) for s in d.pop("slots"))
        head = json.dumps(d, separators=(",", ":"))[:-1]
        return f'{head},"slots":[\n  {slots}\n]}}'

    @classmethod
    def from_json(cls, text: str) -> FlatLayout:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise LayoutError(f"layout: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise LayoutError(f"layout: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def fingerprint(self) -> str:
        """A stable hex digest of everything in the layout (ranks and checkpoints compare it)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def first_difference(self, other: FlatLayout) -> str | None:
        """A sentence naming the first thing that differs from ``other``, or ``None``."""
        for attr in ("dtype", "align_bytes"):
            if getattr(self, attr) != getattr(other, attr):
                return f"{attr}: {getattr(self, attr)!r} vs {getattr(other, attr)!r}"
        for a, b in zip(self.slots, other.slots):
            if a != b:
                return f"parameter {a.name!r}: {_describe(a)} vs {b.name!r}: {_describe(b)}"
        if len(self.slots) != len(other.slots):
            longer = self.slots if len(self.slots) > len(other.slots) else other.slots
            extra = longer[min(len(self.slots), len(other.slots))]
            return f"parameter count: {len(self.slots)} vs {len(other.slots)} (first extra: {extra.name!r})"
        if self.numel != other.numel:
            return f"numel: {self.numel} vs {other.numel}"
        return None


def _describe(s: ParamSlot) -> str:
    tied = f", tied to {list(s.aliases)}" if s.aliases else ""
    frozen = "" if s.requires_grad else ", frozen"
    return f"{s.dtype}, shape {list(s.shape)} at offset {s.offset}{frozen}{tied}"


def as_dtype(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A piece of a byte buffer seen as ``dtype``; any other buffer as it is (its values,
    whatever their dtype: e.g. a gradient kept in the reduce dtype).

    Example::

        as_dtype(flat[a:b], torch.bfloat16)   # a mixed layout's bytes as bf16, else flat[a:b]
    """
    return piece.view(dtype) if piece.dtype == torch.uint8 else piece


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
