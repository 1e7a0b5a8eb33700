"""Gradient compression and star aggregation (issue 24): the bytes per step on the example
GPT, the step time against the dense all-reduce, Star against the ring, and the step time on
slower links, computed.

    python benchmarks/bench_comm.py [--steps 20] [--warmup 2]
                                    [--out benchmarks/results/comm.json]

Convergence (the example's final validation loss with each comm, 3 seeds) takes 33 runs of
the example and is a separate script: ``bench_convergence.py``.

One launch per world size (2, 3 and 4 fresh processes, gloo, ``torch.set_num_threads(1)``
each, on the project's 2 cores); in each, one ``DistributedTrainer`` per comm of
:data:`WORLDS`, over the same group, built from the same weights: the example's model
(``examples/train_gpt.py`` defaults: the "small" GPT with its byte vocabulary, 1 MiB buckets
as on the CPU, AdamW, gradient clipping at 1.0) fed the same batches (the example's global
batch of 24 x 128 tokens, 24 / N sequences per rank). The steps are interleaved, in an order
rotated every step; a step is zero_grad + forward + backward + ``clip_grad_norm_`` (which
averages the gradients) + optimizer step, after a barrier. Per step and rank:

- wall and process CPU time, and **compute**: the main thread's CPU time (forward, backward,
  compression, the optimizer; not gloo's threads, which carry and sum the bytes, nor waiting);
- ``trainer.stats``: ``payload_bytes`` (what the comm handed to collectives) and
  ``bytes_reduced`` (the dense equivalent), counted;
- the bytes the process sent and received on its TCP sockets during the step (the kernel's
  counters, ``TCP_INFO``'s ``tcpi_bytes_sent`` and ``tcpi_bytes_received``, summed over its
  sockets): what really crossed the loopback, whatever algorithm gloo runs for a collective.

Reported:

1. **Bytes per step** at 2 ranks, counted: each comm's payload against the dense one's.
   Targets (issue 24): BF16 0.5x; PowerSGD(rank=4) at least 15x less; TopK(0.01) as counted,
   with what each rank receives (an all-gather: every rank gets every other's values and
   indices). PowerSGD runs dense for its first ``start_step`` steps (10 in the example; here
   ``--warmup``, so that every timed step is compressed); the mean over the example's 300
   steps is computed from the two.
2. **Step time against dense** at 2 and 4 ranks, paired per step (per step the max over
   ranks). On one machine the loopback is fast and the CPU is slow: compression costs
   compute and saves little wire time, so it may well be slower. Reported as measured.
3. **Step time on a link, computed**: ``compute + wire / bandwidth`` at 1, 10 and 100 Gbit/s,
   with ``compute`` the median measured compute and ``wire`` the median over steps of the
   most bytes a rank sent or received (full duplex), no overlap of communication with
   compute (an upper bound; with perfect overlap it would be the larger of the two).
4. **Star against ring**: ``Star(root=0)`` against ``AllReduce()`` at 2, 3 and 4 ranks: the
   bytes the root and the other ranks send and receive per step, as multiples of the
   gradient buffer, and the step time, paired. gloo's ``reduce`` and ``broadcast`` are not
   a literal star (a reduce-scatter then a gather to the root, and a binomial tree), so the
   root's bytes grow with N more slowly than a parameter server's ``(N - 1) x buffer``
   each way, which is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import time
import traceback

import torch
import torch.distributed as dist
from _common import add_examples_to_path, format_table, machine_info, run_ranks, write_json
from report.freshness import hashes
from report.stats import spread_text

from torchshard import DistributedTrainer, FlatParamModule, comm

add_examples_to_path()
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import batch_generator, get_batch, load_corpus  # noqa: E402

GLOBAL_BATCH, BLOCK, PRESET, BUCKET_MB = 24, 128, "small", 1.0  # train_gpt.py's defaults (CPU)
ADAMW = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
MAX_GRAD_NORM = 1.0
EXAMPLE_STEPS, EXAMPLE_START = 300, 10  # the example's run, PowerSGD's default start_step
RANK, RATIO = 4, 0.01
# the comms at each world size: bytes and speed at 2 and 4, Star against the ring at 2, 3, 4
WORLDS = {
    2: ("dense", "bf16", "fp16", "powersgd", "topk", "star"),
    3: ("dense", "star"),
    4: ("dense", "bf16", "powersgd", "topk", "star"),
}
LABELS = {
    "dense": "AllReduce()",
    "bf16": "BF16()",
    "fp16": "FP16()",
    "powersgd": f"PowerSGD(rank={RANK})",
    "topk": f"TopK({RATIO})",
    "star": "Star(root=0)",
}
GBITS = (1, 10, 100)  # the computed table's links, Gbit/s
FIELDS = ("payload", "dense", "sent", "received", "wait")
now = time.perf_counter


def make_comm(name: str, start_step: int) -> object:
    """The ``torchshard.comm`` object of ``name`` (PowerSGD compresses from ``start_step``)."""
    return {
        "dense": lambda: comm.AllReduce(),
        "bf16": lambda: comm.BF16(),
        "fp16": lambda: comm.FP16(),
        "powersgd": lambda: comm.PowerSGD(rank=RANK, start_step=start_step),
        "topk": lambda: comm.TopK(ratio=RATIO),
        "star": lambda: comm.Star(root=0),
    }[name]()


# -- the kernel's byte counters of this process's TCP sockets ------------------------------------
_TCP_INFO_SENT, _TCP_INFO_RECEIVED = 200, 128  # tcpi_bytes_sent (Linux 4.19+), bytes_received


def tcp_bytes() -> tuple[int, int]:
    """Bytes this process has sent and received on its open TCP sockets so far (Linux; the
    sum of ``TCP_INFO``'s ``tcpi_bytes_sent`` and ``tcpi_bytes_received`` over its sockets;
    ``(0, 0)`` elsewhere). A difference over a step is that step's traffic, headers of gloo's
    messages included, TCP/IP headers not."""
    sent = received = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0, 0
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with s:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            except OSError:
                continue
            if len(info) >= _TCP_INFO_SENT + 8:
                sent += struct.unpack_from("Q", info, _TCP_INFO_SENT)[0]
                received += struct.unpack_from("Q", info, _TCP_INFO_RECEIVED)[0]
    return sent, received


# -- one launch: every comm of a world size, interleaved ------------------------------------------
class Config:
    """One comm on this rank: the example's GPT in a trainer with that comm, and AdamW."""

    def __init__(self, name: str, cfg: GPTConfig, start_step: int) -> None:
        self.name = name
        torch.manual_seed(0)  # the same weights for every configuration
        self.fm = FlatParamModule(GPT(cfg))
        self.comm = make_comm(name, start_step)
        self.trainer = DistributedTrainer(self.fm, comm=self.comm, bucket_mb=BUCKET_MB)
        self.opt = self.trainer.make_optimizer(torch.optim.AdamW, **ADAMW)

    def counters(self) -> tuple[int, int, float]:
        s = self.trainer.stats
        return s.payload_bytes, s.bytes_reduced, s.wait_seconds

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """One step after a barrier: its times, bytes and loss (read after the timing)."""
        dist.barrier()
        before, wire = self.counters(), tcp_bytes()
        k0, c0, t0 = time.thread_time(), time.process_time(), now()
        self.trainer.zero_grad()
        loss = self.fm(x, y)[1]
        loss.backward()
        self.trainer.clip_grad_norm_(MAX_GRAD_NORM)
        self.trainer.step()
        t1, c1, k1 = now(), time.process_time(), time.thread_time()
        after, wire_after = self.counters(), tcp_bytes()
        out = dict(wall=t1 - t0, cpu=c1 - c0, compute=k1 - k0, loss=loss.item())
        out.update(zip(("payload", "dense", "wait"), (b - a for a, b in zip(before, after))))
        out.update(zip(("sent", "received"), (b - a for a, b in zip(wire, wire_after))))
        return out


