"""HFTargetRunner: the reference runner, checked against transformers itself (no vLLM needed).

- aux ids follow NeMo's convention (id i = HF hidden_states[i + 1]) and the captured final
  hidden is the PRE-norm one (TargetHead over it reproduces transformers' logits);
- capture on unpadded rows equals the padded forward, whatever the batching;
- forward_eagle3_supervision equals every head output computed from transformers' logits;
- the shared input rules and lifecycle (bad aux ids, padding, lengths, close).
"""

from __future__ import annotations

import pytest
import torch
from _assert import assert_close
from _runner_helpers import check_supervision, draft_vocab, make_batch, reference_supervision, rows
from conftest import RUNNER_AUX_IDS

from eagle_fast import HFTargetRunner, Supervision, TargetRunner


@pytest.fixture(scope="module")
def hf_qwen3(tiny_qwen3):
    runner = HFTargetRunner.build(str(tiny_qwen3))
    runner.set_aux_layers([3, 0, 2])  # unsorted, includes L-1
    yield runner
    runner.close()


@pytest.fixture(params=["hf_llama", "hf_qwen3"])
def runner(request):
    return request.getfixturevalue(request.param)


def test_protocol_and_surface(runner):
    assert isinstance(runner, TargetRunner)
    cfg = runner.model.config
    assert (cfg.num_hidden_layers, cfg.vocab_size) == (4, 1031)
    assert next(runner.model.parameters()).device == torch.device("cpu")
    assert runner.dtype == torch.float32 and runner.max_model_len == 4096
    assert torch.equal(
        runner.input_embedding_weight(), runner.hf_model.get_input_embeddings().weight
    )


def test_aux_and_prenorm_final_match_transformers(runner):
    ids, mask = make_batch()
    out = runner.hf_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    keep = mask.bool()
    # id i = hidden_states[i + 1], except the last layer: transformers' hidden_states[L] is AFTER
    # the final norm, the layer's output (NeMo's hook, vLLM's capture id L) is before it.
    L, H = runner.num_layers, runner.hidden_size
    prenorm_last = _prenorm_last(runner, ids, mask)
    assert_close(
        runner.hf_model.model.norm(prenorm_last)[keep],
        out.hidden_states[L][keep],
        atol=1e-5,
        rtol=1e-5,
        name="norm(pre-norm last) vs hidden_states[L]",
    )
    expected_aux = torch.cat(
        [prenorm_last if i == L - 1 else out.hidden_states[i + 1] for i in runner.aux_layer_ids],
        dim=-1,
    )
    logits, aux = runner.forward_eagle3(ids, mask)
    assert_close(aux[keep], expected_aux[keep], atol=1e-6, rtol=1e-6, name="aux")
    assert_close(logits[keep], out.logits[keep], atol=1e-6, rtol=1e-6, name="logits")
    assert not aux[~keep].any() and not logits[~keep].any(), "pad positions must be zero"
    # capture: unpadded rows; its final hidden through TargetHead gives transformers' logits
    caps = runner.capture(rows(ids, mask))
    for b, (row_aux, final) in enumerate(caps):
        n = int(mask[b].sum())
        assert row_aux.shape == (n, 3 * H) and final.shape == (n, H)
        assert_close(
            row_aux, expected_aux[b, :n], atol=1e-5, rtol=1e-5, name=f"capture aux row {b}"
        )
        assert_close(
            runner.head.logits(final), out.logits[b, :n], atol=1e-5, rtol=1e-5, name=f"head row {b}"
        )
        assert not torch.allclose(final, out.hidden_states[-1][b, :n]), "final must be PRE-norm"


