"""The ``torchshard`` command line: layout and memory estimate of a model; inspect,
consolidate and reshard checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from ._errors import ArgumentError, CheckpointError, TorchShardError
from ._estimate import command as estimate
from ._estimate.model import build_factory
from ._flat.layout import FlatLayout
from .checkpoint._inspect import inspect_checkpoint, latest_under, newest_verified
from .checkpoint._tools import Progress, consolidate, reshard


def _cmd_layout(args: argparse.Namespace) -> int:
    layout = FlatLayout.from_module(build_factory(args.factory), align_bytes=args.align_bytes)
    if args.json:
        print(layout.to_json())
        return 0
    width = max(len(s.name) for s in layout)
    for s in layout:
        tied = f"  (also {', '.join(s.aliases)})" if s.aliases else ""
        frozen = "  frozen" if not s.requires_grad else ""
        print(f"{s.name:<{width}}  {s.offset:>12}  {s.numel:>12}  {list(s.shape)}{frozen}{tied}")
    print(
        f"{len(layout)} parameters, {layout.param_numel:,} elements, buffer {layout.numel:,} "
        f"{layout.dtype} ({layout.nbytes / 2**20:,.1f} MiB), fingerprint {layout.fingerprint()}"
    )
    return 0


def _cmd_estimate(args: argparse.Namespace) -> int:
    print(estimate.run(args))
    return 0


class _StderrProgress(Progress):
    """A byte-count bar on stderr (tqdm's when importable), one line per file otherwise; quiet
    when stderr is not a terminal."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._bar: Any = None
        self._what, self._total, self._done = "", 0, 0

    def start(self, what: str, total_bytes: int) -> None:
        self._what, self._total, self._done = what, total_bytes, 0
        if not self._tty:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=total_bytes, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
            file=sys.stderr, leave=False,
        )  # fmt: skip

    def file(self, name: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=False)
        elif self._tty:
            pct = 100 * self._done // max(self._total, 1)
            sys.stderr.write(f"torchshard: {self._what}: {pct:3d}% {name}\n")
            sys.stderr.flush()

    def advance(self, nbytes: int) -> None:
        self._done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError


def _unit(r: Any) -> str:
    """What the flat buffer of an inspected checkpoint counts: bytes with parameters of
    several dtypes, else elements."""
    return "bytes" if len(r.dtypes) > 1 else "elements"


def _dtypes(d: str | dict[str, str]) -> str:
    """A flat state's dtype, or its dtype per parameter dtype (parameters of several)."""
    return d if isinstance(d, str) else ", ".join(f"{p}: {x}" for p, x in d.items())


def _value(v: Any) -> str:
    return json.dumps(v, separators=(",", ":")) if isinstance(v, (list, dict)) else str(v)


def _fallback_lines(root: str, good: Path | None, bad: list[tuple[Path, str]]) -> list[str]:
    """The report's lines on the checkpoints under ``root`` older than its bad latest one."""
    lines = [f"also bad     {path}: {why}" for path, why in bad]
    if good is None:
        lines.append(f"newest good  none: no complete checkpoint under {root} verifies")
    else:
        lines.append(f"newest good  {good}: the newest checkpoint under {root} that verifies")
    return lines


def _fallback_json(good: Path | None, bad: list[tuple[Path, str]]) -> dict[str, Any]:
    return {
        "newest_verified": None if good is None else str(good),
        "not_verified": [{"path": str(p), "problem": why} for p, why in bad],
    }


def _fallback_error(root: str, good: Path | None) -> str:
    if good is None:
        return f"; no complete checkpoint under {root} verifies"
    return f"; the newest checkpoint under {root} that verifies is {good}"


