"""Head weights that are not finite are refused when the head is built, once, by name and row.

What: a NaN or inf in the LM-head weight (a whole row, one element, past the first row chunk)
or in the final-norm weight raises UserError naming the tensor, the row and the fix, both for
a head built from tensors and for one read from a checkpoint (the checkpoint's tensor name);
each tensor is checked exactly once per load; finite weights load as before.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import eagle_fast.head as head_mod
from eagle_fast.errors import UserError
from eagle_fast.head import HeadSpec, TargetHead

V, H = 2500, 32  # three 1024-row chunks
SPEC = HeadSpec(norm="rms", eps=1e-6)


def _weights(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, H, generator=g).to(dtype), (1 + torch.randn(H, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(
    "row, cols, value, what",
    [(1234, slice(None), float("nan"), "NaN"), (2100, slice(3, 4), float("nan"), "NaN"),
     (0, slice(31, 32), float("-inf"), "inf"), (V - 1, slice(0, 5), float("inf"), "inf")],
)  # fmt: skip
def test_lm_head_row_not_finite_is_refused(dtype, row, cols, value, what):
    weight, norm = _weights(dtype)
    weight[row, cols] = value
    with pytest.raises(UserError, match=rf"lm_head_weight row {row} has {what}.*corrupt") as e:
        TargetHead(weight, norm, SPEC)
    assert "re-download or re-convert" in e.value.fix


def test_norm_weight_not_finite_is_refused():
    weight, norm = _weights()
    norm[5] = float("nan")
    with pytest.raises(UserError, match=r"norm_weight element 5 has NaN"):
        TargetHead(weight, norm, SPEC)


def test_finite_head_loads():
    weight, norm = _weights()
    head = TargetHead(weight, norm, SPEC)
    assert head.lm_head_weight is weight and head.vocab_size == V


def test_checkpoint_names_its_tensor_and_each_is_checked_once(tmp_path, monkeypatch):
    weight, norm = _weights(torch.float32)
    weight[7, 2] = float("nan")
    tensors = {"model.embed_tokens.weight": weight.clone(), "model.norm.weight": norm,
               "lm_head.weight": weight}  # fmt: skip
    save_file(tensors, str(tmp_path / "model.safetensors"))
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                      vocab_size=V, rms_norm_eps=1e-6, tie_word_embeddings=False)
    checked = []
    real = head_mod.check_finite
    monkeypatch.setattr(head_mod, "check_finite", lambda n, w: (checked.append(n), real(n, w)))
    with pytest.raises(UserError, match=r"lm_head\.weight row 7 has NaN"):
        TargetHead.from_pretrained(tmp_path, cfg)
    checked.clear()
    tensors["lm_head.weight"] = _weights(torch.float32)[0]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    TargetHead.from_pretrained(tmp_path, cfg)
    assert sorted(checked) == ["lm_head.weight", "model.norm.weight"]
