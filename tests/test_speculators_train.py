"""`extract --format speculators` read and trained on by vLLM speculators 0.9.0's own code, on CPU.

Its ArrowDataset (FileTransfer, or hs_connectors' FP8Transfer for --aux-dtype fp8) + CollateFn +
shift_batch pack our dataset into a training batch; its vocabulary discovery finds our
d2t-{N}.npy / t2d-{N}.npy; an Eagle3DraftModel (eager attention, eager loss) runs forward and
backward on the batch; and the target it computes from our stored final hidden states
(verifier_lm_head(verifier_norm(.))) is NeMo AutoModel's in-process one, in fp32.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _pipeline import chat_lines, write_jsonl
from _trainers import DRAFT_SIZE, V, draft_vocab, extract_cli, nemo_target_probs
from safetensors.torch import load_file

from eagle_fast.inputs import load_tokenizer, plan_inputs
from eagle_fast.store.fp8 import dequantize, error_bound

pytest.importorskip("speculators", reason="speculators==0.9.0 is in requirements/cpu.lock")

MAX_LEN = 48
N_SAMPLES = 4
PACKED = N_SAMPLES * MAX_LEN  # one batch holds every sample
TTT = 3
AUX = [0, 1, 2]               # layer outputs; speculators' capture ids are these + 1
RUNS = {"fp32": ("fp32", "auto"), "bf16": ("bf16", "auto"), "fp8": ("bf16", "fp8")}


@pytest.fixture(scope="module")
def sp(tiny_llama, tmp_path_factory):
    """name -> dataset dir of `eagle-fast extract --format speculators` (RUNS), plus vocab and plan."""
    tmp = tmp_path_factory.mktemp("speculators")
    data = write_jsonl(tmp / "d.jsonl", chat_lines(N_SAMPLES))
    vocab = draft_vocab(tmp / "vocab.safetensors")
    dirs = {}
    for name, (dtype, aux_dtype) in RUNS.items():
        dirs[name] = tmp / name
        extract_cli("--model", tiny_llama, "--data", data, "--out", dirs[name], "--dtype", dtype, "--aux-dtype",
                    aux_dtype, "--max-len", MAX_LEN, "--format", "speculators", "--draft-vocab",
                    tmp / "vocab.safetensors", "--aux-layers", ",".join(map(str, AUX)))
    plan = plan_inputs(data, load_tokenizer(str(tiny_llama)), V, max_len=MAX_LEN, overlong="truncate")
    return dirs, vocab, plan


def _batch(out, aux_dtype: str, dtype: torch.dtype) -> dict:
    """speculators' ArrowDataset + CollateFn(shift_batch) over `out`: one packed batch."""
    from hs_connectors import FP8Transfer
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from torch.utils.data import DataLoader

    transfer = FP8Transfer(out / "hidden_states", dequantize_dtype=dtype) if aux_dtype == "fp8" else None
    ds = ArrowDataset(max_len=MAX_LEN, datapath=str(out), transfer=transfer, on_missing="raise",
                      hidden_states_dtype=dtype)
    loader = DataLoader(ds, batch_size=len(ds), collate_fn=CollateFn(PACKED, 128, num_target_layers=len(AUX),
                                                                     dtype=dtype, preprocess=shift_batch))
    (batch,) = list(loader)
    return batch


