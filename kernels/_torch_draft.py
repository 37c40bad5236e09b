"""The draft vocabulary's outputs of the PyTorch head: dense log-probs and the sparse top-k.

`lm_head_torch.lm_head_torch` walks the draft ids first when it needs draft outputs without a full
[N, V] output (draft-first order), so the draft columns are one contiguous range of the walk:
  - "draft": raw fp32 draft logits land in an [N, Vd] buffer, normalised at the end
    (`draft_log_softmax`);
  - "draft_topk": no [N, Vd] buffer. The running top-k and the running sum outside it cover
    the draft range only, so when that range ends they are the draft top-k and the draft mass
    outside it (`draft_topk_outputs`); the rest of the vocabulary then feeds the argmax (and
    the full-vocab lse when it is asked for) alone.
"""

from __future__ import annotations

import torch


def draft_log_softmax(
    draft_buf: torch.Tensor, lse: torch.Tensor | None, out_dtype: torch.dtype, tile_elems: int
) -> torch.Tensor:
    """The draft log-probs in `out_dtype` from raw fp32 draft logits [N, Vd]: minus `lse` [N]
    when the caller has the draft logsumexp, else torch's fused log_softmax per row.

    Row blocks of about `tile_elems` elements (the call's [R, C] tile) go through a temporary
    that stays in cache, so a 16-bit result is rounded from it on the way out and the fp32
    buffer is read once (a whole-buffer subtract, then a cast, would write and re-read it).
    An fp32 result is `draft_buf` itself, shifted in place.
    """
    n, vd = draft_buf.shape
    if lse is not None and out_dtype == torch.float32:
        return draft_buf.sub_(lse[:, None])
    rows = max(1, min(n, tile_elems // max(vd, 1)))
    tmp = torch.empty(rows, vd, dtype=draft_buf.dtype, device=draft_buf.device)
    out = draft_buf if out_dtype == torch.float32 else torch.empty(
        n, vd, dtype=out_dtype, device=draft_buf.device)
    for r0 in range(0, n, rows):
        blk = draft_buf[r0 : r0 + rows]
        t = tmp[: blk.shape[0]]
        if lse is None:
            torch.log_softmax(blk, dim=1, out=t)
        else:
            torch.sub(blk, lse[r0 : r0 + rows, None], out=t)
        out[r0 : r0 + rows].copy_(t)
    return out


def draft_topk_outputs(
    run_max: torch.Tensor, run_sum: torch.Tensor, values: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(draft_lse fp32 [N], draft_topk_logprobs [N, k] out_dtype, draft_topk_tail fp32 [N])`
    when the walk has just covered the draft range.

    run_max [N] fp32 and run_sum [N] fp64 are the running max and the float64 sum of
    exp(logit - run_max) over the draft logits OUTSIDE the running top-k; values [N, k] fp32 are
    the top-k logits. The tail is that outside sum over the total, never 1 - sum(top-k), which
    cancels to noise when the top-k holds almost all the mass.
    """
    max64 = run_max.double()
    total = run_sum + torch.exp(values.double() - max64[:, None]).sum(1)
    lse64 = max64 + torch.log(total)
    logprobs = (values.double() - lse64[:, None]).to(out_dtype)
    tail = (run_sum / total).clamp_(0.0, 1.0).float()
    return lse64.float(), logprobs, tail