def build(names: tuple[str, ...], cfg: GPTConfig, start_step: int) -> tuple[dict, dict]:
    """Every configuration of ``names`` that builds on every rank, and why the others failed."""
    configs, errors = {}, {}
    for name in names:
        try:
            configs[name] = Config(name, cfg, start_step)
        except Exception as e:  # reported instead of numbers
            errors[name] = f"{type(e).__name__}: {e}".strip() + "\n" + traceback.format_exc()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(errors))
    for name in sorted({n for failed in everyone for n in failed}):  # built everywhere, or not
        configs.pop(name, None)
        errors.setdefault(name, "failed on another rank")
    return configs, errors


def run(opts: argparse.Namespace) -> dict:
    """Every comm of this world size on this rank, interleaved step by step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**{**GPTConfig.preset(PRESET).__dict__, "block_size": BLOCK, "vocab_size": 256})
    train, _ = load_corpus()
    batch = GLOBAL_BATCH // world
    batches = [
        get_batch(train, batch, BLOCK, batch_generator(0, rank, i, 0), "cpu")
        for i in range(opts.warmup + opts.steps)
    ]
    configs, errors = build(WORLDS[world], cfg, start_step=opts.warmup)
    names = list(configs)
    samples: dict = {n: [] for n in names}
    for i, (x, y) in enumerate(batches):
        k = i % len(names)
        for name in names[k:] + names[:k]:  # rotated every step
            s = configs[name].step(x, y)
            if i >= opts.warmup:
                samples[name].append(s)
    out = dict(samples=samples, errors=errors, batch=batch, block=BLOCK)
    out["comms"] = {n: repr(c.comm) for n, c in configs.items()}
    out["n_params"] = next(iter(configs.values())).fm.layout.param_numel if configs else None
    out["model"] = dict(cfg.__dict__)
    for c in configs.values():
        c.trainer.close()
    return out


# -- summaries --------------------------------------------------------------------------------------
def per_step(ranks: list[dict], name: str, key: str, how=max) -> list[float]:
    """One sample per step: ``how`` (the max) over ranks of ``key``."""
    return [how(s[key] for s in step) for step in zip(*(r["samples"][name] for r in ranks))]


def by_rank(ranks: list[dict], name: str) -> list[dict]:
    """Per rank, the median step's bytes (``FIELDS``) and whether every step moved the same
    payload."""
    out = []
    for r in ranks:
        steps = r["samples"][name]
        med = {k: statistics.median(s[k] for s in steps) for k in FIELDS}
        med["constant"] = len({s["payload"] for s in steps}) == 1
        out.append(med)
    return out


def paired(ranks: list[dict], a: str, b: str) -> dict[str, list[float]]:
    """``a / b`` per step, wall and CPU (each the max over ranks)."""
    return {
        kind: [x / y for x, y in zip(per_step(ranks, a, kind), per_step(ranks, b, kind))]
        for kind in ("wall", "cpu")
    }


def link_time(compute_s: float, wire_bytes: float, gbit: float) -> float:
    """Seconds of a step that computes for ``compute_s``, then moves ``wire_bytes`` over a
    ``gbit`` Gbit/s link (no overlap).

    >>> link_time(0.1, 1.25e9, 10)
    1.1
    """
    return compute_s + wire_bytes * 8 / (gbit * 1e9)


def computed_table(worlds: dict) -> list[dict]:
    """Per world size, comm and link: the computed step time and its ratio to dense's."""
    rows = []
    for world, w in worlds.items():
        if "dense" not in w["bytes"]:
            continue
        for name in w["bytes"]:
            for gbit in GBITS:
                times = {
                    n: link_time(w["compute_s"][n], w["wire_bytes"][n], gbit)
                    for n in (name, "dense")
                }
                rows.append(dict(world=int(world), comm=name, gbit=gbit,
                                 compute_s=w["compute_s"][name], wire_bytes=w["wire_bytes"][name],
                                 step_s=times[name], vs_dense=times[name] / times["dense"]))  # fmt: skip
    return rows


