"""Pipeline memory (issue 26): every rank's ``pipe.memory_bytes()`` against the pure per-stage
planner, to the byte, and the microbatches whose activations each stage holds at once,
counted in torch's own stage bookkeeping, against what each schedule says."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from gpt import GPT, GPTConfig, init_gpt_weights
from multiprocess import run_distributed
from pipeline_models import gpt_loss, meta_gpt

import torchshard

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=16)
M = 4  # microbatches


def _meta(tied: bool) -> GPT:
    return meta_gpt(CFG, tied)


_loss = gpt_loss


def _batch(m: int = M) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2 * m, 16), generator=g)
    return x, torch.randint(0, 64, (2 * m, 16), generator=g)


def _stages(pp: int, schedule: str) -> int:
    return pp * (2 if schedule in ("Interleaved1F1B", "LoopedBFS") else 1)


def _pipe(
    pp: int, schedule: str, shard: bool, tied: bool, m: int = M, v: int | None = None
) -> torchshard.Pipeline:
    torch.manual_seed(0)
    return torchshard.Pipeline(
        _meta(tied),
        pp=pp,
        microbatches=m,
        loss_fn=_loss,
        stages=_stages(pp, schedule) if v is None else v * pp,
        schedule=schedule,
        shard=shard,
        init_fn=init_gpt_weights,
    )


# -- memory_bytes against the planner -------------------------------------------------------
def _measure(configs: list[tuple[int, str, bool, bool]]) -> list[tuple[int, int, dict]]:
    """Per config: after one step with AdamW, ``(pp_rank, dp_rank, memory_bytes())``."""
    out = []
    for pp, schedule, shard, tied in configs:
        pipe = _pipe(pp, schedule, shard, tied)
        pipe.make_optimizer(torch.optim.AdamW, lr=1e-2)
        pipe.zero_grad()
        x, y = _batch()
        pipe.forward_backward(x, target=y)
        pipe.step()
        out.append((pipe.pp_rank, pipe.dp_rank, pipe.memory_bytes()))
        pipe.close()
    return out


def _check(world: int, configs: list[tuple[int, str, bool, bool]]) -> None:
    got = run_distributed(_measure, world, configs, timeout=240)
    for c, (pp, schedule, shard, tied) in enumerate(configs):
        planned = torchshard.plan_pipeline_memory(
            _meta(tied), _stages(pp, schedule), pp=pp, dp=world // pp, shard=shard
        )
        for rank, per_config in enumerate(got):
            pp_rank, dp_rank, measured = per_config[c]
            want = planned.rank(pp_rank, dp_rank)
            assert (pp_rank * (world // pp) + dp_rank, want.rank) == (rank, rank)
            assert measured == want.as_dict(), (configs[c], rank, measured, want)
        assert [r.rank for r in planned.ranks()] == list(range(world))


def test_memory_matches_the_planner_pp2_dp1() -> None:
    _check(
        2,
        [
            (2, "1F1B", False, False),
            (2, "1F1B", False, True),
            (2, "1F1B", True, False),
            (2, "Interleaved1F1B", False, True),
            (2, "Interleaved1F1B", True, False),
        ],
    )


def test_memory_matches_the_planner_world4() -> None:
    _check(
        4,
        [
            (2, "1F1B", False, True),  # pp=2 x dp=2
            (2, "1F1B", True, False),
            (2, "1F1B", True, True),  # a sharded replica of the tied embedding
            (2, "Interleaved1F1B", True, False),
            (4, "1F1B", False, True),  # pp=4 x dp=1
            (4, "1F1B", True, False),
            (4, "Interleaved1F1B", False, False),
        ],
    )


def test_memory_matches_the_planner_pp4_dp2() -> None:
    _check(8, [(4, "1F1B", True, False), (4, "Interleaved1F1B", False, True)])


def test_planner_is_pure_and_counts_the_replica() -> None:
    model = _meta(tied=True)
    mem = torchshard.plan_pipeline_memory(model, 2, pp=2, dp=2)
    whole = torchshard.FlatLayout.from_module(model)
    (one,) = torchshard.plan_memory(whole, 1, shard=False)
    # the tied weight is held twice (owner and replica), everything else once
    tie = CFG.vocab_size * CFG.n_embd * 4
    assert sum(s[0].parameters for s in mem.stages) >= one.parameters + tie
    assert mem.rank(1, 1).rank == 3 and mem.dp == 2
    with pytest.raises(torchshard.PipelineError, match="dp"):
        torchshard.plan_pipeline_memory(model, 2, pp=2, dp=0)
    with pytest.raises(torchshard.PipelineError, match="pp=2"):
        torchshard.plan_pipeline_memory(model, torchshard.plan_stages(model, 4, pp=4), pp=2)
    with pytest.raises(torchshard.PipelineError, match="pp_rank"):
        mem.rank(2, 0)


# -- saved activations per stage --------------------------------------------------------------
class _Saved:
    """Saved-tensor hooks around each stage's forward: every tensor autograd saves for
    backward is tagged with its stage and microbatch, and counted until autograd frees it
    (after that microbatch's backward). ``peak[k]``: the most microbatches of stage ``k``
    with saved tensors alive at once; ``rank_peak`` the same over the rank's stages."""

    def __init__(self, pipe: torchshard.Pipeline) -> None:
        self.live: dict[tuple[int, int], int] = {}
        self.peak = {h.index: 0 for h in pipe.stages}
        self.rank_peak = 0
        for h in pipe.stages:
            self._wrap(h.stage, h.index)

    def _wrap(self, stage: object, k: int) -> None:
        forward = stage.forward_one_chunk  # type: ignore[attr-defined]

        def counted(chunk: int, *args: object, **kwargs: object) -> object:
            key = (k, chunk)
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(key, t), lambda held: held.t
            ):
                out = forward(chunk, *args, **kwargs)
            self._sample()
            return out

        stage.forward_one_chunk = counted  # type: ignore[attr-defined]

    def _pack(self, key: tuple[int, int], t: torch.Tensor) -> object:
        held = _Held(t)
        self.live[key] = self.live.get(key, 0) + 1
        weakref.finalize(held, self._drop, key)
        return held

    def _drop(self, key: tuple[int, int]) -> None:
        self.live[key] -= 1

    def _sample(self) -> None:
        alive = [k for k, n in self.live.items() if n]
        for k in self.peak:
            self.peak[k] = max(self.peak[k], sum(1 for s, _ in alive if s == k))
        self.rank_peak = max(self.rank_peak, len(alive))


