"""`extract --format specforge` read and trained on by SpecForge 0.2.0's own code, on CPU.

Its offline reader, normaliser, collator and FeatureDataLoader load the dataset; its
Eagle3TrainStrategy.forward_loss runs a training step with its own TargetHead, and the target
distribution it builds from our stored hidden states is NeMo AutoModel's in-process one. Also:
the files against SpecForge's storage contract and HF's own hidden states, SpecForge's default
aux layers, the fp8 refusal, a crashed run resumed to the same bytes, and a tied target's logits
through its TargetHead (which needs `lm_head_key: model.embed_tokens.weight`).
Only the test swaps SpecForge's Triton loss for its reference loss and turns torch.compile off
(SpecForge's CPU limits); everything else is SpecForge's code as installed.
"""

from __future__ import annotations

import json
import zipfile
from types import SimpleNamespace

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _pipeline import chat_lines, resumes_to_the_same_bytes, run_main, write_jsonl
from _trainers import DRAFT_SIZE, V, draft_vocab, extract_cli, nemo_target_probs

from eagle_fast.checkpoint import indexed_view
from eagle_fast.inputs import load_tokenizer, plan_inputs

pytest.importorskip("specforge", reason="specforge==0.2.0 is in requirements/cpu.lock")

MAX_LEN = 48
TTT = 3


@pytest.fixture(scope="module")
def sf(tiny_llama, tmp_path_factory):
    """(dataset dir, draft vocab, plan) of `eagle-fast extract --format specforge` in fp32."""
    tmp = tmp_path_factory.mktemp("specforge")
    data = write_jsonl(tmp / "d.jsonl", chat_lines(5))
    vocab = draft_vocab(tmp / "vocab.safetensors")
    out = tmp / "sf"
    extract_cli("--model", tiny_llama, "--data", data, "--out", out, "--dtype", "fp32", "--max-len", MAX_LEN,
                "--format", "specforge", "--draft-vocab", tmp / "vocab.safetensors", "--shard-size", 2,
                "--aux-layers", "2,0,1")  # not the last layer: HF's last hidden_states entry is post-norm
    plan = plan_inputs(data, load_tokenizer(str(tiny_llama)), V, max_len=MAX_LEN, overlong="truncate")
    return out, vocab, plan


