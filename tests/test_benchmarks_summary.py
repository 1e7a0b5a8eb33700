"""benchmarks/summary.py: the README tables are generated from benchmarks/results/*.json, and
the freshness check of those results against the code they measure (by content hash: no git)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "summary.py"


def load_summary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmarks_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


summary = load_summary()  # puts benchmarks/ on sys.path: report/ and rows/ import from there
import bench_convergence  # noqa: E402
import bench_hsdp  # noqa: E402
from report import files, freshness, stats  # noqa: E402
from report.table import machine_line  # noqa: E402

RUN_ALL = "python benchmarks/run_all.py"


def regenerate_hint(path: Path) -> str:
    return f"run: {RUN_ALL} (or python benchmarks/summary.py --write {path.relative_to(REPO)})"


# -- the committed tables and results ----------------------------------------------------------------


def test_benchmarks_readme_table_is_up_to_date() -> None:
    path = REPO / "benchmarks" / "README.md"
    assert summary.main(["--check", str(path)]) == 0, regenerate_hint(path)
    assert "not measured yet" not in path.read_text()


def test_top_level_readme_table_is_up_to_date() -> None:
    path = REPO / "README.md"
    # The README must carry the table: without the marker the check would be silenced.
    assert summary.BEGIN in path.read_text(), f"README.md has no '{summary.BEGIN}' marker"
    assert summary.main(["--check", str(path)]) == 0, regenerate_hint(path)


def test_every_row_is_measured_from_the_results() -> None:
    results = summary.load_results(summary.RESULTS)
    assert set(results) == {*summary.FILES, *summary.SLOW, summary.RUN}, f"run: {RUN_ALL}"
    for row in summary.ROWS:
        assert summary.measured(row, results)[0] != summary.NOT_MEASURED, row.what


def test_every_measured_path_names_files() -> None:
    # A misspelt path would hash nothing, forever: never stale.
    for name, specs in summary.MEASURES.items():
        for spec in specs:
            assert freshness.expand(spec.removeprefix("!"), REPO), (name, spec)
    assert tuple(summary.MEASURES) == (*summary.FILES, *summary.SLOW)


def test_each_benchmark_records_the_hashes_of_what_it_measures() -> None:
    for name, (script, *_) in summary.MEASURES.items():
        assert f'hashes("{name}")' in (REPO / script).read_text(), script


def test_benchmarks_import_nothing_from_tests() -> None:
    for script in (REPO / "benchmarks").rglob("*.py"):
        text = script.read_text()
        assert not re.search(r"""["'/]tests["'/]|from multiprocess |import multiprocess""", text), (
            script.name
        )


def test_benchmarks_read_no_private_state_of_torchshard_objects() -> None:
    # Public API only: renaming a private counter inside torchshard breaks no benchmark.
    for script in (REPO / "benchmarks").rglob("*.py"):
        text = script.read_text()
        assert not re.search(r"""\._mode\b|getattr\([^)]*["']_(?!_)""", text), script.name


# -- the table's mechanics -------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [*summary.FILES, *summary.SLOW])
def test_missing_results_file_gives_not_measured_rows(missing: str, tmp_path: Path) -> None:
    full = summary.load_results(summary.RESULTS)
    for name in (*summary.FILES, *summary.SLOW):
        if name != missing and (summary.RESULTS / f"{name}.json").exists():
            shutil.copy(summary.RESULTS / f"{name}.json", tmp_path)
    partial = summary.load_results(tmp_path)
    for row in summary.ROWS:
        if missing in row.needs:
            assert summary.measured(row, partial) == (summary.NOT_MEASURED, "-"), row.what
        else:  # untouched by the missing file
            assert summary.measured(row, partial) == summary.measured(row, full), row.what


