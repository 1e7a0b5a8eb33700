"""Hugging Face transformers models: their declared ties, their own initialization, their config.

Duck-typed on what ``transformers.PreTrainedModel`` provides, so torchshard
never imports transformers (an optional dependency, the ``hf`` extra).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._log import get_logger

__all__ = [
    "clear_init_flags",
    "fp32_patterns",
    "init_transformers_model",
    "is_transformers_model",
    "keep_in_fp32",
    "model_dtype",
    "restore_declared_ties",
    "transformers_config",
]

logger = get_logger(__name__)

# transformers 5 marks modules and tensors it has initialized (or that
# accelerate.init_empty_weights() built) and skips them in initialize_weights().
_FLAG = "_is_hf_initialized"


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    return (
        any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)
        and callable(getattr(module, "_init_weights", None))
        and hasattr(module, "config")
    )


def restore_declared_ties(model: nn.Module) -> list[tuple[str, str]]:
    """Tie the parameters a transformers model declares tied but that are separate objects.

    Building under ``accelerate.init_empty_weights()`` gives every parameter
    its own meta tensor, so ``lm_head.weight`` is no longer
    ``embed_tokens.weight``. This calls the model's own ``tie_weights()`` (it
    reads the config, e.g. ``tie_word_embeddings``) when a declared tie is
    broken, and returns the ``(target, source)`` pairs it restored.
    """
    broken = [
        (t, s)
        for t, s in _declared_ties(model).items()
        if _get(model, t) is not None
        and _get(model, s) is not None  # a pipeline stage may hold one end only
        and _get(model, t) is not _get(model, s)
    ]
    if not broken:
        return []
    for target, source in broken:
        a, b = _get(model, target), _get(model, source)
        real = a is not None and b is not None and not a.is_meta and not b.is_meta
        if real and (a.shape != b.shape or not torch.equal(a, b)):  # type: ignore[union-attr]
            logger.warning(
                "%s: declared tied to %s by the model's config but holds other values; "
                "tying keeps %s's (set tie_word_embeddings=False in the config to keep both)",
                target,
                source,
                source,
            )
    model.tie_weights()  # type: ignore[operator]
    restored = [(t, s) for t, s in broken if _get(model, t) is _get(model, s)]
    if restored:
        logger.info(
            "restored the model's declared ties: %s",
            ", ".join(f"{t} -> {s}" for t, s in restored),
        )
    return restored


def _declared_ties(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` parameter names the model declares tied (transformers 5), else empty."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if not callable(expand) or not callable(getattr(model, "tie_weights", None)):
        return {}
    try:
        ties = expand(all_submodels=True)
    except Exception as e:  # a custom model whose declaration does not resolve
        logger.warning("could not read the model's declared ties: %s", e)
        return {}
    return {str(t): str(s) for t, s in (ties or {}).items()}


def _get(model: nn.Module, name: str) -> torch.Tensor | None:
    prefix, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        return None
    return owner._parameters.get(attr)


def model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype most of ``model``'s floating point parameter elements have (the dtype it
    was built or loaded in, beside what it keeps in fp32); ``None`` without any.

    Example::

        model_dtype(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))  # bf16
    """
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.dtype.is_floating_point:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def _names(declared: Any) -> list[str]:
    """A ``_keep_in_fp32_modules`` declaration as a list (``None`` or anything else: none)."""
    return [str(n) for n in declared] if isinstance(declared, (list, tuple, set)) else []


