"""Pipeline benchmark: `eagle-fast extract` throughput through vLLM vs the HF engine, with shares.

What it does
    On the tiny Qwen3 with the real 151,936 vocabulary (bench_runner.py builds and caches it)
    and a fixed jsonl of token-id samples, it runs the real CLI (`eagle_fast.cli.main(["extract",
    ...])`) once per engine, each in a fresh process, with a 32k draft vocabulary from
    `eagle-fast vocab` and the default layout (draft supervision, fp32). It reports:
      tokens/s     tokens / engine-loop seconds, steady state: engine start-up and shutdown
                   (`runner.close()`) are taken out wherever the pipeline's loop timer puts them
                   (its own figure is kept as tokens_per_s_reported)
      head share   time in `TargetHead.compute`            / engine-loop seconds
      read share   time loading capture files (vLLM only; `read_hidden_states` minus its wait
                   for the connector's writer, which is engine time)
      engine share time in `runner.capture` minus reading   (the target's forward pass)
      write share  time in the writer thread's shard writes  (a separate thread: it overlaps
                   the main loop, so shares can sum past 100 %)
    and prints the issue's pipeline target (vLLM throughput >= HF's) as PASS/FAIL. Then the
    compact storage options (`COMPACT_VARIANTS`: draft-topk, fp8 aux, both) against bf16 draft,
    on the HF engine, each run COMPACT_REPEATS times round-robin and compared by its fastest
    loop, for issue 13's goal (<= 1.05x the extraction time).

Design
    The shares come from timers wrapped around those four functions inside the child process
    (bench-only instrumentation; the pipeline itself is unchanged), so what is timed is exactly
    the code `eagle-fast extract` runs. Each engine runs in its own process so neither inherits
    the other's threads, allocator state or vLLM's global patches.

Limits
    A random tiny target: its body is nearly free, so on CPU the head dominates both engines
    and the comparison is mostly "same head, different capture path". Sizes are small (8,192
    tokens) to fit `make bench`; override with EAGLE_FAST_BENCH_PIPELINE_SAMPLES / _LEN.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _harness as H

NAME = "pipeline"  # results: pipeline-cpu.json
# the fresh processes each run starts in (this file again, with one of these)
OPTIONS = [H.option("--child", help=argparse.SUPPRESS), H.option("--compact-child", help=argparse.SUPPRESS)]
ENTRIES = {"child": lambda args: _child(args.child), "compact_child": lambda args: _compact_child(args.compact_child)}

SAMPLES = int(os.environ.get("EAGLE_FAST_BENCH_PIPELINE_SAMPLES", "16"))
MEAN_LEN = int(os.environ.get("EAGLE_FAST_BENCH_PIPELINE_LEN", "512"))
ENGINES = ("vllm", "hf")
# Issue 13's extraction-time goal: each compact option costs <= 5 % more than bf16 draft. On
# the HF engine (no 20 s engine start per run), in one process, each option run COMPACT_REPEATS
# times round-robin and compared by its fastest loop: fresh processes differ by ~20 % here.
COMPACT_ENGINE = "hf"
COMPACT_REPEATS = int(os.environ.get("EAGLE_FAST_BENCH_COMPACT_REPEATS", "4"))
COMPACT_BASE = "draft-bf16"
COMPACT_VARIANTS = {
    COMPACT_BASE: ("--out-dtype", "bf16"),
    "draft-topk-k32": ("--supervision", "draft-topk", "--k", "32", "--out-dtype", "bf16"),
    "fp8-draft": ("--aux-dtype", "fp8", "--out-dtype", "bf16"),
    "fp8-draft-topk-k32": ("--aux-dtype", "fp8", "--supervision", "draft-topk", "--k", "32",
                           "--out-dtype", "bf16"),
}


def write_data(path: Path, vocab: int, samples: int = SAMPLES, mean_len: int = MEAN_LEN, seed: int = 0) -> int:
    """jsonl of {"input_ids", "loss_mask"}: lengths mean_len/2 .. 3*mean_len/2, first quarter of
    each sample unsupervised (a prompt). Returns the token count."""
    import torch

    g = torch.Generator().manual_seed(seed)
    total = 0
    with open(path, "w") as f:
        for i in range(samples):
            n = mean_len // 2 + (i * mean_len) // max(1, samples - 1)
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            mask = [0] * (n // 4) + [1] * (n - n // 4)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
            total += n
    return total


# --------------------------------------------------------------------------- child process


class _Timers:
    def __init__(self):
        self.lock = threading.Lock()
        self.s = {"capture": 0.0, "read": 0.0, "read_wait": 0.0, "head": 0.0, "write": 0.0, "set_aux": 0.0,
                  "close": 0.0}
        self.calls = {k: 0 for k in self.s}

    def wrap(self, owner, attr: str, key: str):
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with self.lock:
                    self.s[key] += time.perf_counter() - t0
                    self.calls[key] += 1
        setattr(owner, attr, timed)


def _child(spec: str) -> int:
    """Instrument, then run the real CLI; print the timers and the pipeline's own run record."""
    d = json.loads(spec)
    from eagle_fast import cli, head
    from eagle_fast.pipeline import run as ex
    from eagle_fast.runners import _vllm_compat as compat
    from eagle_fast.runners import base

    T = _Timers()
    T.wrap(base.RunnerBase, "capture", "capture")
    T.wrap(base.RunnerBase, "set_aux_layers", "set_aux")
    T.wrap(base.RunnerBase, "close", "close")
    T.wrap(compat, "read_hidden_states", "read")
    T.wrap(compat, "_wait_written", "read_wait")
    T.wrap(head.TargetHead, "compute", "head")
    T.wrap(ex.ShardWriter, "_write", "write")
    t0 = time.perf_counter()
    rc = cli.main(d["argv"])
    wall = time.perf_counter() - t0
    manifest = json.loads((Path(d["out"]) / "manifest.json").read_text()) if rc == 0 else {}
    run = (manifest.get("runs") or [{}])[-1]
    print("PIPELINE " + json.dumps({"rc": rc, "wall_s": wall, "timers": T.s, "calls": T.calls, "run": run}),
          flush=True)
    return rc


