"""Tests for the head op: `eagle_fast.kernels.lm_head` against the float64 oracle.

What: every mode (each output, each norm, scale / softcap, out_dtype, leading dims, N = 0,
exact ties, k edges, draft edges, large logits) under impl="torch" and impl="triton" (the
Triton interpreter for these CPU tensors), input validation, the draft-id helpers, and a
`gpu` class at real sizes on CUDA.

Design:
  - Truth is the package's reference (`kernels/reference.py`, through `_oracle.lm_head_oracle`):
    full float64 logits after the rounding of the normalised activation the semantics define.
  - Tolerance follows flash-attention: a float output passes when its error is at most
    2 x (the error of the same-dtype yardstick: the oracle with its GEMM in the weight dtype,
    `lm_head_oracle(..., same_dtype=True)`) + atol (+ one out_dtype ulp for outputs stored in
    a 16-bit out_dtype).
  - Ids are checked by value (the oracle logit at the returned id must be the best, within
    the logit tolerance), because random data can have near-ties that any correct fp32
    implementation may break either way; exact-tie tests use small-integer data, whose
    logits are exact in every precision and summation order, and demand the exact ids
    (ties to the lower id, top-k ordered by value then id).
  - impl="torch" runs twice per case: default chunking (one chunk at these sizes) and
    64-column chunks, so the online max / sum / argmax / top-k / draft merges across chunks
    are what gets tested.
  - Triton-interpreter cases stay at N <= 32, H <= 128, V <= 1100, k <= 16 (the interpreter
    runs every program in Python); fresh inputs per case, seeded by the test id.
Limits: the CPU suite cannot see GPU-only behaviour (tensor-core rounding, memory); the
`gpu` class covers that where CUDA exists.
"""

from __future__ import annotations

import math
import os
import threading
import zlib
from contextlib import contextmanager
from unittest import mock

import eagle_fast.kernels as kernels_pkg
import pytest
import torch
import torch.nn.functional as F
from _assert import assert_close, assert_ids_equal
from _oracle import lm_head_oracle
from eagle_fast.kernels import (
    SPAN_PREFIX,
    HeadOutput,
    _cpu,
    draft_ids_from_d2t,
    draft_ids_from_t2d,
    lm_head,
    lm_head_logits,
    lm_head_torch,
)
from eagle_fast.kernels._common import OUT_DTYPE_FIELDS
from eagle_fast.kernels._torch_running import RunningTopK
from eagle_fast.kernels.reference import final_norm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

IMPLS = ["torch", "triton"]
ALL_OUTPUTS = ("logits", "logprobs", "lse", "argmax", "topk", "draft")
# dtype, atol, rtol travel together. atol/rtol sit on top of 2x the same-dtype yardstick's
# error, so they only absorb fp32 accumulation-order noise.
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-4, 1e-5, id="fp16"),
    pytest.param(torch.bfloat16, 1e-4, 1e-5, id="bf16"),
]
# One ulp of a 16-bit out_dtype, relative: outputs stored in it are rounded once from fp32.
OUT_ULP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
FIELDS = {
    "logits": ("logits",),
    "logprobs": ("logprobs",),
    "lse": ("lse",),
    "argmax": ("argmax",),
    "topk": ("topk_ids", "topk_logprobs", "topk_tail"),
    "draft": ("draft_logprobs", "argmax_in_draft"),
}
FLOAT_FIELDS = ("logits", "logprobs", "lse", "topk_logprobs", "topk_tail", "draft_logprobs")
SMALL_CHUNK = 64
SMALL_ROWS = 4


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded by the test id: fresh inputs per case, reproducible per case."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


# ---------------------------------------------------------------------------------- helpers


def make_inputs(gen, N, H, V, dtype, *, norm="rms", logit_std=4.0, device="cpu"):
    """hidden [N, H] (pre-norm, scale ~3), weight [V, H] giving logits of std ~logit_std,
    norm_weight [H] (None for norm="none"), all in `dtype`."""
    hidden = torch.randn(N, H, generator=gen) * (1.0 if norm == "none" else 3.0)
    weight = torch.randn(V, H, generator=gen) * (logit_std / math.sqrt(H))
    if norm == "none":
        norm_weight = None
    elif norm == "rms":
        norm_weight = (1.0 + 0.2 * torch.randn(H, generator=gen)).to(dtype).to(device)
    else:  # rms_one_plus stores w with the 1 taken out (Gemma)
        norm_weight = (0.2 * torch.randn(H, generator=gen)).to(dtype).to(device)
    return hidden.to(dtype).to(device), weight.to(dtype).to(device), norm_weight


def random_draft(gen, V, size):
    return torch.randperm(V, generator=gen)[:size].sort().values


@contextmanager
def small_chunks(width: int = SMALL_CHUNK, rows: int = SMALL_ROWS):
    """Chunks of `width` columns and row blocks of `rows` rows: every cross-tile merge runs."""
    with (
        mock.patch.object(lm_head_torch, "choose_chunk", lambda *a, **kw: width),
        mock.patch.object(lm_head_torch, "choose_row_block", lambda *a, **kw: rows),
    ):
        yield


def run_impl(impl, hidden, weight, norm_weight=None, **kw) -> list[tuple[str, HeadOutput]]:
    """lm_head under `impl`; for torch also with 64-column chunks (the cross-chunk merges)."""
    outs = [(impl, lm_head(hidden, weight, norm_weight, impl=impl, **kw))]
    if impl == "torch":
        with small_chunks():
            outs.append(
                (f"torch/chunk{SMALL_CHUNK}", lm_head(hidden, weight, norm_weight, impl=impl, **kw))
            )
    return outs


def _max_err(a, b) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.to(a.device).double()).abs().max())


