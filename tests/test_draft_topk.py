"""The sparse draft target, `lm_head(..., outputs=("draft_topk", ...))`, against the float64 oracle.

What: the k most likely draft ids (indices into draft_ids), their log-probs over the draft
vocabulary and the draft mass outside them, under impl="torch" (default and 64-column chunks,
so the draft range spans chunks and ends inside one) and impl="triton" (the interpreter);
exact ties; k at its edges (1, beyond one chunk, Vd); combinations with lse / draft; no
[N, Vd] buffer on the PyTorch path; the refusals.
Tolerances follow test_lm_head (2 x the same-dtype yardstick's error + atol); ids are checked
by value on random data and exactly on small-integer data.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _oracle import lm_head_oracle
from eagle_fast.kernels import lm_head
from test_lm_head import (
    _LargestTensor,
    _max_err,
    make_inputs,
    random_draft,
    small_chunks,
    tie_inputs,
)


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh inputs per case, reproducible per case (seeded by the test id)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1e-4, 1e-5, id="bf16"),
]


def _runs(impl, hidden, weight, norm_weight, **kw):
    outs = [(impl, lm_head(hidden, weight, norm_weight, impl=impl, **kw))]
    if impl == "torch":
        with small_chunks():
            outs.append(("torch/chunk64", lm_head(hidden, weight, norm_weight, impl=impl, **kw)))
    return outs


def _check(out, oracle, yardstick, *, k, draft, atol, rtol, label):
    assert out.draft_topk_ids.dtype == torch.int64 and out.draft_topk_ids.shape[-1] == k
    assert out.draft_topk_tail.dtype == torch.float32
    ids = out.draft_topk_ids
    assert bool(((ids >= 0) & (ids < draft.numel())).all()), f"{label}: ids outside [0, Vd)"
    s = ids.sort(-1).values
    assert bool((s[..., 1:] > s[..., :-1]).all()), f"{label}: repeated draft top-k ids"
    # by value: the oracle's draft log-prob at each returned index is the k-th best there
    tol = 2 * _max_err(yardstick.draft_logprobs, oracle.draft_logprobs) + atol
    got = oracle.draft_logprobs.gather(-1, ids)
    assert_close(got, oracle.draft_topk_logprobs, atol=tol, rtol=0, name=f"{label} oracle at ids")
    for name in ("draft_topk_logprobs", "draft_topk_tail"):
        err_same = _max_err(getattr(yardstick, name), getattr(oracle, name))
        assert_close(getattr(out, name), getattr(oracle, name), atol=2 * err_same + atol,
                     rtol=rtol, name=f"{label} {name}")
    # the stored log-probs and the tail add up to the whole draft distribution
    total = out.draft_topk_logprobs.double().exp().sum(-1) + out.draft_topk_tail.double()
    assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0, name=f"{label} mass")
    want_in = torch.isin(out.argmax, draft)
    assert_ids_equal(out.argmax_in_draft, want_in, name=f"{label} argmax_in_draft")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("N,H,V,Vd,k", [(5, 64, 1001, 333, 7), (17, 96, 700, 450, 16), (1, 32, 300, 100, 1)])
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_draft_topk_matches_oracle(impl, N, H, V, Vd, k, dtype, atol, rtol, gen):
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, dtype)
    draft = random_draft(gen, V, Vd)
    kw = {"k": k, "draft_ids": draft}
    oracle = lm_head_oracle(hidden, weight, norm_weight, **kw)
    yardstick = lm_head_oracle(hidden, weight, norm_weight, same_dtype=True, **kw)
    for outputs in (("draft_topk",), ("draft_topk", "lse"), ("draft_topk", "draft", "argmax")):
        for label, out in _runs(impl, hidden, weight, norm_weight, outputs=outputs, **kw):
            label = f"[{label} {outputs}]"
            _check(out, oracle, yardstick, k=k, draft=draft, atol=atol, rtol=rtol, label=label)
            best = oracle.logits.max(-1).values
            at = oracle.logits.gather(-1, out.argmax[:, None]).squeeze(-1)
            assert_close(at, best, atol=1e-4, rtol=1e-5, name=f"{label} oracle logit at argmax")
            if "lse" in outputs:
                assert_close(out.lse, oracle.lse, atol=atol + 1e-5, rtol=rtol, name=f"{label} lse")
            else:
                assert out.lse is None, f"{label}: lse computed though not asked for"
            if "draft" in outputs:
                assert_close(out.draft_logprobs, oracle.draft_logprobs, atol=1e-4, rtol=rtol,
                             name=f"{label} draft_logprobs")
            else:
                assert out.draft_logprobs is None
            assert out.topk_ids is None and out.logits is None


@pytest.mark.parametrize("k", [1, 5, 100, 150])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_draft_topk_exact_ties_go_to_lower_index(k, dtype, gen):
    # Integer logits, every value repeated: the k-th place is tied, and the draft ids are
    # scattered so ties straddle chunks. The lower draft index (= lower target id) wins.
    N, H, V = 9, 32, 400
    hidden, weight = tie_inputs(gen, N, H, V, dtype, n_distinct=12)
    draft = random_draft(gen, V, 150)
    oracle = lm_head_oracle(hidden, weight, None, norm="none", k=k, draft_ids=draft)
    for chunk in (64, 100, 4096):
        with small_chunks(chunk, rows=4):
            out = lm_head(hidden, weight, None, norm="none", outputs=("draft_topk",), k=k,
                          draft_ids=draft, impl="torch")
        assert_ids_equal(out.draft_topk_ids, oracle.draft_topk_ids, name=f"chunk {chunk} ids")
        assert_ids_equal(out.argmax, oracle.argmax, name=f"chunk {chunk} argmax")
        assert_close(out.draft_topk_tail, oracle.draft_topk_tail, atol=1e-6, rtol=1e-5,
                     name=f"chunk {chunk} tail")


def test_draft_topk_k_equals_draft_size_leaves_no_tail(gen):
    hidden, weight, norm_weight = make_inputs(gen, 6, 32, 500, torch.float32)
    draft = random_draft(gen, 500, 90)
    for label, out in _runs("torch", hidden, weight, norm_weight, outputs=("draft_topk",), k=90,
                            draft_ids=draft):
        assert float(out.draft_topk_tail.max()) <= 1e-7, label
        ref = lm_head(hidden, weight, norm_weight, outputs=("draft",), draft_ids=draft, impl="torch")
        dense = torch.full_like(ref.draft_logprobs, float("nan"))
        dense.scatter_(1, out.draft_topk_ids, out.draft_topk_logprobs)
        assert_close(dense, ref.draft_logprobs, atol=2e-6, rtol=1e-6, name=f"{label} all of it")


def test_draft_topk_tail_keeps_relative_accuracy(gen):
    # A peaked draft distribution: the tail is ~1e-9 of the mass, far below what 1 - sum(top-k)
    # could resolve in fp32 (~k x 6e-8); it must still be right to 1e-3 relative.
    N, H, V = 4, 16, 600
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, torch.float32, logit_std=12.0)
    draft = torch.arange(0, V, 2)
    oracle = lm_head_oracle(hidden, weight, norm_weight, k=40, draft_ids=draft)
    out = lm_head(hidden, weight, norm_weight, outputs=("draft_topk",), k=40, draft_ids=draft,
                  impl="torch")
    tail = oracle.draft_topk_tail
    assert float(tail.max()) < 1e-5, "not peaked enough to test the tail"
    assert_close(out.draft_topk_tail, tail, atol=1e-30, rtol=1e-3, name="small tail")


def test_draft_topk_never_builds_a_draft_sized_tensor(gen):
    # The point of the sparse target: no [N, Vd] buffer. "draft" (dense) is the control.
    N, H, V = 128, 16, 16_384
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, torch.bfloat16)
    draft = torch.arange(0, V, 2)  # Vd = 8192: one [N, Vd] fp32 buffer is 4 MiB
    dense = N * draft.numel() * 4
    kw = {"k": 16, "draft_ids": draft, "impl": "torch"}
    with _LargestTensor() as seen:
        lm_head(hidden, weight, norm_weight, outputs=("draft_topk",), **kw)
    assert seen.nbytes <= dense // 4, f"{seen.op} returned {seen.nbytes} bytes; N x Vd x 4 = {dense}"
    with _LargestTensor() as seen:
        lm_head(hidden, weight, norm_weight, outputs=("draft",), **kw)
    assert seen.nbytes >= dense, f"tracker missed the draft buffer ({seen.nbytes} bytes)"


@pytest.mark.parametrize(
    "outputs,kw,match",
    [
        (("draft_topk", "topk"), {"k": 4}, r"cannot be combined with \['topk'\]"),
        (("draft_topk", "logits"), {"k": 4}, r"cannot be combined with \['logits'\]"),
        (("draft_topk",), {"k": 11}, r"k must be in \[1, Vd=10\]"),
        (("draft_topk",), {"k": 0}, r"k must be in \[1, Vd=10\]"),
        (("draft_topk",), {"k": 2.0}, "k must be an int"),
        (("draft_topk",), {"k": 2, "draft_ids": None}, "include .draft_topk. but draft_ids is missing"),
    ],
)
def test_draft_topk_refusals(outputs, kw, match, gen):
    hidden, weight, norm_weight = make_inputs(gen, 3, 8, 50, torch.float32)
    kw = {"draft_ids": torch.arange(10), **kw}
    with pytest.raises(ValueError, match=match):
        lm_head(hidden, weight, norm_weight, outputs=outputs, impl="torch", **kw)


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_draft_topk_empty_rows(lead, gen):
    hidden, weight, norm_weight = make_inputs(gen, 1, 8, 50, torch.float32)
    hidden = hidden.new_zeros(*lead, 8)
    out = lm_head(hidden, weight, norm_weight, outputs=("draft_topk",), k=3,
                  draft_ids=torch.arange(10), out_dtype=torch.bfloat16, impl="torch")
    assert out.draft_topk_ids.shape == (*lead, 3) and out.draft_topk_ids.dtype == torch.int64
    assert out.draft_topk_logprobs.shape == (*lead, 3)
    assert out.draft_topk_logprobs.dtype == torch.bfloat16
    assert out.draft_topk_tail.shape == lead and out.argmax_in_draft.shape == lead
