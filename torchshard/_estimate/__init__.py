"""``torchshard estimate``: a model built on meta (model.py), its per-rank memory in each
mode (estimate.py), the table (table.py) and the command line (command.py)."""

from .command import parse_bytes, parse_override
from .estimate import (
    DTYPES,
    MAX_WORLD_SIZE,
    NOT_COUNTED,
    OPTIMIZERS,
    MemoryEstimate,
    ModeEstimate,
    estimate_memory,
)
from .model import EstimateError, build_factory, build_hf_model, is_factory, layout_of
from .table import format_estimate
from .trainable import DEFAULT_LORA_TARGETS, Trainable

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "DTYPES",
    "MAX_WORLD_SIZE",
    "NOT_COUNTED",
    "OPTIMIZERS",
    "EstimateError",
    "MemoryEstimate",
    "ModeEstimate",
    "Trainable",
    "build_factory",
    "build_hf_model",
    "estimate_memory",
    "format_estimate",
    "is_factory",
    "layout_of",
    "parse_bytes",
    "parse_override",
]
