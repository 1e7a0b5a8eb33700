"""Error feedback: what a lossy comm did not send, kept for the next step, and the state of
such a comm as named flat tensors (``trainer.comm_state()``; see :mod:`torchshard.comm`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.futures import Future

from .comm import CommError

__all__ = ["ErrorFeedback", "done"]


def _scale_of(scaler: Any, device: torch.device) -> torch.Tensor:
    """A ``torch.amp.GradScaler``'s loss scale as a 0-d float32 tensor on ``device``, without
    a host sync (its ``_scale`` tensor, which torch's own sharded scalers read too;
    ``get_scale()`` returns a float and syncs)."""
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scaler.get_scale(), dtype=torch.float32)
    return scale.to(device=device, dtype=torch.float32)


def done(result: torch.Tensor) -> Future[torch.Tensor]:
    """A future already completed with ``result`` (nothing to wait for: a world of one).

    Example::

        done(view).wait() is view
    """
    fut: Future[torch.Tensor] = Future()
    fut.set_result(result)
    return fut


class ErrorFeedback:
    """A lossy bucket comm's state: ``error``, one flat buffer laid out like the gradient
    space (``fm.layout.grad_layout``: only what trains), in the gradient's dtype, and
    ``steps``, the synchronized steps so far. Subclasses add their own named tensors
    (:meth:`extra_state`).

    A lossy comm runs in a world of one too (``runs_alone``): its update must not depend on
    the world size, so that a run resumes at any world size on the same global batches.
    """

    runs_alone: ClassVar[bool] = True
    fuses_mask: ClassVar[bool] = False  # the used-parameter mask never rides a lossy wire

    def __init__(self, ctx: Any, dense: Any, start_step: int) -> None:
        self.mesh = ctx.mesh
        self.dense, self.start_step = dense, start_step
        """The comm of the first ``start_step`` synchronized steps (a dense start)."""
        self.error = torch.zeros_like(ctx.grad)
        """This rank's error feedback: what it did not send, by gradient-space offset."""
        self.steps = 0
        """Synchronized steps (flushes) so far."""
        self.payload_bytes = 0
        """Bytes handed to collectives so far (an all-gather: its output, what each rank
        sends and receives)."""
        self._scaler: Any = None  # the GradScaler whose loss scale the error follows
        self._units = torch.ones((), dtype=torch.float32, device=ctx.device)  # its scale now
        self._rescale = False  # the first launch of the next step rescales the error

    def unscaled(self, scaler: Any, found_inf: torch.Tensor) -> None:
        """After ``trainer.unscale_(scaler)``, with the flag the ranks agreed on (``found_inf``
        > 0: some rank's gradient held an inf or NaN, and the step is skipped).

        The error holds gradients at the loss scale of the backward that kept them. After an
        overflow it holds the inf or NaN too, and so may the comm's other state:
        :meth:`overflowed` forgets it, or every later step would be skipped. Otherwise the
        next step's first launch multiplies the error by the scale ``scaler.update()`` set
        over the one it is in, so that it adds to gradients at their own scale.

        Example::

            comm.unscaled(scaler, torch.zeros(()))   # no overflow this step
        """
        if found_inf.item() > 0:  # a host sync, as ``scaler.step`` has on the same flag
            self.overflowed()
        if self._scaler is not scaler:
            self._scaler = scaler
            self._units = _scale_of(scaler, self.error.device).clone()
        self._rescale = True

    def overflowed(self) -> None:
        """A skipped step's gradient held an inf or NaN, and the error took it in: zero it
        (what earlier steps held back is lost with the step). Subclasses reset their own
        state too."""
        self.reset_error()

    def _follow_scale(self) -> None:
        """Bring the error to the loss scale its scaler holds now (see :meth:`unscaled`)."""
        if self._scaler is None:
            return
        now = _scale_of(self._scaler, self.error.device)
        self.error.mul_((now / self._units).to(self.error.dtype))
        self._units.copy_(now)
        self._rescale = False

    def launch_dense(
        self, view: torch.Tensor, spec: Any, bucket: Any
    ) -> Future[torch.Tensor] | None:
        """Before ``start_step``: the dense comm's launch (in a world of one, nothing to
        send); ``None`` once the comm compresses. Every launch calls it first: the first of a
        step after ``trainer.unscale_`` brings the error to the new loss scale."""
        if self._rescale:
            self._follow_scale()
        if self.steps >= self.start_step:
            return None
        if self.mesh.size == 1:
            return done(view)
        self.payload_bytes += view.numel() * view.element_size()
        return self.dense.launch(view, spec, bucket)

    def flush_dense(self) -> int | None:
        """Before ``start_step``: count the step and flush the dense comm (its bytes across
        replicas); ``None`` once the comm compresses."""
        if self.steps >= self.start_step:
            return None
        self.steps += 1
        return getattr(self.dense, "flush", lambda: 0)()

    def extra_state(self) -> dict[str, torch.Tensor]:
        """The subclass's own state tensors, by name (live buffers)."""
        return {}

    def state(self) -> dict[str, torch.Tensor]:
        """``{"error": ..., "steps": ..., **extra_state()}``: the live buffers, and the step
        count as a new 0-d int64 tensor.

        Example::

            saved = {k: v.clone() for k, v in comm.state().items()}
        """
        self._follow_scale()  # saved at the scale a restored scaler resumes with
        steps = torch.tensor(self.steps, dtype=torch.int64)
        return {"error": self.error, "steps": steps, **self.extra_state()}

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (as :meth:`state` returns it: the same names and sizes; any dtype
        or device) into the buffers; :class:`CommError` naming what does not fit.

        Example::

            comm.load_state(saved)
        """
        mine = self.state()
        if set(state) != set(mine):
            raise CommError(
                f"load_comm_state: expected the tensors {sorted(mine)}, got {sorted(state)}; "
                "pass what comm_state() returns for this comm (reset_comm_error() starts the "
                "error afresh instead)"
            )
        for name, t in state.items():
            if not isinstance(t, torch.Tensor) or t.numel() != mine[name].numel():
                got = f"{t.numel()} elements" if isinstance(t, torch.Tensor) else repr(t)
                raise CommError(
                    f"load_comm_state: {name!r}: expected a tensor of {mine[name].numel()} "
                    f"elements, got {got}; the state of another model or comm setting?"
                )
        for name, t in state.items():
            if name == "steps":
                self.steps = int(t.reshape(()).item())
            else:
                mine[name].copy_(t.reshape(mine[name].shape))

    def reset_error(self) -> None:
        """Forget what was not sent: zero the error feedback."""
        self.error.zero_()
