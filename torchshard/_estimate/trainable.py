"""Which parameters of the estimated model train: all of them, PEFT LoRA adapters, or those
whose names match regular expressions (the rest frozen).

Frozen parameters cost no gradient, optimizer state or master copy (``layout.grad_layout``
is the gradient space), so what trains changes the estimate by orders of magnitude: Llama-2
7B's bf16 gradient is 12.55 GiB; with LoRA r=16 on ``q_proj`` and ``v_proj``, 16 MiB.
"""

from __future__ import annotations

import difflib
import re
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from .model import EstimateError

__all__ = ["DEFAULT_LORA_TARGETS", "EVERY_PARAMETER", "Trainable"]

DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")  # PEFT's own default for Llama
_PEFT_HINT = "pip install peft"


@dataclass(frozen=True, kw_only=True)
class Trainable:
    """What trains: every parameter (the default); with ``lora_rank``, PEFT LoRA adapters on
    every module whose name ends with one of ``lora_targets`` (the base model frozen); with
    ``patterns``, the parameters whose names match one of them (``re.search``), the rest
    frozen, or, with LoRA, trained besides the adapters.

    Example::

        model = Trainable(lora_rank=16).apply(build_hf_model("llama"))  # a PeftModel
        layout_of(model, torch.bfloat16).grad_layout.numel              # the adapters
    """

    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        rank = self.lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise EstimateError(f"--lora-rank: expected a positive integer, got {rank!r}")
        if not self.lora_targets or not all(t and isinstance(t, str) for t in self.lora_targets):
            raise EstimateError(
                f"--lora-targets: expected module names such as q_proj,v_proj, got "
                f"{','.join(map(str, self.lora_targets))!r}"
            )
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise EstimateError(
                    f"--trainable {p!r}: expected a regular expression, got {e}"
                ) from None

    @property
    def everything(self) -> bool:
        """Whether every parameter trains (no LoRA, no patterns)."""
        return self.lora_rank is None and not self.patterns

    def describe(self) -> str:
        """What trains, in words: ``"LoRA r=16 on q_proj, v_proj; the rest frozen"``."""
        if self.everything:
            return "every parameter"
        parts = []
        if self.lora_rank is not None:
            parts.append(f"LoRA r={self.lora_rank} on {', '.join(self.lora_targets)}")
        if self.patterns:
            parts.append(f"parameters matching {', '.join(map(repr, self.patterns))}")
        return f"{' and '.join(parts)}; the rest frozen"

    def to_dict(self) -> dict[str, Any]:
        """``lora`` (``{"rank", "targets"}`` or ``None``) and ``trainable_patterns``."""
        lora = None
        if self.lora_rank is not None:
            lora = {"rank": self.lora_rank, "targets": list(self.lora_targets)}
        return {"lora": lora, "trainable_patterns": list(self.patterns)}

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` with what trains marked by ``requires_grad``: with LoRA, the PEFT model
        wrapping it (``peft.get_peft_model``, built where ``model`` is: on meta, nothing is
        allocated); else ``model`` itself, changed in place.

        Raises :class:`EstimateError` for a LoRA target that names no module, a pattern
        that matches no parameter, or LoRA without peft installed.
        """
        if self.everything:
            return model
        out = model
        if self.lora_rank is not None:
            out = self._lora(model)
        elif self.patterns:
            model.requires_grad_(False)
        # the names of the model the user named (PEFT's wrapper adds "base_model.model.")
        named = list(model.named_parameters(remove_duplicate=False))
        for pattern in self.patterns:
            found = [p for n, p in named if re.search(pattern, n)]
            if not found:
                raise EstimateError(
                    f"--trainable {pattern!r}: expected a regular expression matching some "
                    f"parameter name (such as {named[0][0]!r}), got no match"
                    if named
                    else f"--trainable {pattern!r}: the model has no parameters"
                )
            for p in found:
                p.requires_grad_(True)
        return out

    def _lora(self, model: nn.Module) -> nn.Module:
        """PEFT's LoRA model over ``model``, every target checked to name a module first."""
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as e:
            raise EstimateError(
                f"--lora-rank: expected peft to build the LoRA adapters, got {e}; run {_PEFT_HINT}"
            ) from e
        names = [n for n, _ in model.named_modules() if n]
        for target in self.lora_targets:
            # PEFT's rule for a list of targets: the module's name, or its last components
            if not any(n == target or n.endswith(f".{target}") for n in names):
                last = sorted({n.rsplit(".", 1)[-1] for n in names})
                close = difflib.get_close_matches(target, last, n=1)
                hint = (
                    f"did you mean {close[0]!r}?" if close else f"module names end with {last[:8]}"
                )
                raise EstimateError(
                    f"--lora-targets {target}: expected the last part of a module's name in "
                    f"{type(model).__name__}, got no module; {hint}"
                )
        config = LoraConfig(r=self.lora_rank, target_modules=list(self.lora_targets))
        try:
            with warnings.catch_warnings():  # deprecations, fan_in_fan_out: noise on meta
                warnings.simplefilter("ignore")
                # the adapters in their base layer's dtype, as the model's dtype casts them
                # (PEFT's default would keep them in fp32 beside a bf16 base)
                return get_peft_model(model, config, autocast_adapter_dtype=False)
        except Exception as e:
            kinds = sorted(
                {
                    type(m).__name__
                    for n, m in model.named_modules()
                    if any(n == t or n.endswith(f".{t}") for t in self.lora_targets)
                }
            )
            text = " ".join(str(e).split())[:120]
            raise EstimateError(
                f"--lora-targets {','.join(self.lora_targets)}: expected layers PEFT's LoRA "
                f"adapts (Linear, Embedding, Conv), got {', '.join(kinds)}; "
                f"PEFT: {type(e).__name__}: {text}"
            ) from e


EVERY_PARAMETER = Trainable()  # the default: nothing frozen by the estimate
