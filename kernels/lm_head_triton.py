"""The head op in Triton: RMSNorm + LM-head GEMM + on-the-fly vocabulary reductions.

`lm_head_triton(req)` turns final pre-norm hidden states [N, H] into EAGLE-3 supervision
(lse, argmax, top-k, draft-vocab log-probs, optionally logits / logprobs) without ever
materialising an fp32 [N, V] logits buffer. Semantics are those of `reference.lm_head_torch`.

Design
------
1. Prologue `_rms_norm_kernel` (one program per row on a GPU): row statistics in fp32,
   y = norm(x) in the weight dtype (reference.normalize), written as y [N, H]. Chosen over
   applying the norm inside the GEMM's K-loop because y is O(N*H) (64 MB for N=8192,
   H=4096: ~30 us of HBM traffic against a ~13 ms GEMM) and then both GEMM operands go
   straight from global to shared memory through the async-copy pipeline into wgmma; a
   K-loop prologue would route every A tile through registers for the scale-and-round.
   y is rounded exactly as transformers / vLLM round it (twice for Llama-style RMSNorm:
   x * r, then its product with the weight; once for Gemma's (1 + w) form).
2. `_lm_head_fwd_kernel`, one program per [BLOCK_N rows x BLOCK_V vocab] tile, grouped
   ordering (GROUP_SIZE row blocks sweep the vocabulary together, as in the Triton matmul
   tutorial) so a weight tile is fetched from HBM once per group and the group's y rows stay
   in L2. K-loop over H with fp32 accumulation on tensor cores (bf16/fp16 wgmma on Hopper).
   Epilogue on the fp32 tile: scale, softcap (tanh through exp), then per (row, tile):
     - max m_t, sum exp(l - m_t), argmax (ties to the lower id)    -> PartM/PartS/PartArg
     - draft: masked max / sum-exp over draft columns, raw draft logits scattered through
       the t2d map (target id -> draft column or -1) into an fp32 [rows, Vd] buffer
     - top-k: the tile's best `n_rounds` (value, id) pairs by repeated max extraction,
       packed into order-preserving int64 keys (value bits high, 2^31-1-id low, so equal
       values order by lower id and every key is unique)                    -> Cand
     - logits: stored in out_dtype; logprobs: raw fp32 logits staged (see below).
3. Merge on small buffers (torch): lse = logaddexp over tiles, argmax = first tile holding
   the row maximum, top-k = torch.topk over the candidate keys, draft lse likewise.
   The mass outside the top-k (topk_tail) is summed directly: tiles sum exp over their
   non-candidates, the merge adds the candidates that were not selected.
   Exactness of top-k: a tile whose `n_rounds` candidates ALL made the selected top-k may
   hide more (rare: for k=64, n_rounds=8 it needs 9 of a row's top-64 inside one
   BLOCK_V-wide tile). For the rows concerned, the same kernel re-runs just the union of
   their saturated tiles (HAS_TILE_LIST) with n_rounds = min(k, BLOCK_V), their candidates
   replace the first pass's, and the selection is repeated; tiles that were not saturated
   stay provably complete, since the k-th key can only rise. k <= 8 is exact at once.

Scratch bounds (besides the requested outputs and y [N, H]); T = ceil(V / BLOCK_V):
  - partial stats: rows x T x 12 B (+8 B with draft)        (N=8192, V=151,936: 58 MB)
  - top-k candidates: rows x T x n_rounds x 8 B, n_rounds = min(k, 8), plus ~24 B per
    candidate of transients while merging; never a per-(row, tile) top-64. (N=8192,
    V=151,936, k=64: 5 row chunks of <= 256 MB.) The re-run adds, for its rows only,
    min(k, BLOCK_V) candidates per re-run tile, in sub-chunks of the same budget.
  - logprobs / draft_logprobs with a 16-bit out_dtype: an fp32 staging buffer rows x V
    (rows x Vd), so the final value is rounded once from fp32 like the reference.
  Rows are processed in chunks so that the scratch stays under _SCRATCH_BYTES (256 MiB),
  one BLOCK_N row block at least. With out_dtype fp32 the outputs are their own staging.

Grid and tiles on sm_90 (`_default_config`): grid = ceil(rows / BLOCK_N) * ceil(V / BLOCK_V)
programs. bf16/fp16 weights: 128x256 tiles, BLOCK_H=64, 8 warps, 3 stages for the fast
paths (lse/argmax, +softcap, +top-k, +top-k+softcap, +draft); 128x128 tiles on 16 warps,
4 stages for the heavy epilogues (logits / logprobs stores, draft with top-k or softcap).
fp32 weights: 64x64x32 on 4 warps (FMA, not tensor cores).
Measured by tests/test_lm_head_aot.py (ptxas 13 via triton 3.9; asserted there): every
compiled variant 0 B spilled (the top-k bound _TOPK_SPILL_BOUND is 0 B too), 240-255
registers for the 128x256 variants, 64-128 for the 128x128 ones; shared memory 144 KB
(128x256) / 128 KB (128x128) / 16 KB (fp32), within Hopper's 227 KB; wgmma
(m64n256k16 or m64n64k16) for bf16 and fp16.

Interpreter (CPU tensors): the same kernels run through triton's interpreter, switched on
per launch (no TRITON_INTERPRET needed; the @triton.jit objects stay JITFunctions for
ahead-of-time compilation). The interpreter multiplies bf16 bit patterns in tl.dot and
truncates fp32->16-bit casts, so INTERPRET=True upcasts dot operands to fp32 ("ieee") and
rounds to nearest-even with integer bit arithmetic before any 16-bit store.

Limits: V < 2^31 (ids live in 31 bits of a key); fp32 weights use full-precision fp32 FMA
("ieee", no tf32: the reference is full fp32), correct but ~10x slower than bf16 on GPU.
Tunables: EAGLE_FAST_AUTOTUNE=1 times a few configs per (V, H, bucketed N, variant) on CUDA.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._common import HeadOutput, HeadRequest

# Scratch budget per launch (partial stats, top-k candidates and their merge, fp32
# staging). 256 MiB keeps the head's extra memory small next to an 8B model's weights and
# activations while each launch still has thousands of tiles (N=8192, V=151,936: lse/argmax
# and draft in one launch; top-64 in 5 row chunks of 1664 rows, 7722 tiles each).
_SCRATCH_BYTES = 256 << 20
# Top-k candidates kept per (row, tile) in the first pass when k > this: enough that a row
# needs recomputation only if 9 of its top-k share one 128-256 wide vocab tile, cheap enough
# that 8 extraction rounds (~5 ops per element each) cost ~10% of the tile's GEMM at H=4096.
_TOPK_ROUNDS = 8
# Register spills (bytes, ptxas stores + loads) allowed for top-k variants, which keep the
# fp32 tile live through the extraction loop. Measured 0 B for every top-k variant with
# the default configs (ptxas 13, triton 3.9); asserted by tests/test_lm_head_aot.py, as is
# 0 B for all other variants.
_TOPK_SPILL_BOUND = 0
# candidate slot that holds nothing (tile exhausted); below every real key
_KEY_NONE_INT = -(2**63)
_KEY_NONE = tl.constexpr(_KEY_NONE_INT)


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _tanh(x):
    # tanh through exp (no libdevice: the interpreter cannot run it); exp(-2|x|) <= 1 never
    # overflows.
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -th, th)


@triton.jit
def _round_rne(x, DST: tl.constexpr):
    # INTERPRETER ONLY. Returns fp32 holding x rounded to nearest-even in DST, so the
    # interpreter's truncating fp32->DST cast that follows is exact.
    if DST == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
        x = b.to(tl.float32, bitcast=True)
    elif DST == tl.float16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + (0xFFF + ((b >> 13) & 1))) & -8192
        normal = b.to(tl.float32, bitcast=True)
        # below 2^-14 fp16 is subnormal with a fixed step 2^-24 = ulp of fp32 in [0.5, 1)
        sub = (x + 0.75) - 0.75
        sub = tl.where(sub == 0.0, x * 0.0, sub)  # keep the sign of values that round to 0
        x = tl.where((tl.abs(x) < 6.103515625e-05) & (x != 0.0), sub, normal)  # keeps -0.0
        x = tl.where(x > 65504.0, float("inf"), tl.where(x < -65504.0, float("-inf"), x))
    return x


@triton.jit
def _pack_key(val, ids):
    # Order-preserving int64 key: fp32 bits mapped to a monotone int32 in the high half,
    # 2^31-1-id in the low half (equal values: lower id = larger key). -inf = no candidate.
    val = tl.where(val == 0.0, 0.0, val)  # -0.0 and +0.0 tie, as they compare equal
    bits = val.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)
    return tl.where(val == float("-inf"), _KEY_NONE, key)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _rms_norm_kernel(
    # pointers
    X_ptr,  # [N, H] hidden, bf16 | fp16 | fp32
    NW_ptr,  # [H] norm weight (unused when NORM_MODE == 0)
    Y_ptr,  # [N, H] output, weight dtype
    # sizes
    N,
    H,
    # strides
    stride_xm,
    stride_ym,
    # scalars
    eps,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # next power of two >= H: a whole row in one block
    NORM_MODE: tl.constexpr,  # 0 none (cast only), 1 rms, 2 rms_one_plus (Gemma)
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK_H)
    mask = (rows < N)[:, None] & (offs < H)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X_ptr + rows64[:, None] * stride_xm + offs[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if NORM_MODE != 0:
        ms = tl.where(rows < N, tl.sum(x * x, axis=1) / H, 1.0)  # padding rows: no 1/0
        # IEEE sqrt and division (not rsqrt.approx): the reference computes 1/sqrt in fp32
        r = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.math.sqrt_rn(ms + eps))
        w = tl.load(NW_ptr + offs, mask=offs < H, other=0.0)
        if NORM_MODE == 2:
            # Gemma: (x * r) * (1 + w) in fp32, rounded once below.
            x = (x * r[:, None]) * (1.0 + w.to(tl.float32))[None, :]
        else:
            # Llama/Qwen (transformers and vLLM): round x * r to the weight dtype, then
            # multiply by the weight in that dtype (rounded again below).
            x = x * r[:, None]
            if INTERPRET:
                x = _round_rne(x, Y_ptr.dtype.element_ty)
                w = _round_rne(w.to(tl.float32), Y_ptr.dtype.element_ty)
            x = x.to(Y_ptr.dtype.element_ty).to(tl.float32)
            x = x * w.to(Y_ptr.dtype.element_ty).to(tl.float32)[None, :]
    if INTERPRET:
        x = _round_rne(x, Y_ptr.dtype.element_ty)
    tl.store(
        Y_ptr + rows64[:, None] * stride_ym + offs[None, :], x.to(Y_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _lm_head_fwd_kernel(
    # pointers
    Y_ptr,  # [N, H] normalised activations, weight dtype
    W_ptr,  # [V, H] LM-head weight (row stride stride_wv, unit column stride)
    Logits_ptr,  # [N, V] out_dtype                         (HAS_LOGITS)
    Stage_ptr,  # [N, V] fp32 raw logits for logprobs       (HAS_LOGPROBS)
    PartM_ptr,  # [N, T] fp32 per-tile max
    PartS_ptr,  # [N, T] fp32 per-tile sum exp(l - max) (top-k: over non-candidates)
    PartArg_ptr,  # [N, T] int32 per-tile argmax (global id)
    Cand_ptr,  # [N, T, n_rounds] int64 top-k candidate keys (HAS_TOPK)
    T2D_ptr,  # [V] int32 draft column of each target id, -1 if none (HAS_DRAFT)
    Draft_ptr,  # [N, Vd] fp32 raw draft logits             (HAS_DRAFT)
    PartDM_ptr,  # [N, T] fp32 per-tile max over draft columns (HAS_DRAFT)
    PartDS_ptr,  # [N, T] fp32 per-tile draft sum exp       (HAS_DRAFT)
    Tiles_ptr,  # [T] int32 vocab tiles to compute          (HAS_TILE_LIST)
    # sizes
    N,
    V,
    H,
    n_vtiles,  # vocab tiles this launch covers (T): ceil(V / BLOCK_V), or the list's length
    n_rounds,  # top-k candidates per (row, tile)
    # strides (rows; every inner stride is 1)
    stride_ym,
    stride_wv,
    stride_lm,
    stride_sm,
    stride_pm,
    stride_cm,
    stride_dm,
    # scalars
    logit_scale,
    softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    EVEN_H: tl.constexpr,  # H % BLOCK_H == 0: no K-edge masks
    HAS_LOGITS: tl.constexpr,
    HAS_LOGPROBS: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_DRAFT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TILE_LIST: tl.constexpr,  # top-k re-run on listed tiles only (position -> tile id)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 weights (and the interpreter)
    INTERPRET: tl.constexpr,  # fp32 dot operands + RNE before 16-bit stores
):
    # ---- grouped program ordering: GROUP_SIZE row blocks walk the vocab tiles together
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_v = n_vtiles
    num_pid_in_group = GROUP_SIZE * num_pid_v
    group_id = pid // num_pid_in_group
    first_pid_n = group_id * GROUP_SIZE
    group_rows = tl.minimum(num_pid_n - first_pid_n, GROUP_SIZE)
    pid_n = first_pid_n + ((pid % num_pid_in_group) % group_rows)
    pid_v = (pid % num_pid_in_group) // group_rows  # column of the partial buffers
    if HAS_TILE_LIST:
        tile = tl.load(Tiles_ptr + pid_v)
    else:
        tile = pid_v

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = cols < V
    # loads wrap ragged edges onto valid rows / ids (no load masks); results there are
    # masked out below
    rows_ld = (rows % N).to(tl.int64)
    cols_ld = (cols % V).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    y_ptrs = Y_ptr + rows_ld[:, None] * stride_ym + offs_h[None, :]
    w_ptrs = W_ptr + cols_ld[:, None] * stride_wv + offs_h[None, :]

    # ---- GEMM: acc[n, v] = sum_h y[n, h] * w[v, h], fp32 accumulation
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        if EVEN_H:
            y = tl.load(y_ptrs)
            w = tl.load(w_ptrs)
        else:
            h_mask = (offs_h + h0) < H
            y = tl.load(y_ptrs, mask=h_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=h_mask[None, :], other=0.0)
        if INTERPRET:
            y = y.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(y, tl.trans(w), acc, input_precision=DOT_PRECISION)
        y_ptrs += BLOCK_H
        w_ptrs += BLOCK_H

    # ---- epilogue: logits of this tile in fp32
    logits = acc * logit_scale
    if HAS_SOFTCAP:
        logits = softcap * _tanh(logits / softcap)
    rows64 = rows.to(tl.int64)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if HAS_LOGITS:
        out = logits
        if INTERPRET:
            out = _round_rne(out, Logits_ptr.dtype.element_ty)
        l_ptrs = Logits_ptr + rows64[:, None] * stride_lm + cols[None, :]
        tl.store(l_ptrs, out.to(Logits_ptr.dtype.element_ty), mask=out_mask)
    if HAS_LOGPROBS:
        tl.store(Stage_ptr + rows64[:, None] * stride_sm + cols[None, :], logits, mask=out_mask)
    logits = tl.where(col_mask[None, :], logits, float("-inf"))

    # ---- per (row, tile) statistics: max and argmax (lowest id among maxima)
    local = tl.arange(0, BLOCK_V)
    m = tl.max(logits, axis=1)
    arg = tl.min(tl.where(logits == m[:, None], local[None, :], BLOCK_V), axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf -> sums of 0, not NaN
    p_off = rows64 * stride_pm + pid_v
    tl.store(PartM_ptr + p_off, m, mask=row_mask)
    tl.store(PartArg_ptr + p_off, tile * BLOCK_V + arg, mask=row_mask)
    if not HAS_TOPK:  # here, so the tile can die after the draft step (register pressure)
        s = tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        tl.store(PartS_ptr + p_off, s, mask=row_mask)

    # ---- draft vocabulary: scatter raw logits, partial max / sum exp over draft columns
    if HAS_DRAFT:
        dcol = tl.load(T2D_ptr + cols, mask=col_mask, other=-1)
        is_draft = dcol >= 0
        d_ptrs = Draft_ptr + rows64[:, None] * stride_dm + dcol[None, :]
        tl.store(d_ptrs, logits, mask=row_mask[:, None] & is_draft[None, :])
        dl = tl.where(is_draft[None, :], logits, float("-inf"))
        dm = tl.max(dl, axis=1)
        dm_safe = tl.where(dm == float("-inf"), 0.0, dm)
        ds = tl.sum(tl.exp(dl - dm_safe[:, None]), axis=1)
        tl.store(PartDM_ptr + p_off, dm, mask=row_mask)
        tl.store(PartDS_ptr + p_off, ds, mask=row_mask)

    # ---- top-k candidates: the tile's best n_rounds (value, id) by max extraction; the
    # sum exp then covers only the rest of the tile, so the merge sums the mass outside
    # the top-k directly (no 1 - sum(top-k) cancellation)
    if HAS_TOPK:
        c_ptrs = Cand_ptr + rows64 * stride_cm + pid_v * n_rounds
        best = m
        best_arg = arg
        for r in range(n_rounds):
            if r > 0:
                best = tl.max(logits, axis=1)
                best_arg = tl.min(
                    tl.where(logits == best[:, None], local[None, :], BLOCK_V), axis=1
                )
            tl.store(c_ptrs + r, _pack_key(best, tile * BLOCK_V + best_arg), mask=row_mask)
            logits = tl.where(local[None, :] == best_arg[:, None], float("-inf"), logits)
        s = tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        tl.store(PartS_ptr + p_off, s, mask=row_mask)


# ----------------------------------------------------------------------------- variants


_TL_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class _Config:
    """Block sizes and launch options of `_lm_head_fwd_kernel`."""

    BLOCK_N: int
    BLOCK_V: int
    BLOCK_H: int
    GROUP_SIZE: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class _Variant:
    """What selects a compiled `_lm_head_fwd_kernel`: dtypes and output-mode constexprs."""

    weight: str = "bf16"  # "bf16" | "fp16" | "fp32"
    out: str = "fp32"  # dtype of the logits output
    logits: bool = False
    logprobs: bool = False
    topk: bool = False
    draft: bool = False
    softcap: bool = False
    even_h: bool = True
    # the exact top-k re-run of a first pass with these flags: same tiles (config), listed
    # vocab tiles only, no logits / logprobs / draft stores
    tile_list: bool = False


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _default_config(variant: _Variant, n_rows: int, V: int, H: int, interpret: bool) -> _Config:
    """The one place block sizes are chosen (the AOT test compiles exactly these)."""
    if interpret:
        # Programs run one after another and each tl op costs ~30 us of Python whatever
        # the block size: few, big blocks (BLOCK_H covers H up to 256 in one step). Test
        # shapes still get several row blocks and vocab tiles (BLOCK_N=16 and BLOCK_V=512
        # up to N=64 / V=8192, GROUP_SIZE=2), so the cross-tile merges, the top-k re-run and
        # the grouped ordering run under test as on a GPU.
        return _Config(
            BLOCK_N=16 if n_rows <= 64 else 64,
            BLOCK_V=512 if V <= 8192 else 1024,
            BLOCK_H=min(256, max(16, _next_pow2(H))),
            GROUP_SIZE=2,
            num_warps=4,
            num_stages=1,
        )
    if variant.weight == "fp32":
        # fp32 "ieee" runs on FMA units, not tensor cores: a small tile keeps the fp32
        # operands and accumulator in registers without spilling.
        return _Config(64, 64, 32, 8, num_warps=4, num_stages=2)
    # bf16 / fp16. The big tile, 128x256 on two warpgroups (wgmma m64n256k16 each, 128 fp32
    # accumulator registers per thread), has the best GEMM efficiency; 3 stages of
    # (128+256)x64x2 B = 144 KB shared memory. Its epilogue must fit in the other ~127
    # registers, which holds for lse/argmax alone or with softcap, top-k, top-k+softcap or
    # draft: 0 B spilled (ptxas 13 / triton 3.9). Heavier epilogues (an [N, V] logits or
    # logprobs store, draft with top-k or softcap) spill 8 B-3.4 KB there and still up to
    # 200 B at 128x128 on 8 warps; they get 128x128 on 16 warps (4 warpgroups of m64n64,
    # 32 accumulator registers per thread): 0 B spilled, 4 stages = 128 KB. Those modes
    # are not the fast paths (they materialise [N, V] or stack two reductions).
    # tests/test_lm_head_aot.py asserts these numbers for every variant it compiles.
    # BLOCK_H=64: 128-byte rows, full swizzle. GROUP_SIZE=8: 8 row blocks (8 MB of y at
    # H=4096) stay in L2 while the weight streams past them.
    heavy = (
        variant.logits or variant.logprobs or (variant.draft and (variant.topk or variant.softcap))
    )
    if heavy:
        return _Config(128, 128, 64, 8, num_warps=16, num_stages=4)
    return _Config(128, 256, 64, 8, num_warps=8, num_stages=3)


def _fwd_constexprs(variant: _Variant, cfg: _Config, interpret: bool) -> dict:
    return {
        "BLOCK_N": cfg.BLOCK_N,
        "BLOCK_V": cfg.BLOCK_V,
        "BLOCK_H": cfg.BLOCK_H,
        "GROUP_SIZE": cfg.GROUP_SIZE,
        "EVEN_H": variant.even_h,
        "HAS_LOGITS": variant.logits and not variant.tile_list,
        "HAS_LOGPROBS": variant.logprobs and not variant.tile_list,
        "HAS_TOPK": variant.topk,
        "HAS_DRAFT": variant.draft and not variant.tile_list,
        "HAS_SOFTCAP": variant.softcap,
        "HAS_TILE_LIST": variant.tile_list,
        # fp32 weights: full fp32 products like the reference (tf32 would round operands
        # to 10 mantissa bits); the interpreter always computes in fp32
        "DOT_PRECISION": "ieee" if (interpret or variant.weight == "fp32") else "tf32",
        "INTERPRET": interpret,
    }


def _fwd_signature(variant: _Variant) -> dict:
    w = "*" + variant.weight
    ptrs = {
        "Y_ptr": w,
        "W_ptr": w,
        "Logits_ptr": "*" + (variant.out if variant.logits and not variant.tile_list else "fp32"),
        "Stage_ptr": "*fp32",
        "PartM_ptr": "*fp32",
        "PartS_ptr": "*fp32",
        "PartArg_ptr": "*i32",
        "Cand_ptr": "*i64",
        "T2D_ptr": "*i32",
        "Draft_ptr": "*fp32",
        "PartDM_ptr": "*fp32",
        "PartDS_ptr": "*fp32",
        "Tiles_ptr": "*i32",
    }
    ints = dict.fromkeys(
        ["N", "V", "H", "n_vtiles", "n_rounds", "stride_ym", "stride_wv", "stride_lm", "stride_sm",
         "stride_pm", "stride_cm", "stride_dm"], "i32",
    )  # fmt: skip
    return {**ptrs, **ints, "logit_scale": "fp32", "softcap": "fp32"}


def _aot_variants() -> list[tuple[str, _Variant]]:
    """The variants tests/test_lm_head_aot.py compiles for sm_90: all 32 output-mode
    combinations for bf16 weights (both block configs), plus fp16 / fp32 weights, other
    logits dtypes and a ragged H. Named for test ids."""
    everything = {"logits": True, "logprobs": True, "topk": True, "draft": True, "softcap": True}
    out = []
    for logits, logprobs, topk, draft, softcap in itertools.product((False, True), repeat=5):
        v = _Variant(out="bf16" if logits else "fp32", logits=logits, logprobs=logprobs,
                     topk=topk, draft=draft, softcap=softcap)  # fmt: skip
        flags = [n for n in ("logits", "logprobs", "topk", "draft", "softcap") if getattr(v, n)]
        out.append(("bf16-" + ("-".join(flags) or "lse-argmax"), v))
        if topk:  # its exact top-k re-run (same tiles; compiles to one of 4 distinct kernels)
            out.append(("bf16-" + "-".join(flags) + "-rerun", replace(v, tile_list=True)))
    out += [
        ("bf16-logits-fp32", _Variant(logits=True, out="fp32")),
        ("bf16-ragged-h", _Variant(even_h=False)),
        ("fp16-lse-argmax", _Variant(weight="fp16")),
        ("fp16-logits-fp16", _Variant(weight="fp16", logits=True, out="fp16")),
        ("fp16-topk-draft", _Variant(weight="fp16", topk=True, draft=True)),
        ("fp16-topk-rerun", _Variant(weight="fp16", topk=True, tile_list=True)),
        ("fp32-lse-argmax", _Variant(weight="fp32")),
        ("fp32-everything", _Variant(weight="fp32", **everything)),
        ("fp32-everything-rerun", _Variant(weight="fp32", **everything, tile_list=True)),
    ]
    return out


def compile_for(target, variant: _Variant, n_rows: int = 8192, V: int = 151_936, H: int = 4096):
    """Compile `_lm_head_fwd_kernel` ahead of time with the launcher's own config for
    (n_rows, V, H); returns (compiled kernel, config). Needs no GPU."""
    from triton.compiler import ASTSource

    cfg = _default_config(variant, n_rows, V, H, interpret=False)
    sig = _fwd_signature(variant)
    constexprs = _fwd_constexprs(variant, cfg, interpret=False)
    names = _lm_head_fwd_kernel.arg_names
    for name in constexprs:
        sig[name] = "constexpr"
    sig = {name: sig[name] for name in names}
    # what the JIT would specialise for these sizes: 16-byte aligned pointers, and ints
    # that are multiples of 16 (V=151,936, H=4096, N=8192 and their strides are)
    values = {"N": n_rows, "V": V, "H": H, "stride_ym": H, "stride_wv": H}
    values.update(stride_lm=V, stride_sm=V)
    attrs = {}
    for i, name in enumerate(names):
        if sig[name].startswith("*") or (name in values and values[name] % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=_lm_head_fwd_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=target, options=opts), cfg


def compile_norm_for(target, hidden: str, weight: str, norm_mode: int, H: int = 4096):
    """Compile `_rms_norm_kernel` ahead of time as the launcher launches it on a GPU."""
    from triton.compiler import ASTSource

    block_m, block_h, num_warps = _norm_config(H, interpret=False)
    constexprs = {
        "BLOCK_M": block_m,
        "BLOCK_H": block_h,
        "NORM_MODE": norm_mode,
        "INTERPRET": False,
    }
    sig = {"X_ptr": "*" + hidden, "NW_ptr": "*" + hidden, "Y_ptr": "*" + weight}
    sig.update(dict.fromkeys(["N", "H", "stride_xm", "stride_ym"], "i32"), eps="fp32")
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    sig = {name: sig[name] for name in _rms_norm_kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    src = ASTSource(fn=_rms_norm_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": 1}
    return triton.compile(src, target=target, options=opts)


def _norm_config(H: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps) of the norm prologue. A whole row per block, ~8 fp32
    elements per thread (LayerNorm tutorial); one row per program on a GPU (N programs
    saturate it), 16 under the interpreter (fewer programs, same numpy work)."""
    block_h = max(16, _next_pow2(H))
    if interpret:
        return 16, block_h, 4
    return 1, block_h, min(16, max(1, block_h // 256))


# ----------------------------------------------------------------------------- interpreter

_INTERP_LOCK = threading.Lock()


@functools.cache
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


_INTERP_SCOPES: dict = {}  # id(module globals) -> language patch scope, during one launch


def _call_interpreted(self, *args, **kwargs):
    # Stands in for JITFunction.__call__ (which only raises) while a kernel is interpreted:
    # runs the callee interpreted. InterpretedFunction.__call__ would re-patch
    # triton.language on every call of tl.sum / tl.max (~6 ms each); patch once per callee
    # module per launch instead (restored by _run_kernel).
    from triton.runtime import interpreter

    interp = _interpreted(self.fn)
    rewrite = getattr(interp, "rewrite", None)
    patch = getattr(interpreter, "_patch_lang", None)
    if rewrite is None or patch is None:  # other triton internals: the plain slow path
        return interp(*args, **kwargs)
    key = id(self.fn.__globals__)
    if key not in _INTERP_SCOPES:
        _INTERP_SCOPES[key] = patch(self.fn)
    return rewrite()(*args, **kwargs)


def _prepatch_interpreter(kernel) -> None:
    from triton.language import standard
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None:  # other triton internals: InterpretedFunction patches per call itself
        return
    for fn in (getattr(kernel, "fn", kernel), standard.max.fn):
        key = id(fn.__globals__)
        if key not in _INTERP_SCOPES:
            _INTERP_SCOPES[key] = patch(fn)


def _run_kernel(kernel, grid, interpret: bool, *args, **kwargs):
    """Launch `kernel[grid](...)`, compiled, or in triton's interpreter when `interpret`.

    triton picks interpreter-or-compiler when @triton.jit runs (TRITON_INTERPRET at import),
    for our kernels and for triton.language's own jit functions (tl.sum, tl.max, tl.cdiv).
    Per launch instead: run an InterpretedFunction of the kernel's Python function and,
    for the launch only, let JITFunction.__call__ (otherwise 'Cannot call @triton.jit'd
    outside of the scope of a kernel') run the callee interpreted too. The JITFunction
    objects stay as they are for the compiler and the AOT path."""
    if not interpret:
        kernel[grid](*args, **kwargs)
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    fn = kernel if isinstance(kernel, InterpretedFunction) else _interpreted(kernel.fn)
    with _INTERP_LOCK:  # the interpreter patches triton.language while it runs
        saved = JITFunction.__call__
        JITFunction.__call__ = _call_interpreted
        try:
            # Patch the language for our module and for triton.language.standard (tl.max,
            # tl.sum, ...) BEFORE the launch: the launch's own patch then nests inside ours and
            # is undone first, and ours (undone in the finally) restores the true originals.
            # Patched lazily inside the launch instead, our scopes would record the launch's
            # patched attributes as "originals" and leave triton.language patched afterwards,
            # breaking every later compilation in the process.
            _prepatch_interpreter(kernel)
            fn[grid](*args, **kwargs)
        finally:
            JITFunction.__call__ = saved
            for scope in reversed(list(_INTERP_SCOPES.values())):
                if scope is not None:
                    scope.restore()
            _INTERP_SCOPES.clear()


# ----------------------------------------------------------------------------- launcher


def _normalize(req: HeadRequest, interpret: bool) -> torch.Tensor:
    """y = norm(hidden) in the weight dtype, rounded as reference.normalize, [N, H] contiguous."""
    hidden, weight = req.hidden, req.weight
    if req.norm == "none" and hidden.dtype == weight.dtype:
        return hidden
    N, H = hidden.shape
    y = torch.empty((N, H), dtype=weight.dtype, device=hidden.device)
    nw = req.norm_weight if req.norm_weight is not None else hidden  # dummy when unused
    mode = {"none": 0, "rms": 1, "rms_one_plus": 2}[req.norm]
    block_m, block_h, num_warps = _norm_config(H, interpret)
    _run_kernel(
        _rms_norm_kernel, (triton.cdiv(N, block_m),), interpret,
        hidden, nw, y, N, H, hidden.stride(0), y.stride(0), float(req.eps),
        BLOCK_M=block_m, BLOCK_H=block_h, NORM_MODE=mode, INTERPRET=interpret, num_warps=num_warps,
    )  # fmt: skip
    return y


@dataclass
class _Scratch:
    """Per-launch scratch for R rows and T vocab tiles (see the header for the bound)."""

    part_m: torch.Tensor  # [R, T] fp32
    part_s: torch.Tensor  # [R, T] fp32
    part_arg: torch.Tensor  # [R, T] int32
    cand: torch.Tensor  # [R, T, n_rounds] int64 (top-k) or a 1-element dummy
    part_dm: torch.Tensor  # [R, T] fp32 (draft) or dummy
    part_ds: torch.Tensor  # [R, T] fp32 (draft) or dummy

    @staticmethod
    def alloc(rows: int, T: int, n_rounds: int, draft: bool, device) -> _Scratch:
        f32 = {"dtype": torch.float32, "device": device}
        dummy = torch.empty(1, **f32)
        return _Scratch(
            part_m=torch.empty((rows, T), **f32),
            part_s=torch.empty((rows, T), **f32),
            part_arg=torch.empty((rows, T), dtype=torch.int32, device=device),
            cand=torch.empty(
                (rows, T, n_rounds) if n_rounds else (1,), dtype=torch.int64, device=device
            ),
            part_dm=torch.empty((rows, T), **f32) if draft else dummy,
            part_ds=torch.empty((rows, T), **f32) if draft else dummy,
        )

    @staticmethod
    def bytes_per_row(T: int, n_rounds: int, draft: bool) -> int:
        # a top-k candidate: its 8 B key plus up to ~24 B of transients in _merge_topk
        return T * (12 + (8 if draft else 0) + 32 * n_rounds)


_AUTOTUNE_CACHE: dict = {}


def _autotune_config(variant: _Variant, cfg: _Config, key, run) -> _Config:
    """EAGLE_FAST_AUTOTUNE=1 on CUDA: time a few configs around the default once per key
    (V, H, bucketed N, variant) and keep the fastest. `run(cfg)` launches one config."""
    if key in _AUTOTUNE_CACHE:
        return _AUTOTUNE_CACHE[key]
    from triton.testing import do_bench

    cands = {cfg}
    if variant.weight != "fp32":
        for bn, bv, stages, group in [
            (128, 128, 4, 8),
            (128, 256, 3, 8),
            (128, 256, 4, 8),
            (64, 256, 4, 8),
            (128, 256, 3, 16),
            (256, 128, 3, 8),
        ]:
            cands.add(_Config(bn, bv, 64, group, num_warps=8, num_stages=stages))
    timings, failed = {}, {}
    for c in cands:
        try:
            timings[c] = do_bench(lambda c=c: run(c), warmup=5, rep=20)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the config
            failed[c] = exc
    best = min(timings, key=timings.get) if timings else cfg
    _AUTOTUNE_CACHE[key] = best
    return best


def lm_head_triton(req: HeadRequest) -> HeadOutput:
    """Fused Triton head. `req` is validated and 2-D (see `_common.HeadRequest`).

    Returns lse fp32 [N], argmax int64 [N] and whatever `req.outputs` asks for, with the
    reference's semantics (module header: algorithm and scratch bounds). CUDA tensors run
    compiled kernels; CPU tensors run the same kernels in triton's interpreter.
    """
    hidden, weight = req.hidden, req.weight
    device = hidden.device
    N, H = hidden.shape
    V = weight.shape[0]
    out_dtype = req.out_dtype

    # ---- 1. check constraints
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"lm_head_triton: unsupported device {device}")
    interpret = device.type != "cuda"
    for name, dt in (("hidden", hidden.dtype), ("weight", weight.dtype), ("out_dtype", out_dtype)):
        if dt not in _TL_NAME:
            raise ValueError(f"lm_head_triton: unsupported {name} dtype {dt}")
    if weight.stride(1) != 1 or not hidden.is_contiguous():
        raise ValueError(
            f"lm_head_triton: needs contiguous hidden {tuple(hidden.shape)} and unit-stride "
            f"weight rows {tuple(weight.shape)} (strides {weight.stride()})"
        )
    if V >= 2**31 - 1:
        raise ValueError(f"lm_head_triton: vocabulary V={V} does not fit 31-bit ids")
    if req.norm_weight is not None and req.norm_weight.dtype not in _TL_NAME:
        raise ValueError(f"lm_head_triton: unsupported norm_weight dtype {req.norm_weight.dtype}")

    # ---- 2. allocate outputs
    f32 = {"dtype": torch.float32, "device": device}
    out = HeadOutput(
        lse=torch.empty(N, **f32), argmax=torch.empty(N, dtype=torch.int64, device=device)
    )
    if req.wants("logits"):
        out.logits = torch.empty((N, V), dtype=out_dtype, device=device)
    if req.wants("logprobs"):
        out.logprobs = torch.empty((N, V), dtype=out_dtype, device=device)
    if req.wants("topk"):
        out.topk_ids = torch.empty((N, req.k), dtype=torch.int64, device=device)
        out.topk_logprobs = torch.empty((N, req.k), dtype=out_dtype, device=device)
        out.topk_tail = torch.empty(N, **f32)
    if req.wants("draft"):
        out.draft_logprobs = torch.empty((N, req.draft_ids.numel()), dtype=out_dtype, device=device)
        out.argmax_in_draft = torch.empty(N, dtype=torch.bool, device=device)
    if N == 0:
        return out

    # ---- 3. launch: norm prologue, then row chunks of the fused GEMM + small merges
    head = _Head(req, out, interpret)
    if interpret:
        head.run()
        return out
    with torch.cuda.device(device):  # triton launches on the current device
        if os.environ.get("EAGLE_FAST_AUTOTUNE") == "1":
            key = (V, H, min(_next_pow2(N), 8192), head.variant)
            head.cfg = _autotune_config(head.variant, head.cfg, key, head.trial)
        head.run()
    return out


class _Head:
    """One `lm_head_triton` call: variant and config, row chunks, launches and merges."""

    def __init__(self, req: HeadRequest, out: HeadOutput, interpret: bool):
        self.req, self.out, self.interpret = req, out, interpret
        self.N, self.H = req.hidden.shape
        self.V = req.weight.shape[0]
        self.device = req.hidden.device
        self.k = req.k if req.wants("topk") else 0
        self.out_f32 = req.out_dtype == torch.float32
        self.variant = _Variant(
            weight=_TL_NAME[req.weight.dtype],
            # the logits pointer is an fp32 dummy when no logits are stored
            out=_TL_NAME[req.out_dtype] if out.logits is not None else "fp32",
            logits=out.logits is not None,
            # fp32 logits requested too: logprobs come from them; otherwise fp32 staging
            logprobs=out.logprobs is not None and not (out.logits is not None and self.out_f32),
            topk=self.k > 0,
            draft=out.draft_logprobs is not None,
            softcap=req.softcap is not None,
        )
        self.cfg = _default_config(self.variant, self.N, self.V, self.H, interpret)
        self.Vd = req.draft_ids.numel() if self.variant.draft else 0
        self.t2d = None
        if self.variant.draft:  # target id -> draft column, -1 outside the draft vocabulary
            self.t2d = torch.full((self.V,), -1, dtype=torch.int32, device=self.device)
            self.t2d[req.draft_ids] = torch.arange(self.Vd, dtype=torch.int32, device=self.device)
        self.y = None

    def _tiles(self, cfg: _Config) -> int:
        return triton.cdiv(self.V, cfg.BLOCK_V)

    def _rounds(self, cfg: _Config, exact: bool) -> int:
        """Top-k candidates per (row, tile): min(k, BLOCK_V) is exact; the first pass keeps
        _TOPK_ROUNDS when k is larger (unless the tiles could not hold k candidates)."""
        if not self.k:
            return 0
        full = min(self.k, cfg.BLOCK_V)
        if exact or full <= _TOPK_ROUNDS or self._tiles(cfg) * _TOPK_ROUNDS < self.k:
            return full
        return _TOPK_ROUNDS

    def _chunk_rows(self, cfg: _Config, per_row: int) -> int:
        bn = cfg.BLOCK_N
        return min(self.N, max(bn, _SCRATCH_BYTES // max(1, per_row) // bn * bn))

    # -- one launch of the fused kernel over the rows of y_rows
    def _launch(
        self, y_rows, cfg, variant, n_rounds, scr, logits=None, stage=None, draft=None, tiles=None
    ):
        R = y_rows.shape[0]
        T = self._tiles(cfg) if tiles is None else tiles.numel()
        w = self.req.weight
        variant = replace(variant, even_h=self.H % cfg.BLOCK_H == 0)
        softcap = self.req.softcap
        _run_kernel(
            _lm_head_fwd_kernel, (triton.cdiv(R, cfg.BLOCK_N) * T,), self.interpret,
            y_rows, w,
            logits if logits is not None else scr.part_m,
            stage if stage is not None else scr.part_m,
            scr.part_m, scr.part_s, scr.part_arg, scr.cand,
            self.t2d if self.t2d is not None else scr.part_arg,
            draft if draft is not None else scr.part_m,
            scr.part_dm, scr.part_ds,
            tiles if tiles is not None else scr.part_arg,
            R, self.V, self.H, T, n_rounds,
            y_rows.stride(0), w.stride(0),
            logits.stride(0) if logits is not None else 0,
            stage.stride(0) if stage is not None else 0,
            T, T * max(1, n_rounds),
            draft.stride(0) if draft is not None else 0,
            float(self.req.logit_scale), float(softcap) if softcap is not None else 1.0,
            **_fwd_constexprs(variant, cfg, self.interpret),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def trial(self, cfg: _Config):
        """Autotune probe: the first-pass kernel on up to 4096 rows, outputs discarded."""
        if self.y is None:
            self.y = _normalize(self.req, self.interpret)
        rows, v, dev = min(self.N, 4096), self.variant, self.device
        n_rounds = self._rounds(cfg, exact=False)
        scr = _Scratch.alloc(rows, self._tiles(cfg), n_rounds, v.draft, dev)
        logits = (
            torch.empty((rows, self.V), dtype=self.req.out_dtype, device=dev) if v.logits else None
        )
        stage = torch.empty((rows, self.V), dtype=torch.float32, device=dev) if v.logprobs else None
        draft = torch.empty((rows, self.Vd), dtype=torch.float32, device=dev) if v.draft else None
        self._launch(self.y[:rows], cfg, v, n_rounds, scr, logits, stage, draft)

    def run(self):
        req, out, v, cfg = self.req, self.out, self.variant, self.cfg
        N, V = self.N, self.V
        if self.y is None:
            self.y = _normalize(req, self.interpret)
        T = self._tiles(cfg)
        n_rounds = self._rounds(cfg, exact=False)
        stage_logprobs = v.logprobs and not self.out_f32
        stage_draft = v.draft and not self.out_f32
        per_row = _Scratch.bytes_per_row(T, n_rounds, v.draft)
        per_row += 4 * V * stage_logprobs + 4 * self.Vd * stage_draft
        chunk = self._chunk_rows(cfg, per_row)
        scr = _Scratch.alloc(chunk, T, n_rounds, v.draft, self.device)
        stage_buf = (
            torch.empty((chunk, V), dtype=torch.float32, device=self.device)
            if stage_logprobs
            else None
        )
        draft_buf = (
            torch.empty((chunk, self.Vd), dtype=torch.float32, device=self.device)
            if stage_draft
            else None
        )
        for r0 in range(0, N, chunk):
            r1 = min(N, r0 + chunk)
            R = r1 - r0
            logits = out.logits[r0:r1] if v.logits else None
            stage = (out.logprobs[r0:r1] if self.out_f32 else stage_buf[:R]) if v.logprobs else None
            draft = (
                (out.draft_logprobs[r0:r1] if self.out_f32 else draft_buf[:R]) if v.draft else None
            )
            self._launch(self.y[r0:r1], cfg, v, n_rounds, scr, logits, stage, draft)

            # -- merges over [R, T] partials
            part_m = scr.part_m[:R]
            best_tile = torch.argmax(part_m, dim=1)  # first tile holding the max: lowest id
            amax = scr.part_arg[:R].gather(1, best_tile[:, None]).squeeze(1).long()
            out.argmax[r0:r1] = amax
            if v.topk:
                cand = scr.cand[:R]
                top, tail, lse = _merge_topk(part_m, scr.part_s[:R], cand.reshape(R, -1), self.k)
                if n_rounds < min(self.k, cfg.BLOCK_V):
                    sat = _saturated_tiles(cand, top[:, self.k - 1 :], V, cfg.BLOCK_V)
                    rows = sat.any(1).nonzero().squeeze(1)  # (a host sync per chunk)
                    if rows.numel():
                        self._redo_topk(r0, rows, sat[rows], scr, top, tail)
                self._write_topk(slice(r0, r1), top, tail, lse)
            else:
                lse = _merge_lse(part_m, scr.part_s[:R])
            out.lse[r0:r1] = lse
            lse32 = out.lse[r0:r1, None]
            if out.logprobs is not None:
                if not v.logprobs:  # derived from the fp32 logits output
                    torch.sub(out.logits[r0:r1], lse32, out=out.logprobs[r0:r1])
                elif self.out_f32:
                    stage.sub_(lse32)
                else:
                    out.logprobs[r0:r1] = stage.sub_(lse32)
            if v.draft:
                dlse = _merge_lse(scr.part_dm[:R], scr.part_ds[:R]).float()
                if self.out_f32:
                    draft.sub_(dlse[:, None])
                else:
                    out.draft_logprobs[r0:r1] = draft.sub_(dlse[:, None])
                out.argmax_in_draft[r0:r1] = self.t2d[amax] >= 0

    def _write_topk(self, rows, top, tail, lse64):
        vals, ids = _unpack_keys(top)
        self.out.topk_ids[rows] = ids
        self.out.topk_logprobs[rows] = (vals.double() - lse64[:, None]).to(self.req.out_dtype)
        self.out.topk_tail[rows] = tail.clamp(0.0, 1.0).float()

    def _redo_topk(self, r0, rows, sat, scr, top, tail):
        """Exact top-k for chunk-local `rows` (whose tiles `sat` [F, T] may hide more top-k
        members): recompute just the union of their flagged vocab tiles with min(k, BLOCK_V)
        candidates each, swap those tiles' candidates and sums in, and select again. The
        other tiles were not saturated against a threshold that can only rise, so the result
        is exact. lse stays the first pass's (logprobs / draft already used it). Updates
        `top` and `tail` in place."""
        cfg, T, k = self.cfg, self._tiles(self.cfg), self.k
        n_exact = self._rounds(cfg, exact=True)
        variant = replace(self.variant, tile_list=True)
        n_tiles = int(sat.any(0).sum())
        per_row = _Scratch.bytes_per_row(n_tiles, n_exact, False) + T * 33 * scr.cand.shape[2]
        chunk = min(rows.numel(), self._chunk_rows(cfg, per_row))
        for i0 in range(0, rows.numel(), chunk):
            idx, sat_i = rows[i0 : i0 + chunk], sat[i0 : i0 + chunk]
            F = idx.numel()
            tiles = sat_i.any(0).nonzero().squeeze(1)
            scr2 = _Scratch.alloc(F, tiles.numel(), n_exact, False, self.device)
            y_rows = self.y.index_select(0, idx + r0)
            self._launch(y_rows, cfg, variant, n_exact, scr2, tiles=tiles.to(torch.int32))
            keys1 = scr.cand[idx]  # [F, T, n] first-pass candidates (a copy)
            keys1[:, tiles, :] = _KEY_NONE_INT
            keys = torch.cat([keys1.reshape(F, -1), scr2.cand[:F].reshape(F, -1)], dim=1)
            part_m, part_s = scr.part_m[idx], scr.part_s[idx]
            part_m[:, tiles] = scr2.part_m[:F]
            part_s[:, tiles] = scr2.part_s[:F]
            top[idx], tail[idx], _ = _merge_topk(part_m, part_s, keys, k)


# ----------------------------------------------------------------------------- merges


def _merge_lse(part_m: torch.Tensor, part_s: torch.Tensor) -> torch.Tensor:
    """logaddexp over tiles, in float64: lse = M + log(sum_t s_t * exp(m_t - M))."""
    M = part_m.amax(dim=1).double()
    M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))  # all -inf: lse = -inf
    total = (part_s.double() * torch.exp(part_m.double() - M[:, None])).sum(1)
    return M + torch.log(total)


def _merge_topk(part_m, part_s, keys, k: int):
    """Top-k, tail mass and lse of each row from per-tile candidates.

    part_m [R, T] tile maxima, part_s [R, T] tile sums exp(l - m_t) over NON-candidates,
    keys [R, C] int64 candidate keys (`_pack_key`, unique; _KEY_NONE for empty slots).
    Returns (top keys [R, k] descending, tail float64 [R], lse float64 [R]). The tail is
    summed directly from the mass outside the top-k (non-candidates + unselected
    candidates), never as 1 - sum(top-k). Transient memory ~20 B per candidate.
    """
    top = torch.topk(keys, k, dim=1, sorted=True).values
    M = part_m.amax(dim=1)
    M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))
    outside = (part_s.double() * torch.exp(part_m.double() - M.double()[:, None])).sum(1)
    mass = _key_values(keys).sub_(M[:, None]).exp_()  # fp32 terms <= 1, summed in float64
    selected = keys >= top[:, k - 1 :]
    inside = torch.where(selected, mass, 0.0).sum(1, dtype=torch.float64)
    mass.masked_fill_(selected.logical_or_(keys == _KEY_NONE_INT), 0.0)
    outside += mass.sum(1, dtype=torch.float64)
    del mass, selected
    total = outside + inside
    return top, outside / total, M.double() + torch.log(total)


def _saturated_tiles(cand, kth, V: int, block_v: int) -> torch.Tensor:
    """[R, T] bool: tile t of row r had all its n candidates selected (key >= the k-th
    selected key `kth` [R, 1]) and holds more than n ids, so it may hide further top-k
    members. Tiles that are not saturated provably hide none."""
    _, T, n = cand.shape
    tile_len = torch.clamp(V - torch.arange(T, device=cand.device) * block_v, max=block_v)
    last = cand[:, :, n - 1]
    return (last >= kth) & (tile_len > n)[None, :] & (last != _KEY_NONE_INT)


def _key_values(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values of `_pack_key` keys (a new tensor). Empty slots decode to NaN."""
    hi = (keys >> 32).to(torch.int32)
    return torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).view(torch.float32)


def _unpack_keys(keys: torch.Tensor):
    """Inverse of `_pack_key`: (fp32 values, int64 ids)."""
    return _key_values(keys), 0x7FFFFFFF - (keys & 0xFFFFFFFF)
