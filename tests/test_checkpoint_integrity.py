"""Randomized corruption of every file of a committed checkpoint: no damage loads as another state.

A committed checkpoint of a small GPT (tied head, a frozen parameter, one that never gets a
gradient, float and integer buffers) trained with AdamW in two param groups is damaged one
way at a time: a flipped bit, a truncation, a zeroed run of bytes, a damaged safetensors
header, or one JSON value replaced by another value or type (or dropped). Each damaged copy
is loaded into a live target whose weights, optimizer state and hyperparameters all differ
from the saved ones, and the outcome is one of:

- refused: ``CheckpointError``, and the target is bitwise what it was before the load;
- harmless: the load restored exactly what was saved (weights, buffers, optimizer state
  tensors, hyperparameters as the optimizer sees them, step counters, ``extra``, step);
- wrong: the load succeeded and something differs, or a refusal changed the target;
- other: any other exception.

The sealed mode re-seals ``metadata.json`` after each JSON substitution (what a buggy
writer or a hand edit would produce), so the checksum cannot catch it and the validation
of every value has to: there a load may succeed with a valid but different value, which
no check can tell from the truth, but never with one that the optimizer's constructor
refuses or that breaks the next ``optimizer.step()``.

Run as a script for the counts::

    python tests/test_checkpoint_integrity.py --count 1000            # world size 1
    python tests/test_checkpoint_integrity.py --count 300 --ranks 2   # sharded, 2 ranks
    python tests/test_checkpoint_integrity.py --count 300 --ranks 2 --full  # fully sharded
    python tests/test_checkpoint_integrity.py --count 300 --resealed  # validation behind the seal
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import introspect
import torch
import torch.distributed as dist
from checkpoint_harness import reseal, same_bits, tree_diff
from gpt import GPT, GPTConfig
from torch import nn

import torchshard
from torchshard import checkpoint
from torchshard.checkpoint import CheckpointError

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
SAVED_STEP = 3
EXTRA = {"loss": 2.5, "epoch": 1, "tag": "run-a", "done": False, "lrs": [0.001, 0.0005]}
OUTCOMES = ("refused", "harmless", "wrong", "other")


class Model(GPT):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.never_used = nn.Linear(3, 5)  # no gradient, so no optimizer state
        self.wpe.weight.requires_grad_(False)  # frozen
        self.register_buffer("scale", torch.randn(CFG.n_embd))
        self.register_buffer("calls", torch.tensor(0, dtype=torch.int64))


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln" in name or name.startswith("ln_")


def tokens(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


# -- the setups: one process, and the sharded and fully sharded trainers at 2 ranks -------
@dataclass
class Live:
    """A model and optimizer that a load acts on (``obj`` is what ``load`` is given)."""

    fm: torchshard.FlatParamModule
    opt: torch.optim.Optimizer
    obj: Any
    trainer: torchshard.DistributedTrainer | None = None

    def train(self, steps: int, seed: int) -> None:
        for i in range(steps):
            x, y = tokens(seed, i)
            self.opt.zero_grad()
            self.fm(x, y)[1].backward()
            if self.trainer is not None:
                self.trainer.step()
            else:
                self.opt.step()
            self.fm.module.calls += 1

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: b for n, b in self.fm.module.named_buffers()}


def make_single(seed: int, **hyper: Any) -> Live:
    torch.manual_seed(seed)
    fm = torchshard.FlatParamModule(Model())
    fm.bind(torch.empty(fm.numel, dtype=fm.dtype))
    named = list(fm.module.named_parameters())
    groups = [
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.1},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]
    return Live(fm, torch.optim.AdamW(groups, **hyper), fm)


def make_sharded(seed: int, shard: bool | str = True, **hyper: Any) -> Live:
    torch.manual_seed(seed)
    fm = torchshard.FlatParamModule(Model())
    trainer = torchshard.DistributedTrainer(fm, shard=shard)
    opt = trainer.make_optimizer(
        torch.optim.AdamW, groups=[(no_decay, {"weight_decay": 0.0})], weight_decay=0.1, **hyper
    )
    return Live(fm, opt, trainer, trainer)


SAVED_HYPER = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6)
TARGET_HYPER = dict(lr=2e-3, betas=(0.7, 0.9), eps=1e-7)


# -- snapshots and comparisons ------------------------------------------------------------
def _same_hyper(a: Any, b: Any) -> bool:
    """Equal as the optimizer sees a hyperparameter: 1 and 1.0 alike, True and 1 not,
    a tuple and a list of the same values alike (torch unpacks them), tensors bitwise."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return same_bits(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_hyper(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _groups_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    if len(a) != len(b):
        return [f"param_groups: {len(a)} vs {len(b)}"]
    out = []
    for g, (x, y) in enumerate(zip(a, b)):
        if set(x) != set(y):
            out.append(f"param group {g}: keys {sorted(set(x) ^ set(y))}")
            continue
        out += [
            f"param group {g}[{k!r}]: {x[k]!r} vs {y[k]!r}"
            for k in x
            if not _same_hyper(x[k], y[k])
        ]
    return out


