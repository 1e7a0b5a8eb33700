"""FlatParamModule: every parameter of a module is a view into one flat buffer."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._errors import BindError, TorchShardError
from .._log import get_logger
from .._stepped import watch as watch_optimizers
from .hf import (
    clear_init_flags,
    init_peft_adapters,
    init_transformers_model,
    is_transformers_model,
    keep_in_fp32,
    restore_declared_ties,
)
from .layout import FlatLayout, ParamSlot
from .meta import MetaBuffers
from .tp import TensorParallel, make_tp
from .views import (
    Owners,
    install_grad_hooks,
    overlaps,
    swap_in,
    warn_if_still_held,
    zero_gaps,
)

__all__ = ["FlatParamModule"]

logger = get_logger(__name__)


class FlatParamModule(nn.Module):
    """Wrap ``module`` so that its parameters become views into one flat buffer.

    Construction only computes the :class:`FlatLayout` (it works on modules
    built under ``torch.device("meta")`` and allocates nothing);
    :meth:`bind` supplies the buffer. Gradients land in one flat gradient
    buffer, also across ``optimizer.zero_grad()``.

    Args:
        module: the model; its parameters may live on meta, CPU or CUDA.
        dtype: cast every parameter to this dtype (default: their common dtype).
        align_bytes: every parameter's offset is a multiple of this many bytes.
        tp_plan: tensor parallelism: ``{module glob: style}`` (``"colwise"``, ``"rowwise"``,
            ``"colwise_gather_output"``, ``"packed_colwise"``, ``"embedding_rowwise"``) or
            ``"auto"`` (a transformers model's own plan); each split parameter becomes this
            rank's piece, and the layout lays out the pieces (:attr:`tp`; the whole model's
            layout is ``fm.tp.whole``). Parameters no glob names are replicated.
        mesh: with ``tp_plan``: the :class:`Mesh` (``init_mesh(tp=T)``) whose ``tp`` group
            the plan splits over.
        tp_init: how :meth:`init_weights` (and a trainer's meta init) initializes split
            parameters: ``"whole"`` (default) runs each module's init on its whole parameters,
            one module at a time, and keeps this rank's slices: bitwise the one-process
            init; ``"local"`` runs it on the pieces (faster, no whole tensor; other values,
            and a fan-in-scaled init sees the piece's fan-in).

    Names: :meth:`state_dict` and :meth:`load_state_dict` use the wrapped model's own
    keys (``"0.weight"``), also when a parent module or ``torch.compile(fm)`` saves and
    loads ``fm`` (``"fm.0.weight"``). ``named_parameters()``, ``named_buffers()`` and
    ``named_modules()`` are nn.Module's: they name through the wrapper
    (``"module.0.weight"``), since their names are attribute paths that torch resolves
    with ``getattr`` through the submodules (``fm.get_parameter(name)``,
    ``torch.func.functional_call(fm, dict(fm.named_parameters()), x)``,
    ``torch.export``), and there the model is ``fm.module``: without the prefix those
    break. ``fm.module.named_parameters()`` (and ``named_buffers()``,
    ``named_modules()``) give the plain model's names, the ``state_dict()`` keys; a
    tied weight under its first name, as in the plain model.

    Example::

        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        fm = FlatParamModule(model)
        fm.bind(torch.empty(fm.numel))      # parameters are now views of this buffer
        fm.init_weights()                   # each submodule's reset_parameters()
        fm(torch.randn(4, 8)).sum().backward()
        fm.flat_grad                        # every gradient, in one tensor
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        align_bytes: int = 16,
        tp_plan: dict[str, str] | str | None = None,
        mesh: Any = None,
        tp_init: str = "whole",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TorchShardError(f"module: expected an nn.Module, got {type(module).__name__}")
        super().__init__()
        if is_transformers_model(module):
            # accelerate.init_empty_weights() unties e.g. lm_head.weight from the embedding.
            restore_declared_ties(module)
        if dtype is None:
            # what transformers keeps in fp32 as it loads (from_config on meta does not)
            keep_in_fp32(module)
        self.module = module
        self.tp: TensorParallel | None = make_tp(module, tp_plan, mesh, dtype, align_bytes, tp_init)
        """Tensor parallelism (``tp_plan=``): the tp group, the plan, each slot's split."""
        self.layout: FlatLayout = FlatLayout.from_module(
            module, dtype=dtype, align_bytes=align_bytes
        )
        self._flat: torch.Tensor | None = None
        self._grad: torch.Tensor | None = None
        self._meta = MetaBuffers(module)  # buffers built on meta that nothing wrote yet
        # Who hears that a parameter's gradient is ready: [WeakMethod of callable(slot) or
        # None]. The one per-parameter hook calls it (a trainer sets it: _set_grad_listener).
        self._grad_listener: list[weakref.WeakMethod | None] = [None]
        # Before any parameter a trainer adopts exists: an optimizer over them cannot step
        # unseen, so trainer.memory_bytes() can count it (torchshard/_stepped.py).
        watch_optimizers()

    # -- properties -------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Elements a flat buffer needs (parameters plus alignment padding)."""
        return self.layout.numel

    @property
    def dtype(self) -> torch.dtype:
        """The flat buffers' dtype: the parameters', or ``torch.uint8`` (bytes) when they
        have several (:attr:`dtypes`)."""
        return self.layout.torch_dtype

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The parameters' dtypes, each once, in layout order.

        Example::

            fm.dtypes   # (torch.bfloat16, torch.float32): fm.dtype is then torch.uint8
        """
        return self.layout.dtypes

    @property
    def device(self) -> torch.device:
        """The flat buffer's device, or before :meth:`bind` that of the module's parameters."""
        if self._flat is not None:
            return self._flat.device
        return next(self.module.parameters()).device

    @property
    def flat_param(self) -> torch.Tensor | None:
        """The bound parameter buffer (``None`` before :meth:`bind`)."""
        return self._flat

    @property
    def flat_grad(self) -> torch.Tensor | None:
        """The flat gradient buffer (``None`` before :meth:`bind` or when nothing trains):
        the trainable parameters' gradients alone, laid out by :attr:`FlatLayout.grad_layout`
        (``grad_numel`` elements; the same offsets as the weights when every parameter
        trains). Frozen parameters take no room in it.

        A region whose parameter shows ``.grad is None`` holds stale values.
        """
        return self._grad

    @property
    def grad_numel(self) -> int:
        """Elements a gradient buffer needs: the trainable parameters plus alignment.

        Example::

            fm.grad_numel * fm.dtype.itemsize   # bytes of gradient; 0 when everything is frozen

        With parameters of several dtypes the buffers are bytes and so is this.
        """
        return self.layout.grad_layout.numel

    @property
    def is_bound(self) -> bool:
        return self._flat is not None

    @property
    def meta_buffers(self) -> MetaBuffers:
        """The buffers built on meta that nothing has written since :meth:`bind` made them
        zeros; a forward that reads one raises, naming it (:class:`MetaBuffers`).

        Example::

            fm.meta_buffers.unwritten()          # ['rotary.inv_freq'] until something writes it
        """
        return self._meta

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # -- binding ------------------------------------------------------------------
    def bind(self, flat: torch.Tensor, grad: torch.Tensor | None = None) -> FlatParamModule:
        """Make every parameter a view into ``flat`` and every gradient a view into ``grad``.

        Real weights are copied in one parameter at a time and the old
        parameter is dropped right away, so its memory is released as the
        copy proceeds (if nothing else holds it, e.g. an optimizer, and the
        allocator returns it: on Linux glibc returns blocks over its mmap
        threshold, at most 32 MiB; ``MALLOC_MMAP_THRESHOLD_=131072`` makes
        that hold for smaller parameters too). Binding
        again to another buffer moves the model there; gradients come along.
        Module buffers move to ``flat``'s device (meta ones become zeros).

        Args:
            flat: 1-D contiguous tensor of ``self.dtype`` with at least ``self.numel`` elements.
            grad: optional gradient buffer of at least ``grad_numel`` elements (the
                trainable parameters' gradients, :attr:`flat_grad`), on ``flat``'s device and
                not overlapping it; allocated when omitted and any parameter trains; its
                padding is zeros.

        Example::

            fm.bind(torch.empty(fm.numel, dtype=fm.dtype, device="cuda"))
        """
        return self._bind(flat, grad, copy=True)

    def _bind(
        self, flat: torch.Tensor, grad: torch.Tensor | None, *, copy: bool
    ) -> FlatParamModule:
        # copy=False: flat and grad already hold the values in this layout (a
        # whole-buffer move by _apply); only the views are rebuilt.
        self._check_buffer("flat", flat)
        trains = any(s.requires_grad for s in self.layout)
        grad_layout = self.layout.grad_layout
        if grad is not None:
            self._check_buffer("grad", grad, grad_layout.numel)
            if grad.device != flat.device:
                raise BindError(
                    f"grad: expected a buffer on {flat.device} like flat, got one on {grad.device}"
                )
            if overlaps(flat, grad):
                raise BindError("grad: the gradient buffer overlaps the parameter buffer")
        elif trains:
            # Left unfaulted: a parameter's region is written when its first
            # gradient arrives, so host memory grows only as gradients are touched.
            grad = torch.empty(grad_layout.numel, dtype=self.dtype, device=flat.device)
            zero_gaps(grad, grad_layout)

        replaced: list[tuple[str, weakref.ref[torch.Tensor], int]] = []
        in_grad = dict(zip(self.layout.trainable, grad_layout.slots))

        def take_over(index: int, slot: ParamSlot, old: torch.Tensor, new: nn.Parameter) -> None:
            if copy and old.device.type != "meta":
                new.copy_(old)
                replaced.append((slot.name, weakref.ref(old), old.nbytes))
            if slot.requires_grad:
                assert grad is not None
                gview = in_grad[index].view(grad)
                if old.grad is not None:
                    if copy:
                        gview.copy_(old.grad)
                    new.grad = gview
                install_grad_hooks(new, gview, index, self._grad_listener)

        swap_in(self.module, self.layout, lambda _, s: s.view(flat), take_over)
        warn_if_still_held(replaced)
        self._materialize_buffers(flat.device)
        self._flat, self._grad = flat, grad if trains else None
        return self

    def _materialize_buffers(self, device: torch.device) -> None:
        """Move module buffers to ``device``; ones built on meta become zeros, which a
        forward may not read before something writes them (:attr:`meta_buffers`)."""
        self._meta.materialize(device)

    def _detach_buffers(self) -> None:
        """Forget the flat buffers: a fully sharded trainer made the parameters views of its
        unit buffers instead (``flat_param`` is then ``None``)."""
        self._flat = self._grad = None

    def _set_grad_listener(self, listener: Callable[[int], None] | None) -> None:
        """Have the per-parameter gradient hook call ``listener(slot)`` (``None``: nobody).

        ``listener`` is a bound method, held weakly: its object's owner keeps it alive."""
        current = self._grad_listener[0]
        if listener is not None and current is not None and current() is not None:
            raise TorchShardError(
                "this FlatParamModule already has a DistributedTrainer; close() it before "
                "creating another one for the same module"
            )
        self._grad_listener[0] = None if listener is None else weakref.WeakMethod(listener)

    def _check_buffer(self, what: str, t: torch.Tensor, numel: int | None = None) -> None:
        numel = self.numel if numel is None else numel
        attr = "fm.numel" if numel == self.numel else "fm.grad_numel"
        if not isinstance(t, torch.Tensor):
            raise BindError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or not t.is_contiguous():
            raise BindError(
                f"{what}: expected a contiguous 1-D tensor, got shape {tuple(t.shape)}; "
                f"allocate it as torch.empty({numel}, dtype={self.dtype})"
            )
        if t.dtype != self.dtype:
            raise BindError(
                f"{what}: expected dtype {self.dtype}, got {t.dtype}; "
                "allocate it with dtype=fm.dtype or wrap with FlatParamModule(..., dtype=...)"
            )
        if t.numel() < numel:
            raise BindError(f"{what}: expected at least {numel} elements ({attr}), got {t.numel()}")
        if t.device.type == "meta":
            raise BindError(f"{what}: expected a buffer with storage, got one on the meta device")

    # -- initialization -----------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, fn: Callable[[nn.Module], None] | None = None) -> FlatParamModule:
        """Initialize the bound weights (and buffers built on meta) in place.

        By default each part of the model is initialized its own way: a
        transformers model (``PreTrainedModel``, also nested in another
        module) by its ``initialize_weights()``, i.e. its ``_init_weights``
        for every submodule, including rotary ``inv_freq`` buffers; every
        other submodule by its ``reset_parameters()`` when it has one (this
        also resets e.g. BatchNorm running statistics); a PEFT model's LoRA
        adapters then PEFT's way (``lora_B`` zeros by default). With ``fn``, applies
        it to every submodule like ``nn.Module.apply`` (the convention of
        transformers' ``_init_weights``). ``fn`` must write in place;
        replacing a parameter raises :class:`TorchShardError`. A buffer built
        on meta that nothing writes (not this, nor a checkpoint load, nor the
        user, nor forward before it reads it) raises
        :class:`~torchshard.UnwrittenBufferError` when forward reads it, naming
        it: its zeros would be silently wrong (e.g. rotary frequencies, a
        causal mask). A buffer forward never reads, or writes first, trains.

        Example::

            fm.init_weights(lambda m: isinstance(m, nn.Linear) and nn.init.zeros_(m.bias))
        """
        self._require_bound("init_weights()")
        clear_init_flags(self.module)  # transformers skips tensors it marked as initialized
        tp = self.tp
        if fn is not None:
            self.module.apply(fn if tp is None else lambda m: tp.whole_init(m, fn))
        else:
            _init_own_way(self.module, whole=tp.whole_init if tp is not None else None)
            init_peft_adapters(self.module)  # after the base model's init wrote them
        self.check_views()
        self._meta.refresh()  # every buffer written: no check is left
        return self

    def unwritten_buffers(self) -> list[str]:
        """Buffers built on meta that nothing wrote since :meth:`bind` made them zeros.

        Example::

            assert fm.unwritten_buffers() == []  # every buffer holds its value
        """
        return self._meta.unwritten()

    def check_views(self) -> None:
        """Raise :class:`TorchShardError` naming a parameter that is no longer a view of the buffer."""
        self._require_bound("check_views()")
        assert self._flat is not None
        owners = Owners(self.module)
        base = self._flat.data_ptr()
        for slot in self.layout:
            expected = base + slot.offset * self._flat.element_size()
            for name in slot.names:
                p = owners.get(name)
                if (
                    not isinstance(p, nn.Parameter)
                    or p.data_ptr() != expected
                    or p.shape != slot.shape
                ):
                    raise TorchShardError(
                        f"parameter {name!r} is no longer a view of the flat buffer "
                        "(was it replaced, e.g. by assigning a new nn.Parameter?); "
                        "write into parameters in place instead"
                    )

    def _require_bound(self, what: str) -> None:
        if self._flat is None:
            raise TorchShardError(
                f"{what}: the module is not bound to a buffer yet; call "
                f"fm.bind(torch.empty(fm.numel, dtype={self.dtype})) first"
            )

    # -- state dict: the wrapped module's own keys ------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict (its own keys, no ``module.`` prefix); with
        tensor parallelism, this rank's pieces (whole tensors: ``torchshard.checkpoint``)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Copy a plain model's state dict into the views (never rebinds). With tensor
        parallelism a whole tensor of a split parameter (e.g. pretrained weights) gives
        this rank its piece; a piece's shape is taken as it is."""
        if assign:
            raise TorchShardError(
                "load_state_dict(assign=True) would replace the views into the flat buffer; "
                "use the default assign=False"
            )
        if any(p.device.type == "meta" for p in self.module.parameters()):
            self._require_bound("load_state_dict()")
        if self.tp is not None:
            state_dict = self.tp.localize(state_dict)
        return self.module.load_state_dict(state_dict, strict=strict)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A parent's load_state_dict (or torch.compile's wrapper's) reaches the model through
        # _modules, as "module": give the model's own keys, which state_dict() wrote, that
        # prefix. The children read state_dict after this returns.
        if local_metadata.get("assign_to_params_buffers"):
            raise TorchShardError(
                "load_state_dict(assign=True) would replace the views into the flat buffer; "
                "use the default assign=False"
            )
        own = set(self.module.state_dict(keep_vars=True))
        renamed = {}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if key[len(prefix) :] in own:
                renamed[f"{prefix}module.{key[len(prefix) :]}"] = state_dict.pop(key)
        state_dict.update(renamed)  # after every pop: a new key may be an old one's name
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    # -- .to(), .cuda(), .half(), .to_empty(), ...: keep the invariant -------------------
    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> FlatParamModule:  # type: ignore[override]
        # Every conversion goes through _apply. Apply it to the whole buffer and
        # rebind, instead of letting nn.Module replace each parameter.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        if probe.device.type == "meta":
            raise TorchShardError(
                "cannot move a FlatParamModule to the meta device; build the model on meta "
                "and wrap it instead"
            )
        # what the conversion makes of each parameter dtype (a mixed buffer is bytes, which
        # dtype conversions leave alone)
        cast = {d: fn(torch.empty(0, dtype=d, device=probe.device)).dtype for d in self.dtypes}
        if any(k != v for k, v in cast.items()):
            targets = set(cast.values())
            if len(targets) > 1 or not all(d.is_floating_point or d.is_complex for d in targets):
                raise TorchShardError(
                    f"cannot convert the parameters to {sorted(map(str, targets))}: "
                    "parameters stay floating point, and a conversion casts them all to one"
                )
            self.layout = FlatLayout.from_module(
                self.module, dtype=targets.pop(), align_bytes=self.layout.align_bytes
            )
            self._flat = self._grad = None  # the old buffers no longer match the layout
        if self._flat is not None:
            # Same layout: move or convert the whole buffers at once (one copy,
            # or none for in-place functions like share_memory_) and rebuild the views.
            new_flat = fn(self._flat)
            new_grad = fn(self._grad) if self._grad is not None else None
            if new_flat is not self._flat or new_grad is not self._grad:
                self._bind(new_flat, new_grad, copy=False)
        else:
            self.bind(torch.empty(self.numel, dtype=self.dtype, device=probe.device))
        for m in self.module.modules():
            for key, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[key] = fn(buf)
                    self._meta.follow(m, key, buf, m._buffers[key])  # still unwritten
        return self

    def named_flat_views(self) -> Iterator[tuple[ParamSlot, torch.Tensor]]:
        """Each slot with its parameter view (for code that walks the buffer by parameter)."""
        self._require_bound("named_flat_views()")
        owners = Owners(self.module)
        for slot in self.layout:
            yield slot, owners.get(slot.name)


def _init_own_way(
    module: nn.Module, seen: set[int] | None = None, whole: Callable[..., None] | None = None
) -> None:
    """Pre-order, each module once: a transformers model initializes its whole subtree,
    any other module with ``reset_parameters()`` resets itself. ``whole(m, fn)``: runs
    ``fn(m)`` with ``m``'s split parameters whole (tensor parallelism)."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    if is_transformers_model(module):
        init_transformers_model(module, whole)
        return
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset() if whole is None else whole(module, lambda m: m.reset_parameters())
    for child in module.children():
        _init_own_way(child, seen, whole)
