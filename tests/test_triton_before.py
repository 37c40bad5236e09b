"""The frozen pre-issue-29 Triton head (bench/triton_before/) still runs and agrees with today's.

What: `gpu_check.sh` times the old kernel beside the new one on the first GPU; a copy that no
longer imports, or that computes something else, would make that comparison meaningless. Here
both run through the Triton interpreter on CPU at a small shape with several draft and
non-draft tiles, for draft+argmax and lse+argmax, and must agree: the same argmax ids, lse and
draft log-probs within fp32 noise (the two walk the vocabulary in different orders).
Limits: the interpreter, not compiled code; speed is the GPU check's business.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")

from eagle_fast import kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from triton_before.lm_head_triton import lm_head_triton as before


@pytest.mark.parametrize("outputs", [("draft", "argmax"), ("lse", "argmax")])
def test_old_kernel_agrees_with_new(outputs):
    g = torch.Generator().manual_seed(0)
    n, h, v = 24, 64, 1500
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) / h**0.5).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    draft = torch.randperm(v, generator=g)[:600].sort().values
    kw = {"draft_ids": draft} if "draft" in outputs else {}
    new = kernels.lm_head(hidden, weight, norm_weight, outputs=outputs, impl="triton", **kw)
    with mock.patch.object(kernels, "_triton_impl", lambda: before):
        old = kernels.lm_head(hidden, weight, norm_weight, outputs=outputs, impl="triton", **kw)
    assert torch.equal(old.argmax, new.argmax)
    for name in ("lse", "draft_logprobs"):
        a, b = getattr(old, name, None), getattr(new, name, None)
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-5)
