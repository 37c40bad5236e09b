"""The reference that defines the head op (kernels/reference.py), checked on its own.

What: its reductions against a brute force in plain Python on a tiny float64 case built to
hit every rule (ties across the k-th place, a NaN, a tail of 1e-17, draft subset); its final
norm against transformers' own Llama/Qwen and Gemma norm modules, bit for bit; and the logit
formula (scale, then softcap) against the same brute force. The other test files check the
implementations against this reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from eagle_fast.kernels.reference import final_norm, lm_head_reference, reduce_logits

K = 3
DRAFT_IDS = [0, 2, 5, 6, 8]


def _ranked(values: list[float]) -> list[int]:
    """Ids by (value desc, id asc), NaN as +inf."""
    ranked = [math.inf if math.isnan(v) else v for v in values]
    return sorted(range(len(values)), key=lambda i: (-ranked[i], i))


def _logsumexp(values: list[float]) -> float:
    if any(math.isnan(v) for v in values):
        return math.nan
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def _top_k(values: list[float], k: int) -> tuple[list[int], list[float], float]:
    lse = _logsumexp(values)
    ids = _ranked(values)[:k]
    outside = sum(math.exp(v - lse) for i, v in enumerate(values) if i not in ids)
    return ids, [values[i] - lse for i in ids], outside


def brute_force(row: list[float]) -> dict:
    lse = _logsumexp(row)
    draft = [row[i] for i in DRAFT_IDS]
    d_lse = _logsumexp(draft)
    ids, logprobs, tail = _top_k(row, K)
    d_ids, d_logprobs, d_tail = _top_k(draft, K)
    return {
        "lse": lse, "argmax": _ranked(row)[0], "logprobs": [v - lse for v in row],
        "topk_ids": ids, "topk_logprobs": logprobs, "topk_tail": tail,
        "draft_logprobs": [v - d_lse for v in draft],
        "argmax_in_draft": _ranked(row)[0] in DRAFT_IDS,
        "draft_topk_ids": d_ids, "draft_topk_logprobs": d_logprobs, "draft_topk_tail": d_tail,
    }  # fmt: skip


def tiny_logits() -> torch.Tensor:
    nan, inf = math.nan, math.inf
    return torch.tensor(
        [
            [0.3, -1.2, 2.5, 0.7, -0.4, 1.9, 2.2, -3.0, 0.1],  # distinct values
            [3.0, 1.0, 3.0, 0.0, 2.0, 3.0, 1.0, 2.0, 3.0],  # four-way tie across the k-th place
            [1.0, 4.0, 4.0, inf, 2.0, nan, 4.0, 1.0, 0.0],  # NaN ranks as +inf: after id 3
            [0.0, 0.0, 0.0, 0.0, 40.0, 0.0, 0.0, 0.0, 0.0],  # tail exp(-40) x 8: no cancellation
        ],
        dtype=torch.float64,
    )


def test_reductions_match_a_brute_force_in_plain_python():
    logits = tiny_logits()
    got = reduce_logits(logits, k=K, draft_ids=torch.tensor(DRAFT_IDS)).as_dict()
    for r, row in enumerate(logits.tolist()):
        want = brute_force(row)
        for name, value in want.items():
            have = got[name][r]
            if name.endswith("ids") or name.startswith("argmax"):
                assert have.tolist() == value, (r, name, have.tolist(), value)
            else:  # relative: the tail of row 3 is 3e-17 and must be right to many digits
                want_t = torch.tensor(value, dtype=torch.float64)
                torch.testing.assert_close(have, want_t, rtol=1e-12, atol=0, equal_nan=True,
                                           msg=f"row {r} {name}")
    assert got["topk_tail"][3] > 0  # 1 - sum(top-k) would be 0 here


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm", ["rms", "rms_one_plus"])
def test_final_norm_is_transformers_norm_bit_for_bit(norm, dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(1)
    hidden = (torch.randn(33, 96, generator=g) * 3).to(dtype)
    offset = 1.0 if norm == "rms" else 0.0  # Gemma stores w with the 1 taken out
    norm_weight = (offset + 0.2 * torch.randn(96, generator=g)).to(dtype)
    module = (Qwen3RMSNorm if norm == "rms" else Gemma3RMSNorm)(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(norm_weight)
        served = module(hidden)
    y = final_norm(hidden, norm_weight, eps=1e-6, norm=norm, dtype=dtype)
    assert y.dtype == dtype
    assert torch.equal(y, served), f"{int((y != served).sum())} of {y.numel()} elements differ"


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_logits_are_scaled_then_capped(softcap):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 1, 4, generator=g)  # leading dims are kept
    weight = torch.randn(9, 4, generator=g).bfloat16()
    kw = {"norm": "none", "logit_scale": 2.5, "softcap": softcap, "k": K}
    out = lm_head_reference(hidden, weight, None, **kw)
    assert out.logits.shape == (2, 1, 9) and out.topk_ids.shape == (2, 1, K)
    y = hidden.bfloat16().double().reshape(2, 4).tolist()  # "none": y = rnd(x) in the weight dtype
    w = weight.double().tolist()
    for r in range(2):
        row = [2.5 * sum(a * b for a, b in zip(y[r], w[v])) for v in range(9)]
        if softcap is not None:
            row = [softcap * math.tanh(x / softcap) for x in row]
        want = torch.tensor(row, dtype=torch.float64)
        torch.testing.assert_close(out.logits[r, 0], want, rtol=1e-12, atol=1e-12)
        assert out.topk_ids[r, 0].tolist() == _ranked(row)[:K]
