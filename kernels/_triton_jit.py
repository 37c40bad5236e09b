"""Device helpers of the head's Triton kernels: tanh, rounding, top-k candidates, draft columns.

Design: @triton.jit functions that the kernels in `lm_head_triton.py` inline. tanh goes
through exp and the rounding through integer bit arithmetic, because the interpreter runs
neither libdevice nor a rounding fp32 -> 16-bit cast. A top-k key packs (fp32 value, id)
into one order-preserving int64, so "the k best (value, id) pairs" is a max over keys;
`_triton_merge.unpack_keys` decodes them on the host. `store_candidates` extracts a tile's
best pairs by repeated max, for the full vocabulary (ids = target ids) and for the draft
columns (ids = draft indices) alike; `draft_tile` is the kernel's extra step on the draft
tiles of the draft-first vocabulary walk (`lm_head_triton.py`).
Limits: ids < 2^31 (31 bits of a key); `round_rne` is for the interpreter only.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A candidate slot that holds nothing (tile exhausted): below every real key.
KEY_NONE = -(2**63)
_KEY_NONE = tl.constexpr(KEY_NONE)


@triton.jit
def tanh(x):
    # exp(-2|x|) <= 1 never overflows
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -th, th)


@triton.jit
def exp_shifted(x, m):
    # exp(x - m[:, None]) as one FMA and one ex2 per element: exp2(x * log2(e) - m * log2(e))
    # (tl.exp also lowers to ex2.approx, after a subtraction and a multiply)
    log2e: tl.constexpr = 1.4426950408889634
    return tl.exp2(x * log2e - (m * log2e)[:, None])


@triton.jit
def round_rne(x, DST: tl.constexpr):
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
def tile_argmax(logits, ids):
    # Row max and argmax (lowest id among maxima) of a [BLOCK_N, BLOCK_V] tile whose columns
    # hold the target ids `ids` [BLOCK_V] (in any order: the draft-first walk puts draft ids
    # first); returns (the tile with NaN as +inf, max, argmax id). NaN ranks as +inf: a
    # backend's max may skip NaN (NVIDIA's max.f32, the interpreter's nanmax) or not, and a
    # NaN max matches no column, so an all-NaN row would have no argmax. With NaN gone, every
    # max below is one of its row's values and every argmax, top-k and draft index stays in
    # the tile. The sums of exp that follow still turn NaN (exp(inf - inf)), so lse and
    # logprobs of such a row are NaN.
    logits = tl.where(logits == logits, logits, float("inf"))  # noqa: PLR0124 (NaN test)
    m = tl.max(logits, axis=1)
    arg = tl.min(tl.where(logits == m[:, None], ids[None, :], 0x7FFFFFFF), axis=1)
    return logits, m, arg


@triton.jit
def tile_stats(logits, ids, p_off, row_mask, PartM_ptr, PartArg_ptr, PartS_ptr, SUM: tl.constexpr):
    # `tile_argmax`, its max and argmax stored at p_off, and with SUM the sum exp(l - max) (0
    # for a row of -inf, not NaN); returns tile_argmax's (tile, max, argmax).
    logits, m, arg = tile_argmax(logits, ids)
    tl.store(PartM_ptr + p_off, m, mask=row_mask)
    tl.store(PartArg_ptr + p_off, arg, mask=row_mask)
    if SUM:
        s = tl.sum(exp_shifted(logits, tl.where(m == float("-inf"), 0.0, m)), axis=1)
        tl.store(PartS_ptr + p_off, s, mask=row_mask)
    return logits, m, arg


@triton.jit
def pack_key(val, ids):
    # Order-preserving int64 key: fp32 bits mapped to a monotone int32 in the high half,
    # 2^31-1-id in the low half (equal values: lower id = larger key). -inf = no candidate.
    val = tl.where(val == 0.0, 0.0, val)  # -0.0 and +0.0 tie, as they compare equal
    bits = val.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)
    return tl.where(val == float("-inf"), _KEY_NONE, key)


@triton.jit
def store_candidates(x, ids, best, best_id, c_ptrs, n_rounds, mask):
    # Store the best n_rounds (value, id) of each row of x [BLOCK_N, BLOCK_V] as keys at
    # c_ptrs + r, ties to the lower id, and return x with them set to -inf (so a sum over the
    # rest is the mass outside the candidates). ids [BLOCK_V] are distinct over the columns
    # that can be picked; best / best_id are round 0's, which the caller has. Rounds past the
    # tile's finite values store KEY_NONE.
    for r in range(n_rounds):
        if r > 0:
            best = tl.max(x, axis=1)
            best_id = tl.min(tl.where(x == best[:, None], ids[None, :], 0x7FFFFFFF), axis=1)
        tl.store(c_ptrs + r, pack_key(best, best_id), mask=mask)
        x = tl.where(ids[None, :] == best_id[:, None], float("-inf"), x)
    return x


@triton.jit
def draft_tile(
    logits, pos, rows64, row_mask, d_off, c_ptrs, n_rounds, Vd,
    Draft_ptr, PartDM_ptr, PartDS_ptr, stride_dm,
    HAS_DRAFT: tl.constexpr, DRAFT_TOPK: tl.constexpr,
):  # fmt: skip
    # The epilogue's extra step on a draft tile of the draft-first walk: vocabulary positions
    # `pos` < Vd are the draft columns, and a draft column's index IS its position, so the
    # raw logits store dense and coalesced (HAS_DRAFT) with no target -> draft lookup. Then
    # `draft_stats`; only the last draft tile masks its other columns, in a branch with
    # stores (one outcome per tile: no per-logit select on the full draft tiles), except with
    # DRAFT_TOPK, whose extraction rounds would be compiled twice (60 B spilled at ragged V).
    is_draft = pos < Vd
    if HAS_DRAFT:
        d_ptrs = Draft_ptr + rows64[:, None] * stride_dm + pos[None, :]
        tl.store(d_ptrs, logits, mask=row_mask[:, None] & is_draft[None, :])
    stats = (row_mask, d_off, c_ptrs, n_rounds, PartDM_ptr, PartDS_ptr, DRAFT_TOPK)
    if DRAFT_TOPK or tl.max(pos, axis=0) >= Vd:  # one copy of the top-k rounds: registers
        draft_stats(tl.where(is_draft[None, :], logits, float("-inf")), pos, *stats)
    else:
        draft_stats(logits, pos, *stats)


@triton.jit
def draft_stats(
    dl, pos, row_mask, d_off, c_ptrs, n_rounds, PartDM_ptr, PartDS_ptr, DRAFT_TOPK: tl.constexpr
):
    # A draft tile's max over its draft columns (the others at -inf) and their sum exp;
    # DRAFT_TOPK first stores their best n_rounds as candidate keys with draft indices (the
    # positions) for ids, so the sum covers the other draft columns.
    dm = tl.max(dl, axis=1)
    dm_safe = tl.where(dm == float("-inf"), 0.0, dm)  # no draft column: sum 0, not NaN
    tl.store(PartDM_ptr + d_off, dm, mask=row_mask)
    if DRAFT_TOPK:
        d_best = tl.min(tl.where(dl == dm[:, None], pos[None, :], 0x7FFFFFFF), axis=1)
        dl = store_candidates(dl, pos, dm, d_best, c_ptrs, n_rounds, row_mask)
    ds = tl.sum(exp_shifted(dl, dm_safe), axis=1)
    tl.store(PartDS_ptr + d_off, ds, mask=row_mask)
