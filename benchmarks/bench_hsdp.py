"""Hybrid sharding (issue 23): the 2 x 2 step at 4 ranks against the plain sharded modes and
FSDP2's HSDP, and the cross-node bytes it saves at scale, computed.

    python benchmarks/bench_hsdp.py [--steps 30] [--warmup 3]
                                    [--out benchmarks/results/hsdp.json]
    # part 3, on two network namespaces joined by a 1 Gbit/s link (root; not in run_all.py)
    T=../shared/tools/two-nodes.sh; $T up 1gbit
    R="torchrun --nnodes 2 --nproc-per-node 2 --master-addr 10.77.0.1 --master-port 29500"
    $T run 0 $R --node-rank 0 benchmarks/bench_hsdp.py --nodes --steps 10 &
    $T run 1 $R --node-rank 1 benchmarks/bench_hsdp.py --nodes --steps 10; wait; $T down

1. **Step time, 4 ranks.** One launch of 4 fresh processes (gloo, ``torch.set_num_threads(1)``
   each) on the project's 2 cores; the example's "small" GPT (byte vocabulary), its corpus and
   ``get_batch`` (8 x 128 tokens per rank, the same batches for every configuration), AdamW as
   in the example. Configurations, built from the same weights:

     ts_shard         ``DistributedTrainer(fm, shard=True)`` over the 4 ranks
     hsdp_shard       ``mesh = torchshard.init_mesh(dp_replicate=2)``,
                      ``DistributedTrainer(fm, mesh=mesh, shard=True)``: 2 replicas of 2 shards
     ts_full          ``shard="full"`` over the 4 ranks (a unit per block, prefetch 1)
     hsdp_full        the same over the mesh; *not available* where the trainer raises
                      ``MeshError`` for it (recorded with the message, not a crash)
     fsdp2_full       FSDP2 ``fully_shard`` per block and on the root, one 4-rank mesh (ZeRO-3)
     fsdp2_hsdp       the same on ``init_device_mesh("cpu", (2, 2),
                      mesh_dim_names=("replicate", "shard"))``: FSDP2's HSDP
     fsdp2_hsdp_keep  FSDP2's HSDP with ``reshard_after_forward=False`` (FSDP1's
                      ``_HYBRID_SHARD_ZERO2``: the memory class of ``hsdp_shard``)

   Both meshes put ranks {0, 1} and {2, 3} in a shard group and {0, 2}, {1, 3} in a replicate
   group. The steps are interleaved, in an order rotated every step; a step is zero_grad +
   forward + backward + reduction + optimizer step (+ all-gather), after a barrier, in wall
   and process CPU time; per step the max over ranks; a paired ratio per step. Targets
   (issue 23): ``hsdp_full`` at most 1.15x ``ts_full`` and at most 1.0x ``fsdp2_hsdp``.
   **On one machine this measures overhead, not the network gain**: every rank shares the
   same cores and loopback, so a collective inside a shard group costs what one across
   replicas does, and the step time shows what hybrid sharding's second collective per
   bucket or unit costs, not what it saves across nodes (part 2).
2. **Cross-node bytes per step, computed** (arithmetic, no processes): 8 GPUs per node, bf16
   weights and gradients on the wire, a 7B and a 70B model, at 16, 64 and 512 GPUs. Full
   sharding over every rank (``shard="full"``: the weights all-gathered for forward and again
   for backward, the gradient reduce-scattered; the units kept gathered for the step are
   ignored) and ``shard=True`` (a reduce-scatter and an all-gather) against hybrid sharding
   with ``dp_shard=8`` (node-local), whose only cross-node collective is the all-reduce of a
   rank's reduced 1/8 across the ``world/8`` replicas. Ring collectives over ranks placed node
   by node: each rank sends ``(n-1)/n`` of the buffer per pass (all-reduce: two passes), and
   in a ring through whole nodes one hop in 8 leaves its node, so full sharding's bytes
   through a node's network cards are ``(n-1)/n`` of the buffer per pass, and a rank's share
   (its own card: the node's bytes / 8). Every hop of a replicate group's ring crosses nodes.
   Besides the bytes, hybrid sharding's cross-node ring is ``world/8`` ranks long instead of
   ``world``: fewer latency terms, and the shard groups' collectives run on the links inside
   a node.

3. **Across two nodes, measured** (``--nodes``, by hand): the four torchshard configurations
   under torchrun, 2 ranks on each of two "nodes" (``two-nodes.sh``: network namespaces
   joined by a shaped link; inside a node, loopback), on a GPT whose step the link bounds
   (8 layers, width 512: 25.4M parameters; 1 x 64 tokens per rank). The same mesh: the shard
   groups {0, 1} and {2, 3} are the nodes, so hybrid sharding sends only the replicas'
   all-reduce across the link, and the plain modes every gather and reduction. Rank 0 prints
   the same tables and writes ``hsdp-nodes.json`` (``--out``).

Also recorded: each torchshard trainer's ``stats`` per step (bytes reduced, gathered and
all-reduced across replicas, whole buffers) and every step's loss (the configurations train
the same model on the same data; hybrid sharding reduces in another order, so its losses
differ from the plain modes' in the last bits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist
from _common import (
    add_examples_to_path,
    format_table,
    fsdp2_api,
    machine_info,
    run_ranks,
    write_json,
)
from report.freshness import hashes
from report.stats import spread_text, verdict

import torchshard
from torchshard import DistributedTrainer, FlatParamModule, MeshError

fully_shard, _ = fsdp2_api()

add_examples_to_path()
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import batch_generator, get_batch, load_corpus  # noqa: E402

WORLD, REPLICAS, BATCH, BLOCK, PRESET = 4, 2, 8, 128, "small"
# --nodes: a model whose step the network bounds (25.4M parameters, 102 MB of fp32), few tokens
NODES_MODEL = dict(vocab_size=256, block_size=128, n_layer=8, n_head=8, n_embd=512)
NODES_BATCH, NODES_BLOCK = 1, 64
CONFIGS = (
    "ts_shard",
    "hsdp_shard",
    "ts_full",
    "hsdp_full",
    "fsdp2_full",
    "fsdp2_hsdp",
    "fsdp2_hsdp_keep",
)
TORCHSHARD = {"ts_shard": True, "hsdp_shard": True, "ts_full": "full", "hsdp_full": "full"}
PAIRS = (  # (config, baseline): one ratio per step
    ("hsdp_shard", "ts_shard"),
    ("hsdp_full", "ts_full"),
    ("hsdp_full", "fsdp2_hsdp"),
    ("hsdp_shard", "fsdp2_hsdp_keep"),
    ("ts_full", "fsdp2_full"),
    ("fsdp2_hsdp", "fsdp2_full"),
)
CHECKS = (  # issue 23's targets: (paired key, wall or cpu, at most)
    ("hsdp_full.step / ts_full.step", "wall", 1.15),
    ("hsdp_full.step / fsdp2_hsdp.step", "wall", 1.0),
)
ADAMW = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
# part 2: what the cross-node table computes
NODE = 8  # GPUs per node; hybrid sharding's dp_shard
WIRE_BYTES = 2  # bf16 weights and gradients
MODELS = {"7B": 7 * 10**9, "70B": 70 * 10**9}
WORLDS = (16, 64, 512)
# ring passes of a whole buffer per step: all-gathers + reduce-scatters (an all-reduce is 2)
PASSES = {"full": 3, "sharded": 2}
now = time.perf_counter


# -- 1. step time at 4 ranks ---------------------------------------------------------------------
class Config:
    """One configuration of :data:`CONFIGS` on this rank: its model, optimizer and trainer."""

    def __init__(self, name: str, mesh: torchshard.Mesh, fsdp_meshes: dict, cfg: GPTConfig) -> None:
        self.name, self.trainer = name, None
        torch.manual_seed(0)  # the same weights for every configuration
        model = GPT(cfg)
        if name.startswith("fsdp2"):
            if fully_shard is None:
                raise ImportError("fully_shard: neither torch.distributed.fsdp nor _composable")
            kw: dict = {"mesh": fsdp_meshes["hsdp" if "hsdp" in name else "full"]}
            if name == "fsdp2_hsdp_keep":
                kw["reshard_after_forward"] = False
            for block in model.blocks:
                fully_shard(block, **kw)
            fully_shard(model, **kw)
            self.net = model
            self.opt = torch.optim.AdamW(model.parameters(), **ADAMW)
            self.zero, self.update = self.opt.zero_grad, self.opt.step
            return
        fm = FlatParamModule(model)
        shard = TORCHSHARD[name]
        kw = {"mesh": mesh} if name.startswith("hsdp") else {}
        if shard == "full":
            kw.update(units="auto", prefetch=1, reshard_after_forward=True)
        self.trainer = DistributedTrainer(fm, shard=shard, **kw)
        self.net = fm
        self.opt = self.trainer.make_optimizer(torch.optim.AdamW, **ADAMW)
        self.zero, self.update = self.trainer.zero_grad, self.trainer.step

    def comm(self) -> tuple[int, int, int]:
        """The trainer's cumulative bytes reduced, gathered and all-reduced across replicas."""
        if self.trainer is None:
            return 0, 0, 0
        s = self.trainer.stats
        return s.bytes_reduced, s.bytes_gathered, s.bytes_across_replicas

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float, list[int]]:
        """One step after a barrier: wall and CPU seconds, the loss (read after the timing)
        and the bytes the trainer handed to collectives in it."""
        dist.barrier()
        before = self.comm()
        c0, t0 = time.process_time(), now()
        self.zero()
        loss = self.net(x, y)[1]
        loss.backward()
        self.update()
        c1, t1 = time.process_time(), now()
        moved = [b - a for a, b in zip(before, self.comm())]
        return t1 - t0, c1 - c0, loss.item(), moved


