"""Load a bench/ module in a test as its scripts see it: bench/ first on sys.path while it
imports (the benchmarks import their siblings, `shapes`, `_harness`, by plain name), then off
again, so no test module can be shadowed by a benchmark file afterwards."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str, as_name: str | None = None) -> ModuleType:
    """bench/<name>.py as a module named `as_name` (default eagle_fast_bench_<name>), registered
    in sys.modules (dataclasses and pickling look it up there)."""
    as_name = as_name or f"eagle_fast_bench_{name}"
    spec = importlib.util.spec_from_file_location(as_name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[as_name] = mod
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod
