"""Every recorded benchmark result names where it was measured: the ratios depend on the CPU's
ISA (AVX2 vs AVX512-BF16/AMX), so a result without it cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json"))


def test_there_are_results():
    assert RESULTS, "bench/results/ holds no results"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_names_its_device_and_isa(path):
    env = json.loads(path.read_text())["environment"]
    assert env.get("device_name") and env.get("date") and env.get("git_sha"), path.name
    if env["device"] == "cpu":
        isa = env.get("cpu_isa", "")
        assert isa.split(",")[0] in ("AMX", "AVX512-BF16", "AVX512", "AVX2", "other"), (path.name, isa)
