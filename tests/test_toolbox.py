"""The rest of the PyTorch toolbox on a wrapped model, against the plain model as the oracle.

torch.compile, activation checkpointing (torch's and transformers'), autocast and
a bf16 flat buffer; CPU, a world of one. The compile tests share one compiled
model (module-scoped fixture) because compiling takes tens of seconds here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from models import batch, gpt, tiny_hf_config
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchshard import DistributedTrainer, FlatParamModule

STEPS = 5
ADAMW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1)


def grads_outside_flat_grad(fm: FlatParamModule) -> list[str]:
    """Names of parameters whose ``.grad`` is missing or is not the view at their slot."""
    base, size = fm.flat_grad.data_ptr(), fm.flat_grad.element_size()
    return [
        slot.name
        for slot, p in fm.named_flat_views()
        if p.grad is None or p.grad.data_ptr() != base + slot.offset * size
    ]


def assert_params_in_flat_param(fm: FlatParamModule) -> None:
    base, size = fm.flat_param.data_ptr(), fm.flat_param.element_size()
    for slot, p in fm.named_flat_views():
        assert p.data_ptr() == base + slot.offset * size, slot.name
    fm.check_views()


def assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    """Bitwise: on CPU the wrapped model runs exactly the plain model's kernels."""
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params)
    for name, p in model.named_parameters():
        assert p.grad is not None and ref_params[name].grad is not None, name
        assert torch.equal(p.grad, ref_params[name].grad), name


# -- torch.compile ----------------------------------------------------------------------
@dataclass
class CompiledRun:
    """What one compiled training run saw, step by step, next to the eager oracle's."""

    losses: list[float] = field(default_factory=list)
    eager_losses: list[float] = field(default_factory=list)
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    eager_first_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    grads_left_after_zero_grad: list[list[str]] = field(default_factory=list)
    grads_outside: list[list[str]] = field(default_factory=list)
    """Per step, after backward and average_gradients()."""
    flat_param_moved: bool = True
    weights_changed: bool = False
    graphs: int = 0
    fm: FlatParamModule | None = None


@pytest.fixture(scope="module")
def compiled_run() -> CompiledRun:
    """Wrap, then the trainer, then compile in place; train STEPS AdamW steps beside eager."""
    from torch._dynamo.utils import counters

    ref = gpt()
    fm = FlatParamModule(copy.deepcopy(ref))
    run = CompiledRun(fm=fm)
    # The whole run happens here and the trainer is closed before any test runs: a
    # trainer closed elsewhere tears down the default group this one would share.
    with DistributedTrainer(fm) as trainer:
        flat_ptr = fm.flat_param.data_ptr()
        start = fm.flat_param.clone()
        torch._dynamo.reset()
        counters.clear()
        fm.compile()  # in place: fm stays the FlatParamModule (torch.compile(fm) works too)
        opt = torch.optim.AdamW(fm.parameters(), **ADAMW)
        ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()  # set_to_none: the hook must put each gradient back in flat_grad
            run.grads_left_after_zero_grad.append(
                [n for n, p in fm.module.named_parameters() if p.grad is not None]
            )
            loss = fm(x, y)[1]
            loss.backward()
            trainer.average_gradients()
            run.grads_outside.append(grads_outside_flat_grad(fm))
            ref_opt.zero_grad()
            ref_loss = ref(x, y)[1]
            ref_loss.backward()
            if step == 0:
                run.first_grads = {n: p.grad.clone() for n, p in fm.module.named_parameters()}
                run.eager_first_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
            run.losses.append(loss.item())
            run.eager_losses.append(ref_loss.item())
            opt.step()
            ref_opt.step()
        run.graphs = counters["stats"]["unique_graphs"]
        run.flat_param_moved = fm.flat_param.data_ptr() != flat_ptr
        run.weights_changed = not torch.equal(fm.flat_param, start)
    return run


