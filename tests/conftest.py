from __future__ import annotations

import sys
from pathlib import Path

# The example's GPT model is the project's reference model for tests and benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

# Shared fixtures of the checkpoint tests (single_thread, saved).
pytest_plugins = ["checkpoint_harness"]
