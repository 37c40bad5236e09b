"""The head benchmark's cases: what is measured and how one case is measured.

What it does
    The output modes (`MODES`), the providers (`PROVIDERS`: the seed's fp32 path, plain torch,
    the PyTorch and Triton heads, the bare GEMM), their inputs with a planted top token per row
    (`build_inputs`), one (shape, mode) timed side by side with its cross-check and the PyTorch
    head's phases (`run_case`), and which cases run on a device, target cases first (`suite`).

Limits
    Rounds per case are fixed per device (`ROUNDS`); `bench_lm_head.py` runs the cases, writes
    the results and judges them (`lm_head_goals.py`).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import _floor
import _harness as H
import shapes
import torch
import torch.nn.functional as F
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
    "lm_head-triton-before": "4b the same with the kernel before issue 29 (bench/triton_before)",
    "lm_head-triton-persistent": "4c the same with the persistent TMA-fed kernel (lse / argmax / draft "
                                 "modes; the others run the tiled one)",
    "gemm-floor": "5 bare GEMM y @ W.T, the cheapest PyTorch offers (the floor)",
    "gemm-fp32out": "6 bare GEMM y @ W.T, fp32 out (beside a bf16-output floor)",
}
FLOOR_ONLY = ("gemm-fp32out",)  # run in the floor cases only
CUDA_ONLY = ("lm_head-triton", "lm_head-triton-before", "lm_head-triton-persistent")
TRITON_HEADS = CUDA_ONLY
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
    fp32out: _floor.BareGemm | None = None  # the fp32-output GEMM beside a bf16-output floor

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
    if "gemm-fp32out" in providers:
        inp.fp32out = _floor.BareGemm(_norm32(inp).to(dtype), weight, device, fp32_out=True)
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

    def lm_head_impl(impl, kernel=None):
        from eagle_fast import kernels

        kw = dict(spec)
        if {"draft", "draft_topk"} & set(kw["outputs"]):
            kw["draft_ids"] = inp.draft_ids
        norm = inp.shape.norm

        def call():
            return kernels.lm_head(inp.hidden, inp.weight, inp.norm_weight, eps=EPS, norm=norm, impl=impl, **kw)

        def call_with():  # the same public call, routed to `kernel` (the frozen old one, ..)
            own, kernels._triton_impl = kernels._triton_impl, lambda: kernel
            try:
                return call()
            finally:
                kernels._triton_impl = own
        return call if kernel is None else call_with

    def triton_before():
        from triton_before.lm_head_triton import lm_head_triton as before  # bench/ on sys.path

        return lm_head_impl("triton", before)

    def triton_persistent():
        from eagle_fast.kernels.lm_head_triton import lm_head_triton

        return lm_head_impl("triton", lambda req: lm_head_triton(req, kernel="persistent"))

    table = {
        "seed-fp32": seed_fp32,
        "torch-native": torch_native,
        "lm_head-torch": lambda: lm_head_impl("torch"),
        "lm_head-triton": lambda: lm_head_impl("triton"),
        "lm_head-triton-before": triton_before,
        "lm_head-triton-persistent": triton_persistent,
        "gemm-floor": inp.floor,
        "gemm-fp32out": inp.fp32out,
    }
    out = {}
    for n in names:
        if n in ("lm_head-torch", *TRITON_HEADS):
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
    names = list(PROVIDERS) if device == "cuda" or smoke else [p for p in PROVIDERS if p not in CUDA_ONLY]
    if not _floor.has_fp32_out_beside(device, torch.bfloat16):  # the floor is fp32-out already
        names.remove("gemm-fp32out")
    return names


def is_floor_case(shape: HeadShape) -> bool:
    return any((shape.name, shape.n_tokens) == (s.name, s.n_tokens) for s in shapes.FLOOR_SHAPES)


def names_for(shape: HeadShape, device: str, smoke: bool = False) -> list[str]:
    """Providers of one case: the floor cases run the floor and the head only."""
    names = providers_for(device, smoke)
    if is_floor_case(shape):
        heads = TRITON_HEADS if device == "cuda" else ("lm_head-torch",)
        return [n for n in names if n in ("gemm-floor", "gemm-fp32out", *heads)]
    return [n for n in names if n not in FLOOR_ONLY]


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
        if name in ("gemm-floor", "gemm-fp32out"):
            rec["floor_kind"] = _floor.floor_kind(device, inp.weight.dtype, name == "gemm-fp32out")
        if name == "lm_head-torch" and phase_s is not None:
            rec["phases_s"], rec["phases_by"] = phase_s, "torch.profiler"
        rec.update(check.get(name, {}))
        if name.startswith("lm_head") and rec.get("argmax_agree", 1.0) < MIN_ARGMAX_AGREE:
            rec["status"] = (f"error: wrong result: argmax agrees with seed-fp32 on only "
                             f"{rec['argmax_agree']:.4f} of rows")
        records.append(rec)
    return records, check


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


def target_cases(device: str, smoke: bool = False) -> list:
    """[shape name, N, mode] of the cases a target is stated on (RESULTS.md details them)."""
    if smoke:
        return [[shapes.SMOKE[0].name, shapes.SMOKE[0].n_tokens, "all"]]
    if device == "cpu":
        s, m = shapes.TARGETS["cpu"]
        return [[s.name, s.n_tokens, m]]
    s, modes = shapes.TARGETS["cuda"]
    return [[s.name, s.n_tokens, m] for m in (*modes, "all")]
