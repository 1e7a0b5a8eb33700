"""GlobalBatchSampler: the same global batches at every world size, and a position that
resumes exactly at another world size, with DataLoader workers prefetching.

The oracle is an uninterrupted world of one: its batches, epoch after epoch."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from multiprocess import run_distributed
from torch.utils.data import DataLoader, Dataset

import torchshard
from torchshard import DataError, GlobalBatchSampler

N, G = 50, 6  # 8 global batches per epoch (drop_last), divisible by 1, 2, 3 (and 6)


def oracle(num_batches: int, n: int = N, g: int = G, **kw) -> list[list[int]]:
    """The first ``num_batches`` global batches of an uninterrupted single-process run."""
    sampler = GlobalBatchSampler(n, g, rank=0, world_size=1, **kw)
    out: list[list[int]] = []
    while len(out) < num_batches:
        out += list(sampler)
    return out[:num_batches]


def lockstep(samplers: list[GlobalBatchSampler], loops: list, count: int) -> list[list[int]]:
    """Receive ``count`` global batches from every rank's loop in lockstep (as training does);
    each global batch is the ranks' parts in rank order."""
    its = [iter(loop) for loop in loops]
    return [[int(i) for it in its for i in next(it)] for _ in range(count)]


def ranks(world: int, **kw) -> list[GlobalBatchSampler]:
    return [GlobalBatchSampler(N, G, rank=r, world_size=world, **kw) for r in range(world)]


# -- the order: pure ---------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 6])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_global_batches_are_the_same_at_every_world_size(world, shuffle, drop_last):
    kw = dict(seed=7, shuffle=shuffle, drop_last=drop_last)
    samplers = ranks(world, **kw)
    assert all(len(s) == (8 if drop_last else 9) for s in samplers)
    epochs = 3
    got = lockstep(samplers, [s.track(s) for s in samplers], len(samplers[0]))
    for _ in range(epochs - 1):  # each new pass is the next epoch
        got += lockstep(samplers, [s.track(s) for s in samplers], len(samplers[0]))
    assert got == oracle(epochs * len(samplers[0]), **kw)
    parts = [len(b) for s in samplers for b in s.track(s)]
    assert set(parts) == {G // world}  # equal parts, every batch, padded one included
    assert samplers[0].global_batch(1, 2) == oracle(len(samplers[0]) + 3, **kw)[-1]


def test_each_sample_once_per_epoch_and_a_new_order_each_epoch():
    sampler = GlobalBatchSampler(48, 6, seed=3)
    epochs = [[i for b in sampler for i in b] for _ in range(3)]
    assert all(sorted(e) == list(range(48)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert epochs[0] == [i for b in GlobalBatchSampler(48, 6, seed=3) for i in b]  # reproducible
    assert [i for b in GlobalBatchSampler(48, 6, seed=4) for i in b] != epochs[0]
    assert [i for b in GlobalBatchSampler(48, 6, shuffle=False) for i in b] == list(range(48))


def test_drop_last_drops_the_short_batch_and_padding_repeats_the_epochs_first_samples():
    dropped = oracle(8)
    assert sorted(i for b in dropped for i in b) == sorted(set(i for b in dropped for i in b))
    assert len({i for b in dropped for i in b}) == 48  # 2 of the 50 not seen this epoch
    padded = oracle(9, drop_last=False)
    seen = [i for b in padded for i in b]
    assert sorted(set(seen)) == list(range(N))  # every sample, 4 of them twice
    assert seen[N:] == seen[: 9 * G - N]  # completed with the epoch's first samples
    tiny = GlobalBatchSampler(2, 6, drop_last=False, rank=1, world_size=3)
    assert len(tiny) == 1 and list(tiny) == [tiny.global_batch(0, 0)[2:4]]


@pytest.mark.parametrize("stop", [0, 3, 7, 8, 13])
@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 3), (3, 1), (2, 6), (6, 2)])
def test_resume_at_another_world_size_continues_the_uninterrupted_run(stop, before, after):
    first = ranks(before)
    got = lockstep(first, [s.track(s) for s in first], min(stop, 8))
    if stop > 8:  # into the second epoch
        got += lockstep(first, [s.track(s) for s in first], stop - 8)
    states = [s.state_dict() for s in first]
    assert all(st == states[0] for st in states)  # identical on every rank
    assert states[0]["epoch"] == stop // 8 and states[0]["consumed"] == stop % 8
    state = json.loads(json.dumps(states[0]))
    second = ranks(after)
    for s in second:
        s.load_state_dict(state)
    rest = 8 - stop % 8
    got += lockstep(second, [s.track(s) for s in second], rest)  # the epoch's rest
    got += lockstep(second, [s.track(s) for s in second], 8)  # then a whole new epoch
    assert got == oracle(stop + rest + 8)


