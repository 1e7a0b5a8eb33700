"""The CUDA paths of checkpoint staging, run on a CPU build with CUDA stand-ins.

No GPU here: ``torch.cuda``'s streams, events, device binding and ``cudart`` are
replaced by fakes that log every call (and the thread that made it), the save's
target reports ``cuda:1`` while its tensors stay on the CPU, and a dispatch mode
logs each staging copy with the fake stream it was enqueued on. On a CPU build the
real ``torch.cuda.Event``, ``Stream`` and ``pin_memory=True`` all raise, so a path
that reaches CUDA without going through the fakes fails here.

What is checked: the writer thread binds the device before its first CUDA call;
with an optimizer only its step waits (on the GPU) for the copies, the module
buffers' copies being the only ones the stream waits for at once; without one the
stream waits for all; host memory is page-locked to the byte and re-registered
only to grow; zero ranges are never staged; a save reads the optimizer's ``step``
tensors with one host read, whatever the number of parameters; loading for a CUDA
trainer pins nothing; ``read_into`` refuses device memory.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from probes import HostReads
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchshard
from torchshard import checkpoint
from torchshard.checkpoint import CheckpointError, _load, _save, _staging
from torchshard.checkpoint._format import resolve
from torchshard.checkpoint._metadata import Readers, read_metadata
from torchshard.checkpoint._safetensors import SafetensorsReader
from torchshard.checkpoint._safetensors_writer import write_safetensors
from torchshard.checkpoint._target import Target

CUDA1 = torch.device("cuda", 1)
WIDTH = 20  # every size below is a multiple of 4 bytes: no alignment padding in the arena


class Net(nn.Module):
    """Linear layers around a BatchNorm (buffers that forward changes), one layer frozen."""

    def __init__(self, depth: int = 2, frozen: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.body = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(depth)])
        if frozen:
            self.inp.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.norm(self.inp(x)))


def trained(
    depth: int = 2, frozen: bool = True, seed: int = 0
) -> tuple[torchshard.FlatParamModule, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    fm = torchshard.FlatParamModule(Net(depth, frozen))
    fm.bind(torch.empty(fm.numel))
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        fm(torch.randn(8, WIDTH)).square().mean().backward()
        opt.step()
    return fm, opt


# -- the stand-ins -------------------------------------------------------------------------------
class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def wait_stream(self, stream: FakeStream) -> None:
        self.cuda.note("wait_stream", self.name, stream.name)

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.note("wait_event", self.name, event)


class FakeEvent:
    def __init__(
        self,
        cuda: FakeCuda,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        self.cuda, self.blocking = cuda, blocking
        self.complete = threading.Event()  # the copies before it ran
        cuda.events.append(self)
        if not cuda.holding:
            self.complete.set()

    def record(self, stream: FakeStream | None = None) -> None:
        self.cuda.note("record", self, stream.name if stream is not None else "current")

    def synchronize(self) -> None:
        self.cuda.note("sync", self)
        if not self.complete.wait(timeout=60):  # the test holds the copies "in flight"
            raise AssertionError("the test never released the staging copies")


class FakeCudart:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.cuda.note("register", ptr, size, flags)
        if self.cuda.register_error:
            return self.cuda.register_error
        assert ptr not in self.cuda.registered, "registered twice"
        self.cuda.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.cuda.note("unregister", ptr)
        if ptr not in self.cuda.registered:
            return 62  # cudaErrorHostMemoryNotRegistered
        del self.cuda.registered[ptr]
        return 0


class FakeCuda:
    """``torch.cuda`` as far as staging uses it; ``log`` holds (thread, call, *args)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()
        self.events: list[FakeEvent] = []
        self.holding = False  # events created meanwhile stay incomplete until release()
        self.registered: dict[int, int] = {}
        self.register_error = 0
        self.fail_bind = False
        self.active = "current"  # the stream a copy is enqueued on
        self.streams = 0
        self.current = FakeStream(self, "current")
        cudart = FakeCudart(self)

        def set_device(device: Any) -> None:
            self.note("set_device", torch.device(device))
            if self.fail_bind:
                raise RuntimeError("CUDA error: invalid device ordinal")

        def current_stream(device: Any = None) -> FakeStream:
            return self.current

        def new_stream(device: Any = None, priority: int = 0, **kwargs: Any) -> FakeStream:
            self.streams += 1
            return FakeStream(self, f"side{self.streams}")

        @contextlib.contextmanager
        def stream(s: FakeStream) -> Iterator[None]:
            before, self.active = self.active, s.name
            try:
                yield
            finally:
                self.active = before

        m = monkeypatch
        m.setattr(torch.cuda, "set_device", set_device)
        m.setattr(torch.cuda, "current_device", lambda: 1)
        m.setattr(torch.cuda, "current_stream", current_stream)
        m.setattr(torch.cuda, "Stream", new_stream)
        m.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(self, *a, **k))
        m.setattr(torch.cuda, "stream", stream)
        m.setattr(torch.cuda, "cudart", lambda: cudart)

    def note(self, *entry: Any) -> None:
        with self.lock:
            self.log.append((threading.get_ident(), *entry))

    def hold(self) -> None:
        self.holding = True

    def release(self) -> None:
        self.holding = False
        for event in self.events:
            event.complete.set()

    def calls(self, name: str) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[1] == name]


