"""How a trainer lets go of what it holds, in one order (see ``torchshard._exit`` for why
the order matters: gloo's threads must be done before the interpreter finalizes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .._dist import Coordinator
from .._exit import EXIT_TIMEOUT, destroy_group, drain
from .._flat.module import FlatParamModule
from .._log import get_logger

__all__ = ["teardown"]

logger = get_logger(__name__)


def teardown(
    fm: FlatParamModule,
    grads: Any,
    coordinator: Coordinator | None,
    groups: Iterable[dist.ProcessGroup],
    device: torch.device | None,
    *,
    failed: bool,
) -> None:
    """Stop the gradient sync ``grads`` (its collectives in flight waited for), agree with
    the other ranks through the store that every rank is done, stop the heartbeat, destroy
    ``groups`` (the ones the mode made) in order, and give gloo's threads the GIL for a
    moment. ``failed``: leaving on an exception (which a peer may not share): skip the
    waits and the agreement, which could hang on peers stuck in a collective; only stop
    the threads."""
    if failed:
        fm._set_grad_listener(None)
        if coordinator is not None:
            coordinator.close()
        return
    if grads is not None:
        grads.close()  # hooks off, collectives in flight waited for
    if device is not None and device.type == "cuda":
        # work.wait() on NCCL only orders streams: let collectives in flight finish
        # before the group that runs them can be destroyed
        torch.cuda.current_stream(device).synchronize()
    if coordinator is not None:
        late = coordinator.leave(EXIT_TIMEOUT)
        if late:
            logger.warning(
                "close(): rank %d leaves without ranks %s: they did not close within "
                "%.0f s, or stopped beating (their process died or froze)",
                coordinator.rank,
                late,
                EXIT_TIMEOUT,
            )
    for group in groups:
        destroy_group(group)
    drain()