def _prenorm_last(runner, ids, mask) -> torch.Tensor:
    """The last decoder layer's output, taken with a forward hook (independently of the runner)."""
    got = {}
    layer = runner.hf_model.model.layers[-1]
    handle = layer.register_forward_hook(
        lambda m, i, o: got.setdefault("x", o[0] if isinstance(o, tuple) else o)
    )
    try:
        runner.hf_model(input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    return got["x"]


def test_capture_independent_of_batching(hf_llama):
    ids, mask = make_batch(lengths=(5, 11, 2, 8, 11, 3), seed=4)
    seqs = rows(ids, mask)
    one_batch = hf_llama.capture(seqs)
    hf_llama.max_batch_tokens = 12  # forces one or two rows per forward
    try:
        many = hf_llama.capture(seqs)
    finally:
        hf_llama.max_batch_tokens = 16384
    for b, ((a1, f1), (a2, f2)) in enumerate(zip(one_batch, many)):
        assert_close(a2, a1, atol=1e-5, rtol=1e-5, name=f"aux row {b}")
        assert_close(f2, f1, atol=1e-5, rtol=1e-5, name=f"final row {b}")


def test_supervision_equals_head_over_transformers_logits(runner):
    ids, mask = make_batch(seed=1)
    draft_ids = draft_vocab()
    logits, aux = runner.forward_eagle3(ids, mask)
    sup = runner.forward_eagle3_supervision(
        ids,
        mask,
        outputs=("logits", "logprobs", "lse", "argmax", "topk", "draft", "hidden"),
        draft_ids=draft_ids,
        k=5,
    )
    assert isinstance(sup, Supervision)
    ref = reference_supervision(logits, mask, k=5, draft_ids=draft_ids)
    check_supervision(sup, ref, mask, atol=1e-5, rtol=1e-5, name="hf supervision")
    # supervision captures rows through `capture` (sorted by length, repadded), another batching
    # than forward_eagle3's: the same values, rounded alike only where the CPU's GEMM is
    # shape-independent (not MKL's on AVX2)
    assert_close(sup.aux_hidden_states, aux, atol=1e-5, rtol=1e-5, name="aux")
    assert sup.attention_mask is mask
    assert (
        sup.hidden.shape == (*mask.shape, runner.hidden_size) and not sup.hidden[~mask.bool()].any()
    )
    # the default fast path: draft only, no full-vocabulary tensors
    fast = runner.forward_eagle3_supervision(ids, mask, draft_ids=draft_ids)
    assert (
        fast.logits is None
        and fast.logprobs is None
        and fast.topk_ids is None
        and fast.hidden is None
    )
    assert torch.equal(fast.argmax_in_draft, sup.argmax_in_draft)
    # the sparse draft target, through the same path
    sparse = runner.forward_eagle3_supervision(ids, mask, outputs=("draft_topk", "lse"), draft_ids=draft_ids,
                                               k=5, out_dtype=torch.float32)
    ref = reference_supervision(logits, mask, k=5, draft_ids=draft_ids, draft_topk=True)
    ref = {f: ref[f] for f in ("draft_topk_ids", "draft_topk_logprobs", "draft_topk_tail", "argmax_in_draft",
                               "argmax", "lse")}
    check_supervision(sparse, ref, mask, atol=1e-5, rtol=1e-5, name="hf draft_topk supervision")
    assert sparse.draft_logprobs is None and sparse.topk_ids is None


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "plan",
    [
        {"GROUP_TOKENS": 10_000},
        {"GROUP_TOKENS": 16, "MIN_TOKENS": 16},
        {"STAGING_BYTES": 0, "MIN_TOKENS": 16},
    ],
    ids=["one-group", "split-rows", "shrinking"],
)
def test_supervision_out_dtype_and_groups_equal_the_head(hf_llama, out_dtype, plan):
    # The runner sends rows through the head in token groups (pieces of rows, shrinking towards
    # the end) and, for 16-bit outputs, rounds the head's fp32 results while copying them into
    # the [B, S, ...] fields (top-k excepted): every field must equal the head's own output for
    # the non-pad rows and be zero at pad positions. Bit for bit with one group (the same head
    # call); with other groupings the head's GEMM tiles have other shapes, which MKL's fp32
    # GEMM on AVX2 rounds differently, so floats agree to a few ulps of the field's dtype (and
    # ids exactly).
    import contextlib
    from unittest import mock

    from eagle_fast import supervision

    ids, mask = make_batch(lengths=(40, 33, 1, 50), seed=2)
    draft_ids = draft_vocab()
    keep = mask.bool()
    final = torch.cat([f for _, f in hf_llama.capture(rows(ids, mask))])
    for outputs in (("draft", "argmax"), ("logits", "logprobs", "topk", "draft")):
        want = hf_llama.head.compute(final, outputs, k=4, draft_ids=draft_ids, out_dtype=out_dtype)
        calls = []

        def counted(h, *a, _compute=hf_llama.head.compute, _calls=calls, **kw):
            _calls.append(len(h))
            return _compute(h, *a, **kw)

        with contextlib.ExitStack() as stack:
            for name, value in plan.items():
                stack.enter_context(mock.patch.object(supervision, name, value))
            stack.enter_context(mock.patch.object(hf_llama.head, "compute", counted))
            # one group at a time, so `calls` is in group order (parallel groups: below)
            stack.enter_context(mock.patch.object(supervision, "group_workers", lambda *a: 1))
            sup = hf_llama.forward_eagle3_supervision(
                ids, mask, outputs=outputs, draft_ids=draft_ids, k=4, out_dtype=out_dtype
            )
        assert sum(calls) == int(keep.sum())
        if plan.get("GROUP_TOKENS") == 16:  # rows split across calls
            assert max(calls) <= 16 and len(calls) == 8, calls
        if "STAGING_BYTES" in plan:  # never growing towards the end
            assert calls[1:] == sorted(calls[1:], reverse=True) and calls[-1] == 16, calls
            assert len(calls) > 2 and calls[0] >= calls[1], calls
        one_call = len(calls) == 1
        for name, value in want.as_dict().items():
            got = getattr(sup, name)
            assert got.dtype == value.dtype, (outputs, name, got.dtype)
            if one_call or not value.is_floating_point():
                assert torch.equal(got[keep], value), (outputs, name)
            else:
                ulps = 4 * torch.finfo(value.dtype).eps
                assert_close(got[keep], value, atol=ulps, rtol=ulps, name=f"{outputs} {name}")
            assert not got[~keep].any(), (outputs, name, "pad positions must be zero")


