"""The CPU under the head: its ISA, the AVX2 caps, and MKL's bf16 GEMM with fp32 output.

ISA. The CPU head's speed (and which baseline is fastest) depends on it: with AVX512-BF16/AMX,
bf16 GEMMs run in hardware; on AVX2 they are emulated and the fp32 GEMM is the fast one.
Results agree across ISAs within the oracle's tolerance (lm_head_torch.py, "Bit-identity").
`make test-avx2` sets ISA_CAPS to run torch, oneDNN, MKL and this module as an AVX2-only CPU
would; vLLM's own kernels pick their ISA from the hardware and are not capped.

GEMM. PyTorch has no CPU GEMM with bf16 inputs and fp32 output (`mm(..., out_dtype)` is
CUDA-only; oneDNN's bf16 math mode is a process-global flag). MKL has one,
`cblas_gemm_bf16bf16f32` (exact products, fp32 accumulation, fp32 result), and x86 builds of
PyTorch link MKL into libtorch_cpu and export its CBLAS symbols. `gemm_bf16_f32` calls it
through ctypes (the GIL is released during the call), with no state outside the call.
Limits: x86 Linux builds of PyTorch with MKL; elsewhere `bf16_gemm_available()` is False and
the head upcasts to fp32 instead (same math, slower on AMX).

Threads. `one_thread_here()` makes the calling thread's ops single-threaded through OpenMP's and
MKL's per-thread counts. `torch.set_num_threads` would also set process-wide state: the count
every thread that has not run a parallel op yet starts with, and XNNPACK's thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

import torch

# Environment switches that cap torch's kernels, oneDNN and MKL to AVX2, and turn off the head's
# bf16 GEMM (EAGLE_FAST_CPU_BF16_GEMM=0). The libraries read theirs when they load, so they must
# be set before the process starts (the Makefile does).
ISA_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "EAGLE_FAST_CPU_BF16_GEMM": "0"}

_ISA_BY_FLAG = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"),
                ("avx2", "AVX2"))


def _cpuinfo_field(key: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_model() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor", "AMD EPYC 7B13", ...)."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown CPU"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none), read once: every
    head call asks (through `bf16_gemm_available`), and the file is re-read on each open."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def hardware_isa() -> str:
    """The widest math ISA the hardware has: "AMX", "AVX512-BF16", "AVX512", "AVX2" or "other"."""
    flags = cpu_flags()
    return next((name for flag, name in _ISA_BY_FLAG if flag in flags), "other")


def isa_capped() -> bool:
    """Whether any ISA_CAPS switch is set (to anything but "1") in this process's environment."""
    return any(os.environ.get(name, "1") != "1" for name in ISA_CAPS)


def cpu_isa() -> str:
    """`hardware_isa()`, with the caps in force when any is set ("AMX, capped (...)")."""
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name, "1") != "1"]
    isa = hardware_isa()
    return f"{isa}, capped ({' '.join(caps)})" if caps else isa


def bf16_gemm_is_native() -> bool:
    """Whether PyTorch's bf16 CPU GEMM runs in hardware here (AVX512-BF16/AMX, uncapped)."""
    return hardware_isa() in ("AMX", "AVX512-BF16") and not isa_capped()


# CBLAS enums (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_INT_MAX = 2**31 - 1  # LP64 interface: 32-bit sizes and strides


