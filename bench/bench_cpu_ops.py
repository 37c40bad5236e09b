"""CPU building blocks of the PyTorch head path, side by side: the numbers its design rests on.

What it does
    Times, interleaved in one process (so machine load hits every variant alike):
      gemm-tile      one [1024 x 256] @ [256 x 1024] tile into an fp32 output from bf16
                     operands: the fp32 GEMM on upcast operands, MKL's bf16 GEMM (the head's
                     where the CPU has bf16 math) and oneDNN's process-global bf16 mode
      reductions     per-row passes over a [1024 x 1024] fp32 tile: max with indices
                     (`torch.max(dim=1)`), `amax`, `argmax`, and the exp pass (sub, exp, sum)
      tile-sweep     `lm_head(outputs=("draft", "argmax"))` at N=6400, H=256, V=151,936 with a
                     32,000-id draft vocabulary, for several [R x C] tile shapes
      call-overhead  the same call at N=64 and N=1024 rows: the fixed cost of one head call
                     (the weight is gathered, upcast and reordered once per call)
      group-parallel `supervise` over 1024 tokens in 128-token groups (the server's): one group
                     at a time on all torch threads vs one group per thread at once, alone and
                     next to another process that keeps one core busy (a client, a loader)
    and writes bench/results/cpu_ops-cpu.json (rendered by report.py).

Limits
    Only meaningful on the CPU it runs on: the bf16 variants need AVX512-BF16/AMX (without it
    oneDNN's mode is the fp32 GEMM and MKL's is not run). Sizes are fixed; ~2-3 minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import _harness as H
import torch
from eagle_fast.kernels._cpu import bf16_gemm_available, bf16_gemm_is_native, gemm_bf16_f32

NAME = "cpu_ops"  # results: cpu_ops-cpu.json

V, DRAFT = 151_936, 32_000
# the last one is the pre-tiling shape: [N, C] tiles of 64 MiB (N = 6400 rows, 2560 columns)
TILES = ((1024, 1024), (256, 4096), (512, 2048), (512, 4096), (1024, 4096), (6400, 2560))


def _interleaved(fns: dict, reps: int) -> dict:
    """Median seconds per variant, the variants called in turn `reps` times after one warm-up."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


@contextlib.contextmanager
def _bf16_math_mode():
    """oneDNN's bf16 math mode for fp32 GEMMs. Process-global: fine in this single-threaded
    bench, and the reason the head itself never sets it."""
    mm = torch.backends.mkldnn.matmul
    previous, mm.fp32_precision = mm.fp32_precision, "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = previous


def gemm_tile(reps: int = 30) -> dict:
    """One [1024 x 256] @ [256 x 1024] -> fp32 tile three ways: the fp32 GEMM on upcast operands
    (with the chunk's upcast, as the head pays it), MKL's bf16 GEMM (what the head runs where
    `bf16_gemm_available()`), and oneDNN's bf16 math mode (the global flag it does not set)."""
    g = torch.Generator().manual_seed(0)
    y16 = torch.randn(1024, 256, generator=g).bfloat16()
    w16 = torch.randn(1024, 256, generator=g).bfloat16()
    y, w32 = y16.float(), torch.empty(1024, 256)
    out = torch.empty(1024, 1024)

    def fp32():
        w32.copy_(w16)
        return torch.mm(y, w32.t(), out=out)

    def bf16_mode():
        with _bf16_math_mode():
            return torch.mm(y, w16.float().t(), out=out)

    variants = {"fp32 (upcast)": fp32, "oneDNN bf16 mode (global)": bf16_mode}
    if bf16_gemm_available():
        variants["MKL bf16 (the head)"] = lambda: gemm_bf16_f32(y16, w16, out)
    t = _interleaved(variants, reps)
    truth = y16.double() @ w16.double().t()
    err = {name: float((fn().double() - truth).abs().max()) for name, fn in variants.items()}
    base = t["fp32 (upcast)"]
    return {"seconds": t, "speedup_vs_fp32": {k: base / v for k, v in t.items()},
            "max_abs_err_vs_fp64": err, "bf16_in_hardware": bf16_gemm_is_native()}


def reductions(reps: int = 30) -> dict:
    tile = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
    m = tile.amax(1, keepdim=True)
    scratch = torch.empty_like(tile)

    def exp_pass():
        torch.sub(tile, m, out=scratch)
        scratch.exp_()
        return scratch.sum(1)

    t = _interleaved({"max(dim) with indices": lambda: torch.max(tile, dim=1),
                      "amax": lambda: torch.amax(tile, dim=1),
                      "argmax": lambda: torch.argmax(tile, dim=1),
                      "sub+exp+sum": exp_pass}, reps)
    return {"seconds": t, "g_elements_per_s": {k: tile.numel() / s / 1e9 for k, s in t.items()}}


def _head_inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, 256, generator=g) * 3).bfloat16()
    weight = (torch.randn(V, 256, generator=g) * 0.05).bfloat16()
    draft = torch.randperm(V, generator=g)[:DRAFT].sort().values
    return hidden, weight, torch.ones(256, dtype=torch.bfloat16), draft