def check_outputs(
    out,
    oracle,
    yardstick,
    *,
    outputs,
    atol,
    rtol,
    out_dtype=torch.float32,
    draft_ids=None,
    exact_ids=False,
    label="",
):
    """Every requested field against the oracle (rules in the module header); no NaN/inf.
    Exactly the computed fields come back: argmax always, lse only with lse / logprobs / topk."""
    wanted = {"argmax"}.union(*(FIELDS[o] for o in outputs))
    if {"lse", "logprobs", "topk"} & set(outputs):
        wanted.add("lse")
    assert set(out.as_dict()) == wanted, (
        f"{label}: fields {sorted(out.as_dict())}, want {sorted(wanted)}"
    )
    for name in wanted:
        t = getattr(out, name)
        want = {
            "argmax": torch.int64,
            "topk_ids": torch.int64,
            "argmax_in_draft": torch.bool,
            "lse": torch.float32,
            "topk_tail": torch.float32,
        }.get(name, out_dtype)
        assert t.dtype == want, f"{label} {name}: dtype {t.dtype}, want {want}"
        assert not t.requires_grad, f"{label} {name} requires grad"

    for name in FLOAT_FIELDS:
        if name not in wanted:
            continue
        err_same = _max_err(getattr(yardstick, name), getattr(oracle, name))
        ulp = OUT_ULP[out_dtype] if name in OUT_DTYPE_FIELDS else 0.0
        assert_close(
            getattr(out, name),
            getattr(oracle, name),
            atol=2 * err_same + atol,
            rtol=rtol + ulp,
            name=f"{label} {name} (same-dtype error {err_same:.3g})",
        )

    # ids, by value: the oracle logit at each returned id must be the best available.
    logit_tol = (
        2 * _max_err(yardstick.logits, oracle.logits)
        + atol
        + rtol * float(oracle.logits.abs().max())
    )
    best = oracle.logits.max(-1).values
    got = oracle.logits.gather(-1, out.argmax[..., None].to(oracle.logits.device)).squeeze(-1)
    assert_close(got, best, atol=logit_tol, rtol=0, name=f"{label} oracle logit at argmax")
    if exact_ids:
        assert_ids_equal(out.argmax, oracle.argmax, name=f"{label} argmax")
    if "topk" in wanted:
        ids = out.topk_ids.to(oracle.logits.device)
        got = oracle.logits.gather(-1, ids)
        best = oracle.logits.gather(-1, oracle.topk_ids)
        assert_close(got, best, atol=logit_tol, rtol=0, name=f"{label} oracle logits at topk_ids")
        ids_sorted = ids.sort(-1).values
        assert bool((ids_sorted[..., 1:] > ids_sorted[..., :-1]).all()), (
            f"{label}: repeated topk ids"
        )
        if exact_ids:
            assert_ids_equal(out.topk_ids, oracle.topk_ids, name=f"{label} topk_ids")
    if "argmax_in_draft" in wanted:
        want_in = torch.isin(out.argmax, draft_ids.to(out.argmax.device))
        assert_ids_equal(out.argmax_in_draft, want_in, name=f"{label} argmax_in_draft vs argmax")


def check_case(
    impl,
    hidden,
    weight,
    norm_weight=None,
    *,
    atol,
    rtol,
    outputs=ALL_OUTPUTS,
    exact_ids=False,
    **kw,
):
    """Run `impl` (both chunkings for torch) and check all outputs against the oracle."""
    k = kw.get("k", 0)
    oracle = lm_head_oracle(hidden, weight, norm_weight, **kw)
    yardstick = lm_head_oracle(hidden, weight, norm_weight, same_dtype=True, **kw)
    for label, out in run_impl(impl, hidden, weight, norm_weight, outputs=outputs, **kw):
        check_outputs(
            out,
            oracle,
            yardstick,
            outputs=outputs,
            atol=atol,
            rtol=rtol,
            out_dtype=kw.get("out_dtype", torch.float32),
            draft_ids=kw.get("draft_ids"),
            exact_ids=exact_ids,
            label=f"[{label} k={k}]",
        )
    return oracle


