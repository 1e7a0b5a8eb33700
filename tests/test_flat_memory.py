"""Host memory of wrapping and binding, measured in a fresh subprocess.

Each scenario runs in its own process, resets the kernel's resident-size
high-water mark (``/proc/self/clear_refs``) right before the step, and
compares the peak after it (``VmHWM``) with the resident size before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

PRELUDE = """
import json, resource, sys
import torch
from torch import nn
sys.path.insert(0, {examples!r})
from gpt import GPT, GPTConfig, init_gpt_weights
from torchshard import FlatParamModule

torch.set_num_threads(1)
PAGE = resource.getpagesize()

def rss():  # resident bytes now
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

def start():  # reset the high-water mark; the resident bytes now
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss()

def peak():  # highest resident bytes since start()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")
"""


def run_child(body: str) -> dict:
    code = PRELUDE.format(examples=str(EXAMPLES)) + body
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_wrapping_a_1b_meta_model_costs_little_host_memory():
    r = run_child("""
with torch.device("meta"):
    model = GPT(GPTConfig.preset("1.3b"))
before = start()
fm = FlatParamModule(model)
print(json.dumps(dict(numel=fm.layout.param_numel, grew=peak() - before)))
""")
    assert r["numel"] > 1.0e9
    assert r["grew"] < 64 * 2**20, r  # megabytes, against 5 GB of fp32 weights


@pytest.mark.slow
def test_binding_a_100m_meta_model_allocates_only_the_buffers():
    r = run_child("""
cfg = GPTConfig(vocab_size=16384, block_size=512, n_layer=12, n_head=12, n_embd=768)
with torch.device("meta"):
    model = GPT(cfg)
fm = FlatParamModule(model)
before = start()
flat = torch.empty(fm.numel)
fm.bind(flat)
fm.init_weights(init_gpt_weights)
after_init = peak()
fm.flat_grad.fill_(1.0)  # every gradient touched
after_grads = peak()
print(json.dumps(dict(numel=fm.layout.param_numel, nbytes=fm.layout.nbytes,
                      init=after_init - before, grads=after_grads - before)))
""")
    assert 0.9e8 < r["numel"] < 1.1e8
    # parameters only: the gradient buffer is not touched yet
    assert r["init"] <= 1.05 * r["nbytes"], r
    assert r["grads"] <= 1.05 * 2 * r["nbytes"], r


@pytest.mark.slow
def test_binding_a_model_with_weights_never_holds_two_copies():
    r = run_child("""
torch.manual_seed(0)
# 64 MiB per weight: each is its own mmap, so freeing it returns it to the OS
model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(6)])
checksum = sum(p.sum().item() for p in model.parameters())
nbytes = sum(p.numel() * 4 for p in model.parameters())
before = start()
fm = FlatParamModule(model)
fm.bind(torch.empty(fm.numel))
grew = peak() - before
same = sum(p.sum().item() for p in model.parameters()) == checksum
print(json.dumps(dict(nbytes=nbytes, grew=grew, after=rss() - before, same=same)))
""")
    assert r["same"]
    # two copies at once would be +1.0x; one parameter in flight is +1/6
    assert r["grew"] <= 0.25 * r["nbytes"], r
    assert r["after"] <= 0.05 * r["nbytes"], r
