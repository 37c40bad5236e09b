"""The trained tiny target: training lowers the loss and peaks the distributions, the build is
cached (a second call trains nothing), deterministic, and atomic (an interrupted or partial
build is never taken for a complete one)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from eagle_fast import tiny
from eagle_fast.tiny import (
    TinySpec,
    TrainSpec,
    build_trained_tiny,
    trained_tiny_dir,
    training_report,
)

# A few seconds of training: the smallest shape the builder accepts, on the corpus's own vocab.
SPEC = TinySpec(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=601,
                tokenizer_vocab=600, seed=5)
TRAIN = TrainSpec(steps=24, batch_size=8, lr=1e-2, warmup=3, held_out=8, seed=1)


def _mtimes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    return build_trained_tiny(root / "model", SPEC, TRAIN)


def test_training_lowers_the_loss_and_peaks_the_distributions(built):
    r = training_report(built)
    losses = r["losses"]
    assert len(losses) == TRAIN.steps and all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    before, after = r["held_out"]["random_init"]["all"], r["held_out"]["trained"]["all"]
    assert before["positions"] == after["positions"] > 0
    assert after["nll"] < before["nll"] - 0.5, (before, after)
    assert after["max_prob"] > 2 * before["max_prob"] and after["entropy"] < before["entropy"]
    # the saved checkpoint is the trained model: its held-out peakedness is the report's
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    lines = [raw for raw in tiny._data_path().read_text().splitlines() if raw.strip()][-TRAIN.held_out:]
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    again = tiny.peakedness(model, tiny._chat_sequences(tok, lines))["all"]
    assert again["max_prob"] == pytest.approx(after["max_prob"], abs=2e-4)
    assert again["nll"] == pytest.approx(after["nll"], abs=2e-4)


def test_second_call_reuses_the_cache(built, monkeypatch):
    before = _mtimes(built)
    monkeypatch.setattr(tiny, "_train", lambda *a, **k: pytest.fail("retrained a complete cache entry"))
    assert build_trained_tiny(built, SPEC, TRAIN) == built
    assert _mtimes(built) == before
    # the cache key is the whole build: other training settings get a directory of their own
    assert trained_tiny_dir("c", SPEC, TRAIN) != trained_tiny_dir("c", SPEC, TrainSpec(steps=25))
    assert trained_tiny_dir("c", SPEC, TRAIN) == trained_tiny_dir("c", SPEC, TRAIN)


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(model, sequences, train):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_trained_tiny(tmp_path / "model", SPEC, TRAIN)
    assert list(tmp_path.iterdir()) == []  # neither the target nor its temp dir


@pytest.mark.parametrize("damage", ["no_marker", "other_build", "no_report"])
def test_partial_cache_dir_is_rebuilt_identically(built, tmp_path, damage):
    out = tmp_path / "model"
    shutil.copytree(built, out)
    if damage == "no_marker":  # killed between the weights and the marker (a non-atomic writer)
        (out / ".complete").unlink()
        (out / "model.safetensors").write_bytes(b"truncated")
    elif damage == "other_build":  # a marker for other settings under this name
        (out / ".complete").write_text('{"spec": {}, "train": {}}')
    else:
        (out / tiny.TRAINING_REPORT).unlink()
    assert build_trained_tiny(out, SPEC, TRAIN) == out
    # rebuilt from scratch, and training is deterministic: the same bytes as the first build
    assert _digest(out / "model.safetensors") == _digest(built / "model.safetensors")
    assert training_report(out)["losses"] == training_report(built)["losses"]
    assert (out / ".complete").read_text() == (built / ".complete").read_text()