class _Held:
    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _held(pp: int, schedule: str, m: int, v: int) -> dict:
    """Per stage of this rank: the peak microbatches with saved activations over two steps,
    the same over the rank's stages, and how many are left after them."""
    pipe = _pipe(pp, schedule, False, False, m, v)
    pipe.make_optimizer(torch.optim.SGD, lr=1e-2)
    saved = _Saved(pipe)
    x, y = _batch(m)
    for _ in range(2):
        pipe.zero_grad()
        pipe.forward_backward(x, target=y)
        pipe.step()
    gc.collect()
    out = {
        "peak": saved.peak,
        "rank_peak": saved.rank_peak,
        "left": sum(1 for n in saved.live.values() if n),
    }
    pipe.close()
    return out


@pytest.mark.parametrize(
    ("pp", "schedule", "m", "v"),
    [
        (2, "GPipe", 4, 1),
        (2, "1F1B", 2, 1),
        (2, "1F1B", 8, 1),
        (2, "Interleaved1F1B", 2, 2),
        (2, "Interleaved1F1B", 8, 2),
        (2, "Interleaved1F1B", 3, 3),  # one round of 3 microbatches
        (2, "Interleaved1F1B", 6, 3),
        (2, "LoopedBFS", 4, 2),
        (4, "GPipe", 4, 1),
        (4, "1F1B", 8, 1),
        (4, "Interleaved1F1B", 4, 2),
        (4, "Interleaved1F1B", 8, 2),
    ],
)
def test_saved_activations_per_stage_as_the_schedule_says(
    pp: int, schedule: str, m: int, v: int
) -> None:
    got = run_distributed(_held, pp, pp, schedule, m, v, timeout=240)
    want = torchshard.held_microbatches(schedule, pp, m, v)
    for r, g in enumerate(got):
        assert g["left"] == 0, (r, g)  # every microbatch's saved tensors freed by its backward
        assert g["rank_peak"] == want[r], (r, g, want)
        assert all(0 < n <= m for n in g["peak"].values()), (r, g)
        if schedule in ("GPipe", "LoopedBFS"):  # every forward before any backward
            assert g["peak"] == {k: m for k in range(r, v * pp, pp)}, (r, g)
    if schedule != "GPipe" and schedule != "LoopedBFS":  # the last: forward, loss, backward
        assert got[-1]["peak"][v * pp - 1] == 1, got[-1]
    assert [g["rank_peak"] for g in got] == list(want)


def test_held_microbatches_figures_and_errors() -> None:
    assert torchshard.held_microbatches("1F1B", 4, 8) == (4, 3, 2, 1)
    assert torchshard.held_microbatches("1F1B", 4, 2) == (2, 2, 2, 1)
    assert torchshard.held_microbatches("GPipe", 4, 8) == (8,) * 4
    assert torchshard.held_microbatches("Interleaved1F1B", 4, 8, 2) == (11, 9, 7, 5)
    with pytest.raises(torchshard.PipelineError, match="schedule"):
        torchshard.held_microbatches("ZBVZeroBubble", 2, 4)
    with pytest.raises(torchshard.PipelineError, match="stages_per_rank"):
        torchshard.held_microbatches("1F1B", 2, 4, 2)
    with pytest.raises(torchshard.PipelineError, match="microbatches"):
        torchshard.held_microbatches("1F1B", 2, 0)
