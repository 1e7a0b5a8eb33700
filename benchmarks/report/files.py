"""Writing a file so that a reader, or an interrupted run, never sees a part of it: the one
writer of results (``_common.write_json``) and of the tables (``summary.py --write``).
Stdlib only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename: a reader (or an interrupted run) sees the
    old file or the new one, never a part. The temporary is named by process, so two writers
    do not share one, and is removed on any error; the file keeps its permissions.
    Example: ``write_atomically(Path("README.md"), text)``.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # the same directory: one rename
    try:
        tmp.write_text(text)
        if path.exists():
            shutil.copymode(path, tmp)  # the file's own permissions, not a fresh file's
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