def _cmd_inspect(args: argparse.Namespace) -> int:
    progress = _StderrProgress()
    latest = latest_under(args.path)  # (step, path) when PATH is a root holding one
    try:
        report = inspect_checkpoint(args.path, progress=progress)
    except CheckpointError as e:
        if latest is None:
            raise
        # the latest checkpoint's metadata.json fails: say so, and which older one verifies
        step, path = latest
        good, bad = newest_verified(args.path, step, progress=progress)
        if args.json:
            out = {"path": str(path), "ok": False, "problems": [str(e)]}
            print(json.dumps({**out, **_fallback_json(good, bad)}, indent=1))
        else:
            print(f"checkpoint   {path}  (latest complete under {args.path})")
            print(f"BAD          {e}")
            print("\n".join(_fallback_lines(args.path, good, bad)))
        print(f"torchshard: error: {e}{_fallback_error(args.path, good)}", file=sys.stderr)
        return 1
    fallback = None
    if not report.ok and latest is not None:
        fallback = newest_verified(args.path, report.step, progress=progress)
    if args.json:
        out = report.to_dict()
        if fallback is not None:
            out.update(_fallback_json(*fallback))
        print(json.dumps(out, indent=1))
    else:
        r = report
        where = (
            f"  (latest of {len(r.steps_under_root)} complete under {args.path})"
            if r.steps_under_root
            else ""
        )
        print(f"checkpoint   {r.path}{where}")
        print(f"step         {r.step}")
        print(f"world size   {r.world_size} (at save)")
        print(f"format       {r.format_version}")
        print(
            "metadata     sha256 verified, every value checked"
            if r.protected
            else "metadata     UNPROTECTED: no checksum (format 1); every value checked"
        )
        print(
            f"parameters   {r.parameters:,} ({r.param_numel:,} elements, {', '.join(r.dtypes)}, "
            f"{_size(r.param_bytes)}); flat buffer {r.numel:,} {_unit(r)}"
        )
        for alias, name in r.tied.items():
            print(f"  tied       {alias} -> {name}")
        print(f"buffers      {len(r.buffers)}" + (f": {', '.join(r.buffers)}" if r.buffers else ""))
        opt = r.optimizer
        if opt is None:
            print("optimizer    none")
        else:
            state = [f"{k} ({_dtypes(d)})" for k, d in opt["flat_state"].items()]
            state += [f"{k} (scalar, {d})" for k, d in opt["scalar_state"].items()]
            print(f"optimizer    {opt['class']}")
            print(f"  state      {', '.join(state) or 'none yet'}")
            print(f"  stateful   {opt['stateful']} of {r.parameters} parameters")
            for g, group in enumerate(opt["param_groups"]):
                hyper = ", ".join(f"{k}={_value(v)}" for k, v in group.items() if k != "params")
                print(f"  group {g:<4} {group['params']} parameters: {hyper}")
        if r.comm is not None:  # a lossy comm's state (format 5)
            c = r.comm
            flat = [f"{k} ({v['dtype']}, {v['numel']:,})" for k, v in c["flat"].items()]
            flat += [f"{k}={v}" for k, v in c["scalars"].items()]
            print(f"comm         {c['comm']}: {', '.join(flat)}")
        print(f"extra        {json.dumps(r.extra)}")
        print("files")
        width = max((len(f.name) for f in r.files), default=0)
        for f in r.files:
            status = "OK" if f.ok else "BAD"
            print(f"  {f.name:<{width}}  {f.size:>14,} bytes  {f.chunks:>5} chunks  {status}")
        for w in r.warnings:
            print(f"warning: {w}")
        if r.ok:
            print(f"OK: {len(r.files)} files, {r.total_bytes:,} bytes, every checksum verified")
        else:
            print(f"{len(r.problems)} problem(s):")
            for p in r.problems:
                print(f"  {p}")
        if fallback is not None:
            print("\n".join(_fallback_lines(args.path, *fallback)))
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        then = "" if fallback is None else _fallback_error(args.path, fallback[0])
        print(f"torchshard: error: {report.problems[0]}{more}{then}", file=sys.stderr)
        return 1
    return 0


