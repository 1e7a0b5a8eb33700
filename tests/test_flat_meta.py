"""The meta-buffer check fires on use: forward may not read a buffer built on meta that
nothing wrote, and only that.

A buffer built under ``torch.device("meta")`` becomes zeros at ``bind()``. Reading them in
forward raises, naming the buffer; a scratch or cache buffer that forward writes first (or
never reads) trains, bitwise like the same model whose buffer was built for real (the
oracle). At 1 process without a trainer, and at 2 ranks through a DistributedTrainer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_distributed
from torch import nn

import torchshard
from torchshard import UnwrittenBufferError


class Scratch(nn.Module):
    """A buffer ``cache`` that forward writes (``how``) and then reads, or only reads
    (``how="read"``), or never touches (``how="never"``); ``spare`` is never read."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.register_buffer("cache", torch.full((8,), 7.0), persistent=False)
        self.register_buffer("spare", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        m = h.detach().mean(0)
        if self.how == "never":
            return self.out(h)
        if self.how == "copy":
            self.cache.copy_(m)
        elif self.how == "fill":
            self.cache.fill_(0.5)
        elif self.how == "setitem":
            self.cache[:] = m
        elif self.how == "view":  # a view written first writes the buffer
            self.cache[:4].copy_(m[:4])
            self.cache[4:] = 1.0
        return self.out(h * self.cache)


WRITES = ["copy", "fill", "setitem", "view"]


def deterministic_init(m: nn.Module) -> None:
    """Weights without random numbers: the oracle and the meta-built model agree bitwise."""
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.copy_(torch.linspace(-0.5, 0.5, m.weight.numel()).view_as(m.weight))
            m.bias.fill_(0.1)


def batch(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))


def built_on_meta(model: Callable[[], nn.Module]) -> torchshard.FlatParamModule:
    with torch.device("meta"):
        module = model()
    fm = torchshard.FlatParamModule(module)
    fm.bind(torch.zeros(fm.numel))  # zeros: the alignment padding compares equal too
    fm.init_weights(deterministic_init)  # writes the weights, not the buffers
    return fm


def built_for_real(model: Callable[[], nn.Module]) -> torchshard.FlatParamModule:
    fm = torchshard.FlatParamModule(model().apply(deterministic_init))
    return fm.bind(torch.zeros(fm.numel))


