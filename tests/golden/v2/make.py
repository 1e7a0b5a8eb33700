"""Write tests/golden/v2: a sharded bf16 checkpoint (fp32 master) at 2 ranks, and what a
1-rank replicated load of it gives, by the code this runs with (PYTHONPATH picks it):

    git worktree add /tmp/old 1e6ebf9
    PYTHONPATH=/tmp/old torchrun --standalone --nproc-per-node 2 make.py OUT/ckpt save
    PYTHONPATH=/tmp/old python make.py OUT/ckpt load OUT/expected.safetensors
"""

import sys

import torch
from safetensors.torch import save_file
from torch import nn

import torchshard
from torchshard import checkpoint


class Golden(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)
        self.register_buffer("scale", torch.arange(3, dtype=torch.float32))

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x))) * self.scale


def expected_after_load(root, out):
    torch.manual_seed(1)
    fm = torchshard.FlatParamModule(Golden(), dtype=torch.bfloat16)
    t = torchshard.DistributedTrainer(fm)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2, weight_decay=0.1)
    info = checkpoint.load(root, t, optimizer=opt)
    tensors = {f"model/{k}": v.clone() for k, v in fm.state_dict().items()}
    names = {id(p): n for n, p in fm.module.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"optim/{names[id(p)]}/{k}"] = torch.as_tensor(v).clone()
    save_file(tensors, out, metadata={"step": str(info.step), "extra": str(info.extra)})
    t.close()


def main():
    root = sys.argv[1]
    if sys.argv[2] == "save":
        torch.manual_seed(0)
        fm = torchshard.FlatParamModule(Golden(), dtype=torch.bfloat16)
        t = torchshard.DistributedTrainer(fm, shard=True)
        opt = t.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            t.zero_grad()
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step + 10 * t.rank))
            fm(x.bfloat16()).float().square().mean().backward()
            t.step()
        checkpoint.save(root, t, step=3, optimizer=opt, extra={"note": "golden v2"})
        t.close()
    else:
        expected_after_load(root, sys.argv[3])


if __name__ == "__main__":
    main()
