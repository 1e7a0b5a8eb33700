"""The ``torchshard`` command line. Later subcommands (inspect, consolidate, ...) go here."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import torch

from . import __version__
from ._errors import TorchShardError
from ._layout import FlatLayout


def _load_factory(spec: str) -> torch.nn.Module:
    """Build ``module:callable`` on the meta device (no weights are allocated)."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise TorchShardError(f"factory: expected 'module:callable', got {spec!r}")
    if "" not in sys.path:  # like `python -m`: modules in the working directory import
        sys.path.insert(0, "")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise TorchShardError(f"factory {spec!r}: {e}") from e
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:
        raise TorchShardError(f"factory {spec!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise TorchShardError(
            f"factory {spec!r}: expected an nn.Module, got {type(model).__name__}"
        )
    return model


def _cmd_layout(args: argparse.Namespace) -> int:
    layout = FlatLayout.from_module(_load_factory(args.factory), align_bytes=args.align_bytes)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchshard`` console script."""
    parser = argparse.ArgumentParser(prog="torchshard", description=__doc__)
    parser.add_argument("--version", action="version", version=f"torchshard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layout", help="print the flat layout of a model built on meta")
    p.add_argument("factory", help="'module:callable' returning an nn.Module (built on meta)")
    p.add_argument("--align-bytes", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print the layout JSON")
    p.set_defaults(run=_cmd_layout)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except TorchShardError as e:
        print(f"torchshard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
