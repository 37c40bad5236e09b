"""Variants and block sizes of the head's Triton kernels, and the opt-in autotuner.

Design: a `Variant` (dtypes and output-mode flags) selects one compiled `lm_head_fwd_kernel`;
`default_config` is the one place its block sizes are chosen, deterministically, with the
reason beside each choice (tests/test_lm_head_aot.py compiles exactly these for sm_90);
`norm_config` does the same for the norm prologue. `fwd_constexprs` turns a variant and a
config into the kernel's meta-parameters, for the launcher and the AOT compiler alike.
`persistent_config` chooses the persistent kernel's (`_triton_persistent`), which runs instead
of the tiled one when EAGLE_FAST_TRITON_VARIANT=persistent (read once, at import: `KERNEL`) or
when a caller asks for it, and only for the modes it covers; the default stays "tiled".
Limits: autotuning runs only with EAGLE_FAST_AUTOTUNE=1 on CUDA, a few configs around the
default, timed once per (V, H, bucketed N, variant) and kept for the process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from triton.testing import do_bench

# Which fused kernel the launcher runs: "tiled" (`lm_head_fwd_kernel`, one program per tile) or
# "persistent" (`lm_head_persistent_kernel`, one program per SM, TMA-fed; the modes it covers).
KERNELS = ("tiled", "persistent")
KERNEL = os.environ.get("EAGLE_FAST_TRITON_VARIANT", "tiled")
if KERNEL not in KERNELS:
    raise ValueError(f"EAGLE_FAST_TRITON_VARIANT={KERNEL!r}: expected one of {KERNELS}")

TL_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Config:
    """Block sizes and launch options of `lm_head_fwd_kernel`."""

    BLOCK_N: int
    BLOCK_V: int
    BLOCK_H: int
    GROUP_SIZE: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Variant:
    """What selects a compiled `lm_head_fwd_kernel`: dtypes and output-mode constexprs."""

    weight: str = "bf16"  # "bf16" | "fp16" | "fp32"
    out: str = "fp32"  # dtype of the logits output
    logits: bool = False
    logprobs: bool = False
    topk: bool = False
    draft: bool = False
    # the top-k over the draft columns ("draft_topk"; never with topk / logits / logprobs)
    draft_topk: bool = False
    softcap: bool = False
    # the full-vocabulary sum exp (lse); False for outputs that need only maxima and the draft
    # columns' own statistics ("draft" / "argmax" / "draft_topk"): the argmax-only epilogue.
    # Top-k and logprobs always sum, whatever this says.
    lse: bool = True
    even_h: bool = True
    # the exact top-k re-run of a first pass with these flags: same tiles (config), only the
    # (row, tile) pairs given a slot, no logits / logprobs / draft stores (nor, for
    # draft_topk, lse sums)
    tile_list: bool = False


def aligned_row(n: int) -> int:
    """Row stride, in elements, of a staging buffer with n fp32 columns: a multiple of 16, so
    every row starts 64-byte aligned and the JIT specialises the stride as divisible by 16."""
    return -(-n // 16) * 16


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_config(variant: Variant, n_rows: int, V: int, H: int, interpret: bool) -> Config:
    """The one place block sizes are chosen (the AOT test compiles exactly these)."""
    if interpret:
        # Programs run one after another and each tl op costs ~30 us of Python whatever
        # the block size: few, big blocks (BLOCK_H covers H up to 256 in one step). Test
        # shapes still get several row blocks and vocab tiles (BLOCK_N=16 and BLOCK_V=512
        # up to N=64 / V=8192, GROUP_SIZE=2), so the cross-tile merges, the top-k re-run and
        # the grouped ordering run under test as on a GPU.
        return Config(
            BLOCK_N=16 if n_rows <= 64 else 64,
            BLOCK_V=512 if V <= 8192 else 1024,
            BLOCK_H=min(256, max(16, next_pow2(H))),
            GROUP_SIZE=2,
            num_warps=4,
            num_stages=1,
        )
    if variant.weight == "fp32":
        # fp32 "ieee" runs on FMA units, not tensor cores: a small tile keeps the fp32
        # operands and accumulator in registers without spilling.
        return Config(64, 64, 32, 8, num_warps=4, num_stages=2)
    # bf16 / fp16. The big tile, 128x256 on two warpgroups (wgmma m64n256k16 each, 128 fp32
    # accumulator registers per thread), has the best GEMM efficiency; 3 stages of
    # (128+256)x64x2 B = 144 KB shared memory. Its epilogue must fit in the other ~127
    # registers, which holds for lse/argmax alone or with softcap, top-k, draft or the draft
    # top-k: 0 B spilled (ptxas 13 / triton 3.9). Heavier epilogues (an [N, V] logits or
    # logprobs store, draft with top-k, draft top-k or softcap, the draft top-k with
    # softcap, top-k with softcap since NaN ranks as +inf: its re-run spilled 216 B at 255
    # registers) spill 8 B-3.4 KB there and still up to 200 B at 128x128 on 8
    # warps; they get 128x128 on 16 warps (4 warpgroups of m64n64,
    # 32 accumulator registers per thread): 0 B spilled, 4 stages = 128 KB. Those modes
    # are not the fast paths (they materialise [N, V] or stack two reductions).
    # tests/test_lm_head_aot.py asserts these numbers for every variant it compiles.
    # BLOCK_H=64: 128-byte rows, full swizzle. GROUP_SIZE=8: 8 row blocks (8 MB of y at
    # H=4096) stay in L2 while the weight streams past them.
    two_reductions = variant.topk or variant.draft_topk
    heavy = (
        variant.logits
        or variant.logprobs
        or (variant.draft and (two_reductions or variant.softcap))
        or ((variant.draft_topk or variant.topk) and variant.softcap)
    )
    if variant.draft and (variant.logits or variant.logprobs):
        # [N, V] stores scattered through the draft-first order: up to 80 B spilled on
        # 128x128 (8 or 16 warps); 64x128 on 8 warps holds them in 140-145 registers
        return Config(64, 128, 64, 8, num_warps=8, num_stages=4)
    if heavy:
        return Config(128, 128, 64, 8, num_warps=16, num_stages=4)
    return Config(128, 256, 64, 8, num_warps=8, num_stages=3)


def persistent_config(variant: Variant, n_rows: int, V: int, H: int, interpret: bool) -> Config:
    """Block sizes of `lm_head_persistent_kernel` (modes: lse / argmax / draft, 16-bit weights)."""
    if interpret:  # as `default_config`, with BLOCK_V=256: more tiles per lane under test
        return Config(16 if n_rows <= 64 else 64, 256, min(256, max(16, next_pow2(H))), 2, 4, 1)
    # GROUP_SIZE=12: 132 SMs = 12 row blocks x 11 lanes, so a group's programs stream 11
    # consecutive weight tiles past 12 row blocks of y (12 MB at H=4096) in L2, and the weight
    # is read from HBM N / 1536 times (5.3 at N=8192; 8 in the tiled kernel's groups of 8).
    # argmax / lse: the tiled kernel's 128x256x64 on two warpgroups (wgmma m64n256k16, 128
    # accumulator registers per thread), 3 stages, 144 KB: 0 B spilled. The draft epilogue
    # (dense stores and an exp pass) and softcap's do not fit beside that accumulator in the
    # persistent loop: every 128x256 variant tried spilled (16 warps, 2-4 stages, per-tile
    # draft statistics, int32 draft offsets), except softcap on 2 stages, which leaves one
    # TMA load in flight. They run 128x128 on the same two warpgroups (m64n128k16, 64
    # accumulator registers), 4 stages = 128 KB: 0 B spilled (ptxas 13; triton 3.9 and 3.6),
    # for ~0.5 more SASS per logit on non-draft tiles (row reductions over half the columns)
    # and ~1/3 more operand bytes per flop from L2. bench/RESULTS-head-gpu.md has the counts.
    if variant.draft or variant.softcap:
        return Config(128, 128, 64, 12, num_warps=8, num_stages=4)
    return replace(default_config(variant, n_rows, V, H, interpret), GROUP_SIZE=12)


def norm_config(H: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps) of the norm prologue. A whole row per block, ~8 fp32
    elements per thread (LayerNorm tutorial); one row per program on a GPU (N programs
    saturate it), 16 under the interpreter (fewer programs, same numpy work)."""
    block_h = max(16, next_pow2(H))
    if interpret:
        return 16, block_h, 4
    return 1, block_h, min(16, max(1, block_h // 256))


def fwd_constexprs(variant: Variant, cfg: Config, interpret: bool) -> dict:
    """The meta-parameters of `lm_head_fwd_kernel` for `variant` under `cfg`."""
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
        "DRAFT_TOPK": variant.draft_topk,
        # draft tiles first: the vocabulary walk of every pass with a draft vocabulary
        "HAS_ORDER": variant.draft or variant.draft_topk,
        "HAS_SOFTCAP": variant.softcap,
        # a draft top-k re-run needs only the draft columns' statistics
        "HAS_LSE": (variant.lse and not (variant.draft_topk and variant.tile_list))
        or variant.topk or variant.logprobs,
        "IS_RERUN": variant.tile_list,
        # fp32 weights: full fp32 products like the reference (tf32 would round operands
        # to 10 mantissa bits); the interpreter always computes in fp32
        "DOT_PRECISION": "ieee" if (interpret or variant.weight == "fp32") else "tf32",
        "INTERPRET": interpret,
    }


# ----------------------------------------------------------------------------- autotuning

_AUTOTUNE_CACHE: dict = {}
# What EAGLE_FAST_AUTOTUNE=1 times besides the default, for 16-bit weights
# (tests/test_lm_head_aot.py compiles each for sm_90).
AUTOTUNE_CONFIGS = tuple(
    Config(bn, bv, 64, group, num_warps=8, num_stages=stages)
    for bn, bv, stages, group in [
        (128, 128, 4, 8),
        (128, 256, 3, 8),
        (128, 256, 4, 8),
        (64, 256, 4, 8),
        (128, 256, 3, 16),
    ]  # 256x128 spilled 80 B on the draft + argmax epilogue: not a candidate
)


def autotune_config(variant: Variant, cfg: Config, key, run) -> Config:
    """EAGLE_FAST_AUTOTUNE=1 on CUDA: time a few configs around the default once per key
    (V, H, bucketed N, variant) and keep the fastest. `run(cfg)` launches one config."""
    if key in _AUTOTUNE_CACHE:
        return _AUTOTUNE_CACHE[key]
    cands = {cfg} | (set(AUTOTUNE_CONFIGS) if variant.weight != "fp32" else set())
    timings, failed = {}, {}
    for c in cands:
        try:
            timings[c] = do_bench(lambda c=c: run(c), warmup=5, rep=20)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the config
            failed[c] = exc
    best = min(timings, key=timings.get) if timings else cfg
    _AUTOTUNE_CACHE[key] = best
    return best
