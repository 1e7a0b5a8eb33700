"""Write tests/golden/v5: a checkpoint of format 5 (a PowerSGD run's compression state) at 2
ranks, and what a 1-rank load of it gives, by the code this runs with (PYTHONPATH picks it):

    PYTHONPATH=. torchrun --standalone --nproc-per-node 2 tests/golden/v5/make.py OUT save
    PYTHONPATH=. python tests/golden/v5/make.py OUT load OUT/expected.safetensors
"""

import sys

import torch
from safetensors.torch import save_file
from torch import nn

import torchshard
from torchshard import checkpoint
from torchshard.comm import PowerSGD

COMM = PowerSGD(rank=2, start_step=1)


class Golden(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)  # compressed at rank 2: 16 * 8 > 2 * (16 + 8) * 2
        self.head = nn.Linear(16, 3)  # dense: too small to compress

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


def expected_after_load(root, out):
    torch.manual_seed(1)
    t = torchshard.DistributedTrainer(torchshard.FlatParamModule(Golden()), comm=COMM)
    opt = t.make_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    info = checkpoint.load(root, t, optimizer=opt)
    tensors = {f"model/{k}": v.clone() for k, v in t.module.state_dict().items()}
    tensors |= {f"comm/{k}": v.clone() for k, v in t.comm_state().items()}
    names = {id(p): n for n, p in t.module.module.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"optim/{names[id(p)]}/{k}"] = torch.as_tensor(v).clone()
    save_file(tensors, out, metadata={"step": str(info.step), "extra": str(info.extra)})
    t.close()


def main():
    root = sys.argv[1]
    if sys.argv[2] == "save":
        torch.manual_seed(0)
        t = torchshard.DistributedTrainer(torchshard.FlatParamModule(Golden()), comm=COMM)
        opt = t.make_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        for step in range(3):
            t.zero_grad()
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step + 10 * t.rank))
            t.module(x).square().mean().backward()
            t.step()
        checkpoint.save(root, t, step=3, optimizer=opt, extra={"note": "golden v5"})
        t.close()
    else:
        expected_after_load(root, sys.argv[3])


if __name__ == "__main__":
    main()
