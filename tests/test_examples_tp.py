"""The examples with ``--tp``: train_gpt.py (gpt.py's TP_PLAN) and finetune_hf.py
(``tp_plan="auto"``) train at dp2 x tp2 as the same run data-parallel over 2 ranks, in every
``--shard`` mode and with ``--dp-replicate``; bad ``--tp`` values fail on every rank before a
step; checkpoints resume at another TP degree."""

from __future__ import annotations

import sys

import pytest
import torch
from multiprocess import WorkerError, run_distributed
from test_examples import FINETUNE, GPT, TRAIN_GPT, final_weights, logged_losses, needs_hf, run
from test_parallel_launch import torchrun

pytestmark = pytest.mark.timeout(300)

# train_gpt.py without checkpoints (the lines it logs are not needed: main returns the
# validation loss after training, which every step's data and update feed)
TINY = [*GPT, "--steps", "6", "--log-every", "3", "--ckpt-dir", ""]
# finetune_hf.py's Llama (tied head, 4 heads, 2 kv heads), a few short steps
FINE = [
    *("--steps", "4", "--block-size", "16", "--batch-size", "4", "--log-every", "2"),
    *("--threads", "1", "--num-workers", "0", "--ckpt-dir", ""),
]
MODES = {"replicated": [], "sharded": ["--shard"], "full": ["--shard", "full"]}


def _main(script: str, argv: list[str]) -> object:
    torch.set_num_threads(1)
    return __import__(script).main(argv)


def _val_loss(out: object) -> float:
    return out["val_loss"] if isinstance(out, dict) else out  # type: ignore[index]


@pytest.mark.parametrize(
    ("mode", "extra"),
    [*((m, []) for m in MODES), ("sharded", ["--dp-replicate", "2"])],
    ids=[*MODES, "hybrid"],
)
def test_train_gpt_tp2_trains_as_data_parallel_over_the_other_ranks(mode, extra):
    """4 ranks, --tp 2: the batches go by data-parallel rank (the tp ranks of a group read
    the same), so the run is the 2-rank data-parallel run up to float32 rounding; every rank
    reports the same validation loss."""
    tp = run_distributed(_main, 4, "train_gpt", [*TINY, *MODES[mode], *extra, "--tp", "2"])
    dp = run_distributed(_main, 2, "train_gpt", [*TINY, *MODES[mode]])
    assert len(set(tp)) == 1, tp
    assert tp[0] == pytest.approx(dp[0], abs=2e-4), (tp, dp)


@pytest.mark.slow
def test_train_gpt_tp2_under_torchrun_logs_its_mesh_and_learns():
    """The documented launch: torchrun, 4 processes, --tp 2 with 2 replicas of a fully
    sharded group of one; rank 0 alone logs, the loss falls, evaluation ends the run."""
    four = ("--standalone", "--nproc-per-node", "4")
    args = [*GPT, "--steps", "12", "--log-every", "4", "--ckpt-dir", ""]
    text = run(
        torchrun(*four, TRAIN_GPT, *args, "--tp", "2", "--shard", "full", "--dp-replicate", "2")
    )
    assert (
        "world 4 on cpu, fully sharded (hybrid: 2 replicas x 1 shards, tensor parallel: "
        "2 data-parallel x tp 2)" in text
    ), text
    losses = logged_losses(text)
    assert list(losses) == [4, 8, 12] and losses[12] < losses[4], text
    assert text.count("done: first logged loss") == 1, text