def train(fm: nn.Module, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = fm(batch(step)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def guard_hooks(fm: torchshard.FlatParamModule) -> int:
    return len(fm.module._forward_pre_hooks) + len(fm.module._forward_hooks)


# -- 1 process: what raises, what trains ----------------------------------------------------------
def test_a_read_of_an_unwritten_buffer_raises_naming_it():
    fm = built_on_meta(lambda: nn.Sequential(Scratch("read")))
    assert fm.unwritten_buffers() == ["0.cache", "0.spare"]
    with pytest.raises(UnwrittenBufferError) as e:
        fm(batch(0))
    message = str(e.value)
    assert "buffer '0.cache' was built on the meta device" in message, message
    assert "also unwritten so far: ['0.spare']" in message, message
    assert "non-persistent" in message and "init function" in message, message
    assert isinstance(e.value, torchshard.TorchShardError)
    # the zeros are left as they were, and the plain buffer is back
    cache = fm.module[0].cache
    assert type(cache) is torch.Tensor and torch.equal(cache, torch.zeros(8))
    assert fm.unwritten_buffers() == ["0.cache", "0.spare"]
    # written by hand, as the message says: it trains
    cache.fill_(0.5)
    train(fm, 1)
    assert fm.unwritten_buffers() == ["0.spare"]


@pytest.mark.parametrize("how", WRITES)
def test_a_buffer_forward_writes_before_reading_trains_like_a_real_one(how):
    oracle = built_for_real(lambda: Scratch(how))
    fm = built_on_meta(lambda: Scratch(how))
    assert fm.unwritten_buffers() == ["cache", "spare"]
    expected, got = train(oracle, 3), train(fm, 3)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert torch.equal(fm.flat_param, oracle.flat_param)
    assert torch.equal(fm.module.cache, oracle.module.cache)
    assert fm.unwritten_buffers() == ["spare"]  # never read: it stays, and trains
    assert type(fm.module.cache) is torch.Tensor and type(fm.module.spare) is torch.Tensor


def test_a_buffer_forward_never_reads_trains_and_keeps_only_two_hooks():
    oracle = built_for_real(lambda: Scratch("never"))
    fm = built_on_meta(lambda: Scratch("never"))
    assert guard_hooks(fm) == 2
    assert all(torch.equal(a, b) for a, b in zip(train(oracle, 3), train(fm, 3)))
    assert torch.equal(fm.flat_param, oracle.flat_param)
    assert fm.unwritten_buffers() == ["cache", "spare"] and guard_hooks(fm) == 2


def test_the_check_removes_itself_once_every_buffer_is_written():
    fm = built_on_meta(lambda: Scratch("copy"))
    train(fm, 1)
    assert guard_hooks(fm) == 2  # spare is still unwritten
    fm.module.spare.zero_()  # outside forward: seen by the version counter
    train(fm, 1)
    assert fm.unwritten_buffers() == [] and guard_hooks(fm) == 0


def test_a_buffer_the_init_function_writes_has_no_check_at_all():
    def init(m: nn.Module) -> None:
        deterministic_init(m)
        if isinstance(m, Scratch):
            m.cache.fill_(0.5)
            m.spare.zero_()

    with torch.device("meta"):
        module = Scratch("read")
    fm = torchshard.FlatParamModule(module)
    fm.bind(torch.empty(fm.numel))
    assert guard_hooks(fm) == 2
    fm.init_weights(init)
    assert fm.unwritten_buffers() == [] and guard_hooks(fm) == 0
    train(fm, 1)


def test_a_buffer_moved_or_cast_while_unwritten_stays_checked():
    fm = built_on_meta(lambda: Scratch("read"))
    fm.double()  # a new tensor for every buffer, still zeros nobody wrote
    assert fm.unwritten_buffers() == ["cache", "spare"]
    with pytest.raises(UnwrittenBufferError, match="buffer 'cache'"):
        fm(batch(0).double())
    fm.module.cache.fill_(0.5)
    fm.float()
    assert fm.unwritten_buffers() == ["spare"]
    train(fm, 1)


class Ops(nn.Module):
    """Runs ``op(buffer, x)`` in forward: what counts as a read, a write, or neither."""

    def __init__(self, op: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
        super().__init__()
        self.op = op
        self.register_buffer("buf", torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.op(self.buf, x.detach())
        return x


READS = {
    "mul": lambda b, x: x * b,
    "linear": lambda b, x: nn.functional.linear(x, b),
    "cat": lambda b, x: torch.cat([x, b]),
    "clone": lambda b, x: b.clone(),
    "item": lambda b, x: b[0, 0].item(),
    "a view's read": lambda b, x: b[1:].T.sum(),
    "add_ (reads, then writes)": lambda b, x: b.add_(1),
    "copy_ from it": lambda b, x: x.clone().copy_(b),
    "out= from it": lambda b, x: torch.add(b, 1, out=torch.empty(4, 4)),
    "to another dtype": lambda b, x: b.double(),
}
NOT_READS = {
    "shape": lambda b, x: b.shape[0] + b.dim() + b.numel(),
    "dtype and device": lambda b, x: (b.dtype, b.device, b.is_floating_point()),
    "zeros_like": lambda b, x: torch.zeros_like(b),
    "its shape for another": lambda b, x: (x.expand_as(b), x.type_as(b), x.to(b)),
    "a view": lambda b, x: b[1:].view(-1).detach(),
    "zero_": lambda b, x: b.zero_(),
    "out=": lambda b, x: torch.add(x, 1, out=b),
    "nn.init": lambda b, x: nn.init.eye_(b),
    "random fill": lambda b, x: b.normal_(),
    "masked_fill_": lambda b, x: b.masked_fill_(torch.ones(4, 4, dtype=torch.bool), 2.0),
}


@pytest.mark.parametrize("op", list(READS), ids=list(READS))
def test_every_op_that_reads_an_unwritten_buffer_raises_before_it_changes_it(op):
    with torch.device("meta"):
        module = Ops(READS[op])
    fm = torchshard.FlatParamModule(nn.Sequential(nn.Linear(4, 4), module))
    fm.bind(torch.zeros(fm.numel))
    version = module.buf._version
    with pytest.raises(UnwrittenBufferError, match=r"buffer '1\.buf'"):
        fm(torch.ones(4, 4))
    assert module.buf._version == version and fm.unwritten_buffers() == ["1.buf"]
    assert type(module.buf) is torch.Tensor


@pytest.mark.parametrize("op", list(NOT_READS), ids=list(NOT_READS))
def test_metadata_views_and_overwrites_are_not_reads(op):
    with torch.device("meta"):
        module = Ops(NOT_READS[op])
    fm = torchshard.FlatParamModule(nn.Sequential(nn.Linear(4, 4), module))
    fm.bind(torch.zeros(fm.numel))
    fm(torch.ones(4, 4))
    written = fm.unwritten_buffers() == []
    assert written == (op in ("zero_", "out=", "nn.init", "random fill", "masked_fill_")), op
    assert type(module.buf) is torch.Tensor


# -- 2 ranks, through the trainer -----------------------------------------------------------------
def _through_the_trainer(shard: bool | str) -> dict:
    rank, out = dist.get_rank(), {}

    def trained(fm: torchshard.FlatParamModule, **kw) -> torchshard.DistributedTrainer:
        trainer = torchshard.DistributedTrainer(fm, shard=shard, **kw)
        opt = trainer.make_optimizer(torch.optim.SGD, lr=0.1)
        for step in range(3):
            opt.zero_grad()
            fm(batch(step, rank)).square().mean().backward()
            trainer.step()
        return trainer

    # read before any write: every rank raises at the same op, naming it
    with torch.device("meta"):
        module = Scratch("read")
    fm = torchshard.FlatParamModule(module)
    trainer = torchshard.DistributedTrainer(fm, shard=shard, init_fn=deterministic_init)
    out["unwritten"] = fm.unwritten_buffers()  # src's broadcast zeros are no value
    try:
        fm(batch(0, rank))
    except UnwrittenBufferError as e:
        out["error"] = str(e)
    trainer.close()

    # written first, or never read: bitwise the model whose buffers were built for real
    for how in ("copy", "never"):
        oracle_fm = torchshard.FlatParamModule(Scratch(how).apply(deterministic_init))
        oracle = trained(oracle_fm)
        with torch.device("meta"):
            module = Scratch(how)
        fm = torchshard.FlatParamModule(module)
        meta = trained(fm, init_fn=deterministic_init)
        with oracle.gathered(), meta.gathered():
            pairs = zip(oracle_fm.state_dict().values(), fm.state_dict().values())
            out[how] = all(torch.equal(a, b) for a, b in pairs)
        out[f"{how} unwritten"] = fm.unwritten_buffers()
        oracle.close()
        meta.close()

    # written by the init function on every rank (and broadcast from src): no check at all
    def init(m: nn.Module) -> None:
        deterministic_init(m)
        if isinstance(m, Scratch):
            m.cache.fill_(float(dist.get_rank()))  # src's value arrives everywhere
            m.spare.zero_()

    with torch.device("meta"):
        module = Scratch("read")
    fm = torchshard.FlatParamModule(module)
    plain = torchshard.FlatParamModule(Scratch("read"))
    trainer = torchshard.DistributedTrainer(fm, shard=shard, init_fn=init)
    other = torchshard.DistributedTrainer(plain, shard=shard)
    out["init wrote"] = fm.unwritten_buffers()
    out["extra hooks"] = guard_hooks(fm) - guard_hooks(plain)
    out["cache"] = module.cache.tolist()
    fm(batch(0, rank)).sum().backward()
    trainer.close()
    other.close()
    return out


@pytest.mark.parametrize("shard", [False, "full"], ids=["replicated", "full"])
def test_through_a_trainer_at_two_ranks(shard):
    for out in run_distributed(_through_the_trainer, 2, shard, timeout=120):
        assert out["unwritten"] == ["cache", "spare"], out
        assert "buffer 'cache' was built on the meta device" in out.get("error", ""), out
        assert out["copy"] and out["never"], out
        assert out["copy unwritten"] == ["spare"] and out["never unwritten"] == ["cache", "spare"]
        assert out["init wrote"] == [] and out["extra hooks"] == 0, out
        assert out["cache"] == [0.0] * 8, out  # rank 0's, broadcast
