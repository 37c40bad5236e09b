"""HFTargetRunner's head borrows the model's own LM-head / final-norm tensors, never changing results.

- tied and untied: after `build` the head's LM head (and a tied head's embedding) and its final
  norm ARE the model's tensors, the head's checkpoint copy is freed, and every head output is
  bitwise what a separately loaded `TargetHead` gives;
- a model whose output embedding differs by one element, or a head in another dtype, padded, or
  facing a model without output embeddings: the head keeps its own copy.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref

import pytest
import torch
from _runner_helpers import draft_vocab, make_batch
from conftest import RUNNER_AUX_IDS
from transformers import AutoModelForCausalLM

from eagle_fast import HFTargetRunner
from eagle_fast.head import TargetHead
from eagle_fast.runners.hf import _share_head_weights

HEAD_OUTPUTS = ("logits", "logprobs", "lse", "argmax", "topk", "draft")


@pytest.fixture(params=["tiny_llama", "tiny_qwen3"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def _build(path, monkeypatch, edit_model=None) -> tuple[HFTargetRunner, list]:
    """`HFTargetRunner.build`, returning weak references to the head's checkpoint tensors;
    `edit_model(model)` runs on the loaded model before the head is shared with it."""
    own: list[weakref.ref] = []
    load_head, load_model = TargetHead.from_pretrained, AutoModelForCausalLM.from_pretrained

    def head_spy(cls, *args, **kwargs):
        head = load_head(*args, **kwargs)
        own.extend(weakref.ref(t) for t in (head.lm_head_weight, head.norm_weight))
        return head

    def model_spy(*args, **kwargs):
        model = load_model(*args, **kwargs)
        if edit_model is not None:
            edit_model(model)
        return model

    monkeypatch.setattr(TargetHead, "from_pretrained", classmethod(head_spy))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_spy)
    runner = HFTargetRunner.build(str(path))
    monkeypatch.undo()
    runner.set_aux_layers(list(RUNNER_AUX_IDS))
    return runner, own


def _fresh_head(path, runner) -> TargetHead:
    return TargetHead.from_pretrained(path, runner.config, dtype=runner.dtype, device=runner.device)


def _assert_same_results(runner, fresh: TargetHead, name: str) -> None:
    """The runner's head gives bitwise what `fresh` gives: head calls and the runner's supervision."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(37, runner.hidden_size, generator=g).to(runner.dtype)
    draft_ids = draft_vocab(runner.head.vocab_size)
    kwargs = {"k": 5, "draft_ids": draft_ids}
    got = runner.head.compute(hidden, HEAD_OUTPUTS, **kwargs)
    want = fresh.compute(hidden, HEAD_OUTPUTS, **kwargs)
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        assert (a is None) == (b is None), f"{name}: head field {field.name} presence differs"
        assert a is None or torch.equal(a, b), f"{name}: head field {field.name} differs"

    ids, mask = make_batch(vocab=runner.head.vocab_size)
    outputs = ("logits", "lse", "argmax", "topk", "draft")
    shared = runner.forward_eagle3_supervision(ids, mask, outputs, **kwargs)
    runner.head, borrowed = fresh, runner.head
    try:
        reference = runner.forward_eagle3_supervision(ids, mask, outputs, **kwargs)
    finally:
        runner.head = borrowed
    got, want = shared.as_dict(), reference.as_dict()
    assert got.keys() == want.keys(), f"{name}: supervision fields {sorted(got)} != {sorted(want)}"
    for field, b in want.items():
        assert torch.equal(got[field], b), f"{name}: supervision field {field} differs"


def test_head_shares_the_models_weights(checkpoint, monkeypatch):
    runner, own = _build(checkpoint, monkeypatch)
    try:
        model, head = runner.hf_model, runner.head
        out_embed = model.get_output_embeddings().weight
        assert head.lm_head_weight.data_ptr() == out_embed.data_ptr(), "LM head not shared"
        assert head.norm_weight.data_ptr() == model.model.norm.weight.data_ptr(), "norm not shared"
        assert not head.lm_head_weight.requires_grad and not head.norm_weight.requires_grad
        assert not isinstance(head.lm_head_weight, torch.nn.Parameter), "not detached"
        if head.tied:
            embed = model.get_input_embeddings().weight
            assert head.embed_weight().data_ptr() == embed.data_ptr(), "tied embedding not shared"
        gc.collect()
        assert all(ref() is None for ref in own), "the head's checkpoint copy is still alive"

        fresh = _fresh_head(checkpoint, runner)
        assert fresh.lm_head_weight.data_ptr() != head.lm_head_weight.data_ptr()
        _assert_same_results(runner, fresh, "shared")
    finally:
        runner.close()


def test_head_keeps_its_copy_when_the_model_differs(checkpoint, monkeypatch, caplog):
    def edit(model):
        with torch.no_grad():
            model.get_output_embeddings().weight[5, 3] += 1.0

    caplog.set_level(logging.DEBUG, logger="eagle_fast.runners.hf")
    runner, own = _build(checkpoint, monkeypatch, edit_model=edit)
    try:
        model, head = runner.hf_model, runner.head
        out_embed = model.get_output_embeddings().weight
        assert head.lm_head_weight.data_ptr() != out_embed.data_ptr(), "shared a differing weight"
        assert own[0]() is head.lm_head_weight, "the head's own copy was replaced"
        assert head.norm_weight.data_ptr() == model.model.norm.weight.data_ptr(), "norm not shared"
        assert "lm_head: values differ" in caplog.text

        fresh = _fresh_head(checkpoint, runner)
        assert torch.equal(head.lm_head_weight, fresh.lm_head_weight)
        assert not torch.equal(out_embed, fresh.lm_head_weight), "the edit did not take"
        _assert_same_results(runner, fresh, "kept")
    finally:
        runner.close()


@pytest.fixture(scope="module")
def llama_model(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    return model.eval().requires_grad_(False)


# case -> what the debug log must name as the reason
MISMATCHES = {
    "bf16_head": "torch.bfloat16",
    "padded_vocab": "torch.Size([1034, 128])",
    "no_output_embeddings": "the model has no such tensor",
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_head_keeps_its_copy_on_mismatch(case, tiny_llama, llama_model, monkeypatch, caplog):
    dtype = torch.bfloat16 if case == "bf16_head" else torch.float32
    head = TargetHead.from_pretrained(tiny_llama, dtype=dtype)
    if case == "padded_vocab":
        head.lm_head_weight = torch.cat([head.lm_head_weight, head.lm_head_weight[:3]])
    if case == "no_output_embeddings":
        monkeypatch.setattr(llama_model, "get_output_embeddings", lambda: None)
    own_head = head.lm_head_weight

    caplog.set_level(logging.DEBUG, logger="eagle_fast.runners.hf")
    _share_head_weights(head, llama_model)
    assert head.lm_head_weight is own_head, f"{case}: LM head replaced"
    norm_shared = head.norm_weight.data_ptr() == llama_model.model.norm.weight.data_ptr()
    assert norm_shared == (case != "bf16_head"), f"{case}: norm shared={norm_shared}"
    reasons = [r.getMessage() for r in caplog.records if "head lm_head:" in r.getMessage()]
    assert len(reasons) == 1 and MISMATCHES[case] in reasons[0], f"{case}: logged {reasons}"
