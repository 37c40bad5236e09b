"""The floor a head is measured against: the bare GEMM of its shape on this device, and the
head's own time by phase.

What it does
    `BareGemm(y, weight, device)` is the GEMM y @ W.T alone for every logit of the [N, V]
    shape, the cheapest way PyTorch offers on this device:
      CUDA                   bf16 `torch.mm(..., out_dtype=float32)` (tensor cores, fp32 out);
      CPU, AVX512-BF16/AMX   bf16 `torch.mm` with bf16 output (oneDNN in hardware);
      other CPUs             fp32 `torch.mm` on weights upcast once, ahead of time (PyTorch's
                             bf16 GEMM is emulated there, several times slower).
    `BareGemm(..., fp32_out=True)` is the fp32-output GEMM shown beside it where the floor rounds
    to bf16: MKL's bf16 x bf16 -> fp32 GEMM (`_cpu.gemm_bf16_f32`, the exact head's GEMM).
    Operands are prepared outside the timed call (normalised y, the upcast weight, a
    preallocated [N, V] output), so the floor pays for nothing but the multiply and its
    writes: the ratio head / floor is stricter on the head than any fair baseline.
    `phases(fn)` runs fn once under `torch.profiler.profile` and returns the seconds the
    PyTorch head spent in each phase (norm, upcast, gemm, merge, exp, copy-out: the head's
    `record_function` spans, summed by name over every thread; "other" is the rest of the call).

Limits
    On CPU the [N, V] output of the floor is resident while it is measured (2.5 GB bf16 at
    N=8192, V=151,936); the head never holds one. Phases exist for the PyTorch head only
    (the Triton kernel fuses them). Where head groups run on several threads at once, the
    phases add up their threads' time, which can pass the call's wall time.
"""

from __future__ import annotations

import time

import torch
from eagle_fast.kernels import HEAD_PHASES, SPAN_PREFIX
from eagle_fast.kernels._cpu import (
    bf16_gemm_available,
    bf16_gemm_is_native,
    gemm_bf16_f32,
    hardware_isa,
)

PHASES = (*HEAD_PHASES, "other")


def floor_kind(device: str, dtype: torch.dtype = torch.bfloat16, fp32_out: bool = False) -> str:
    """What the floor (or with fp32_out, the GEMM beside it) is on this device, in words."""
    if device == "cuda":
        return "bf16 torch.mm with fp32 output"
    if dtype == torch.bfloat16 and fp32_out and bf16_gemm_available():
        return "MKL bf16 x bf16 -> fp32 GEMM"
    if dtype == torch.bfloat16 and not fp32_out and bf16_gemm_is_native():
        return "bf16 torch.mm, bf16 output (oneDNN, AVX512-BF16/AMX)"
    return "fp32 torch.mm on weights upcast ahead of time"


def floor_isa() -> str:
    """The ISA the CPU floor runs on: `hardware_isa()`, or "AVX2" where bf16 math is emulated
    or capped away (`make bench-avx2`)."""
    return hardware_isa() if bf16_gemm_is_native() else "AVX2"


def has_fp32_out_beside(device: str, dtype: torch.dtype) -> bool:
    """Whether the floor rounds to bf16 here, so that an fp32-output GEMM is shown beside it."""
    return device != "cuda" and dtype == torch.bfloat16 and bf16_gemm_is_native()


class BareGemm:
    """y [N, H] @ weight [V, H].T -> [N, V], operands prepared once (see the header)."""

    def __init__(self, y: torch.Tensor, weight: torch.Tensor, device: str, fp32_out: bool = False):
        self.device = device
        N, V = y.shape[0], weight.shape[0]
        if device == "cuda":
            self.mode = "cuda"
        elif weight.dtype == torch.bfloat16 and fp32_out and bf16_gemm_available():
            self.mode = "mkl"
        elif weight.dtype == torch.bfloat16 and not fp32_out and bf16_gemm_is_native():
            self.mode = "bf16"
        else:
            self.mode = "fp32"
        self.out = None
        if device != "cuda":
            dtype = torch.bfloat16 if self.mode == "bf16" else torch.float32
            self.out = torch.empty(N, V, dtype=dtype, device=y.device)
            self.out.zero_()  # touch every page now: the timed call must not pay for page faults
        if self.mode in ("cuda", "mkl", "bf16"):
            self.y, self.w = y.contiguous(), weight
        else:
            self.y, self.w = y.float().contiguous(), weight.float()

    def __call__(self) -> dict:
        if self.mode == "mkl":
            gemm_bf16_f32(self.y, self.w, self.out)
        elif self.mode == "cuda" and self.y.dtype != torch.float32:
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
