"""The tests' one float64 oracle of the head op: every output from full float64 logits.

`lm_head_oracle(hidden, weight, ...)` takes `lm_head`'s arguments and computes the logits in
float64 after the SAME rounding of the normalised activation as the head
(`lm_head_torch.normalize`, the one rounding the semantics define), then reduces them with
`oracle_from_logits`, which also serves logits from elsewhere (transformers' own, in the
runner tests). Ties follow the head's rule through a stable sort (equal values keep ascending
id order); topk_tail is summed directly over the tokens outside the top-k.
`same_dtype=True` gives the yardstick of the tolerance rule: the same oracle with its GEMM
run as plain PyTorch runs it in the weight dtype (output rounded to that dtype).
Limits: rows go in blocks of `row_block`, each a [row_block, V] float64 tensor plus its sort.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from eagle_fast.kernels import HeadOutput
from eagle_fast.kernels.lm_head_torch import normalize


def _reduce(logits: torch.Tensor, k: int, draft_ids: torch.Tensor | None) -> HeadOutput:
    """Every output of float64 logits [R, V]."""
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits - lse[:, None]
    # stable descending sort = the exact tie rule (equal values keep ascending id order)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    out = HeadOutput(lse=lse, argmax=order[:, 0], logits=logits, logprobs=logprobs)
    if k:
        out.topk_ids = order[:, :k]
        out.topk_logprobs = torch.gather(logprobs, 1, out.topk_ids)
        out.topk_tail = torch.gather(logprobs, 1, order[:, k:]).exp().sum(-1)
    if draft_ids is not None:
        out.draft_logprobs = torch.log_softmax(logits[:, draft_ids], dim=-1)
        out.argmax_in_draft = torch.isin(out.argmax, draft_ids)
        if 0 < k <= draft_ids.numel():  # the draft top-k: indices into draft_ids, same tie rule
            d_order = torch.sort(logits[:, draft_ids], dim=-1, descending=True, stable=True).indices
            out.draft_topk_ids = d_order[:, :k]
            out.draft_topk_logprobs = torch.gather(out.draft_logprobs, 1, out.draft_topk_ids)
            out.draft_topk_tail = torch.gather(out.draft_logprobs, 1, d_order[:, k:]).exp().sum(-1)
    return out


def _concat(parts: list[HeadOutput], lead: tuple[int, ...]) -> HeadOutput:
    names = parts[0].as_dict()
    fields = {name: torch.cat([p.as_dict()[name] for p in parts]) for name in names}
    return HeadOutput(**fields).reshape(lead)


@torch.no_grad()
def oracle_from_logits(
    logits: torch.Tensor,
    *,
    k: int = 0,
    draft_ids: torch.Tensor | None = None,
    row_block: int = 1024,
) -> HeadOutput:
    """Every head output of logits [..., V] (any float dtype), computed in float64.

    Fields keep the leading dims; float fields are float64, ids int64. logits, logprobs, lse
    and argmax always; top-k when k > 0; draft outputs when draft_ids is given, and the draft
    top-k (draft_topk_*) when both are and k <= Vd.
    """
    lead = tuple(logits.shape[:-1])
    x = logits.reshape(-1, logits.shape[-1])
    parts = [
        _reduce(x[r0 : r0 + row_block].double(), k, draft_ids)
        for r0 in range(0, max(x.shape[0], 1), row_block)
    ]
    return _concat(parts, lead)


@torch.no_grad()
def lm_head_oracle(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    norm: str = "rms",
    logit_scale: float = 1.0,
    softcap: float | None = None,
    k: int = 0,
    draft_ids: torch.Tensor | None = None,
    row_block: int = 1024,
    same_dtype: bool = False,
    **_ignored,
) -> HeadOutput:
    """Truth for tests: every output from full float64 logits, after the SAME rounding of y.

    Takes `lm_head`'s arguments (outputs / out_dtype / impl are accepted and ignored: it
    computes every output `oracle_from_logits` does). hidden [..., H]; fields keep the
    leading dims. same_dtype: the GEMM y @ weight.T runs in the weight dtype with its output
    rounded to it (F.linear), as plain PyTorch computes it; a low-precision result passes when
    its error is at most a small multiple of that one's plus atol.
    """
    lead = tuple(hidden.shape[:-1])
    x = hidden.reshape(-1, hidden.shape[-1])
    w64 = weight.double()
    parts = []
    for r0 in range(0, max(x.shape[0], 1), row_block):
        y = normalize(x[r0 : r0 + row_block], norm_weight, eps=eps, norm=norm, dtype=weight.dtype)
        gemm = F.linear(y, weight).double() if same_dtype else y.double() @ w64.t()
        logits = gemm * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        parts.append(_reduce(logits, k, draft_ids))
    return _concat(parts, lead)