@pytest.mark.parametrize("seed", range(40))
def test_supervision_group_plan_covers_rows_and_bounds_staging(seed):
    # Pure planner: every token once, in row-major order; sizes within [min, max] (the first
    # group may be smaller); and at every group, fields written so far + the group's staged
    # results + its new field pages stay within `budget` of the fields' final size.
    from eagle_fast.supervision import plan_supervision_groups

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 300, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
    lens[0] = max(lens[0], 1)
    kept = int(torch.randint(1, 5000, (1,), generator=g))
    staged = kept * int(torch.randint(1, 4, (1,), generator=g)) + int(torch.randint(0, 900, (1,), generator=g))
    budget = int(torch.randint(0, 60 * staged, (1,), generator=g))
    lo, hi = 16, int(torch.randint(16, 400, (1,), generator=g))
    groups = plan_supervision_groups(lens, staged, kept, budget, max_tokens=hi, min_tokens=lo)
    flat = [(b, t) for pieces in groups for b, a, c in pieces for t in range(a, c)]
    assert flat == [(b, t) for b, n in enumerate(lens) for t in range(n)]
    assert all(c > a for pieces in groups for _, a, c in pieces)
    sizes = [sum(c - a for _, a, c in pieces) for pieces in groups]
    total, written = sum(lens), 0
    for i, s in enumerate(sizes):
        assert 0 < s <= hi and (s >= lo or i == 0 or s == total - written), sizes
        after = total - written - s
        assert s * staged <= max(budget + kept * after, lo * staged), (i, sizes)
        written += s


def test_supervision_group_plan_rejects_bad_arguments():
    from eagle_fast.supervision import plan_supervision_groups

    with pytest.raises(ValueError, match="bytes per token"):
        plan_supervision_groups([3], -1, 1, 10, max_tokens=4)
    # nothing staged (the fields are the head's own outputs): groups of max_tokens, the first
    # sliver shared with the second
    assert plan_supervision_groups([3, 6], 0, 1, 0, max_tokens=4) == [
        [(0, 0, 3)], [(1, 0, 2)], [(1, 2, 6)]]
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        plan_supervision_groups([3], 1, 1, 10, max_tokens=4, min_tokens=5)
    assert plan_supervision_groups([0, 0], 1, 1, 10, max_tokens=4) == []


