"""The CPU head's compiled draft + argmax walk (`csrc/head_cpu.c`): build, load, call.

What it does
    `draft_argmax(y, weight, draft_ids, ...)` is `lm_head_torch`'s ("draft", "argmax") and
    ("draft", "lse") on CPUs with AMX or AVX512-BF16, in two passes (bf16 products, fp32 sums):
    pass 1 walks the whole vocabulary once and keeps, per token, the argmax, the draft
    logsumexp and (asked for) the full one; pass 2 writes `logit - draft lse` rounded once to
    the output dtype, from the draft logits recomputed (AMX: the same logits, bit for bit) or
    stored by pass 1 (AVX512-BF16: in the fp32 output itself, or a bounded fp32 scratch of a
    group of tokens for a bf16 one). No [N, V] buffer and no fp32 [N, Vd] buffer beside the
    output ever exist.

Design
    PyTorch's fastest CPU GEMM (oneDNN, bf16 output) rounds logits to bf16, and its only
    fp32-output bf16 GEMM (MKL's) runs at the fp32 rate, 2-2.5x slower; a fused kernel with
    fp32 accumulators has neither cost and reduces while the tile is in cache. The C
    source ships in the package and is compiled on first use with the system C compiler (`cc`,
    or $CC) into a per-user cache (`cache_dir()`), keyed by the source, the compiler and the
    flags; `report()` builds it ahead (`make venv` calls it). It links
    nothing but libc (libm, pthreads), so no OpenMP or MKL runtime is shared with torch: the walk starts its own
    threads (torch's per-thread count, so a head pool worker's call runs on one) and keeps no
    state between calls. AMX needs the tile state granted by the kernel (arch_prctl, as oneDNN
    asks for it); that permission is the process's, asked once, and changes nothing else.

Bit-identity
    Every logit is summed in an order fixed by H; the vocabulary is cut into segments fixed by
    V alone, whose per-token statistics are merged in segment order. So a call's bytes are the
    same run to run, for any thread count, and whether pass 2 recomputes or reads the logits.
    They differ from the MKL-based walk's by the fp32 summation order (a few ulps of the
    logits), within the oracle's tolerance, and the two variants from each other likewise.

Variants
    "amx" (TDPBF16PS tiles; the default on CPUs with AMX) and "avx512-bf16" (VDPBF16PS, 16
    accumulators per 8 rows; the default on CPUs with AVX512-BF16 and no AMX such as AMD EPYC
    Zen 4, where it runs at the floor's rate: bench/RESULTS.md); EAGLE_FAST_CPU_NATIVE=
    avx512-bf16 or `variant(...)` picks it on an AMX CPU too. The tests run both variants
    wherever either runs, so both keep their bytes and bounds.

Limits
    AMX or AVX512-BF16 on Linux x86-64, not capped by ISA_CAPS, a C compiler, bf16 weights, H a
    multiple of 32, finite logits provably (||y|| ||w|| < 2^120, from the screen's norm
    bounds); otherwise `serves` is False and the PyTorch path runs.
    EAGLE_FAST_CPU_NATIVE=0 (read at import) turns it off; `switched(on)` overrides that for the
    calls inside a block.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ._common import TensorMemo, scoped
from ._cpu import bf16_gemm_available, hardware_isa, isa_capped

SOURCE = Path(__file__).with_name("csrc") / "head_cpu.c"
FLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu11", "-fno-strict-aliasing", "-pthread")
# EAGLE_FAST_CPU_NATIVE (read at import): 0 off; 1 (default) the CPU's own kernel (AMX where the
# CPU has AMX, AVX512-BF16 where it has AVX512-BF16 and no AMX); avx512-bf16 the AVX512-BF16
# kernel on any CPU with AVX512-BF16, an AMX one too.
_SETTING = os.environ.get("EAGLE_FAST_CPU_NATIVE", "1")
ENABLED = _SETTING != "0"
VARIANT = "avx512-bf16" if _SETTING == "avx512-bf16" else None
VARIANTS = ("amx", "avx512-bf16")
_ENABLED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("native_enabled", default=None)
_VARIANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("native_variant", default=None)

# Vocabulary segments: at most this many, each a multiple of 32 rows (set by V alone).
SEGMENTS = 64
# W rows per chunk (kept in L2 while every token block sweeps it) and packed-y bytes per token
# group (kept in the last-level cache while every chunk sweeps it).
CHUNK_BYTES = 1536 << 10
GROUP_BYTES = 8 << 20
# Pass 2 recomputes the draft logits (AMX: as measured there) or pass 1 stores them (AVX512-BF16:
# pass 2's recompute cost more than its output's bytes on the EPYC).
RECOMPUTES = {"amx": True, "avx512-bf16": False}
# A bf16 output's fp32 scratch: pass 1 stores a group of tokens' draft logits there (32 MiB: 256
# tokens at a 32k draft, so the walk re-reads W once per 256 tokens).
SCRATCH_BYTES = 32 << 20


def switched(on: bool) -> contextlib.AbstractContextManager:
    """The compiled walk on or off for the calls made inside the block (`_common.scoped`)."""
    return scoped(_ENABLED, on)


def variant(name: str) -> contextlib.AbstractContextManager:
    """The kernel variant ("amx" or "avx512-bf16") for the calls made inside the block, whatever
    EAGLE_FAST_CPU_NATIVE says (`_common.scoped`)."""
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {name!r}")
    return scoped(_VARIANT, name)


def cache_dir() -> Path:
    """Where built libraries go: $EAGLE_FAST_NATIVE_CACHE, else $XDG_CACHE_HOME/eagle_fast/native
    (~/.cache/eagle_fast/native)."""
    env = os.environ.get("EAGLE_FAST_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle_fast" / "native"


_BUILD_ERROR: list[str] = []


def build_error() -> str | None:
    """Why `library()` is None (no compiler, a failed build), or None."""
    return _BUILD_ERROR[0] if _BUILD_ERROR else None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _build(cc: str) -> Path:
    """The library for this source, compiler and flags, built once (atomically) per cache."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode()])).hexdigest()[:16]
    path = cache_dir() / f"head_cpu-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              check=False)
        if proc.returncode:
            raise RuntimeError(f"{cc} failed on {SOURCE}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled walk, built on first use; None where it cannot be (see `build_error()`)."""
    cc = _compiler()
    if cc is None:
        _BUILD_ERROR.append(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        _BUILD_ERROR.append(str(exc))
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ef_amx_init.argtypes, lib.ef_amx_init.restype = [], i
    lib.ef_pack_y.argtypes, lib.ef_pack_y.restype = [p, i64, i64, i64, p], None
    lib.ef_draft_argmax.argtypes = [p, i64, i64, i64, p, i64, p, i64, i64, i64, i64, p, p, p, p, p, p, i64, i, i]
    lib.ef_draft_argmax.restype = i
    lib.ef_draft_fix.argtypes = [p, i64, i64, i64, p, p, i64, i, i]
    lib.ef_draft_fix.restype = i
    lib.ef_populate.argtypes, lib.ef_populate.restype = [p, i64, i], i
    lib.ef_draft_out.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, i, i64, i, i]
    lib.ef_draft_out.restype = i
    return lib


def kind() -> str | None:
    """The kernel variant that runs here ("amx", "avx512-bf16"), or None: the one asked for
    (`variant`, else EAGLE_FAST_CPU_NATIVE, else the CPU's own: "amx" on AMX, "avx512-bf16"
    elsewhere), where the CPU has it uncapped and it is built."""
    return _kind(_VARIANT.get() or VARIANT or ("amx" if hardware_isa() == "AMX" else "avx512-bf16"))


@functools.cache
def _kind(name: str) -> str | None:
    isa = hardware_isa()
    if isa_capped() or isa not in ("AMX", "AVX512-BF16") or (name == "amx" and isa != "AMX"):
        return None
    lib = library()
    if lib is None:
        return None
    if name == "amx" and lib.ef_amx_init() != 0:
        _BUILD_ERROR.append("the kernel did not grant the AMX tile state (arch_prctl)")
        return None
    return name


def enabled() -> bool:
    on = _ENABLED.get()
    return ENABLED if on is None else on


def serves(outputs, k: int, weight: torch.Tensor, logit_scale: float = 1.0, softcap=None) -> bool:
    """Whether `lm_head(impl="torch")` hands a call with these settings to the compiled walk (it
    still checks, per call, that the logits are provably finite): "draft" with neither top-k nor
    a full-vocabulary output, a bf16 CPU weight the bf16 GEMM path keeps in bf16 (so the
    activation is bf16 too), H a multiple of 32, no scale or softcap, a variant that runs here."""
    outs = set(outputs)
    return (enabled() and "draft" in outs and not k and not outs & {"logits", "logprobs", "topk", "draft_topk"}
            and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.stride(1) == 1
            and 0 < weight.shape[1] and weight.shape[1] % 32 == 0 and weight.shape[0] < 2**31
            and logit_scale == 1.0 and softcap is None and bf16_gemm_available() and kind() is not None)


def draft_argmax(y: torch.Tensor, weight: torch.Tensor, draft_ids: torch.Tensor, y_norm: torch.Tensor,
                 w_norm_max: float, threads: int | None = None, lse: bool = False,
                 out_dtype: torch.dtype = torch.float32, recompute: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """`(draft_logprobs [N, Vd] out_dtype, argmax int64 [N], lse fp32 [N] or None)`, or None
    (nothing done) where the logits are not provably finite.

    y bf16 [N, H] contiguous (the normalised activation); weight bf16 [V, H]; draft_ids sorted
    int64 [Vd], Vd >= 1; y_norm fp32 [N] and w_norm_max upper bounds on the row norms
    (`_torch_screen.norm_upper`). `lse`: the full-vocabulary logsumexp too (an exp of every
    logit, in the same pass). The draft log-probs are the fp32 draft logits minus their
    logsumexp, rounded once to out_dtype. threads: torch's count for the calling thread by
    default; the bytes do not depend on it. `recompute`: pass 2 recomputes the draft logits
    (True) or pass 1 stores them (False); the same bytes either way; None: the variant's way
    (`RECOMPUTES`). RuntimeError where `kind()` is None.
    """
    which = kind()
    if which is None:
        raise RuntimeError(f"draft_argmax: {report()}")
    amx = which == "amx"
    recompute = RECOMPUTES[which] if recompute is None else recompute
    N, H = y.shape
    Vd = draft_ids.numel()
    y_max = float(y_norm.max())
    if not (math.isfinite(y_max) and math.isfinite(w_norm_max) and y_max * w_norm_max < 2.0**120):
        return None
    lib = library()
    threads = threads or torch.get_num_threads()
    yp = torch.empty(_round_up(N, 16) // 16 * (H // 32) * 256, dtype=torch.int32)
    lib.ef_pack_y(y.data_ptr(), N, H, y.stride(0), yp.data_ptr())
    ids = draft_ids.to(torch.int64).contiguous()
    direct = out_dtype in (torch.float32, torch.bfloat16)
    if recompute:
        # pass 1: argmax, draft lse (and the full lse) over the whole vocabulary
        argmax, draft_lse, full_lse = _pass1(weight, yp, 0, N, ids, lse, None, threads, amx)
        del yp  # before pass 2's output exists
        # pass 2: the draft columns again, minus their lse, rounded once, written row by row
        wdp = packed_draft(weight, ids)
        out = empty_huge((N, Vd), out_dtype if direct else torch.float32)
        cols = max(32, min(_round_up(Vd, 32), CHUNK_BYTES // (2 * H) // 32 * 32))
        rc = lib.ef_draft_out(y.data_ptr(), y.stride(0), N, H, wdp.data_ptr(), Vd, draft_lse.data_ptr(),
                              out.data_ptr(), out.stride(0), int(out_dtype == torch.bfloat16), cols, threads,
                              int(amx))
        if rc == -2:
            raise MemoryError("the compiled head walk (pass 2) ran out of memory for its scratch")
        return (out if direct else out.to(out_dtype)), argmax, full_lse
    # pass 1 stores the draft logits where pass 2 finds them: in the fp32 output itself, or, for
    # a bf16 output, in an fp32 scratch of a group of tokens at a time (SCRATCH_BYTES). The
    # output's pages are taken up front, in 4 KiB pages: on the EPYC (a VM whose host takes freed
    # memory back) huge pages (`empty_huge`) cost a fresh output several times what 4 KiB pages
    # do, and faulting them one at a time inside the walk cost more than one pass ahead.
    out = torch.empty(N, Vd, dtype=out_dtype if direct else torch.float32)
    lib.ef_populate(out.data_ptr(), out.numel() * out.element_size(), threads)
    bf16 = out.dtype == torch.bfloat16
    rows = max(32, SCRATCH_BYTES // (4 * Vd) // 32 * 32) if bf16 else N
    scratch = torch.empty(min(rows, N), Vd) if bf16 else out
    if bf16:
        lib.ef_populate(scratch.data_ptr(), scratch.numel() * 4, threads)
    argmax = torch.empty(N, dtype=torch.int64)
    full_lse = torch.empty(N) if lse else None
    for t0 in range(0, N, rows):
        n = min(rows, N - t0)
        logits = scratch if bf16 else out[t0:]
        got = _pass1(weight, yp, t0, n, ids, lse, logits, threads, amx)
        argmax[t0:t0 + n] = got[0]
        if lse:
            full_lse[t0:t0 + n] = got[2]
        # pass 2: the stored logits minus their lse, rounded once
        lib.ef_draft_fix(logits.data_ptr(), Vd, n, Vd, got[1].data_ptr(), out[t0:].data_ptr(), Vd, int(bf16),
                         threads)
    return (out if direct else out.to(out_dtype)), argmax, full_lse


def _pass1(weight: torch.Tensor, yp: torch.Tensor, t0: int, n: int, ids: torch.Tensor, lse: bool,
           logits: torch.Tensor | None, threads: int, amx: bool):
    """Pass 1 over tokens [t0, t0 + n) of the packed y (t0 a multiple of 32): `(argmax int64 [n],
    draft lse fp32 [n], full lse fp32 [n] or None)`; with `logits` (fp32 [n, Vd] rows, contiguous
    from its first), their draft logits stored there."""
    V, H = weight.shape
    seg = _round_up(_round_up(V, SEGMENTS) // SEGMENTS, 32)
    nseg = _round_up(V, seg) // seg
    chunk = max(32, min(seg, CHUNK_BYTES // (2 * H) // 32 * 32))
    group = max(32, GROUP_BYTES // (2 * H) // 32 * 32)
    n_pad = _round_up(n, 32)
    best = torch.full((nseg, n_pad), -math.inf)
    dmax = torch.full((nseg, n_pad), -math.inf)
    arg = torch.zeros(nseg, n_pad, dtype=torch.int32)
    dsum = torch.zeros(nseg, n_pad, dtype=torch.float64)
    asum = torch.zeros(nseg, n_pad, dtype=torch.float64) if lse else None
    rc = library().ef_draft_argmax(
        weight.data_ptr(), weight.stride(0), V, H, yp.data_ptr() + t0 // 16 * (H // 32) * 256 * 4, n, ids.data_ptr(),
        ids.numel(), seg, chunk, group, best.data_ptr(), arg.data_ptr(), dmax.data_ptr(), dsum.data_ptr(),
        None if asum is None else asum.data_ptr(), None if logits is None else logits.data_ptr(),
        0 if logits is None else logits.stride(0), threads, int(amx))
    if rc == -2:
        raise MemoryError("the compiled head walk (pass 1) ran out of memory for its scratch")
    best, arg, dmax, dsum = best[:, :n], arg[:, :n], dmax[:, :n], dsum[:, :n]
    # Merge the segments in order: the first segment holding the max has the lowest id.
    top = best.max(0).values
    first = torch.where(best == top, torch.arange(nseg)[:, None], nseg).min(0).values
    argmax = arg.gather(0, first[None]).squeeze(0).long()
    full_lse = None if asum is None else _merged_lse(best, asum[:, :n])
    return argmax, _merged_lse(dmax, dsum), full_lse


# The draft rows of the weights walked lately, packed for pass 2 (bf16, Vd x H: a fifth of the
# weight at a 32k draft of 152k ids); repacking them per call cost more than pass 2 itself at a
# few hundred tokens (supervision's groups).
_PACKS = TensorMemo(2)


def packed_draft(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] in pass 2's operand layout (`ef_pack_y`, zero-padded to 32 rows), made once
    per (weight, ids) and again after either changes."""
    def make():
        vd, h = ids.numel(), weight.shape[1]
        packed = torch.zeros(_round_up(vd, 32) // 16 * (h // 32) * 256, dtype=torch.int32)
        rows = weight.index_select(0, ids)
        library().ef_pack_y(rows.data_ptr(), vd, h, rows.stride(0), packed.data_ptr())
        return packed

    return _PACKS.get((weight, ids), make)


def _merged_lse(maxima: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """fp32 [N]: log(sum_s sums[s] exp(maxima[s] - M)) + M, M the max over segments s, taken in
    segment order (elementwise: the same bytes for any thread count)."""
    m = maxima.max(0).values.double()
    total = torch.zeros_like(m)
    for s in range(maxima.shape[0]):
        total += sums[s] * torch.exp(maxima[s].double() - m)
    return (m + torch.log(total)).float()


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


@functools.cache
def _madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty, with transparent huge pages asked for the buffer's own range where it is
    large (first touch of a fresh GB costs 2.4x more in 4 KiB pages here); advice on this
    range only, gone when it is freed, and a no-op where THP is off."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    fn = _madvise()
    if fn is not None and nbytes >= 8 * _HUGE:
        start = (out.data_ptr() + _HUGE - 1) // _HUGE * _HUGE
        end = (out.data_ptr() + nbytes) // _HUGE * _HUGE
        if end > start:
            fn(start, end - start, _MADV_HUGEPAGE)
    return out


def report() -> str:
    """One line: whether the compiled walk runs here, and why not (builds it where it can)."""
    library()
    if kind():
        return f"compiled head walk: {kind()}"
    why = build_error()
    if hardware_isa() not in ("AMX", "AVX512-BF16"):
        why = f"it needs AMX or AVX512-BF16; this CPU has {hardware_isa()}"
    elif isa_capped():
        why = f"{hardware_isa()} is capped here (kernels._cpu.ISA_CAPS)"
    elif why is None:
        why = f"the {_VARIANT.get() or VARIANT} kernel needs AMX; this CPU has {hardware_isa()}"
    return f"compiled head walk: not used ({why})"