def build(
    names: list[str], mesh: torchshard.Mesh, fsdp_meshes: dict, cfg: GPTConfig
) -> tuple[dict, dict, dict]:
    """Every configuration of ``names`` that builds on every rank; those that are not
    available (a ``MeshError``: hybrid sharding not implemented for that mode yet) and those
    that failed, with the reason."""
    configs, unavailable, errors = {}, {}, {}
    for name in names:
        try:
            configs[name] = Config(name, mesh, fsdp_meshes, cfg)
        except MeshError as e:
            unavailable[name] = str(e)
        except Exception as e:  # reported instead of numbers
            errors[name] = f"{type(e).__name__}: {e}".strip() + "\n" + traceback.format_exc()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted([*unavailable, *errors]))
    for name in sorted({n for failed in everyone for n in failed}):  # built everywhere, or not
        configs.pop(name, None)
        if name not in unavailable:
            errors.setdefault(name, "failed on another rank")
    return configs, unavailable, errors


def run(opts: argparse.Namespace) -> dict:
    """Every configuration on this rank, interleaved step by step: times, losses, bytes.
    ``opts.nodes``: torchshard's only, on the communication-bound model."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = torchshard.init_mesh(dp_replicate=REPLICAS)
    if opts.nodes:
        names, fsdp_meshes = list(TORCHSHARD), {}
        cfg, batch, block = GPTConfig(**NODES_MODEL), NODES_BATCH, NODES_BLOCK
    else:
        names, cfg, batch, block = list(CONFIGS), GPTConfig.preset(PRESET), BATCH, BLOCK
        fsdp_meshes = {
            "full": init_device_mesh("cpu", (world,)),
            "hsdp": init_device_mesh(
                "cpu", (REPLICAS, world // REPLICAS), mesh_dim_names=("replicate", "shard")
            ),
        }
    train, _ = load_corpus()
    batches = [
        get_batch(train, batch, block, batch_generator(0, rank, i, 0), "cpu")
        for i in range(opts.warmup + opts.steps)
    ]
    configs, unavailable, errors = build(names, mesh, fsdp_meshes, cfg)
    names = list(configs)
    out: dict = {k: {n: [] for n in names} for k in ("wall", "cpu", "losses", "comm")}
    for i, (x, y) in enumerate(batches):
        k = i % len(names)
        for name in names[k:] + names[:k]:  # rotated every step
            wall, cpu, loss, moved = configs[name].step(x, y)
            out["losses"][name].append(loss)
            if i >= opts.warmup:
                out["wall"][name].append(wall)
                out["cpu"][name].append(cpu)
                out["comm"][name].append(moved)
    out["replicas"] = {n: c.trainer.replicas for n, c in configs.items() if c.trainer}
    for c in configs.values():
        if c.trainer is not None:
            c.trainer.close()
    out.update(mesh_shape=list(mesh.shape), unavailable=unavailable, errors=errors)
    n_params = next(c.trainer.module.layout.param_numel for c in configs.values() if c.trainer)
    out.update(n_params=n_params, model=dict(cfg.__dict__), batch=batch, block=block)
    return out


def per_step(ranks: list[dict], kind: str, name: str) -> list[float]:
    """One sample per step: the max over ranks."""
    return [max(x) for x in zip(*(r[kind][name] for r in ranks))]


def comm_summary(ranks: list[dict]) -> dict:
    """Per torchshard configuration and rank: the bytes per step it handed to collectives
    (the median step) and whether every step moved the same."""
    out = {}
    for name in TORCHSHARD:
        if name not in ranks[0]["comm"]:
            continue
        by_rank = []
        for r in ranks:
            steps = [tuple(s) for s in r["comm"][name]]
            mid = [statistics.median(s[j] for s in steps) for j in range(3)]
            by_rank.append(dict(zip(("reduced", "gathered", "across_replicas"), mid)))
            by_rank[-1]["constant"] = len(set(steps)) == 1
        out[name] = by_rank
    return out


def loss_diffs(ranks: list[dict], names: list[str]) -> dict[str, float]:
    """The largest |loss - ts_shard's| over every step and rank, per configuration."""
    return {
        n: max(abs(a - b) for r in ranks for a, b in zip(r["losses"][n], r["losses"]["ts_shard"]))
        for n in names
        if n != "ts_shard" and "ts_shard" in names
    }


