"""Head benchmark: `eagle_fast.kernels.lm_head` against what a user would otherwise run, per vocab.

What it does
    For each shape of `shapes.py` (sweep over vocabulary sizes, plus the target case) and each
    output mode, it runs these providers side by side (interleaved rounds, medians):
      1 seed-fp32      the seed's path (NeMo's VLLMTargetRunner._compute_logits): fp32 norm,
                       an fp32 [H, V] copy of the head made once at load, full fp32 logits,
                       then log_softmax / logsumexp / argmax / topk / draft gather on them
      2 torch-native   plain PyTorch in the weight dtype: norm rounded to bf16, bf16 GEMM with
                       full bf16 logits, reductions on logits.float() as users write them
      3 lm_head-torch  lm_head(impl="torch"), the chunked PyTorch / CPU path
      4 lm_head-triton lm_head(impl="triton"), CUDA only
     4b lm_head-triton-before  the same public call routed to the kernel as it was before
                       issue 29 (`bench/triton_before/`, frozen), CUDA only: old and new side
                       by side, each warmed up like every provider
      5 gemm-floor     the bare GEMM y @ W.T of the shape on the already-normalised y, fp32
                       out, in this device's fastest exact mode (`_floor.py`): the floor any
                       head must pay
    and reports median time, TFLOP/s (2*N*H*V / t), peak extra memory, bytes per token, each
    head's time as a ratio to the floor and (PyTorch head) its time by phase, then prints the
    issue's targets as PASS/FAIL lines. The floor cases (`shapes.FLOOR_SHAPES`) run only the
    floor and the head.

Output modes: lse+argmax | topk64 | draft32k (log-softmax over a 32k draft subset + argmax
mask: outputs ("draft", "argmax"), no lse) | logits-bf16 (full logits, bf16) | all
(lse+argmax+topk64+draft32k: the CPU target).

Three ways to run it
    make bench                               pytest-benchmark over the CPU suite (bench/run.py)
    python bench/bench_lm_head.py --out DIR  the same suite as a plain script (no pytest-benchmark,
                                             no transformers, no vLLM): what gpu_check.sh runs
    python bench/bench_lm_head.py --smoke    seconds: tiny shapes, every provider and code path
                                             (Triton through the interpreter on CPU)

Design
    This file runs the suite and writes the results; the cases and how one is measured live in
    `lm_head_cases.py`, the goals in `lm_head_goals.py`. Timing is interleaved (`_harness.SideBySide`) so ratios hold on a shared machine; the
    first call of each provider is a warm-up that also measures peak extra memory
    (`_harness.peak_extra`: CUDA allocator peak, or CPU peak RSS) and its outputs are
    cross-checked (argmax agreement, lse difference) so a fast wrong kernel cannot pass. The
    CPU target's memory ratio is re-measured in a fresh subprocess per provider. Inputs are
    random with a planted top token per row (see `build_inputs`); timing does not depend on
    the values.

Limits
    The seed's fp32 head copy (V*H*4 bytes) is load-time state, not per-call memory, so it is
    reported separately as `resident_bytes` and is NOT in provider 1's peak: that makes the
    memory target stricter on us. CPU absolute times are noisy (shared machine); only ratios
    measured in one run are claims. Providers 4 and 5 are skipped on CPU (the interpreter is
    not a speed). Provider 2 is called once on CPUs without AVX512-BF16/AMX (`_once`: there
    PyTorch's bf16 GEMM is emulated, ~7x slower than fp32, so it can never be the faster
    baseline); with them it is oneDNN's bf16 GEMM, which rounds the logits to bf16, the fastest
    provider, and timed in rounds like the others.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import _harness as H
import torch
from lm_head_cases import (
    MIN_ARGMAX_AGREE,
    MODES,
    PROVIDERS,
    InputCache,
    build_inputs,
    is_cpu_target,
    make_providers,
    names_for,
    providers_for,
    run_case,
    suite,
    target_cases,
)
from lm_head_goals import evaluate_targets
from shapes import HeadShape

NAME = "lm_head"  # results: lm_head-<device>.json, lm_head-smoke.json with --smoke
OPTIONS = [
    H.option("--device", choices=("auto", "cpu", "cuda"), default="auto"),
    H.option("--budget-s", type=float, default=float("inf"),
             help="stop starting new cases after this many seconds (targets run first)"),
    H.option("--smoke", action="store_true",
             help="tiny shapes, every provider, seconds (results into a temp dir unless --out/--json)"),
    H.option("--probe", help=argparse.SUPPRESS),  # one provider's memory, in a fresh process
]
ENTRIES = {"probe": lambda args: _probe_main(args.probe)}


def device_of(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_lm_head: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        raise SystemExit(2)
    return args.device


def result_name(args) -> str:
    return "lm_head-smoke" if args.smoke else f"lm_head-{device_of(args)}"


def default_out(args) -> Path | None:
    return Path(tempfile.gettempdir()) / "eagle_fast-bench-smoke" if args.smoke else None


def probe_memory_subprocess(shape: HeadShape, mode: str, provider: str, timeout: int = 300) -> int | None:
    """Peak extra RSS of ONE call in a fresh interpreter (inputs built, then the call)."""
    spec = json.dumps({"shape": asdict(shape), "mode": mode, "provider": provider})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", spec]
    try:
        res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    for line in res.stdout.splitlines():
        if line.startswith("PROBE "):
            return int(json.loads(line[6:])["peak_extra_bytes"])
    print(f"  memory probe {provider} failed: {res.stderr[-2000:]}", file=sys.stderr)
    return None


def _probe_main(spec: str) -> None:
    d = json.loads(spec)
    shape = HeadShape(**d["shape"])
    H.return_freed_memory()
    inp = build_inputs(shape, "cpu", providers=(d["provider"],))
    fn = make_providers(inp, d["mode"], [d["provider"]])[d["provider"]]
    _, peak, dt = H.peak_extra(fn, "cpu")
    print("PROBE " + json.dumps({"peak_extra_bytes": peak, "seconds": dt}), flush=True)


def add_subprocess_memory(records: list, shape: HeadShape, mode: str) -> None:
    """CPU target: re-measure providers 1 and 3 in fresh processes (the numbers the target uses)."""
    for rec in records:
        if rec["provider"] in ("seed-fp32", "lm_head-torch"):
            rec["peak_extra_bytes_subprocess"] = probe_memory_subprocess(shape, mode, rec["provider"])



def payload(device: str, records: list, env: dict, smoke: bool = False, **extra) -> dict:
    return {"benchmark": "lm_head", "environment": env, "providers": PROVIDERS,
            "target_cases": target_cases(device, smoke), "smoke": smoke,
            "modes": {m: {k: (str(v) if k == "out_dtype" else v) for k, v in s.items()} for m, s in MODES.items()},
            "records": records, **extra}


def run(args) -> dict:
    """The suite, target cases first; the results so far go to args.json after every case, so a
    run killed by a timeout keeps what it finished."""
    device, smoke = device_of(args), args.smoke
    env = H.environment(device)
    names = providers_for(device, smoke)
    cache = InputCache(device, names)
    records, skipped, t0 = [], [], time.perf_counter()
    for shape, mode in suite(device, smoke):
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(f"{shape.name} N={shape.n_tokens} {mode}")
            continue
        inp = cache.get(shape)
        recs, _ = run_case(inp, mode, names_for(shape, device, smoke), rounds=(1, 2) if smoke else None)
        if device == "cpu" and not smoke and is_cpu_target(shape, mode):
            add_subprocess_memory(recs, shape, mode)
        records += recs
        _print_case(recs)
        H.write_json(args.json, payload(device, records, env, smoke=smoke, partial=True,
                                        wall_s=time.perf_counter() - t0))
    if skipped:
        print(f"time budget {args.budget_s:.0f} s reached; skipped {len(skipped)} cases: {skipped}")
    return payload(device, records, env, smoke=smoke, skipped=skipped, wall_s=time.perf_counter() - t0)


def verdicts(results: dict) -> H.Verdicts:
    return evaluate_targets(results["records"], results["environment"]["device"], results["smoke"])


def errors(results: dict) -> list[str]:
    """A provider that failed or a wrong head; off --smoke, a missed goal too (gpu_check.sh's exit 1)."""
    errs = H.failed_records(results["records"], "shape", "n_tokens", "mode", "provider")
    if not results["smoke"]:
        errs += [f"FAIL {t['target']}" for t in results["targets"] if t["result"] == "FAIL"]
    return errs


def _print_case(recs: list) -> None:
    r0 = recs[0]
    print(f"{r0['shape']} N={r0['n_tokens']} H={r0['hidden']} V={r0['vocab']} {r0['mode']}")
    for r in recs:
        tf = f"{r['tflops']:.3f}" if r["tflops"] else "-"
        agree = f" argmax-agree={r['argmax_agree']:.4f}" if "argmax_agree" in r else ""
        print(f"  {r['provider']:15s} {H.fmt_s(r['median_s']):>10s} x{r['n_timed']} "
              f"{tf:>9s} TFLOP/s  peak+{H.fmt_bytes(r['peak_extra_bytes']):>10s}  {r['status']}{agree}",
              flush=True)


# --------------------------------------------------------------------------- pytest-benchmark
# One test per case, so pytest-benchmark's table has a row per (shape, mode) and its `pedantic`
# drives the interleaved rounds (one round = every provider once); the module's fixture judges
# them and writes the results JSON as `run` would.

try:
    import pytest
except ImportError:  # script mode on a machine without pytest (the GPU image)
    pytest = None

if pytest is not None:
    _DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    _NAMES = providers_for(_DEVICE)
    _CASES = suite(_DEVICE)

    @pytest.fixture(scope="module")
    def _collector():
        state = {"records": [], "cache": InputCache(_DEVICE, _NAMES), "env": H.environment(_DEVICE),
                 "t0": time.perf_counter()}
        yield state
        state["cache"] = None
        results = payload(_DEVICE, state["records"], state["env"], wall_s=time.perf_counter() - state["t0"],
                          skipped=[])
        results["targets"] = verdicts(results).lines
        H.write_json(H.results_path(sys.modules[__name__], H.parser(sys.modules[__name__]).parse_args([])),
                     results)

    @pytest.mark.parametrize("shape, mode", _CASES,
                             ids=[f"{s.name}-N{s.n_tokens}-{m}" for s, m in _CASES])
    def test_lm_head(benchmark, _collector, shape, mode):
        inp = _collector["cache"].get(shape)
        recs, check = run_case(inp, mode, names_for(shape, _DEVICE), benchmark=benchmark)
        if _DEVICE == "cpu" and is_cpu_target(shape, mode):
            add_subprocess_memory(recs, shape, mode)
        _collector["records"] += recs
        benchmark.extra_info.update({r["provider"]: {"median_s": r["median_s"], "peak_extra_bytes":
                                                     r["peak_extra_bytes"], "status": r["status"]}
                                     for r in recs})
        failed = H.failed_records(recs, "provider")
        assert not failed, failed
        # A fast wrong head must not be benchmarked as if it were right.
        for name, c in check.items():
            if name.startswith("lm_head") and "argmax_agree" in c:
                assert c["argmax_agree"] >= MIN_ARGMAX_AGREE, (name, c)


if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
