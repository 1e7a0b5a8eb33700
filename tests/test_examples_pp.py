"""train_gpt.py with ``--pp``: the pipeline trains as the same run data-parallel over the
other ranks (bitwise: a stage computes what the whole model computes, microbatch by
microbatch), bad ``--pp`` combinations fail on every rank before a step, and checkpoints
resume at another pipeline degree under torchrun."""

from __future__ import annotations

import pytest
import torch
from multiprocess import WorkerError, run_distributed
from test_examples import GPT, TRAIN_GPT, final_weights, logged_losses, run
from test_parallel_launch import torchrun

pytestmark = pytest.mark.timeout(300)

TINY = [*GPT, "--steps", "6", "--log-every", "3", "--ckpt-dir", ""]


def _main(argv: list[str]) -> float:
    torch.set_num_threads(1)
    return __import__("train_gpt").main(argv)


@pytest.mark.parametrize(
    ("extra", "schedule"),
    [([], "1F1B"), (["--shard"], "GPipe"), (["--shard"], "Interleaved1F1B")],
)
def test_train_gpt_pp2_trains_as_data_parallel_over_the_other_ranks(extra, schedule):
    """4 ranks, --pp 2: the batches go by data-parallel rank (both stages of a replica read
    the same), so the run is the 2-rank data-parallel run up to float32 rounding (each
    rank's 6 sequences go through as 2 microbatches of 3, their losses halved, against one
    mean over 6); every rank reports the same validation loss."""
    pp = run_distributed(
        _main, 4, [*TINY, *extra, "--pp", "2", "--microbatches", "2", "--schedule", schedule]
    )
    dp = run_distributed(_main, 2, [*TINY, *extra])
    assert len(set(pp)) == 1, pp
    assert pp[0] == pytest.approx(dp[0], abs=2e-4), (pp, dp)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--pp", "2", "--tp", "2"], "argument --pp: pipeline stages do not run with --tp"),
        (["--pp", "2", "--shard", "full"], "do not run with --shard full"),
        (["--pp", "2", "--grad-accum", "2"], "--microbatches for accumulation"),
        (["--microbatches", "2"], "--microbatches and --schedule need --pp"),
        (["--pp", "0"], "expected a number of stages >= 1, got 0"),
    ],
)
def test_train_gpt_refuses_pp_flags_it_cannot_run(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        __import__("train_gpt").parse_args([*TINY, *flags])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--pp", "2", "--microbatches", "4"], "--batch-size 12: each of the 2 data-parallel"),
        (["--pp", "3"], "--pp 3: init_mesh(pp=3): pp does not divide the world size 4"),
        (["--pp", "4", "--schedule", "Interleaved1F1B", "--microbatches", "4"], "8 stages need"),
    ],
)
def test_a_pp_that_does_not_fit_exits_on_every_rank(flags, says):
    """A batch the microbatches do not cut, a degree the world does not take, more stages
    than the model has layers: the same SystemExit on every rank, before any step."""
    with pytest.raises(WorkerError) as e:
        run_distributed(_main, 4, [*TINY, *flags])
    assert sorted(e.value.errors) == list(range(4))
    for text in e.value.errors.values():
        assert "SystemExit" in text and says in text, text


@pytest.mark.slow
def test_train_gpt_pp2_resumes_at_another_pipeline_degree(tmp_path):
    """Saved at (pp 2, dp 2) at step 4 (by the uninterrupted run): resumed at (pp 2, dp 2) it
    ends bitwise as the uninterrupted run; at pp 1 (a plain trainer over 2 ranks) and pp 4 it
    logs the same step-8 loss up to float32 rounding; the files are the one-process picture."""
    a, b = tmp_path / "a", tmp_path / "b"
    gpt = [*GPT, "--steps", "8", "--log-every", "4", "--save-every", "4", "--shard"]
    four = ("--standalone", "--nproc-per-node", "4")
    pp2 = ["--pp", "2", "--microbatches", "2"]
    whole = run(torchrun(*four, TRAIN_GPT, *gpt, *pp2, "--ckpt-dir", str(b)))
    assert "(pipeline: pp 2 x 2 data-parallel)" in whole, whole
    step4 = b / "step-00000004"
    assert {"wte.weight", "blocks.1.mlp.0.weight"} <= set(final_weights(step4))
    again = ["--ckpt-dir", str(a), "--resume-from", str(step4)]
    resumed = run(torchrun(*four, TRAIN_GPT, *gpt, *pp2, *again))
    assert f"resumed from {step4} (saved at world size 4, pp 2" in resumed, resumed
    ours, theirs = final_weights(a / "step-00000008"), final_weights(b / "step-00000008")
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "resumed weights differ"
    for nproc, flags in ((2, []), (4, ["--pp", "4", "--microbatches", "4"])):
        launch = ("--standalone", "--nproc-per-node", str(nproc))
        again = [*gpt, *flags, "--ckpt-dir", "", "--resume-from", str(step4)]
        text = run(torchrun(*launch, TRAIN_GPT, *again))
        assert f"resumed from {step4} (saved at world size 4, pp 2" in text, text
        got, want = logged_losses(text), logged_losses(whole)
        assert got[8] == pytest.approx(want[8], abs=2e-4), (nproc, flags, text)