def test_no_results_at_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert summary.main(["--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(summary.NOT_MEASURED) == len(summary.ROWS) + 1  # + the machine line


def test_write_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "doc.md"
    path.write_text(f"# title\n\n{summary.BEGIN}\nold table\n{summary.END}\n\ntail\n")
    assert summary.main(["--check", str(path)]) == 1
    assert str(path) in capsys.readouterr().err
    assert summary.main(["--write", str(path)]) == 0
    text = path.read_text()
    assert text.startswith(
        f"# title\n\n{summary.BEGIN}\n| what | how | result | target | verdict |\n"
    )
    assert text.endswith(f"\n{summary.END}\n\ntail\n")
    assert "old table" not in text
    assert summary.main(["--check", str(path)]) == 0


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "flat.json"
    path.write_text("older\n")
    path.chmod(0o640)
    summary.write_atomically(path, "old\n")
    assert path.read_text() == "old\n"
    assert path.stat().st_mode & 0o777 == 0o640  # the file's mode, kept

    def refuse(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        summary.write_atomically(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["flat.json"]


def test_a_result_is_written_by_the_same_atomic_writer(tmp_path: Path) -> None:
    import _common  # benchmarks/, put on sys.path by load_summary()

    path = tmp_path / "results" / "flat.json"  # the folder is made
    _common.write_json(path, {"rows": [1]})
    path.chmod(0o640)
    _common.write_json(path, {"rows": [2]})
    assert json.loads(path.read_text()) == {"rows": [2]}
    assert path.stat().st_mode & 0o777 == 0o640  # kept, as by summary.py --write
    assert [p.name for p in path.parent.iterdir()] == ["flat.json"]  # no temporary left


def test_write_without_markers_exits_2_naming_the_file(tmp_path: Path) -> None:
    marked = tmp_path / "marked.md"
    marked.write_text(f"{summary.BEGIN}\n{summary.END}\n")
    plain = tmp_path / "plain.md"
    plain.write_text("# no markers here\n")
    cmd = [sys.executable, str(SCRIPT), "--write", str(marked), str(plain)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert str(plain) in proc.stderr
    assert plain.read_text() == "# no markers here\n"
    assert marked.read_text() == f"{summary.BEGIN}\n{summary.END}\n"  # nothing written


def test_spread_is_p10_p90_from_ten_pairs_on_and_min_max_below() -> None:
    few = stats.Spread.of([1.0, 3.0, 2.0])
    assert (few.median, few.lo, few.hi, few.kind) == (2.0, 1.0, 3.0, "min-max")
    many = stats.Spread.of([float(x) for x in range(1, 22)])  # 1..21
    assert (many.median, many.lo, many.hi, many.kind) == (11.0, 3.0, 19.0, "p10-p90")
    assert stats.spread_text([1.0, 3.0, 2.0]) == "2.00x (min-max 1.00-3.00)"


def test_a_target_is_met_only_when_the_paired_ratios_mostly_meet_it() -> None:
    ratios = [0.9] * 8 + [1.5] * 2  # median 0.9 either way
    assert stats.verdict(ratios, 1.0) == "met (8 of 10 <= 1)"
    assert stats.verdict([0.9] * 7 + [1.5] * 3, 1.0).startswith("unclear (7 of 10")
    assert stats.verdict([0.9] * 2 + [1.5] * 8, 1.0).startswith("missed (2 of 10")
    # the audit's case: a median under the target, most pairs over it
    assert stats.verdict([1.2, 1.25, 1.33, 1.45, 2.49], 1.3).startswith("unclear (2 of 5")


# -- the fully sharded rows, on made-up results --------------------------------------------------


def row(what: str) -> summary.Row:
    (found,) = (r for r in summary.ROWS if r.what.startswith(what))
    return found


def full_results(by_world: dict[str, list[float]], memory: dict[str, list[float]]) -> dict:
    """A full.json with owner/native ratios per world size and full/replicated RSS ratios
    per allocator (every other number made up)."""
    ranks = [{"memory_bytes": {k: 1 << 20 for k in stats.PERSISTENT}}]
    launch = {k: {"ranks": ranks} for k in ("full", "replicated")}
    return {
        "full": {
            "memory": {
                "target": 0.5,
                "by_allocator": {
                    alloc: {
                        "paired": {"full / replicated": xs},
                        "max_growth_by_round": {"full": [1.0], "replicated": [2.0]},
                        "rounds": [launch],
                    }
                    for alloc, xs in memory.items()
                },
            },
            "collectives": {
                "by_world": {
                    world: {
                        "units": {
                            unit: {"paired": {"both": {"wall": xs, "cpu": xs}}}
                            for unit in ("gpt2_block", "small_block")
                        }
                    }
                    for world, xs in by_world.items()
                }
            },
        }
    }


def test_gloo_rows_name_the_faster_strategy_at_each_world_size() -> None:
    results = full_results(
        {"2": [0.5] * 10, "3": [1.5] * 10, "4": [0.5] * 6 + [1.5] * 4}, {"glibc": [0.4]}
    )
    cell, verdict_cell = summary.measured(row("gloo: gather + reduce-scatter"), results)
    assert verdict_cell == (
        "2: owner (10 of 10 owner <= native); 3: native (0 of 10 owner <= native); "
        "4: unclear (6 of 10 owner <= native)"
    )
    assert cell.startswith("2 ranks: wall 0.50x") and cell.endswith("; 10 repetitions")


def test_the_memory_row_gives_one_verdict_per_allocator() -> None:
    results = full_results({"2": [1.0]}, {"glibc": [0.6, 0.7], "mmap_128k": [0.4, 0.45]})
    cell, verdict_cell = summary.measured(row("peak RSS growth per rank"), results)
    assert verdict_cell == (
        "glibc: missed (0 of 2 <= 0.5); `MALLOC_MMAP_THRESHOLD_=131072`: met (2 of 2 <= 0.5)"
    )
    assert "2 rounds of fresh launches" in cell


def test_the_bytes_row_is_met_only_within_one_percent_of_the_analytic() -> None:
    def results(measured: float) -> dict:
        ratio = {"measured": measured, "analytic": 1.47, "all_elements": 100, "kept_elements": 6}
        comm = {"zero_bytes": 1, "bytes_gathered": 1, "bytes_reduced": 1, "constant": True}
        names = ("ts_repl", "ts_shard", "ts_full")
        return {
            "sharded": {
                "bytes_ratio": {"ts_full / ts_repl": ratio, "ts_full_bf16 / ts_shard_bf16": ratio},
                "comm_bytes": {name: dict(comm) for name in names},
            }
        }

    what = row("bytes communicated per step")
    assert summary.measured(what, results(1.47 * 1.009))[1] == "met"
    assert summary.measured(what, results(1.5))[1] == "missed"
    assert summary.measured(what, {"sharded": {}}) == (summary.NOT_MEASURED, "-")  # older file


# -- the hybrid sharding rows ----------------------------------------------------------------------


def hsdp_results(full: list[float] | None) -> dict:
    """An hsdp.json whose hybrid ``shard="full"`` paired ratios are ``full``, or that records
    it as not available (``None``); every other ratio 1.0."""
    keys = [f"{a}.step / {b}.step" for a, b in bench_hsdp.PAIRS]
    paired = {k: {"wall": [1.0] * 10, "cpu": [1.0] * 10} for k in keys}
    unavailable = {}
    if full is None:
        unavailable["hsdp_full"] = "mesh: dp_replicate=2 with shard='full' is not implemented"
        paired = {k: v for k, v in paired.items() if not k.startswith("hsdp_full")}
    else:
        for k in keys:
            if k.startswith("hsdp_full"):
                paired[k] = {"wall": full, "cpu": full}
    cross = {"node": 8, "rows": bench_hsdp.cross_node_table()}
    return {
        "hsdp": {"paired": paired, "unavailable": unavailable, "errors": {}, "cross_node": cross}
    }


def test_the_hybrid_rows_judge_full_only_where_it_ran() -> None:
    overhead, vs_fsdp2 = row("hybrid sharding 2 x 2"), row("hybrid sharding step vs FSDP2")
    cell, verdict_cell = summary.measured(overhead, hsdp_results(None))
    assert '`shard="full"`: not available when measured' in cell and verdict_cell == "-"
    assert cell.startswith("`shard=True`: wall 1.00x")
    assert summary.measured(vs_fsdp2, hsdp_results(None))[1] == "-"
    ran = hsdp_results([1.1] * 8 + [1.2] * 2)
    assert summary.measured(overhead, ran)[1] == '`shard="full"`: met (8 of 10 <= 1.15)'
    assert summary.measured(vs_fsdp2, ran)[1] == "missed (0 of 10 <= 1)"


def test_cross_node_bytes_equal_a_hop_by_hop_ring() -> None:
    """The computed table's per-rank bytes against a ring walked hop by hop: every chunk of
    a ring pass over ranks placed node by node, counting the hops between two nodes."""

    def crossing(ranks: list[int], nbytes: float, node: int) -> float:
        n = len(ranks)
        hops = sum(
            ranks[(i + h) % n] // node != ranks[(i + h + 1) % n] // node
            for i in range(n)
            for h in range(n - 1)
        )
        return hops * nbytes / n  # a chunk is 1/n of the buffer

    node, params, b = 8, 10**9, bench_hsdp.WIRE_BYTES
    for world in (16, 64):
        c = bench_hsdp.cross_node(world, params, "full", node)
        plain = 3 * crossing(list(range(world)), params * b, node) / world
        assert c["plain"] == pytest.approx(plain, rel=1e-12)
        # one replicate group (rank s of every node), its all-reduce: two passes of 1/node
        group = list(range(0, world, node))
        hybrid = 2 * crossing(group, params * b / node, node) / len(group)
        assert c["hybrid"] == pytest.approx(hybrid, rel=1e-12)
    assert bench_hsdp.cross_node(512, params, "sharded")["hybrid"] == pytest.approx(
        bench_hsdp.cross_node(512, params, "full")["hybrid"]
    )


# -- the compression rows ---------------------------------------------------------------------------


def comm_results(
    bf16: float = 0.5, powersgd: float = 1 / 20, root: tuple = (2.5, 4.0, 4.25)
) -> dict:
    """A comm.json whose payload per step over dense's is ``bf16`` and ``powersgd`` at 2
    ranks, and whose Star root sends + receives ``root`` gradient buffers at 2, 3, 4 ranks
    (every other number made up)."""
    dense = 1 << 20
    payload = {"dense": 1.0, "bf16": bf16, "fp16": 0.5, "powersgd": powersgd, "topk": 0.04,
               "star": 2.0}  # fmt: skip
    ratio = {"wall": [1.0] * 10, "cpu": [1.0] * 10}
    worlds = {}
    for world, names in ((2, payload), (3, ("dense", "star")), (4, payload)):
        one = {"payload": 0, "dense": dense, "sent": dense, "received": dense, "constant": True}
        worlds[str(world)] = {
            "errors": {},
            "bytes": {n: [dict(one, payload=payload[n] * dense)] * world for n in names},
            "paired": {f"{n}.step / dense.step": ratio for n in names if n != "dense"},
        }
    computed = [
        {"world": w, "comm": n, "gbit": g, "compute_s": 0.1, "step_s": 0.11, "vs_dense": 1.0}
        for w in (2, 4) for n in payload if n != "fp16" for g in (10, 100)
    ]  # fmt: skip
    star = [
        {"world": w, "root_sent": t - 1, "root_received": 1.0, "other_sent": 1.0,
         "other_received": 1.0, "ring_sent": 1.0, "ring_received": 1.0, "server": w - 1}
        for w, t in zip((2, 3, 4), root)
    ]  # fmt: skip
    return {
        "comm": {
            "worlds": worlds,
            "computed": computed,
            "star": star,
            "example_steps": 300,
            "example_start_step": 10,
        }
    }


def test_the_bytes_row_judges_bf16_at_half_and_powersgd_at_15x_less() -> None:
    what = row("bytes per step on the example GPT")
    cell, verdict_cell = summary.measured(what, comm_results())
    assert verdict_cell == "BF16: met; PowerSGD: met"
    # 20x less per compressed step; the example's 300 steps, dense for 10: 300 / (10 + 290/20)
    assert "PowerSGD 20.0x less" in cell and "dense for the first 10: 12.2x less" in cell, cell
    assert summary.measured(what, comm_results(bf16=0.51))[1] == "BF16: missed; PowerSGD: met"
    assert summary.measured(what, comm_results(powersgd=1 / 14.9))[1] == (
        "BF16: met; PowerSGD: missed"
    )
    failed = comm_results()
    failed["comm"]["worlds"]["2"]["errors"]["powersgd"] = "CommError: ..."
    assert "failed at 2 ranks" in summary.measured(what, failed)[0]


def test_the_star_row_is_met_only_where_the_roots_bytes_grow_with_every_rank() -> None:
    what = row("`Star(root=0)` vs the ring")
    cell, verdict_cell = summary.measured(what, comm_results())
    assert verdict_cell == "met (2.50 < 4.00 < 4.25)"
    assert "the root sends 1.50 / 3.00 / 3.25" in cell and "each way" in cell, cell
    flat = comm_results(root=(2.5, 4.0, 4.0))
    assert summary.measured(what, flat)[1] == "missed (2.50 < 4.00 < 4.00)"


def convergence_results(losses: dict[str, list[float]]) -> dict:
    """A convergence.json of these final validation losses, by comm and seed."""
    seeds = [str(s) for s in range(len(losses["dense"]))]
    runs = {
        name: {s: {"val_loss": v, "curve": [[10, 5.0]]} for s, v in zip(seeds, vals)}
        for name, vals in losses.items()
    }
    compare = bench_convergence.compare(runs)
    return {"convergence": {"runs": runs, "seeds": seeds, "compare": compare, "total_s": 900}}


def test_the_convergence_row_judges_every_seed_against_its_dense_twin() -> None:
    what = row("final validation loss of the example")
    dense = [2.0, 2.1, 2.2]
    losses = {
        "dense": dense,
        "bf16": [d * 1.004 for d in dense],  # within 0.5% on every seed
        "powersgd": [dense[0] * 1.01, dense[1] * 1.03, dense[2] * 0.99],  # one seed over 2%
        "topk": [d * 1.02 for d in dense],
        "topk_noef": [d * 1.05 for d in dense],
    }
    cell, verdict_cell = summary.measured(what, convergence_results(losses))
    # no rank-8 or longer-start runs: their row says so, and what to run
    untargeted = row("the same runs for PowerSGD at higher ranks")
    assert summary.measured(untargeted, convergence_results(losses))[0] == (
        "no runs without targets in `convergence.json`; rerun bench_convergence.py"
    )
    assert verdict_cell == (
        "BF16: met (3 of 3 <= 0.5); PowerSGD: unclear (2 of 3 <= 2); TopK: met (3 of 3 <= 3); "
        "TopK below no error feedback: met (3 of 3 <= 0)"
    )
    assert "BF16 +0.40% (+0.40 to +0.40)" in cell and "spread 9.52%" in cell, cell
    # error feedback that does not help is seen
    losses["topk_noef"] = [d * 1.01 for d in dense]
    assert summary.measured(what, convergence_results(losses))[1].endswith(
        "TopK below no error feedback: missed (0 of 3 <= 0)"
    )
    failed = convergence_results(losses)
    failed["convergence"]["runs"]["topk_noef"]["1"] = {"error": "usage: ...", "wall_s": 3.0}
    assert summary.measured(what, failed)[0] == (
        "runs failed: topk_noef seed 1 (errors in `convergence.json`)"
    )


def test_the_convergence_control_row_reports_sgd_beside_adamw_without_a_verdict() -> None:
    what, control = row("final validation loss of the example"), row("the control: the same")
    dense = [2.0, 2.1, 2.2]
    losses = {"dense": dense, "bf16": dense, "powersgd": [d * 1.06 for d in dense],
              "powersgd8": [d * 1.02 for d in dense], "powersgd16": [d * 1.01 for d in dense],
              "topk": dense, "topk_noef": dense}  # fmt: skip
    r = convergence_results(losses)
    assert "PowerSGD +6.00% (+6.00 to +6.00); TopK" in summary.measured(what, r)[0]
    # the comms without targets have a row of their own, without a verdict
    untargeted = row("the same runs for PowerSGD at higher ranks")
    assert summary.measured(untargeted, r) == (
        "vs dense, the mean over seeds (range): PowerSGD(rank=8) +2.00% (+2.00 to +2.00); "
        "PowerSGD(rank=16) +1.00% (+1.00 to +1.00)",
        "-",
    )
    assert summary.measured(what, r)[0].endswith("3 seeds x 7 comms, 15 min in all")
    # TopK dense for 30 steps, with and without error feedback: the seeds where it helps
    with_start = {**losses, "topk30": [2.1, 2.1, 2.2], "topk_noef30": [2.2, 2.2, 2.2]}
    assert summary.measured(untargeted, convergence_results(with_start))[0].endswith(
        "; TopK(0.01, start_step=30) +1.67% (+0.00 to +5.00); without error feedback +4.92% "
        "(+0.00 to +10.00); error feedback below none on 2 of 3 seeds (-3.03% (-4.55 to +0.00))"
    )
    cell, verdict_cell = summary.measured(control, r)
    assert cell.startswith("no control runs in `convergence.json` (run with --control '')")
    sgd = {"dense": [2.4, 2.5, 2.6], "powersgd": [2.424, 2.525, 2.626],
           "topk": [2.64, 2.75, 2.86], "topk_noef": [2.52, 2.625, 2.73]}  # fmt: skip
    seeds = ("0", "1", "2")
    runs = {n: {s: {"val_loss": v} for s, v in zip(seeds, vals)} for n, vals in sgd.items()}
    r["convergence"]["control"] = {"runs": runs, "compare": bench_convergence.compare(runs)}
    cell, verdict_cell = summary.measured(control, r)
    # the time in the main row covers the control's runs too: it says so
    assert summary.measured(what, r)[0].endswith(
        "3 seeds x 7 comms (and x 4 for the control below), 15 min in all"
    )
    assert verdict_cell == "-"
    assert cell == (
        "vs dense under SGD, the mean over seeds (range): PowerSGD(rank=4) +1.00% (+1.00 to "
        "+1.00); TopK +10.00% (+10.00 to +10.00); without error feedback +5.00% (+5.00 to "
        "+5.00); dense 2.4000 to 2.6000, against AdamW's 2.0000 to 2.2000"
    ), cell


def test_convergence_compares_each_seed_with_the_dense_run_of_that_seed() -> None:
    runs = {
        "dense": {"0": {"val_loss": 2.0}, "1": {"val_loss": 4.0}},
        "topk": {"0": {"val_loss": 2.02}, "1": {"val_loss": 4.0}},
        "topk_noef": {"0": {"val_loss": 2.04}, "1": {"error": "..."}},
    }
    c = bench_convergence.compare(runs)
    assert c["vs_dense"] == {"topk": {"0": 1.0, "1": 0.0}, "topk_noef": {"0": 2.0}}
    assert c["ef_vs_noef"] == {"0": pytest.approx(100 * (2.02 - 2.04) / 2.04)}
    assert c["ef_vs_noef30"] == {}  # no runs with a dense start
    assert c["dense_spread"] == pytest.approx(100 * 2.0 / 3.0)


# -- freshness by content, on a scratch tree (no git: as in a tarball) --------------------------------


def write(tree: Path, path: str, text: str) -> None:
    (tree / path).parent.mkdir(parents=True, exist_ok=True)
    (tree / path).write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A file for every path of MEASURES (a directory gets x.py; a glob, what it matches)."""
    tree = tmp_path / "tree"
    for specs in freshness.MEASURES.values():
        for spec in specs:
            spec = spec.removeprefix("!")
            path = spec.replace("*", "") + ".py" if "*" in spec else spec
            write(tree, path if path.endswith(".py") else f"{path}/x.py", "v1\n")
    write(tree, "docs/notes.md", "v1\n")
    return tree


def measured_in(tree: Path) -> dict:
    """Results of every benchmark, measured on ``tree`` as it is now."""
    names = (*summary.FILES, *summary.SLOW)
    return {name: {"measured": freshness.hashes(name, tree)} for name in names}


def stale_names(problems: list[str]) -> set[str]:
    return {p.split(".json:")[0] for p in problems if ".json:" in p}


def test_fresh_results_pass(tree: Path) -> None:
    assert freshness.stale(measured_in(tree), tree) == []


def test_a_change_to_measured_code_makes_exactly_its_results_stale(tree: Path) -> None:
    results = measured_in(tree)
    write(tree, "docs/notes.md", "v2\n")  # measured by nothing
    assert freshness.stale(results, tree) == []
    write(tree, "torchshard/checkpoint/x.py", "v2\n")
    problems = freshness.stale(results, tree)
    assert stale_names(problems) == {"checkpoint", "scale"}, problems
    assert all("torchshard/checkpoint/x.py (changed)" in p for p in problems), problems
    assert all(p.endswith(f"run {RUN_ALL}") for p in problems)
    write(tree, "benchmarks/bench_flat.py", "v2\n")  # the benchmark's own script
    assert stale_names(freshness.stale(results, tree)) == {"flat", "checkpoint", "scale"}
    write(tree, "torchshard/checkpoint/x.py", "v1\n")  # changed back: fresh again
    assert stale_names(freshness.stale(results, tree)) == {"flat"}


def test_the_fully_sharded_mode_is_measured_only_where_it_runs(tree: Path) -> None:
    results = measured_in(tree)
    assert "torchshard/_parallel/full.py" not in results["trainer"]["measured"]
    write(tree, "torchshard/_parallel/full.py", "v2\n")
    full_mode = {"sharded", "full", "hsdp", "lora", "mixed", "tp"}
    assert stale_names(freshness.stale(results, tree)) == full_mode
    write(tree, "torchshard/_parallel/x.py", "v2\n")  # the trainer core: every mode
    problems = freshness.stale(results, tree)
    want = {"trainer", "sharded", "full", "hsdp", "comm", "checkpoint", "lora", "mixed", "tp"}
    want.add("pipeline")  # replicated and shard=True stages
    assert stale_names(problems) == want, problems  # not the convergence runs: see below


def test_the_convergence_runs_hold_the_comms_path_not_the_whole_trainer(tree: Path) -> None:
    results = measured_in(tree)
    write(tree, "torchshard/_parallel/trainer.py", "v2\n")  # held bitwise by the tests
    assert "convergence" not in stale_names(freshness.stale(results, tree))
    write(tree, "torchshard/_parallel/powersgd.py", "v2\n")  # what it certifies
    assert "convergence" in stale_names(freshness.stale(results, tree))


def test_a_module_that_becomes_a_package_is_still_measured(tree: Path) -> None:
    results = measured_in(tree)
    (tree / "torchshard/_parallel/full.py").unlink()
    write(tree, "torchshard/_parallel/full/__init__.py", "v1\n")
    write(tree, "torchshard/_parallel/full/storage.py", "v1\n")
    problems = freshness.stale(results, tree)
    assert stale_names(problems) == {"sharded", "full", "hsdp", "lora", "mixed", "tp"}, problems
    sharded = next(p for p in problems if p.startswith("sharded.json"))
    assert "torchshard/_parallel/full.py (gone)" in sharded
    assert "torchshard/_parallel/full/storage.py (new)" in sharded
    assert freshness.stale(measured_in(tree), tree) == []  # measured again: fresh


def test_only_python_files_of_a_directory_are_measured(tree: Path) -> None:
    results = measured_in(tree)
    write(tree, "torchshard/_flat/notes.txt", "v1\n")
    write(tree, "torchshard/_flat/__pycache__/x.cpython-310.pyc", "bytes")
    assert freshness.stale(results, tree) == []


def test_results_without_hashes_or_missing_are_stale(tree: Path) -> None:
    results = measured_in(tree)
    del results["flat"]
    results["scale"] = {"machine": {"git_commit": "a" * 40}}  # written before the hashes
    problems = freshness.stale(results, tree)
    assert stale_names(problems) == {"flat", "scale"}, problems
    assert f"flat.json: missing; run {RUN_ALL}" in problems
    assert any("scale.json: records no hashes" in p for p in problems)


def test_a_slow_result_names_its_own_command(tree: Path) -> None:
    """convergence.json is not run_all.py's: a stale or missing one says what regenerates it."""
    results = measured_in(tree)
    write(tree, "benchmarks/bench_convergence.py", "v2\n")
    (problem,) = freshness.stale(results, tree)
    assert problem.startswith("convergence.json: the code it measures changed since: ")
    assert problem.endswith("run python benchmarks/bench_convergence.py"), problem
    del results["convergence"]
    assert freshness.stale(results, tree) == [
        "convergence.json: missing; run python benchmarks/bench_convergence.py"
    ]


def test_no_git_is_needed(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = measured_in(tree)
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH; the tree is no repository
    assert freshness.stale(results, tree) == []
    write(tree, "examples/gpt.py", "v2\n")  # every benchmark of the example's GPT
    not_gpt = {"scale", "lora", "mixed", "tp", "pipeline"}
    every = {*summary.FILES, *summary.SLOW}
    assert stale_names(freshness.stale(results, tree)) == every - not_gpt


CODE_V1 = '''"""The module."""


def step(x, lr=0.1):
    """One step."""
    return x - lr * "abc".count("a")  # a comment
'''


def test_docstrings_comments_and_layout_leave_results_fresh_and_code_does_not(
    tree: Path,
) -> None:
    path = "torchshard/checkpoint/x.py"
    write(tree, path, CODE_V1)
    results = measured_in(tree)
    assert results["checkpoint"]["measured"][path].startswith(freshness.CODE)
    prose = CODE_V1.replace("The module.", "The module, said better.").replace(
        "# a comment", "# another comment\n\n"
    )
    write(tree, path, prose.replace("x, lr=0.1", "x,  lr = 0.1"))
    assert freshness.stale(results, tree) == []
    # a default value, a string literal, an operator
    for old, code in [("lr=0.1", "lr=0.2"), ('"abc"', '"abd"'), ("x - lr", "x + lr")]:
        write(tree, path, CODE_V1.replace(old, code))
        assert stale_names(freshness.stale(results, tree)) == {"checkpoint", "scale"}, code
    write(tree, path, "def broken(:\n")  # does not parse: hashed by its bytes
    results = measured_in(tree)
    assert not results["checkpoint"]["measured"][path].startswith(freshness.CODE)
    write(tree, path, "def broken(:  # still\n")
    assert stale_names(freshness.stale(results, tree)) == {"checkpoint", "scale"}


def test_a_result_with_byte_hashes_is_checked_by_bytes_until_rehashed(tree: Path) -> None:
    """Results written before code hashes recorded the SHA-256 of each file's bytes: they stay
    checkable as they are, and ``--rehash`` turns those fresh by them into code hashes."""
    path = "benchmarks/bench_flat.py"
    write(tree, path, CODE_V1)
    old = {f: freshness.sha256(tree / f) for f in freshness.files(freshness.MEASURES["flat"], tree)}
    assert freshness.stale({**measured_in(tree), "flat": {"measured": old}}, tree) == []
    write(tree, path, CODE_V1.replace("# a comment", "# edited"))  # bytes changed, code did not
    results = {**measured_in(tree), "flat": {"measured": dict(old)}}
    assert stale_names(freshness.stale(results, tree)) == {"flat"}
    assert not freshness.rehash(results["flat"], "flat", tree)  # not fresh by its bytes: kept
    assert results["flat"]["measured"] == old
    write(tree, path, CODE_V1)  # the bytes it measured
    assert freshness.rehash(results["flat"], "flat", tree)
    assert results["flat"]["measured"] == freshness.hashes("flat", tree)
    write(tree, path, CODE_V1.replace("# a comment", "# edited"))
    assert freshness.stale(results, tree) == []  # now by code
    assert not freshness.rehash(results["flat"], "flat", tree)  # already code hashes


def test_rehash_cli_rewrites_only_the_measured_hashes(tmp_path: Path) -> None:
    """On this tree: byte hashes of every result, rewritten by ``--rehash`` into exactly what a
    fresh measurement would record, the rest of each file byte for byte as written."""
    for name in (*summary.FILES, *summary.SLOW):
        hashed = {f: freshness.sha256(REPO / f) for f in freshness.files(summary.MEASURES[name])}
        data = {"machine": {"python": "3.11.7"}, "measured": hashed, "value": 0.1}
        (tmp_path / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    cmd = [sys.executable, str(SCRIPT), "--rehash", "--results", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    for name in (*summary.FILES, *summary.SLOW):
        assert f"rehashed {tmp_path / name}.json" in proc.stderr, proc.stderr
        text = (tmp_path / f"{name}.json").read_text()
        want = {"machine": {"python": "3.11.7"}, "measured": freshness.hashes(name), "value": 0.1}
        assert text == json.dumps(want, indent=2) + "\n"
    stale = [sys.executable, str(SCRIPT), "--stale", "--results", str(tmp_path)]
    assert subprocess.run(stale, capture_output=True, text=True).returncode == 0


def test_a_code_hash_from_another_python_says_so(tree: Path) -> None:
    results = measured_in(tree)
    results["flat"]["machine"] = {"python": "2.7.18"}
    write(tree, "benchmarks/bench_flat.py", "v2\n")
    (problem,) = [p for p in freshness.stale(results, tree) if p.startswith("flat.json")]
    assert "the result was measured on 2.7" in problem, problem
    results["flat"]["machine"] = {"python": ".".join(map(str, sys.version_info[:3]))}
    (problem,) = [p for p in freshness.stale(results, tree) if p.startswith("flat.json")]
    assert "measured on" not in problem, problem
    # Only byte hashes changed: no ast is involved, so the Python it ran on is no clue.
    byte_hashes = {p: freshness.sha256(tree / p) for p in freshness.hashes("flat", tree)}
    results["flat"] = {"machine": {"python": "2.7.18"}, "measured": byte_hashes}
    write(tree, "benchmarks/bench_flat.py", "v3\n")
    (problem,) = [p for p in freshness.stale(results, tree) if p.startswith("flat.json")]
    assert "bench_flat.py (changed)" in problem and "measured on" not in problem, problem


def test_stale_cli_exits_1_naming_each_result_and_0_when_fresh(tmp_path: Path) -> None:
    for name in (*summary.FILES, *summary.SLOW, summary.RUN):
        (tmp_path / f"{name}.json").write_text(json.dumps({"machine": {"git_commit": None}}))
    cmd = [sys.executable, str(SCRIPT), "--stale", "--results", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    every = (*summary.FILES, *summary.SLOW)
    assert all(f"{name}.json: records no hashes" in proc.stderr for name in every)
    for name, data in measured_in(REPO).items():  # measured on this very tree
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_the_machine_line_names_the_kernels_and_how_many_results_do_not() -> None:
    """A VM's CPU "model name" may hide whether torch ran its AVX2 or AVX-512 kernels, which
    move float results (a lossy comm's loss): each result records what torch dispatched to."""
    m = {"cpu_count": 2, "torch": "2.13.0+cpu", "cpu": "AMD EPYC", "git_commit": "abc"}
    one = {"flat": {"machine": {**m, "cpu_capability": "AVX512"}}}
    assert "2 CPUs (AMD EPYC, AVX512 kernels)" in machine_line(one)
    mixed = {
        **one,
        "trainer": {"machine": {**m, "cpu_capability": "AVX2"}},
        "comm": {"machine": m},  # measured before the field existed
    }
    assert "2 CPUs (AMD EPYC, AVX2 / AVX512 kernels; 1 of 3 unsaid)" in machine_line(mixed)
    assert "2 CPUs (AMD EPYC)" in machine_line({"comm": {"machine": m}})


def test_the_blocking_save_row_shows_which_writer_moved() -> None:
    """A ratio to save_file flips its verdict when the page cache's cost moves between runs:
    the row gives each writer's own medians, so that a reader sees which side moved."""
    blocking = {
        "median_s": {"torchshard": 0.9, "safetensors": 1.5, "dd_fsync": 1.75},
        "cpu_s": {"torchshard": [0.3, 0.2, 0.4], "safetensors": [1.0], "dd_fsync": [1.2, 1.25]},
    }
    ratios = {"wall": [0.6, 0.5, 0.7], "cpu": [0.3, 0.2, 0.25]}
    r = {
        "checkpoint": {
            "blocking": blocking,
            "paired": {"blocking: torchshard / safetensors": ratios},
        }
    }
    cell, verdicts = summary.measured(row("blocking save vs"), r)
    assert cell.endswith(
        "; medians torchshard 0.90 s / 0.30 CPU-s, save_file 1.50 s / 1.00 CPU-s, "
        "dd conv=fsync 1.75 s / 1.23 CPU-s"
    ), cell
    assert verdicts == "wall met (3 of 3 <= 1.1); CPU met (3 of 3 <= 1.2)"
