"""The examples run as documented, with small settings: the transformers fine-tune under
torchrun and under ``accelerate launch``, and the train / stop / resume at 1 and 3 / export
script; train_gpt.py's resume past a corrupt checkpoint, its errors printed once, its metrics
and their plot; both scripts' --help. (``train_gpt.py``'s runs at several world sizes and
launchers are in test_parallel_launch.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multiprocess import free_port, run_python
from safetensors.torch import load_file
from test_parallel_launch import clean_env, torchrun

ROOT = Path(__file__).resolve().parent.parent
FINETUNE = str(ROOT / "examples" / "finetune_hf.py")
TRAIN_GPT = str(ROOT / "examples" / "train_gpt.py")
TORCHRUN = torchrun()[1:]  # ["-m", "torch.distributed.run"]: launch() starts it from the fork
# global: 1, 2 and 3 ranks; one thread per rank (a world of one would take every core, on a
# box where the other test worker runs too)
SMALL = "--block-size 32 --batch-size 6 --save-every 2 --log-every 2 --threads 1"
# train_gpt.py, small enough for a test; no DataLoader workers (no processes to start)
GPT = [
    *("--preset", "tiny", "--block-size", "16", "--batch-size", "12", "--lr", "1e-2"),
    *("--threads", "1", "--num-workers", "0"),
]


def needs_hf() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")


def launch(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 240):
    """(exit code, stdout + stderr) of ``cmd``. A one-process run of a script,
    ``[sys.executable, script, ...]``, and torchrun's agent, ``[sys.executable, "-m",
    "torch.distributed.run", ...]``, go through run_python (tests/multiprocess.py: a preloaded
    fork, not 2 to 3 s of imports); torchrun's workers are fresh interpreters all the same
    (it starts them). Other launchers and commands start as they are."""
    env = env or clean_env()
    if cmd[0] == sys.executable and (cmd[1].endswith(".py") or cmd[1:3] == TORCHRUN):
        out = run_python(cmd[1:], ROOT, env, timeout=timeout)
    else:
        out = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    return out.returncode, out.stdout + out.stderr


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 240) -> str:
    code, text = launch(cmd, env, timeout)
    assert code == 0, text
    assert "Traceback" not in text, text
    return text


# The scripts run several jobs in a row: their subprocess timeout (400 s) exceeds the suite's
# 300 s (pyproject), so the test's own limit is raised above it; otherwise pytest-timeout
# would kill the test first and the subprocess timeout, with its partial output, never fire.
SCRIPT_TIMEOUT = 400


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT + 60)
def test_resume_script_trains_resumes_at_1_and_3_and_exports(tmp_path):
    needs_hf()
    if shutil.which("torchshard") is None or shutil.which("torchrun") is None:
        pytest.fail("the torchshard and torchrun commands must be installed (pip install -e .)")
    env = clean_env() | {"STEPS": "8", "RUN": str(tmp_path / "run"), "ARGS": SMALL}
    text = run(["bash", str(ROOT / "examples" / "resume.sh")], env=env, timeout=SCRIPT_TIMEOUT)

    # stopped at step 4; both resumes start from that checkpoint, saved at 2 ranks
    assert f"checkpoint committed: {tmp_path}/run/w2/step-00000004" in text
    assert "step-00000006" not in text.split("== 1 rank")[0]
    for world in (1, 3):
        assert f"resumed from {tmp_path}/run/w{world}/step-00000004 (saved at world size 2" in text
        assert f"world {world} on cpu" in text
        assert f"{tmp_path}/run/w{world}/step-00000008" in text
    assert "OK: 4 files" in text  # torchshard inspect verified every checksum

    # the export loads in transformers and generates what the trained model generated
    samples = re.findall(r"greedy sample:? (.*)", text)
    assert len(samples) == 4, text  # 2, 1 and 3 ranks, then the exported model
    assert samples[-1] == samples[-2], samples
    assert "loaded LlamaForCausalLM" in text
    assert sorted(p.name for p in (tmp_path / "run" / "model").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


@pytest.mark.slow
def test_finetune_under_accelerate_launch_gpt2_sharded(tmp_path):
    needs_hf()
    if shutil.which("accelerate") is None:
        pytest.fail("the accelerate command must be installed (pip install accelerate)")
    cmd = [
        "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), FINETUNE,
        "--arch", "gpt2", "--shard", "--steps", "4", "--ckpt-dir", str(tmp_path / "ckpt"),
        *SMALL.split(),
    ]  # fmt: skip
    text = run(cmd)
    assert "GPT2LMHeadModel" in text and "world 2 on cpu, sharded" in text, text
    assert (tmp_path / "ckpt" / "step-00000004" / "metadata.json").is_file()


@pytest.mark.slow
def test_finetune_starts_from_a_from_pretrained_directory(tmp_path):
    """--init-from: rank 0 loads the directory, the other ranks build on meta and receive it;
    with --lora-rank (PEFT LoRA over it) the adapters train and export in PEFT's format, and
    PeftModel.from_pretrained loads them over the same base."""
    needs_hf()
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "pretrained")
    env = clean_env()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        FINETUNE, "--init-from", str(tmp_path / "pretrained"), "--steps", "2",
        "--ckpt-dir", str(tmp_path / "ckpt"), *SMALL.split(), "--lora-rank", "4",
    ]  # fmt: skip
    text = run(cmd, env=env)
    assert "PeftModel" in text and "world 2 on cpu" in text, text
    # 1 layer x (q_proj 4x32 + 32x4, v_proj 4x32 + 16x4): the adapters alone train
    assert "(448 train)" in text, text
    assert os.path.isdir(tmp_path / "ckpt" / "step-00000002")
    peft = pytest.importorskip("peft")
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pretrained")
    model = peft.PeftModel.from_pretrained(base, tmp_path / "ckpt" / "adapter")
    lora = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora and any(p.abs().sum() > 0 for p in lora.values())  # trained off its zeros


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT + 60)
def test_fault_tolerance_script_survives_a_kill_and_ends_bitwise_as_without_it(tmp_path):
    env = clean_env() | {"STEPS": "20", "KILL": "8", "RUN": str(tmp_path / "run")}
    text = run(
        ["bash", str(ROOT / "examples" / "fault_tolerance.sh")], env=env, timeout=SCRIPT_TIMEOUT
    )
    assert "train_gpt: --fail-at 8: rank 1 kills itself" in text
    # the restarted attempt resumed from the last committed checkpoint: step 5, or none
    # when step 5's async save was still being written at the kill (3 steps later)
    step5 = f"resumed from {tmp_path}/run/faulty/step-00000005 (saved at world size 2"
    scratch = f"--resume: no checkpoint under {str(tmp_path / 'run' / 'faulty')!r}"
    assert step5 in text or scratch in text, text
    # then the second phase from step 10, at 3 ranks
    assert f"resumed from {tmp_path}/run/faulty/step-00000010 (saved at world size 2" in text
    assert "final weights equal the uninterrupted run's: True (28 tensors, bitwise)" in text


# -- --help ---------------------------------------------------------------------------------------


def value_options_without_a_default(parser) -> list[str]:
    """Options that take a value and whose --help line does not say its default."""
    formatter = parser._get_formatter()
    return [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.nargs != 0  # flags are off by default
        if "default" not in formatter._get_help_string(action) % vars(action)
    ]


@pytest.mark.parametrize("script", ["train_gpt", "finetune_hf"])
def test_help_shows_every_default_and_no_changelog(script):
    if script == "finetune_hf":
        needs_hf()
    parser = __import__(script).build_parser()
    assert value_options_without_a_default(parser) == []
    text = parser.format_help()
    assert "(default: 24)" in text or "(default: 12)" in text  # --batch-size
    assert "Was per rank" not in text and "--reset-data-position" in text
    for flag in ("--resume-from", "--overwrite"):
        assert flag in text


# -- train_gpt.py: resume past a corrupt checkpoint, errors once, metrics --------------------------


def final_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_train_gpt_resumes_past_a_corrupt_latest_checkpoint_under_max_restarts(tmp_path):
    """The issue's "done when": two checkpoints, a flipped byte in the latest's metadata.json;
    --resume under `torchrun --max-restarts 1` continues from the one before, in one attempt,
    and ends bitwise equal to a run that resumed from that one directly (--resume-from)."""
    a, b = tmp_path / "a", tmp_path / "b"
    gpt = [*GPT, "--steps", "12", "--save-every", "4", "--log-every", "4", "--keep-last", "3"]
    two = ("--standalone", "--nproc-per-node", "2")
    run(torchrun(*two, TRAIN_GPT, *gpt, "--ckpt-dir", str(a), "--stop-at", "8"))
    assert sorted(p.name for p in a.glob("step-*")) == ["step-00000004", "step-00000008"]

    # the oracle: from step 4 exactly, saving elsewhere
    first = a / "step-00000004"
    direct = run(torchrun(*two, TRAIN_GPT, *gpt, "--ckpt-dir", str(b), "--resume-from", str(first)))
    assert f"resumed from {first} (saved at world size 2" in direct, direct

    meta = a / "step-00000008" / "metadata.json"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01
    meta.write_bytes(data)
    text = run(
        torchrun(*two, "--max-restarts", "1", TRAIN_GPT, *gpt, "--ckpt-dir", str(a), "--resume")
    )
    assert re.search(r"step-00000008\b.*skipped", text), text  # rank 0's warning
    assert text.count(f"resumed from {first} (saved at world size 2") == 1, text  # no restart
    assert "aside as step-00000008.bad" in text, text  # by the Checkpointer, on rank 0
    assert sorted(p.name for p in a.glob("step-*")) == [
        "step-00000004", "step-00000008", "step-00000008.bad", "step-00000012",
    ]  # fmt: skip
    assert (a / "step-00000008.bad" / "metadata.json").read_bytes() == bytes(data)

    ours, theirs = final_weights(a / "step-00000012"), final_weights(b / "step-00000012")
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "final weights differ"
    # metrics.jsonl: the step-8 line of the attempt given up is replaced by the resumed run's
    logged = [(m["step"], m["loss"], m["lr"]) for m in metrics(a / "metrics.jsonl")]
    oracle = [(m["step"], m["loss"], m["lr"]) for m in metrics(b / "metrics.jsonl")]
    assert [step for step, *_ in logged] == [4, 8, 12] and logged[1:] == oracle, (logged, oracle)


@pytest.mark.slow
def test_train_gpt_errors_once_and_a_new_batch_size_resumes_with_reset_data_position(tmp_path):
    ckpt = ["--ckpt-dir", str(tmp_path), "--save-every", "2", "--log-every", "2"]
    two = ("--standalone", "--nproc-per-node", "2")
    run(torchrun(*two, TRAIN_GPT, *GPT, *ckpt, "--steps", "8", "--stop-at", "4"))
    metrics_before = metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics_before] == [2, 4]
    assert set(metrics_before[0]) == {
        "step", "loss", "lr", "tokens_per_s", "comm_wait_ms_per_step", "elapsed_s",
    }  # fmt: skip
    assert all(len(repr(m["lr"])) <= 12 for m in metrics_before), metrics_before  # no noise

    # another global batch: refused, said once (by rank 0), naming the way out
    bigger = [*ckpt, "--steps", "8", "--resume", "--batch-size", "24"]
    code, text = launch(torchrun(*two, TRAIN_GPT, *GPT, *bigger))
    assert code != 0, text
    assert text.count("the checkpoint's data position does not fit this run") == 1, text
    assert "--reset-data-position" in text and 'train_gpt.py", line' not in text, text

    # and with the flag: 4 global batches of 12 received = 2 of 24, said loudly (once)
    text = run(torchrun(*two, TRAIN_GPT, *GPT, *bigger, "--reset-data-position"))
    assert text.count("WARNING: --reset-data-position") == 1, text
    assert "data: epoch 0, global batch 2 of" in text, text
    assert [int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("step ")] == [6, 8]
    assert re.search(r"^step +6 +loss \S+ +lr 0\.\d+ ", text, re.M), text  # %.3g, no noise
    assert [m["step"] for m in metrics(tmp_path / "metrics.jsonl")] == [2, 4, 6, 8]

    # a checkpoint that does not load, named exactly: one message, every rank non-zero
    meta = tmp_path / "step-00000008" / "metadata.json"
    meta.write_bytes(meta.read_bytes().replace(b'"step"', b'"stop"', 1))
    cmd = [*GPT, *ckpt, "--steps", "10", "--batch-size", "24", "--resume-from", str(meta.parent)]
    code, text = launch(torchrun(*two, TRAIN_GPT, *cmd))
    assert code != 0, text
    assert text.count("cannot resume:") == 1 and str(meta.parent) in text, text
    assert 'train_gpt.py", line' not in text, text


def logged_losses(text: str) -> dict[int, float]:
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"^step +(\d+) +loss (\S+)", text, re.M)
    }


@pytest.mark.slow
def test_train_gpt_hybrid_sharding_trains_and_resumes_anywhere(tmp_path):
    """--dp-replicate 2 at 4 ranks: 2 replicas of 2 shards (shard=True). The same losses as
    --shard over the 4 ranks, up to the reduction order (the last bits; printed to 4 places);
    resumed from its own step-8 checkpoint, bitwise the uninterrupted run; that checkpoint
    resumes fully sharded at 2 ranks. (Stopping with --stop-at and resuming in the same
    directory: test_train_gpt_resumes_past_a_corrupt_latest_checkpoint_under_max_restarts.)"""
    a, b = tmp_path / "a", tmp_path / "b"
    gpt = [*GPT, "--steps", "12", "--log-every", "4", "--save-every", "4", "--shard"]
    four = ("--standalone", "--nproc-per-node", "4")
    hybrid = [*four, TRAIN_GPT, *gpt, "--dp-replicate", "2"]
    whole = run(torchrun(*hybrid, "--ckpt-dir", str(b)))
    assert "world 4 on cpu, sharded (hybrid: 2 replicas x 2 shards)" in whole, whole
    plain = run(torchrun(*four, TRAIN_GPT, *gpt, "--ckpt-dir", ""))
    assert "hybrid" not in plain, plain
    ours, theirs = logged_losses(whole), logged_losses(plain)
    assert list(ours) == [4, 8, 12] and ours[12] < ours[4], whole
    assert ours == pytest.approx(theirs, abs=2e-4), (ours, theirs)

    step8 = b / "step-00000008"
    resumed = run(torchrun(*hybrid, "--ckpt-dir", str(a), "--resume-from", str(step8)))
    assert f"resumed from {step8} (saved at world size 4" in resumed, resumed
    ours, theirs = final_weights(a / "step-00000012"), final_weights(b / "step-00000012")
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "resumed weights differ"

    two = ("--standalone", "--nproc-per-node", "2")
    full = [*GPT, "--steps", "12", "--log-every", "4", "--shard", "full"]
    text = run(torchrun(*two, TRAIN_GPT, *full, "--ckpt-dir", "", "--resume-from", str(step8)))
    assert f"resumed from {step8} (saved at world size 4" in text, text


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--dp-replicate", "2", "--ckpt-dir", ""], "need --shard"),
        (["--shard", "--dp-replicate", "0", "--ckpt-dir", ""], "replicas >= 1, got 0"),
    ],
)
def test_train_gpt_refuses_a_dp_replicate_it_cannot_run(args, says, capsys):
    train_gpt = __import__("train_gpt")
    with pytest.raises(SystemExit) as e:
        train_gpt.parse_args(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --dp-replicate:" in err and says in err, err
    assert (
        train_gpt.parse_args(["--shard", "--dp-replicate", "2", "--ckpt-dir", ""]).dp_replicate == 2
    )


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("gzip", "expected one of allreduce, bf16, fp16, star, powersgd, topk"),
        ("bf16:2", "bf16 takes no argument, got 'bf16:2'"),
        ("powersgd:four", "powersgd:RANK must be an integer, got 'powersgd:four'"),
        ("powersgd:4:x", "powersgd:START_STEP must be an integer, got 'powersgd:4:x'"),
        ("powersgd:4:1:2", "expected powersgd[:RANK[:START_STEP]], got 'powersgd:4:1:2'"),
        ("star:1:2", "expected star[:ROOT], got 'star:1:2'"),
        ("topk:1%", "topk:RATIO must be a number, got 'topk:1%'"),
        ("powersgd:0", "rank"),  # torchshard's own check, before any launch
        ("topk:1.5", "ratio"),
        ("star:-1", "root"),
        ("powersgd:4:-1", "start_step"),
    ],
)
def test_train_gpt_refuses_a_comm_it_cannot_build(value, says, capsys):
    train_gpt = __import__("train_gpt")
    with pytest.raises(SystemExit) as e:
        train_gpt.parse_args(["--comm", value, "--ckpt-dir", ""])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --comm:" in err and says in err, err


def test_train_gpt_builds_each_comm_by_name():
    import torchshard.comm as comm

    train_gpt = __import__("train_gpt")
    built = {
        text: train_gpt.parse_args(["--comm", text, "--ckpt-dir", ""]).comm_object
        for text in (
            *("allreduce", "bf16", "fp16", "star:1", "powersgd", "powersgd:8", "topk:0.1"),
            *("powersgd:4:30", "topk-noef:0.02", "topk:0.01:30", "topk-noef:0.01:30"),
        )
    }
    assert built == {
        "allreduce": comm.AllReduce(),
        "bf16": comm.BF16(),
        "fp16": comm.FP16(),
        "star:1": comm.Star(root=1),
        "powersgd": comm.PowerSGD(),
        "powersgd:8": comm.PowerSGD(rank=8),
        "powersgd:4:30": comm.PowerSGD(rank=4, start_step=30),
        "topk:0.1": comm.TopK(ratio=0.1),
        "topk-noef:0.02": comm.TopK(ratio=0.02, error_feedback=False),
        "topk:0.01:30": comm.TopK(ratio=0.01, start_step=30),
        "topk-noef:0.01:30": comm.TopK(ratio=0.01, error_feedback=False, start_step=30),
    }
    assert train_gpt.parse_args(["--ckpt-dir", ""]).comm is None  # the default: no comm= at all


def test_train_gpt_takes_sgd_with_its_own_default_lr():
    train_gpt = __import__("train_gpt")
    adamw, sgd = (
        train_gpt.parse_args([*o, "--ckpt-dir", ""]) for o in ([], ["--optimizer", "sgd"])
    )
    assert (adamw.optimizer, adamw.lr, sgd.optimizer, sgd.lr) == ("adamw", 2e-3, "sgd", 0.1)
    assert train_gpt.parse_args(["--optimizer", "sgd", "--lr", "0.3", "--ckpt-dir", ""]).lr == 0.3


@pytest.mark.slow
def test_train_gpt_trains_with_sgd_and_adamw_refuses_its_checkpoint(tmp_path):
    """--optimizer sgd (one process, no launcher) trains: the loss falls; its checkpoint does
    not resume under AdamW, and the error names both optimizers."""
    gpt = [*GPT, "--optimizer", "sgd", "--lr", "0.5", "--steps", "8", "--log-every", "4"]
    text = run([sys.executable, TRAIN_GPT, *gpt, "--save-every", "8", "--ckpt-dir", str(tmp_path)])
    assert "SGD with momentum at lr 0.5" in text, text
    losses = logged_losses(text)
    assert list(losses) == [4, 8] and losses[8] < losses[4], text
    code, text = launch([sys.executable, TRAIN_GPT, *GPT, "--steps", "12", "--resume",
                         "--ckpt-dir", str(tmp_path)])  # fmt: skip
    assert code != 0, text
    assert "checkpoint has torch.optim.sgd.SGD, got torch.optim.adamw.AdamW" in text, text


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def sent_per_step(text: str) -> dict[int, tuple[float, float]]:
    """``step N ... sent X/step (dense Y)``: X and Y in bytes (as printed), by logged step."""
    size = r"([\d.]+) (B|KiB|MiB|GiB)"
    return {
        int(m[1]): (float(m[2]) * UNITS[m[3]], float(m[4]) * UNITS[m[5]])
        for m in re.finditer(rf"^step +(\d+) .* sent {size}/step \(dense {size}\)$", text, re.M)
    }


@pytest.mark.slow
def test_train_gpt_compresses_with_powersgd_after_its_start_and_refuses_it_sharded(tmp_path):
    """--comm powersgd:2 at 2 ranks: the first 10 synchronized steps all-reduce densely (the
    log's payload equals the dense one), the last ones send less; a sharded run refuses it
    with torchshard's reason, said once, before any step."""
    two = ("--standalone", "--nproc-per-node", "2")
    gpt = [*GPT, "--steps", "12", "--log-every", "2", "--ckpt-dir", ""]
    text = run(torchrun(*two, TRAIN_GPT, *gpt, "--comm", "powersgd:2"))
    assert "comm=PowerSGD(rank=2, start_step=10" in text, text  # the trainer's first line
    sent = sent_per_step(text)
    assert list(sent) == [2, 4, 6, 8, 10, 12], text
    assert sent[2][0] == sent[2][1] > 0 and sent[10] == sent[2], sent  # dense up to step 10
    assert 0 < sent[12][0] < sent[12][1] / 2 and sent[12][1] == sent[2][1], sent
    losses = logged_losses(text)
    assert losses[12] < losses[2], losses

    code, text = launch(torchrun(*two, TRAIN_GPT, *gpt, "--comm", "powersgd:2", "--shard"))
    assert code != 0, text
    assert text.count("--comm powersgd:2:") == 1, text  # rank 0 says it
    assert not re.search(r"^step +\d", text, re.M), text  # before any step
    assert 'train_gpt.py", line' not in text, text


@pytest.mark.slow
def test_train_gpt_powersgd_resumes_with_its_compression_state(tmp_path):
    """--comm powersgd:2 resumed from its own step-12 checkpoint: the checkpoint carried
    the step count (the resumed run compresses at once, as the uninterrupted one, instead of
    10 more dense steps) and the mean error (the weights at step 16 within float32 rounding
    of the uninterrupted run's: the mean, not each rank's own error, is what resumes); the
    same checkpoint resumes at 1 rank, with the same logged loss (PowerSGD's update depends
    on the ranks only through their sum)."""
    a, b = tmp_path / "a", tmp_path / "b"
    gpt = [*GPT, "--steps", "16", "--log-every", "4", "--save-every", "4"]
    two = ("--standalone", "--nproc-per-node", "2")
    psgd = [*two, TRAIN_GPT, *gpt, "--comm", "powersgd:2"]
    whole = run(torchrun(*psgd, "--ckpt-dir", str(b)))
    step12 = b / "step-00000012"
    resumed = run(torchrun(*psgd, "--ckpt-dir", str(a), "--resume-from", str(step12)))
    assert f"resumed from {step12} (saved at world size 2" in resumed, resumed
    sent, sent_whole = sent_per_step(resumed), sent_per_step(whole)
    assert sent[16] == sent_whole[16] and sent[16][0] < sent[16][1] / 2, (sent, sent_whole)
    assert logged_losses(resumed)[16] == logged_losses(whole)[16]
    ours, theirs = final_weights(a / "step-00000016"), final_weights(b / "step-00000016")
    assert ours.keys() == theirs.keys() and ours
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert 0 <= worst < 1e-5, worst

    more = [*GPT, "--steps", "16", "--log-every", "4", "--comm", "powersgd:2", "--ckpt-dir", ""]
    text = run([sys.executable, TRAIN_GPT, *more, "--resume-from", str(step12)])  # no launcher
    assert f"resumed from {step12} (saved at world size 2" in text, text
    assert "loaded error (the mean over 2 ranks), powersgd_q, steps=12" in text, text
    # one rank sends nothing, yet compresses alike: the same global batches, the same loss
    assert logged_losses(text)[16] == logged_losses(whole)[16], text


def test_plot_metrics_draws_the_loss_curve(tmp_path):
    pytest.importorskip("matplotlib")
    import plot_metrics

    lines = [
        {"step": 10, "loss": 5.0, "lr": 0.002},
        {"step": 20, "loss": 4.0, "lr": 0.002},
        {"step": 20, "loss": 3.5, "lr": 0.002},  # logged again after a resume: this one counts
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 30, "lo')
    assert [(m["step"], m["loss"]) for m in plot_metrics.read_metrics(path)] == [
        (10, 5.0),
        (20, 3.5),
    ]
    out = plot_metrics.main([str(tmp_path)])  # the directory: its metrics.jsonl
    assert out == tmp_path / "loss.png"
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and out.stat().st_size > 1000
    assert plot_metrics.main([str(path), "-o", str(tmp_path / "x.png")]).is_file()
    with pytest.raises(SystemExit, match="no metrics lines"):
        (tmp_path / "empty.jsonl").write_text("")
        plot_metrics.main([str(tmp_path / "empty.jsonl")])


@pytest.mark.slow
def test_finetune_refuses_to_start_over_a_run_without_overwrite(tmp_path):
    needs_hf()
    cmd = [sys.executable, FINETUNE, "--steps", "2", "--ckpt-dir", str(tmp_path), *SMALL.split()]
    run(cmd)
    code, text = launch(cmd)
    assert code == 2 and "holds checkpoints" in text and "--overwrite" in text, text
    text = run([*cmd, "--overwrite", "--stop-at", "1", "--save-every", "1"])
    assert "--overwrite: removing" in text, text
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001"]
