"""Ahead-of-time compilation of the head's Triton kernels, with the launcher's own configs.

Design: `compile_for` / `compile_norm_for` build triton's `ASTSource` route (the only one
that works without a driver) from the same `default_config`, `fwd_constexprs` and
`norm_config` the launcher uses (`compile_persistent_for`: the persistent kernel, its TMA
descriptors typed by block shape), with the specialisation the JIT would apply (16-byte
aligned pointers, ints divisible by 16). `aot_variants` lists what tests/test_lm_head_aot.py
compiles for sm_90, where it asserts wgmma, register spills and shared memory.
Limits: needs no GPU, but does need triton's bundled ptxas for the cubin.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import triton
from triton.compiler import ASTSource

from ._triton_config import (
    Config,
    Variant,
    aligned_row,
    default_config,
    fwd_constexprs,
    norm_config,
    persistent_config,
)
from ._triton_norm import rms_norm_kernel
from ._triton_persistent import lm_head_persistent_kernel, persistent_constexprs
from .lm_head_triton import lm_head_fwd_kernel

# Register spills (bytes, ptxas stores + loads) allowed for top-k variants, which keep the
# fp32 tile live through the extraction loop; tests/test_lm_head_aot.py asserts it, and
# 0 B for all other variants.
TOPK_SPILL_BOUND = 0


def fwd_signature(variant: Variant) -> dict:
    """Argument types of `lm_head_fwd_kernel` for `variant`, constexprs aside."""
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
        "Order_ptr": "*i32",
        "Draft_ptr": "*fp32",
        "PartDM_ptr": "*fp32",
        "PartDS_ptr": "*fp32",
        "Slot_ptr": "*i32",
    }
    ints = dict.fromkeys(
        ["N", "V", "H", "Vd", "n_vtiles", "n_rounds", "stride_ym", "stride_wv", "stride_lm",
         "stride_sm", "stride_pm", "stride_cm", "stride_dm", "stride_dpm"], "i32",
    )  # fmt: skip
    return {**ptrs, **ints, "logit_scale": "fp32", "softcap": "fp32"}


def aot_variants() -> list[tuple[str, Variant]]:
    """The variants tests/test_lm_head_aot.py compiles for sm_90: all 32 output-mode
    combinations for bf16 weights (both block configs), the 8 without top-k / logprobs again
    with the argmax-only epilogue (`lse=False`), the 8 draft top-k ones (with / without lse,
    draft, softcap), plus fp16 / fp32 weights, other logits dtypes and a ragged H. Every
    top-k variant comes with its exact re-run. Named for test ids."""
    everything = {"logits": True, "logprobs": True, "topk": True, "draft": True, "softcap": True}
    dtopk = {"draft_topk": True, "draft": True, "softcap": True}  # the heaviest draft top-k
    out = []
    for logits, logprobs, topk, draft, softcap in itertools.product((False, True), repeat=5):
        v = Variant(out="bf16" if logits else "fp32", logits=logits, logprobs=logprobs,
                     topk=topk, draft=draft, softcap=softcap)  # fmt: skip
        flags = [n for n in ("logits", "logprobs", "topk", "draft", "softcap") if getattr(v, n)]
        out.append(("bf16-" + ("-".join(flags) or "lse-argmax"), v))
        if topk:  # its exact top-k re-run (same tiles; compiles to one of 4 distinct kernels)
            out.append(("bf16-" + "-".join(flags) + "-rerun", replace(v, tile_list=True)))
        if not (topk or logprobs):  # the argmax-only epilogue (no lse): the draft fast path
            name = "bf16-" + "-".join([*flags, "argmax"]) if flags else "bf16-argmax"
            out.append((name + "-nolse", replace(v, lse=False)))
    for draft, softcap, lse in itertools.product((False, True), repeat=3):
        v = Variant(draft_topk=True, draft=draft, softcap=softcap, lse=lse)
        flags = [n for n in ("draft", "softcap", "lse") if getattr(v, n)]
        name = "-".join(["bf16-draft_topk", *flags])
        out += [(name, v), (name + "-rerun", replace(v, tile_list=True))]
    out += [
        ("bf16-logits-fp32", Variant(logits=True, out="fp32")),
        ("bf16-ragged-h", Variant(even_h=False)),
        ("fp16-lse-argmax", Variant(weight="fp16")),
        ("fp16-logits-fp16", Variant(weight="fp16", logits=True, out="fp16")),
        ("fp16-topk-draft", Variant(weight="fp16", topk=True, draft=True)),
        ("fp16-topk-rerun", Variant(weight="fp16", topk=True, tile_list=True)),
        ("fp16-draft-argmax-nolse", Variant(weight="fp16", draft=True, lse=False)),
        ("fp16-draft_topk", Variant(weight="fp16", draft_topk=True, lse=False)),
        ("fp16-draft_topk-rerun", Variant(weight="fp16", draft_topk=True, lse=False,
                                          tile_list=True)),
        ("fp32-lse-argmax", Variant(weight="fp32")),
        ("fp32-everything", Variant(weight="fp32", **everything)),
        ("fp32-everything-rerun", Variant(weight="fp32", **everything, tile_list=True)),
        ("fp32-draft_topk-draft-softcap-lse", Variant(weight="fp32", **dtopk)),
        ("fp32-draft_topk-draft-softcap-lse-rerun",
         Variant(weight="fp32", **dtopk, tile_list=True)),
    ]
    return out


def compile_for(
    target, variant: Variant, n_rows: int = 8192, V: int = 151_936, H: int = 4096, Vd: int = 32_000,
    cfg=None,
):  # fmt: skip
    """Compile `lm_head_fwd_kernel` ahead of time with the launcher's own config for
    (n_rows, V, H) and a draft vocabulary of Vd ids, or with `cfg`; returns (kernel, config)."""
    cfg = cfg or default_config(variant, n_rows, V, H, interpret=False)
    sig = fwd_signature(variant)
    constexprs = fwd_constexprs(variant, cfg, interpret=False)
    names = lm_head_fwd_kernel.arg_names
    for name in constexprs:
        sig[name] = "constexpr"
    sig = {name: sig[name] for name in names}
    # what the JIT would specialise for these sizes: 16-byte aligned pointers, and ints
    # that are multiples of 16 (V=151,936, H=4096, N=8192 and their strides are)
    values = {"N": n_rows, "V": V, "H": H, "stride_ym": H, "stride_wv": H}
    values.update(stride_lm=V, stride_sm=V, Vd=Vd, stride_dm=aligned_row(Vd))
    attrs = {}
    for i, name in enumerate(names):
        if sig[name].startswith("*") or (name in values and values[name] % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=lm_head_fwd_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=target, options=opts), cfg


# The persistent kernel's modes (`_triton_persistent.supports`), named as `aot_variants` names them.
PERSISTENT_VARIANTS = {
    "bf16-lse-argmax": Variant(),
    "bf16-argmax-nolse": Variant(lse=False),
    "bf16-draft-argmax-nolse": Variant(draft=True, lse=False),
    "bf16-draft": Variant(draft=True),
    "bf16-softcap": Variant(softcap=True),
    "bf16-draft-softcap-argmax-nolse": Variant(draft=True, softcap=True, lse=False),
    "fp16-lse-argmax": Variant(weight="fp16"),
}


def compile_persistent_for(
    target, variant: Variant, n_rows: int = 8192, V: int = 151_936, H: int = 4096, n_progs: int = 132,
    cfg: Config | None = None,
):  # fmt: skip
    """Compile `lm_head_persistent_kernel` ahead of time with the launcher's config for
    (n_rows, V, H) (or `cfg`, one the launcher does not choose) and a grid of n_progs programs
    (132 SMs: H100 / H200 SXM); returns (kernel, config, programs)."""
    cfg = cfg or persistent_config(variant, n_rows, V, H, interpret=False)
    n_progs = n_progs // cfg.GROUP_SIZE * cfg.GROUP_SIZE  # `_triton_persistent.num_programs`
    w = variant.weight
    sig = {
        "y_desc": f"tensordesc<{w}[{cfg.BLOCK_N}, {cfg.BLOCK_H}]>",
        "w_desc": f"tensordesc<{w}[{cfg.BLOCK_V}, {cfg.BLOCK_H}]>",
        **dict.fromkeys(["PartM_ptr", "PartS_ptr"], "*fp32"),
        "PartArg_ptr": "*i32",
        "Order_ptr": "*i32",
        **dict.fromkeys(["Draft_ptr", "PartDM_ptr", "PartDS_ptr"], "*fp32"),
        **dict.fromkeys(["N", "V", "H", "Vd", "stride_pm", "stride_dm"], "i32"),
        "logit_scale": "fp32",
        "softcap": "fp32",
    }
    constexprs = persistent_constexprs(variant, cfg, n_progs, interpret=False)
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    names = lm_head_persistent_kernel.arg_names
    sig = {name: sig[name] for name in names}
    values = {"N": n_rows, "V": V, "H": H, "stride_dm": aligned_row(32_000)}
    attrs = {}
    for i, name in enumerate(names):
        if sig[name].startswith("*") or (name in values and values[name] % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=lm_head_persistent_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=target, options=opts), cfg, n_progs


def compile_norm_for(target, hidden: str, weight: str, norm_mode: int, H: int = 4096):
    """Compile `rms_norm_kernel` ahead of time as the launcher launches it on a GPU."""
    block_m, block_h, num_warps = norm_config(H, interpret=False)
    constexprs = {
        "BLOCK_M": block_m,
        "BLOCK_H": block_h,
        "NORM_MODE": norm_mode,
        "INTERPRET": False,
    }
    sig = {"X_ptr": "*" + hidden, "NW_ptr": "*" + hidden, "Y_ptr": "*" + weight}
    sig.update(dict.fromkeys(["N", "H", "stride_xm", "stride_ym"], "i32"), eps="fp32")
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    sig = {name: sig[name] for name in rms_norm_kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    src = ASTSource(fn=rms_norm_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": 1}
    return triton.compile(src, target=target, options=opts)