# Inductor fuses and reorders float32 ops (e.g. a different reduction order in
# LayerNorm, softmax and the matmul epilogues), so compiled and eager agree to a
# few ulps per op, not bitwise; over a tiny GPT and 5 AdamW steps that stays far
# below 1e-4 relative (measured: ~1e-7), while any real bug (a gradient lost or
# read from the wrong slot) changes the loss in the first or second digit.
COMPILE_TOL = dict(rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_compiled_wrapped_model_trains_like_the_eager_plain_model(compiled_run):
    torch.testing.assert_close(compiled_run.losses, compiled_run.eager_losses, **COMPILE_TOL)
    assert compiled_run.first_grads.keys() == compiled_run.eager_first_grads.keys()
    for name, g in compiled_run.first_grads.items():
        torch.testing.assert_close(g, compiled_run.eager_first_grads[name], **COMPILE_TOL)


@pytest.mark.slow
def test_compiled_gradients_land_in_flat_grad_after_zero_grad(compiled_run):
    # zero_grad() set every .grad to None; the compiled backward's gradients were
    # then re-homed into flat_grad by the post-accumulate-grad hook, every step.
    assert compiled_run.grads_left_after_zero_grad == [[]] * STEPS
    assert compiled_run.grads_outside == [[]] * STEPS


@pytest.mark.slow
def test_compiled_parameters_stay_views_of_flat_param(compiled_run):
    assert compiled_run.weights_changed  # the optimizer stepped the buffer itself
    assert not compiled_run.flat_param_moved
    assert_params_in_flat_param(compiled_run.fm)


@pytest.mark.slow
def test_compiled_model_is_not_recompiled_by_optimizer_steps(compiled_run):
    # In-place updates of the flat buffer keep every guard valid: one graph for all steps.
    assert compiled_run.graphs == 1


# -- activation checkpointing: torch.utils.checkpoint ------------------------------------------
class CheckpointedMLP(nn.Module):
    """Residual MLP blocks, each run under ``checkpoint`` unless ``use_reentrant`` is None."""

    def __init__(self, use_reentrant: bool | None = None) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
            for _ in range(2)
        )
        self.out = nn.Linear(16, 4)
        self.block_calls = 0
        for b in self.blocks:
            b.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.block_calls += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            if self.use_reentrant is None:
                h = h + b(h)
            else:
                h = h + checkpoint(b, h, use_reentrant=self.use_reentrant)
        return self.out(h)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_torch_checkpoint_gives_the_gradients_of_no_checkpointing(use_reentrant):
    torch.manual_seed(0)
    ref = CheckpointedMLP()
    plain_fm = FlatParamModule(copy.deepcopy(ref))  # wrapped, no checkpointing
    plain_fm.bind(torch.empty(plain_fm.numel))
    model = copy.deepcopy(ref)
    model.use_reentrant = use_reentrant
    fm = FlatParamModule(model)
    nets = (fm, plain_fm, ref)
    with DistributedTrainer(fm) as trainer:
        opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]  # after binding
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
            model.block_calls = 0
            for net, opt in zip(nets, opts):
                # step 0: .grad is None and the hook re-homes it; step 1: accumulate in place
                opt.zero_grad(set_to_none=step == 0)
                F.cross_entropy(net(x), y).backward()
            trainer.average_gradients()
            assert model.block_calls == 2 * len(model.blocks)  # forward + recompute
            assert grads_outside_flat_grad(fm) == []
            assert_same_grads(model, ref)
            assert_same_grads(model, plain_fm.module)
            for opt in opts:
                opt.step()
    assert_params_in_flat_param(fm)


