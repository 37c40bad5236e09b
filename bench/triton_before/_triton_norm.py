"""The head's norm prologue in Triton: y = norm(hidden) in the weight dtype, before the GEMM.

Design: one program per row on a GPU (a whole row per block, fp32 statistics), IEEE sqrt
and division like the reference's fp32 1/sqrt; y is rounded exactly as `reference.final_norm`
rounds it (twice for Llama-style RMSNorm: x * r, then its product with the weight; once for
Gemma's (1 + w) form), so `lm_head_fwd_kernel` reads both GEMM operands unchanged.
Limits: a whole row must fit one block (BLOCK_H = next power of two >= H).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from eagle_fast.kernels._common import HeadRequest

from ._triton_config import norm_config
from ._triton_interpret import run_kernel
from ._triton_jit import round_rne


@triton.jit
def rms_norm_kernel(
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
                x = round_rne(x, Y_ptr.dtype.element_ty)
                w = round_rne(w.to(tl.float32), Y_ptr.dtype.element_ty)
            x = x.to(Y_ptr.dtype.element_ty).to(tl.float32)
            x = x * w.to(Y_ptr.dtype.element_ty).to(tl.float32)[None, :]
    if INTERPRET:
        x = round_rne(x, Y_ptr.dtype.element_ty)
    tl.store(
        Y_ptr + rows64[:, None] * stride_ym + offs[None, :], x.to(Y_ptr.dtype.element_ty), mask=mask
    )


def normalize_triton(req: HeadRequest, interpret: bool) -> torch.Tensor:
    """y = norm(hidden) in the weight dtype, rounded as reference.final_norm, [N, H] contiguous."""
    hidden, weight = req.hidden, req.weight
    if req.norm == "none" and hidden.dtype == weight.dtype:
        return hidden
    N, H = hidden.shape
    y = torch.empty((N, H), dtype=weight.dtype, device=hidden.device)
    nw = req.norm_weight if req.norm_weight is not None else hidden  # dummy when unused
    mode = {"none": 0, "rms": 1, "rms_one_plus": 2}[req.norm]
    block_m, block_h, num_warps = norm_config(H, interpret)
    run_kernel(
        rms_norm_kernel, (triton.cdiv(N, block_m),), interpret,
        hidden, nw, y, N, H, hidden.stride(0), y.stride(0), float(req.eps),
        BLOCK_M=block_m, BLOCK_H=block_h, NORM_MODE=mode, INTERPRET=interpret, num_warps=num_warps,
    )  # fmt: skip
    return y
