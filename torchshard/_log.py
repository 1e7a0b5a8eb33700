"""The library's loggers: below WARNING, only rank 0 speaks unless told otherwise.

The library adds no handlers and never configures logging; it only filters its
own records, so that N ranks do not print N copies of every message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Literal

import torch.distributed as dist

__all__ = ["get_logger", "set_log_ranks"]

_ranks: frozenset[int] | None = frozenset({0})  # None: every rank


def set_log_ranks(ranks: Iterable[int] | Literal["all"]) -> None:
    """Choose which ranks' torchshard records below WARNING pass (default: rank 0 only).

    Warnings and errors always pass, from every rank. Handlers and levels stay
    the application's: configure them with :mod:`logging` as usual.

    Example::

        logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
        torchshard.set_log_ranks("all")        # or e.g. [0, 7]
    """
    global _ranks
    if ranks == "all":
        _ranks = None
        return
    if isinstance(ranks, str):
        raise ValueError(f"ranks: expected 'all' or an iterable of ranks, got {ranks!r}")
    chosen = frozenset(int(r) for r in ranks)
    if any(r < 0 for r in chosen):
        raise ValueError(f"ranks: expected non-negative ranks, got {sorted(chosen)}")
    _ranks = chosen


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)  # launched, not yet initialized


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or _ranks is None or _rank() in _ranks


_FILTER = _RankFilter()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the rank filter (records are filtered where they are made)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