class CopyLog(TorchDispatchMode):
    """Logs each in-place copy or fill with the (fake) stream it runs on."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("copy_", "zero_", "fill_"):
            self.cuda.note(name, self.cuda.active, args[0].numel())
        return func(*args, **(kwargs or {}))


class CudaTarget(Target):
    """What ``Target`` sees of a trainer on ``cuda:1``; the tensors stay on the CPU."""

    def __init__(self, obj: Any) -> None:
        super().__init__(obj)
        self.device = CUDA1


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(_save, "Target", CudaTarget)
    return fake


@pytest.fixture
def writer() -> Iterator[_save.Writer]:
    w = _save.Writer(timeout=60.0)
    yield w
    w.close()


def save(cuda: FakeCuda, w: _save.Writer, root: Path, fm, opt, step: int) -> _save.CheckpointFuture:
    with CopyLog(cuda):
        return w.save(root, fm, step, opt, None, None)


# -- expected sizes, from the model alone -----------------------------------------------------------
def buffer_bytes(fm: torchshard.FlatParamModule) -> int:
    return sum(b.numel() * b.element_size() for b in fm.module.buffers())


def weight_bytes(fm: torchshard.FlatParamModule) -> int:
    slots = fm.layout.slots
    return (slots[-1].end - slots[0].offset) * fm.flat_param.element_size()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's parameter-shaped state (what is staged; no zeros)."""
    return sum(
        v.numel() * v.element_size()
        for p, st in opt.state.items()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0
    )


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# -- 1. the writer thread binds the device ----------------------------------------------------------
def test_bind_device_binds_cuda_only(cuda: FakeCuda) -> None:
    _staging.bind_device(torch.device("cpu"))
    assert cuda.calls("set_device") == []
    _staging.bind_device(CUDA1)
    assert [e[2] for e in cuda.calls("set_device")] == [CUDA1]


def test_the_writer_thread_binds_the_device_before_its_first_cuda_call(
    cuda: FakeCuda, writer: _save.Writer, tmp_path: Path
) -> None:
    fm, opt = trained()
    main = threading.get_ident()
    path = save(cuda, writer, tmp_path, fm, opt, 1).wait()

    pool = {e[0] for e in cuda.calls("sync")}
    assert len(pool) == 1 and main not in pool, "the writer thread waits for the copies"
    (thread,) = pool
    theirs = [e[1:] for e in cuda.log if e[0] == thread]
    assert theirs[0] == ("set_device", CUDA1), f"first CUDA call of the writer thread: {theirs}"
    assert [e for e in theirs if e[0] == "set_device"] == [("set_device", CUDA1)]

    fresh, fresh_opt = trained(seed=1)
    checkpoint.load(path, fresh, optimizer=fresh_opt)
    assert torch.equal(fresh.flat_param, fm.flat_param)
    for a, b in zip(fresh.module.buffers(), fm.module.buffers()):
        assert torch.equal(a, b)


# -- 2. what waits for the copies -------------------------------------------------------------------
def test_with_an_optimizer_only_its_step_waits_for_the_copies(
    cuda: FakeCuda, writer: _save.Writer, tmp_path: Path
) -> None:
    fm, opt = trained()
    main = threading.get_ident()
    cuda.hold()  # the copies stay "in flight" until released
    try:
        future = save(cuda, writer, tmp_path, fm, opt, 1)
        staging = ("wait_stream", "copy_", "record", "wait_event", "zero_", "fill_")
        during = [e[1:] for e in cuda.log if e[0] == main and e[1] in staging]

        # the side stream first waits for the work already queued, then copies the buffers
        assert during[0] == ("wait_stream", "side1", "current")
        records = [i for i, e in enumerate(during) if e[0] == "record"]
        assert len(records) == 2 and all(during[i][2] == "side1" for i in records)
        early, done = (during[i][1] for i in records)
        assert done.blocking and not early.blocking  # the writer sleeps in synchronize()
        buffers = during[1 : records[0]]
        assert buffers == [("copy_", "side1", b.numel()) for b in fm.module.buffers()]
        rest = during[records[0] + 1 : records[1]]
        assert rest and all(e[:2] == ("copy_", "side1") for e in rest)
        # the current stream waits for the buffers' copies only
        assert [e for e in during if e[0] == "wait_event"] == [("wait_event", "current", early)]

        opt.step()  # enqueues a GPU-side wait for every copy before the step's kernels
        assert cuda.calls("wait_event")[-1][1:] == ("wait_event", "current", done)
        assert cuda.calls("wait_event")[-1][0] == main
    finally:
        cuda.release()
    future.wait()
    n = len(cuda.calls("wait_event"))
    opt.step()  # the copies are done: nothing left to wait for
    assert len(cuda.calls("wait_event")) == n

    cuda.hold()  # a second save: the hook is not registered twice
    try:
        future = save(cuda, writer, tmp_path, fm, opt, 2)
        n = len(cuda.calls("wait_event"))
        opt.step()
        assert len(cuda.calls("wait_event")) == n + 1
        assert cuda.calls("wait_event")[-1][3] is cuda.calls("record")[-1][2]
    finally:
        cuda.release()
    future.wait()