# -- activation checkpointing: transformers -----------------------------------------------------
def tiny_hf_model(arch: str) -> nn.Module:
    """Llama (untied, as LlamaConfig defaults) or GPT-2 (lm_head tied to wte), real weights."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tiny_hf_config(arch, vocab_size=128, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def count_mlp_calls(model: nn.Module) -> list[int]:
    """Count the decoder layers' MLP calls: twice per layer and step when checkpointed."""
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    # The MLP, not the layer: recent transformers checkpoint the layer's forward, so
    # hooks on the layer itself are outside the checkpoint and run once.
    for layer in decoder_layers(model):
        layer.mlp.register_forward_pre_hook(hook)
    return calls


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(
    ("when", "use_reentrant"),
    [("never", None), ("before", False), ("after", False), ("before", True), ("after", True)],
    ids=["never", "before_wrap", "after_wrap", "before_wrap-reentrant", "after_wrap-reentrant"],
)
def test_transformers_gradient_checkpointing_gives_the_plain_gradients(arch, when, use_reentrant):
    ref = tiny_hf_model(arch).train()
    model = copy.deepcopy(ref)
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": use_reentrant}}
    if when == "before":
        model.gradient_checkpointing_enable(**kwargs)
    fm = FlatParamModule(model).train()
    if when == "after":
        fm.module.gradient_checkpointing_enable(**kwargs)
    calls = count_mlp_calls(model)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with DistributedTrainer(fm) as trainer:
        loss = fm(input_ids=ids, labels=ids).loss
        loss.backward()
        trainer.average_gradients()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    recomputes = 1 if when == "never" else 2
    assert calls[0] == recomputes * len(decoder_layers(model))
    assert torch.equal(loss, ref_loss)
    assert_same_grads(model, ref)
    assert grads_outside_flat_grad(fm) == []
    assert_params_in_flat_param(fm)


def test_transformers_activation_checkpointing_enable_after_wrapping():
    ref = tiny_hf_model("llama").train()
    if not hasattr(ref, "activation_checkpointing_enable"):
        pytest.skip("this transformers has only gradient_checkpointing_enable")
    fm = FlatParamModule(copy.deepcopy(ref)).train()
    fm.module.activation_checkpointing_enable()
    calls = count_mlp_calls(fm.module)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    fm.bind(torch.empty(fm.numel))
    fm(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    assert calls[0] == 2 * len(decoder_layers(fm.module))
    assert_same_grads(fm.module, ref)
    assert grads_outside_flat_grad(fm) == []


# -- autocast and a bf16 buffer ---------------------------------------------------------------
def test_autocast_bf16_matches_the_plain_model_and_keeps_fp32_grads_in_flat_grad():
    ref = gpt()
    fm = FlatParamModule(copy.deepcopy(ref))
    with DistributedTrainer(fm) as trainer:
        for step in range(2):
            x, y = batch(step)
            losses = []
            for net in (fm, ref):
                net.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits, loss = net(x, y)
                assert logits.dtype == torch.bfloat16
                loss.backward()  # outside autocast, as recommended
                losses.append(loss)
            trainer.average_gradients()
            assert torch.equal(losses[0], losses[1])
            assert_same_grads(fm.module, ref)
            assert fm.flat_grad.dtype == torch.float32
            assert {p.grad.dtype for p in fm.parameters()} == {torch.float32}
            assert grads_outside_flat_grad(fm) == []
    assert_params_in_flat_param(fm)


def test_bf16_flat_buffer_matches_the_plain_bf16_model():
    ref = gpt().to(torch.bfloat16)
    fm = FlatParamModule(gpt(), dtype=torch.bfloat16)
    with DistributedTrainer(fm) as trainer:
        assert fm.flat_param.dtype == fm.flat_grad.dtype == torch.bfloat16
        x, y = batch(0)
        loss = fm(x, y)[1]
        loss.backward()
        trainer.average_gradients()
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    assert loss.dtype == torch.bfloat16
    assert torch.equal(loss, ref_loss)
    assert_same_grads(fm.module, ref)
    assert grads_outside_flat_grad(fm) == []
    assert_params_in_flat_param(fm)
