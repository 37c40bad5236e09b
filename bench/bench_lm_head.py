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
    Timing is interleaved (`_harness.SideBySide`) so ratios hold on a shared machine; the
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
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _floor
import _harness as H
import shapes
from eagle_fast.kernels._cpu import bf16_gemm_is_native
from shapes import HeadShape

MODES = {
    "lse+argmax": {"outputs": ("lse", "argmax")},
    "topk64": {"outputs": ("topk",), "k": shapes.TOPK},
    "draft32k": {"outputs": ("draft", "argmax")},
    "logits-bf16": {"outputs": ("logits",), "out_dtype": torch.bfloat16},
    "all": {"outputs": ("lse", "argmax", "topk", "draft"), "k": shapes.TOPK},
    "draft-topk64": {"outputs": ("draft_topk",), "k": shapes.TOPK},
}
SWEEP_MODES = ("lse+argmax", "topk64", "draft32k", "logits-bf16")

PROVIDERS = {
    "seed-fp32": "1 seed: fp32 upcast + full fp32 logits",
    "torch-native": "2 plain torch, weight dtype, full logits",
    "lm_head-torch": "3 lm_head(impl='torch')",
    "lm_head-triton": "4 lm_head(impl='triton')",
    "gemm-floor": "5 bare GEMM y @ W.T, fp32 out (the floor)",
}
CUDA_ONLY = ("lm_head-triton",)
FLOOR_PROVIDERS = ("gemm-floor", "lm_head-torch")

EPS = 1e-6

# Rounds per device: (warm-up calls, timed interleaved rounds), for the target cases and the
# sweep. CPU calls take seconds and all of `make bench` has 10 minutes on 2 cores; CUDA calls
# take milliseconds.
ROUNDS = {"cpu": {"target": (1, 3), "sweep": (1, 2)}, "cuda": {"target": (2, 7), "sweep": (2, 5)}}
# Called once (warm-up = its only sample) per device; see _harness.SideBySide. On CPUs without
# AVX512-BF16/AMX, PyTorch's bf16 GEMM is emulated (~20 GFLOP/s on AVX2, 7x slower than fp32), so
# provider 2 can never be the faster baseline there, and repeating its 15-second calls would eat
# the budget. With them (oneDNN), it is the fastest provider and is timed like the others: one
# sample of it ranged 1.3-2.4 s across runs on the same machine.
def _once() -> dict:
    return {"cpu": () if bf16_gemm_is_native() else ("torch-native",), "cuda": ()}


# --------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    """One shape's tensors plus each provider's load-time state."""

    shape: HeadShape
    device: str
    hidden: torch.Tensor          # [N, H] bf16, pre-norm
    weight: torch.Tensor          # [V, H] bf16
    norm_weight: torch.Tensor     # [H] bf16
    draft_ids: torch.Tensor       # int64 [Vd], sorted
    draft_mask: torch.Tensor      # bool [V]: t2d
    w32_t: torch.Tensor | None = None   # seed: fp32 [H, V] copy, made once (as the seed does)
    norm32: torch.Tensor | None = None  # seed: fp32 norm multiplier (1 + w for Gemma)
    floor: _floor.BareGemm | None = None  # the bare GEMM, operands prepared

    @property
    def resident_seed_bytes(self) -> int:
        return self.w32_t.numel() * 4 if self.w32_t is not None else 0