# -- 2. cross-node bytes, computed -----------------------------------------------------------------
def ring_pass(n: int, nbytes: float) -> float:
    """Bytes each rank sends in one ring pass (an all-gather or a reduce-scatter) of a buffer
    of ``nbytes`` over ``n`` ranks.

    >>> ring_pass(4, 100.0)
    75.0
    """
    return (n - 1) / n * nbytes


def cross_node(world: int, params: int, mode: str, node: int = NODE) -> dict[str, float]:
    """Bytes per step that cross nodes, per rank (its own network card's share: the node's
    bytes / ``node``), for ``mode`` (``"full"`` or ``"sharded"``) sharded over every rank
    (``plain``) and hybrid-sharded with ``dp_shard=node`` (``hybrid``), rings placed node by
    node; and each's per-rank bytes on collectives whose group spans nodes (``*_spanning``:
    what a count of "collectives over the world" gives, 1 hop in ``node`` of it crossing).

    >>> c = cross_node(16, 8 * 10**9, "full")
    >>> round(c["hybrid"] / c["plain"], 4)
    0.3556
    """
    b = params * WIRE_BYTES
    replicas = world // node
    spanning = PASSES[mode] * ring_pass(world, b)  # the rank's wire bytes on world rings
    # a ring through whole nodes: one hop in `node` leaves its node
    plain = spanning / node
    # the all-reduce of the rank's reduced 1/node over the replicas: every hop crosses
    hybrid = 2 * ring_pass(replicas, b / node)
    return {"plain": plain, "hybrid": hybrid, "plain_spanning": spanning, "hybrid_spanning": hybrid}


