"""Every recorded benchmark result names where it was measured: the ratios depend on the CPU's
ISA (AVX2 vs AVX512-BF16/AMX), so a result without it cannot be read. The duration of `make bench`
the docs quote is the one bench/run.py derives from the recorded runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _bench import load_bench

REPO = Path(__file__).resolve().parents[1]
RESULTS = sorted((REPO / "bench" / "results").glob("*.json"))


def test_there_are_results():
    assert RESULTS, "bench/results/ holds no results"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_names_its_device_and_isa(path):
    env = json.loads(path.read_text())["environment"]
    assert env.get("device_name") and env.get("date") and env.get("git_sha"), path.name
    if env["device"] == "cpu":
        isa = env.get("cpu_isa", "")
        assert isa.split(",")[0] in ("AMX", "AVX512-BF16", "AVX512", "AVX2", "other"), (path.name, isa)


def _run_py():
    return load_bench("run")


def test_make_bench_duration_is_one_figure_from_the_recorded_runs():
    """bench/run.py's per-module seconds follow the wall times the results files record (within
    2x: a rerun on a loaded machine moves them), and README.md, bench/README.md and the Makefile
    quote their sum, not figures of their own."""
    run = _run_py()
    assert set(run.SECONDS) == set(run.MODULES)
    for name in run.MODULES:
        path = REPO / "bench" / "results" / f"{name}-cpu.json"
        wall = json.loads(path.read_text()).get("wall_s") if path.exists() else None
        if wall:
            assert 0.5 <= run.SECONDS[name] / wall <= 2.0, (name, run.SECONDS[name], wall)
    total = run.estimate_minutes()
    for doc in ("README.md", "bench/README.md", "Makefile"):
        text = (REPO / doc).read_text()
        assert f"{total} minutes" in text or f"~{total} min" in text, (doc, total)
