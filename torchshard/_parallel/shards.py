"""What a trainer publishes of its state: the flat ranges this rank's optimizer updates
(:class:`LocalShards`, read by the checkpoint layer) and the bytes it holds
(:class:`MemoryStats`). Plain data: no process group, no mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LocalShards", "MemoryStats"]


@dataclass(frozen=True)
class LocalShards:
    """What this rank holds of the flat buffer, inside the tensor its optimizer updates.

    ``runs`` are this rank's non-empty ``(start, end, at)``: flat elements ``[start, end)``
    are ``tensor[at : at + end - start]``. ``regions`` are the flat ranges cut over the
    ranks (one per unit with ``shard="full"``, one for ``shard=True``), and ``every[k]``
    every rank's ``[a, b)`` of region ``k``, clipped to it (what an exchange needs).
    ``frozen``: what else this rank holds of the weights but never updates (a fully sharded
    trainer's frozen parameters, kept as the flat buffer holds them: its dtype, or bytes
    for parameters of several), as local shards of their own; ``None`` without.

    Example::

        shards = trainer.local_shards()        # None: every rank holds every weight
        for start, end, at in shards.runs:
            piece = shards.tensor[at : at + end - start]
    """

    tensor: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]
    regions: tuple[tuple[int, int], ...]
    every: tuple[tuple[tuple[int, int], ...], ...]
    frozen: LocalShards | None = None

    @staticmethod
    def of(
        tensor: torch.Tensor,
        regions: list[tuple[int, int]],
        every: list[list[tuple[int, int]]],
        rank: int,
        offsets: list[int],
    ) -> LocalShards:
        """Regions laid out one after another in ``tensor``, region ``k`` at ``offsets[k]``
        (its stripe's first element there, whatever the clipping)."""
        runs = []
        for k, ranges in enumerate(every):
            a, b = ranges[rank]
            if b > a:
                runs.append((a, b, offsets[k]))
        return LocalShards(tensor, tuple(runs), tuple(regions), tuple(tuple(e) for e in every))


@dataclass(frozen=True)
class MemoryStats:
    """Bytes one rank holds for a trainer (:meth:`DistributedTrainer.memory_stats`).

    ``parameters``, ``gradients``, ``optimizer`` and ``master`` persist between steps;
    ``transient`` is what the mode holds now beyond them (gathered units with
    ``shard="full"``, else 0) and ``peak_transient`` its most since construction or
    :meth:`DistributedTrainer.reset_peak_memory`, as ``torch.cuda.max_memory_allocated``.

    Example::

        trainer.reset_peak_memory()
        loss = model(x).sum(); loss.backward(); trainer.step()
        print(trainer.memory_stats().peak_transient / 2**20, "MiB")
    """

    parameters: int
    gradients: int
    optimizer: int
    master: int
    transient: int
    peak_transient: int

    @property
    def persistent(self) -> int:
        """What stays between steps: parameters, gradients, optimizer state and master."""
        return self.parameters + self.gradients + self.optimizer + self.master
