"""How gradients travel between ranks: ``DistributedTrainer(fm, comm=...)``.

Each choice is a small frozen dataclass; the trainer builds what it needs over its group:

==================================  ==========================  ===========================
``comm=``                           modes                       bytes per step (``stats``)
==================================  ==========================  ===========================
``AllReduce()`` (default, exact)    every mode                  the gradient's
``BF16()``, ``FP16()``              ``shard=False`` / ``True``  half of a float32 gradient's
``Star(root=0)`` (exact)            ``shard=False`` / ``True``  a reduce and a broadcast
``PowerSGD(rank, start_step, ...)`` ``shard=False``             ``P`` + ``Q`` + vectors
``TopK(ratio)`` (experimental)      ``shard=False``             ``world * k`` values+indices
==================================  ==========================  ===========================

A choice a mode cannot take, a bad setting, or a dtype a choice cannot take (``PowerSGD``
and ``TopK``: float32 or float64 gradients, one dtype, and no ``reduce_dtype``) raises
:class:`CommError` on every rank when the trainer is built. ``BF16``/``FP16`` also work with
hybrid sharding (a mesh with replicas and ``shard=True``); ``Star`` does not. With
``shard=False`` a mesh is a data-parallel group like any other, so every comm works there.
With tensor parallelism (``init_mesh(tp=T)``) each tp rank compresses its own pieces' gradients
over ``mesh.dp``; ``TopK`` is refused there (its pick over a bucket mixing split and replicated
parameters would let the tp ranks' replicated parameters drift apart).

Compression runs when gradients are synchronized (never inside ``no_sync()``); the
used-parameter mask always travels exactly (on a lossy comm: as its own int32 all-reduce).
``trainer.stats.payload_bytes`` counts what went on the wire (each buffer handed to a
collective, once, at its size in the dtype it travelled in; an all-gather at its output,
what each rank sends and receives) beside ``stats.bytes_reduced``, the dense equivalent.
In a world of one ``BF16``, ``FP16`` and ``Star`` do nothing, while ``PowerSGD`` and
``TopK`` still compress (nothing travels): a run's updates do not depend on its world size.

Compression state
-----------------
``PowerSGD`` and ``TopK`` keep state across steps; the trainer hands it out as named flat
tensors, for checkpoints::

    state = trainer.comm_state()          # dict[str, torch.Tensor]: the live buffers
    trainer.load_comm_state(state)        # copies in; CommError if it does not fit
    trainer.reset_comm_error()            # zero the error feedback

- ``"error"``: this rank's error feedback (what it did not send), a 1-D tensor laid out like
  the gradient space ``fm.layout.grad_layout`` (the trainable parameters only, at their
  gradient offsets; ``fm.flat_grad``'s shape), in the gradient's dtype (float32 or float64).
  PowerSGD's is zero outside compressed parameters. Ranks differ.
- ``"powersgd_q"`` (PowerSGD): the warm-started ``Q`` of every compressed parameter, one
  1-D tensor by slot: for each trainable slot in layout order whose ``(n, m, r)`` compresses
  (``n = shape[0]``, ``m = numel / n``, ``r = min(rank, n, m)``, ``n * m > min_compression *
  (n + m) * r``), ``m * r`` elements, row-major ``(m, r)``. The same on every rank, and the
  same at any world size.
- ``"steps"``: a new 0-d int64 tensor, the synchronized steps so far (PowerSGD compresses from
  ``start_step`` on).

``load_comm_state`` takes exactly these names, each with as many elements (any dtype or
device). PowerSGD's update depends on the ranks' inputs only through their sum, so a run
saved with the **mean** of ``"error"`` over its ranks and resumed with that mean on every
rank, at any world size and on the same global batches, continues as it would have.
For TopK the mean error is an approximation (each rank's pick depends on its own error);
``reset_comm_error()`` is the other choice. The other comms keep no state: ``{}``.

Loss scaling: with fp16 and a ``torch.amp.GradScaler``, unscale through the trainer
(``trainer.unscale_(scaler)``, or ``trainer.step(scaler)``), not ``scaler.unscale_``: after an
overflow the error is zeroed and PowerSGD's ``Q`` drawn again (the same on every rank), and
when the scale changes the error follows it, so ``comm_state()`` holds it at the scale the
scaler holds now (``docs/compression.md``, "Loss scaling").

``torchshard.checkpoint.save`` writes this state (the mean error, ``Q``, ``steps``) and ``load``
restores it at any world size (``comm_error="reset"`` starts the error at zero); a load into
another comm says what it drops: ``docs/compression.md``, "Checkpoints".

Example::

    import torchshard
    from torchshard.comm import PowerSGD

    trainer = torchshard.DistributedTrainer(fm, comm=PowerSGD(rank=4, start_step=30))
    ...
    print(trainer.stats.bytes_reduced / trainer.stats.payload_bytes, "x fewer bytes")
"""

from __future__ import annotations

from ._parallel.comms import BF16, FP16, AllReduce, Comm, CommError, PowerSGD, Star, TopK

__all__ = ["BF16", "FP16", "AllReduce", "Comm", "CommError", "PowerSGD", "Star", "TopK"]
