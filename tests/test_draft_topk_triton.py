"""The Triton kernel's one-pass "draft_topk" (kernels/lm_head_triton.py, DRAFT_TOPK), in the interpreter.

What: one launch of the fused kernel per call; the exact re-run of rows whose draft top-k
crowds one vocab tile; exact ties (integer logits) to the lower draft index, across tiles
and across the re-run boundary; k = Vd; no [N, Vd] tensor unless "draft" is asked for too.
All against the float64 oracle, in the interpreter (tiles 512 wide; draft ids are walked
first, so more than 512 of them make several draft tiles); one `gpu` test runs the compiled
kernel at a moderate size.
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _oracle import lm_head_oracle
from eagle_fast.kernels import lm_head
from test_lm_head import _LargestTensor, make_inputs, random_draft, tie_inputs
from test_lm_head_triton_internal import _int_logit_inputs, cuda_case

lm = importlib.import_module("eagle_fast.kernels.lm_head_triton")


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def launches(monkeypatch):
    """The fused kernel's launches during the test: (DRAFT_TOPK, IS_RERUN, n_rounds)."""
    seen = []
    real = lm.run_kernel

    def spy(kernel, grid, interpret, *args, **kw):
        if kernel is lm.lm_head_fwd_kernel:
            seen.append((kw["DRAFT_TOPK"], kw["IS_RERUN"], args[18]))
        return real(kernel, grid, interpret, *args, **kw)

    monkeypatch.setattr(lm, "run_kernel", spy)
    return seen


class _NewLargest(_LargestTensor):
    """The largest storage created during the call, views of the given inputs excluded."""

    def __init__(self, *inputs):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() not in self.inputs and st.nbytes() > self.nbytes:
                    self.nbytes, self.op = st.nbytes(), str(func)
        return out


def _check_exact(out, oracle, label):
    assert_ids_equal(out.draft_topk_ids, oracle.draft_topk_ids, name=f"{label} draft_topk_ids")
    assert_ids_equal(out.argmax, oracle.argmax, name=f"{label} argmax")
    assert_ids_equal(out.argmax_in_draft, oracle.argmax_in_draft, name=f"{label} argmax_in_draft")
    assert_close(out.draft_topk_logprobs, oracle.draft_topk_logprobs, atol=1e-5, rtol=1e-6,
                 name=f"{label} draft_topk_logprobs")  # fmt: skip
    assert_close(out.draft_topk_tail, oracle.draft_topk_tail, atol=1e-7, rtol=1e-5,
                 name=f"{label} draft_topk_tail")  # fmt: skip


def test_draft_topk_is_one_launch(gen, launches):
    hidden, weight, norm_weight = make_inputs(gen, 20, 64, 1100, torch.bfloat16)
    draft = random_draft(gen, 1100, 400)
    for outputs in (("draft_topk",), ("draft_topk", "lse", "draft")):
        launches.clear()
        lm_head(hidden, weight, norm_weight, outputs=outputs, k=8, draft_ids=draft, impl="triton")
        assert launches == [(True, False, 8)], f"{outputs}: {launches}"


@pytest.mark.parametrize("rounds,k", [(2, 6), (8, 16)], ids=["rounds2-k6", "rounds8-k16"])
@pytest.mark.parametrize("outputs", [("draft_topk",), ("draft_topk", "lse", "draft")], ids="+".join)
def test_crowded_draft_tiles_are_recomputed_exactly(rounds, k, outputs, monkeypatch, launches):
    """The first pass keeps `rounds` candidates per tile; rows whose draft top-k crowd one
    tile (k > rounds) must be re-run on that tile and come out exactly right."""
    monkeypatch.setattr(lm, "_TOPK_ROUNDS", rounds)
    redo_rows = []
    real_redo = lm._Head._redo_topk

    def spy(self, r0, sat, *args):
        redo_rows.extend((sat.any(1).nonzero().squeeze(1) + r0).tolist())
        return real_redo(self, r0, sat, *args)

    monkeypatch.setattr(lm._Head, "_redo_topk", spy)
    g = torch.Generator().manual_seed(3)
    N, V = 20, 2200
    logits = torch.randint(-40, 20, (N, V), generator=g).float()
    # 1100 draft ids: the draft-first walk puts them in 3 tiles (512, 512, 76 of them; the
    # last also holds 436 non-draft ids), and 2 more tiles hold the rest of the vocabulary
    draft = torch.arange(1, V, 2)
    crowded = [0, 4, 9, 19]
    for r in crowded:  # the row's best draft columns, with ties, inside one draft tile
        cols = draft[512 * (r % 3) :][: k + 2]
        logits[r, cols] = 30.0 + torch.arange(k + 2).remainder(4).float()
        logits[r, cols[0] - 1] = 45.0  # a non-draft column holds the full-vocab argmax
    hidden, weight = _int_logit_inputs(logits)
    out = lm_head(hidden, weight, None, norm="none", outputs=outputs, k=k, draft_ids=draft,
                  impl="triton")  # fmt: skip
    assert set(crowded) <= set(redo_rows), f"crowded rows {crowded}, re-run {sorted(redo_rows)}"
    reruns = [x for x in launches if x[1]]
    assert reruns and all(x[0] and x[2] == k for x in reruns), launches
    oracle = lm_head_oracle(hidden, weight, None, norm="none", k=k, draft_ids=draft)
    _check_exact(out, oracle, "crowded")
    assert not bool(out.argmax_in_draft[crowded].any())
    if "lse" in outputs:
        assert_close(out.lse, oracle.lse, atol=1e-5, rtol=1e-6, name="lse")
        assert_close(out.draft_logprobs, oracle.draft_logprobs, atol=1e-5, rtol=1e-6,
                     name="draft_logprobs")  # fmt: skip
    else:
        assert out.lse is None and out.draft_logprobs is None


