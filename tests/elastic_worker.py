"""examples/train_gpt.py, unchanged, for the elastic test: a world of one waits after its
first checkpoint until a node joins.

    python -m torch.distributed.run --nnodes 1:2 ... tests/elastic_worker.py TRAIN_GPT_ARGS

At world size 1 the first checkpoint is committed, this line is printed (the test starts
the second node once it reads it)::

    elastic_worker: world 1 committed step-00000100; waiting for a node to join

and the worker sleeps until torchrun, seeing the new node, stops it and restarts the job at
world size 2; at any other world size train_gpt.py runs as it is. Without the wait the job
needs a long ``--steps`` as a timer (a world of one still training when the node joins),
and the larger world then trains for all of it.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

import torch.distributed as dist

from torchshard import checkpoint

TRAIN_GPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
WAIT_S = 240  # longer than the test waits: the test fails first, with the logs
_save = checkpoint.Checkpointer.save


def save_then_wait_alone(self, *args, **kwargs):
    future = _save(self, *args, **kwargs)
    if dist.get_world_size() == 1:
        path = future.wait()
        print(f"elastic_worker: world 1 committed {path.name}; waiting for a node to join")
        sys.stdout.flush()
        time.sleep(WAIT_S)  # torchrun stops this worker when the node joins
        raise SystemExit(f"elastic_worker: no node joined in {WAIT_S} s")
    return future


checkpoint.Checkpointer.save = save_then_wait_alone
sys.argv = [str(TRAIN_GPT), *sys.argv[1:]]
runpy.run_path(str(TRAIN_GPT), run_name="__main__")
