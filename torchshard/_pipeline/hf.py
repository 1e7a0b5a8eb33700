"""A stage forward for transformers decoders (Llama-like: ``model.embed_tokens``,
``model.layers``, ``model.rotary_emb``, ``model.norm``, ``lm_head``), whose own forward
slices its layer list and needs every module: a pruned stage runs this instead. Duck-typed,
transformers is imported only when a stage runs."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import PipelineError
from .._flat.hf import is_transformers_model

__all__ = ["hf_stage_forward", "is_hf_decoder", "set_stage_forward", "stage_forward_for"]

StageForward = Callable[..., Any]


def _base(model: nn.Module) -> nn.Module | None:
    """The decoder inside a ``...ForCausalLM`` (its ``base_model_prefix``), or the model."""
    prefix = getattr(model, "base_model_prefix", "")
    return getattr(model, prefix, None) if prefix and hasattr(model, prefix) else model


def is_hf_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers decoder :func:`hf_stage_forward` can run."""
    base = _base(model)
    return (
        is_transformers_model(model)
        and base is not None
        and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
    )


def hf_stage_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One pipeline stage of a transformers decoder (a pruned copy, :func:`split_stages`):
    token ids in on the stage with ``embed_tokens``, hidden states in elsewhere; the rotary
    position embeddings and the causal mask as the model's own forward builds them (no
    cache, no padding mask); the stage's layers; ``norm`` and ``lm_head`` where the stage
    has them. Returns the hidden states, the last stage the logits.

    Example::

        pipe = torchshard.Pipeline(llama, pp=2, microbatches=4, loss_fn=loss_fn,
                                   stage_forward=torchshard.hf_stage_forward)
    """
    base = _base(model)
    if base is not None:
        if base.embed_tokens is not None:
            x = base.embed_tokens(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = _causal_mask(base.config, x, position_ids)
        rope = base.rotary_emb(x, position_ids=position_ids)
        for layer in base.layers:
            x = layer(x, attention_mask=mask, position_embeddings=rope, position_ids=position_ids)
        if base.norm is not None:
            x = base.norm(x)
    head = getattr(model, "lm_head", None) if base is not model else None
    return head(x) if head is not None else x


def _causal_mask(config: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """transformers' own causal mask for ``config``'s attention (``None`` where sdpa's
    ``is_causal`` does it), as the model's forward makes it without a cache."""
    from transformers.masking_utils import create_causal_mask

    cache = "cache" if "cache" in _params(create_causal_mask) else "past_key_values"
    kw = {"config": config, "inputs_embeds": x, "attention_mask": None, cache: None}
    return create_causal_mask(**kw, position_ids=position_ids)


@functools.cache
def _params(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def stage_forward_for(model: nn.Module, given: StageForward | None) -> StageForward | None:
    """The stage forward a pipeline runs: ``given``, else :func:`hf_stage_forward` for a
    transformers decoder, else ``None`` (the model's own forward)."""
    if given is not None:
        if not callable(given):
            raise PipelineError(
                f"stage_forward: expected a callable (stage_module, *inputs) -> output, "
                f"got {type(given).__name__}"
            )
        return given
    return hf_stage_forward if is_hf_decoder(model) else None


def set_stage_forward(module: nn.Module, fn: StageForward) -> None:
    """Have ``module`` run ``fn(module, *inputs)`` as its forward (hooks still run)."""
    module.forward = functools.partial(fn, module)  # type: ignore[method-assign]
