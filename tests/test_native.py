"""The CPU head's compiled walk (`eagle_fast.kernels._native`, `kernels/csrc/head_cpu.c`).

What: ("draft", "argmax") on bf16 weights through `lm_head`, which takes the compiled walk where
`_native.kind()` names one (AMX or AVX512-BF16, uncapped) and the PyTorch path elsewhere (AVX2,
the AVX2-capped pass, no compiler):
  - the oracle rule of tests/test_lm_head.py (float outputs within 2x the same-dtype
    yardstick's error + atol; ids by value) on shapes with every tail (N, V not multiples of
    32; one draft id; every id a draft id; several segments), fp32 and bf16 out_dtype;
  - exact ties on small-integer data go to the lowest id, across segments and between draft
    and other columns;
  - the same bytes run to run, for 1, 2 and 3 threads, per token whatever else is in the
    call (rows alone vs in a batch), and whether pass 2 recomputes or reads the draft logits;
  - each CPU's own kernel by default (AMX on AMX, AVX512-BF16 without AMX);
  - the fallbacks: logits not provably finite, H not a multiple of 32, switched off, no C
    compiler (with the reason named); the build is cached and atomic.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _oracle import lm_head_oracle
from eagle_fast.kernels import _native, lm_head, lm_head_torch
from eagle_fast.kernels._cpu import hardware_isa, isa_capped
from test_lm_head import check_outputs


@pytest.fixture(autouse=True, params=_native.VARIANTS)
def variant(request):
    """Every test under each kernel variant: AMX, and AVX512-BF16 (the kernel for CPUs without
    AMX; it runs on an AMX CPU too, so it is tested wherever either runs)."""
    with _native.variant(request.param):
        yield request.param


def here() -> bool:
    return _native.kind() is not None


def need_walk():
    if not here():
        pytest.skip(f"the compiled walk does not run here: {_native.report()}")
ATOL, RTOL = 1e-4, 1e-5


def _inputs(n, h, v, vd, seed, logit_std=4.0, draft=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * logit_std / math.sqrt(h)).bfloat16()
    norm_weight = (1 + 0.2 * torch.randn(h, generator=g)).bfloat16()
    ids = torch.randperm(v, generator=g)[:vd].sort().values if draft is None else draft
    return hidden, weight, norm_weight, ids


def _call(hidden, weight, norm_weight, ids, outputs=("draft", "argmax"), **kw):
    """lm_head's `outputs` and whether the compiled walk served the call."""
    real = _native.draft_argmax
    served = []

    def spy(*a, **k):
        got = real(*a, **k)
        served.append(got is not None)
        return got

    with mock.patch.object(lm_head_torch, "native_draft_argmax", spy):
        out = lm_head(hidden, weight, norm_weight, outputs=outputs, draft_ids=ids, impl="torch", **kw)
    return out, any(served)


def _check_oracle(out, hidden, weight, norm_weight, ids, outputs=("draft", "argmax"), out_dtype=torch.float32):
    """test_lm_head's oracle rule (`check_outputs`) for one call."""
    check_outputs(out, lm_head_oracle(hidden, weight, norm_weight, draft_ids=ids),
                  lm_head_oracle(hidden, weight, norm_weight, draft_ids=ids, same_dtype=True), outputs=outputs,
                  atol=ATOL, rtol=RTOL, out_dtype=out_dtype, draft_ids=ids)