def cross_node_table() -> list[dict]:
    """Every model of :data:`MODELS` at every world size of :data:`WORLDS`, both modes."""
    rows = []
    for model, params in MODELS.items():
        for world in WORLDS:
            for mode in PASSES:
                c = cross_node(world, params, mode)
                rows.append(dict(model=model, params=params, world=world, mode=mode,
                                 replicas=world // NODE, dp_shard=NODE, **c,
                                 ratio=c["hybrid"] / c["plain"]))  # fmt: skip
    return rows


def print_cross_node(rows: list[dict]) -> None:
    def gb(x: float) -> str:
        return f"{x / 1e9:.2f}"

    table = [
        (f"{r['model']}, {r['world']} GPUs ({r['replicas']}x{r['dp_shard']})",
         {"full": '"full"', "sharded": "True"}[r["mode"]], gb(r["plain"]), gb(r["hybrid"]),
         f"{r['ratio']:.3f}", f"{1 - r['ratio']:.0%}", gb(r["plain_spanning"]))
        for r in rows
    ]  # fmt: skip
    headers = ["cross-node GB/step/rank", "shard=", "plain", "hybrid", "hybrid/plain", "saved",
               "plain on world rings"]  # fmt: skip
    title = (
        f"\ncomputed: {NODE} GPUs per node, bf16 on the wire, ring collectives over ranks placed "
        f"node by node; hybrid: dp_shard={NODE} (node-local), the replicas' all-reduce only\n"
        "crosses; plain: 1 hop in 8 of its rings crosses (a rank's share of its node's bytes); "
        "the last column: a plain rank's wire bytes on rings that span nodes"
    )
    print(format_table(headers, table, title))