@pytest.mark.parametrize("rounds", [2, 8])
@pytest.mark.parametrize("k", [1, 5, 16, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_draft_topk_exact_ties_go_to_lower_index(rounds, k, dtype, gen, monkeypatch):
    # Integer logits with every value repeated: the k-th place is tied, the ties straddle
    # the 3 draft tiles (1500 draft ids walked first) and (rounds=2) the candidates kept per
    # tile; the lower draft index wins.
    monkeypatch.setattr(lm, "_TOPK_ROUNDS", rounds)
    N, H, V = 9, 32, 2200
    hidden, weight = tie_inputs(gen, N, H, V, dtype, n_distinct=12)
    draft = random_draft(gen, V, 1500)
    out = lm_head(hidden, weight, None, norm="none", outputs=("draft_topk",), k=k,
                  draft_ids=draft, impl="triton")  # fmt: skip
    oracle = lm_head_oracle(hidden, weight, None, norm="none", k=k, draft_ids=draft)
    _check_exact(out, oracle, f"k={k} rounds={rounds}")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_draft_topk_k_equals_draft_size(out_dtype, gen):
    hidden, weight, norm_weight = make_inputs(gen, 6, 32, 1100, torch.float32)
    draft = random_draft(gen, 1100, 90)
    out = lm_head(hidden, weight, norm_weight, outputs=("draft_topk", "draft"), k=90,
                  draft_ids=draft, out_dtype=out_dtype, impl="triton")  # fmt: skip
    assert float(out.draft_topk_tail.max()) <= 1e-7
    assert_ids_equal(out.draft_topk_ids.sort(-1).values, torch.arange(90).expand(6, 90),
                     name="every draft index once")  # fmt: skip
    dense = torch.full_like(out.draft_logprobs, float("nan"))
    dense.scatter_(1, out.draft_topk_ids, out.draft_topk_logprobs)
    tol = 2e-6 if out_dtype == torch.float32 else 1e-2
    assert_close(dense, out.draft_logprobs, atol=tol, rtol=tol, name="scattered top-k = draft")
    oracle = lm_head_oracle(hidden, weight, norm_weight, k=90, draft_ids=draft)
    assert_close(out.draft_topk_logprobs, oracle.draft_topk_logprobs, atol=tol, rtol=tol,
                 name="draft_topk_logprobs")  # fmt: skip


def test_draft_topk_launch_builds_no_draft_sized_tensor(gen):
    # The sparse target's point: no [N, Vd] buffer. "draft" (dense) is the control.
    N, H, V = 32, 64, 1100
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, torch.bfloat16)
    draft = torch.arange(0, 1024)
    dense = N * draft.numel() * 4
    kw = {"k": 16, "draft_ids": draft, "impl": "triton"}
    for outputs in (("draft_topk",), ("draft_topk", "lse")):
        with _NewLargest(hidden, weight, norm_weight, draft) as seen:
            lm_head(hidden, weight, norm_weight, outputs=outputs, **kw)
        assert seen.nbytes <= dense // 4, f"{outputs}: {seen.op} made {seen.nbytes} B; N x Vd x 4 = {dense}"
    with _NewLargest(hidden, weight, norm_weight, draft) as seen:
        lm_head(hidden, weight, norm_weight, outputs=("draft_topk", "draft"), **kw)
    assert seen.nbytes >= dense, f"tracker missed the draft buffer ({seen.nbytes} B)"


@pytest.mark.gpu
@pytest.mark.parametrize("outputs", [("draft_topk",), ("draft_topk", "lse", "draft")], ids="+".join)
def test_compiled_draft_topk_matches_oracle_on_cuda(outputs):
    # k=64 > the 8 first-pass candidates per tile: crowded tiles are re-run compiled too
    hidden, weight, nw, draft, k = cuda_case(6, 4)
    out = lm_head(hidden, weight, nw, outputs=outputs, k=k, draft_ids=draft, impl="triton")
    oracle = lm_head_oracle(hidden, weight, nw, k=k, draft_ids=draft)
    got = oracle.draft_logprobs.gather(1, out.draft_topk_ids)
    assert_close(got, oracle.draft_topk_logprobs, atol=1e-3, rtol=0, name="oracle at ids")
    assert_close(out.draft_topk_logprobs, oracle.draft_topk_logprobs, atol=1e-3, rtol=1e-5,
                 name="draft_topk_logprobs")  # fmt: skip
    assert_close(out.draft_topk_tail, oracle.draft_topk_tail, atol=1e-4, rtol=1e-3, name="tail")
    best = oracle.logits.gather(1, out.argmax[:, None]).squeeze(1)
    assert_close(best, oracle.logits.amax(1), atol=1e-3, rtol=0, name="logit at argmax")
    if "lse" in outputs:
        assert_close(out.lse, oracle.lse, atol=1e-4, rtol=1e-5, name="lse")
        assert_close(out.draft_logprobs, oracle.draft_logprobs, atol=1e-3, rtol=1e-5, name="draft")
