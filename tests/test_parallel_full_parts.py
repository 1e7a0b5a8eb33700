"""The fully sharded mode's parts on their own: the parameter swap it shares with the flat
module, its collectives (both gloo strategies), and the unit storage's states and counters.
The whole mode is tested through the trainer in ``test_parallel_full.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from models import Blocks
from multiprocess import run_distributed
from torch import nn

from torchshard._flat.layout import FlatLayout
from torchshard._flat.views import swap_in
from torchshard._parallel.full.collectives import UnitComm
from torchshard._parallel.full.storage import FREE, PENDING, READY, UnitBuffers
from torchshard._parallel.units import resolve_units


def test_swap_in_replaces_every_name_of_a_slot_keeps_attributes_and_drops_the_old():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied: one slot, two names
    model[0].bias.note = "kept"
    layout = FlatLayout.from_module(model)
    flat = torch.arange(layout.numel, dtype=torch.float32)
    seen = []

    def on_swap(i, slot, old, new):
        seen.append((i, slot.name, old.shape == new.shape))

    params = swap_in(model, layout, lambda i, s: flat[s.offset : s.end].view(s.shape), on_swap)
    assert [i for i, *_ in seen] == list(range(len(layout))) and all(ok for *_, ok in seen)
    assert model[1].weight is model[0].weight is params[0]
    assert model[0].bias.note == "kept"
    for s, p in zip(layout, params):
        assert p.data_ptr() == flat[s.offset :].data_ptr(), s.name
        assert torch.equal(p.reshape(-1), flat[s.offset : s.end])


def _unit_parts(native: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Blocks(4, 8, 3)
    layout = FlatLayout.from_module(model, align_bytes=4)
    units = resolve_units(model, layout)
    comm = UnitComm(None, torch.device("cpu"), native=native)
    storage = UnitBuffers(units, layout, torch.float32, torch.float32, comm)
    # stripe r of unit u: r + 100 u, so a gathered unit shows who sent what
    for u in range(len(units)):
        storage.stripe(u).fill_(rank + 100 * u)
    out = {"states": [], "whole": True}
    for u, g in enumerate(storage.geometries):
        storage.gather(u, wait=False)
        out["states"].append(storage.state[u])
        storage.gather(u, wait=True)
        out["states"].append(storage.state[u])
        expected = torch.cat([torch.full((g.per_rank,), q + 100.0 * u) for q in range(world)])
        out["whole"] &= torch.equal(storage.buffers[u], expected)
    held = sum(b.numel() * b.element_size() for b in storage.buffers)
    out["transient"] = (storage.transient, held, storage.peak_transient)
    storage.release_all()
    out["freed"] = (storage.transient, [storage.state[u] for u in range(len(units))])
    out["storage"] = sum(b.untyped_storage().nbytes() for b in storage.buffers)
    # a reduce-scatter of every rank's unit gradient: this rank's stripe of the sum
    g = storage.geometries[1]
    grad = torch.arange(g.total, dtype=torch.float32) * (rank + 1)
    mine, works = comm.reduce_scatter(1, grad.clone(), g.per_rank, dist.ReduceOp.SUM)
    for w in works:
        w.wait()
    a = rank * g.per_rank
    scale = world * (world + 1) / 2
    out["reduced"] = torch.equal(mine, torch.arange(a, a + g.per_rank, dtype=torch.float32) * scale)
    out["digest"] = comm.order.digest()
    out["stats"] = (comm.stats.bytes_gathered, comm.stats.bytes_reduced)
    return out


def test_unit_storage_gathers_counts_and_frees_with_either_gloo_strategy():
    got = {n: run_distributed(_unit_parts, 2, n, timeout=120) for n in (False, True)}
    for native, results in got.items():
        for r in results:
            assert r["whole"] and r["reduced"], (native, r)
            n_units = len(r["states"]) // 2
            assert r["states"][0::2] == [PENDING] * n_units, r
            assert r["states"][1::2] == [READY] * n_units, r
            transient, held, peak = r["transient"]
            assert transient == held == peak, r
            assert r["freed"] == (0, [FREE] * n_units) and r["storage"] == 0, r
        # the same collectives in the same order on both ranks, and whichever strategy
        assert len({r["digest"] for r in results}) == 1
        assert results[0]["stats"] == got[False][0]["stats"]
    assert got[True][0]["digest"] == got[False][0]["digest"]
