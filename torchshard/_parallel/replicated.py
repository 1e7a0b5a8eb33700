"""Replicated mode (DDP's): every bucket all-reduced, every rank updates every parameter."""

from __future__ import annotations

from .comm import AllReduce, BucketComm
from .mode import Mode

__all__ = ["Replicated"]


class Replicated(Mode):
    """Every rank holds and updates every weight; each bucket travels by ``comm`` (built
    over the mesh as ``comm(mesh)``; default :class:`AllReduce`: every rank gets the sum),
    the used-parameter mask riding in the last bucket launched when the comm allows it."""

    divides_first = True  # as DDP: each bucket times 1/world as it launches, bitwise DDP's
    comm_kinds = frozenset({"dense", "cast", "star", "compress"})

    def __init__(self, comm: type[BucketComm] = AllReduce) -> None:
        self.comm_type = comm
