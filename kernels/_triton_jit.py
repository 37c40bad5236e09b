"""Device helpers of the head's Triton kernels: tanh, round-to-nearest-even, top-k keys.

Design: @triton.jit functions that the kernels in `lm_head_triton.py` inline. tanh goes
through exp and the rounding through integer bit arithmetic, because the interpreter runs
neither libdevice nor a rounding fp32 -> 16-bit cast. A top-k key packs (fp32 value, id)
into one order-preserving int64, so "the k best (value, id) pairs" is a max over keys;
`_triton_merge.unpack_keys` decodes them on the host.
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
def pack_key(val, ids):
    # Order-preserving int64 key: fp32 bits mapped to a monotone int32 in the high half,
    # 2^31-1-id in the low half (equal values: lower id = larger key). -inf = no candidate.
    val = tl.where(val == 0.0, 0.0, val)  # -0.0 and +0.0 tie, as they compare equal
    bits = val.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)
    return tl.where(val == float("-inf"), _KEY_NONE, key)