def _draft(model_dir, out, dtype: torch.dtype):
    """Eagle3DraftModel as speculators' trainer builds it, with the vocabulary its CLI discovers."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config, parse_vocab_mappings

    found = argparse.Namespace(d2t_path=None, t2d_path=None, data_path=str(out), draft_vocab_size=DRAFT_SIZE,
                               token_freq_path=None, verifier_name_or_path=str(model_dir), trust_remote_code=False)
    d2t, t2d, size = parse_vocab_mappings(found)
    assert size == DRAFT_SIZE and d2t is not None, "speculators did not find d2t-N.npy / t2d-N.npy"
    layer_config = create_transformer_layer_config(str(model_dir), 1, "llama", None, None, [])
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(model_dir), draft_vocab_size=size,
        norm_before_residual=False, ttt_steps=TTT, draft_attn_impl="eager",
        target_layer_ids=[i + 1 for i in AUX])
    return model.to(dtype), d2t, t2d


def _step(model, batch):
    from speculators.losses import resolve_loss_config

    return model(hidden_states=batch["hidden_states"], input_ids=batch["input_ids"],
                 document_ids=batch["document_ids"], loss_mask=batch["loss_mask"],
                 position_ids=batch["position_ids"], verifier_last_hidden_states=batch["verifier_last_hidden_states"],
                 ttt_steps=TTT, loss_config=resolve_loss_config("kl_div", "eager"))


@pytest.mark.parametrize("run", ["bf16", "fp8"])
def test_speculators_reads_and_trains_on_our_dataset(sp, tiny_llama, run):
    dirs, _, plan = sp
    batch = _batch(dirs[run], RUNS[run][1], torch.bfloat16)
    n = sum(s.length - 1 for s in plan.samples)  # shift_batch drops one row per sample
    assert_ids_equal(batch["input_ids"][0, :n], torch.tensor([t for s in plan.samples for t in s.input_ids[1:]]),
                     name="input_ids")
    assert_ids_equal(batch["loss_mask"][0, :n], torch.tensor([t for s in plan.samples for t in s.loss_mask[1:]]),
                     name="loss_mask")
    assert_ids_equal(batch["document_ids"][0, :n], torch.cat([torch.full((s.length - 1,), i)
                                                              for i, s in enumerate(plan.samples)]), name="docs")
    assert bool((batch["document_ids"][0, n:] == -1).all())
    # the values it packs are ours: bf16 as stored; fp8 within fp8's rounding of the bf16 run's
    stored = [load_file(str(dirs["bf16"] / "hidden_states" / f"hs_{s.index}.safetensors"))["hidden_states"]
              for s in plan.samples]
    if run == "fp8":
        for i, s in enumerate(plan.samples):
            q = load_file(str(dirs["fp8"] / "hidden_states" / f"hs_{s.index}.safetensors"))
            assert q["hidden_states"].dtype == torch.float8_e4m3fn
            ours = dequantize(q["hidden_states"], q["hidden_states_scales"], torch.bfloat16)
            err = (ours.double() - stored[i].double()).abs()
            assert bool((err <= error_bound(stored[i], q["hidden_states_scales"], torch.bfloat16)).all()), \
                "fp8 values beyond their rounding bound"
            stored[i] = ours
    # shift_batch: every aux row but the last, every final row but the first
    aux = torch.cat([h[:-1, :-1].flatten(1) for h in stored])
    final = torch.cat([h[1:, -1] for h in stored])
    # FP8Transfer multiplies in bf16 after rounding the scale: up to 3 bf16 roundings from ours
    rtol = 2 ** -7 if run == "fp8" else 0
    assert_close(batch["hidden_states"][0, :n], aux, atol=0, rtol=rtol, name="aux")
    assert_close(batch["verifier_last_hidden_states"][0, :n], final, atol=0, rtol=rtol, name="final slot")
    model, _, _ = _draft(tiny_llama, dirs[run], torch.bfloat16)
    _, loss, _ = _step(model, batch)
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    grad = model.fc.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0)


def test_speculators_targets_equal_nemos(sp, tiny_llama, monkeypatch, nemo_reference):
    from speculators.models.eagle3 import core

    dirs, vocab, plan = sp
    batch = _batch(dirs["fp32"], "auto", torch.float32)
    model, d2t, t2d = _draft(tiny_llama, dirs["fp32"], torch.float32)
    assert_ids_equal(d2t, vocab.d2t(), name="d2t")
    assert_ids_equal(t2d, vocab.t2d(), name="t2d")
    seen = []
    compute_metrics = core.compute_metrics
    monkeypatch.setattr(core, "compute_metrics",
                        lambda logits, targets, *a, **k: seen.append(targets) or compute_metrics(logits, targets,
                                                                                               *a, **k))
    _, loss, _ = _step(model, batch)
    assert torch.isfinite(loss)
    target_p = torch.softmax(seen[0][0].float(), dim=-1)  # [packed, Vd], the shifted frame
    row = 0
    for s in plan.samples:
        want = nemo_target_probs(nemo_reference, vocab, s.input_ids)
        n = s.length - 1
        assert_close(target_p[row: row + n], want[:n], atol=1e-6, rtol=1e-4, name=f"sample {s.index}")
        row += n