def fp32_patterns(model: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The name patterns of what transformers keeps in fp32 when it loads ``model`` (a
    transformers model) in ``dtype``: ``from_pretrained``'s dtype plan. transformers 5:
    ``_keep_in_fp32_modules_strict`` for fp16 and bf16, ``_keep_in_fp32_modules`` for fp16
    only; the model's own ``_get_dtype_plan`` when it has one.

    Example::

        fp32_patterns(model, torch.bfloat16)   # ("e_score_correction_bias", "gate.weight")
    """
    plan = getattr(model, "_get_dtype_plan", None)
    if callable(plan):
        try:
            return tuple(str(k) for k, v in plan(dtype).items() if v == torch.float32)
        except Exception as e:  # a transformers whose private helper changed: the rule below
            logger.debug("%s._get_dtype_plan(%s) failed: %s", type(model).__name__, dtype, e)
    out = []
    if dtype in (torch.float16, torch.bfloat16):
        out += _names(getattr(model, "_keep_in_fp32_modules_strict", None))
    if dtype == torch.float16:
        out += _names(getattr(model, "_keep_in_fp32_modules", None))
    return tuple(dict.fromkeys(out))


def keep_in_fp32(module: nn.Module) -> list[str]:
    """Cast to fp32 the parameters on meta that transformers would keep in fp32: for each
    (outermost) transformers model in ``module``, those whose names match its
    :func:`fp32_patterns` at its :func:`model_dtype`. Returns their names in ``module``.

    ``from_pretrained(path, dtype=...)`` applies that plan as it loads; ``from_config`` (the
    way to build on meta) does not, so a model built on meta would otherwise hold those
    parameters in the lower precision, and its layout would differ from that of the same
    model loaded with ``from_pretrained`` (on rank 0, say). Parameters with values are left
    as they are (``from_pretrained`` already applied the plan to them); on meta there are no
    values, so this only decides the dtype they will be allocated in. Names match as in
    transformers: each pattern, ``*`` a wildcard, searched for (``re.search``) in the name.

    Example::

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
        keep_in_fp32(model)   # e.g. ["model.norm.weight", ...] for _keep_in_fp32_modules
    """
    cast: list[str] = []
    seen: list[str] = []
    for prefix, m in module.named_modules():
        if not is_transformers_model(m) or any(_under(prefix, s) for s in seen):
            continue
        seen.append(prefix)
        dtype = model_dtype(m)
        patterns = fp32_patterns(m, dtype) if dtype not in (None, torch.float32) else ()
        if not patterns:
            continue
        found = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
        for name, p in m.named_parameters():
            if p.is_meta and p.dtype != torch.float32 and found.search(name):
                p.data = p.data.to(torch.float32)  # the same Parameter: ties stay
                cast.append(f"{prefix}.{name}" if prefix else name)
    if cast:
        shown = ", ".join(cast[:4]) + (f" and {len(cast) - 4} more" if len(cast) > 4 else "")
        logger.info("kept in fp32 as transformers loads them: %s", shown)
    return cast


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def clear_init_flags(model: nn.Module) -> None:
    """Forget transformers' "already initialized" marks, so its initializers write every tensor."""
    for m in model.modules():
        m.__dict__.pop(_FLAG, None)
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                t.__dict__.pop(_FLAG, None)


def init_transformers_model(model: nn.Module, whole: Callable[..., None] | None = None) -> None:
    """Initialize every parameter and buffer of a bound transformers model its own way.

    ``initialize_weights()`` applies the model's ``_init_weights`` to every
    submodule (composite models dispatch to each sub-model's own), including
    rotary embeddings' ``inv_freq``. It skips what transformers marked as
    initialized: clear the marks first (:func:`clear_init_flags`). ``whole(m, fn)`` runs
    ``fn(m)`` with ``m``'s tensor-parallel pieces whole (each model's ``_init_weights``).
    """
    if whole is not None:
        patched = [m for m in model.modules() if callable(getattr(m, "_init_weights", None))]
        for m in patched:
            m._init_weights = functools.partial(_whole_call, whole, m._init_weights)
        try:
            init_transformers_model(model)
        finally:
            for m in patched:
                del m._init_weights
        return
    init = getattr(model, "initialize_weights", None)
    if callable(init):
        init()
    else:  # transformers 4: the same walk by hand
        model.apply(model._init_weights)  # type: ignore[operator]


def _whole_call(whole: Callable[..., None], init: Callable[..., None], m: nn.Module) -> None:
    whole(m, init)


def init_peft_adapters(model: nn.Module) -> int:
    """Initialize a PEFT model's LoRA adapters PEFT's own way (by default ``lora_B`` zeros,
    so a new adapter leaves the base model's output unchanged); the base model's init
    (transformers') wrote them as plain ``nn.Linear`` layers. The number of layers reset.

    Example::

        init_peft_adapters(peft_model)   # after the base model was initialized
    """
    configs = next((m.peft_config for m in model.modules() if hasattr(m, "peft_config")), None)
    if not isinstance(configs, dict):
        return 0
    reset = 0
    for m in model.modules():
        adapters = getattr(m, "lora_A", None)
        if callable(getattr(m, "reset_lora_parameters", None)) and isinstance(
            adapters, nn.ModuleDict
        ):
            for name in adapters:
                config = configs.get(name)
                if config is not None:
                    m.reset_lora_parameters(name, getattr(config, "init_lora_weights", True))
                    reset += 1
    return reset


def transformers_config(model: nn.Module, dtype: torch.dtype) -> dict[str, Any] | None:
    """The model's config as ``save_pretrained`` writes it (``config.json``), or ``None``.

    ``dtype`` is the weights' (written as the config's ``dtype``); a mixed layout's buffer
    dtype (bytes) stands for the model's own: :func:`model_dtype`, what fp32 modules aside
    it was built in, which ``from_pretrained`` then loads it in.

    Example::

        transformers_config(fm.module, fm.dtype)["architectures"]   # ["LlamaForCausalLM"]
    """
    if not is_transformers_model(model):
        return None
    if not (dtype.is_floating_point or dtype.is_complex):
        dtype = model_dtype(model) or torch.float32
    config = model.config
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    d = to_dict()
    d["architectures"] = [type(model).__name__]
    key = "dtype" if "dtype" in d or "torch_dtype" not in d else "torch_dtype"
    d[key] = str(dtype).removeprefix("torch.")
    return json.loads(json.dumps(d, default=str))  # plain JSON values only