# ------------------------------------------------------------------------ numerics, all modes


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("N,H,V,k", [(5, 123, 1001, 7), (1, 64, 257, 16), (17, 96, 1000, 13)])
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_all_outputs_match_oracle(impl, N, H, V, k, dtype, atol, rtol, gen):
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, dtype)
    draft = random_draft(gen, V, V // 3)
    check_case(impl, hidden, weight, norm_weight, atol=atol, rtol=rtol, k=k, draft_ids=draft)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("norm", ["rms", "rms_one_plus", "none"])
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_norm_variants(impl, norm, dtype, atol, rtol, gen):
    hidden, weight, norm_weight = make_inputs(gen, 9, 80, 515, dtype, norm=norm)
    draft = random_draft(gen, 515, 100)
    check_case(
        impl,
        hidden,
        weight,
        norm_weight,
        atol=atol,
        rtol=rtol,
        norm=norm,
        eps=1e-5,
        k=5,
        draft_ids=draft,
    )


def test_norm_variants_differ(gen):
    # The three norms must give different answers on the same tensors, or the test above
    # could not tell a norm-mode mix-up from a pass.
    hidden, weight, norm_weight = make_inputs(gen, 4, 32, 50, torch.float32)
    lse = {
        n: lm_head(hidden, weight, None if n == "none" else norm_weight, norm=n, impl="torch").lse
        for n in ("rms", "rms_one_plus", "none")
    }
    assert not torch.allclose(lse["rms"], lse["rms_one_plus"])
    assert not torch.allclose(lse["rms"], lse["none"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("logit_scale,softcap", [(0.25, None), (1.0, 8.0), (3.0, 2.5)])
@pytest.mark.parametrize("dtype,atol,rtol", [DTYPES[0], DTYPES[2]])
def test_logit_scale_and_softcap(impl, logit_scale, softcap, dtype, atol, rtol, gen):
    hidden, weight, norm_weight = make_inputs(gen, 7, 64, 300, dtype, logit_std=10.0)
    draft = random_draft(gen, 300, 64)
    oracle = check_case(
        impl,
        hidden,
        weight,
        norm_weight,
        atol=atol,
        rtol=rtol,
        logit_scale=logit_scale,
        softcap=softcap,
        k=6,
        draft_ids=draft,
    )
    if softcap is not None:  # the cap must actually bend the logits for this to test it
        assert float(oracle.logits.abs().max()) > 0.9 * softcap


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "outputs",
    [
        (),
        ("lse", "argmax"),
        ("logits",),
        ("logprobs",),
        ("topk",),
        ("draft",),
        ("draft", "argmax", "lse"),
        ("logits", "draft"),
        ("logits", "topk", "draft"),
    ],
    ids=lambda o: "+".join(o) or "none",
)
def test_output_subsets(impl, outputs, gen):
    hidden, weight, norm_weight = make_inputs(gen, 6, 48, 333, torch.bfloat16)
    draft = random_draft(gen, 333, 50)
    check_case(
        impl,
        hidden,
        weight,
        norm_weight,
        atol=1e-4,
        rtol=1e-5,
        outputs=outputs,
        k=3,
        draft_ids=draft,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_out_dtype(impl, out_dtype, gen):
    hidden, weight, norm_weight = make_inputs(gen, 5, 40, 211, torch.bfloat16)
    draft = random_draft(gen, 211, 70)
    check_case(
        impl,
        hidden,
        weight,
        norm_weight,
        atol=1e-4,
        rtol=1e-5,
        k=4,
        draft_ids=draft,
        out_dtype=out_dtype,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("norm", ["rms", "rms_one_plus"])
def test_activation_rounding_matches_served_model(impl, dtype, norm, gen):
    # A 16-bit target must get the logits the served model computes, so y must be rounded
    # exactly as transformers' own norm modules round it: Llama/Qwen RMSNorm rounds x * r and
    # then the product with the weight (two roundings); Gemma multiplies by (1 + w) in fp32 and
    # rounds once. The 16-bit tolerances elsewhere are loose enough to hide the difference, so
    # measure it directly: the logits must sit far closer to "transformers' norm module, then an
    # exact GEMM" than the one-rounding and two-rounding variants sit to each other.
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    hidden, weight, norm_weight = make_inputs(gen, 16, 128, 200, dtype, norm=norm)
    module = (Qwen3RMSNorm if norm == "rms" else Gemma3RMSNorm)(128, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(norm_weight)
        served = module(hidden).double() @ weight.double().t()
    out = lm_head(hidden, weight, norm_weight, norm=norm, outputs=("logits",), impl=impl)
    y32 = final_norm(hidden, norm_weight, eps=1e-6, norm=norm, dtype=torch.float32)  # unrounded
    once = y32.to(dtype).double() @ weight.double().t()
    r = torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    twice = ((hidden.float() * r).to(dtype) * norm_weight.to(dtype)).double() @ weight.double().t()
    gap = float((once - twice).abs().mean())
    err = float((out.logits.double() - served).abs().mean())
    # Mean, not max: a rare 1-ulp flip of one y element from a different rsqrt is allowed.
    assert err < 0.05 * gap, f"mean |logits - served| {err:.3g}; one vs two roundings {gap:.3g}"


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_dtypes_fp32_hidden_bf16_weight(impl, gen):
    # vLLM can hand over fp32 hidden states for a bf16 head; y is rounded to the WEIGHT dtype.
    hidden, weight, norm_weight = make_inputs(gen, 6, 72, 190, torch.float32)
    weight = weight.bfloat16()
    check_case(
        impl,
        hidden,
        weight,
        norm_weight,
        atol=1e-4,
        rtol=1e-5,
        k=5,
        draft_ids=random_draft(gen, 190, 20),
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,atol,rtol", [DTYPES[0], DTYPES[2]])
def test_large_logits(impl, dtype, atol, rtol, gen):
    hidden, weight, norm_weight = make_inputs(gen, 8, 64, 280, dtype, logit_std=60.0)
    oracle = check_case(
        impl,
        hidden,
        weight,
        norm_weight,
        atol=atol,
        rtol=rtol,
        k=9,
        draft_ids=random_draft(gen, 280, 90),
    )
    assert float(oracle.logits.abs().max()) > 50


@pytest.mark.parametrize("impl", IMPLS)
def test_leading_dims(impl, gen):
    hidden, weight, norm_weight = make_inputs(gen, 6, 32, 129, torch.bfloat16)
    draft = random_draft(gen, 129, 40)
    kw = {"outputs": ALL_OUTPUTS, "k": 3, "draft_ids": draft, "impl": impl}
    flat = lm_head(hidden, weight, norm_weight, **kw)
    for lead in [(2, 3), (3, 1, 2)]:
        out = lm_head(hidden.reshape(*lead, 32), weight, norm_weight, **kw)
        for name, t in out.as_dict().items():
            ref = getattr(flat, name)
            assert t.shape == (*lead, *ref.shape[1:]), f"{name}: {tuple(t.shape)} for lead {lead}"
            assert torch.equal(t.reshape(ref.shape), ref), name
    check_case(
        impl,
        hidden.reshape(2, 3, 32),
        weight,
        norm_weight,
        atol=1e-4,
        rtol=1e-5,
        k=3,
        draft_ids=draft,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["N0", "B2xS0"])
def test_empty_rows(impl, lead, gen):
    H, V, k, Vd = 16, 40, 3, 7
    hidden = torch.randn(*lead, H, generator=gen, dtype=torch.float32).bfloat16()
    weight = torch.randn(V, H, generator=gen).bfloat16()
    out = lm_head(
        hidden,
        weight,
        torch.ones(H, dtype=torch.bfloat16),
        outputs=ALL_OUTPUTS,
        k=k,
        draft_ids=torch.arange(Vd),
        out_dtype=torch.float16,
        impl=impl,
    )
    want = {
        "lse": (lead, torch.float32),
        "argmax": (lead, torch.int64),
        "logits": ((*lead, V), torch.float16),
        "logprobs": ((*lead, V), torch.float16),
        "topk_ids": ((*lead, k), torch.int64),
        "topk_logprobs": ((*lead, k), torch.float16),
        "topk_tail": (lead, torch.float32),
        "draft_logprobs": ((*lead, Vd), torch.float16),
        "argmax_in_draft": (lead, torch.bool),
    }
    got = {n: (tuple(t.shape), t.dtype) for n, t in out.as_dict().items()}
    assert got == {n: (tuple(s), d) for n, (s, d) in want.items()}


@pytest.mark.parametrize("impl", IMPLS)
def test_tied_embedding_weight(impl, gen):
    # A tied head passes the input embedding itself: an nn.Parameter that requires grad, here a
    # row slice of a vocabulary padded to 1024 rows (as checkpoints pad it). Nothing may
    # write to it, track gradients through it, or read the padding rows.
    V, H = 1001, 64
    emb = torch.nn.Embedding(1024, H, dtype=torch.bfloat16)
    with torch.no_grad():
        emb.weight.normal_(0.0, 4.0 / math.sqrt(H), generator=gen)
        emb.weight[V:] = 1e4  # padding rows: would win every argmax if read
    weight = emb.weight[:V]
    before = emb.weight.detach().clone()
    hidden = emb(torch.randint(0, V, (3, 4), generator=gen)) * 3.0  # [B, S, H], requires grad
    norm_weight = torch.ones(H, dtype=torch.bfloat16)
    check_case(
        impl,
        hidden.detach(),
        weight.detach(),
        norm_weight,
        atol=1e-4,
        rtol=1e-5,
        k=5,
        draft_ids=random_draft(gen, V, 100),
    )
    out = lm_head(
        hidden,
        weight,
        norm_weight,
        outputs=ALL_OUTPUTS,
        k=5,
        draft_ids=random_draft(gen, V, 100),
        impl=impl,
    )
    assert all(not t.requires_grad for t in out.as_dict().values())
    assert torch.equal(emb.weight.detach(), before)
    assert int(out.argmax.max()) < V


@pytest.mark.parametrize("impl", IMPLS)
def test_column_major_weight(impl, gen):
    # A transposed view (weight stored [H, V]) has non-unit row stride; it must be handled,
    # not misread.
    hidden, weight, norm_weight = make_inputs(gen, 4, 32, 77, torch.float32)
    weight_cm = weight.t().contiguous().t()
    assert weight_cm.stride(1) != 1
    check_case(
        impl,
        hidden,
        weight_cm,
        norm_weight,
        atol=1e-5,
        rtol=1e-5,
        k=2,
        draft_ids=random_draft(gen, 77, 9),
    )


# ------------------------------------------------------------------------- exact ties, edges


def tie_inputs(gen, N, H, V, dtype, n_distinct=20):
    """Small-integer hidden and weight (norm="none"): logits are integers |l| <= 4H = 128, exact
    in bf16 / fp16 / fp32 and in any summation order. The weight has only n_distinct rows, each
    repeated >= V // n_distinct times at shuffled ids, so every row's max is tied and ties
    straddle the k-th place."""
    base = torch.randint(-2, 3, (n_distinct, H), generator=gen)
    which = torch.arange(V) % n_distinct
    which = which[torch.randperm(V, generator=gen)]
    hidden = torch.randint(-2, 3, (N, H), generator=gen)
    return hidden.to(dtype), base[which].to(dtype)


@pytest.mark.parametrize(
    "impl,k",
    [(impl, k) for impl in IMPLS for k in (1, 5, 16)] + [("torch", 100), ("torch", 257)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_exact_ties_go_to_lower_id(impl, k, dtype, gen):
    N, H, V = 9, 32, 257
    hidden, weight = tie_inputs(gen, N, H, V, dtype)
    draft = random_draft(gen, V, 90)
    oracle = check_case(
        impl,
        hidden,
        weight,
        None,
        norm="none",
        atol=1e-5,
        rtol=1e-6,
        k=k,
        draft_ids=draft,
        exact_ids=True,
    )
    logits = oracle.logits
    # the construction really ties the top, and (k < V) ties across the k-th place
    assert bool(((logits == logits.max(-1, keepdim=True).values).sum(-1) >= 2).all())
    if k < V:
        at_k = logits.gather(-1, oracle.topk_ids[:, k - 1 : k])
        assert bool(((logits == at_k).sum(-1) > 1).any())


def test_torch_topk_path_used_on_cuda(gen):
    # On CUDA the PyTorch path picks each chunk's candidates with torch.topk only (no threshold
    # gather). Force that path on CPU, with chunks narrower than k and ties everywhere.
    hidden, weight = tie_inputs(gen, 9, 32, 257, torch.float32)
    with mock.patch.object(RunningTopK, "_update_above_threshold", lambda *a: False):
        for k in (1, 7, 100):
            check_case(
                "torch",
                hidden,
                weight,
                None,
                norm="none",
                atol=1e-5,
                rtol=1e-6,
                k=k,
                outputs=("topk",),
                exact_ids=True,
            )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("V", [13, 1])
def test_k_equals_vocab(impl, V, gen):
    hidden, weight, norm_weight = make_inputs(gen, 5, 24, V, torch.float32)
    oracle = check_case(
        impl, hidden, weight, norm_weight, atol=1e-5, rtol=1e-5, k=V, draft_ids=torch.arange(V)
    )
    out = lm_head(hidden, weight, norm_weight, outputs=("topk",), k=V, impl=impl)
    assert_close(out.topk_tail, torch.zeros(5), atol=1e-6, rtol=0, name="tail of k=V")
    assert_ids_equal(out.topk_ids.sort(-1).values, torch.arange(V).expand(5, V), name="k=V ids")
    assert oracle.topk_ids.shape == (5, V)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["first", "last", "all", "d2t"])
def test_draft_edges(impl, which, gen):
    N, H, V = 6, 40, 301
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, torch.bfloat16)
    if which == "first":
        draft = torch.tensor([0])
    elif which == "last":
        draft = torch.tensor([V - 1])
    elif which == "all":
        draft = torch.arange(V)
    else:  # a d2t-style draft vocab: the 64 most likely tokens under a random unigram
        top = torch.randn(V, generator=gen).topk(64).indices.sort().values
        draft = draft_ids_from_d2t(top - torch.arange(64))
    check_case(impl, hidden, weight, norm_weight, atol=1e-4, rtol=1e-5, k=4, draft_ids=draft)
    out = lm_head(hidden, weight, norm_weight, outputs=("draft", "lse"), draft_ids=draft, impl=impl)
    if draft.numel() == 1:  # a one-token draft vocab has probability one
        assert_close(out.draft_logprobs, torch.zeros(N, 1), atol=1e-6, rtol=0, name="Vd=1")
    if which == "all":  # the draft vocab is the vocab: draft log-probs are the log-probs
        assert_close(
            out.draft_logprobs + out.lse[:, None],
            lm_head(hidden, weight, norm_weight, outputs=("logits",), impl=impl).logits,
            atol=1e-4,
            rtol=1e-5,
            name="Vd=V",
        )
        assert bool(out.argmax_in_draft.all())


@pytest.mark.parametrize("impl", IMPLS)
def test_tail_when_topk_holds_nearly_all_mass(impl, gen):
    # One token per row leads by ~45 nats: the true tail is ~1e-17. Whatever the tail
    # formula, it must be tiny, non-negative and finite.
    N, H, V = 6, 64, 300
    weight = F.normalize(torch.randn(V, H, generator=gen), dim=-1)
    hidden = weight[torch.randint(0, V, (N,), generator=gen)]
    out = lm_head(
        hidden, weight, None, norm="none", logit_scale=60.0, outputs=("topk",), k=2, impl=impl
    )
    oracle = lm_head_oracle(hidden, weight, None, norm="none", logit_scale=60.0, k=2)
    assert float(oracle.topk_tail.max()) < 1e-10
    assert_close(out.topk_tail, oracle.topk_tail, atol=1e-6, rtol=0, name="topk_tail")


def test_torch_tail_keeps_relative_accuracy(gen):
    # The PyTorch path sums the tail directly over the tokens outside the top-k (never as
    # 1 - sum(top-k)), so even a 1e-17 tail is right to fp32 relative precision, whatever the
    # chunking.
    N, H, V = 6, 64, 300
    weight = F.normalize(torch.randn(V, H, generator=gen), dim=-1)
    hidden = weight[torch.randint(0, V, (N,), generator=gen)]
    kw = {"norm": "none", "logit_scale": 60.0, "k": 2}
    oracle = lm_head_oracle(hidden, weight, None, **kw)
    for label, out in run_impl("torch", hidden, weight, None, outputs=("topk",), **kw):
        assert_close(out.topk_tail, oracle.topk_tail, atol=0, rtol=1e-4, name=f"{label} tail")


# ------------------------------------------------------------------- memory and dispatch (CPU)


class _LargestTensor(TorchDispatchMode):
    """Records the largest storage any aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.nbytes, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.nbytes:
                self.nbytes, self.op = t.untyped_storage().nbytes(), str(func)
        return out


def test_torch_impl_never_builds_vocab_sized_tensors(gen):
    # Without logits/logprobs, no tensor created during the call may come near one fp32 [N, V]
    # matrix: the default plan here is one [128, 1024] tile, 1/16 of it
    # (`test_cpu_scratch_stays_within_its_budget` checks the budget where it binds).
    # Requesting logits is the control: there the tracker must see the [N, V] output.
    N, H, V = 128, 16, 16_384
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, torch.bfloat16)
    full = N * V * 4
    kw = {"k": 8, "draft_ids": torch.arange(0, V, 31), "impl": "torch"}
    with _LargestTensor() as seen:
        lm_head(hidden, weight, norm_weight, outputs=("lse", "argmax", "topk", "draft"), **kw)
    assert seen.nbytes <= full // 8, f"{seen.op} returned {seen.nbytes} bytes; N x V x 4 = {full}"
    with _LargestTensor() as seen:
        lm_head(hidden, weight, norm_weight, outputs=("logits",), **kw)
    assert seen.nbytes >= full, f"tracker missed the logits output ({seen.nbytes} bytes)"


@pytest.mark.parametrize(
    "N,H,V,dtype",
    [
        (1100, 16, 4096, torch.bfloat16),  # more rows than one tile holds: rows are blocked
        (40, 2048, 1000, torch.float16),  # a wide head: the fp32 weight chunk is bounded too
    ],
)
def test_cpu_scratch_stays_within_its_budget(N, H, V, dtype, gen):
    # The CPU plan's promise: besides the outputs, no tensor of a call outgrows the tile budget
    # (one fp32 [R, C] logits tile, one fp32 weight chunk), although full fp32 logits or a
    # whole upcast weight would.
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, dtype)
    budget = max(lm_head_torch._CPU_TILE_BYTES, lm_head_torch._CPU_WCHUNK_BYTES)
    assert max(N * V * 4, V * H * 4) > budget, "the case must be bigger than the budget"
    with _LargestTensor() as seen:
        out = lm_head(hidden, weight, norm_weight, outputs=("lse", "topk"), k=8, impl="torch")
    assert seen.nbytes <= budget, f"{seen.op} returned {seen.nbytes} bytes; budget {budget}"
    oracle = lm_head_oracle(hidden, weight, norm_weight, k=8)
    assert_close(out.lse, oracle.lse, atol=1e-3, rtol=1e-4, name="lse")  # and still right


@pytest.mark.parametrize("chunk", [64, 100, 4096])
def test_draft_first_ties_go_to_lower_id(chunk, gen):
    # Draft-first order (draft wanted, no top-k, no [N, V] output) walks the draft ids before
    # the others, so an argmax tie between a draft id and a LOWER non-draft id is met in the
    # wrong order: the lower id must still win. Exact integer logits, ties everywhere.
    N, H, V = 9, 32, 257
    hidden, weight = tie_inputs(gen, N, H, V, torch.bfloat16, n_distinct=6)
    draft = torch.arange(100, V, 2)  # high ids, so the tied rest ids below them come later
    oracle = lm_head_oracle(hidden, weight, None, norm="none", draft_ids=draft)
    for outputs in (("draft", "argmax"), ("draft", "argmax", "lse")):
        with small_chunks(chunk, rows=4):
            out = lm_head(
                hidden, weight, None, norm="none", outputs=outputs, draft_ids=draft, impl="torch",
            )
        assert_ids_equal(out.argmax, oracle.argmax, name=f"{outputs} argmax")
        assert bool((out.argmax < 100).any()), "the case never tied across the two ranges"
        assert_ids_equal(out.argmax_in_draft, oracle.argmax_in_draft, name="argmax_in_draft")
        assert_close(out.draft_logprobs, oracle.draft_logprobs, atol=1e-5, rtol=1e-6, name="draft")
        if "lse" in outputs:
            assert_close(out.lse, oracle.lse, atol=1e-5, rtol=1e-6, name="lse")
        else:  # the argmax-only pass over the non-draft tiles: no lse was computed
            assert out.lse is None


def _global_torch_settings() -> dict:
    mkldnn = torch.backends.mkldnn
    return {"mkldnn.matmul.fp32_precision": mkldnn.matmul.fp32_precision,
            "mkldnn.fp32_precision": mkldnn.fp32_precision, "mkldnn.enabled": mkldnn.enabled,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "num_threads": torch.get_num_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cpu_head_changes_no_global_state(dtype, gen):
    # Every global torch setting a GEMM reads is the same at each of the head's GEMMs as before
    # the call: another thread (a trainer sharing the process) never sees a changed setting.
    hidden, weight, norm_weight = make_inputs(gen, 40, 64, 3000, dtype)
    before = _global_torch_settings()
    seen = []

    def spy(real):
        def gemm(*a, **kw):
            seen.append(_global_torch_settings())
            return real(*a, **kw)
        return gemm

    with mock.patch.object(torch, "mm", spy(torch.mm)), \
         mock.patch.object(lm_head_torch, "gemm_bf16_f32", spy(lm_head_torch.gemm_bf16_f32)):
        lm_head(hidden, weight, norm_weight, outputs=ALL_OUTPUTS, k=8,
                draft_ids=torch.arange(0, 3000, 7), impl="torch")
        lm_head_logits(hidden, weight, norm_weight)
    assert seen, "the spy saw no GEMM"
    assert all(s == before for s in seen), [s for s in seen if s != before][:1]
    assert _global_torch_settings() == before


def test_cpu_head_leaves_another_threads_fp32_matmul_alone(gen):
    # A trainer thread's fp32 matmul that runs while a bf16 head call is in flight keeps full
    # fp32 accuracy (a process-global bf16 GEMM mode would round its operands: ~1e-3 error).
    hidden, weight, norm_weight = make_inputs(gen, 256, 256, 20_000, torch.bfloat16)
    a = torch.randn(256, 512, generator=gen)
    b = torch.randn(512, 256, generator=gen)
    truth = a.double() @ b.double()
    worst, stop = [0.0], threading.Event()

    def trainer():
        while not stop.is_set():
            err = float(((a @ b).double() - truth).abs().max() / truth.abs().max())
            worst[0] = max(worst[0], err)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        for _ in range(3):
            lm_head(hidden, weight, norm_weight, outputs=("draft",),
                    draft_ids=torch.arange(0, 20_000, 3), impl="torch")
    finally:
        stop.set()
        thread.join()
    assert worst[0] < 1e-5, f"a concurrent fp32 matmul lost precision: relative error {worst[0]:.2e}"


needs_bf16_gemm = pytest.mark.skipif(
    not _cpu.bf16_gemm_available(), reason="no hardware bf16 GEMM here (AVX2, or capped)")


@needs_bf16_gemm
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (37, 300, 48), (130, 1025, 257)])
def test_mkl_bf16_gemm_is_the_fp32_gemm_of_bf16_values(M, N, K, gen):
    a = torch.randn(M, K, generator=gen).bfloat16()
    b = torch.randn(N + 3, K, generator=gen).bfloat16()[2 : N + 2]  # a row window of b
    wide = torch.full((M, N + 11), float("nan"))
    out = _cpu.gemm_bf16_f32(a, b, wide[:, 5 : N + 5])  # a column window: row stride N + 11
    truth = a.double() @ b.double().t()
    assert_close(out, truth, atol=K * 2e-7, rtol=1e-6, name="bf16 gemm vs float64")
    assert wide[:, :5].isnan().all() and wide[:, N + 5 :].isnan().all(), "wrote outside its window"


@needs_bf16_gemm
def test_mkl_bf16_gemm_refuses_what_it_cannot_run():
    a, b = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(6, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bf16 a, b and fp32 out"):
        _cpu.gemm_bf16_f32(a.float(), b, torch.empty(4, 6))
    with pytest.raises(ValueError, match=r"a \(4, 8\) @ b \(6, 8\).T -> out \(4, 5\)"):
        _cpu.gemm_bf16_f32(a, b, torch.empty(4, 5))
    with pytest.raises(ValueError, match="out must be a CPU tensor with unit column stride"):
        _cpu.gemm_bf16_f32(a, b, torch.empty(6, 4).t())


def test_cpu_head_takes_the_bf16_gemm_where_the_hardware_has_one(gen):
    # bf16 weights run MKL's bf16 GEMM on AVX512-BF16/AMX (uncapped) and the fp32 GEMM on
    # upcast operands elsewhere; fp16 and fp32 weights always take the fp32 GEMM.
    calls = []
    real = lm_head_torch.gemm_bf16_f32
    with mock.patch.object(lm_head_torch, "gemm_bf16_f32", lambda *a: calls.append(1) or real(*a)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            calls.clear()
            hidden, weight, norm_weight = make_inputs(gen, 8, 32, 300, dtype)
            lm_head(hidden, weight, norm_weight, impl="torch")
            expect = dtype == torch.bfloat16 and _cpu.bf16_gemm_available()
            assert bool(calls) == expect, (dtype, len(calls), _cpu.cpu_isa())


def test_auto_runs_torch_on_cpu(gen):
    # impl="auto" must never send CPU tensors to the (slow) Triton interpreter.
    hidden, weight, norm_weight = make_inputs(gen, 3, 16, 20, torch.float32)
    with mock.patch.object(
        kernels_pkg, "_triton_impl", side_effect=AssertionError("triton called")
    ):
        out = lm_head(hidden, weight, norm_weight, impl="auto")
    assert out.lse.shape == (3,)


def test_kernel_import_keeps_public_function():
    # Importing the kernel module must not rebind the package's public `lm_head` function.
    from eagle_fast.kernels.lm_head_triton import lm_head_triton

    assert callable(lm_head_triton)
    assert kernels_pkg.lm_head is lm_head
    from eagle_fast.kernels import lm_head as again

    assert again is lm_head


# ------------------------------------------------------------------------------- validation


def _valid():
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(3, 16, generator=g),
        "weight": torch.randn(50, 16, generator=g),
        "norm_weight": torch.ones(16),
    }


_META = {"device": "meta"}


def _draft(ids):
    return {"outputs": ("draft",), "draft_ids": ids}


def _topk(k):
    return {"outputs": ("topk",), "k": k}


# (tensor overrides, keyword arguments, message pattern)
# fmt: off
BAD_INPUTS = [
    ({"weight": torch.randn(50, 17)}, {}, r"hidden size mismatch.*\(3, 16\).*\(50, 17\)"),
    ({"weight": torch.randn(0, 16)}, {}, r"weight has an empty vocabulary.*\(0, 16\)"),
    ({"weight": torch.randn(16)}, {}, r"weight must be 2-D.*\(16,\)"),
    ({"weight": torch.randn(2, 50, 16)}, {}, r"weight must be 2-D.*\(2, 50, 16\)"),
    ({"hidden": torch.tensor(1.0)}, {}, r"hidden must have a trailing hidden dim"),
    ({"hidden": [[1.0] * 16]}, {}, r"hidden must be a torch.Tensor"),
    ({}, _topk(0), r"k must be in \[1, V=50\].*k=0"),
    ({}, _topk(51), r"k must be in \[1, V=50\].*k=51"),
    ({}, _topk(2.5), r"k must be an int"),
    ({}, _topk(True), r"k must be an int"),
    ({}, {"outputs": ("lse", "probs")}, r"outputs: unknown name.*probs"),
    ({}, {"outputs": 3}, r"outputs must be a sequence"),
    ({}, {"norm": "layer"}, r"norm must be one of.*layer"),
    ({"norm_weight": None}, {"norm": "rms"}, r"norm='rms' needs norm_weight"),
    ({"norm_weight": None}, {"norm": "rms_one_plus"}, r"norm='rms_one_plus' needs norm_weight"),
    ({"norm_weight": torch.ones(17)}, {}, r"norm_weight must have shape \(16,\).*\(17,\)"),
    ({"norm_weight": torch.ones(1, 16)}, {}, r"norm_weight must have shape \(16,\).*\(1, 16\)"),
    ({}, {"norm": "none"}, r"norm='none' takes no norm_weight"),
    ({}, {"outputs": ("draft",)}, r"'draft' but draft_ids is missing"),
    ({}, _draft(torch.tensor([[1, 2]])), r"draft_ids must be a non-empty 1-D.*\(1, 2\)"),
    ({}, _draft(torch.tensor([], dtype=torch.int64)), r"draft_ids must be a non-empty 1-D"),
    ({}, _draft(torch.tensor([1.0, 2.0])), r"draft_ids must be an integer tensor"),
    ({}, _draft(torch.ones(50, dtype=torch.bool)), r"draft_ids must be an integer.*t2d"),
    ({}, _draft(torch.tensor([1, 5, 3])), r"strictly increasing.*unsorted at position 1"),
    ({}, _draft(torch.tensor([1, 3, 3])), r"strictly increasing.*duplicated at position 1"),
    ({}, _draft(torch.tensor([-1, 3])), r"draft_ids must lie in \[0, V=50\).*min -1"),
    ({}, _draft(torch.tensor([3, 50])), r"draft_ids must lie in \[0, V=50\).*max 50"),
    ({}, {"eps": float("nan")}, r"eps must be finite"),
    ({}, {"eps": float("inf")}, r"eps must be finite"),
    ({}, {"eps": -1e-6}, r"eps must be >= 0"),
    ({}, {"eps": "1e-6"}, r"eps must be a real number"),
    ({}, {"logit_scale": float("inf")}, r"logit_scale must be finite"),
    ({}, {"logit_scale": float("nan")}, r"logit_scale must be finite"),
    ({}, {"softcap": 0.0}, r"softcap must be > 0"),
    ({}, {"softcap": -30.0}, r"softcap must be > 0"),
    ({}, {"softcap": float("inf")}, r"softcap must be finite"),
    ({"hidden": torch.randn(3, 16, dtype=torch.float64)}, {}, r"hidden dtype torch.float64 is not"),
    ({"hidden": torch.ones(3, 16, dtype=torch.int32)}, {}, r"hidden dtype torch.int32 is not"),
    ({"weight": torch.randn(50, 16, dtype=torch.float64)}, {}, r"weight dtype torch.float64"),
    ({"norm_weight": torch.ones(16, dtype=torch.float64)}, {}, r"norm_weight dtype torch.float64"),
    ({"weight": torch.empty(50, 16, **_META)}, {}, r"weight is on meta but hidden is on cpu"),
    ({"norm_weight": torch.empty(16, **_META)}, {}, r"norm_weight is on meta but hidden is on cpu"),
    ({}, _draft(torch.arange(3, **_META)), r"draft_ids is on meta but hidden is on cpu"),
    ({}, {"out_dtype": torch.int64}, r"out_dtype must be one of"),
    ({}, {"out_dtype": torch.float64}, r"out_dtype must be one of"),
    ({}, {"out_dtype": "float32"}, r"out_dtype must be one of"),
]
# fmt: on


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tensors,kwargs,match", BAD_INPUTS)
def test_rejects_bad_input(impl, tensors, kwargs, match):
    args = {**_valid(), **tensors}
    with pytest.raises(ValueError, match=match):
        lm_head(args["hidden"], args["weight"], args["norm_weight"], impl=impl, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_valid_base_call_passes(impl):
    # the base of the bad-input cases is itself valid, so each case fails for its own reason
    args = _valid()
    out = lm_head(
        args["hidden"],
        args["weight"],
        args["norm_weight"],
        outputs=ALL_OUTPUTS,
        k=50,
        draft_ids=torch.tensor([0, 49]),
        eps=0.0,
        softcap=1e-3,
        impl=impl,
    )
    assert out.topk_ids.shape == (3, 50)


def test_rejects_unknown_impl():
    args = _valid()
    with pytest.raises(ValueError, match=r"impl must be one of.*'cuda'"):
        lm_head(args["hidden"], args["weight"], args["norm_weight"], impl="cuda")


def test_triton_impl_without_triton_is_a_clear_error():
    args = _valid()
    with mock.patch.object(kernels_pkg, "_triton_available", return_value=False):
        with pytest.raises(ValueError, match=r"impl='triton' needs the triton package"):
            lm_head(args["hidden"], args["weight"], args["norm_weight"], impl="triton")
        out = lm_head(args["hidden"], args["weight"], args["norm_weight"], impl="auto")
    assert out.lse.shape == (3,)


def test_outputs_accepts_a_single_name():
    args = _valid()
    out = lm_head(args["hidden"], args["weight"], args["norm_weight"], outputs="topk", k=2)
    assert out.topk_ids.shape == (3, 2) and out.logits is None


def test_k_and_draft_ids_ignored_unless_requested():
    args = _valid()
    out = lm_head(
        args["hidden"],
        args["weight"],
        args["norm_weight"],
        k=999,
        draft_ids=torch.tensor([5, 1]),
        impl="torch",
    )
    assert out.topk_ids is None and out.draft_logprobs is None


def test_assert_helpers_fail_loudly():
    # The helpers every check above relies on must fail, and say where: NaN never passes.
    expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    actual = torch.tensor([[1.0, float("nan")], [3.0, 4.5]])
    with pytest.raises(AssertionError, match=r"x: 2 / 4 elements differ.*1 NaN.*\(0, 1\)"):
        assert_close(actual, expected, atol=0.1, rtol=0.0, name="x")
    assert_close(expected + 0.05, expected, atol=0.1, rtol=0.0, name="x")
    with pytest.raises(AssertionError, match=r"ids: 1 / 3 entries differ.*\(2,\): 7 vs 2"):
        assert_ids_equal(torch.tensor([0, 1, 7]), torch.tensor([0, 1, 2]), name="ids")


# ------------------------------------------------------------------------ draft-id helpers


def test_draft_ids_from_d2t_and_t2d_agree():
    target = torch.tensor([0, 3, 4, 10, 99])
    d2t = target - torch.arange(5)
    ids = draft_ids_from_d2t(d2t.to(torch.int32))
    assert ids.dtype == torch.int64 and torch.equal(ids, target)
    mask = torch.zeros(100, dtype=torch.bool)
    mask[target] = True
    assert torch.equal(draft_ids_from_t2d(mask), target)


@pytest.mark.parametrize(
    "d2t,match",
    [
        (torch.tensor([0, 2, 1]), r"strictly increasing.*duplicated at position 1"),  # ids 0, 3, 3
        (torch.tensor([5, -1]), r"strictly increasing.*unsorted at position 0"),  # ids 5, 0
        (torch.tensor([-1, 0]), r"negative target ids"),
        (torch.tensor([0.0, 1.0]), r"d2t must be an integer tensor"),
        (torch.zeros(2, 2, dtype=torch.int64), r"d2t must be a non-empty 1-D"),
    ],
)
def test_draft_ids_from_d2t_rejects(d2t, match):
    with pytest.raises(ValueError, match=match):
        draft_ids_from_d2t(d2t)


@pytest.mark.parametrize(
    "mask,match",
    [
        (torch.tensor([0, 1, 1]), r"t2d_mask must be a bool tensor"),
        (torch.ones(2, 3, dtype=torch.bool), r"t2d_mask must be 1-D"),
        (torch.zeros(5, dtype=torch.bool), r"selects no token"),
    ],
)
def test_draft_ids_from_t2d_rejects(mask, match):
    with pytest.raises(ValueError, match=match):
        draft_ids_from_t2d(mask)


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
class TestCudaRealSizes:
    """N=4096, H=4096, V=151,936 bf16 on CUDA: triton and torch against the float64 oracle,
    and the memory bound (no [N, V] fp32 buffer unless logits/logprobs are asked for)."""

    N, H, V, K, VD = 4096, 4096, 151_936, 64, 32_000

    @pytest.fixture(scope="class")
    def case(self):
        g = torch.Generator(device="cuda").manual_seed(3)
        hidden = (torch.randn(self.N, self.H, device="cuda", generator=g) * 3).bfloat16()
        weight = (
            torch.randn(self.V, self.H, device="cuda", generator=g) * (4 / self.H**0.5)
        ).bfloat16()
        norm_weight = (1 + 0.2 * torch.randn(self.H, device="cuda", generator=g)).bfloat16()
        draft = torch.randperm(self.V, device="cuda", generator=g)[: self.VD].sort().values
        kw = {"k": self.K, "draft_ids": draft}
        oracle = lm_head_oracle(hidden, weight, norm_weight, row_block=512, **kw)
        yardstick = lm_head_oracle(
            hidden, weight, norm_weight, row_block=512, same_dtype=True, **kw
        )
        return hidden, weight, norm_weight, kw, oracle, yardstick

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize(
        "outputs",
        [("lse", "argmax"), ("topk",), ("draft",), ALL_OUTPUTS],
        ids=lambda o: "+".join(o),
    )
    def test_matches_oracle(self, case, impl, outputs):
        hidden, weight, norm_weight, kw, oracle, yardstick = case
        out = lm_head(hidden, weight, norm_weight, outputs=outputs, impl=impl, **kw)
        check_outputs(
            out,
            oracle,
            yardstick,
            outputs=outputs,
            atol=1e-4,
            rtol=1e-5,
            draft_ids=kw["draft_ids"],
            label=f"[cuda {impl}]",
        )

    @pytest.mark.parametrize("impl", IMPLS)
    def test_peak_memory_without_full_logits(self, case, impl):
        hidden, weight, norm_weight, kw, _, _ = case
        outputs = ("lse", "argmax", "topk", "draft")
        lm_head(hidden, weight, norm_weight, outputs=outputs, impl=impl, **kw)  # warm-up / compile
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = lm_head(hidden, weight, norm_weight, outputs=outputs, impl=impl, **kw)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        out_bytes = sum(t.numel() * t.element_size() for t in out.as_dict().values())
        full = self.N * self.V * 4
        assert extra - out_bytes <= full // 4, (
            f"{impl}: {extra / 2**20:.0f} MiB extra ({out_bytes / 2**20:.0f} MiB outputs); "
            f"one fp32 [N, V] is {full / 2**20:.0f} MiB"
        )

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("k", [1, 64, 100])
    def test_exact_ties(self, impl, k):
        g = torch.Generator().manual_seed(k)
        hidden, weight = tie_inputs(g, 64, 128, 4099, torch.bfloat16, n_distinct=32)
        hidden, weight = hidden.cuda(), weight.cuda()
        draft = torch.arange(0, 4099, 3, device="cuda")
        kw = {"norm": "none", "k": k, "draft_ids": draft}
        oracle = lm_head_oracle(hidden, weight, None, **kw)
        yardstick = lm_head_oracle(hidden, weight, None, same_dtype=True, **kw)
        out = lm_head(hidden, weight, None, outputs=ALL_OUTPUTS, impl=impl, **kw)
        check_outputs(
            out,
            oracle,
            yardstick,
            outputs=ALL_OUTPUTS,
            atol=1e-5,
            rtol=1e-6,
            draft_ids=draft,
            exact_ids=True,
            label=f"[cuda {impl} ties k={k}]",
        )


# ------------------------------------------------------------------- lm_head_logits (drop-in)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "norm,scale,softcap", [("rms", 1.0, None), ("rms_one_plus", 0.5, 30.0), ("none", 1.0, None)]
)
def test_lm_head_logits_equals_lm_head_logits_output(dtype, norm, scale, softcap, gen):
    # The logits-only path is the same math as lm_head's "logits" output (same rounding of y,
    # same tiles), so on CPU it is bit-identical to it for the same plan. Another plan (row
    # blocks and chunks narrower than the vocabulary) may round the GEMM differently (MKL's
    # fp32 GEMM on AVX2 does), but must agree with the oracle just as closely.
    hidden, weight, norm_weight = make_inputs(gen, 37, 48, 700, dtype, norm=norm)
    kw = {"eps": 1e-5, "norm": norm, "logit_scale": scale, "softcap": softcap}
    want = lm_head(hidden, weight, norm_weight, outputs=("logits",), impl="torch", **kw).logits
    got = lm_head_logits(hidden, weight, norm_weight, **kw)
    assert got.dtype == torch.float32 and got.shape == (37, 700)
    assert torch.equal(got, want)
    oracle = lm_head_oracle(hidden, weight, norm_weight, **kw)
    assert_close(got, oracle.logits, atol=1e-4, rtol=1e-5, name="logits vs oracle")
    with small_chunks(256, rows=16):
        small = lm_head_logits(hidden, weight, norm_weight, **kw)
        small_out = lm_head(hidden, weight, norm_weight, outputs=("logits",), impl="torch", **kw)
    assert torch.equal(small, small_out.logits)
    assert_close(small, oracle.logits, atol=1e-4, rtol=1e-5, name="small tiles vs oracle")


def test_lm_head_logits_writes_into_a_row_slice(gen):
    # forward_eagle3 hands each row's slice of a [B, S, V] buffer: only those rows change.
    hidden, weight, norm_weight = make_inputs(gen, 5, 32, 300, torch.bfloat16)
    buf = torch.full((3, 8, 300), 7.0)
    res = lm_head_logits(hidden, weight, norm_weight, out=buf[1, :5])
    assert res.data_ptr() == buf[1, :5].data_ptr()
    assert torch.equal(buf[1, :5], lm_head_logits(hidden, weight, norm_weight))
    untouched = torch.ones(3, 8, dtype=torch.bool)
    untouched[1, :5] = False
    assert bool((buf[untouched] == 7.0).all())
    # leading dims are kept, and out may be given in them or flat
    h3 = hidden.reshape(1, 5, 32)
    assert lm_head_logits(h3, weight, norm_weight).shape == (1, 5, 300)
    flat = torch.empty(5, 300)
    assert lm_head_logits(h3, weight, norm_weight, out=flat) is flat
    assert lm_head_logits(hidden[:0], weight, norm_weight).shape == (0, 300)
    # row pieces: rows 0-1 go to buf[2, :2], rows 2-4 to buf[0, 5:8], nothing else changes
    buf = torch.full((3, 8, 300), 7.0)
    pieces = [buf[2, :2], buf[0, 5:8]]
    with small_chunks(128, rows=2):  # pieces split at a row-block edge: the same tiles
        assert lm_head_logits(hidden, weight, norm_weight, out=pieces) is pieces
        want = lm_head_logits(hidden, weight, norm_weight)
    assert torch.equal(buf[2, :2], want[:2]) and torch.equal(buf[0, 5:8], want[2:])
    untouched = torch.ones(3, 8, dtype=torch.bool)
    untouched[2, :2] = untouched[0, 5:8] = False
    assert bool((buf[untouched] == 7.0).all())


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: torch.empty(5, 300, dtype=torch.bfloat16), "must be float32"),
        (lambda: torch.empty(5, 299), "must have shape"),
        (lambda: torch.empty(300, 5).t(), "unit column stride"),
        (lambda: torch.empty(5, 600)[:, ::2], "unit column stride"),
        (lambda: [[0.0] * 300] * 5, "must be a torch.Tensor"),
        (lambda: torch.empty(5, 300, device="meta"), "is on meta"),
        (lambda: torch.empty(4, 300), "must have shape"),
        (lambda: [torch.empty(2, 300), torch.empty(2, 300)], "sum n_i = N"),
        (lambda: [torch.empty(2, 300), torch.empty(3, 300, dtype=torch.float16)], "out\\[1\\] must be float32"),
    ],
)
def test_lm_head_logits_rejects_bad_out(bad, match, gen):
    hidden, weight, norm_weight = make_inputs(gen, 5, 32, 300, torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        lm_head_logits(hidden, weight, norm_weight, out=bad())
    with pytest.raises(ValueError, match="hidden size mismatch"):
        lm_head_logits(hidden[:, :16], weight, norm_weight)


def test_avx2_caps_take_effect():
    # `make test-avx2` relies on these switches: under them torch dispatches its AVX2 kernels
    # whatever the hardware has (oneDNN and MKL read theirs at load time the same way).
    import subprocess
    import sys

    from eagle_fast.kernels._cpu import ISA_CAPS

    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **ISA_CAPS},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "AVX2"


@pytest.mark.parametrize(
    "outputs, exp_tiles",
    [(("draft", "argmax"), "draft"), (("argmax",), "none"), (("lse", "argmax"), "all"),
     (("draft", "lse"), "all"), (("topk",), "all")],
    ids=lambda o: "+".join(o) if isinstance(o, tuple) else o,
)
def test_exp_pass_runs_only_where_an_output_needs_it(outputs, exp_tiles, gen):
    # The logsumexp pass (an exp of every logit of a tile) is the per-logit cost beyond the
    # GEMM and one max. "draft" needs it over the draft columns only (its own logsumexp),
    # "argmax" nowhere; lse, logprobs and top-k over every tile. Counted through the head's
    # phase spans in a profile: one "gemm" span per tile, one "exp" span per tile that ran it.
    N, H, V = 10, 32, 1000
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, torch.float32)
    draft = random_draft(gen, V, 300)
    with small_chunks(128, rows=4), torch.profiler.profile() as prof:
        out = lm_head(hidden, weight, norm_weight, outputs=outputs, k=5, draft_ids=draft, impl="torch")
    spans = [e.name.removeprefix(SPAN_PREFIX) for e in prof.events() if e.name.startswith(SPAN_PREFIX)]
    blocks = -(-N // 4)
    # draft-first order (draft without top-k): the 300 draft columns in 3 chunks, then 6
    chunks = 3 + 6 if "draft" in outputs and "topk" not in outputs else -(-V // 128)
    tiles = spans.count("gemm")
    assert tiles == chunks * blocks, (tiles, chunks * blocks)
    want = {"all": tiles, "none": 0, "draft": 3 * blocks}[exp_tiles]
    assert spans.count("exp") == want, (spans.count("exp"), want, tiles)
    assert (out.lse is None) == (exp_tiles in ("draft", "none")), "lse must come back exactly when computed"