# --------------------------------------------------------------------------- parent


def _run_engine(engine: str, model: Path, data: Path, vocab_file: Path, work: Path, max_len: int) -> dict:
    out = work / f"ds-{engine}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["extract", "--model", str(model), "--data", str(data), "--out", str(out), "--engine", engine,
            "--draft-vocab", str(vocab_file), "--max-len", str(max_len)]
    spec = json.dumps({"argv": argv, "out": str(out)})
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec],
                         check=False, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    rec = {"engine": engine, "command": "eagle-fast " + " ".join(argv), "process_wall_s": wall}
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("PIPELINE ")), None)
    if res.returncode != 0 or line is None:
        rec["status"] = f"error: rc={res.returncode}: {(res.stderr or res.stdout)[-1500:]}"
        return rec
    d = json.loads(line[len("PIPELINE "):])
    run, t = d["run"], d["timers"]
    # Throughput is steady-state: engine start-up (VLLMTargetRunner starts its engine lazily in
    # `set_aux_layers`) and shutdown (`close`, seconds for vLLM's processes) are not per-token
    # work. Wherever the pipeline's own loop timer puts them, they come out of the loop here.
    loop_reported = run.get("seconds") or 0.0
    build_reported = run.get("build_seconds") or 0.0
    start_in_loop = t["set_aux"] if build_reported < 0.9 * t["set_aux"] else 0.0
    loop = loop_reported - start_in_loop - t["close"]
    read = max(0.0, t["read"] - t["read_wait"])
    rec.update({
        "status": "ok", "tokens": run.get("tokens"), "samples": run.get("samples"),
        "tokens_per_s": run["tokens"] / loop if loop > 0 else None,
        "tokens_per_s_reported": run.get("tokens_per_second"), "loop_s": loop,
        "loop_s_reported": loop_reported, "engine_start_s": t["set_aux"],
        "engine_start_in_loop_s": start_in_loop, "close_s": t["close"],
        "build_s": build_reported + start_in_loop,
        "head_s": t["head"], "read_s": read, "engine_s": t["capture"] - read, "write_s": t["write"],
        "head_share": t["head"] / loop if loop else None, "read_share": read / loop if loop else None,
        "engine_share": (t["capture"] - read) / loop if loop else None,
        "write_share": t["write"] / loop if loop else None,
        "calls": d["calls"], "bytes_on_disk": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
    })
    shutil.rmtree(out, ignore_errors=True)
    return rec