def small_llama(tmp_path) -> list[str]:
    """``--init-from`` a Llama smaller than the example's (2 layers of width 32, a tied head),
    saved by transformers from a random init."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    return ["--init-from", str(tmp_path / "llama")]


def test_finetune_hf_tp2_trains_as_data_parallel_over_the_other_ranks(tmp_path):
    """4 ranks, --tp 2 (tp_plan="auto"), from a from_pretrained directory (read by data-parallel
    rank 0's tp ranks, each keeping its piece; broadcast to the other data-parallel rank):
    the 2-rank data-parallel run's losses up to float32 rounding, the same on every rank.
    (The meta-built random init under TP: tests/test_tp_hf.py.)"""
    needs_hf()
    fine = [*FINE, *small_llama(tmp_path), "--shard"]
    tp = run_distributed(_main, 4, "finetune_hf", [*fine, "--tp", "2"])
    dp = run_distributed(_main, 2, "finetune_hf", fine)
    for key in ("val_loss", "last_loss"):
        assert len({r[key] for r in tp}) == 1, tp
        assert tp[0][key] == pytest.approx(dp[0][key], abs=2e-4), (key, tp, dp)


@pytest.mark.parametrize(
    ("script", "argv", "says"),
    [
        ("train_gpt", ["--tp", "0"], "argument --tp: expected a number of ranks >= 1, got 0"),
        ("finetune_hf", ["--tp", "0"], "argument --tp: expected a number of ranks >= 1, got 0"),
        ("finetune_hf", ["--tp", "2", "--lora-rank", "4"], "--lora-rank needs --tp 1"),
    ],
)
def test_examples_refuse_a_tp_they_cannot_run(script, argv, says, capsys):
    if script == "finetune_hf":
        needs_hf()
    with pytest.raises(SystemExit) as e:
        __import__(script).parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("script", "world", "argv", "says"),
    [
        ("train_gpt", 3, [*TINY, "--tp", "3"], "--tp 3: tp_plan: blocks.0.attn.n_head = 2 heads"),
        ("train_gpt", 2, [*TINY, "--tp", "4"], "--tp 4: init_mesh: dp_replicate (1) x tp (4)"),
        ("finetune_hf", 2, [*FINE, "--tp", "2", "--arch", "gpt2"], "declares no tensor-par"),
    ],
    ids=["heads", "world", "gpt2-has-no-plan"],
)
def test_examples_exit_on_every_rank_for_a_tp_that_does_not_fit(script, world, argv, says):
    """A degree the model's heads or the world size do not take, or a model without a plan
    for "auto": the same SystemExit on every rank, before any step."""
    if script == "finetune_hf":
        needs_hf()
    with pytest.raises(WorkerError) as e:
        run_distributed(_main, world, script, argv)
    assert sorted(e.value.errors) == list(range(world))
    for text in e.value.errors.values():
        assert "SystemExit" in text and says in text, text


# -- resume at another TP degree ------------------------------------------------------------------


def test_train_gpt_tp2_resumes_at_another_tp_degree(tmp_path):
    """Saved at (dp 2, tp 2) at step 4 (by the uninterrupted run): resumed at (dp 2, tp 2) it
    ends bitwise as the uninterrupted run; at (dp 2, tp 1) it logs the same step-8 loss up to
    float32 rounding; the checkpoint's files are the one-process picture. (Every other
    (dp, tp) and mode: tests/test_checkpoint_tp.py, without a launcher.)"""
    a, b = tmp_path / "a", tmp_path / "b"
    gpt = [*GPT, "--steps", "8", "--log-every", "4", "--save-every", "4", "--shard"]
    four = ("--standalone", "--nproc-per-node", "4")
    whole = run(torchrun(*four, TRAIN_GPT, *gpt, "--tp", "2", "--ckpt-dir", str(b)))
    assert "(tensor parallel: 2 data-parallel x tp 2)" in whole, whole
    step4 = b / "step-00000004"
    assert final_weights(step4)["wte.weight"].shape == (256, 16)  # whole, not a tp piece
    again = ["--tp", "2", "--ckpt-dir", str(a), "--resume-from", str(step4)]
    resumed = run(torchrun(*four, TRAIN_GPT, *gpt, *again))
    assert f"resumed from {step4} (saved at world size 4, tp 2" in resumed, resumed
    ours, theirs = final_weights(a / "step-00000008"), final_weights(b / "step-00000008")
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "resumed weights differ"
    for nproc, tp in ((2, 1),):
        launch = ("--standalone", "--nproc-per-node", str(nproc))
        again = [*gpt, "--tp", str(tp), "--ckpt-dir", "", "--resume-from", str(step4)]
        text = run(torchrun(*launch, TRAIN_GPT, *again))
        assert f"resumed from {step4} (saved at world size 4, tp 2" in text, text
        got, want = logged_losses(text), logged_losses(whole)
        assert got[8] == pytest.approx(want[8], abs=2e-4), (nproc, tp, text)


def test_finetune_hf_tp2_resumes_at_another_tp_degree(tmp_path):
    """Saved at (dp 1, tp 2) at step 2 of 4 (by the uninterrupted run): resumed at one process
    and at (dp 2, tp 1) it logs the uninterrupted run's step-4 loss up to float32 rounding,
    and the checkpoint loads in transformers without a merge."""
    needs_hf()
    import transformers

    from torchshard.checkpoint._tools import consolidate

    b = tmp_path / "b"
    fine = [*FINE[:-2], *small_llama(tmp_path), "--save-every", "2"]  # no --ckpt-dir ''
    two = ("--standalone", "--nproc-per-node", "2")
    whole = run(torchrun(*two, FINETUNE, *fine, "--tp", "2", "--ckpt-dir", str(b)))
    step2 = b / "step-00000002"
    again = [FINETUNE, *fine, "--ckpt-dir", "", "--resume-from", str(step2)]
    for cmd in ([sys.executable, *again], torchrun(*two, *again)):  # one process: no launcher
        text = run(cmd)
        assert f"resumed from {step2} (saved at world size 2, tp 2" in text, text
        assert logged_losses(text)[4] == pytest.approx(logged_losses(whole)[4], abs=2e-4)
    consolidate(b / "step-00000004", tmp_path / "export")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(model).__name__ == "LlamaForCausalLM"