@pytest.mark.parametrize("n,h,v,vd", [
    (1, 32, 100, 1),          # one token, one draft id, one 100-row tail block
    (37, 64, 1000, 300),      # N and V off the 32-grid
    (100, 96, 777, 777),      # every id a draft id
    (65, 128, 4099, 2000),    # many segments (V / 64 rows each), a 3-row tail
    (48, 256, 2048, 64),      # few draft ids, aligned everything
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("outputs", [("draft", "argmax"), ("draft", "lse")], ids=["draft", "draft+lse"])
def test_matches_oracle(n, h, v, vd, out_dtype, outputs):
    hidden, weight, norm_weight, ids = _inputs(n, h, v, vd, seed=n * 7 + v)
    out, served = _call(hidden, weight, norm_weight, ids, outputs, out_dtype=out_dtype)
    assert served == here(), f"compiled walk served: {served}, available here: {_native.report()}"
    assert (out.lse is not None) == ("lse" in outputs)
    _check_oracle(out, hidden, weight, norm_weight, ids, outputs, out_dtype)


def test_first_and_last_ids_in_the_draft():
    v = 1000
    ids = torch.tensor([0, 1, 31, 32, 500, v - 33, v - 2, v - 1])
    hidden, weight, norm_weight, ids = _inputs(20, 64, v, 0, seed=5, draft=ids)
    out, served = _call(hidden, weight, norm_weight, ids)
    assert served == here()
    _check_oracle(out, hidden, weight, norm_weight, ids)


def test_large_logits_keep_the_logsumexp():
    hidden, weight, norm_weight, ids = _inputs(33, 64, 1500, 400, seed=9, logit_std=60.0)
    out, served = _call(hidden, weight, norm_weight, ids, ("draft", "lse"))
    assert served == here()
    _check_oracle(out, hidden, weight, norm_weight, ids, ("draft", "lse"))


def test_exact_ties_go_to_the_lowest_id():
    """Small-integer data: every logit is exact in any order, and each row's max repeats in
    many columns of several segments, draft and not; the lowest id must win."""
    g = torch.Generator().manual_seed(3)
    n, h, v = 40, 32, 4099
    hidden = torch.randint(-2, 3, (n, h), generator=g).bfloat16()
    weight = torch.randint(-2, 3, (20, h), generator=g).bfloat16()[torch.randint(0, 20, (v,), generator=g)]
    ids = torch.randperm(v, generator=g)[:1500].sort().values
    out, served = _call(hidden, weight, None, ids, ("draft", "lse"), norm="none")
    assert served == here()
    oracle = lm_head_oracle(hidden, weight, None, norm="none", draft_ids=ids)
    assert_ids_equal(out.argmax, oracle.argmax, name="argmax")
    assert_close(out.lse, oracle.lse, atol=1e-5, rtol=1e-6, name="lse")
    assert_close(out.draft_logprobs, oracle.draft_logprobs, atol=1e-5, rtol=1e-6, name="draft_logprobs")


def test_same_bytes_run_to_run_and_for_any_thread_count():
    need_walk()
    hidden, weight, _, ids = _inputs(200, 128, 3001, 900, seed=11)
    from eagle_fast.kernels._torch_screen import norm_upper

    y_norm, w_max = norm_upper(hidden), float(norm_upper(weight).max())
    runs = [_native.draft_argmax(hidden, weight, ids, y_norm, w_max, threads=t, lse=True, out_dtype=dt)
            for t, dt in ((1, torch.float32), (2, torch.float32), (3, torch.float32), (2, torch.float32))]
    bf16 = [_native.draft_argmax(hidden, weight, ids, y_norm, w_max, threads=t, out_dtype=torch.bfloat16)[0]
            for t in (1, 3)]
    assert runs[0][0].dtype == torch.float32 and bf16[0].dtype == torch.bfloat16
    assert torch.equal(bf16[0].view(torch.int16), bf16[1].view(torch.int16))
    assert torch.equal(bf16[0].view(torch.int16), runs[0][0].bfloat16().view(torch.int16))  # rounded once
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b)
    # a token's bytes do not depend on the other rows of its call
    alone = _native.draft_argmax(hidden[150:151], weight, ids, y_norm[150:151], w_max, lse=True)
    for a, b in zip(alone, runs[0]):
        assert torch.equal(a[0], b[150])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_stored_and_recomputed_draft_logits_give_the_same_bytes(out_dtype, monkeypatch):
    """Pass 2 either recomputes the draft logits or reads those pass 1 stored (a bf16 output's
    scratch holds a group of tokens at a time: here 64, so the call takes several groups)."""
    need_walk()
    from eagle_fast.kernels._torch_screen import norm_upper

    hidden, weight, _, ids = _inputs(150, 96, 2500, 700, seed=19)
    monkeypatch.setattr(_native, "SCRATCH_BYTES", 64 * 4 * ids.numel())
    y_norm, w_max = norm_upper(hidden), float(norm_upper(weight).max())
    got = [_native.draft_argmax(hidden, weight, ids, y_norm, w_max, threads=t, lse=True, out_dtype=out_dtype,
                                recompute=r) for r, t in ((True, 1), (False, 2))]
    (logprobs, argmax, lse), (logprobs2, argmax2, lse2) = got
    assert logprobs.dtype == out_dtype
    assert torch.equal(logprobs.view(torch.uint8), logprobs2.view(torch.uint8))
    assert torch.equal(argmax, argmax2) and torch.equal(lse.view(torch.int32), lse2.view(torch.int32))


def test_falls_back_where_it_cannot_promise_finite_logits():
    hidden, weight, norm_weight, ids = _inputs(40, 64, 600, 100, seed=2)
    weight = weight.clone()
    weight[7, 3] = float("inf")
    out, served = _call(hidden, weight, norm_weight, ids)
    assert not served
    with _native.switched(False):
        ref = lm_head(hidden, weight, norm_weight, outputs=("draft", "argmax"), draft_ids=ids, impl="torch")
    assert torch.equal(out.argmax, ref.argmax)
    assert torch.equal(out.draft_logprobs.isnan(), ref.draft_logprobs.isnan())


def test_other_shapes_and_switches_take_the_pytorch_path():
    hidden, weight, norm_weight, ids = _inputs(40, 48, 600, 100, seed=4)  # H not a multiple of 32
    assert not _call(hidden, weight, norm_weight, ids)[1]
    hidden, weight, norm_weight, ids = _inputs(40, 64, 600, 100, seed=4)
    with _native.switched(False):
        assert not _call(hidden, weight, norm_weight, ids)[1]
    assert not _call(hidden, weight, norm_weight, ids, softcap=30.0)[1]
    assert not _call(hidden, weight, norm_weight, ids, ("draft", "topk"), k=4)[1]
    assert not _call(hidden.float(), weight.float(), norm_weight.float(), ids)[1]


def test_by_default_each_cpu_runs_its_own_kernel():
    """No switch set: an AMX CPU runs the AMX kernel, an AVX512-BF16 CPU without AMX the
    AVX512-BF16 one, any other CPU (or one capped to AVX2, or without a compiler) neither."""
    env = {k: v for k, v in os.environ.items() if k != "EAGLE_FAST_CPU_NATIVE"}
    got = subprocess.run([sys.executable, "-c", "from eagle_fast.kernels import _native; print(_native.kind())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    own = {"AMX": "amx", "AVX512-BF16": "avx512-bf16"}.get(hardware_isa())
    assert got == str(None if isa_capped() or _native.library() is None else own)


def test_without_a_compiler_the_reason_is_named(monkeypatch):
    monkeypatch.setattr(_native, "_compiler", lambda: None)
    monkeypatch.setattr(_native, "_BUILD_ERROR", [])
    assert _native.library.__wrapped__() is None
    assert "no C compiler" in _native.build_error()


@pytest.mark.skipif(_native._compiler() is None, reason="no C compiler here")
def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_FAST_NATIVE_CACHE", str(tmp_path))
    first = _native._build(_native._compiler())
    stamp = first.stat().st_mtime_ns
    assert _native._build(_native._compiler()) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_both_passes_see_the_same_logits():
    """Pass 1 picks the argmax from its logits, pass 2 writes its own logits minus the lse: they
    must be the same logits, bit for bit. Rows a and b hold the same products in another k order
    (y repeats every 32 columns, b is a with its 32-column blocks rotated), so their exact
    logits tie and their fp32 sums differ by rounding on many rows: wherever pass 2's log-probs
    of a and b differ, pass 1 must have picked the larger. Then, every id a draft id on unit-scale
    logits: the log-probs sum to one."""
    need_walk()
    from eagle_fast.kernels._torch_screen import norm_upper

    g = torch.Generator().manual_seed(3)
    n, h, v, a, b = 300, 128, 1000, 500, 501
    hidden = (torch.rand(n, 32, generator=g) + 0.1).repeat(1, h // 32).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.01).bfloat16()
    weight[a] = (torch.rand(h, generator=g) * 3).bfloat16()
    weight[b] = torch.cat([weight[a][32:], weight[a][:32]])
    logprobs, argmax, _ = _native.draft_argmax(hidden, weight, torch.arange(v), norm_upper(hidden),
                                               float(norm_upper(weight).max()), lse=True)
    assert bool(((argmax == a) | (argmax == b)).all())
    differ = logprobs[:, a] != logprobs[:, b]
    assert int(differ.sum()) > 10, "the rotated rows never round apart: the test cannot tell the passes apart"
    larger = torch.where(logprobs[:, a] > logprobs[:, b], a, b)
    assert torch.equal(argmax[differ], larger[differ])
    # logits of unit scale (the lse is fp32: its rounding is the tolerance)
    hidden, weight, _, _ = _inputs(70, 96, 1200, 0, seed=13)
    logprobs, _, _ = _native.draft_argmax(hidden, weight, torch.arange(1200), norm_upper(hidden),
                                          float(norm_upper(weight).max()))
    assert_close(torch.logsumexp(logprobs.double(), 1), torch.zeros(70, dtype=torch.float64), atol=1e-6, rtol=0,
                 name="logsumexp of the draft log-probs")


def test_packed_draft_rows_follow_the_weight_and_the_ids():
    need_walk()
    hidden, weight, norm_weight, ids = _inputs(40, 64, 900, 200, seed=17)
    first = _call(hidden, weight, norm_weight, ids)[0]
    weight.mul_(-1.5)  # in place: same storage, a new version
    out, served = _call(hidden, weight, norm_weight, ids)
    assert served
    _check_oracle(out, hidden, weight, norm_weight, ids)
    assert not torch.equal(out.draft_logprobs, first.draft_logprobs)
    ids[:5] = torch.arange(5) * 3  # the ids in place too (still sorted and distinct)
    assert bool((ids[1:] > ids[:-1]).all())
    out, _ = _call(hidden, weight, norm_weight, ids)
    _check_oracle(out, hidden, weight, norm_weight, ids)


def test_padded_supervision_asks_the_walk_for_its_dtype_with_the_same_bits():
    """`supervise` into [B, S] fields asks a head the compiled walk serves for bf16 directly
    (half the staging, no fp32 copy); the bits are those of rounding its fp32 results."""
    from eagle_fast import supervision as SV
    from eagle_fast.head import HeadSpec, TargetHead

    hidden, weight, norm_weight, ids = _inputs(90, 64, 700, 150, seed=21)
    head = TargetHead(weight, norm_weight, HeadSpec(norm="rms", eps=1e-6))
    assert head.rounds_once(("draft", "argmax")) == here()
    assert not head.rounds_once(("draft", "topk"), k=4)
    finals = [hidden[:50], hidden[50:]]
    got, dtypes = {}, []
    real = head.compute

    def compute(*a, **k):
        dtypes.append(k["out_dtype"])
        return real(*a, **k)

    for label, once in (("asked", here()), ("rounded", False)):
        into = SV.PaddedFields(2, 50, torch.device("cpu"), torch.bfloat16)
        with mock.patch.object(head, "rounds_once", return_value=once), mock.patch.object(head, "compute", compute):
            SV.supervise(head, list(finals), ("draft", "argmax"), into, draft_ids=ids, out_dtype=torch.bfloat16)
        got[label] = into.fields
    assert dtypes[0] == (torch.bfloat16 if here() else torch.float32) and dtypes[-1] == torch.float32
    assert got["asked"].keys() == got["rounded"].keys()
    for name, t in got["asked"].items():
        assert torch.equal(t.view(torch.uint8) if t.is_floating_point() else t,
                           got["rounded"][name].view(torch.uint8) if t.is_floating_point() else got["rounded"][name]), name