def _weights(live: Live) -> torch.Tensor:
    """Where ``live``'s weights are: the flat buffer, or with ``shard="full"`` (no flat
    buffer; its parameters have no storage between steps) this rank's stripes, which a load
    writes and the optimizer updates."""
    if live.fm.flat_param is not None:
        return live.fm.flat_param
    assert live.trainer is not None and live.trainer.shard == "full"
    return introspect.stripes(live.trainer)


def _stripes_only(live: Live) -> bool:
    return live.fm.flat_param is None


def snapshot(live: Live) -> dict[str, Any]:
    flat = _weights(live)
    params = {} if _stripes_only(live) else dict(live.fm.module.named_parameters())
    return {
        "flat_ptr": flat.data_ptr(),
        "flat": flat.detach().clone(),  # with its padding, which a load leaves alone
        "params": {n: p.detach().clone() for n, p in params.items()},
        "buffers": {n: b.detach().clone() for n, b in live.buffers().items()},
        "optim": copy.deepcopy(live.opt.state_dict()),
    }


def restore(live: Live, snap: dict[str, Any]) -> None:
    """Put ``live`` back to ``snap`` (the target's state before a load)."""
    with torch.no_grad():
        _weights(live).copy_(snap["flat"])
        if _stripes_only(live):  # no unit may stay gathered from the weights a load wrote
            introspect.release_all(live.trainer)
        for n, b in live.buffers().items():
            b.copy_(snap["buffers"][n])
    live.opt.load_state_dict(copy.deepcopy(snap["optim"]))


def differences(live: Live, ref: dict[str, Any], own: bool = False) -> list[str]:
    """What in ``live`` is not bitwise ``ref`` (a snapshot): weights, buffers, optimizer;
    ``own``: ``ref`` is a snapshot of ``live`` itself, whose flat buffer must stay in place.
    A fully sharded ``live`` is compared by its stripes (against a fully sharded ``ref`` at
    the same world size: the same layout), padding included."""
    flat = _weights(live)
    out = []
    if own and flat.data_ptr() != ref["flat_ptr"]:
        out.append("the flat buffer was replaced")
    if (own or _stripes_only(live)) and not same_bits(flat, ref["flat"]):
        out.append("flat buffer" if own else "stripes")
    params = {n: p for n, p in live.fm.module.named_parameters()}
    out += [f"parameter {n}" for n, p in ref["params"].items() if not same_bits(params[n], p)]
    bufs = live.buffers()
    out += [f"buffer {n}" for n, b in ref["buffers"].items() if not same_bits(bufs[n], b)]
    sd = live.opt.state_dict()
    out += tree_diff(sd["state"], ref["optim"]["state"], "optimizer state")
    out += _groups_diff(sd["param_groups"], ref["optim"]["param_groups"])
    return out


# -- corruptions --------------------------------------------------------------------------
_SEAL = re.compile(rb',"sha256":"([0-9a-f]{64})"\}\s*\Z')


