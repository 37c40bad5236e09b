"""Ahead-of-time compilation of the head kernels for Hopper (sm_90), on a machine without a GPU.

Every `lm_head_fwd_kernel` variant in `_triton_aot.aot_variants()` is compiled with the block
sizes, warps and stages the launcher picks for N=8192, H=4096, V=151,936 (`compile_for` uses
the launcher's own `default_config`), and the norm prologue for each norm mode. Asserted:
  - bf16 / fp16 weights run on tensor cores: `wgmma` in the PTX;
  - ptxas register spills: 0 bytes for variants without top-k, at most
    `TOPK_SPILL_BOUND` bytes with top-k (the bound is stated in kernels/_triton_aot.py);
  - shared memory within Hopper's 227 KB per block.
Spill counts come from the ptxas log of the real compile (TRITON_DUMP_PTXAS_LOG), i.e. the
same ptxas and flags triton uses for the cubin. Each kernel is compiled once per session in
a fresh TRITON_CACHE_DIR (a cache hit would skip ptxas); 2-25 s per variant.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import os
import re
from dataclasses import replace

import pytest
import torch
from eagle_fast.kernels import HeadOutput
from eagle_fast.kernels._common import HeadRequest

triton = pytest.importorskip("triton")

lm = importlib.import_module("eagle_fast.kernels.lm_head_triton")
aot = importlib.import_module("eagle_fast.kernels._triton_aot")
cfgs = importlib.import_module("eagle_fast.kernels._triton_config")
if not isinstance(lm.lm_head_fwd_kernel, triton.runtime.jit.JITFunction):
    # TRITON_INTERPRET=1 at import time made them InterpretedFunctions
    pytest.skip("kernels were built for the interpreter: no AOT compile", allow_module_level=True)

HOPPER_SMEM_LIMIT = 227 * 1024
VARIANTS = dict(aot.aot_variants())


def _ptxas_usage(log: str) -> tuple[int, int]:
    """(registers, spill bytes = stores + loads) from a ptxas -v log."""
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert regs and spills, f"no ptxas usage line in log:\n{log}"
    return int(regs[-1]), int(spills[-1][0]) + int(spills[-1][1])


@pytest.fixture(scope="session")
def hopper(tmp_path_factory):
    """Compile for sm_90 with a fresh cache and the ptxas log on; yields compile(fn) -> dict."""
    from triton.backends.compiler import GPUTarget

    saved_env = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_DUMP_PTXAS_LOG")}
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    target = GPUTarget("cuda", 90, 32)
    cache: dict = {}

    def compile_(key, build):
        if key not in cache:
            # a fresh cache per kernel: a cache hit would skip ptxas and its log
            os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                kernel, cfg = build(target)
            regs, spill = _ptxas_usage(buf.getvalue())
            ptx = kernel.asm["ptx"]
            cache[key] = {
                "cfg": cfg,
                "regs": regs,
                "spill": spill,
                "shared": kernel.metadata.shared,
                "wgmma": "wgmma.mma_async" in ptx,
            }
        return cache[key]

    yield compile_
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _compile_key(variant) -> tuple:
    """What determines the compiled kernel: variants that differ only in flags a re-run
    switches off compile once."""
    cfg = cfgs.default_config(variant, 8192, 151_936, 4096, interpret=False)
    consts = cfgs.fwd_constexprs(variant, cfg, interpret=False)
    return ("fwd", cfg, tuple(sorted(consts.items())), tuple(aot.fwd_signature(variant).items()))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fwd_kernel_compiles_for_hopper(hopper, name):
    variant = VARIANTS[name]
    res = hopper(_compile_key(variant), lambda target: aot.compile_for(target, variant))
    cfg = res["cfg"]
    if variant.weight in ("bf16", "fp16"):
        assert res["wgmma"], f"{name}: no wgmma in the PTX (tensor cores not used)"
    bound = aot.TOPK_SPILL_BOUND if variant.topk else 0
    assert res["spill"] <= bound, (
        f"{name}: {res['spill']} B spilled (bound {bound}), {res['regs']} registers"
    )
    assert res["shared"] <= HOPPER_SMEM_LIMIT, f"{name}: {res['shared']} B shared memory"
    print(f"{name}: {cfg.BLOCK_N}x{cfg.BLOCK_V}x{cfg.BLOCK_H} w{cfg.num_warps} s{cfg.num_stages} "
          f"regs={res['regs']} spill={res['spill']}B smem={res['shared']}B wgmma={res['wgmma']}")  # fmt: skip


@pytest.mark.parametrize(
    "cfg", cfgs.AUTOTUNE_CONFIGS,
    ids=lambda c: f"{c.BLOCK_N}x{c.BLOCK_V}-s{c.num_stages}-g{c.GROUP_SIZE}",
)  # fmt: skip
@pytest.mark.parametrize("name", ["bf16-lse-argmax", "bf16-draft-argmax-nolse"])
def test_autotune_candidates_compile_for_hopper(hopper, name, cfg):
    """EAGLE_FAST_AUTOTUNE=1 times these on the first GPU: each must compile for sm_90, on
    tensor cores, within shared memory and without spilling."""
    variant = VARIANTS[name]
    key = ("autotune", *_compile_key(variant)[2:], cfg)
    res = hopper(key, lambda target: aot.compile_for(target, variant, cfg=cfg))
    assert res["wgmma"] and res["shared"] <= HOPPER_SMEM_LIMIT, res
    assert res["spill"] == 0, f"{name} {cfg}: {res['spill']} B spilled, {res['regs']} registers"


@pytest.mark.parametrize(
    "name", ["bf16-draft-argmax-nolse", "bf16-topk", "bf16-topk-rerun", "bf16-draft_topk",
             "bf16-draft_topk-rerun", "bf16-logits-logprobs-draft"],
)  # fmt: skip
def test_fwd_kernel_compiles_for_ragged_shapes(hopper, name):
    """Ragged rows, vocabulary and draft vocabulary (N=300, V=32,003, Vd=10,001: the GPU
    tests' shape); H stays a multiple of 64 as in every real model (an H of 1000 loses the
    16-byte row alignment, and with it vectorised loads: 1.7-4.9 KB spilled)."""
    variant = VARIANTS[name]
    shape = {"n_rows": 300, "V": 32_003, "H": 1024, "Vd": 10_001}
    res = hopper(("ragged", *_compile_key(variant)), lambda t: aot.compile_for(t, variant, **shape))
    assert res["wgmma"] and res["shared"] <= HOPPER_SMEM_LIMIT, res
    bound = aot.TOPK_SPILL_BOUND if variant.topk else 0
    assert res["spill"] <= bound, f"{name}: {res['spill']} B spilled, {res['regs']} registers"


@pytest.mark.parametrize(
    "hidden, weight, norm_mode",
    [
        ("bf16", "bf16", 1),
        ("bf16", "bf16", 2),
        ("fp32", "bf16", 0),
        ("fp16", "fp16", 1),
        ("fp32", "fp32", 1),
    ],
)
def test_norm_kernel_compiles_for_hopper(hopper, hidden, weight, norm_mode):
    res = hopper(
        ("norm", hidden, weight, norm_mode),
        lambda target: (aot.compile_norm_for(target, hidden, weight, norm_mode), None),
    )
    assert res["spill"] == 0, f"norm kernel spilled {res['spill']} B"
    assert res["shared"] <= HOPPER_SMEM_LIMIT


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["out-fp32", "out-bf16"])
def test_launcher_picks_only_compiled_variants(out_dtype):
    """Every request the launcher can get for a bf16 head at the benchmark shape maps to a
    variant and config this file compiles (the logits store dtype aside: bf16 for all
    combinations, fp32 / fp16 once each), "draft_topk" with what it combines with included.
    Meta tensors: nothing is computed."""
    N, H, V, k = 8192, 4096, 151_936, 64
    meta = {"device": "meta", "dtype": torch.bfloat16}
    compiled = set(VARIANTS.values())
    requests = list(itertools.chain.from_iterable(
        itertools.combinations(("logits", "logprobs", "topk", "draft"), r) for r in range(5)
    ))  # fmt: skip
    requests += [("draft_topk",), ("draft_topk", "draft")]
    for outputs in requests:
        for softcap, lse in itertools.product((None, 30.0), (True, False)):
            wants_draft = bool({"draft", "draft_topk"} & set(outputs))
            req = HeadRequest(
                hidden=torch.empty(N, H, **meta),
                weight=torch.empty(V, H, **meta),
                norm_weight=torch.empty(H, **meta),
                eps=1e-6,
                norm="rms",
                logit_scale=1.0,
                softcap=softcap,
                outputs=frozenset(outputs) | {"argmax"} | ({"lse"} if lse else set()),
                k=k if {"topk", "draft_topk"} & set(outputs) else 0,
                draft_ids=torch.arange(0, V, 5, device="meta") if wants_draft else None,
                out_dtype=out_dtype,
            )
            out = HeadOutput(lse=None, argmax=None)
            out.logits = object() if "logits" in outputs else None
            out.logprobs = object() if "logprobs" in outputs else None
            out.draft_logprobs = object() if "draft" in outputs else None
            head = lm._Head(req, out, interpret=False)
            v = head.variant
            key = replace(v, out="bf16") if v.logits else v
            assert key in compiled, f"{sorted(outputs)} softcap={softcap} lse={lse}: {v} not AOT-compiled"
            assert v.lse == (lse or bool({"topk", "logprobs"} & set(outputs)))
            assert head.cfg == cfgs.default_config(key, N, V, H, interpret=False)
            assert v.draft_topk == ("draft_topk" in outputs) and v.topk == ("topk" in outputs)
            if v.topk or v.draft_topk:  # the exact re-run of crowded tiles
                assert replace(key, tile_list=True) in compiled, f"{v}: re-run not compiled"


def test_variants_cover_every_output_mode():
    """The AOT list exercises each constexpr switch the launcher sets, on and off."""
    vs = list(VARIANTS.values())
    for field in ("logits", "logprobs", "topk", "draft", "draft_topk", "softcap", "tile_list", "lse"):
        assert {getattr(v, field) for v in vs} == {False, True}, field
    assert {v.weight for v in vs} == {"bf16", "fp16", "fp32"}
    assert {v.out for v in vs if v.logits} >= {"bf16", "fp32"}
