"""`make bench`: run the benchmarks through pytest-benchmark, then refresh RESULTS.md and the plots.

What it does
    1. pytest (in this process) over bench/bench_lm_head.py, bench_runner.py,
       bench_pipeline.py, bench_cpu_ops.py, bench_serve.py, bench_ray.py, bench_storage.py,
       bench_host_path.py and bench_accept.py (after storage, whose recommended k it reads), and
       bench_masks.py (what the chat mask rule changes on the demo data), bench_engine_check.py
       (the engine check's cost on the demo's extraction), bench_regenerate.py (regenerate against a
       bare vLLM generate), bench_engine_accept.py (drafts served by vLLM, judged by `accept`) and
       bench_draft_types.py (EAGLE-3 and DFlash drafts from one capture, each by its own trainer,
       judged by `accept --method`; one capture's time against two).
       Each module's test is `_harness.pytest_case` (one per head case in bench_lm_head.py):
       pytest-benchmark collects and tabulates them and drives the head's and the runner's
       interleaved rounds; the ratios come from `_harness.SideBySide` (its docstring says why).
       Each module writes its own results JSON into bench/results/ (or --out) as it finishes.
    2. bench/report.py turns every JSON there into bench/RESULTS.md, its subject pages and the plots.
    3. Prints every PASS/FAIL line from the fresh JSONs and the wall time.

Design
    Bench files are named bench_*.py and collected only here (`-o python_files=bench_*.py`);
    `make test` never sees them (pyproject's testpaths is ["tests"]). Started as a script, this
    file puts bench/ (not the repository root) first on sys.path, so the repository's top-level
    `kernels/` directory can never shadow Hugging Face's `kernels` package inside transformers.
    A missed target does not fail the run (the page records it); a benchmark that errors does.

Limits
    `--only` picks modules. How long each takes is `SECONDS` below, the wall time its recorded
    results file holds; their sum, about 75 minutes on 2 cores (21 of them `accept`, 12
    `engine_accept`, 20 `draft_types`), is the
    figure README.md, bench/README.md and the Makefile quote. No whole `make bench` was timed
    with every module in it; the sum leaves out pytest's start-up and the report (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = {"lm_head": "bench_lm_head.py", "runner": "bench_runner.py", "pipeline": "bench_pipeline.py",
           "cpu_ops": "bench_cpu_ops.py", "serve": "bench_serve.py", "ray": "bench_ray.py",
           "storage": "bench_storage.py", "host_path": "bench_host_path.py", "accept": "bench_accept.py",
           "masks": "bench_masks.py", "engine_check": "bench_engine_check.py", "regenerate": "bench_regenerate.py",
           "engine_accept": "bench_engine_accept.py", "draft_types": "bench_draft_types.py"}
# Seconds each module took: `wall_s` of its results file in bench/results/ (a 2-core Xeon with AMX;
# the trained tiny target of storage and accept already cached; draft_types: the AMD EPYC with
# AVX512-BF16, bench/results/amd-epyc-avx512bf16/). host_path's file records none: its figure is
# bench/README.md's "about 2 minutes".
SECONDS = {"lm_head": 109, "runner": 70, "pipeline": 190, "cpu_ops": 36, "serve": 267, "ray": 128,
           "storage": 10, "host_path": 120, "accept": 1277, "masks": 14, "engine_check": 331, "regenerate": 32,
           "engine_accept": 735, "draft_types": 1181}


def estimate_minutes(names=MODULES) -> int:
    """The expected wall time of these modules, in whole minutes (the docs' figure for all)."""
    return round(sum(SECONDS[n] for n in names) / 60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(MODULES), help="comma list of: " + ", ".join(
        f"{n} (~{SECONDS[n] / 60:.1f} min)" for n in MODULES) + f"; all: ~{estimate_minutes()} min")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    bad = [n for n in names if n not in MODULES]
    if bad:
        ap.error(f"unknown module(s) {bad}; pick from {list(MODULES)}")
    os.environ["EAGLE_FAST_BENCH_OUT"] = str(a.out.resolve())
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(k, v)

    import pytest

    print(f"==== {', '.join(names)}: about {estimate_minutes(names)} min on 2 cores (bench/run.py SECONDS) ====")
    t0 = time.perf_counter()
    started = time.time()
    args = ["-q", "-p", "no:cacheprovider", "--benchmark-disable-gc", "-o", "python_files=bench_*.py",
            "--rootdir", str(HERE.parent), "--benchmark-columns=min,median,max,rounds",
            *[str(HERE / MODULES[n]) for n in names], *a.pytest_args]
    rc = pytest.main(args)

    import report

    report.build(a.out, report.PAGE if a.out.resolve() == (HERE / "results").resolve() else a.out / "RESULTS.md")
    print("\n==== targets (from this run's results) ====")
    for p in sorted(a.out.glob("*.json")):
        if p.stat().st_mtime < started:
            continue
        d = json.loads(p.read_text())
        for t in d.get("targets", []):
            print(f"{t['result']:4s}  {t['target']}: {t['detail']}")
    print(f"==== make bench wall time: {time.perf_counter() - t0:.0f} s; pytest exit {int(rc)} ====")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
