"""Ray extraction with --keep-mass (a different k per token on disk) writes the single-process bytes."""

from __future__ import annotations

import pytest
import torch
from _pipeline import mixed_jsonl

pytest.importorskip("ray", reason="ray is not installed (pip install 'eagle-fast[ray]')")
from test_ray import assert_same_dataset, cfg_for, local_ray, one_thread  # noqa: F401 - fixtures

from eagle_fast import extract
from eagle_fast.pipeline.distributed import RayOptions
from eagle_fast.store.dataset import Eagle3Dataset
from eagle_fast.vocab import DraftVocab, save_draft_vocab


@pytest.mark.usefixtures("local_ray")
def test_two_workers_write_the_single_process_ragged_bytes(tiny_llama, tmp_path):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=14)
    vocab = str(save_draft_vocab(tmp_path / "v.pt", DraftVocab(torch.arange(5, 1031, 43), 1031)))
    kw = {"supervision": "draft-topk", "k": 8, "keep_mass": 0.4, "draft_vocab": vocab, "out_dtype": "bf16"}
    ref = extract(cfg_for(tiny_llama, data, tmp_path / "ref", **kw))
    got = extract(cfg_for(tiny_llama, data, tmp_path / "ray", **kw), ray=RayOptions(workers=2))
    assert ref.complete and got.complete and ref.shards_total > 2
    mean_k, capped, n = Eagle3Dataset(tmp_path / "ref").keep_mass_stats()
    assert 1 < mean_k < 8 and 0 < capped < n, "the test needs ragged rows and capped ones"
    assert_same_dataset(tmp_path / "ray", tmp_path / "ref")