def report(ranks: list[dict], opts: argparse.Namespace, t_start: float, machine: dict,
           code: dict) -> None:  # fmt: skip
    """Print the tables and write the JSON, from every rank's :func:`run`."""
    first = ranks[0]
    unavailable, errors = first["unavailable"], {}
    for r in ranks:
        errors.update(r["errors"])
    names = [n for n in CONFIGS if n in first["wall"]]
    rows = []
    for name in [n for n in CONFIGS if n in names or n in unavailable or n in errors]:
        if name in unavailable:
            rows.append((name, "not available: " + unavailable[name].split(";")[0], "-"))
        elif name in errors:
            rows.append((name, "ERROR: " + errors[name].splitlines()[0], "-"))
        else:
            rows.append((name, *(spread_text([1e3 * v for v in per_step(ranks, k, name)], 1, "")
                                 for k in ("wall", "cpu"))))  # fmt: skip
    world, (nr, ns, _) = len(ranks), first["mesh_shape"]
    where = (
        f"{world} ranks under torchrun ({os.environ.get('LOCAL_WORLD_SIZE', '?')} per node), "
        "the launcher's network between nodes"
        if opts.nodes
        else f"{world} ranks on one machine"
    )
    fsdp2 = "" if opts.nodes else " and fsdp2_hsdp*"
    title = (
        f"\n{where} ({nr} replicas x {ns} shards for hsdp_*{fsdp2}), gloo, 1 thread/"
        f"rank, GPT of {first['n_params'] / 1e6:.1f}M parameters, {first['batch']}x"
        f"{first['block']} tokens/rank, AdamW; {opts.steps} steps (+{opts.warmup}) of each, "
        "interleaved; per step the max over ranks, median (p10-p90)"
    )
    if not opts.nodes:
        title += (
            "\nONE machine: this measures hybrid sharding's overhead, not its network gain "
            "(every collective runs over the same loopback and cores)"
        )
    print(format_table(["step time (ms)", "wall", "CPU"], rows, title))
    paired = {
        f"{a}.step / {b}.step": {
            kind: [x / y for x, y in zip(per_step(ranks, kind, a), per_step(ranks, kind, b))]
            for kind in ("wall", "cpu")
        }
        for a, b in PAIRS
        if a in names and b in names
    }
    rows = [(k, spread_text(v["wall"]), spread_text(v["cpu"])) for k, v in paired.items()]
    print(format_table(["paired step ratio", "wall", "CPU"], rows, "\nmedian (p10-p90) over steps"))
    checks = {}
    for key, kind, target in () if opts.nodes else CHECKS:  # one machine's targets
        v = verdict(paired[key][kind], target) if key in paired else "not available"
        checks[key] = {"kind": kind, "target": target, "verdict": v}
        print(f"{key} ({kind}, <= {target}): {v}")
    comm = comm_summary(ranks)
    rows = [
        (f"{name} r{q}", *(f"{c[k] / 2**20:.2f}" for k in ("reduced", "gathered",
                                                           "across_replicas")),
         "yes" if c["constant"] else "NO")
        for name, by_rank in comm.items() for q, c in enumerate(by_rank)
    ]  # fmt: skip
    headers = ["MiB per step (trainer.stats)", "reduced", "gathered", "across replicas", "same"]
    print(format_table(headers, rows, "\nwhole buffers handed to collectives, per rank"))
    diffs = loss_diffs(ranks, names)
    print("max |loss - ts_shard's| over steps and ranks: "
          + ", ".join(f"{n} {d:.2e}" for n, d in diffs.items()))  # fmt: skip

    table = cross_node_table()
    print_cross_node(table)

    load, total = os.getloadavg(), now() - t_start
    print(f"\ntotal {total:.0f} s; 1-min load {machine['loadavg'][0]:.1f} at start, "
          f"{load[0]:.1f} at end ({os.cpu_count()} CPUs)")  # fmt: skip
    results = {"benchmark": "hsdp-nodes" if opts.nodes else "hsdp", "machine": machine}
    results.update(measured=code, args=vars(opts), threads_per_rank=1, world_size=world)
    results.update(mesh_shape=first["mesh_shape"], replicas=first["replicas"])
    results.update({k: first[k] for k in ("n_params", "model", "batch", "block")})
    results.update(adamw=ADAMW, unavailable=unavailable, errors=errors, paired=paired)
    results.update(checks=checks, comm_bytes=comm, loss_diff_vs_ts_shard=diffs)
    results["cross_node"] = {"node": NODE, "wire_bytes": WIRE_BYTES, "passes": PASSES,
                             "rows": table}  # fmt: skip
    results.update(loadavg_end=list(load), total_s=total, samples_by_rank=ranks)
    print(f"wrote {write_json(opts.out, results)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    p.add_argument("--comm-timeout", type=float, default=120, help="gloo collective timeout (s)")
    p.add_argument(
        "--nodes",
        action="store_true",
        help="run under torchrun over its ranks (4, on two nodes: see part 3), torchshard's\n"
        "configurations only, on a model the network bounds; rank 0 reports",
    )
    p.add_argument("--out", help="default: benchmarks/results/hsdp.json (--nodes: hsdp-nodes.json)")
    opts = p.parse_args()
    opts.out = opts.out or ("hsdp-nodes.json" if opts.nodes else "benchmarks/results/hsdp.json")
    t_start, machine, code = now(), machine_info(), hashes("hsdp")
    if not opts.nodes:
        ranks = run_ranks(
            run, WORLD, opts, timeout_s=opts.timeout, comm_timeout_s=opts.comm_timeout
        )
        report(ranks, opts, t_start, machine, code)
        return
    torchshard.init_distributed()
    torch.set_num_threads(1)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, run(opts))
    if dist.get_rank() == 0:
        report(ranks, opts, t_start, machine, code)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
