"""FlatParamModule against plain PyTorch as the oracle (CPU, one process)."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT, init_gpt_weights
from models import CFG, batch, gpt
from torch import nn

from torchshard import BindError, FlatParamModule, LayoutError, TorchShardError


def wrapped(model: nn.Module, **kwargs) -> FlatParamModule:
    fm = FlatParamModule(model, **kwargs)
    return fm.bind(torch.empty(fm.numel, dtype=fm.dtype))


def inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    start = buf.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= (
        start + buf.numel() * buf.element_size()
    )


def assert_grads_in_buffer(fm: FlatParamModule) -> None:
    for name, p in fm.module.named_parameters():
        if p.grad is not None:
            assert inside(p.grad, fm.flat_grad), name
            offset = fm.layout[name].offset * fm.flat_grad.element_size()
            assert p.grad.data_ptr() == fm.flat_grad.data_ptr() + offset, name


# -- storage ------------------------------------------------------------------
def test_parameters_are_views_of_the_buffer():
    model = gpt()
    before = copy.deepcopy(model.state_dict())
    fm = FlatParamModule(model)
    flat = torch.full((fm.numel + 5,), float("nan"))
    fm.bind(flat)
    assert fm.flat_param is flat and fm.device == flat.device and fm.dtype == torch.float32
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and inside(p, flat), name
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert p.data_ptr() == flat.data_ptr() + fm.layout[name].offset * flat.element_size()
        assert p.data_ptr() % 16 == flat.data_ptr() % 16
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key
    # a write through the buffer is a write to the parameter, and back
    flat[fm.layout["ln_f.bias"].offset] = 7.0
    assert model.ln_f.bias[0].item() == 7.0
    with torch.no_grad():
        model.ln_f.weight.fill_(3.0)
    s = fm.layout["ln_f.weight"]
    assert torch.all(flat[s.offset : s.end] == 3.0)


def test_tied_parameters_share_one_slot_and_stay_tied_through_training():
    fm = wrapped(gpt())
    m = fm.module
    assert m.lm_head.weight is m.wte.weight
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        _, loss = fm(*batch(step))
        loss.backward()
        opt.step()
    assert m.lm_head.weight is m.wte.weight
    assert inside(m.lm_head.weight, fm.flat_param)
    assert len(list(fm.parameters())) == len(fm.layout)


# -- bitwise parity with the plain model ----------------------------------------
def test_forward_is_bitwise_identical():
    ref = gpt()
    fm = wrapped(copy.deepcopy(ref))
    x, y = batch(0)
    logits, loss = fm(x, y)
    ref_logits, ref_loss = ref(x, y)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["adamw", "sgd-momentum"],
)
def test_ten_steps_bitwise_identical_with_default_zero_grad(make_opt):
    ref = gpt()
    fm = wrapped(copy.deepcopy(ref))
    opt, ref_opt = make_opt(fm.parameters()), make_opt(ref.parameters())
    grad_ptrs = None
    for step in range(10):
        for model, o in ((fm, opt), (ref, ref_opt)):
            o.zero_grad()  # default: set_to_none=True
            _, loss = model(*batch(step))
            loss.backward()
            o.step()
        assert_grads_in_buffer(fm)
        ptrs = [p.grad.data_ptr() for p in fm.parameters()]
        assert grad_ptrs in (None, ptrs)  # the same views every step, nothing new allocated
        grad_ptrs = ptrs
        for (name, p), q in zip(fm.module.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"step {step}: {name}"
            assert torch.equal(p.grad, q.grad), f"step {step}: grad of {name}"


def test_gradient_accumulation_and_module_zero_grad():
    ref = gpt()
    fm = wrapped(copy.deepcopy(ref))
    for zero in ("module", "optimizer-none", "optimizer-zeros"):
        opt = torch.optim.SGD(fm.parameters(), lr=0.1)
        if zero == "module":
            fm.zero_grad()
            ref.zero_grad()
        else:
            opt.zero_grad(set_to_none=zero == "optimizer-none")
            ref.zero_grad(set_to_none=zero == "optimizer-none")
        for micro in range(3):
            fm(*batch(micro))[1].backward()
            ref(*batch(micro))[1].backward()
        assert_grads_in_buffer(fm)
        for (name, p), q in zip(fm.module.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"{zero}: {name}"


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = self.frozen(self.a(x))
        return self.b(x) if use_b else x


def test_unused_parameter_has_no_grad_like_plain_pytorch():
    torch.manual_seed(0)
    ref = TwoBranches()
    fm = wrapped(copy.deepcopy(ref))
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step, use_b in enumerate([True, False, False, True, False]):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for model, o in ((fm, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x, use_b).sum().backward()
            o.step()
        assert (fm.module.b.weight.grad is None) == (not use_b)
        assert fm.module.frozen.weight.grad is None
        for (name, p), q in zip(fm.module.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"step {step}: {name}"


def test_frozen_parameters_keep_their_flag_and_never_get_a_gradient():
    torch.manual_seed(0)
    fm = wrapped(TwoBranches())
    layout = fm.layout
    assert not layout["frozen.weight"].requires_grad and layout["a.weight"].requires_grad
    fm(torch.randn(2, 4), True).sum().backward()
    assert not fm.module.frozen.weight.requires_grad and fm.module.frozen.weight.grad is None
    s = layout["frozen.weight"]
    assert torch.all(fm.flat_grad[s.offset : s.end] == 0)
    assert inside(fm.module.frozen.weight, fm.flat_param)


def test_module_without_trainable_parameters_has_no_grad_buffer():
    fm = wrapped(nn.Linear(2, 2).requires_grad_(False))
    assert fm.flat_grad is None


def test_grad_buffer_supplied_by_caller():
    fm = FlatParamModule(gpt())
    flat, grad = torch.empty(fm.numel), torch.zeros(fm.numel)
    fm.bind(flat, grad)
    fm(*batch(0))[1].backward()
    assert fm.flat_grad is grad and grad.abs().sum() > 0
    assert_grads_in_buffer(fm)


def test_create_graph_still_lands_in_the_buffer():
    fm = wrapped(nn.Linear(3, 1))
    x = torch.randn(5, 3)
    fm(x).pow(2).sum().backward(create_graph=True)
    assert_grads_in_buffer(fm)


# -- meta construction, bind, init ---------------------------------------------------
def test_meta_model_binds_and_initializes_with_reset_parameters():
    with torch.device("meta"):
        model = GPT(CFG)
    fm = FlatParamModule(model)
    assert fm.device.type == "meta" and not fm.is_bound and fm.flat_param is None
    fm.bind(torch.full((fm.numel,), float("nan")))
    fm.init_weights()
    assert torch.all(model.ln_f.weight == 1) and torch.all(model.ln_f.bias == 0)
    assert model.lm_head.weight is model.wte.weight
    for name, p in model.named_parameters():  # the buffer was NaN: every value was written
        assert torch.isfinite(p).all(), name
        if name.split(".")[-2].startswith("ln"):  # every LayerNorm: ones and zeros, not skipped
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
        else:
            assert p.std() > 0, name


def test_init_weights_with_a_function_matches_the_eager_model():
    with torch.device("meta"):
        model = GPT(CFG)
    fm = FlatParamModule(model)
    fm.bind(torch.empty(fm.numel))
    torch.manual_seed(0)
    fm.init_weights(init_gpt_weights)
    ref = gpt(0)  # GPT.__init__ applies init_gpt_weights right after reset_parameters
    torch.manual_seed(0)
    ref.apply(init_gpt_weights)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_init_fn_that_replaces_a_parameter_is_an_error():
    fm = wrapped(nn.Sequential(nn.Linear(2, 2)))

    def replace(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(torch.zeros(2, 2))

    with pytest.raises(TorchShardError, match=r"'0\.weight' is no longer a view"):
        fm.init_weights(replace)


def test_meta_buffers_are_materialized_and_initialized():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fm = FlatParamModule(model)
    fm.bind(torch.empty(fm.numel))
    bn = model[1]
    assert bn.running_var.device.type == "cpu" and bn.num_batches_tracked.device.type == "cpu"
    with torch.no_grad():
        bn.running_var.fill_(5)
    fm.init_weights()
    assert torch.all(bn.running_var == 1) and torch.all(bn.running_mean == 0)


def test_rebinding_moves_the_model_and_its_gradients():
    fm = wrapped(gpt())
    fm(*batch(0))[1].backward()
    old_flat = fm.flat_param
    values = {k: v.clone() for k, v in fm.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in fm.module.named_parameters()}
    new = torch.empty(fm.numel)
    fm.bind(new)
    assert fm.flat_param is new and fm.flat_grad is not None
    fm.check_views()
    for k, v in fm.state_dict().items():
        assert torch.equal(v, values[k]) and not inside(v, old_flat), k
    for n, p in fm.module.named_parameters():
        assert torch.equal(p.grad, grads[n]) and inside(p.grad, fm.flat_grad), n


# -- conversions keep the invariant ------------------------------------------------------
@pytest.mark.parametrize(
    ("convert", "dtype"),
    [
        (lambda m: m.double(), torch.float64),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.to(torch.bfloat16), torch.bfloat16),
        (lambda m: m.to("cpu"), torch.float32),
        (lambda m: m.float(), torch.float32),
    ],
    ids=["double", "half", "to-bf16", "to-cpu", "float"],
)
def test_conversions_keep_parameters_in_the_buffer(convert, dtype):
    ref = gpt()
    fm = wrapped(copy.deepcopy(ref))
    fm(*batch(0))[1].backward()
    assert convert(fm) is fm
    assert fm.dtype == dtype and fm.flat_param.dtype == dtype
    fm.check_views()
    assert fm.module.lm_head.weight is fm.module.wte.weight
    for (name, p), q in zip(fm.module.named_parameters(), ref.parameters()):
        assert p.dtype == dtype and torch.equal(p, q.to(dtype)), name
        assert inside(p.grad, fm.flat_grad)
    fm.zero_grad()
    fm(*batch(1))[1].backward()
    fm.check_views()
    assert_grads_in_buffer(fm)  # every dtype: the second backward writes into flat_grad
    assert all(p.grad is not None for p in fm.module.parameters())


def test_to_empty_binds_a_meta_model_and_keeps_ties():
    with torch.device("meta"):
        model = GPT(CFG)
    fm = FlatParamModule(model).to_empty(device="cpu")
    assert fm.is_bound and model.lm_head.weight is model.wte.weight
    fm.check_views()


def test_to_on_an_unbound_model_with_weights_binds_it():
    ref = gpt()
    fm = FlatParamModule(copy.deepcopy(ref)).to(torch.float64)
    assert fm.is_bound and fm.dtype == torch.float64
    for p, q in zip(fm.parameters(), ref.parameters()):
        assert torch.equal(p, q.double())


def test_to_meta_is_refused():
    fm = wrapped(nn.Linear(2, 2))
    with pytest.raises(TorchShardError, match="meta"):
        fm.to("meta")
    with pytest.raises(TorchShardError, match="meta"):
        fm.to("meta", torch.float16)
    assert fm.dtype == torch.float32
    fm.check_views()


def test_share_memory_keeps_views():
    fm = wrapped(nn.Linear(2, 2))
    fm.share_memory()
    assert fm.flat_param.is_shared()
    fm.check_views()


@pytest.mark.gpu  # else `pytest -m gpu`, the GPU run, would never select it
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_moves_the_whole_buffer():  # pragma: no cover - GPU only
    ref = gpt()
    fm = wrapped(copy.deepcopy(ref)).cuda()
    assert fm.flat_param.is_cuda and fm.device.type == "cuda"
    fm.check_views()
    x, y = batch(0)
    _, loss = fm(x.cuda(), y.cuda())
    loss.backward()
    assert fm.flat_grad.is_cuda and fm.module.wte.weight.grad.is_cuda


# -- state dict ----------------------------------------------------------------------------
def test_state_dict_uses_the_models_own_keys_and_round_trips():
    ref = gpt(1)
    fm = wrapped(gpt(2))
    assert list(fm.state_dict()) == list(ref.state_dict())
    ptrs = [p.data_ptr() for p in fm.parameters()]
    fm.load_state_dict(ref.state_dict())
    assert [p.data_ptr() for p in fm.parameters()] == ptrs  # copied into the views
    fm.check_views()
    plain = gpt(3)
    plain.load_state_dict(fm.state_dict())
    for p, q in zip(plain.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_load_state_dict_assign_is_refused():
    fm = wrapped(nn.Linear(2, 2))
    with pytest.raises(TorchShardError, match="assign=True"):
        fm.load_state_dict(nn.Linear(2, 2).state_dict(), assign=True)


def test_load_state_dict_into_an_unbound_meta_model_is_refused():
    with torch.device("meta"):
        fm = FlatParamModule(nn.Linear(2, 2))
    with pytest.raises(TorchShardError, match="not bound"):
        fm.load_state_dict(nn.Linear(2, 2).state_dict())


# -- names ------------------------------------------------------------------------------------
def names(pairs) -> list[str]:
    return [n for n, _ in pairs]


@pytest.mark.parametrize("remove_duplicate", [True, False])
def test_names_are_the_models_under_module_and_its_own_through_fm_module(remove_duplicate):
    plain, fm = gpt(0), wrapped(gpt(0))  # lm_head.weight is tied to wte.weight
    kw = {"remove_duplicate": remove_duplicate}
    for walk in ("named_parameters", "named_buffers", "named_modules"):
        want = names(getattr(plain, walk)(**kw))
        assert names(getattr(fm.module, walk)(**kw)) == want, walk
        under = names(getattr(fm, walk)(**kw))
        assert under == (["", "module"] if walk == "named_modules" else []) + [
            f"module.{n}" for n in want if n
        ], walk
        prefixed = names(getattr(fm, walk)(prefix="p", **kw))
        assert prefixed == [f"p.{n}" if n else "p" for n in under], walk
    # nn.Module's names are attribute paths: torch resolves them through the wrapper
    for name, p in fm.named_parameters(**kw):
        assert fm.get_parameter(name) is p
    # the model's own names are the state dict's keys (no buffers in this model)
    assert names(fm.module.named_parameters(remove_duplicate=False)) == list(fm.state_dict())


class Holder(nn.Module):
    def __init__(self, fm: FlatParamModule) -> None:
        super().__init__()
        self.fm = fm
        self.other = nn.Linear(2, 2)


def test_a_parent_saves_and_loads_fm_under_the_models_keys():
    fm = wrapped(gpt(2))
    parent = Holder(fm)
    ref = Holder(gpt(1))  # the plain model where fm is
    keys = list(parent.state_dict())
    assert keys == list(ref.state_dict())
    assert "fm.wte.weight" in keys and "fm.lm_head.weight" in keys
    ptrs = [p.data_ptr() for p in fm.parameters()]
    parent.load_state_dict(ref.state_dict())
    assert [p.data_ptr() for p in fm.parameters()] == ptrs  # copied into the views
    fm.check_views()
    for p, q in zip(fm.module.parameters(), ref.fm.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(RuntimeError, match=r'Unexpected key.*"fm\.bogus"'):
        parent.load_state_dict({**ref.state_dict(), "fm.bogus": torch.zeros(1)})
    with pytest.raises(TorchShardError, match="assign=True"):
        parent.load_state_dict(ref.state_dict(), assign=True)
    fm.check_views()


def test_torch_compile_wrapper_round_trips_the_state_dict():
    fm = wrapped(gpt(2))
    compiled = torch.compile(fm)  # nothing compiles until a forward
    sd = compiled.state_dict()
    assert list(sd) == [f"_orig_mod.{k}" for k in gpt(1).state_dict()]
    sd = {k: torch.zeros_like(v) for k, v in sd.items()}
    compiled.load_state_dict(sd)
    assert not fm.flat_param[: fm.layout.param_numel].any()
    fm.check_views()


# -- errors ----------------------------------------------------------------------------------
def bind_error(fm: FlatParamModule, flat, grad=None) -> str:
    with pytest.raises(BindError) as e:
        fm.bind(flat, grad)
    return str(e.value)


def test_bind_errors_are_clear():
    fm = FlatParamModule(nn.Linear(4, 3))
    assert "at least 16 elements" in bind_error(fm, torch.empty(15))
    assert "dtype torch.float32, got torch.float64" in bind_error(fm, torch.empty(16).double())
    assert "1-D" in bind_error(fm, torch.empty(4, 4))
    assert "1-D" in bind_error(fm, torch.empty(32)[::2])
    assert "meta" in bind_error(fm, torch.empty(16, device="meta"))
    assert "torch.Tensor" in bind_error(fm, [0.0] * 16)
    buf = torch.empty(40)
    assert "overlaps" in bind_error(fm, buf[:16], buf[8:24])
    assert "grad: expected at least" in bind_error(fm, torch.empty(16), torch.empty(3))
    # a failed bind leaves the module untouched
    assert not fm.is_bound and fm.module.weight.device.type == "cpu"
    fm.bind(buf[:16], buf[16:32])  # adjacent, not overlapping
    fm.check_views()


def test_construction_errors():
    with pytest.raises(LayoutError, match="no parameters"):
        FlatParamModule(nn.Sequential())
    with pytest.raises(
        LayoutError, match=r"floating point dtype, got torch.int64 \(parameter 'w'\)"
    ):
        m = nn.Module()
        m.w = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
        FlatParamModule(m)
    with pytest.raises(TorchShardError, match=r"nn\.Module"):
        FlatParamModule("model")  # type: ignore[arg-type]


def test_mixed_dtypes_are_cast_with_dtype():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    expected = [p.detach().float().clone() for p in model.parameters()]
    fm = wrapped(model, dtype=torch.float32)
    for p, e in zip(fm.parameters(), expected):
        assert p.dtype == torch.float32 and torch.equal(p, e)


def test_mixed_dtypes_keep_their_own():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3).bfloat16(), nn.LayerNorm(3), nn.Linear(3, 2).bfloat16())
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    fm = wrapped(model)
    assert fm.dtype == torch.uint8 and fm.dtypes == (torch.bfloat16, torch.float32)
    for n, p in fm.module.named_parameters():
        assert p.dtype == expected[n].dtype and torch.equal(p, expected[n]), n
    fm.check_views()
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    fm.module[2](fm.module[1](fm.module[0](x).float()).bfloat16()).float().sum().backward()
    for s in fm.layout:  # every gradient a typed view of the one byte buffer
        p = fm.module.get_parameter(s.name)
        assert p.grad.dtype == p.dtype and p.grad.data_ptr() == fm.flat_grad.data_ptr() + s.offset
    fm.double()  # a conversion casts them all to one
    assert fm.dtype == torch.float64 and fm.dtypes == (torch.float64,)
    for n, p in fm.module.named_parameters():
        assert torch.equal(p, expected[n].double()), n


def test_init_weights_before_bind_is_an_error():
    with torch.device("meta"):
        fm = FlatParamModule(nn.Linear(2, 2))
    with pytest.raises(TorchShardError, match=r"init_weights\(\): the module is not bound"):
        fm.init_weights()


def test_old_parameters_still_held_after_bind_are_reported(caplog):
    model = gpt()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # created before wrapping: a bug
    fm = FlatParamModule(model)
    with caplog.at_level("WARNING", logger="torchshard"):
        fm.bind(torch.empty(fm.numel))
    (record,) = [r for r in caplog.records if "still referenced" in r.getMessage()]
    n = len(list(model.parameters()))
    assert f"{n} of {n} replaced parameters" in record.getMessage()
    assert "optimizer" in record.getMessage()
    del stale

    caplog.clear()
    model = gpt()
    for p in model.parameters():  # leaves one parameter bound to `p`: not worth a warning
        p.requires_grad_(True)
    fm = FlatParamModule(model)
    with caplog.at_level("WARNING", logger="torchshard"):
        fm.bind(torch.empty(fm.numel))
    assert not [r for r in caplog.records if "still referenced" in r.getMessage()]
