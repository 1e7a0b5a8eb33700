"""A lossy comm with tensor parallelism (issue 25): training, and its state in a checkpoint.

- PowerSGD at (dp2, tp2) compresses each tp rank's local gradients over ``mesh.dp``: the run
  is the (dp1, tp2) one (PowerSGD's dp invariance, per tp rank) to 1e-12 in float64, the
  replicated parameters stay bitwise alike on the tp ranks, and it differs from the dense
  run; its error feedback is laid out like the local gradient space. TopK with tp > 1 is
  refused (its pick over a bucket mixing split and replicated parameters would let the tp
  ranks' replicated parameters drift apart: measured before the refusal).
- A (2, 2) save stores the mean error in the whole model's gradient space (the TP=1
  picture: equal, bit for bit, to the dp mean gathered over tp) and the tp ranks' ``Q`` in
  order. Loaded at (2, 2) or (1, 2) (the same degree) every rank holds the mean error's
  pieces and its own rank's ``Q``, and the resumed run is the uninterrupted one to 1e-12
  (``comm_error="reset"``: zero error, and the run differs). At (2, 1) or (1, 1) the error
  loads as the whole picture and the trainer keeps its own ``Q``, saying so. A TP=1
  checkpoint's error loads at tp=2 alike.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, TP_PLAN, GPTConfig, init_gpt_weights
from multiprocess import run_distributed
from safetensors.torch import load_file
from test_checkpoint_tp import _steps

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, checkpoint
from torchshard.comm import AllReduce, CommError, PowerSGD, TopK

CFG = GPTConfig.preset("tiny")
POWERSGD = PowerSGD(rank=2, start_step=1)
SAVE, END = 2, 4


def _trainer(dp: int, tp: int, comm: object = POWERSGD):
    torch.set_default_dtype(torch.float64)
    try:
        mesh = torchshard.init_mesh(tp=tp)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(CFG)
    finally:
        torch.set_default_dtype(torch.float32)
    assert mesh.dp_size == dp
    split = {"tp_plan": TP_PLAN, "mesh": mesh} if tp > 1 else {}
    fm = FlatParamModule(model, **split)
    tr = DistributedTrainer(fm, mesh=mesh, comm=comm, init_fn=init_gpt_weights)
    return mesh, fm, tr, tr.make_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)


def _whole(fm, i: int, x: torch.Tensor) -> torch.Tensor:
    return fm.tp.gather(i, x) if fm.tp is not None else x


def _weights(fm) -> dict[str, torch.Tensor]:
    return {
        s.name: _whole(fm, i, fm.module.get_parameter(s.name).detach()).clone()
        for i, s in enumerate(fm.layout.slots)
    }


def _whole_error(mesh, fm, tr, mean: bool) -> torch.Tensor:
    """The error feedback (``mean``: averaged over dp first) in the whole gradient space."""
    error = tr.comm_state()["error"].clone()
    if mean and mesh.dp_size > 1:
        dist.all_reduce(error, group=mesh.dp)
        error /= mesh.dp_size
    whole = fm.tp.whole if fm.tp is not None else fm.layout
    out = torch.zeros(whole.grad_layout.numel, dtype=error.dtype)
    for i, ls, ws in zip(fm.layout.trainable, fm.layout.grad_layout.slots, whole.grad_layout.slots):
        piece = error[ls.offset : ls.offset + ls.numel].view(ls.shape)
        out[ws.offset : ws.offset + ws.numel] = _whole(fm, i, piece).reshape(-1)
    return out


# -- training --------------------------------------------------------------------------------
def _train(dp: int, tp: int, comm: object) -> dict:
    mesh, fm, tr, opt = _trainer(dp, tp, comm)
    _steps(mesh, fm, tr, opt, 0, 4)
    state = tr.comm_state()
    replicated = {
        s.name: fm.module.get_parameter(s.name).detach().clone()
        for i, s in enumerate(fm.layout.slots)
        if fm.tp is not None and fm.tp.splits[i] is None
    }
    out = {"weights": _weights(fm), "replicated": replicated}
    out["local"] = state["error"].numel() if state else 0
    out["grads"] = fm.layout.grad_layout.numel
    tr.close()
    return out


def test_powersgd_compresses_per_tp_rank_over_dp():
    got = run_distributed(_train, 4, 2, 2, POWERSGD, timeout=180)
    one_dp = run_distributed(_train, 2, 1, 2, POWERSGD, timeout=180)[0]
    dense = run_distributed(_train, 4, 2, 2, AllReduce(), timeout=180)[0]
    for name, w in got[0]["weights"].items():
        assert (w - one_dp["weights"][name]).abs().max() <= 1e-12, name
    assert max((w - dense["weights"][n]).abs().max() for n, w in got[0]["weights"].items()) > 1e-6
    assert got[0]["replicated"]
    for a, b in ((0, 1), (2, 3)):  # the tp pairs: their replicated parameters, bit for bit
        for name, w in got[a]["replicated"].items():
            assert torch.equal(w, got[b]["replicated"][name]), (a, b, name)
    assert all(r["local"] == r["grads"] for r in got)  # the local gradient space


def _topk_refused() -> str:
    try:
        _trainer(2, 2, TopK(ratio=0.1))
    except CommError as e:
        return str(e)
    return "built"


def test_topk_with_tp_is_refused_on_every_rank():
    for message in run_distributed(_topk_refused, 4, timeout=120):
        assert "TopK(ratio=0.1" in message and "tp=2" in message, message


# -- checkpoints -----------------------------------------------------------------------------
def _save(root: str, dp: int, tp: int) -> dict:
    """Steps 0 .. END - 1, saved after SAVE: the mean error and Q at the save, and the end."""
    mesh, fm, tr, opt = _trainer(dp, tp)
    _steps(mesh, fm, tr, opt, 0, SAVE)
    q = tr.comm_state()["powersgd_q"].clone()
    qs = [q]
    if fm.tp is not None:
        qs = [torch.empty_like(q) for _ in range(tp)]
        dist.all_gather(qs, q, group=fm.tp.group)
    saved = {"mean": _whole_error(mesh, fm, tr, mean=True), "q": qs}
    checkpoint.save(root, tr, step=SAVE, optimizer=opt)
    _steps(mesh, fm, tr, opt, SAVE, END)
    saved["end"] = _weights(fm)
    tr.close()
    return saved


def _resume(root: str, dp: int, tp: int, comm_error: str) -> dict:
    mesh, fm, tr, opt = _trainer(dp, tp)
    own = tr.comm_state()["powersgd_q"].clone()
    info = checkpoint.load(root, tr, optimizer=opt, comm_error=comm_error)
    state = {k: v.clone() for k, v in tr.comm_state().items()}
    out = {"note": info.comm, "step": info.step, "steps": int(state["steps"])}
    out["error"] = _whole_error(mesh, fm, tr, mean=False)
    out["q"], out["own_q"] = state["powersgd_q"], torch.equal(state["powersgd_q"], own)
    out["tp_rank"] = mesh.tp_rank
    _steps(mesh, fm, tr, opt, info.step, END)
    out["end"] = _weights(fm)
    tr.close()
    return out


def _diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.fixture(scope="module")
def saved_22(tmp_path_factory):
    root = tmp_path_factory.mktemp("psgd22")
    return root, run_distributed(_save, 4, str(root), 2, 2, timeout=180)[0]


def test_the_22_save_holds_the_whole_mean_error_and_each_tp_ranks_q(saved_22):
    root, saved = saved_22
    (path,) = root.glob("step-*")
    meta = json.loads((path / "metadata.json").read_text())
    comm = meta["comm"]
    assert comm["flat"]["error"]["numel"] == saved["mean"].numel()
    assert comm["flat"]["powersgd_q"]["numel"] == 2 * saved["q"][0].numel()
    files = [load_file(path / f["file"]) for f in comm["files"]]  # in range order
    error = torch.cat([f["error"] for f in files if "error" in f])
    q = torch.cat([f["powersgd_q"] for f in files if "powersgd_q" in f])
    assert torch.equal(error, saved["mean"]) and saved["mean"].any()
    assert torch.equal(q, torch.cat(saved["q"]))
    assert checkpoint.inspect_checkpoint(path).ok


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 2)])
def test_the_same_degree_resumes_the_run(saved_22, dp, tp):
    root, saved = saved_22
    for r in run_distributed(_resume, dp * tp, str(root), dp, tp, "mean", timeout=180):
        assert _diff(r["end"], saved["end"]) <= 1e-12, _diff(r["end"], saved["end"])
        assert torch.equal(r["error"], saved["mean"])  # every rank: the mean's pieces
        assert torch.equal(r["q"], saved["q"][r["tp_rank"]])
        assert r["steps"] == SAVE == r["step"] and "powersgd_q, steps=2" in r["note"]
    reset = run_distributed(_resume, dp * tp, str(root), dp, tp, "reset", timeout=180)
    for r in reset:
        assert not r["error"].any() and torch.equal(r["q"], saved["q"][r["tp_rank"]])
        assert _diff(r["end"], saved["end"]) > 1e-6  # the error mattered


@pytest.mark.parametrize("dp, tp", [(2, 1), (1, 1)])
def test_another_degree_loads_the_error_and_keeps_its_own_q(saved_22, dp, tp):
    root, saved = saved_22
    for r in run_distributed(_resume, dp * tp, str(root), dp, tp, "mean", timeout=180):
        assert torch.equal(r["error"], saved["mean"]) and r["own_q"]
        assert r["steps"] == SAVE and "tp=2's pieces" in r["note"], r["note"]
        assert "resets Q" in r["note"] and all(w.isfinite().all() for w in r["end"].values())


def test_a_tp1_checkpoint_loads_its_error_at_tp2(tmp_path):
    saved = run_distributed(_save, 2, str(tmp_path), 2, 1, timeout=180)[0]
    for r in run_distributed(_resume, 2, str(tmp_path), 1, 2, "mean", timeout=180):
        assert torch.equal(r["error"], saved["mean"]) and r["own_q"]
        assert "tp=1's pieces" in r["note"], r["note"]
