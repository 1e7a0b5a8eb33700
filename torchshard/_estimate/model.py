"""Models built on the meta device for the estimate: from a transformers config or a factory.

Nothing here allocates weights or downloads: configs come from local files or
transformers' own defaults, and a factory runs under ``torch.device("meta")``.
"""

from __future__ import annotations

import difflib
import importlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._errors import TorchShardError
from .._flat.hf import keep_in_fp32
from .._flat.layout import FlatLayout
from .._flat.module import FlatParamModule
from .._log import get_logger

__all__ = [
    "EstimateError",
    "build_factory",
    "build_hf_model",
    "is_factory",
    "layout_of",
]

logger = get_logger(__name__)

_HF_HINT = "pip install transformers accelerate (or pip install -e '.[hf]' in a clone)"


class EstimateError(TorchShardError, ValueError):
    """A bad input to the estimator: model, override, size, world size or missing extra."""


def is_factory(spec: str) -> bool:
    """``module:callable`` (and not an existing file whose name happens to hold a colon).

    Example::

        is_factory("gpt:gpt_small")   # True
    """
    return ":" in spec and not Path(spec).exists()


def build_factory(spec: str) -> nn.Module:
    """Build ``module:callable`` on the meta device (no weights are allocated).

    Example::

        model = build_factory("gpt:gpt_small")   # gpt.py in the working directory
    """
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise TorchShardError(f"factory: expected 'module:callable', got {spec!r}")
    if "" not in sys.path:  # like `python -m`: modules in the working directory import
        sys.path.insert(0, "")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except ImportError as e:
        raise TorchShardError(
            f"factory {spec!r}: {e}; run from the directory that holds {mod_name!r}, "
            "or put that directory on PYTHONPATH"
        ) from e
    except AttributeError as e:
        raise TorchShardError(f"factory {spec!r}: {e}") from e
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:
        raise TorchShardError(f"factory {spec!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise TorchShardError(
            f"factory {spec!r}: expected an nn.Module, got {type(model).__name__}"
        )
    return model


def _import_hf() -> tuple[Any, Any]:
    try:
        import transformers
        from accelerate import init_empty_weights
    except ImportError as e:
        raise EstimateError(
            f"transformers models: expected transformers and accelerate, got {e}; run {_HF_HINT}"
        ) from e
    return transformers, init_empty_weights


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}"


def _read_config(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise EstimateError(f"{path}: expected a transformers config.json, got no such file")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EstimateError(f"{path}: expected a transformers config JSON file, got {e}") from e
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise EstimateError(
            f"{path}: expected a JSON object with a 'model_type' (e.g. \"llama\"), got "
            f"{'no model_type' if isinstance(config, dict) else type(config).__name__}"
        )
    return config


def build_hf_model(
    spec: str, overrides: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """A causal LM built on meta from a config JSON file (or a directory holding config.json)
    or a transformers ``model_type`` with its defaults; ``overrides`` replace config values.

    With ``dtype``, built in it as ``from_config(config, dtype=dtype)`` builds, and what
    transformers keeps in fp32 when it loads the model in that dtype (its
    ``_keep_in_fp32_modules``, what its code creates in fp32) is fp32, as ``from_pretrained``
    would have it (:func:`keep_in_fp32`). Never downloads: configs come from local files or
    transformers' own defaults.

    Example::

        model = build_hf_model("llama", {"num_hidden_layers": 2}, torch.bfloat16)
    """
    overrides = dict(overrides or {})
    path = Path(spec)
    if path.exists():
        values = _read_config(path)
        model_type = values.pop("model_type")
        where = str(path)
    elif spec.endswith(".json") or "/" in spec or "\\" in spec:
        raise EstimateError(f"model {spec!r}: expected a config JSON file, got no such file")
    else:
        model_type, values, where = spec, {}, f"model_type {spec!r}"
    transformers, init_empty_weights = _import_hf()
    if model_type not in transformers.CONFIG_MAPPING:
        known = [k for k in transformers.CONFIG_MAPPING if k == k.lower()]
        close = difflib.get_close_matches(model_type, known, cutoff=0.75)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise EstimateError(
            f"model {spec!r}: expected a config JSON file, a transformers model_type such as "
            f"'llama' or 'gpt2', or 'module:callable', got {model_type!r}, none of these{hint}"
        )
    try:
        base = transformers.AutoConfig.for_model(model_type, **values)
    except Exception as e:
        raise EstimateError(f"{where}: bad config: {_one_line(e)}") from e
    for key in overrides:
        if not hasattr(base, key):
            close = difflib.get_close_matches(key, list(base.to_dict()))
            hint = f"did you mean {close[0]!r}?" if close else "check the name"
            raise EstimateError(
                f"--set {key}: expected an attribute of the {model_type} config, got an "
                f"unknown name; {hint}"
            )
    # Overrides go through the constructor, so derived values (head_dim, ...) follow them.
    try:
        config = transformers.AutoConfig.for_model(model_type, **{**values, **overrides})
    except Exception as e:
        sets = " ".join(f"--set {k}={json.dumps(v)}" for k, v in overrides.items())
        raise EstimateError(f"{where} with {sets}: bad config: {_one_line(e)}") from e
    try:
        with init_empty_weights():
            kw = {} if dtype is None else {_dtype_keyword(transformers): dtype}
            model = transformers.AutoModelForCausalLM.from_config(config, **kw)
    except Exception as e:
        if "Unrecognized configuration class" in str(e):  # not a causal LM
            got = f"{type(config).__name__}, which has no causal LM class"
        else:
            got = _one_line(e)
        raise EstimateError(
            f"{where}: expected a config of a causal LM that builds on meta, got {got}"
        ) from e
    keep_in_fp32(model)
    logger.debug("built %s from %s on meta", type(model).__name__, where)
    return model


def _dtype_keyword(transformers: Any) -> str:
    """``from_config``'s dtype argument: ``dtype`` since transformers 4.56, ``torch_dtype``
    before."""
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def layout_of(model: nn.Module, dtype: torch.dtype | None) -> FlatLayout:
    """The flat layout the trainer would use for ``model`` cast to ``dtype``, or (``None``)
    with each parameter in its own dtype (allocates nothing for a model on meta).

    Example::

        layout = layout_of(build_hf_model("gpt2"), torch.bfloat16)
        mixed = layout_of(build_hf_model("afmoe", dtype=torch.float16), None)  # fp32 norms
    """
    return FlatParamModule(model, dtype=dtype).layout
