"""The guard over buffers built on meta: forward may not read the zeros nothing wrote.

``bind()`` gives a buffer built under ``torch.device("meta")`` storage filled with zeros,
which are not the values its module computes at construction (rotary frequencies, a
causal mask). Until something writes it (``init_weights``, a checkpoint load,
``load_state_dict``, your code, or forward itself) such a buffer is *unwritten*. A write
is seen by the tensor's version counter, which every in-place op bumps.

While any buffer is unwritten, each forward of the wrapped model sees every unwritten
buffer as a guarded alias (the same storage; a tensor subclass whose
``__torch_function__`` sees the ops that receive it, and only those):

- an op that overwrites it (``copy_``, ``zero_``, ``fill_``, ``__setitem__``, the random
  fills, a ``torch.nn.init`` function, ``out=``) writes it: from then on it is a plain
  buffer (a scratch or cache buffer filled before it is read trains);
- a view of it (``buf[:n]``, ``.view``, ``.expand``, ``.detach``) stays guarded;
- shape, dtype and device queries, ``*_like`` factories and ``x.expand_as(buf)``
  (``view_as``, ``reshape_as``, ``type_as``, ``to``) read no value;
- any other op reads its zeros and raises :class:`UnwrittenBufferError` naming it, before
  an in-place op or ``out=`` could change it.

A buffer that forward never reads trains as it is. Reads outside forward (a save, a
print) are not checked, nor is a forward traced by ``torch.compile``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._errors import UnwrittenBufferError

__all__ = ["MetaBuffers"]

# Ops that write every element they touch without reading the old values, when the buffer is
# their first argument.
_WRITES = frozenset(
    {
        "copy_", "zero_", "fill_", "__setitem__", "normal_", "uniform_", "random_",
        "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_", "index_fill_",
        "index_copy_", "masked_fill_", "masked_scatter_", "fill_diagonal_", "put_",
        "index_put_", "set_",
    }
)  # fmt: skip
# Ops that read a tensor's metadata, never its values.
_METADATA = frozenset(
    {
        "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
        "is_contiguous", "element_size", "data_ptr", "get_device", "is_floating_point",
        "is_complex", "is_signed", "is_pinned", "is_shared", "untyped_storage", "__len__",
        "__hash__", "requires_grad_", "detach_", "retain_grad", "register_hook",
        "record_stream", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
        "randn_like", "randint_like", "new_empty", "new_zeros", "new_ones", "new_full",
        "new_empty_strided",
    }
)  # fmt: skip
# Ops that take their other arguments for their shape, dtype or device only.
_SELF_ONLY = frozenset({"expand_as", "view_as", "reshape_as", "type_as", "to"})
_IN_PLACE_DUNDERS = frozenset(
    {
        "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
        "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
        "__irshift__",
    }
)  # fmt: skip


@dataclass(eq=False)
class _Unwritten:
    """One buffer that ``bind()`` made zeros: where it lives and its version then."""

    name: str
    owner: nn.Module
    key: str
    tensor: torch.Tensor
    version: int
    persistent: bool
    alias: torch.Tensor | None = None  # the guarded alias, during a forward


class MetaBuffers:
    """The buffers of ``module`` built on meta that nothing has written since they became zeros.

    :class:`~torchshard.FlatParamModule` holds one (``fm.meta_buffers``); ``bind()`` fills
    it, and from then on a forward of ``module`` that reads one of them raises
    :class:`UnwrittenBufferError` naming it (see this module's docstring for what counts as
    a read and as a write).

    Cost: once every buffer is written the check removes itself (no hook is left). While a
    buffer stays unwritten (one that forward never reads, say), each forward of ``module``
    runs one forward pre-hook and one forward hook that swap a guarded alias in for each
    unwritten buffer and back: about 10 to 20 microseconds per forward for one buffer, at any
    model size (measured on a busy 2-core CPU, a 4-layer MLP whose forward takes about 110
    microseconds; a TorchFunctionMode that sees every op cost 50-80). Ops that receive such a
    buffer pass through Python; every other op runs as without the check, so the policy is
    to keep checking for as long as a buffer stays unwritten.

    Example::

        with torch.device("meta"):
            model = nn.BatchNorm1d(8)       # running_mean and running_var: buffers
        fm = FlatParamModule(model)
        fm.bind(torch.empty(fm.numel))
        fm.meta_buffers.unwritten()         # ['running_mean', 'running_var', ...]
        with fm.meta_buffers.preserved():   # a broadcast of zeros is no value
            for b in model.buffers():
                dist.broadcast(b, 0)
        fm.init_weights()                   # reset_parameters() writes them
        fm.meta_buffers.unwritten()         # []: no check is left
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._pending: dict[str, _Unwritten] = {}
        self._hooks: list[RemovableHandle] = []
        self._in_forward = False

    @torch.no_grad()
    def materialize(self, device: torch.device) -> None:
        """Move the module's buffers to ``device``; ones built on meta become zeros, unwritten.

        Example::

            fm.meta_buffers.materialize(torch.device("cpu"))
        """
        for prefix, m in self.module.named_modules(remove_duplicate=False):
            for key, buf in m._buffers.items():
                if buf is None or buf.device == device:
                    continue
                if buf.device.type != "meta":
                    m._buffers[key] = buf.to(device)
                    self.follow(m, key, buf, m._buffers[key])
                    continue
                new = torch.zeros_like(buf, device=device)
                m._buffers[key] = new
                if new.numel():  # an empty buffer holds no value to be wrong
                    name = f"{prefix}.{key}" if prefix else key
                    persistent = key not in m._non_persistent_buffers_set
                    self._pending[name] = _Unwritten(name, m, key, new, new._version, persistent)
        self._arm()

    def follow(self, owner: nn.Module, key: str, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` took ``old``'s place as buffer ``key`` of ``owner`` (moved or cast by
        ``fm.to()``): if ``old`` held unwritten zeros, so does ``new``.

        Example::

            old = model.table
            new = model._buffers["table"] = old.double()
            fm.meta_buffers.follow(model, "table", old, new)
        """
        if new is old:
            return
        for u in self._pending.values():
            if u.owner is owner and u.key == key and u.tensor is old and old._version == u.version:
                u.tensor, u.version, u.alias = new, new._version, None

    def unwritten(self) -> list[str]:
        """The qualified names of the buffers nothing has written yet, in ``named_buffers()`` order.

        Example::

            assert fm.meta_buffers.unwritten() == []  # every buffer has its value
        """
        return [n for n, u in self._pending.items() if self._holds(u)]

    def refresh(self) -> None:
        """Forget the buffers that were written; with none left the check removes itself.

        Example::

            model.table.copy_(table())
            fm.meta_buffers.refresh()           # no hook is left if that was the last one
        """
        if self._in_forward:  # the aliases stay until forward ends; _leave swaps them back
            return
        self._pending = {n: u for n, u in self._pending.items() if self._holds(u)}
        if not self._pending:
            for h in self._hooks:
                h.remove()
            self._hooks = []

    @contextlib.contextmanager
    def preserved(self) -> Iterator[list[str]]:
        """Keep the buffers that are unwritten on entry unwritten across the block.

        For a broadcast from the source rank: it writes the source's zeros, which are no
        value. Every rank built the same model and ran the same initialization, so every
        rank keeps the same names. Yields them.

        Example::

            with fm.meta_buffers.preserved():
                for b in fm.module.buffers():
                    dist.broadcast(b, 0)
        """
        names = self.unwritten()
        try:
            yield names
        finally:
            for name in names:
                u = self._pending.get(name)
                current = None if u is None else u.owner._buffers.get(u.key)
                if u is not None and current is not None:
                    u.tensor, u.version = current, current._version
            self.refresh()

    def is_unwritten(self, name: str) -> bool:
        """Whether buffer ``name`` still holds the zeros ``bind()`` gave it (the version check).

        Example::

            fm.meta_buffers.is_unwritten("rotary.inv_freq")
        """
        u = self._pending.get(name)
        return u is not None and u.tensor._version == u.version

    # -- the check, armed while a buffer is unwritten ---------------------------------------
    def _holds(self, u: _Unwritten) -> bool:
        current = u.owner._buffers.get(u.key)
        held = current is u.tensor or (current is not None and current is u.alias)
        return held and u.tensor._version == u.version

    def _arm(self) -> None:
        if self._pending and not self._hooks:
            self._hooks = [
                self.module.register_forward_pre_hook(self._enter),
                self.module.register_forward_hook(self._leave, always_call=True),
            ]

    def _enter(self, *_: Any) -> None:
        """Before a forward: each unwritten buffer becomes its guarded alias (hooks are
        removed here, never in ``_leave``: torch walks forward hooks live after an error)."""
        if self._in_forward or torch.compiler.is_compiling():
            return
        self.refresh()
        for u in self._pending.values():
            alias = u.tensor.as_subclass(_Guarded)
            alias._ts_guard, alias._ts_name = self, u.name
            u.alias = u.owner._buffers[u.key] = alias
        self._in_forward = bool(self._pending)

    def _leave(self, *_: Any) -> None:
        """After a forward, also one that raised: the plain buffers back (unless forward
        assigned another tensor to the attribute: that is a write)."""
        if not self._in_forward:
            return
        for u in self._pending.values():
            if u.alias is not None and u.owner._buffers.get(u.key) is u.alias:
                u.owner._buffers[u.key] = u.tensor
            u.alias = None
        self._in_forward = False

    def _error(self, name: str, func: Callable[..., Any]) -> UnwrittenBufferError:
        u = self._pending[name]
        how = (
            "load a checkpoint that holds it, write it in the init function (or a "
            "reset_parameters() of its module), "
            if u.persistent
            else "it is non-persistent, so no checkpoint holds it: write it in the init "
            "function (or a reset_parameters() of its module) or by hand, "
        )
        others = [n for n in self.unwritten() if n != name]
        also = f" (also unwritten so far: {others})" if others else ""
        op = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        op = op.replace("TensorBase.", "Tensor.")
        return UnwrittenBufferError(
            f"buffer {name!r} was built on the meta device and forward read it ({op}) before "
            "anything wrote it (init_weights, a checkpoint load, load_state_dict, your code or "
            "forward itself), so it holds zeros instead of the values its module computes at "
            f"construction{also}; {how}or build the model under accelerate.init_empty_weights() "
            "(parameters on meta, buffers real); forward may also write it (copy_, fill_, an "
            "index assignment) before it reads it"
        )


def _tensors(items: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``items``, and in the lists and tuples among them (``torch.cat``)."""
    for a in items:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (b for b in a if isinstance(b, torch.Tensor))


def _unwritten_in(items: Any) -> list[_Guarded]:
    found = []
    for t in _tensors(items):
        guard = t.__dict__.get("_ts_guard") if type(t) is _Guarded else None
        if guard is not None and guard.is_unwritten(t._ts_name):
            found.append(t)
    return found


def _alias_of(t: Any, g: torch.Tensor) -> bool:
    if not isinstance(t, torch.Tensor) or t.device != g.device or t.layout != torch.strided:
        return False
    return t.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()


class _Guarded(torch.Tensor):
    """An alias of an unwritten buffer, seen only inside forward: every op that receives it
    comes here first, to be let through as a write, a view or a metadata query, or refused."""

    _ts_guard: MetaBuffers
    _ts_name: str

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        name = getattr(func, "__name__", "")
        with torch._C.DisableTorchFunctionSubclass():
            if name in _WRITES or getattr(func, "__module__", None) == "torch.nn.init":
                read = _unwritten_in(args[1:]) + _unwritten_in(kwargs.values())
                mutates = True
            elif "out" in kwargs:
                rest = [v for k, v in kwargs.items() if k != "out"]
                read, mutates = _unwritten_in(args) + _unwritten_in(rest), True
            elif name in _SELF_ONLY:
                read, mutates = _unwritten_in(args[:1]), False
            else:
                read = _unwritten_in(args) + _unwritten_in(kwargs.values())
                mutates = name in _IN_PLACE_DUNDERS or (
                    name.endswith("_") and not name.startswith("__")
                )
            if not read or name in _METADATA:
                return func(*args, **kwargs)
            g = read[0]
            if mutates:  # refused before it runs: the buffer keeps its version
                raise g._ts_guard._error(g._ts_name, func)
            out = func(*args, **kwargs)
            if name == "__get__" and not isinstance(out, torch.Tensor):
                return out  # a property: shape, dtype, device, ...
            views = out if isinstance(out, (list, tuple)) else (out,)
            if views and all(_alias_of(v, g) for v in views):
                guarded = [_guard(v, g) for v in views]
                return type(out)(guarded) if isinstance(out, (list, tuple)) else guarded[0]
            raise g._ts_guard._error(g._ts_name, func)


def _guard(view: torch.Tensor, like: _Guarded) -> torch.Tensor:
    """``view`` guarded as the buffer ``like`` is (it may already be that same object)."""
    if type(view) is _Guarded:
        return view
    out = view.as_subclass(_Guarded)
    out._ts_guard, out._ts_name = like._ts_guard, like._ts_name
    return out