def _nodes(tree: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _nodes(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _nodes(v, (*path, i))
    return out


def _descend(rng: random.Random, tree: Any, skip: tuple[str, ...], start: tuple = ()) -> tuple:
    """A node reached from ``start`` by choosing a random child at every level (each section
    gets its share, however many leaves it has), stopping early at a container now and then."""
    path: tuple = start if _has(tree, start) else ()
    node = _get(tree, path)
    while isinstance(node, (dict, list)) and node:
        keys = [k for k in (node if isinstance(node, dict) else range(len(node)))]
        keys = [k for k in keys if not (path == () and k in skip)]
        if not keys or (path and rng.random() < 0.15):
            break
        k = rng.choice(keys)
        path, node = (*path, k), node[k]
    return path


def _has(tree: Any, path: tuple) -> bool:
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            return False
        tree = tree[k]
    return True


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _replacements(value: Any) -> list[Any]:
    pool: list[Any] = [0, -1, 1, 1.5, 2**62, 0.0, "x", "", None, True, False, [], {}]
    if isinstance(value, bool):
        pool += [not value, int(value), str(value).lower()]
    elif isinstance(value, (int, float)):
        pool += [value * 2, -value, value + 1, float(value), int(value), value / 10, 1e308]
    elif isinstance(value, str):
        pool += [value + "x", value.upper(), value[:-1]]
    elif isinstance(value, list):
        pool += [value[:-1], [*value, value[-1] if value else 0], list(reversed(value))]
    elif isinstance(value, dict):
        pool += [dict(list(value.items())[:-1])]
    return pool


# Where the values that become training state live: a resealed edit starts there half the time.
FOCUS = [("optimizer", "param_groups"), ("optimizer", "scalar_state"), ("optimizer",), ("step",)]


def substitute(
    rng: random.Random, tree: Any, skip: tuple[str, ...] = (), focus: bool = False
) -> tuple[Any, str]:
    """Replace one node of a JSON tree by another value or type, or drop it."""
    tree = copy.deepcopy(tree)
    start = rng.choice(FOCUS) if focus and rng.random() < 0.5 else ()
    path = _descend(rng, tree, skip, start)
    if not path:
        return rng.choice([[], {}, None, "x", 0]), "root"
    parent, key = _get(tree, path[:-1]), path[-1]
    old = parent[key]
    if rng.random() < 0.12:
        del parent[key]
        return tree, f"drop {list(path)}"
    new = rng.choice(_replacements(old))
    parent[key] = new
    return tree, f"{list(path)}: {json.dumps(old)[:40]} -> {json.dumps(new)[:40]}"


def _dump(tree: Any) -> bytes:
    return json.dumps(tree, separators=(",", ":")).encode()


def _header_span(data: bytes) -> int:
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    return min(len(data), 8 + n)


def corrupt(rng: random.Random, name: str, data: bytes, resealed: bool) -> tuple[bytes, str]:
    """One random corruption of file ``name`` (its bytes ``data``): (new bytes, description)."""
    is_json = name.endswith(".json")
    if resealed:
        tree, what = substitute(rng, json.loads(data), skip=("sha256",), focus=True)
        return reseal(_dump(tree)), f"resealed substitution {what}"
    kinds = ["bit flip", "truncation", "zeroed run"]
    kinds += ["substitution"] * 3 if is_json else ["header bit flip", "header substitution"]
    kind = rng.choice(kinds)
    out = bytearray(data)
    if kind in ("bit flip", "header bit flip"):
        hi = _header_span(data) if kind == "header bit flip" else len(data)
        i, bit = rng.randrange(hi), rng.randrange(8)
        out[i] ^= 1 << bit
        return bytes(out), f"{kind} at byte {i} bit {bit}"
    if kind == "truncation":
        n = rng.randrange(len(data))
        return data[:n], f"truncation to {n} of {len(data)} bytes"
    if kind == "zeroed run":
        n = rng.randint(1, 64)
        i = rng.randrange(max(1, len(data) - n))
        out[i : i + n] = bytes(len(out[i : i + n]))
        return bytes(out), f"zeroed run [{i}, {i + n})"
    if kind == "substitution":
        tree, what = substitute(rng, json.loads(data))
        return _dump(tree), f"substitution {what}"
    # a header value substituted; the length prefix fixed so the file still parses
    span = _header_span(data)
    tree, what = substitute(rng, json.loads(data[8:span]))
    head = _dump(tree)
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + data[span:], f"header substitution {what}"


def pick_file(rng: random.Random, names: list[str], resealed: bool) -> str:
    """``metadata.json`` half the time (nothing else vouches for it), else any file."""
    if resealed or rng.random() < 0.5:
        return "metadata.json"
    return rng.choice(sorted(names))


# -- one load, classified -----------------------------------------------------------------
def _step_ok(live: Live) -> str | None:
    """Whether the loaded optimizer can take a step (with zero gradients)."""
    try:
        for group in live.opt.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        live.opt.step()
    except Exception as e:
        return f"optimizer.step() after the load: {type(e).__name__}: {e}"
    finally:
        live.opt.zero_grad()
    return None


def _invalid(live: Live, info: Any) -> list[str]:
    """What a load accepted that is not valid: hyperparameters the optimizer's own constructor
    refuses (or of another type than a fresh optimizer's), step counters that are not
    non-negative whole numbers, a checkpoint step that ``save`` would refuse."""
    cls = type(live.opt)
    takes = inspect.signature(cls).parameters
    out = []
    if type(info.step) is not int or info.step < 0:
        out.append(f"step {info.step!r}")
    if not isinstance(info.extra, dict):
        out.append(f"extra {info.extra!r}")
    defaults = cls([nn.Parameter(torch.zeros(2))]).param_groups[0]
    for g, group in enumerate(live.opt.param_groups):
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        try:
            cls([nn.Parameter(torch.zeros(2))], **{k: v for k, v in hyper.items() if k in takes})
        except Exception as e:
            out.append(f"param group {g}: {cls.__name__} refuses {hyper}: {e}")
            continue
        for k, v in hyper.items():
            default = defaults.get(k, ...)
            if default is ...:
                out.append(f"param group {g}: {k!r} is no hyperparameter of {cls.__name__}")
            elif isinstance(default, bool) and not isinstance(v, bool):
                out.append(f"param group {g}: {k}={v!r} is not a bool")
            elif default is None and not (v is None or isinstance(v, bool)):
                out.append(f"param group {g}: {k}={v!r} is neither None nor a bool")
    for i, st in live.opt.state_dict()["state"].items():
        step = st.get("step")
        if step is not None:
            v = float(step)
            if not (v >= 0 and v == int(v)) or not step.dtype.is_floating_point:
                out.append(f"state {i}: step {step!r}")
    return out


def attempt(
    live: Live, path: Path, target: dict[str, Any], saved: dict[str, Any], resealed: bool
) -> tuple[str, str]:
    """Load ``path`` into ``live`` (first restored to ``target``); (outcome, detail)."""
    restore(live, target)
    try:
        info = checkpoint.load(path, live.obj, optimizer=live.opt)
    except CheckpointError as e:
        changed = differences(live, target, own=True)
        if changed:
            return "wrong", f"refused ({e}) but changed {changed[:3]}"
        return "refused", str(e)
    except Exception as e:
        return "other", f"{type(e).__name__}: {e}"
    diffs = differences(live, saved)
    diffs += (
        [f"step {info.step!r}"] if info.step != SAVED_STEP or type(info.step) is not int else []
    )
    diffs += tree_diff(info.extra, EXTRA, "extra")
    if not diffs:
        return "harmless", ""
    if resealed:
        # A valid value that differs cannot be told from the truth once the seal vouches
        # for it; a load must never accept what the optimizer itself would refuse.
        bad = _invalid(live, info)
        problem = _step_ok(live)
        if not bad and problem is None:
            return "harmless", f"valid but different: {diffs[:2]}"
        return "wrong", f"accepted an invalid value: {(bad or [problem])[:2]} ({diffs[:2]})"
    return "wrong", "; ".join(diffs[:3])


def _combine(outcomes: list[tuple[str, str]]) -> tuple[str, str]:
    """One corruption's outcome over all ranks: the worst; ranks that disagree are wrong."""
    kinds = {o for o, _ in outcomes}
    for worst in ("other", "wrong"):
        if worst in kinds:
            return worst, next(d for o, d in outcomes if o == worst)
    if len(kinds) > 1:
        return "wrong", f"ranks disagree: {outcomes}"
    return outcomes[0]


# -- the runs -----------------------------------------------------------------------------
def _run(
    live: Live, path: Path, saved: dict[str, Any], count: int, seed: int, resealed: bool
) -> dict[str, Any]:
    """``count`` corruptions of the checkpoint at ``path``, one at a time, each undone after."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    files = {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    if world > 1:
        dist.barrier()  # every rank has the intact files before rank 0 damages one
    target = snapshot(live)
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {k: [] for k in OUTCOMES}
    harmless_changes = 0
    for i in range(count):
        what = ""
        if rank == 0:
            name = pick_file(rng, list(files), resealed)
            data, how = corrupt(rng, name, files[name], resealed)
            (path / name).write_bytes(data)
            what = f"{name}: {how}"
        if world > 1:
            dist.barrier()
        outcome = attempt(live, path, target, saved, resealed)
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, outcome)
            outcome = _combine(gathered)
        kind, detail = outcome
        counts[kind] += 1
        harmless_changes += kind == "harmless" and bool(detail)
        if len(examples[kind]) < 40:
            examples[kind].append(f"#{i} {what}: {detail}"[:400])
        if rank == 0:
            (path / name).write_bytes(files[name])
        if world > 1:
            dist.barrier()
    assert {p.name: p.read_bytes() for p in sorted(path.iterdir())} == files
    return {
        "counts": {k: counts[k] for k in OUTCOMES},
        "examples": examples,
        "valid_but_different": harmless_changes,
    }


def run_single(root: Path, count: int, seed: int, resealed: bool = False) -> dict[str, Any]:
    """World size 1: save once, then ``count`` corruptions loaded into one reused target."""
    torch.set_num_threads(1)
    source = make_single(0, **SAVED_HYPER)
    source.train(SAVED_STEP, seed=0)
    path = checkpoint.save(root, source.fm, step=SAVED_STEP, optimizer=source.opt, extra=EXTRA)
    saved = snapshot(source)
    live = make_single(1, **TARGET_HYPER)
    live.train(2, seed=1)
    assert differences(live, saved), "the target must differ from the saved state everywhere"
    return _run(live, path, saved, count, seed, resealed)


def _sharded_worker(root: str, count: int, seed: int, shard: bool | str = True) -> dict[str, Any]:
    """Every rank: save a sharded (or fully sharded) checkpoint, then load ``count``
    corruptions of it."""
    source = make_sharded(0, shard, **SAVED_HYPER)
    source.train(SAVED_STEP, seed=0)
    path = checkpoint.save(root, source.obj, step=SAVED_STEP, optimizer=source.opt, extra=EXTRA)
    saved = snapshot(source)
    live = make_sharded(1, shard, **TARGET_HYPER)
    live.train(2, seed=1)
    try:
        return _run(live, path, saved, count, seed, resealed=False)
    finally:
        source.trainer.close()
        live.trainer.close()


def run_sharded(
    root: Path, count: int, seed: int, ranks: int = 2, shard: bool | str = True
) -> dict[str, Any]:
    from multiprocess import run_distributed

    timeout = 60 + 0.5 * count
    args = (str(root), count, seed, shard)
    return run_distributed(_sharded_worker, ranks, *args, timeout=timeout)[0]


def _explain(result: dict[str, Any]) -> str:
    lines = [f"counts: {result['counts']}"]
    for kind in ("wrong", "other"):
        lines += [f"  {kind}: {e}" for e in result["examples"][kind][:10]]
    return "\n".join(lines)


# -- tests --------------------------------------------------------------------------------
def test_world_1_no_corruption_loads_as_another_state(tmp_path):
    result = run_single(tmp_path / "ckpt", count=240, seed=1)
    c = result["counts"]
    assert c["wrong"] == 0 and c["other"] == 0, _explain(result)
    assert c["refused"] > 150, _explain(result)  # most damage is caught, not ignored


def test_sharded_2_ranks_no_corruption_loads_as_another_state(tmp_path):
    result = run_sharded(tmp_path / "ckpt", count=120, seed=2)
    c = result["counts"]
    assert c["wrong"] == 0 and c["other"] == 0, _explain(result)
    assert c["refused"] > 70, _explain(result)


def test_full_2_ranks_no_corruption_loads_as_another_state(tmp_path):
    """The fully sharded load reads each rank's stripes itself (no broadcast): its own path."""
    result = run_sharded(tmp_path / "ckpt", count=120, seed=4, shard="full")
    c = result["counts"]
    assert c["wrong"] == 0 and c["other"] == 0, _explain(result)
    assert c["refused"] > 70, _explain(result)


def test_resealed_substitutions_never_load_an_invalid_value(tmp_path):
    result = run_single(tmp_path / "ckpt", count=160, seed=3, resealed=True)
    c = result["counts"]
    assert c["wrong"] == 0 and c["other"] == 0, _explain(result)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1, help="1: one process; 2+: sharded trainer")
    p.add_argument("--full", action="store_true", help="with --ranks 2+: shard='full'")
    p.add_argument("--resealed", action="store_true", help="re-seal metadata.json after each edit")
    p.add_argument("--show", type=int, default=5, help="examples of each outcome to print")
    args = p.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        if args.ranks == 1:
            result = run_single(root, args.count, args.seed, args.resealed)
        else:
            shard = "full" if args.full else True
            result = run_sharded(root, args.count, args.seed, args.ranks, shard)
    for kind in OUTCOMES:
        print(f"{kind:<9} {result['counts'][kind]}")
    if args.resealed:
        print(f"(of the harmless: {result['valid_but_different']} valid but different values)")
    for kind in OUTCOMES:
        for e in result["examples"][kind][: args.show]:
            print(f"  {kind}: {e}")
    print(f"{args.count} corruptions in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_checkpoint_integrity  # by name, so the 2-rank worker pickles by reference

    sys.exit(test_checkpoint_integrity.main())
