"""Device helpers of the head's Triton kernels: tanh, rounding, top-k candidates, draft columns.

Design: @triton.jit functions that the kernels in `lm_head_triton.py` inline. tanh goes
through exp and the rounding through integer bit arithmetic, because the interpreter runs
neither libdevice nor a rounding fp32 -> 16-bit cast. A top-k key packs (fp32 value, id)
into one order-preserving int64, so "the k best (value, id) pairs" is a max over keys;
`_triton_merge.unpack_keys` decodes them on the host. `store_candidates` extracts a tile's
best pairs by repeated max, for the full vocabulary (ids = target ids) and for the draft
columns (ids = draft indices) alike; `draft_epilogue` is the kernel's step over a tile's
draft columns.
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
def tile_argmax(logits, local, BLOCK_V: tl.constexpr):
    # Row max and argmax (lowest column among maxima) of a [BLOCK_N, BLOCK_V] tile whose
    # columns are `local` [BLOCK_V]; returns (the tile with NaN as +inf, max, argmax). NaN
    # ranks as +inf: a backend's max may skip NaN (NVIDIA's max.f32, the interpreter's
    # nanmax) or not, and a NaN max matches no column, so an all-NaN row would give the
    # out-of-tile argmax BLOCK_V. With NaN gone, every max below is one of its row's values
    # and every argmax, top-k and draft index stays in the tile. The sums of exp that follow
    # still turn NaN (exp(inf - inf)), so lse and logprobs of such a row are NaN.
    logits = tl.where(logits == logits, logits, float("inf"))  # noqa: PLR0124 (NaN test)
    m = tl.max(logits, axis=1)
    arg = tl.min(tl.where(logits == m[:, None], local[None, :], BLOCK_V), axis=1)
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
def store_candidates(x, ids, best, best_id, c_ptrs, n_rounds, mask, id_base):
    # Store the best n_rounds (value, id_base + id) of each row of x [BLOCK_N, BLOCK_V] as
    # keys at c_ptrs + r, ties to the lower id, and return x with them set to -inf (so a sum
    # over the rest is the mass outside the candidates). ids [BLOCK_V] rise along the tile
    # over the columns that can be picked; best / best_id are round 0's, which the caller
    # has. Rounds past the tile's finite values store KEY_NONE.
    for r in range(n_rounds):
        if r > 0:
            best = tl.max(x, axis=1)
            best_id = tl.min(tl.where(x == best[:, None], ids[None, :], 0x7FFFFFFF), axis=1)
        tl.store(c_ptrs + r, pack_key(best, id_base + best_id), mask=mask)
        x = tl.where(ids[None, :] == best_id[:, None], float("-inf"), x)
    return x


@triton.jit
def draft_epilogue(
    logits, cols, col_mask, rows64, row_mask, p_off, c_ptrs, n_rounds,
    T2D_ptr, Draft_ptr, PartDM_ptr, PartDS_ptr, stride_dm,
    HAS_DRAFT: tl.constexpr, DRAFT_TOPK: tl.constexpr,
):  # fmt: skip
    # The draft columns of a tile (T2D: target id -> draft column, -1 if none): raw logits
    # scattered to Draft (HAS_DRAFT), the tile's max over them and their sum exp. DRAFT_TOPK
    # first stores their best n_rounds as candidate keys with draft indices for ids (rising
    # along the tile, as draft ids are sorted), so the sum covers the other draft columns.
    dcol = tl.load(T2D_ptr + cols, mask=col_mask, other=-1)
    is_draft = dcol >= 0
    if HAS_DRAFT:
        d_ptrs = Draft_ptr + rows64[:, None] * stride_dm + dcol[None, :]
        tl.store(d_ptrs, logits, mask=row_mask[:, None] & is_draft[None, :])
    dl = tl.where(is_draft[None, :], logits, float("-inf"))
    dm = tl.max(dl, axis=1)
    dm_safe = tl.where(dm == float("-inf"), 0.0, dm)  # no draft column: sum 0, not NaN
    tl.store(PartDM_ptr + p_off, dm, mask=row_mask)
    if DRAFT_TOPK:
        dids = tl.where(is_draft, dcol, 0x7FFFFFFF)
        d_best = tl.min(tl.where(dl == dm[:, None], dids[None, :], 0x7FFFFFFF), axis=1)
        dl = store_candidates(dl, dids, dm, d_best, c_ptrs, n_rounds, row_mask, 0)
    ds = tl.sum(tl.exp(dl - dm_safe[:, None]), axis=1)
    tl.store(PartDS_ptr + p_off, ds, mask=row_mask)