def test_breaking_out_keeps_the_position_and_epochs_advance_by_themselves():
    sampler = GlobalBatchSampler(N, G)
    tracked = sampler.track(sampler)
    got = []
    for batch in tracked:
        got.append(batch)
        if len(got) == 3:
            break
    assert sampler.state_dict()["consumed"] == 3
    got += list(tracked)  # the rest of the epoch
    assert sampler.epoch == 1 and sampler.state_dict()["consumed"] == 0
    got += list(tracked)
    assert got == oracle(16)


def test_set_epoch_keeps_a_resumed_position_and_jumps_to_another_epoch():
    sampler = GlobalBatchSampler(N, G)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 2, "consumed": 5})
    sampler.set_epoch(2)  # a DistributedSampler-style loop after resuming: no repeat
    assert [*sampler.track(sampler)] == oracle(24)[2 * 8 + 5 :]
    sampler.set_epoch(0)
    assert sampler.state_dict()["epoch"] == 0 and [*sampler] == oracle(8)


def test_default_rank_is_a_world_of_one_without_a_group():
    assert not dist.is_initialized()
    sampler = GlobalBatchSampler(N, G)
    assert (sampler.rank, sampler.world_size, sampler.local_batch_size) == (0, 1, G)
    assert isinstance(torchshard.DataError("x"), torchshard.TorchShardError)


# -- the position under prefetching workers ------------------------------------------------


