"""The screened argmax (`kernels/_torch_screen.py`) returns exactly what the exact walk returns.

What: ("draft", "argmax") on bf16 weights with the screen on and off (`switched`)
must agree byte for byte (argmax, argmax_in_draft, draft_logprobs) on random targets, on
exact ties between draft and non-draft columns (copied weight rows, on both sides of the draft
id), on integer data, on near-ties, and on the trained tiny target; the bounds the screen rests
on hold against the two GEMMs they bound, and a bound without its accumulation term fails
(negative control); non-finite input leaves the screen out.
Limits: the screen runs only where MKL's bf16 GEMM runs in hardware (AVX512-BF16/AMX): the
tests are skipped elsewhere, with the reason shown.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from eagle_fast.kernels import _cpu, _native, lm_head, lm_head_torch
from eagle_fast.kernels._torch_screen import (
    counting,
    fp32_gap,
    norm_upper,
    screen_bound,
    switched,
    verify_pairs,
)

from eagle_fast import tiny

pytestmark = pytest.mark.skipif(not _cpu.bf16_gemm_available(),
                                reason="the screen needs MKL's bf16 GEMM in hardware (AVX512-BF16/AMX)")


@pytest.fixture(autouse=True)
def _no_compiled_walk():
    """The screen serves ("draft", "argmax") only where the compiled walk does not (`_native`)."""
    with _native.switched(False):
        yield


@contextmanager
def _tiles(chunk: int | None, rows: int | None):
    """The exact walk (and so the screen) with `chunk` columns x `rows` rows per tile."""
    if chunk is None:
        yield
        return
    with mock.patch.object(lm_head_torch, "choose_chunk", lambda *a, **kw: chunk), \
         mock.patch.object(lm_head_torch, "choose_row_block", lambda *a, **kw: rows):
        yield


def _both(hidden, weight, norm_weight, draft_ids, chunk=None, rows=None):
    """(screened output, exact output, the screened call's `counting()`)."""
    outs = {}
    for on in (True, False):
        with switched(on), counting() as counts, _tiles(chunk, rows):
            outs[on] = lm_head(hidden, weight, norm_weight, outputs=("draft", "argmax"),
                               draft_ids=draft_ids, impl="torch")
        if on:
            screened = dict(counts)
    return outs[True], outs[False], screened


def _assert_same(a, b):
    bad = (a.argmax != b.argmax).nonzero(as_tuple=True)[0]
    assert bad.numel() == 0, f"{bad.numel()} rows differ, first {bad[:5].tolist()}: " \
                             f"{a.argmax[bad[:5]].tolist()} vs {b.argmax[bad[:5]].tolist()}"
    assert torch.equal(a.argmax_in_draft, b.argmax_in_draft)
    assert torch.equal(a.draft_logprobs.view(torch.int32), b.draft_logprobs.view(torch.int32))


def _inputs(n, h, v, vd, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(n, h, generator=g)).bfloat16()
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    draft_ids = torch.randperm(v, generator=g)[:vd].sort().values
    return hidden, weight, norm_weight, draft_ids


@pytest.mark.parametrize("n, h, v, vd, chunk, rows", [
    (300, 64, 5003, 1000, 256, 64),     # many tiles, ragged last chunk and row block
    (200, 256, 20000, 4000, None, None),  # the walk's own tiling
    (160, 1000, 3001, 500, 512, 48),
])
def test_random_targets_same_bytes(n, h, v, vd, chunk, rows):
    hidden, weight, norm_weight, draft_ids = _inputs(n, h, v, vd, seed=n + v)
    a, b, counts = _both(hidden, weight, norm_weight, draft_ids, chunk, rows)
    _assert_same(a, b)
    assert counts["tiles"] > 0, "the screen did not run"
    assert not bool(b.argmax_in_draft.all()), "every argmax in the draft: nothing was screened"


@pytest.mark.parametrize("where", ["below", "above"])
def test_exact_ties_with_the_draft_keep_the_lowest_id(where):
    """Non-draft copies of draft rows tie with them exactly in every summation order; rows of y
    aligned with a copied row make that tie the row's maximum."""
    n, h, v = 256, 128, 4096
    g = torch.Generator().manual_seed(7)
    hidden, weight, norm_weight, _ = _inputs(n, h, v, 1, seed=3)
    draft_ids = torch.arange(1024, 2048) if where == "below" else torch.arange(0, 1024)
    # copies: ids 0..199 (below the draft) or 3000..3199 (above it) hold draft rows
    copies = torch.arange(200) + (0 if where == "below" else 3000)
    sources = draft_ids[torch.randperm(1024, generator=g)[:200]]
    weight[copies] = weight[sources]
    pick = torch.randint(0, 200, (n,), generator=g)
    hidden[: n // 2] = (8 * weight[sources[pick[: n // 2]]].float()).bfloat16()
    norm_weight = torch.ones(h, dtype=torch.bfloat16)
    a, b, counts = _both(hidden, weight, norm_weight, draft_ids, 512, 64)
    _assert_same(a, b)
    tied = a.argmax[: n // 2]
    if where == "below":  # the copy, at the lower id, wins the tie
        assert bool((tied < 1024).any())
    assert counts.get("exact_pairs", 0) > 0, "no tie reached the exact tiles"


def test_integer_data_ties_and_near_ties():
    """Small integers: logits exact in any order, many exact ties across the draft boundary."""
    n, h, v = 128, 32, 2048
    g = torch.Generator().manual_seed(11)
    hidden = torch.randint(-3, 4, (n, h), generator=g).bfloat16()
    weight = torch.randint(-2, 3, (v, h), generator=g).bfloat16()
    draft_ids = torch.randperm(v, generator=g)[:600].sort().values
    outs = {}
    for on in (True, False):
        with switched(on), _tiles(256, 32):
            outs[on] = lm_head(hidden, weight, None, norm="none", outputs=("draft", "argmax"),
                               draft_ids=draft_ids, impl="torch")
    _assert_same(outs[True], outs[False])
    exact = hidden.double() @ weight.double().T
    best = exact.max(1).values
    first = (exact == best[:, None]).int().argmax(1)
    assert torch.equal(outs[True].argmax, first)


def test_nonfinite_input_leaves_the_screen_out():
    hidden, weight, norm_weight, draft_ids = _inputs(128, 64, 3000, 700, seed=5)
    hidden[3, 5] = float("nan")
    a, b, counts = _both(hidden, weight, norm_weight, draft_ids, 256, 32)
    assert counts.get("tiles", 0) == 0
    assert torch.equal(a.argmax, b.argmax)


def _cancelling(n, h, v, seed):
    """y = [x, x[p]], w = [u, -u[p]] with x spanning four decades and p a permutation: every
    logit is exactly 0, but the second half's products come in another order than the first's,
    so any fp32 summation rounds its partial sums (with p the identity, a GEMM that sums both
    halves alike, as AMX does at H=64, cancels them exactly and returns exact zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h // 2, generator=g) * torch.logspace(0, 4, h // 2)).bfloat16()
    u = torch.randn(v, h // 2, generator=g).bfloat16()
    p = torch.randperm(h // 2, generator=g)
    return torch.cat([x, x[:, p]], 1), torch.cat([u, -u[:, p]], 1)


def _walk_gemms(y, w):
    """The exact walk's fp32 logits from each call shape it makes: a whole tile, and row blocks
    of 15 and of 1 row (a leftover block of the walk, `choose_row_block`). MKL sums a few rows
    in another order than a whole tile on some CPUs (on AMX, a 1-row call differs from the
    256-row call that matches oneDNN's bf16 GEMM bit for bit), and the bound must hold for all."""
    out = {}
    for rows in (y.shape[0], 15, 1):
        s = torch.empty(y.shape[0], w.shape[0])
        for r0 in range(0, y.shape[0], rows):
            _cpu.gemm_bf16_f32(y[r0 : r0 + rows], w, s[r0 : r0 + rows])
        out[rows] = s
    return out


@pytest.mark.parametrize("h", [64, 1000, 4096])
@pytest.mark.parametrize("data", ["random", "cancelling"])
def test_bounds_hold_against_both_gemms(h, data):
    if data == "random":
        hidden, w, _, _ = _inputs(256, h, 1024, 1, seed=h, scale=100.0)
        y = hidden
    else:
        y, w = _cancelling(256, h, 1024, seed=h)
    z = torch.mm(y, w.t())  # the screen's GEMM: bf16 output
    y_norm, w_norm = norm_upper(y), norm_upper(w)
    assert bool((y_norm >= torch.linalg.vector_norm(y.double(), dim=1)).all())
    ub = screen_bound(z.float(), fp32_gap(y_norm[:, None], w_norm[None, :], h))
    rows, cols = torch.arange(256).repeat_interleave(4), torch.randint(0, 1024, (1024,))
    d, e = verify_pairs(y, w, rows, cols, y_norm, w_norm)
    broken = {}
    for call_rows, s in _walk_gemms(y, w).items():
        assert bool((s <= ub).all()), f"bound broken by {(s - ub).max().item()} ({call_rows}-row calls)"
        assert bool(((s[rows, cols].double() - d).abs() <= e).all()), f"{call_rows}-row calls"
        broken[call_rows] = int((s > screen_bound(z.float(), torch.zeros(()))).sum())
    if data == "cancelling":  # negative control: without the accumulation term the bound breaks
        assert bool((z != 0).any()), "the cancelling data did not make the screen's GEMM round"
        assert any(broken.values()), f"no call shape broke the bound without its accumulation term: {broken}"


def test_trained_tiny_target_same_bytes(tmp_path):
    """The trained tiny target's own final hidden states (peaked distributions)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM  # a heavy engine, loaded only here

    spec = tiny.TinySpec(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=601,
                         tokenizer_vocab=600, seed=5)
    train = tiny.TrainSpec(steps=24, batch_size=8, lr=1e-2, warmup=3, held_out=8, seed=1)
    model_dir = tiny.build_trained_tiny(tmp_path / "model", spec, train)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    captured = []
    model.model.norm.register_forward_hook(lambda mod, args, out: captured.append(args[0]))
    ids = torch.randint(0, 600, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    hidden = captured[0].reshape(-1, 64)
    weight, norm_weight = model.lm_head.weight.detach(), model.model.norm.weight.detach()
    draft_ids = torch.arange(0, 601, 4)
    a, b, counts = _both(hidden, weight, norm_weight, draft_ids, 256, 64)
    _assert_same(a, b)
    assert counts["tiles"] > 0


def test_weight_norms_follow_the_weight():
    """The cached row-norm bounds serve the same weight again (the public call detaches it on
    every call) and are recomputed after an in-place change or for another view; a call after
    the weight changed still returns the exact walk's bytes."""
    from eagle_fast.kernels._torch_screen import weight_norms

    hidden, weight, norm_weight, draft_ids = _inputs(256, 64, 3000, 700, seed=9)
    first = weight_norms(weight.detach())
    assert weight_norms(weight.detach()) is first, "the same weight missed the cache"
    weight[:10] *= 4  # bumps the version counter the detached views share
    again = weight_norms(weight.detach())
    assert again is not first and torch.equal(again, norm_upper(weight))
    assert torch.equal(weight_norms(weight[1:]), norm_upper(weight[1:]))
    a, b, counts = _both(hidden, weight, norm_weight, draft_ids, 256, 64)
    _assert_same(a, b)
    assert counts["tiles"] > 0
