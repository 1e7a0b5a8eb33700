"""Draw the loss curve that examples/train_gpt.py recorded, to a PNG.

train_gpt.py appends a JSON line per log step to <ckpt-dir>/metrics.jsonl (rank 0 only):
step, loss (the mean over the ranks and the steps since the last line), lr, tokens_per_s,
comm_wait_ms_per_step and elapsed_s (training seconds, earlier launches included).

    python examples/plot_metrics.py runs/train_gpt/metrics.jsonl        # -> runs/train_gpt/loss.png
    python examples/plot_metrics.py runs/train_gpt -o loss.png          # the directory works too

Needs matplotlib: pip install matplotlib (or pip install -e ".[plot]").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """The lines of ``path``, one per step, in step order; a line cut short (a crash while it
    was written) is left out, and a step written twice counts as its later line."""
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            rows[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            continue
    return [rows[step] for step in sorted(rows)]


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("path", type=Path, help="a metrics.jsonl, or the directory that holds one")
    p.add_argument(
        "-o", "--output", type=Path, help="the PNG to write (default: loss.png beside PATH's file)"
    )
    args = p.parse_args(argv)
    path = args.path / "metrics.jsonl" if args.path.is_dir() else args.path
    if not path.is_file():
        raise SystemExit(f"plot_metrics: {path}: no such file; pass train_gpt.py's metrics.jsonl")
    rows = read_metrics(path)
    if not rows:
        raise SystemExit(f"plot_metrics: {path}: no metrics lines; let the run log a step first")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(
            "plot_metrics: needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')"
        ) from e

    steps = [row["step"] for row in rows]
    losses = [row["loss"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, marker="." if len(rows) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(str(path), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    output = args.output or path.with_name("loss.png")
    fig.savefig(output, dpi=100)
    plt.close(fig)
    print(
        f"{output}: loss at {len(rows)} steps ({steps[0]} to {steps[-1]}), "
        f"{losses[0]:.4f} to {losses[-1]:.4f}"
    )
    return output


if __name__ == "__main__":
    main()