def test_bf16_runner_captures_in_bf16(tiny_llama):
    with HFTargetRunner.build(str(tiny_llama), dtype=torch.bfloat16) as runner:
        runner.set_aux_layers([0, 1, 2])
        ids, mask = make_batch(lengths=(4, 6))
        draft_ids = draft_vocab()
        sup = runner.forward_eagle3_supervision(
            ids, mask, outputs=("lse", "argmax", "hidden", "draft"), draft_ids=draft_ids
        )
        assert sup.aux_hidden_states.dtype == torch.bfloat16 and sup.hidden.dtype == torch.bfloat16
        # log-prob fields default to the target dtype: the head's fp32 results, rounded once
        want = runner.head.compute(sup.hidden[mask.bool()], ("draft",), draft_ids=draft_ids)
        assert sup.draft_logprobs.dtype == torch.bfloat16
        assert torch.equal(sup.draft_logprobs[mask.bool()], want.draft_logprobs.to(torch.bfloat16))
        fp32 = runner.forward_eagle3_supervision(
            ids, mask, outputs=("draft",), draft_ids=draft_ids, out_dtype=torch.float32
        )
        assert torch.equal(fp32.draft_logprobs[mask.bool()], want.draft_logprobs)
        assert runner.head.dtype == torch.bfloat16 and sup.lse.dtype == torch.float32
        logits, _ = runner.forward_eagle3(ids, mask)
        keep = mask.bool()
        # bf16 logits (transformers) vs fp32-accumulated head: agree to bf16 precision
        assert_close(
            sup.lse[keep], torch.logsumexp(logits[keep], -1), atol=0.05, rtol=0.02, name="bf16 lse"
        )
    assert runner.closed


@pytest.mark.parametrize(
    "ids, message",
    [
        ([0, 1], "exactly 3 aux_layer_ids"),
        ([0, 1, 2, 3], "exactly 3 aux_layer_ids"),
        ([1, 1, 2], "distinct"),
        ([0, 1, 4], r"out of range.*num_hidden_layers=4"),
        ([-1, 1, 2], "out of range"),
        ([0.5, 1, 2], "must be ints"),
        ([True, 1, 2], "must be ints"),
    ],
)
def test_bad_aux_ids_rejected_and_old_ids_kept(hf_llama, ids, message):
    with pytest.raises(ValueError, match=message):
        hf_llama.set_aux_layers(ids)
    assert hf_llama.aux_layer_ids == list(RUNNER_AUX_IDS)


def test_bad_batches_rejected(hf_llama):
    ids, mask = make_batch(lengths=(3, 5))
    empty = mask.clone()
    empty[0] = 0
    with pytest.raises(ValueError, match=r"rows \[0\] have no tokens"):
        hf_llama.forward_eagle3(ids, empty)
    left = mask.flip(1)
    with pytest.raises(ValueError, match="not right-padded"):
        hf_llama.forward_eagle3_supervision(ids, left, outputs=("lse",))
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        hf_llama.capture([[1, 2], []])
    with pytest.raises(ValueError, match="4097 tokens > max_model_len=4096"):
        hf_llama.capture([[5] * 4097])
    with pytest.raises(ValueError, match=r"outside \[0, 1031\)"):
        hf_llama.capture([[5, 1031]])
    with pytest.raises(ValueError, match="unknown name"):
        hf_llama.forward_eagle3_supervision(ids, mask, outputs=("draft_probs",))


def test_lifecycle(tiny_qwen3):
    runner = HFTargetRunner.build(str(tiny_qwen3))
    with pytest.raises(RuntimeError, match="set_aux_layers"):
        runner.capture([[1, 2, 3]])
    with runner:
        runner.set_aux_layers([0, 1, 3])
        assert len(runner.capture([[1, 2, 3]])) == 1
    runner.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        runner.capture([[1, 2, 3]])


def test_capture_runs_no_lm_head(runner, monkeypatch):
    """Captures run the decoder alone; forward_eagle3 still returns transformers' own logits."""
    ids, am = make_batch([7, 3], vocab=runner.head.vocab_size, seed=4)
    want = runner.capture(rows(ids, am))
    lm_head = runner.hf_model.get_output_embeddings()

    def refuse(*_args, **_kwargs):
        raise AssertionError("the capture ran the LM head")

    monkeypatch.setattr(lm_head, "forward", refuse)
    got = runner.capture(rows(ids, am))
    for (a, f), (a2, f2) in zip(got, want):
        assert torch.equal(a, a2) and torch.equal(f, f2)
    with pytest.raises(AssertionError, match="ran the LM head"):
        runner.forward_eagle3(ids, am)