def tile_sweep(reps: int = 2) -> dict:
    from unittest import mock

    from eagle_fast.kernels import lm_head, lm_head_torch

    hidden, weight, norm_w, draft = _head_inputs(6400)

    def call(rows: int, cols: int):
        def fn():
            with mock.patch.object(lm_head_torch, "choose_chunk", lambda *a, **kw: cols), \
                 mock.patch.object(lm_head_torch, "choose_row_block", lambda n, *a, **kw: min(rows, n)):
                lm_head(hidden, weight, norm_w, outputs=("draft", "argmax"), draft_ids=draft, impl="torch")
        return fn

    t = _interleaved({f"{r}x{c}": call(r, c) for r, c in TILES}, reps)
    C = lm_head_torch.choose_chunk(6400, 256, V)
    return {"seconds": t, "default": f"{lm_head_torch.choose_row_block(6400, C)}x{C}", "rows": 6400}


def call_overhead(reps: int = 5) -> dict:
    from eagle_fast.kernels import lm_head

    calls = {}
    for n in (64, 1024):
        hidden, weight, norm_w, draft = _head_inputs(n)
        calls[f"N={n}"] = (lambda h=hidden, w=weight, g=norm_w, d=draft:
                           lm_head(h, w, g, outputs=("draft", "argmax"), draft_ids=d, impl="torch"))
    t = _interleaved(calls, reps)
    # t(N) = fixed + N * per_token through the two points: the cost every call pays whatever
    # its size (streaming and upcasting the weight, per-chunk overhead).
    per_token = (t["N=1024"] - t["N=64"]) / (1024 - 64)
    return {"seconds": t, "per_token_s": {k: s / int(k[2:]) for k, s in t.items()},
            "fixed_s": max(0.0, t["N=64"] - 64 * per_token)}


class _BenchHead:
    """What `supervise` needs of a head, over `_head_inputs`' weights."""

    def __init__(self, weight, norm_w):
        self.weight, self.norm_w = weight, norm_w
        self.vocab_size, self.hidden_size, self.dtype = weight.shape[0], weight.shape[1], weight.dtype

    def compute(self, final, outputs, *, k, draft_ids, out_dtype, impl):
        from eagle_fast.kernels import lm_head

        return lm_head(final, self.weight, self.norm_w, outputs=outputs, k=k, draft_ids=draft_ids,
                       out_dtype=out_dtype, impl=impl)


class _Drop:
    """The server's kind of destination: copies, keeps nothing, groups of `staging_bytes`."""

    copies, keeps, staging_bytes = True, False, 16 << 20

    def put(self, pieces, values):
        values["draft_logprobs"].exp()


def group_parallel(reps: int = 2, tokens: int = 1024) -> dict:
    import subprocess
    from unittest import mock

    from eagle_fast import supervision as SV

    hidden, weight, norm_w, draft = _head_inputs(tokens)
    head = _BenchHead(weight, norm_w)

    def call(parallel: bool):
        def fn():
            with contextlib.ExitStack() as stack:
                if not parallel:
                    stack.enter_context(mock.patch.object(SV, "group_workers", lambda *a: 1))
                SV.supervise(head, [hidden], ("draft",), _Drop(), draft_ids=draft, out_dtype=torch.float32)
        return fn

    variants = {"one group at a time": call(False), "a group per thread": call(True)}
    t = {"alone": _interleaved(variants, reps)}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t["next to a busy process"] = _interleaved(variants, reps)
    finally:
        busy.kill()
        busy.wait()
    return {"seconds": t, "tokens": tokens, "threads": torch.get_num_threads(),
            "speedup": {k: v["one group at a time"] / v["a group per thread"] for k, v in t.items()}}


def run(args) -> dict:
    # No return_freed_memory here: nothing measures memory, and forcing every block over 256 KiB
    # through mmap/munmap would add page faults to each per-chunk allocation.
    t0 = time.perf_counter()
    out = {"benchmark": "cpu_ops", "environment": H.environment("cpu"),
           "gemm_tile": gemm_tile(), "reductions": reductions(), "tile_sweep": tile_sweep(),
           "call_overhead": call_overhead(), "group_parallel": group_parallel()}
    out["wall_s"] = time.perf_counter() - t0
    g = out["gemm_tile"]
    print("  gemm tile 1024x1024x256: " + ", ".join(
        f"{k} {H.fmt_s(v)} ({g['speedup_vs_fp32'][k]:.2f}x)" for k, v in g["seconds"].items()))
    print("  reductions (G elem/s): " + ", ".join(f"{k} {v:.2f}" for k, v in out["reductions"]["g_elements_per_s"].items()))
    print("  tile sweep: " + ", ".join(f"{k} {H.fmt_s(v)}" for k, v in out["tile_sweep"]["seconds"].items())
          + f" (default {out['tile_sweep']['default']})")
    c = out["call_overhead"]
    print("  call: " + ", ".join(f"{k} {H.fmt_s(v)}" for k, v in c["seconds"].items())
          + f" (fixed cost per call {H.fmt_s(c['fixed_s'])})")
    gp = out["group_parallel"]
    print("  supervise groups: " + "; ".join(
        f"{where}: " + ", ".join(f"{k} {H.fmt_s(v)}" for k, v in t.items()) + f" ({gp['speedup'][where]:.2f}x)"
        for where, t in gp["seconds"].items()))
    return out


def verdicts(results: dict) -> H.Verdicts:
    """None: these numbers explain the head's design; no goal is stated on them."""
    return H.Verdicts()


def errors(results: dict) -> list[str]:
    err = max(results["gemm_tile"]["max_abs_err_vs_fp64"].values())
    return [] if err < 1e-3 else [f"gemm tile: max abs error vs float64 {err:.2g} (>= 1e-3)"]


test_cpu_ops = H.pytest_case(__name__)

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