class Indices(Dataset):
    """Sample i is i: the batches show which samples the loop received."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def loader(sampler: GlobalBatchSampler, workers: int = 2, **kw) -> DataLoader:
    return DataLoader(Indices(N), batch_sampler=sampler, num_workers=workers, **kw)


@pytest.mark.slow
def test_workers_prefetch_ahead_and_the_tracked_position_is_what_the_loop_received():
    samplers = ranks(2)
    loaders = [loader(s, prefetch_factor=2) for s in samplers]
    loops = [s.track(dl) for s, dl in zip(samplers, loaders)]
    got = lockstep(samplers, loops, 3)
    assert all(s._handed > 3 for s in samplers)  # the workers drew ahead of the loop
    state = samplers[0].state_dict()
    assert state["consumed"] == 3 and samplers[1].state_dict() == state
    # untracked, the same loader makes the position unknowable: an error, not a guess
    untracked = GlobalBatchSampler(N, G)
    next(iter(loader(untracked)))
    with pytest.raises(DataError, match=r"position: .*drawn outside track\(\).*sampler\.track"):
        untracked.state_dict()
    resumed = ranks(3)
    for s in resumed:
        s.load_state_dict(state)
    loops = [s.track(loader(s, persistent_workers=True)) for s in resumed]
    got += lockstep(resumed, loops, 2)  # then break out, the workers having drawn ahead
    assert all(s._handed > 5 for s in resumed)
    got += lockstep(resumed, loops, 3)  # a new pass: the epoch's rest, none skipped
    got += lockstep(resumed, loops, 8)  # the next epoch: the same workers, a new pass
    assert got == oracle(16)


def test_track_refuses_a_loader_that_does_not_draw_from_the_sampler():
    sampler = GlobalBatchSampler(N, G)
    with pytest.raises(DataError, match="track: loader: expected a DataLoader built with"):
        sampler.track(DataLoader(Indices(N), batch_size=G))
    with pytest.raises(DataError, match="track: loader: expected a DataLoader built with"):
        sampler.track([[0, 1]])
    with pytest.raises(DataError, match="in_order: expected True, got False"):
        sampler.track(DataLoader(Indices(N), batch_sampler=sampler, in_order=False))


def test_two_iterations_at_once_are_an_error():
    sampler = GlobalBatchSampler(N, G)
    first = iter(sampler)
    next(first)
    second = iter(sampler)
    next(second)
    with pytest.raises(DataError, match="iterations: expected one at a time"):
        next(first)
    sampler.load_state_dict(oracle_state(sampler, epoch=0, consumed=0))
    with pytest.raises(DataError, match="iterations: expected one at a time"):
        next(second)


def oracle_state(sampler: GlobalBatchSampler, **changes) -> dict:
    return {
        "version": 1,
        "epoch": 0,
        "consumed": 0,
        "num_samples": sampler.num_samples,
        "global_batch_size": sampler.global_batch_size,
        "seed": sampler.seed,
        "shuffle": sampler.shuffle,
        "drop_last": sampler.drop_last,
        **changes,
    }


def test_the_state_is_plain_json_and_world_size_free():
    sampler = GlobalBatchSampler(N, G, rank=1, world_size=3, seed=5)
    assert sampler.state_dict() == oracle_state(sampler)
    assert json.loads(json.dumps(sampler.state_dict())) == sampler.state_dict()


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_samples=0), r"num_samples: expected an int >= 1, got 0; pass the dataset's"),
        (dict(num_samples=5.0), r"num_samples: expected an int, got 5.0"),
        (dict(global_batch_size=0), r"global_batch_size: expected an int >= 1, got 0"),
        (
            dict(global_batch_size=16, rank=0, world_size=3),
            r"global_batch_size: expected a multiple of the world size 3, got 16; .*\(e\.g\. 18\)",
        ),
        (dict(num_samples=4), r"num_samples: expected at least global_batch_size \(6\)"),
        (dict(rank=0), r"rank and world_size: expected both or neither"),
        (dict(rank=2, world_size=2), r"rank: expected 0 <= rank < world_size 2, got 2"),
        (dict(rank=-1, world_size=2), r"rank: expected an int >= 0, got -1"),
        (dict(world_size=0, rank=0), r"world_size: expected an int >= 1, got 0"),
        (dict(shuffle=1), r"shuffle: expected True or False, got 1"),
        (dict(seed="0"), r"seed: expected an int, got '0'"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    args = {"num_samples": N, "global_batch_size": G, **kwargs}
    with pytest.raises(DataError, match=message):
        GlobalBatchSampler(**args)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            dict(global_batch_size=12),
            r"global_batch_size: expected 12 \(the saved state's\), got 6",
        ),
        (dict(num_samples=51), r"num_samples: expected 51 .*build the sampler with num_samples=51"),
        (dict(seed=1), r"seed: expected 1 \(the saved state's\), got 0"),
        (dict(shuffle=False), r"shuffle: expected False"),
        (dict(drop_last=False), r"drop_last: expected False"),
        (dict(version=2), r"version: expected 1, got 2"),
        (dict(consumed=9), r"consumed: expected at most the epoch's 8 global batches, got 9"),
        (dict(epoch=-1), r"epoch: expected an int >= 0, got -1"),
        (dict(epoch="1"), r"epoch: expected an int, got '1'"),
    ],
)
def test_a_mismatched_or_malformed_state_is_a_clear_error(changes, message):
    sampler = GlobalBatchSampler(N, G)
    with pytest.raises(DataError, match=message):
        sampler.load_state_dict(oracle_state(sampler, **changes))
    assert sampler.state_dict() == oracle_state(sampler)  # unchanged


def test_a_state_with_missing_keys_or_of_the_wrong_type_is_a_clear_error():
    sampler = GlobalBatchSampler(N, G)
    state = oracle_state(sampler)
    del state["consumed"]
    with pytest.raises(DataError, match=r"missing \['consumed'\]"):
        sampler.load_state_dict(state)
    with pytest.raises(DataError, match="state: expected a dict from state_dict"):
        sampler.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(DataError, match="set_epoch: epoch: expected an int >= 0"):
        sampler.set_epoch(-1)
    with pytest.raises(DataError, match="index: expected 0 <= index < 8, got 8"):
        sampler.global_batch(0, 8)


# -- real processes: 2 ranks, resumed at 3, then at 1 -------------------------------------


def _train_like(state_json: str | None, count: int) -> tuple[list[list[int]], str, int]:
    """Receive ``count`` batches through a DataLoader with 2 workers, as a training loop
    does (crossing into the next epoch if need be); return them, the state and how far the
    workers had drawn."""
    sampler = GlobalBatchSampler(N, G, seed=11)  # rank and world size: the process group's
    if state_json is not None:
        sampler.load_state_dict(json.loads(state_json))
    # fork, as under torchrun (this harness's children would otherwise start a forkserver: 2 s)
    dl = DataLoader(
        Indices(N),
        batch_sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    tracked = sampler.track(dl)
    seen: list[list[int]] = []
    while len(seen) < count:
        for batch in tracked:
            seen.append(batch.tolist())
            if len(seen) == count:
                break
    handed = sampler._handed
    state = json.dumps(sampler.state_dict())
    states: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    assert len(set(states)) == 1, states  # every rank saves the same state
    return seen, state, handed


@pytest.mark.slow
def test_resume_at_3_then_1_rank_with_prefetching_workers_equals_the_uninterrupted_run():
    plan = [(2, 3), (3, 7), (1, 9)]  # (world size, batches): 3 + 7 crosses the epoch at 8
    got: list[list[int]] = []
    state = None
    for world, count in plan:
        results = run_distributed(_train_like, world, state, count, timeout=120)
        parts = [seen for seen, _, _ in results]
        got += [[i for p in parts for i in p[b]] for b in range(count)]  # rank order
        state = results[0][1]
        if world == 2:
            assert results[0][2] > count  # the workers had drawn ahead of the loop
    assert got == oracle(19, seed=11)
    assert json.loads(state)["epoch"] == 2 and json.loads(state)["consumed"] == 3
