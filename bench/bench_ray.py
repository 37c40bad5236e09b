"""Ray benchmark: `eagle-fast extract --ray` with 1 and 2 workers against the plain path (HF engine).

What it does
    On the tiny Qwen3 with the real 151,936 vocabulary (bench_runner.py builds and caches it)
    and a fixed jsonl of token-id samples (bench_pipeline.write_data), it runs the real CLI
    three ways, each in a fresh process: `plain` (one process), `ray-1` and `ray-2` (`--ray
    --ray-workers N`, each starting its own local Ray instance), at two `--batch-tokens`, and
    reports tokens / engine-loop seconds (the manifest's `runs` record: the loop starts once
    every runner is built, so Ray start-up and runner builds are out of it; they are reported
    apart, with each command's wall time). It checks that the three datasets are byte-identical
    (every shard file; the manifests but for `runs`) and prints the issue's targets:
      ray-2 / ray-1 throughput >= 1.6x (one 1-CPU worker leaves the second core idle)
      ray-1 loop time <= 1.1x the plain path's (both one engine on one torch thread)
Design
    Every mode starts cold in its own process (the first batches of a fresh worker pay the same
    warm-up as a fresh plain run), in rotated order, so machine noise hits them alike.
Limits
    One machine with 2 cores: two CPU workers share them (1 CPU each, 1 torch thread), so this
    measures scheduling overhead and core use, not a cluster's network or shared storage.
    Sizes are modest (override with EAGLE_FAST_BENCH_RAY_SAMPLES / _LEN / _BATCHES).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness as H

NAME = "ray"  # results: ray-cpu.json

SAMPLES = int(os.environ.get("EAGLE_FAST_BENCH_RAY_SAMPLES", "32"))
MEAN_LEN = int(os.environ.get("EAGLE_FAST_BENCH_RAY_LEN", "256"))
BATCHES = tuple(int(b) for b in os.environ.get("EAGLE_FAST_BENCH_RAY_BATCHES", "256,2048").split(","))
SHARD_SIZE = 4  # 8 shards: enough for two workers to pull an even share
# One torch thread per engine everywhere: the plain run through OMP_NUM_THREADS, each Ray worker
# through its 1-CPU share. So one engine leaves the second core idle, and the three runs share a
# thread count (bf16 CPU kernels may round differently with another one).
MODES = {"plain": [], "ray-1": ["--ray", "--ray-workers", "1", "--ray-cpus-per-worker", "1"],
         "ray-2": ["--ray", "--ray-workers", "2", "--ray-cpus-per-worker", "1"]}


def dataset_sha256(out: Path) -> str:
    """One hash of a dataset: its shard files' bytes and its manifest but for `runs`."""
    files = {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(out.rglob("*")) if p.is_file() and not p.name.startswith("manifest")}
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("runs")
    return hashlib.sha256(json.dumps({"files": files, "manifest": manifest}, sort_keys=True).encode()).hexdigest()


def _run_mode(mode: str, batch: int, model: Path, data: Path, work: Path, max_len: int) -> dict:
    out = work / f"ds-{mode}-{batch}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["extract", "--model", str(model), "--data", str(data), "--out", str(out), "--engine", "hf",
            "--supervision", "lse", "--max-len", str(max_len), "--batch-tokens", str(batch),
            "--shard-size", str(SHARD_SIZE), *MODES[mode]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    if mode == "plain":
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "eagle_fast", *argv], check=False, capture_output=True, text=True,
                         timeout=900, env=env)
    rec = {"mode": mode, "batch_tokens": batch, "command": "eagle-fast " + " ".join(argv),
           "process_wall_s": time.perf_counter() - t0}
    if res.returncode != 0:
        rec["status"] = f"error: rc={res.returncode}: {res.stderr[-1500:]}"
        return rec
    run = json.loads((out / "manifest.json").read_text())["runs"][-1]
    rec.update({"status": "ok", "tokens": run["tokens"], "loop_s": run["seconds"], "build_s": run["build_seconds"],
                "tokens_per_s": run["tokens"] / run["seconds"], "ray_workers": run.get("ray_workers"),
                "dataset_sha256": dataset_sha256(out)})
    shutil.rmtree(out, ignore_errors=True)
    return rec


