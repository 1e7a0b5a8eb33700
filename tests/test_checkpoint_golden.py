"""A checkpoint written by the code before the package was rearranged loads bitwise as it did.

``golden/v2`` (see golden/README.md): sharded, bf16 with fp32 master, AdamW, 2 ranks,
written at commit 1e6ebf9; ``expected.safetensors`` is what that code restored from it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from multiprocess import run_distributed
from safetensors.torch import load_file

GOLDEN = Path(__file__).resolve().parent / "golden" / "v2"
sys.path.insert(0, str(GOLDEN))


def _load_as_today(root: str, out: str) -> None:
    from make import expected_after_load  # the same function that wrote the expectation

    expected_after_load(root, out)


def test_prehouse_checkpoint_loads_bitwise_as_the_code_that_wrote_it(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "step-00000003", root / "step-00000003")
    out = tmp_path / "today.safetensors"
    run_distributed(_load_as_today, 1, str(root), str(out), timeout=60)
    expected, today = load_file(GOLDEN / "expected.safetensors"), load_file(out)
    assert sorted(expected) == sorted(today)
    assert any(k.endswith("/exp_avg") for k in expected)  # the optimizer state is in it
    for k in expected:
        assert expected[k].dtype == today[k].dtype and torch.equal(expected[k], today[k]), k
