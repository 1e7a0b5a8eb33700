"""The fully sharded mode (``shard="full"``), cut by the objects that own its state:
``collectives`` -> ``storage`` -> ``grads`` / ``init`` -> ``schedule`` -> ``mode``."""

from .mode import FullyShard

__all__ = ["FullyShard"]
