"""Draft vocabulary: loss-masked frequencies -> d2t / t2d as SpecForge and NeMo store them."""

from __future__ import annotations

import json

import pytest
import torch
from _pipeline import chat_lines, write_jsonl

from eagle_fast.errors import UserError
from eagle_fast.inputs import load_tokenizer, plan_inputs
from eagle_fast.vocab import (
    DraftVocab,
    count_tokens,
    load_draft_vocab,
    save_draft_vocab,
    select_draft_vocab,
)


def test_counts_only_loss_masked_positions():
    counts = count_tokens([([5, 6, 6, 7], [0, 1, 1, 0]), ([6, 9], [1, 1])], vocab_size=12)
    assert counts.tolist() == [0] * 6 + [3, 0, 0, 1, 0, 0]


def test_selection_order_ties_specials_and_fill():
    counts = torch.tensor([0, 5, 9, 5, 0, 1, 0, 0, 2, 0])
    v = select_draft_vocab(counts, 4, special_ids=[None, 7])
    # special 7 first, then by count (ties -> lower id): 2 (9), 1 (5), 3 (5); then sorted
    assert v.ids.tolist() == [1, 2, 3, 7]
    assert v.coverage == pytest.approx((9 + 5 + 5) / 22)
    # fewer seen tokens than the size: the lowest unseen ids fill up
    assert select_draft_vocab(torch.tensor([0, 0, 3, 0, 1, 0]), 4).ids.tolist() == [0, 1, 2, 4]
    full = select_draft_vocab(counts, 50)
    assert full.ids.tolist() == list(range(10)) and full.d2t().tolist() == [0] * 10 and bool(full.t2d().all())
    with pytest.raises(UserError, match="--size must be positive"):
        select_draft_vocab(counts, 0)


def test_file_format_matches_specforge_and_nemo(tmp_path):
    ids = torch.tensor([0, 3, 4, 10, 11, 19])
    path = save_draft_vocab(tmp_path / "v.pt", DraftVocab(ids, 20))
    data = torch.load(path, weights_only=True)
    # SpecForge / vLLM: d2t int64 offsets (target = draft + d2t[draft]); t2d bool presence mask
    assert data["d2t"].dtype == torch.int64 and data["d2t"].tolist() == [0, 2, 2, 7, 7, 14]
    assert data["t2d"].dtype == torch.bool and data["t2d"].shape == (20,)
    assert torch.equal(torch.arange(6) + data["d2t"], ids) and torch.equal(data["t2d"].nonzero().flatten(), ids)
    # NeMo AutoModel reads the same file as its cached selected_token_ids
    eagle3 = pytest.importorskip("nemo_automodel.components.datasets.llm.eagle3")
    got = eagle3.load_eagle3_token_mapping(str(path), target_vocab_size=20, draft_vocab_size=6)
    assert got is not None and torch.equal(got[0], ids) and torch.equal(got[1], data["t2d"])
    # and NeMo's own draft buffers from those ids are ours
    assert torch.equal(got[0] - torch.arange(6), data["d2t"])
    # the head op's helpers agree
    kernels = pytest.importorskip("eagle_fast.kernels")
    if hasattr(kernels, "draft_ids_from_d2t"):
        assert torch.equal(kernels.draft_ids_from_d2t(data["d2t"]).cpu(), ids)
        assert torch.equal(kernels.draft_ids_from_t2d(data["t2d"]).cpu(), ids)


def test_load_accepts_foreign_files_and_rejects_bad_ones(tmp_path):
    ids = torch.tensor([1, 2, 5, 8])
    v = DraftVocab(ids, 10)
    assert torch.equal(load_draft_vocab(save_draft_vocab(tmp_path / "v.safetensors", v), 10).ids, ids)
    torch.save({"selected_token_ids": torch.tensor([8, 1, 5, 2]), "target_vocab_size": 10}, tmp_path / "nemo.pt")
    assert torch.equal(load_draft_vocab(tmp_path / "nemo.pt", 10).ids, ids)  # NeMo's cache, any order
    from safetensors.torch import save_file

    save_file({"d2t": v.d2t(), "t2d": v.t2d(), "fc.weight": torch.zeros(2, 2)}, str(tmp_path / "draft.safetensors"))
    assert torch.equal(load_draft_vocab(tmp_path / "draft.safetensors", 10).ids, ids)  # a draft checkpoint
    cases = [
        (tmp_path / "v.safetensors", 12, "t2d has 10 entries"),
        (tmp_path / "missing.pt", 10, "not found"),
    ]
    torch.save({"d2t": torch.tensor([0, -1, 0])}, tmp_path / "dup.pt")  # ids 0, 0, 2
    torch.save({"d2t": torch.tensor([0, 20])}, tmp_path / "range.pt")
    torch.save({"weights": torch.ones(3)}, tmp_path / "other.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    cases += [(tmp_path / "dup.pt", 10, "repeats token ids"), (tmp_path / "range.pt", 10, "outside the target"),
              (tmp_path / "other.pt", 10, "holds no draft vocabulary"), (tmp_path / "junk.pt", 10, "cannot read")]
    for path, vocab_size, msg in cases:
        with pytest.raises(UserError, match=msg):
            load_draft_vocab(path, vocab_size)


def test_vocab_command_counts_assistant_tokens(tmp_path, tiny_llama):
    from eagle_fast.cli import main

    lines = chat_lines(40)
    # raw ids: token 1000 is the most frequent token of the file but never loss-masked
    lines.append(json.dumps({"input_ids": [1000] * 300 + [5, 6], "loss_mask": [0] * 300 + [1, 1]}))
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    out = tmp_path / "vocab.pt"
    assert main(["vocab", "--model", str(tiny_llama), "--data", str(data), "--size", "64", "--out", str(out)]) == 0
    v = load_draft_vocab(out, 1031)
    tok = load_tokenizer(str(tiny_llama))
    plan = plan_inputs(data, tok, 1031, max_len=2048, overlong="truncate")
    everything = count_tokens(((s.input_ids, [1] * s.length) for s in plan.samples), 1031)
    counts = count_tokens(((s.input_ids, s.loss_mask) for s in plan.samples), 1031)
    assert torch.equal(v.ids, select_draft_vocab(counts, 64, [tok.eos_token_id, tok.pad_token_id]).ids)
    # chat headers (<|im_start|>, role names) and unmasked ids are frequent but never supervised
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    for t in (1000, im_start):
        assert everything[t] >= 40 and counts[t] == 0 and t not in v.ids.tolist()
    assert counts[tok.eos_token_id] > 0 and tok.eos_token_id in v.ids.tolist()  # <|im_end|> closes each answer
