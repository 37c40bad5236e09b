"""The head op defined: a short, slow PyTorch reference that every implementation must match.

`lm_head_reference(hidden, weight, ...)` computes full logits and reads every output off them;
`reduce_logits(logits, ...)` is its second half, for logits that come from elsewhere (a
transformers model's own). Plain by design, like vLLM's `forward_native`: no vocabulary
tiling, no candidate tricks; rows go in blocks only to bound memory. It imports nothing from
the implementations it checks (`lm_head_torch`, `lm_head_triton`).

Semantics (both implementations follow them)
    x32    = hidden.float()                                       [N, H]
    r      = rsqrt(mean(x32 ** 2, -1) + eps)                       [N]    fp32
    y      = rounded to weight.dtype as the served model rounds it  [N, H]
             "rms" (Llama/Qwen, transformers and vLLM): rnd(rnd(x32 * r) * rnd(norm_weight))
             "rms_one_plus" (Gemma): rnd(x32 * r * (1 + norm_weight.float()))
             "none": rnd(x32);  rnd = round to nearest-even in weight.dtype
    logits = (y @ weight.T) * logit_scale                          [N, V]
             then softcap * tanh(logits / softcap) when softcap is set
             (the implementations accumulate in fp32 and keep fp32 logits)
    lse    = logsumexp(logits)
    argmax = first index of max(logits)                            ties -> lower id
    top-k  = k largest logits, ordered by (value desc, id asc)     exact tie rule, k in [1, V]
    topk_logprobs   = topk logits - lse
    topk_tail       = mass OUTSIDE the top-k, summed over those tokens (never 1 - sum(top-k),
                      which cancels to noise when the top-k holds almost all the mass)
    draft_logprobs  = log_softmax(logits[:, draft_ids])            over the draft columns only
    argmax_in_draft = argmax in draft_ids
    draft top-k     = the same top-k over logits[:, draft_ids]: ids index draft_ids, logprobs
                      are draft_logprobs, draft_topk_tail the draft mass outside it
    A NaN logit ranks as +inf in argmax and every top-k (ids stay real ids); lse turns NaN.
Limits: float64 [row_block, V] logits plus their sort per block; a test oracle, not a path.
"""

from __future__ import annotations

import math

import torch

from ._common import HeadOutput


def final_norm(hidden, norm_weight, *, eps: float, norm: str, dtype: torch.dtype) -> torch.Tensor:
    """y [N, H] in `dtype` (the weight dtype): the final norm, rounded where the served model
    rounds it (see the semantics above; fp32 statistics, rnd the identity for fp32)."""
    x32 = hidden.float()
    if norm == "none":
        return x32.to(dtype)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if norm == "rms":  # normalise, round; weight in dtype, round (HF's `weight * x.to(dtype)`)
        return ((x32 * r).to(dtype).float() * norm_weight.to(dtype).float()).to(dtype)
    return (x32 * r * (1.0 + norm_weight.float())).to(dtype)  # "rms_one_plus": round once


def _top_k(logits: torch.Tensor, logprobs: torch.Tensor, k: int):
    """(ids [R, k], their logprobs [R, k], mass outside them [R]) by (value desc, id asc)."""
    ranked = torch.where(logits.isnan(), math.inf, logits)  # NaN ranks as +inf
    ids = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :k]  # stable: id asc
    outside = torch.ones_like(logits, dtype=torch.bool).scatter_(1, ids, False)
    tail = torch.where(outside, logprobs.exp(), 0.0).sum(-1)
    return ids, logprobs.gather(1, ids), tail


def _reduce(logits: torch.Tensor, k: int, draft_ids: torch.Tensor | None) -> HeadOutput:
    """Every output of float64 logits [R, V]."""
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits - lse[:, None]
    argmax = torch.where(logits.isnan(), math.inf, logits).argmax(-1)  # the first maximal id
    out = HeadOutput(lse=lse, argmax=argmax, logits=logits, logprobs=logprobs)
    if 0 < k <= logits.shape[1]:
        out.topk_ids, out.topk_logprobs, out.topk_tail = _top_k(logits, logprobs, k)
    if draft_ids is not None:
        draft_logits = logits[:, draft_ids]
        out.draft_logprobs = torch.log_softmax(draft_logits, dim=-1)
        out.argmax_in_draft = torch.isin(argmax, draft_ids)
        if 0 < k <= draft_ids.numel():
            out.draft_topk_ids, out.draft_topk_logprobs, out.draft_topk_tail = _top_k(
                draft_logits, out.draft_logprobs, k)
    return out


def _concat(parts: list[HeadOutput], lead: tuple[int, ...]) -> HeadOutput:
    fields = {name: torch.cat([p.as_dict()[name] for p in parts]) for name in parts[0].as_dict()}
    return HeadOutput(**fields).reshape(lead)


@torch.no_grad()
def reduce_logits(logits: torch.Tensor, *, k: int = 0, draft_ids: torch.Tensor | None = None,
                  row_block: int = 1024) -> HeadOutput:
    """Every head output of logits [..., V] (any float dtype), computed in float64.

    Fields keep the leading dims; float fields are float64, ids int64. logits, logprobs, lse and
    argmax always; the top-k when 1 <= k <= V; the draft outputs when draft_ids (int64 [Vd],
    ascending) is given, and the draft top-k when also 1 <= k <= Vd.
    """
    x = logits.reshape(-1, logits.shape[-1])
    parts = [_reduce(x[r0 : r0 + row_block].double(), k, draft_ids)
             for r0 in range(0, max(x.shape[0], 1), row_block)]
    return _concat(parts, tuple(logits.shape[:-1]))


@torch.no_grad()
def lm_head_reference(
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
    dtype: torch.dtype = torch.float64,
    row_block: int = 1024,
) -> HeadOutput:
    """Every head output of `lm_head`'s arguments: hidden [..., H], weight [V, H], norm_weight [H].

    dtype is the GEMM's precision, operands and output: float64 (exact products) is the truth;
    the weight dtype is what plain PyTorch computes (a 16-bit GEMM rounds its output), the
    yardstick of the tests' tolerance. Scale, softcap and the reductions run in float64.
    Returns `reduce_logits`' fields, leading dims of hidden.
    """
    x = hidden.reshape(-1, hidden.shape[-1])
    w = weight.to(dtype)
    parts = []
    for r0 in range(0, max(x.shape[0], 1), row_block):
        y = final_norm(x[r0 : r0 + row_block], norm_weight, eps=eps, norm=norm, dtype=weight.dtype)
        logits = (y.to(dtype) @ w.t()).double() * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        parts.append(_reduce(logits, k, draft_ids))
    return _concat(parts, tuple(hidden.shape[:-1]))