def test_files_follow_specforges_storage_contract(sf, tiny_llama):
    from transformers import AutoModelForCausalLM

    out, vocab, plan = sf
    aux = json.loads((out / "manifest.json").read_text())["aux_layer_ids"]
    assert aux == [0, 1, 2]  # ascending, whatever order they were asked in
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    for s in plan.samples:
        path = out / "rows_0-2000" / f"data_{s.index}.ckpt"
        assert zipfile.is_zipfile(path), "torch.load(mmap=True) needs the zip serialisation"
        d = torch.load(str(path), weights_only=True, mmap=True)
        T = s.length
        assert set(d) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert d["input_ids"].dtype == d["loss_mask"].dtype == torch.int64
        assert d["input_ids"].tolist() == s.input_ids and d["loss_mask"].tolist() == s.loss_mask
        assert d["aux_hidden_state"].shape == (1, T, 3 * 128) and d["aux_hidden_state"].dtype == torch.float32
        assert d["hidden_state"].shape == (1, T, 128) and d["hidden_state"].dtype == torch.float32
        with torch.no_grad():
            ref = hf(torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states
        want_aux = torch.cat([ref[i + 1] for i in aux], dim=-1)  # layer i's output, ascending
        assert_close(d["aux_hidden_state"], want_aux, atol=1e-5, rtol=1e-5, name="aux_hidden_state")
        # HF's last hidden_states entry is AFTER the final norm: what SpecForge's TargetHead expects
        assert_close(d["hidden_state"], ref[-1], atol=1e-5, rtol=1e-5, name="hidden_state (post-norm)")
    mapping = torch.load(str(out / "vocab_mapping.pt"), weights_only=True)
    assert_ids_equal(mapping["d2t"], vocab.d2t(), name="d2t")
    assert_ids_equal(mapping["t2d"], vocab.t2d(), name="t2d")


@pytest.mark.parametrize("num_layers", [8, 28, 32, 36, 61])
def test_default_aux_layers_are_specforges(num_layers):
    from specforge.algorithms.model_providers import resolve_eagle_capture_layers

    from eagle_fast.runners.factory import parse_aux_layers

    cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    theirs = resolve_eagle_capture_layers(cfg, {}, SimpleNamespace(num_hidden_layers=num_layers))
    # both count layer outputs (layer i = HF hidden_states[i + 1]); the store sorts them
    assert sorted(parse_aux_layers(None, num_layers)) == theirs


def test_fp8_is_refused_before_anything_is_written(tmp_path, tiny_llama, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    code, _, err = run_main(capsys, "extract", "--model", tiny_llama, "--data", data, "--out", tmp_path / "o",
                            "--engine", "hf", "--format", "specforge", "--aux-dtype", "fp8")
    assert code != 0 and "SpecForge" in err and "fp8" in err
    assert not (tmp_path / "o").exists()


def _draft_model(vocab_mapping_path):
    from specforge.modeling.auto import AutoDraftModel
    from transformers import LlamaConfig

    config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=128, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=64, intermediate_size=256, num_hidden_layers=1,
                         vocab_size=V, draft_vocab_size=DRAFT_SIZE, max_position_embeddings=512,
                         rms_norm_eps=1e-6)
    torch.manual_seed(0)
    draft = AutoDraftModel.from_config(config, attention_backend="sdpa", torch_dtype=torch.float32)
    draft.load_vocab_mapping(str(vocab_mapping_path))
    draft.freeze_embedding()
    return draft


@torch._dynamo.config.patch(disable=True)
def test_specforge_reads_trains_and_targets_equal_nemos(sf, tiny_llama, tmp_path, monkeypatch, nemo_reference):
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.algorithms.eagle3.data import (
        build_offline_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.core.loss import _compute_loss
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.strategies.base import Eagle3TrainStrategy

    out, vocab, plan = sf
    refs = build_offline_reader(str(out), run_id="t", ttt_length=TTT, max_len=MAX_LEN).read()
    assert len(refs) == len(plan.samples)
    loader = FeatureDataLoader(LocalFeatureStore("t"), refs=refs, batch_size=2, collate_fn=build_offline_collator(),
                               per_sample_transform=build_offline_normalizer(MAX_LEN), drop_last=False)
    batches = list(loader)
    assert sum(b.tensors["input_ids"].shape[0] for b in batches) == len(plan.samples)

    # SpecForge's CPU limits: its KL loss is a Triton kernel and its target step is compiled (dynamo
    # is off through torch's own patch, on the test: monkeypatch's undo deletes the config entry,
    # which torch then hides, and every later torch.compile in the session raises AttributeError)
    monkeypatch.setattr(eagle3_model, "LogSoftmaxLoss", SimpleNamespace(apply=_compute_loss))
    targets = []
    compute_target_p = eagle3_model._compute_target_p
    monkeypatch.setattr(eagle3_model, "_compute_target_p",
                        lambda **kw: targets.append(compute_target_p(**kw)) or targets[-1])

    # TargetHead needs *.index.json; fp32 weights, as the target (its from_pretrained casts to bf16)
    target_dir = indexed_view(tiny_llama, tmp_path / "target")
    head = TargetHead(str(target_dir))
    head.load_weights(str(target_dir))
    head.freeze_weights()
    draft = _draft_model(out / "vocab_mapping.pt")
    strategy = Eagle3TrainStrategy(eagle3_model.OnlineEagle3Model(draft, length=TTT, attention_backend="sdpa"),
                                   target_head=head.eval())
    by_ids = {tuple(s.input_ids): s for s in plan.samples}
    for batch in batches:
        step = strategy.forward_loss(batch)
        assert torch.isfinite(step.loss) and step.loss > 0
        draft.zero_grad()
        step.loss.backward()
        assert draft.fc.weight.grad is not None and bool(draft.fc.weight.grad.abs().sum() > 0)
        target_p = targets[-1][0]  # [B, S, Vd], SpecForge's shifted frame (row t: position t + 1)
        for b, (ids, am) in enumerate(zip(batch.tensors["input_ids"], batch.tensors["attention_mask"])):
            n = int(am.sum())
            s = by_ids[tuple(ids[:n].tolist())]
            want = nemo_target_probs(nemo_reference, vocab, s.input_ids)
            assert_close(target_p[b, : n - 1], want[: n - 1], atol=1e-6, rtol=1e-4, name=f"sample {s.index}")


def test_crashed_run_resumes_to_the_same_bytes(tmp_path, tiny_llama):
    from eagle_fast import ExtractConfig

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(5))

    def cfg(out):
        return ExtractConfig(model=str(tiny_llama), data=str(data), out=str(out), engine="hf", dtype="bf16",
                             max_len=32, shard_size=2, layout="specforge", progress_tty=False)

    run = resumes_to_the_same_bytes(cfg, tmp_path)
    d = torch.load(str(run / "rows_0-2000" / "data_0.ckpt"), weights_only=True, mmap=True)
    assert d["aux_hidden_state"].dtype == d["hidden_state"].dtype == torch.bfloat16


def test_tied_target_needs_lm_head_key(tiny_qwen3, tmp_path):
    from specforge.modeling.target.target_head import TargetHead
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    extract_cli("--model", tiny_qwen3, "--data", data, "--out", tmp_path / "sf", "--dtype", "fp32", "--max-len", 32,
                "--format", "specforge")
    target_dir = indexed_view(tiny_qwen3, tmp_path / "target")
    head = TargetHead(str(target_dir))
    with pytest.raises(KeyError, match="lm_head.weight"):  # SpecForge's default key: no such tensor when tied
        head.load_weights(str(target_dir))
    head.load_weights(str(target_dir), lm_head_key="model.embed_tokens.weight")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    for path in sorted((tmp_path / "sf").rglob("*.ckpt")):
        d = torch.load(str(path), weights_only=True, mmap=True)
        with torch.no_grad():
            want = hf(d["input_ids"][None]).logits
            got = head(d["hidden_state"])
        assert_close(got, want, atol=1e-5, rtol=1e-5, name=f"{path.name}: TargetHead logits")