def summarize(ranks: list[dict]) -> dict:
    """One world size's launch: bytes by rank, compute, the paired ratios to dense."""
    first = ranks[0]
    errors: dict = {}
    for r in ranks:
        errors.update(r["errors"])
    names = list(first["samples"])
    out: dict = dict(comms=first["comms"], errors=errors, batch=first["batch"], bytes={})
    out.update(compute_s={}, wire_bytes={}, paired={}, loss_diff_vs_dense={})
    for name in names:
        out["bytes"][name] = by_rank(ranks, name)
        out["compute_s"][name] = statistics.median(per_step(ranks, name, "compute"))
        wire = [max(a, b) for a, b in zip(per_step(ranks, name, "sent"),
                                          per_step(ranks, name, "received"))]  # fmt: skip
        out["wire_bytes"][name] = statistics.median(wire)
        if name != "dense" and "dense" in names:
            out["paired"][f"{name}.step / dense.step"] = paired(ranks, name, "dense")
            out["loss_diff_vs_dense"][name] = max(
                abs(a["loss"] - b["loss"])
                for r in ranks
                for a, b in zip(r["samples"][name], r["samples"]["dense"])
            )
    return out


def report(runs: dict[int, list[dict]], opts: argparse.Namespace, t_start: float,
           machine: dict, code: dict) -> None:  # fmt: skip
    """Print the tables and write the JSON."""
    worlds = {str(w): summarize(ranks) for w, ranks in runs.items()}
    first = runs[min(runs)][0]
    print(f"\nthe example's GPT ({first['n_params']:,} parameters), {GLOBAL_BATCH}x{BLOCK} tokens "
          f"per step over the ranks, 1 MiB buckets; {opts.steps} steps (+{opts.warmup}) of "
          "each comm, interleaved")  # fmt: skip
    for world, w in worlds.items():
        for name, err in w["errors"].items():
            print(f"{world} ranks, {name}: ERROR {err.splitlines()[0]}")
        rows = []
        for name, ranks in w["bytes"].items():
            for q, b in enumerate(ranks):
                rows.append((f"{LABELS[name]} r{q}", f"{b['payload'] / 1024:.1f}",
                             f"{b['dense'] / 1024:.1f}", f"{b['dense'] / max(b['payload'], 1):.2f}",
                             f"{b['sent'] / 1024:.1f}", f"{b['received'] / 1024:.1f}",
                             "yes" if b["constant"] else "NO"))  # fmt: skip
        headers = ["KiB per step", "payload", "dense", "dense/payload", "TCP sent", "TCP received",
                   "same"]  # fmt: skip
        print(format_table(headers, rows, f"\n{world} ranks: bytes per step, the median step"))
        rows = [
            (k.split(".")[0], spread_text(v["wall"]), spread_text(v["cpu"]),
             f"{1e3 * w['compute_s'][k.split('.')[0]]:.1f}")
            for k, v in w["paired"].items()
        ]  # fmt: skip
        if rows:
            title = f"\n{world} ranks: step time / dense's, median (p10-p90) over steps"
            dense_ms = 1e3 * w["compute_s"].get("dense", float("nan"))
            print(format_table(["vs dense", "wall", "CPU", "compute ms"], rows, title)
                  + f"\n(dense: compute {dense_ms:.1f} ms)")  # fmt: skip
    table = computed_table(worlds)
    rows = [(f"{r['world']} ranks, {LABELS[r['comm']]}", f"{r['gbit']}",
             f"{1e3 * r['compute_s']:.1f}", f"{r['wire_bytes'] / 1024:.1f}",
             f"{1e3 * r['step_s']:.2f}", f"{r['vs_dense']:.3f}")
            for r in table]  # fmt: skip
    headers = ["computed step time", "Gbit/s", "compute ms", "wire KiB", "step ms", "vs dense"]
    print(format_table(headers, rows, "\ncomputed: compute + wire / bandwidth, no overlap"))
    star = star_table(worlds)
    rows = [(f"{s['world']} ranks", *(f"{s[k]:.2f}" for k in ("root_sent", "root_received",
             "other_sent", "other_received", "ring_sent", "ring_received", "server")))
            for s in star]  # fmt: skip
    headers = ["Star vs ring, x buffer", "root sent", "root recv", "others sent", "others recv",
               "ring sent", "ring recv", "param server"]  # fmt: skip
    print(format_table(headers, rows, "\nbytes per step (TCP) over the dense gradient's"))
    total = now() - t_start
    load = os.getloadavg()
    print(f"\ntotal {total:.0f} s; 1-min load {machine['loadavg'][0]:.1f} at start, "
          f"{load[0]:.1f} at end ({os.cpu_count()} CPUs)")  # fmt: skip
    results = {"benchmark": "comm", "machine": machine, "measured": code, "args": vars(opts)}
    results.update(threads_per_rank=1, n_params=first["n_params"], model=first["model"])
    results.update(global_batch=GLOBAL_BATCH, block=BLOCK, bucket_mb=BUCKET_MB, adamw=ADAMW)
    results.update(labels=LABELS, powersgd_start_step=opts.warmup, example_steps=EXAMPLE_STEPS,
                   example_start_step=EXAMPLE_START, gbits=list(GBITS))  # fmt: skip
    results.update(worlds=worlds, computed=table, star=star)
    results.update(loadavg_end=list(load), total_s=total)
    results["samples_by_world"] = {str(w): ranks for w, ranks in runs.items()}
    print(f"wrote {write_json(opts.out, results)}")


