"""Tensor parallelism against the peer (issue 25): torch's own distributed-test
``Transformer`` (``torch.testing._internal.distributed._tensor.common_dtensor``, the model
DTensor TP is tested on), TP=2 on 2 gloo ranks, fp32, dropout 0, through its own
``Transformer.parallelize`` (DTensor: ``ColwiseParallel`` / ``RowwiseParallel``) and through
torchshard (``FlatParamModule(model, tp_plan=PEER_PLAN, mesh=init_mesh(tp=2))``), built from
the same seed and stepped with AdamW on the same batches.

The peer's plan in torchshard's styles (``Transformer.parallelize`` without sequence
parallelism):

- ``tok_embeddings``, ``pos_embeddings``: ``RowwiseParallel`` on an Embedding (its rows
  split, masked lookups all-reduced) is ``"embedding_rowwise"``;
- ``attention.wq/wk/wv``, ``feed_forward.w1``: ``ColwiseParallel`` is ``"colwise"``;
  ``attention.wo``, ``feed_forward.w2``: ``RowwiseParallel`` is ``"rowwise"``;
- ``output``: ``ColwiseParallel(output_layouts=Replicate())`` (logits gathered) is
  ``"colwise_gather_output"``; it is tied to ``tok_embeddings.weight``, and both styles
  split the vocabulary (dim 0), so the tie holds one split under both names.

What the model needed: its ``Attention.forward`` views q/k/v with ``self.n_heads`` (the
whole model's count). torchshard's split layers return plain local tensors, so each
layer's ``attention.n_heads`` is set to the local count (``n_heads // tp``), exactly what
``parallelize(..., local_output_for_attn=True)`` does for the peer. That is also the only
way the peer runs on CPU: with ``parallelize``'s default (q/k/v left DTensors of the global
shape) torch 2.13 raises in attention, ``aten._scaled_dot_product_flash_attention_for_cpu``
having no sharding strategy. A model whose attention infers the head count
(``view(b, t, -1, head_dim)``, as transformers' Llama) needs nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiprocess import run_distributed

import torchshard

TP = 2
STEPS = 5
BATCH, SEQ = 4, 16
ADAMW = dict(lr=1e-2)
PEER_PLAN = {
    "tok_embeddings": "embedding_rowwise",
    "pos_embeddings": "embedding_rowwise",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "output": "colwise_gather_output",
}


@torch.no_grad()
def gpt2_init(model: torch.nn.Module) -> torch.nn.Module:
    """GPT-2's init from seed 0: every Linear and Embedding weight N(0, 0.02), biases 0
    (LayerNorms stay 1, 0). The peer's own init gives the tied embedding and head
    ``nn.Embedding``'s N(0, 1): logits of std ~sqrt(dim), a loss of 12.6 at a vocabulary of
    8, where one fp32 ulp is 1e-6, so the 1e-6 target would ask for bitwise equality, which
    two reduction orders of the rowwise bias cannot give (DTensor adds bias / T to each
    rank's partial sum, torchshard the bias once after the sum)."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            m.weight.normal_(0.0, 0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            m.bias.zero_()
    return model


def _peer_models(**model_args: object) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    """Two copies of the peer ``Transformer`` with the same init (dropout 0, fp32): one
    parallelized by DTensor over a 1-D ``DeviceMesh`` of the world, one plain with each
    attention's head count set to the local one; and the vocabulary size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(dropout_p=0.0, **model_args)  # type: ignore[arg-type]
    peer, ours = (gpt2_init(Transformer(args)) for _ in range(2))
    tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # local_output_for_attn: on CPU, DTensor has no sharding rule for SDPA's flash kernel
    peer = Transformer.parallelize(peer, tp_mesh, False, local_output_for_attn=True)
    for layer in ours.layers:
        layer.attention.n_heads = args.n_heads // TP
    return peer, ours, args.vocab_size


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A peer parameter's whole value (the layers DTensor left alone hold plain tensors)."""
    from torch.distributed.tensor import DTensor

    return p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _against_dtensor() -> dict[str, object]:
    peer, ours, vocab = _peer_models()
    mesh = torchshard.init_mesh(tp=TP)
    fm = torchshard.FlatParamModule(ours, tp_plan=PEER_PLAN, mesh=mesh)
    trainer = torchshard.DistributedTrainer(fm, mesh=mesh)
    trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
    popt = torch.optim.AdamW(peer.parameters(), **ADAMW)
    whole = {n: _whole(p) for n, p in peer.named_parameters()}

    def gathered() -> dict[str, torch.Tensor]:
        return {
            s.name: fm.tp.gather(i, fm.module.get_parameter(s.name).detach())
            for i, s in enumerate(fm.layout.slots)
        }

    init_equal = sorted(n for n, w in gathered().items() if torch.equal(w, whole[n]))
    m = fm.module
    tied = m.output.weight is m.tok_embeddings.weight
    tied_local = tuple(m.output.weight.shape)
    gen = torch.Generator().manual_seed(1)  # the same batches on both tp ranks
    theirs, mine = [], []
    for _ in range(STEPS):
        x = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        y = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        popt.zero_grad()
        loss = _loss(peer(x), y)
        loss.backward()
        popt.step()
        theirs.append(loss.item())
        trainer.zero_grad()
        loss = _loss(fm(x), y)
        loss.backward()
        trainer.step()
        mine.append(loss.item())
    after = gathered()
    diff = max((after[n] - _whole(p)).abs().max().item() for n, p in peer.named_parameters())
    trainer.close()
    return dict(
        theirs=theirs,
        mine=mine,
        init_equal=init_equal,
        names=sorted(whole),
        tied=tied,
        tied_local=tied_local,
        vocab=vocab,
        weight_diff=diff,
    )


def test_losses_match_dtensor_tp_for_5_steps() -> None:
    ranks = run_distributed(_against_dtensor, TP, timeout=120)
    first = ranks[0]
    # the same model and init: every gathered parameter equals the peer's, bitwise
    assert first["init_equal"] == first["names"]
    # the tied head and embedding stay one parameter, split by vocabulary on both
    assert first["tied"] and first["tied_local"][0] == first["vocab"] // TP
    for r in ranks:
        assert r["theirs"] == first["theirs"] and r["mine"] == first["mine"]  # tp ranks agree
        for step, (a, b) in enumerate(zip(r["theirs"], r["mine"])):
            assert abs(a - b) <= 1e-6, (step, a, b)
    assert len(set(first["mine"])) == STEPS  # it trains: every step's loss differs
    assert first["weight_diff"] <= 1e-6