def build_inputs(shape: HeadShape, device: str, providers=tuple(PROVIDERS), seed: int = 0) -> Inputs:
    """Random inputs with a planted next token per row, so the argmax is not a near-tie.

    weight ~ N(0, 0.02) (initialisation scale); hidden = g + (sqrt(H) / 2) * unit(weight[t])
    with g ~ N(0, 1) and a random target id t per row: the planted logit sits ~9 standard
    deviations above the rest, as a trained model's top token does, so the cross-check between
    providers that round differently compares real decisions, not coin flips.
    """
    dtype = getattr(torch, shape.dtype)
    N, Hd, V = shape.n_tokens, shape.hidden, shape.vocab
    g = torch.Generator(device=device).manual_seed(seed)
    gcpu = torch.Generator().manual_seed(seed)

    def randn(rows, cols, scale=1.0):
        # row blocks keep the fp32 temporary small for multi-GB weights
        out = torch.empty(rows, cols, dtype=dtype, device=device)
        step = max(1, (256 << 20) // (4 * cols))
        for i in range(0, rows, step):
            n = min(step, rows - i)
            out[i:i + n] = torch.randn(n, cols, generator=g, device=device) * scale
        return out

    weight = randn(V, Hd, scale=0.02)
    planted = torch.randint(0, V, (N,), generator=gcpu).to(device)
    u = weight[planted].float()
    u = u / u.norm(dim=-1, keepdim=True)
    hidden = (randn(N, Hd).float() + (Hd ** 0.5 / 2) * u).to(dtype)
    nw = randn(1, Hd, scale=0.1).float().squeeze(0)
    norm_weight = (nw if shape.norm == "rms_one_plus" else 1.0 + nw).to(dtype)
    Vd = shapes.draft_size(V)
    draft_ids = torch.randperm(V, generator=gcpu)[:Vd].sort().values.to(device)
    draft_mask = torch.zeros(V, dtype=torch.bool, device=device)
    draft_mask[draft_ids] = True
    inp = Inputs(shape, device, hidden, weight, norm_weight, draft_ids, draft_mask)
    if "seed-fp32" in providers:
        inp.w32_t = weight.float().t().contiguous()
        n32 = norm_weight.float()
        inp.norm32 = 1.0 + n32 if shape.norm == "rms_one_plus" else n32
    if "gemm-floor" in providers:
        inp.floor = _floor.BareGemm(_norm32(inp).to(dtype), weight, device)
    return inp


def _norm32(inp: Inputs) -> torch.Tensor:
    x = inp.hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    n32 = inp.norm32 if inp.norm32 is not None else (
        1.0 + inp.norm_weight.float() if inp.shape.norm == "rms_one_plus" else inp.norm_weight.float())
    return x * n32


# --------------------------------------------------------------------------- providers


def _from_full_logits(logits32: torch.Tensor, mode: str, inp: Inputs) -> dict:
    """What a user computes from full fp32 logits for `mode` (NeMo's draft projection style)."""
    out = {}
    if mode == "lse+argmax":
        out["lse"] = torch.logsumexp(logits32, -1)
        out["argmax"] = logits32.argmax(-1)
    elif mode == "topk64":
        logprobs = torch.log_softmax(logits32, -1)
        out["topk_logprobs"], out["topk_ids"] = logprobs.topk(shapes.TOPK, -1)
        out["argmax"] = out["topk_ids"][:, 0]
    elif mode == "draft32k":
        out["argmax"] = logits32.argmax(-1)
        out["argmax_in_draft"] = inp.draft_mask[out["argmax"]]
        out["draft_logprobs"] = torch.log_softmax(logits32.index_select(-1, inp.draft_ids), -1)
    elif mode == "draft-topk64":
        out["argmax"] = logits32.argmax(-1)
        out["argmax_in_draft"] = inp.draft_mask[out["argmax"]]
        draft = torch.log_softmax(logits32.index_select(-1, inp.draft_ids), -1)
        out["draft_topk_logprobs"], out["draft_topk_ids"] = draft.topk(shapes.TOPK, -1)
    elif mode == "all":
        logprobs = torch.log_softmax(logits32, -1)
        out["lse"] = (logits32[:, :1] - logprobs[:, :1]).squeeze(1)
        out["topk_logprobs"], out["topk_ids"] = logprobs.topk(shapes.TOPK, -1)
        out["topk_tail"] = (1.0 - out["topk_logprobs"].exp().sum(-1)).clamp_min(0.0)
        out["argmax"] = out["topk_ids"][:, 0]
        out["argmax_in_draft"] = inp.draft_mask[out["argmax"]]
        out["draft_logprobs"] = torch.log_softmax(logits32.index_select(-1, inp.draft_ids), -1)
    else:
        raise ValueError(mode)
    return out


def make_providers(inp: Inputs, mode: str, names) -> dict:
    """name -> zero-argument callable doing `mode`'s work on `inp`."""
    spec = MODES[mode]
    dtype = inp.weight.dtype

    def seed_fp32():
        x = inp.hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        x = x * inp.norm32
        logits = x @ inp.w32_t                       # [N, V] fp32
        if mode == "logits-bf16":
            return {"logits": logits.to(torch.bfloat16)}
        return _from_full_logits(logits, mode, inp)

    def torch_native():
        y = _norm32(inp).to(dtype)
        logits = F.linear(y, inp.weight)             # [N, V] in the weight dtype
        if mode == "logits-bf16":
            return {"logits": logits}
        return _from_full_logits(logits.float(), mode, inp)

    def lm_head_impl(impl):
        from eagle_fast.kernels import lm_head

        kw = dict(spec)
        if {"draft", "draft_topk"} & set(kw["outputs"]):
            kw["draft_ids"] = inp.draft_ids
        norm = inp.shape.norm

        def call():
            return lm_head(inp.hidden, inp.weight, inp.norm_weight, eps=EPS, norm=norm, impl=impl, **kw)
        return call

    table = {
        "seed-fp32": seed_fp32,
        "torch-native": torch_native,
        "lm_head-torch": lambda: lm_head_impl("torch"),
        "lm_head-triton": lambda: lm_head_impl("triton"),
        "gemm-floor": inp.floor,
    }
    out = {}
    for n in names:
        if n in ("lm_head-torch", "lm_head-triton"):
            out[n] = table[n]()
        else:
            out[n] = table[n]
    return out


def _fields(result) -> dict:
    if result is None:
        return {}
    if isinstance(result, dict):
        return result
    return result.as_dict()  # HeadOutput


def output_bytes(result) -> int:
    return sum(t.numel() * t.element_size() for t in _fields(result).values() if torch.is_tensor(t))


def summarize(name: str, result) -> dict:
    """What the cross-check and the memory report need of one output: small tensors only."""
    f = _fields(result)
    keep = {k: f[k].detach().cpu() for k in ("argmax", "lse", "draft_topk_logprobs") if k in f}
    if "argmax" not in keep and "logits" in f:  # full logits (the floor's): their argmax
        keep["argmax"] = f["logits"].argmax(-1).cpu()
    keep["_output_bytes"] = output_bytes(result)
    return keep


# Our head's argmax must agree with the seed's fp32 path on at least this share of rows. Not 1:
# the seed keeps the normalised activation in fp32 while lm_head rounds it to the weight dtype
# first (as transformers and vLLM do), which flips near-ties (~0.5 % of random rows measured).
MIN_ARGMAX_AGREE = 0.98


def cross_check(timings: dict, reference: str) -> dict:
    """Agreement of each provider's argmax / lse with `reference`'s warm-up outputs."""
    ref = _fields(timings[reference].result) if reference in timings else {}
    report = {}
    for name, t in timings.items():
        f = _fields(t.result)
        entry = {}
        if "argmax" in f and "argmax" in ref:
            entry["argmax_agree"] = float((f["argmax"].cpu() == ref["argmax"].cpu()).float().mean())
        if "lse" in f and "lse" in ref:
            entry["lse_max_abs_diff"] = float((f["lse"].float().cpu() - ref["lse"].float().cpu()).abs().max())
        if "draft_topk_logprobs" in f and "draft_topk_logprobs" in ref:
            a, b = f["draft_topk_logprobs"].float().cpu(), ref["draft_topk_logprobs"].float().cpu()
            entry["draft_topk_max_abs_diff"] = float((a - b).abs().max())
        if entry:
            report[name] = entry
    return report


# --------------------------------------------------------------------------- one case


def providers_for(device: str, smoke: bool = False) -> list[str]:
    if device == "cuda" or smoke:
        return list(PROVIDERS)
    return [p for p in PROVIDERS if p not in CUDA_ONLY]


def is_floor_case(shape: HeadShape) -> bool:
    return any((shape.name, shape.n_tokens) == (s.name, s.n_tokens) for s in shapes.FLOOR_SHAPES)


def names_for(shape: HeadShape, device: str, smoke: bool = False) -> list[str]:
    """Providers of one case: the floor cases run the floor and the head only."""
    names = providers_for(device, smoke)
    if is_floor_case(shape):
        head = "lm_head-triton" if device == "cuda" else "lm_head-torch"
        return [n for n in names if n in ("gemm-floor", head)]
    return names


def run_case(inp: Inputs, mode: str, names, *, rounds=None, benchmark=None) -> tuple[list, dict]:
    """Measure one (shape, mode) for every provider in `names`. Returns (records, cross-check).

    With a pytest-benchmark fixture, its `pedantic` drives the timed rounds (one round = every
    provider once, interleaved); otherwise a plain loop does.
    """
    device, shape = inp.device, inp.shape
    kind = "target" if (is_target(shape, mode, device) or is_floor_case(shape)) else "sweep"
    warmups, n_rounds = rounds or ROUNDS[device][kind]
    sbs = H.SideBySide(make_providers(inp, mode, names), device, once=_once()[device], summarize=summarize)
    sbs.warmup(extra_warmups=warmups - 1)
    check = cross_check(sbs.timings, "seed-fp32" if "seed-fp32" in names else names[0])
    phase_s = None
    if "lm_head-torch" in sbs.providers and not sbs.timings["lm_head-torch"].error:
        # one more call, under torch.profiler (outside the timed rounds)
        _, phase_s = _floor.phases(sbs.providers["lm_head-torch"], device)
    outs = {n: (t.result or {}).get("_output_bytes") for n, t in sbs.timings.items()}
    sbs.drop_results()
    if benchmark is not None:
        counter = iter(range(10**9))
        benchmark.group = f"{shape.name} N={shape.n_tokens}"
        benchmark.pedantic(lambda: sbs.round(next(counter)), rounds=n_rounds, iterations=1)
    else:
        for i in range(n_rounds):
            sbs.round(i)
    records = []
    floor = sbs.timings.get("gemm-floor")
    floor_s = floor.median if floor is not None and not floor.error else None
    for name, t in sbs.timings.items():
        med = t.median
        rec = {
            "shape": shape.name, "model": shape.model, "hidden": shape.hidden, "vocab": shape.vocab,
            "n_tokens": shape.n_tokens, "norm": shape.norm, "dtype": shape.dtype, "mode": mode,
            "provider": name, "device": device,
            "median_s": med, "min_s": min(t.times) if t.times else None, "n_timed": len(t.times),
            "times_s": t.times, "warmup_s": t.warmup_s,
            "tflops": (shape.flop / med / 1e12) if med else None,
            "peak_extra_bytes": t.peak_extra_bytes,
            "bytes_per_token": (t.peak_extra_bytes / shape.n_tokens) if t.peak_extra_bytes is not None else None,
            "output_bytes": outs.get(name),
            "resident_bytes": inp.resident_seed_bytes if name == "seed-fp32" else 0,
            "status": "error: " + t.error if t.error else ("ok (called once)" if t.once else "ok"),
            "vs_floor": (med / floor_s) if (med and floor_s) else None,
        }
        if name == "gemm-floor":
            rec["floor_kind"] = _floor.floor_kind(device, inp.weight.dtype)
        if name == "lm_head-torch" and phase_s is not None:
            rec["phases_s"] = phase_s
        rec.update(check.get(name, {}))
        if name.startswith("lm_head") and rec.get("argmax_agree", 1.0) < MIN_ARGMAX_AGREE:
            rec["status"] = (f"error: wrong result: argmax agrees with seed-fp32 on only "
                             f"{rec['argmax_agree']:.4f} of rows")
        records.append(rec)
    return records, check


# --------------------------------------------------------------------------- memory probe


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


# --------------------------------------------------------------------------- targets


def _find(records, shape_name, n_tokens, mode, provider):
    for r in records:
        if (r["shape"], r["n_tokens"], r["mode"], r["provider"]) == (shape_name, n_tokens, mode, provider):
            return r
    return None


def evaluate_targets(records: list, device: str, smoke: bool = False) -> H.Verdicts:
    """The issue's targets as PASS/FAIL lines. `smoke` runs both checks on the smoke shapes
    (numbers meaningless) so the GPU verdict code is exercised on a CPU."""
    v = H.Verdicts()
    if smoke:
        s = shapes.SMOKE[0]
        _cpu_targets(v, records, s, "all", tag="smoke, meaningless: ")
        _gpu_targets(v, records, s, ("lse+argmax", "draft32k", "topk64"), tag="smoke, meaningless: ")
    elif device == "cpu":
        _cpu_targets(v, records, *shapes.TARGETS["cpu"])
        _floor_targets(v, records)
    else:
        _gpu_targets(v, records, *shapes.TARGETS["cuda"])
    return v


def _cpu_targets(v: H.Verdicts, records, shape: HeadShape, mode: str, tag: str = "") -> None:
    p1, p2, p3 = (_find(records, shape.name, shape.n_tokens, mode, p)
                  for p in ("seed-fp32", "torch-native", "lm_head-torch"))
    where = f"{tag}N={shape.n_tokens} H={shape.hidden} V={shape.vocab} {mode}"
    if not (p1 and p3 and p1["median_s"] and p3["median_s"]):
        v.check(f"CPU time ({where})", None, "not measured")
        v.check(f"CPU memory ({where})", None, "not measured")
        return
    base_name, base = min(((n, r) for n, r in (("seed-fp32", p1), ("torch-native", p2))
                           if r and r["median_s"]), key=lambda nr: nr[1]["median_s"])
    ratio = p3["median_s"] / base["median_s"]
    v.check(f"CPU time ({where}): lm_head-torch <= 1.1x the faster of providers 1 and 2",
            ratio <= 1.1, f"{H.fmt_s(p3['median_s'])} vs {base_name} {H.fmt_s(base['median_s'])}"
            f" = {ratio:.2f}x")
    sub = p1.get("peak_extra_bytes_subprocess") and p3.get("peak_extra_bytes_subprocess")
    m1 = p1["peak_extra_bytes_subprocess"] if sub else p1["peak_extra_bytes"]
    m3 = p3["peak_extra_bytes_subprocess"] if sub else p3["peak_extra_bytes"]
    how = "each in a fresh subprocess" if sub else "in-process, first call"
    if m1 and m3 is not None:
        mr = m3 / m1
        v.check(f"CPU memory ({where}): lm_head-torch peak extra <= 25% of provider 1",
                mr <= 0.25, f"{H.fmt_bytes(m3)} vs {H.fmt_bytes(m1)} = {100 * mr:.1f}% ({how})")
    else:
        v.check(f"CPU memory ({where})", None, "not measured")


def _floor_targets(v: H.Verdicts, records) -> None:
    """The head's ("draft", "argmax") call against the bare GEMM of its shape (CPU)."""
    for shape in shapes.FLOOR_SHAPES:
        bound = shapes.FLOOR_GOALS[(shape.name, shape.n_tokens)]
        head = _find(records, shape.name, shape.n_tokens, "draft32k", "lm_head-torch")
        floor = _find(records, shape.name, shape.n_tokens, "draft32k", "gemm-floor")
        where = f"N={shape.n_tokens} H={shape.hidden} V={shape.vocab} draft32k+argmax"
        if not (head and floor and head["median_s"] and floor["median_s"]):
            v.check(f"CPU head vs floor ({where})", None, "not measured")
            continue
        ph = head.get("phases_s") or {}
        outside = ", ".join(f"{p} {100 * ph[p] / ph['total']:.0f}%" for p in _floor.PHASES
                            if p != "gemm" and ph.get(p) and ph.get("total"))
        v.check(f"CPU head vs floor ({where}): lm_head-torch <= {bound}x the bare GEMM",
                head["vs_floor"] <= bound,
                f"{H.fmt_s(head['median_s'])} vs {H.fmt_s(floor['median_s'])} "
                f"({floor['floor_kind']}) = {head['vs_floor']:.2f}x; by phase: gemm "
                f"{100 * ph.get('gemm', 0) / ph.get('total', 1):.0f}%, {outside}")


def _gpu_targets(v: H.Verdicts, records, shape: HeadShape, modes, tag: str = "") -> None:
    nv2 = 2 * shape.n_tokens * shape.vocab
    for mode in modes:
        tri = _find(records, shape.name, shape.n_tokens, mode, "lm_head-triton")
        gemm = _find(records, shape.name, shape.n_tokens, mode, "gemm-floor")
        seed = _find(records, shape.name, shape.n_tokens, mode, "seed-fp32")
        where = f"{tag}N={shape.n_tokens} H={shape.hidden} V={shape.vocab} {mode}"
        if not (tri and tri["median_s"]):
            v.check(f"GPU ({where})", None, "lm_head-triton not measured")
            continue
        if tri["status"].startswith("error"):
            v.check(f"GPU ({where})", False, tri["status"])
            continue
        bound = 1.25 if mode == "topk64" else 1.10  # the GPU goals, raised from 1.3x / 1.15x
        if gemm and gemm["median_s"]:
            r = tri["median_s"] / gemm["median_s"]
            v.check(f"GPU time ({where}): triton <= {bound}x bare GEMM", r <= bound,
                    f"{H.fmt_s(tri['median_s'])} vs {H.fmt_s(gemm['median_s'])} = {r:.2f}x "
                    f"({tri['tflops']:.1f} vs {gemm['tflops']:.1f} TFLOP/s)")
        else:
            v.check(f"GPU time ({where})", None, "bare GEMM not measured")
        if seed and seed["median_s"]:
            s = seed["median_s"] / tri["median_s"]
            v.check(f"GPU speed-up ({where}): triton >= 10x provider 1", s >= 10,
                    f"{H.fmt_s(seed['median_s'])} / {H.fmt_s(tri['median_s'])} = {s:.1f}x")
        if tri["peak_extra_bytes"] is not None:
            scratch = tri["peak_extra_bytes"] - (tri["output_bytes"] or 0)
            v.check(f"GPU memory ({where}): no N x V buffer (scratch <= 25% of N*V*2 B)",
                    scratch <= 0.25 * nv2,
                    f"peak extra {H.fmt_bytes(tri['peak_extra_bytes'])} = outputs "
                    f"{H.fmt_bytes(tri['output_bytes'])} + scratch {H.fmt_bytes(scratch)}; "
                    f"N*V*2 = {H.fmt_bytes(nv2)}")


# --------------------------------------------------------------------------- suites


def suite(device: str, smoke: bool = False) -> list[tuple[HeadShape, str]]:
    """(shape, mode) cases, target case(s) first so a time budget never drops them."""
    if smoke:
        return [(s, m) for s in shapes.SMOKE for m in MODES]
    if device == "cuda":
        tshape, _ = shapes.TARGETS["cuda"]
        cases = [(tshape, m) for m in (*SWEEP_MODES, "all", "draft-topk64")]
        cases += [(s, m) for s in shapes.sweep("cuda") if s.name != tshape.name for m in SWEEP_MODES]
        return cases
    tshape, tmode = shapes.TARGETS["cpu"]
    floor = [(s, m) for s in shapes.FLOOR_SHAPES for m in shapes.FLOOR_MODES]
    return [(tshape, tmode), *floor] + [(s, m) for s in shapes.sweep("cpu") for m in SWEEP_MODES]


class InputCache:
    """Keeps one shape's inputs alive across its modes (cases come grouped by shape)."""

    def __init__(self, device, names):
        self.device, self.names, self.key, self.inp = device, names, None, None

    def get(self, shape: HeadShape) -> Inputs:
        key = (shape.name, shape.n_tokens)
        if key != self.key:
            self.inp = None
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
            names = [n for n in self.names if n in names_for(shape, self.device)]
            self.inp = build_inputs(shape, self.device, names)
            self.key = key
        return self.inp


def is_target(shape: HeadShape, mode: str, device: str) -> bool:
    return [shape.name, shape.n_tokens, mode] in target_cases(device)


def is_cpu_target(shape: HeadShape, mode: str) -> bool:
    t, m = shapes.TARGETS["cpu"]
    return (shape.name, shape.n_tokens, mode) == (t.name, t.n_tokens, m)


def add_subprocess_memory(records: list, shape: HeadShape, mode: str) -> None:
    """CPU target: re-measure providers 1 and 3 in fresh processes (the numbers the target uses)."""
    for rec in records:
        if rec["provider"] in ("seed-fp32", "lm_head-torch"):
            rec["peak_extra_bytes_subprocess"] = probe_memory_subprocess(shape, mode, rec["provider"])


def target_cases(device: str, smoke: bool = False) -> list:
    """[shape name, N, mode] of the cases a target is stated on (RESULTS.md details them)."""
    if smoke:
        return [[shapes.SMOKE[0].name, shapes.SMOKE[0].n_tokens, "all"]]
    if device == "cpu":
        s, m = shapes.TARGETS["cpu"]
        return [[s.name, s.n_tokens, m]]
    s, modes = shapes.TARGETS["cuda"]
    return [[s.name, s.n_tokens, m] for m in (*modes, "all")]


def payload(device: str, records: list, verdicts: H.Verdicts, env: dict, smoke: bool = False, **extra) -> dict:
    return {"benchmark": "lm_head", "environment": env, "providers": PROVIDERS,
            "target_cases": target_cases(device, smoke), "smoke": smoke,
            "modes": {m: {k: (str(v) if k == "out_dtype" else v) for k, v in s.items()} for m, s in MODES.items()},
            "targets": verdicts.lines, "records": records, **extra}


def run_suite(device: str, out_dir: Path, budget_s: float, smoke: bool = False) -> dict:
    env = H.environment(device)
    names = providers_for(device, smoke)
    cache = InputCache(device, names)
    records, skipped, t0 = [], [], time.perf_counter()
    for shape, mode in suite(device, smoke):
        if time.perf_counter() - t0 > budget_s:
            skipped.append(f"{shape.name} N={shape.n_tokens} {mode}")
            continue
        inp = cache.get(shape)
        recs, _ = run_case(inp, mode, names_for(shape, device, smoke), rounds=(1, 2) if smoke else None)
        if device == "cpu" and not smoke and is_cpu_target(shape, mode):
            add_subprocess_memory(recs, shape, mode)
        records += recs
        _print_case(recs)
        if out_dir is not None:  # after every case: a run killed by a timeout keeps its results
            partial = payload(device, records, H.Verdicts(), env, smoke=smoke, partial=True,
                              wall_s=time.perf_counter() - t0)
            H.write_json(Path(out_dir) / f"{_result_name(device, smoke)}.json", partial)
    verdicts = evaluate_targets(records, device, smoke)
    if skipped:
        print(f"time budget {budget_s:.0f} s reached; skipped {len(skipped)} cases: {skipped}")
    out = payload(device, records, verdicts, env, smoke=smoke, skipped=skipped,
                  wall_s=time.perf_counter() - t0)
    if out_dir is not None:
        path = H.write_json(Path(out_dir) / f"{_result_name(device, smoke)}.json", out)
        print(f"wrote {path}")
    return out


def _result_name(device: str, smoke: bool) -> str:
    return "lm_head-smoke" if smoke else f"lm_head-{device}"


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

try:
    import pytest
except ImportError:  # script mode on a machine without pytest
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
        verdicts = evaluate_targets(state["records"], _DEVICE)
        out_dir = Path(os.environ.get("EAGLE_FAST_BENCH_OUT", H.RESULTS_DIR))
        H.write_json(out_dir / f"lm_head-{_DEVICE}.json",
                     payload(_DEVICE, state["records"], verdicts, state["env"],
                             wall_s=time.perf_counter() - state["t0"], skipped=[]))

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
        errors = [f"{r['provider']}: {r['status']}" for r in recs if r["status"].startswith("error")]
        assert not errors, errors
        # A fast wrong head must not be benchmarked as if it were right.
        for name, c in check.items():
            if name.startswith("lm_head") and "argmax_agree" in c:
                assert c["argmax_agree"] >= MIN_ARGMAX_AGREE, (name, c)


# --------------------------------------------------------------------------- script


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", type=Path, default=None,
                    help="results directory (default bench/results; with --smoke a temp dir)")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="stop starting new cases after this many seconds (targets run first)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, every provider, seconds")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        _probe_main(args.probe)
        return 0
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_lm_head: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "eagle_fast-bench-smoke" if args.smoke else H.RESULTS_DIR
    out = run_suite(device, args.out, args.budget_s, smoke=args.smoke)
    failed = [t for t in out["targets"] if t["result"] == "FAIL"]
    errors = [r for r in out["records"] if r["status"].startswith("error")]
    return 1 if (errors or (failed and not args.smoke)) else 0


if __name__ == "__main__":
    sys.exit(main())
