"""What a sparse draft target loses: the per-token KL of each rebuild against the dense target,
and its bound from the stored tail mass alone.

Per token, with k kept ids, the true draft distribution p, tau the draft mass outside the kept
ids and Vd the draft vocabulary (`supervision.dense_target_p(_ragged)` rebuilds q):
  spread       KL(p || q) <= tau ln(Vd - k)      (q > 0 everywhere; equality when one id holds
                                                  the whole tail)
  renormalize  KL(q || p)  = -ln(1 - tau)        (q is p given the kept ids; KL(p || q) is
                                                  infinite when tau > 0)
  drop         D(q || p)   = tau                 (q sums to 1 - tau: the generalised KL of
                                                  unnormalised measures, sum q ln(q/p) - q + p)
`kl_check` measures the left side in float64 from a recomputed dense p and gives the bound from
the STORED tail plus an allowance for what storing rounds (the kept log-probs in out_dtype, the
tail in fp32, q in fp32). Limits: the allowance is first order in the rounding; it is not a
bound on training quality, which also depends on the draft model.
"""

from __future__ import annotations

import torch

from eagle_fast.supervision import TAIL_MODES, dense_target_p_ragged


def kl_check(p_true: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor,
             tail: torch.Tensor, draft_size: int, mode: str, tail_tol: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kl, bound, allowance), float64 `[T]` each: a rebuild within its bound has
    kl <= bound + allowance on every token. kl is +inf where the stored tail is off the true
    mass outside the kept ids by more than `tail_tol` (plus its fp32 rounding): the bound is
    the stored tail's, so a wrong tail fails rather than widening the allowance.

    p_true `[T, Vd]` (the dense draft distribution, recomputed); the sparse target ragged as
    stored with --keep-mass (lengths `[T]`, ids and logprobs `[sum lengths]`, tail `[T]`); a
    fixed-k target is lengths = k everywhere and its `[T, k]` fields flattened."""
    if mode not in TAIL_MODES:
        raise ValueError(f"tail mode must be one of {TAIL_MODES}, got {mode!r}")
    p = p_true.double()
    lengths = lengths.long()
    T = p.shape[0]
    q = dense_target_p_ragged(lengths, ids, logprobs, tail, draft_size, mode).double()
    rows = torch.repeat_interleave(torch.arange(T), lengths)
    kept = torch.zeros_like(p, dtype=torch.bool)
    kept[rows, ids.long()] = True
    tau = torch.where(kept, 0.0, p).sum(-1)  # the true mass outside, summed (never 1 - kept)
    stored = tail.double()
    # the kept log-probs' rounding, per token: the largest |stored - true| log-prob
    delta = torch.zeros(T, dtype=torch.float64).scatter_reduce_(
        0, rows, (logprobs.double() - p[rows, ids.long()].log()).abs(), "amax")
    eps = 1e-6  # q itself is fp32
    wrong_tail = (tau - stored).abs() > tail_tol + 2**-23 * stored + 1e-12
    if mode == "spread":
        others = (draft_size - lengths).clamp_min(1).double()
        kl = torch.where(p > 0, p * (p.log() - q.log()), 0.0).sum(-1)
        bound = stored * others.log()
        allowance = delta + tau * (tau / stored).log().abs().nan_to_num(0.0) + (tau - stored).abs() * others.log()
    else:
        ratio = torch.where(q > 0, q * (q.log() - p.log()), 0.0).sum(-1)
        if mode == "renormalize":
            kl = ratio
            bound = -torch.log1p(-stored)
            allowance = 2 * delta + (torch.log1p(-tau) - torch.log1p(-stored)).abs()
        else:
            kl = ratio - q.sum(-1) + p.sum(-1)
            bound = stored
            # D = tau + sum_kept p (e^d (d - 1) + 1), d = the log-prob's rounding: <= d^2 for |d| <= 1
            allowance = delta * delta + (tau - stored).abs()
    return kl.masked_fill(wrong_tail, float("inf")), bound, allowance.clamp_min(0.0) + eps
