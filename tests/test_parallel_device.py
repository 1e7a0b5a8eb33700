"""Which device a rank trains on: choose_device() over every backend string and placement,
and the trainer and init_distributed() asking it (review: GPU readiness #1, #12).

CPU stand-ins: torch.cuda's answers are monkeypatched, so these run here and fail on the
bugs a GPU box would show (a trainer that silently stays on the CPU, two ranks on one GPU).
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_distributed

import torchshard
from torchshard import DeviceError, FlatParamModule
from torchshard._dist import backend_devices, choose_device

CUDA, CPU = torch.device("cuda", 1), torch.device("cpu")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("nccl", {"cuda": "nccl"}),
        ("NCCL", {"cuda": "nccl"}),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("undefined", {"cpu": "gloo", "cuda": "nccl"}),  # init_process_group() with no backend
        ("", {"cpu": "gloo", "cuda": "nccl"}),
        ("cuda:nccl", {"cuda": "nccl"}),
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        ("cpu:gloo, cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}),  # get_backend_config("gloo")
        ("mpi", {"cpu": "mpi"}),
    ],
)
def test_backend_devices_reads_every_spelling(config, expected):
    assert backend_devices(config) == expected


def _choose(config: str, **over):
    kw = dict(
        backends=backend_devices(config),
        cuda_available=True,
        device_count=2,
        local_rank=1,
        local_world_size=2,
        current=0,
    )
    kw.update(over)
    return choose_device(**kw)


# Every backend string a user can hand torch, with and without CUDA: CUDA exactly when CUDA
# is there and NCCL serves CUDA tensors (the name "nccl" was the only one accepted before).
@pytest.mark.parametrize(
    ("config", "uses_cuda"),
    [
        ("nccl", True),
        ("cuda:nccl", True),
        ("undefined", True),
        ("cpu:gloo,cuda:nccl", True),
        ("gloo", False),
        ("cpu:gloo", False),
        ("mpi", False),
    ],
)
@pytest.mark.parametrize("cuda_available", [True, False])
def test_cuda_exactly_when_nccl_serves_cuda(config, uses_cuda, cuda_available):
    device = _choose(config, cuda_available=cuda_available)
    assert device == (CUDA if uses_cuda and cuda_available else CPU)


@pytest.mark.parametrize(("local_world", "count"), [(2, 1), (3, 2), (8, 4), (9, 8)])
def test_more_ranks_per_node_than_gpus_is_an_error_naming_both(local_world, count):
    with pytest.raises(DeviceError, match=rf"{local_world} ranks on this node .* {count} visible"):
        _choose("nccl", local_world_size=local_world, device_count=count, local_rank=0)


@pytest.mark.parametrize(("local_world", "count"), [(1, 1), (2, 2), (4, 8), (8, 8)])
def test_as_many_or_fewer_ranks_than_gpus_each_get_their_local_rank(local_world, count):
    got = [
        _choose("nccl", local_world_size=local_world, device_count=count, local_rank=r)
        for r in range(local_world)
    ]
    assert got == [torch.device("cuda", r) for r in range(local_world)]


def test_a_local_rank_without_a_gpu_is_an_error():
    with pytest.raises(DeviceError, match="LOCAL_RANK=2 but 2 visible"):
        _choose("nccl", local_world_size=None, local_rank=2)


def test_oversubscription_on_gloo_is_fine():
    assert _choose("gloo", local_world_size=8, device_count=1, local_rank=5) == CPU


def test_the_module_s_gpu_wins_over_the_local_rank():
    placed = torch.device("cuda", 0)
    assert _choose("cpu:gloo,cuda:nccl", module_device=placed) == placed
    # a CPU- or meta-built model is placed by the rules, not kept where it was built
    assert _choose("nccl", module_device=CPU) == CUDA
    assert _choose("nccl", module_device=torch.device("meta")) == CUDA


def test_a_bound_group_device_wins():
    bound = torch.device("cuda", 0)
    assert _choose("nccl", bound=bound, module_device=torch.device("cuda", 1)) == bound


def test_without_local_rank_the_current_device_is_used():
    # e.g. mp.spawn scripts that call torch.cuda.set_device(rank) themselves
    assert _choose("nccl", local_rank=None, local_world_size=None, current=1) == CUDA


def _fake_gpus(monkeypatch, count: int = 2) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _trainer_pick(config: str) -> str:
    """The trainer's choice for a gloo group that claims ``config`` on a 2-GPU node."""
    import torch.distributed as dist

    from torchshard._parallel import setup

    mp = pytest.MonkeyPatch()
    try:
        _fake_gpus(mp)
        mp.setattr(dist, "get_backend_config", lambda group=None: config)
        fm = FlatParamModule(torch.nn.Linear(4, 4))
        return str(setup.pick_device(fm, None, None))
    finally:
        mp.undo()


@pytest.mark.parametrize("config", ["undefined", "cuda:nccl", "cpu:gloo,cuda:nccl", "nccl"])
def test_the_trainer_asks_what_the_group_can_do_not_its_name(config):
    # LOCAL_RANK=1 of LOCAL_WORLD_SIZE=2 in run_distributed's torchrun-like env
    assert run_distributed(_trainer_pick, 2, config, timeout=60) == ["cuda:0", "cuda:1"]


def test_init_distributed_refuses_a_multi_rank_world_without_local_rank(monkeypatch):
    import torch.distributed as dist

    assert not dist.is_initialized()
    _fake_gpus(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(DeviceError, match="LOCAL_RANK is not"):
        torchshard.init_distributed()
    assert not dist.is_initialized()


def test_init_distributed_refuses_more_ranks_than_gpus(monkeypatch):
    import torch.distributed as dist

    _fake_gpus(monkeypatch, count=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(DeviceError, match=r"3 ranks on this node .* 2 visible"):
        torchshard.init_distributed()
    assert not dist.is_initialized()