@functools.cache
def _mkl_gemm_bf16bf16f32():
    """MKL's `cblas_gemm_bf16bf16f32` from PyTorch's own libtorch_cpu, or None without it."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        fn = lib.cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    fn.restype = None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    return fn


def bf16_gemm_available() -> bool:
    """Whether `gemm_bf16_f32` runs here, in hardware (AVX512-BF16/AMX, not capped)."""
    return bf16_gemm_is_native() and _mkl_gemm_bf16bf16f32() is not None


def gemm_bf16_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b.T: a bf16 [M, K], b bf16 [N, K], out fp32 [M, N], fp32 accumulation.

    Every operand needs unit stride along its last dim (rows may have any stride, so `out` can
    be a column window of a wider buffer). Products of bf16 values are exact in fp32, so this
    is the fp32 GEMM of the upcast operands without the upcast.
    """
    fn = _mkl_gemm_bf16bf16f32()
    if fn is None:
        raise RuntimeError("MKL's cblas_gemm_bf16bf16f32 is not in this PyTorch build")
    (M, K), (N, K2) = a.shape, b.shape
    if (a.dtype, b.dtype, out.dtype) != (torch.bfloat16, torch.bfloat16, torch.float32):
        raise TypeError(f"gemm_bf16_f32 takes bf16 a, b and fp32 out, got {a.dtype}, {b.dtype}, {out.dtype}")
    if K != K2 or tuple(out.shape) != (M, N):
        raise ValueError(f"gemm_bf16_f32: a {tuple(a.shape)} @ b {tuple(b.shape)}.T -> out {tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.device.type != "cpu" or t.stride(-1) != 1 or t.stride(0) < t.shape[1]:
            raise ValueError(f"gemm_bf16_f32: {name} must be a CPU tensor with unit column stride")
        if max(t.shape[0], t.stride(0)) > _MKL_INT_MAX:
            raise ValueError(f"gemm_bf16_f32: {name} {tuple(t.shape)} exceeds MKL's 32-bit sizes")
    fn(_ROW_MAJOR, _NO_TRANS, _TRANS, M, N, K, 1.0, a.data_ptr(), a.stride(0), b.data_ptr(),
       b.stride(0), 0.0, out.data_ptr(), out.stride(0))
    return out


@functools.cache
def _thread_count_setters():
    """`(omp_set_num_threads, MKL_Set_Num_Threads_Local)` of the OpenMP runtime and the MKL that
    PyTorch uses, or None when ATen's parallel backend is not OpenMP or either is out of reach.
    Both set the calling thread's own count only (OpenMP's nthreads-var ICV belongs to the
    thread's task; MKL's local count overrides its global one in that thread)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
        torch_lib = Path(torch.__file__).parent / "lib"
        runtimes = {line.split()[-1] for line in maps.splitlines()
                    if Path(line.split()[-1]).name.startswith(("libgomp", "libiomp5"))}
        # ATen uses the runtime torch ships beside libtorch_cpu (its RPATH is $ORIGIN); other
        # packages may map their own (sentencepiece bundles a libgomp). Without one in torch's
        # lib dir, a single mapped runtime is ATen's; with several, which one is not known.
        own = {r for r in runtimes if Path(r).parent.resolve() == torch_lib.resolve()}
        runtimes = own or runtimes
        if len(runtimes) != 1:
            return None
        omp_set = ctypes.CDLL(runtimes.pop()).omp_set_num_threads
        mkl_set = ctypes.CDLL(str(torch_lib / "libtorch_cpu.so")).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    omp_set.argtypes, omp_set.restype = [ctypes.c_int], None
    mkl_set.argtypes, mkl_set.restype = [ctypes.c_int], ctypes.c_int
    return omp_set, mkl_set


def per_thread_counts_available() -> bool:
    """Whether `one_thread_here()` can work in this process (nothing is changed by asking)."""
    return _thread_count_setters() is not None


def one_thread_here() -> bool:
    """Run the calling thread's torch ops (ATen's OpenMP loops, MKL, oneDNN) on one thread,
    changing no other thread's count and no process-wide default; for a thread the caller owns
    and ends (a pool worker). Returns False, having changed nothing, where
    `per_thread_counts_available()` is False."""
    setters = _thread_count_setters()
    if setters is None:
        return False
    # torch initialises a thread's counts on its first parallel op, from the process-wide
    # default: that happens here, first, so it cannot undo the counts set below later.
    torch.get_num_threads()
    omp_set, mkl_set = setters
    omp_set(1)
    mkl_set(1)
    return True