def test_without_an_optimizer_the_stream_waits_for_every_copy(
    cuda: FakeCuda, writer: _save.Writer, tmp_path: Path
) -> None:
    fm, _ = trained()
    future = save(cuda, writer, tmp_path, fm, None, 1)
    done = [e[2] for e in cuda.calls("record")][-1]
    assert [e[1:] for e in cuda.calls("wait_event")][-1] == ("wait_event", "current", done)
    future.wait()


# -- 3. pinned memory, to the byte ---------------------------------------------------------------
def test_staging_memory_is_pinned_to_the_byte_and_regrown_once(
    cuda: FakeCuda, writer: _save.Writer, tmp_path: Path
) -> None:
    fm, opt = trained()
    small = buffer_bytes(fm) + weight_bytes(fm)
    save(cuda, writer, tmp_path, fm, None, 1).wait()
    (first,) = cuda.calls("register")
    assert first[3] == small == writer.pinned_bytes
    assert small & (small - 1), "a size torch's pinned allocator would round up"
    # whole pages of its own: no other allocation shares a page that registration locks
    assert first[2] % mmap.PAGESIZE == 0
    storage = writer.arena.block.untyped_storage()
    assert (
        storage.data_ptr() + storage.nbytes()
        >= first[2] + -(-small // mmap.PAGESIZE) * mmap.PAGESIZE
    )

    big = small + state_bytes(opt)
    save(cuda, writer, tmp_path, fm, opt, 2).wait()
    grown = [e[1:] for e in cuda.log if e[1] in ("register", "unregister")]
    assert grown[1] == ("unregister", first[2]), "the smaller block goes first"
    assert grown[2][0] == "register" and grown[2][2] == big == writer.pinned_bytes
    assert big & (big - 1)
    assert cuda.registered == {grown[2][1]: big}

    save(cuda, writer, tmp_path, fm, opt, 3).wait()  # the same share: no new registration
    assert len(cuda.calls("register")) == 2
    writer.close()
    assert cuda.registered == {} and writer.pinned_bytes == 0


def test_memory_a_failed_save_copied_into_is_reused_only_once_the_copies_are_over(
    cuda: FakeCuda, writer: _save.Writer, tmp_path: Path
) -> None:
    fm, opt = trained()
    cuda.fail_bind = True  # the writer thread fails before it waits for the copies
    cuda.hold()
    try:
        with pytest.raises(CheckpointError, match="invalid device ordinal"):
            save(cuda, writer, tmp_path, fm, None, 1).wait()
        done = cuda.calls("record")[-1][2]
        assert cuda.calls("sync") == []
    finally:
        cuda.fail_bind = False
        cuda.release()
    save(cuda, writer, tmp_path, fm, opt, 2).wait()  # a larger share: the block is replaced
    main = threading.get_ident()
    order = [e[1:3] for e in cuda.log if e[0] == main and e[1] in ("sync", "unregister")]
    assert order[:2] == [("sync", done), ("unregister", cuda.calls("register")[0][2])]


def test_a_failed_registration_is_a_clear_error(
    cuda: FakeCuda, writer: _save.Writer, tmp_path: Path
) -> None:
    fm, opt = trained()
    cuda.register_error = 2  # cudaErrorMemoryAllocation
    with pytest.raises(
        CheckpointError, match=r"cudaHostRegister of \d+ bytes .* failed with CUDA error 2"
    ):
        save(cuda, writer, tmp_path, fm, opt, 1)
    assert writer.pinned_bytes == 0 and cuda.calls("unregister") == []
    cuda.register_error = 0
    save(cuda, writer, tmp_path, fm, opt, 1).wait()  # the writer is still usable
    assert writer.pinned_bytes == cuda.calls("register")[-1][3]


# -- 5. zero ranges are counts, written by the writer ----------------------------------------------
def test_zero_ranges_are_never_staged_and_the_files_match_a_cpu_save(
    monkeypatch: pytest.MonkeyPatch, writer: _save.Writer, tmp_path: Path
) -> None:
    fm, opt = trained(frozen=True)
    reference = checkpoint.save(tmp_path / "cpu", fm, step=1, optimizer=opt)
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(_save, "Target", CudaTarget)
    path = save(cuda, writer, tmp_path / "cuda", fm, opt, 1).wait()

    assert cuda.calls("zero_") == [] and cuda.calls("fill_") == []
    stateful = [p for p in fm.parameters() if opt.state.get(p)]
    assert len(stateful) < len(list(fm.parameters())), "the frozen layer has no state"
    state_copies = len(cuda.calls("copy_")) - len(list(fm.module.buffers())) - 1
    assert state_copies == 2 * len(stateful)  # exp_avg and exp_avg_sq, not the zeros
    assert writer.pinned_bytes == buffer_bytes(fm) + weight_bytes(fm) + state_bytes(opt)
    same_files(path, reference)


# -- 4. one host read of the step values per save -------------------------------------------------
def test_a_save_reads_the_step_tensors_at_once(tmp_path: Path) -> None:
    for depth in (1, 6):
        fm, opt = trained(depth=depth, frozen=False)
        steps = [st["step"] for st in opt.state.values()]
        assert steps and all(isinstance(s, torch.Tensor) for s in steps)
        with HostReads() as reads:
            checkpoint.save(tmp_path / f"d{depth}", fm, step=1, optimizer=opt)
        # one read of all the step values, at any depth (HostReads sees .tolist(), which does
        # not dispatch, as well as .item() and the like)
        assert reads.seen == {"tolist": 1}, (depth, reads.seen)
        meta = read_metadata(resolve(tmp_path / f"d{depth}"))
        assert meta.optim is not None
        values = [v for v in meta.optim.scalar_state["step"]["values"] if v is not None]
        assert values == [2.0] * len(steps)
    # The control: a read per step tensor, as a save that read them one by one would, is seen.
    with HostReads() as per_tensor:
        for s in steps:
            s.tolist()
    with HostReads() as per_item:
        for s in steps:
            s.item()
    assert per_tensor.seen == {"tolist": len(steps)} and len(steps) > 6
    assert per_item.seen == {"_local_scalar_dense": len(steps)}


# -- 3 (load), 6, 7 -------------------------------------------------------------------------------
def test_loading_for_a_cuda_trainer_reads_into_plain_host_memory(tmp_path: Path) -> None:
    fm, opt = trained()
    path = checkpoint.save(tmp_path, fm, step=1, optimizer=opt)
    meta = read_metadata(path)
    readers = Readers(meta)
    try:  # pin_memory=True raises on a CPU build: this fails if the load pins again
        share = _load._read_share(meta, CudaTarget(fm), opt, readers)
    finally:
        readers.close()
    hosts = [share.weights, *share.buffers.values(), *share.optim.values()]
    assert all(h.device.type == "cpu" and not h.is_pinned() for h in hosts)
    [(s, e, _)] = share.parts
    assert torch.equal(share.weights, fm.flat_param[s:e])


def test_load_drops_the_old_optimizer_state_before_installing_the_loaded_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fm, opt = trained()
    path = checkpoint.save(tmp_path, fm, step=1, optimizer=opt)
    target, target_opt = trained(seed=1)
    old = [weakref.ref(v) for st in target_opt.state.values() for v in st.values()]
    assert old and all(r() is not None for r in old)
    alive_at_install = []
    install = target_opt.load_state_dict

    def spy(state_dict: dict) -> None:
        alive_at_install.append(sum(r() is not None for r in old))
        install(state_dict)

    monkeypatch.setattr(target_opt, "load_state_dict", spy)
    checkpoint.load(path, target, optimizer=target_opt)
    assert alive_at_install == [0]
    for p, q in zip(target.parameters(), fm.parameters()):
        for k, v in opt.state[q].items():
            assert torch.equal(target_opt.state[p][k], v), k


def test_read_into_refuses_memory_that_is_not_contiguous_host_memory(tmp_path: Path) -> None:
    file = tmp_path / "t.safetensors"
    write_safetensors(file, [("x", torch.arange(8, dtype=torch.float32))])
    with SafetensorsReader(file) as reader:
        with pytest.raises(ValueError, match=r"host memory.*on meta"):
            reader.read_into("x", 0, 4, torch.empty(4, device="meta"))
        with pytest.raises(ValueError, match="non-contiguous"):
            reader.read_into("x", 0, 4, torch.empty(8)[::2])
        out = torch.empty(4)
        reader.read_into("x", 2, 6, out)
        assert out.tolist() == [2.0, 3.0, 4.0, 5.0]
