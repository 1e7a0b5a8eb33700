"""A trainer over a process subgroup (``process_group=dist.new_group(...)``) with ``src != 0``,
against DDP on the same group, in every mode; and a checkpoint saved and loaded inside it.

A group rank is not a global rank: torch's broadcast and reduce take global ranks, so the
trainer's broadcast from ``src``, the sharded mode's reduce to each slice's owner, the fully
sharded mode's unit broadcasts from ``src`` and its gathers and reductions from and to each
stripe's owner, and the checkpoint load's broadcasts must map one to the other. In group [1, 2] of 3 the group's
rank 0 is global rank 1 (a rank of the group: mistaking one for the other goes unnoticed by
the collective, but not by the weights); in group [0, 2, 3] of 4, group rank 1 is global 2.
Every rank starts from its own weights, so the oracle, DDP over the same group started from
``src``'s, only agrees if the trainer broadcast the right rank's. Bitwise in a group of 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_distributed
from sharded_harness import KW, Model, batch, differences, flat_state, new_trainer, torch_groups
from torch.nn.parallel import DistributedDataParallel as DDP

from torchshard import DistributedTrainer, checkpoint

SAVE_AT, STEPS = 3, 6


def compare(trainer: DistributedTrainer, ref: torch.nn.Module, exact: bool, where: str) -> None:
    model = trainer.module.module
    with trainer.gathered():  # the fully sharded mode's weights exist inside this only
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if exact:
                assert torch.equal(p, q), f"{where}: {name} differs from DDP"
            else:
                # AdamW divides by sqrt(v): a last-bit difference in a nearly zero mean gradient
                # moves an update (up to lr = 1e-2) by ~1e-6
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{where}: {name}")


def _subgroup(members: list[int], src: int, shard: bool | str, root: str) -> dict | None:
    rank = dist.get_rank()
    group = dist.new_group(members)  # every rank of the world calls it
    if rank not in members:
        dist.barrier()  # the default group still works beside the subgroup
        return None
    grank, size = dist.get_rank(group), len(members)
    exact = size == 2
    trainer = new_trainer(shard, group=group, src=src, seed=100 + rank)  # each its own weights
    torch.manual_seed(100 + members[src])  # the oracle starts from src's weights
    ref = Model()
    ddp = DDP(ref, process_group=group)
    ref_opt = torch.optim.AdamW(torch_groups(ref), **KW)
    compare(trainer, ref, True, "after the broadcast from src")
    ckpt = checkpoint.Checkpointer(root, keep_last=None)
    saved, future = None, None
    for step in range(STEPS):
        trainer.zero_grad()
        trainer.module(*batch(grank, step))[1].backward()
        trainer.step()
        ref_opt.zero_grad()
        ddp(*batch(grank, step))[1].backward()
        ref_opt.step()
        compare(trainer, ref, exact, f"step {step}")
        if step + 1 == SAVE_AT:  # saved in the background while training goes on
            future = ckpt.save(trainer, step=SAVE_AT, optimizer=trainer.optimizer)
            saved = flat_state(trainer)
    assert future is not None and saved is not None
    path = future.wait()
    ckpt.close()
    final = flat_state(trainer)
    trainer.assert_in_sync()
    trainer.close()

    # A fresh trainer in the same group, from other weights, loads the checkpoint and goes on:
    # bitwise as the run that never stopped.
    fresh = new_trainer(shard, group=group, src=size - 1 - src, seed=200 + rank)
    info = checkpoint.load(root, fresh, optimizer=fresh.optimizer)
    out = {"path": str(path), "step": info.step, "loaded": differences(flat_state(fresh), saved)}
    for step in range(SAVE_AT, STEPS):
        fresh.zero_grad()
        fresh.module(*batch(grank, step))[1].backward()
        fresh.step()
    out["continued"] = differences(flat_state(fresh), final)
    fresh.assert_in_sync()
    fresh.close()
    dist.barrier()
    return out


CASES = [(3, [1, 2], 1), (4, [0, 2, 3], 2)]


@pytest.mark.parametrize("shard", [False, True, "full"], ids=["replicated", "sharded", "full"])
@pytest.mark.parametrize(
    ("world_size", "members", "src"),
    [pytest.param(*CASES[0], id="ranks-1-2-of-3"), pytest.param(*CASES[1], id="ranks-0-2-3-of-4")],
)
def test_subgroup_matches_ddp_on_the_group_and_checkpoints_inside_it(
    tmp_path, world_size, members, src, shard
):
    root = tmp_path / "ckpt"
    results = run_distributed(_subgroup, world_size, members, src, shard, str(root), timeout=180)
    for rank, r in enumerate(results):
        if rank not in members:
            assert r is None
            continue
        assert r["step"] == SAVE_AT and r["path"] == str(root / f"step-{SAVE_AT:08d}"), r
        assert not r["loaded"], f"rank {rank}: the load differs from the save: {r['loaded']}"
        assert not r["continued"], f"rank {rank}: the continuation differs: {r['continued']}"
    report = checkpoint.inspect_checkpoint(root / f"step-{SAVE_AT:08d}")
    assert report.ok and report.world_size == len(members), report