def run(args) -> dict:
    import bench_pipeline
    import bench_runner  # the tiny checkpoint lives there (one definition, one cache)

    t_start = time.perf_counter()
    env = H.environment("cpu")
    model = bench_runner.tiny_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="eagle_fast-bench-ray-"))
    records = []
    try:
        data = work / "data.jsonl"
        tokens = bench_pipeline.write_data(data, bench_runner.VOCAB, samples=SAMPLES, mean_len=MEAN_LEN)
        max_len = MEAN_LEN * 3 // 2 + 8
        order = list(MODES)
        for i, batch in enumerate(BATCHES):
            for mode in order[i % 3:] + order[: i % 3]:  # rotated per batch size
                r = _run_mode(mode, batch, model, data, work, max_len)
                records.append(r)
                print(f"  {mode:6s} batch {batch:5d}: " + (f"{r['tokens_per_s']:7.0f} tok/s  loop {r['loop_s']:.1f} s"
                      f"  build {r['build_s']:.1f} s  wall {r['process_wall_s']:.1f} s" if r["status"] == "ok"
                      else r["status"][:300]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"benchmark": "ray", "environment": env,
           "setup": {"model": "tiny Qwen3 (random), V=151,936, H=256, 4 layers, bf16", "engine": "hf",
                     "samples": SAMPLES, "tokens": tokens, "shard_size": SHARD_SIZE, "supervision": "lse",
                     "batch_tokens": list(BATCHES),
                     "local_ray": "2 CPUs; 1 CPU and 1 torch thread per worker; plain: OMP_NUM_THREADS=1"},
           "records": records, "wall_s": time.perf_counter() - t_start}
    return out


def verdicts(results: dict) -> H.Verdicts:
    records, v = results["records"], H.Verdicts()
    ok = [r for r in records if r["status"] == "ok"]
    same = {b: {r["dataset_sha256"] for r in ok if r["batch_tokens"] == b} for b in BATCHES}
    v.check("ray: plain, ray-1 and ray-2 datasets are byte-identical at each batch size (manifest but for `runs`)",
            all(len(d) == 1 for d in same.values()) and len(ok) == len(records),
            f"{len(ok)}/{len(records)} runs ok; distinct datasets per batch size: "
            + ", ".join(f"{b}: {len(d)}" for b, d in same.items()))
    by = {(r["mode"], r["batch_tokens"]): r for r in ok}
    for batch in BATCHES:
        one, two, plain = by.get(("ray-1", batch)), by.get(("ray-2", batch)), by.get(("plain", batch))
        if one and two:
            r = two["tokens_per_s"] / one["tokens_per_s"]
            v.check(f"ray (CPU, HF engine, batch {batch}): 2 workers vs 1 (1 CPU each) >= 1.6x", r >= 1.6,
                    f"{two['tokens_per_s']:.0f} vs {one['tokens_per_s']:.0f} tok/s = {r:.2f}x")
        if one and plain:
            r = one["loop_s"] / plain["loop_s"]
            v.check(f"ray (CPU, HF engine, batch {batch}): 1 worker's loop time <= 1.1x the plain path's",
                    r <= 1.1, f"{one['loop_s']:.2f} vs {plain['loop_s']:.2f} s = {r:.2f}x (+{100 * (r - 1):.0f} %); "
                    f"wall {one['process_wall_s']:.1f} vs {plain['process_wall_s']:.1f} s with Ray start-up")
    return v


def errors(results: dict) -> list[str]:
    return H.failed_records(results["records"], "mode", "batch_tokens")


test_ray = H.pytest_case(__name__, needs="ray")

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