def _compact_runs(model: Path, data: Path, vocab_file: Path, work: Path, max_len: int) -> list[dict]:
    """The compact options and their baseline in ONE process (HF engine), round-robin,
    COMPACT_REPEATS times each after a warm-up round: fresh processes differ by ~20 % on the
    same work here, one process much less. Each record is its fastest loop (the manifest's
    engine-loop seconds), with every run's loop time in `loop_s_runs`."""
    argvs = {name: ["extract", "--model", str(model), "--data", str(data), "--out", str(work / f"c-{name}"),
                    "--engine", COMPACT_ENGINE, "--draft-vocab", str(vocab_file), "--max-len", str(max_len), *extra]
             for name, extra in COMPACT_VARIANTS.items()}
    spec = json.dumps({"argvs": argvs, "repeats": COMPACT_REPEATS})
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compact-child", spec],
                         check=False, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("COMPACT ")), None)
    if res.returncode != 0 or line is None:
        err = f"error: rc={res.returncode}: {(res.stderr or res.stdout)[-1500:]}"
        return [{"engine": COMPACT_ENGINE, "variant": n, "status": err} for n in argvs]
    runs = json.loads(line[len("COMPACT "):])
    out = []
    for name, recs in runs.items():
        loops = [r["seconds"] for r in recs]
        best = min(recs, key=lambda r: r["seconds"])
        out.append({"engine": COMPACT_ENGINE, "variant": name, "status": "ok", "command": "eagle-fast " + " ".join(argvs[name]),
                    "tokens": best["tokens"], "loop_s": best["seconds"], "loop_s_runs": loops,
                    "tokens_per_s": best["tokens"] / best["seconds"], "bytes_on_disk": best["bytes"]})
    return out


def _fp8_encode_seconds(tokens: int, width: int, repeats: int = 5) -> float:
    """What --aux-dtype fp8 adds to an extraction, timed alone: quantising `tokens` rows of bf16
    aux states [tokens, width] (store/fp8.quantize), fastest of `repeats`."""
    import torch

    from eagle_fast.store.fp8 import quantize

    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        quantize(x)
        best = min(best, time.perf_counter() - t0)
    return best


def _compact_child(spec: str) -> int:
    d = json.loads(spec)
    from eagle_fast import cli

    runs: dict[str, list[dict]] = {name: [] for name in d["argvs"]}
    for rep in range(d["repeats"] + 1):  # round 0 warms up (imports, allocator, caches)
        for name, argv in d["argvs"].items():
            out = Path(argv[argv.index("--out") + 1])
            shutil.rmtree(out, ignore_errors=True)
            if cli.main(argv) != 0:
                return 1
            run = json.loads((out / "manifest.json").read_text())["runs"][-1]
            size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
            shutil.rmtree(out, ignore_errors=True)
            if rep:
                runs[name].append({"seconds": run["seconds"], "tokens": run["tokens"], "bytes": size})
    print("COMPACT " + json.dumps(runs), flush=True)
    return 0


