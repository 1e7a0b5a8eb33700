"""The library logs through ``logging``: below WARNING only rank 0 by default, never a handler."""

from __future__ import annotations

import logging

import pytest
import torch
from multiprocess import run_distributed
from torch import nn

import torchshard


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _trainer_logs(all_ranks: bool) -> list[tuple[str, str]]:
    if all_ranks:
        torchshard.set_log_ranks("all")
    handler = _Records()
    root = logging.getLogger("torchshard")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with torch.device("meta"):
            model = nn.Linear(4, 4)
        trainer = torchshard.DistributedTrainer(torchshard.FlatParamModule(model))
        logging.getLogger("torchshard._parallel.trainer").warning("a warning from every rank")
        trainer.close()
    finally:
        root.removeHandler(handler)
        torchshard.set_log_ranks([0])
    return [(r.levelname, r.getMessage()) for r in handler.records]


@pytest.mark.parametrize("all_ranks", [False, True])
def test_info_from_rank_0_only_unless_asked_warnings_from_every_rank(all_ranks):
    logs = run_distributed(_trainer_logs, 2, all_ranks, timeout=60)
    for rank, records in enumerate(logs):
        infos = [m for level, m in records if level == "INFO"]
        warnings = [m for level, m in records if level == "WARNING"]
        assert warnings == ["a warning from every rank"]
        if rank == 0 or all_ranks:
            assert any(f"rank {rank} of 2" in m for m in infos), records
        else:
            assert infos == [], records


def test_set_log_ranks_rejects_bad_values():
    with pytest.raises(ValueError, match="ranks"):
        torchshard.set_log_ranks("none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        torchshard.set_log_ranks([-1])


def test_the_library_adds_no_handlers():
    import torchshard.checkpoint  # noqa: F401  (every module imported)

    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.startswith("torchshard") and isinstance(logger, logging.Logger):
            assert logger.handlers == [], name
