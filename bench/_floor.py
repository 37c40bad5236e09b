"""The floor a head is measured against: the bare GEMM of its shape on this device, and the
head's own time by phase.

What it does
    `BareGemm(y, weight, device)` is the GEMM y @ W.T alone, fp32 results for every logit of
    the [N, V] shape, in the fastest exact way this device has:
      CUDA                   bf16 `torch.mm(..., out_dtype=float32)` (tensor cores, fp32 out);
      CPU, AVX512-BF16/AMX   MKL's `cblas_gemm_bf16bf16f32` (the bf16-mode GEMM the head uses);
      other CPUs             fp32 `torch.mm` on weights upcast once, ahead of time.
    Its operands are prepared outside the timed call (normalised y, the upcast weight, a
    preallocated [N, V] output), so the floor pays for nothing but the multiply and its
    writes: the ratio head / floor is stricter on the head than any fair baseline.
    `phases(fn)` runs fn once under `torch.profiler.profile` and returns the seconds the
    PyTorch head spent in each phase (norm, upcast, gemm, merge, exp, copy-out: the head's
    `record_function` spans, summed by name over every thread; "other" is the rest of the call).

Limits
    On CPU the [N, V] fp32 output of the floor is resident while it is measured (5 GB at
    N=8192, V=151,936); the head never holds one. Phases exist for the PyTorch head only
    (the Triton kernel fuses them). Where head groups run on several threads at once, the
    phases add up their threads' time, which can pass the call's wall time.
"""

from __future__ import annotations

import time

import torch
from eagle_fast.kernels import HEAD_PHASES, SPAN_PREFIX
from eagle_fast.kernels._cpu import bf16_gemm_available, gemm_bf16_f32

PHASES = (*HEAD_PHASES, "other")


def floor_kind(device: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """What the floor is on this device, in words (for RESULTS.md)."""
    if device == "cuda":
        return "bf16 torch.mm with fp32 output"
    if dtype == torch.bfloat16 and bf16_gemm_available():
        return "MKL bf16 x bf16 -> fp32 GEMM (AVX512-BF16/AMX)"
    return "fp32 torch.mm on weights upcast ahead of time"


class BareGemm:
    """y [N, H] @ weight [V, H].T -> fp32 [N, V], operands prepared once (see the header)."""

    def __init__(self, y: torch.Tensor, weight: torch.Tensor, device: str):
        self.device = device
        N, V = y.shape[0], weight.shape[0]
        self.out = None
        if device != "cuda":
            self.out = torch.empty(N, V, dtype=torch.float32, device=y.device)
            self.out.zero_()  # touch every page now: the timed call must not pay for page faults
        self.mkl = device != "cuda" and weight.dtype == torch.bfloat16 and bf16_gemm_available()
        if device == "cuda" or self.mkl:
            self.y, self.w = y.contiguous(), weight
        else:
            self.y, self.w = y.float().contiguous(), weight.float()

    def __call__(self) -> dict:
        if self.mkl:
            gemm_bf16_f32(self.y, self.w, self.out)
        elif self.device == "cuda" and self.y.dtype != torch.float32:
            # a fresh output: CUDA's caching allocator makes that free, a copy would not be
            try:
                return {"logits": torch.mm(self.y, self.w.t(), out_dtype=torch.float32)}
            except TypeError:  # a torch without mm(out_dtype=): the 16-bit GEMM
                return {"logits": torch.mm(self.y, self.w.t())}
        else:
            torch.mm(self.y, self.w.t(), out=self.out)
        return {"logits": self.out}


def phases(fn, device: str = "cpu") -> tuple[object, dict[str, float]]:
    """(result, seconds per phase) of one call of fn, which calls the PyTorch head, read from
    a `torch.profiler` run: each phase's spans, CPU time (on CUDA the kernels' device time),
    summed. "total" is the call's wall time, or the phases' sum where threads overlap."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    try:  # supervise's pool threads too (a torch without the option profiles this thread only)
        every_thread = {"experimental_config": torch.profiler._ExperimentalConfig(profile_all_threads=True)}
    except TypeError:
        every_thread = {}
    with torch.profiler.profile(activities=activities, **every_thread) as prof:
        t0 = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out = dict.fromkeys(HEAD_PHASES, 0.0)
    for event in prof.events():
        name = event.name.removeprefix(SPAN_PREFIX)
        if event.name.startswith(SPAN_PREFIX) and name in out:
            out[name] += (event.device_time_total if device == "cuda" else event.cpu_time_total) / 1e6
    out["other"] = max(0.0, wall - sum(out.values()))
    out["total"] = max(wall, sum(out.values()))
    return result, out