def star_table(worlds: dict) -> list[dict]:
    """Per world size with both: what Star's root (rank 0) and the other ranks sent and
    received per step, and a ring rank's (dense), as multiples of the gradient buffer; and a
    parameter server's root, ``N - 1`` buffers each way."""
    out = []
    for world, w in worlds.items():
        if not {"star", "dense"} <= set(w["bytes"]):
            continue
        star, ring = w["bytes"]["star"], w["bytes"]["dense"]
        buf = ring[0]["dense"]  # the gradient buffer's bytes (handed to all-reduces once)
        others = star[1:]
        out.append(dict(
            world=int(world), buffer_bytes=buf,
            root_sent=star[0]["sent"] / buf, root_received=star[0]["received"] / buf,
            other_sent=max(b["sent"] for b in others) / buf,
            other_received=max(b["received"] for b in others) / buf,
            ring_sent=max(b["sent"] for b in ring) / buf,
            ring_received=max(b["received"] for b in ring) / buf,
            server=int(world) - 1,
        ))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per comm and world size")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (PowerSGD: dense)")
    p.add_argument("--worlds", default="2,3,4", help="world sizes to launch (of 2, 3, 4)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--out", default="benchmarks/results/comm.json")
    opts = p.parse_args()
    t_start, machine, code = now(), machine_info(), hashes("comm")
    runs = {}
    for world in (int(w) for w in opts.worlds.split(",")):
        runs[world] = run_ranks(run, world, opts, timeout_s=opts.timeout)
    report(runs, opts, t_start, machine, code)


if __name__ == "__main__":
    main()