def _cmd_consolidate(args: argparse.Namespace) -> int:
    done = consolidate(args.path, args.out, aliases=args.with_aliases, progress=_StderrProgress())
    print(f"wrote {done.path}: step {done.step}, {done.tensors} tensors, {done.nbytes:,} bytes")
    if done.path.is_dir():
        print(f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(done.path)!r})")
    elif done.tied:
        tied = ", ".join(f"{a} (= {n})" for a, n in done.tied.items())
        print(
            f"tied parameters stored once, without {tied}: load with "
            "model.load_state_dict(sd, strict=False), or consolidate with --with-aliases"
        )
    return 0


def _cmd_reshard(args: argparse.Namespace) -> int:
    path = reshard(args.path, args.out, args.world_size, progress=_StderrProgress())
    print(f"wrote {path}: world size {args.world_size}")
    return 0


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """Reports bad command lines as one line (raised, so ``main`` returns 2) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchshard`` console script; returns the exit status.

    0: success; 1: a corrupt, missing or incompatible checkpoint (or an I/O
    error); 2: bad arguments. Errors are one line on stderr.
    """
    parser = _Parser(prog="torchshard", description=__doc__)
    parser.add_argument("--version", action="version", version=f"torchshard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layout", help="print the flat layout of a model built on meta")
    p.add_argument("factory", help="'module:callable' returning an nn.Module (built on meta)")
    p.add_argument("--align-bytes", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print the layout JSON")
    p.set_defaults(run=_cmd_layout, error_status=2)
    p = estimate.add_parser(sub)
    p.set_defaults(run=_cmd_estimate, error_status=2)
    ckpt_help = "a checkpoint directory, or a root (then its latest complete checkpoint)"
    p = sub.add_parser(
        "inspect",
        help="describe a checkpoint and verify every file and checksum",
        description="Print what a checkpoint holds and verify metadata.json's checksum and "
        "values, every file's size and every chunk's checksum, and the index transformers reads "
        "against metadata.json. For a root whose latest checkpoint fails, the report also names "
        "the newest checkpoint under it that verifies (older ones are verified in turn, newest "
        "first). Exit status: 0 when all is well (a format-1 checkpoint, which has no metadata "
        "checksum, gets a warning); 1 when the checkpoint (of a root, its latest, even if an "
        "older one verifies) is damaged, incomplete or unreadable, or the root holds no "
        "complete checkpoint; 2 when the command line is wrong, or PATH does not exist or is "
        "not a directory; 130 when interrupted.",
    )
    p.add_argument("path", metavar="PATH", help=ckpt_help)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_cmd_inspect, error_status=1)
    p = sub.add_parser(
        "consolidate",
        help="export the weights: one safetensors file, or a transformers model directory",
        description="OUT.safetensors: write the model's weights and buffers as one safetensors "
        "file with its state-dict names; a tied parameter is stored once, under its first name "
        "(as transformers does): load with load_state_dict(sd, strict=False). Any other OUT: a "
        "new directory with config.json and model.safetensors that transformers' "
        "AutoModelForCausalLM.from_pretrained(OUT) loads (the checkpoint must have been saved "
        "from a transformers model, which stores its config).",
    )
    p.add_argument("path", metavar="PATH", help=ckpt_help)
    p.add_argument("out", metavar="OUT", help="the output .safetensors file, or a new directory")
    p.add_argument(
        "--with-aliases",
        action="store_true",
        help="also write a copy of each tied parameter under its other names (strict loading)",
    )
    p.set_defaults(run=_cmd_consolidate, error_status=1)
    p = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint as if saved at another world size",
        description="Rewrite a checkpoint as OUT/step-N for world size N, streaming (memory "
        "about one block); committed like a save (metadata.json last, then a rename).",
    )
    p.add_argument("path", metavar="PATH", help=ckpt_help)
    p.add_argument("out", metavar="OUT", help="the output checkpoint root")
    p.add_argument("--world-size", type=int, required=True, metavar="N", help="the new world size")
    p.set_defaults(run=_cmd_reshard, error_status=1)
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        print(f"torchshard: error: {e}", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except ArgumentError as e:
        print(f"torchshard: error: {e}", file=sys.stderr)
        return 2
    except TorchShardError as e:
        print(f"torchshard: error: {e}", file=sys.stderr)
        return args.error_status
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"torchshard: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("torchshard: error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