def run(args) -> dict:
    import bench_runner  # the tiny checkpoint lives there (one definition, one cache)

    t_start = time.perf_counter()
    env = H.environment("cpu")
    model = bench_runner.tiny_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="eagle_fast-bench-pipeline-"))
    try:
        data = work / "data.jsonl"
        tokens = write_data(data, bench_runner.VOCAB)
        max_len = MEAN_LEN * 3 // 2 + 8
        vocab_file = work / "draft_vocab.pt"
        res = subprocess.run([sys.executable, "-m", "eagle_fast", "vocab", "--model", str(model), "--data", str(data),
                              "--size", "32000", "--out", str(vocab_file), "--max-len", str(max_len)],
                             check=False, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"eagle-fast vocab failed: {res.stderr[-2000:]}")
        records = [_run_engine(e, model, data, vocab_file, work, max_len) for e in ENGINES]
        records += _compact_runs(model, data, vocab_file, work, max_len)
        fp8_cost = _fp8_encode_seconds(tokens, 3 * bench_runner.tiny_spec().hidden_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"benchmark": "pipeline", "environment": env,
           "setup": {"model": "tiny Qwen3 (random), V=151,936, H=256, 4 layers, bf16", "samples": SAMPLES,
                     "tokens": tokens, "supervision": "draft (32k, from eagle-fast vocab), fp32",
                     "layout": "native (default)"},
           "fp8_encode_s": fp8_cost, "records": records, "wall_s": time.perf_counter() - t_start}
    for r in records:
        if r["status"] != "ok":
            print(f"  {r['engine']} {r.get('variant', '')} {r['status']}", flush=True)
            continue
        if r.get("variant"):
            print(f"  {r['engine']} {r['variant']:22s} {r['tokens_per_s']:>8.0f} tok/s  loops "
                  + " ".join(f"{x:.2f}" for x in r["loop_s_runs"]) + " s", flush=True)
            continue
        print(f"  {r['engine']:27s} {r['tokens_per_s']:>8.0f} tok/s  loop {r['loop_s']:.1f} s  build {r['build_s']:.1f} s"
              f"  head {100 * r['head_share']:.0f}%  engine {100 * r['engine_share']:.0f}%"
              f"  read {100 * r['read_share']:.0f}%  write {100 * r['write_share']:.0f}%", flush=True)
    return out


def verdicts(results: dict) -> H.Verdicts:
    records, fp8_cost, v = results["records"], results.get("fp8_encode_s"), H.Verdicts()
    compact = {r["variant"]: r for r in records if r.get("variant")}
    base = compact.get(COMPACT_BASE)
    if fp8_cost is not None and base and base["status"] == "ok":
        share = fp8_cost / base["loop_s"]
        v.check("pipeline: the work --aux-dtype fp8 adds (quantising every token's aux states, timed alone) "
                "<= 5 % of the bf16 draft extraction", share <= 0.05,
                f"{1e3 * fp8_cost:.1f} ms for {base['tokens']:,} tokens = {100 * share:.2f} % of {base['loop_s']:.2f} s")
    for name, r in compact.items():
        if name == COMPACT_BASE:
            continue
        if not (base and base["status"] == "ok" and r["status"] == "ok"):
            v.check(f"pipeline: {name} extraction time <= 1.05x bf16 draft", None, "a run failed")
            continue
        if r["bytes_on_disk"] >= base["bytes_on_disk"]:  # the option did not take effect: no timing claim
            v.check(f"pipeline ({COMPACT_ENGINE} engine): {name} writes fewer bytes than {COMPACT_BASE}", False,
                    f"{r['bytes_on_disk']:,} vs {base['bytes_on_disk']:,} bytes: check its options in COMPACT_VARIANTS")
            continue
        ratio = r["loop_s"] / base["loop_s"]
        v.check(f"pipeline ({COMPACT_ENGINE} engine): {name} extraction time <= 1.05x {COMPACT_BASE}'s",
                ratio <= 1.05,
                f"fastest of {len(r['loop_s_runs'])}: {r['loop_s']:.2f} s vs {base['loop_s']:.2f} s = {ratio:.3f}x; on disk "
                f"{r['bytes_on_disk'] / base['bytes_on_disk']:.2f}x")
    by = {r["engine"]: r for r in records if not r.get("variant")}
    vl, hf = by.get("vllm"), by.get("hf")
    if not (vl and hf and vl["status"] == "ok" and hf["status"] == "ok"):
        v.check("pipeline: vLLM throughput >= HF's", None, "an engine did not run: " +
                "; ".join(f"{r['engine']}: {r['status'][:200]}" for r in records if r["status"] != "ok"))
        return v
    r = vl["tokens_per_s"] / hf["tokens_per_s"]
    v.check("pipeline (CPU, tiny Qwen3 V=151,936): vLLM engine throughput >= HF engine's", r >= 1.0,
            f"{vl['tokens_per_s']:.0f} vs {hf['tokens_per_s']:.0f} tok/s = {r:.2f}x; head share "
            f"{100 * vl['head_share']:.0f}% (vLLM), {100 * hf['head_share']:.0f}% (HF)")
    return v


def errors(results: dict) -> list[str]:
    return H.failed_records(results["records"], "engine", "variant")


test_pipeline = H.pytest_case(__name__, needs="vllm")

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
