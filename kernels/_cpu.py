"""Which CPU the head runs on: its widest math ISA, and whether it is capped to AVX2.

The CPU head's speed (and which baseline is fastest) depends on the ISA: with AVX512-BF16/AMX
PyTorch's bf16 GEMM runs in hardware through oneDNN; on AVX2 it is emulated and the fp32 GEMM
is the fast one. Results are the same on both within the oracle's tolerance (see reference.py,
"Bit-identity"). `make test-avx2` sets ISA_CAPS to run torch, oneDNN and MKL as an AVX2-only
CPU would; vLLM's own kernels pick their ISA from the hardware and are not capped.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# Environment switches that cap torch's kernels, oneDNN and MKL to AVX2. They are read when each
# library loads, so they must be set before the process starts (the Makefile does).
ISA_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

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


def cpu_model() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor", "AMD EPYC 7B13", ...)."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set((_cpuinfo_field("flags") or "").split())


def hardware_isa() -> str:
    """The widest math ISA the hardware has: "AMX", "AVX512-BF16", "AVX512", "AVX2" or "other"."""
    flags = cpu_flags()
    return next((name for flag, name in _ISA_BY_FLAG if flag in flags), "other")


def isa_capped() -> bool:
    """Whether any ISA_CAPS switch is set in this process's environment."""
    return any(os.environ.get(name) for name in ISA_CAPS)


def cpu_isa() -> str:
    """`hardware_isa()`, with the caps in force when any is set ("AMX, capped (...)")."""
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    isa = hardware_isa()
    return f"{isa}, capped ({' '.join(caps)})" if caps else isa


def bf16_gemm_is_native() -> bool:
    """Whether PyTorch's bf16 CPU GEMM runs in hardware here (AVX512-BF16/AMX, uncapped)."""
    return hardware_isa() in ("AMX", "AVX512-BF16") and not isa_capped()
