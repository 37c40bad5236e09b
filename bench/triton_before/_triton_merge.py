"""Host side of the Triton head: per-tile scratch and the merges that reduce it per row.

Design: `lm_head_fwd_kernel` leaves, per (row, vocab tile), a max, a sum of exp and an
argmax, top-k candidates as int64 keys (`_triton_jit.pack_key`; target ids, or draft indices
for the draft top-k) and draft statistics, in a `Scratch`. Torch merges them: lse by
logaddexp over tiles, top-k by torch.topk over the keys, and the mass outside the top-k
summed directly from the non-selected terms, never as 1 - sum(top-k). The same merge serves the draft top-k on the draft columns' statistics.
`candidate_rounds` sizes the candidates per tile, `saturated_tiles` finds the tiles whose
candidates may hide more of a row's top-k (the launcher re-runs those).
Limits: statistics are merged in float64 on [rows, tiles] buffers; a candidate costs its 8 B
key plus transients while merging (`Scratch.bytes_per_row`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton_jit import KEY_NONE


@dataclass
class Scratch:
    """Per-launch scratch for R rows and T vocab tiles (lm_head_triton.py bounds its size)."""

    part_m: torch.Tensor  # [R, T] fp32
    part_s: torch.Tensor  # [R, T] fp32
    part_arg: torch.Tensor  # [R, T] int32
    cand: torch.Tensor  # [R, T, n_rounds] int64 (top-k, draft top-k) or a 1-element dummy
    part_dm: torch.Tensor  # [R, T] fp32 (draft, draft top-k) or dummy
    part_ds: torch.Tensor  # [R, T] fp32 (draft, draft top-k) or dummy

    @staticmethod
    def alloc(rows: int, T: int, n_rounds: int, draft: bool, device) -> Scratch:
        f32 = {"dtype": torch.float32, "device": device}
        dummy = torch.empty(1, **f32)
        return Scratch(
            part_m=torch.empty((rows, T), **f32),
            part_s=torch.empty((rows, T), **f32),
            part_arg=torch.empty((rows, T), dtype=torch.int32, device=device),
            cand=torch.empty(
                (rows, T, n_rounds) if n_rounds else (1,), dtype=torch.int64, device=device
            ),
            part_dm=torch.empty((rows, T), **f32) if draft else dummy,
            part_ds=torch.empty((rows, T), **f32) if draft else dummy,
        )

    @staticmethod
    def bytes_per_row(T: int, n_rounds: int, draft: bool) -> int:
        # a top-k candidate: its 8 B key plus up to ~24 B of transients in merge_topk
        return T * (12 + (8 if draft else 0) + 32 * n_rounds)


def merge_lse(part_m: torch.Tensor, part_s: torch.Tensor) -> torch.Tensor:
    """logaddexp over tiles, in float64: lse = M + log(sum_t s_t * exp(m_t - M))."""
    M = part_m.amax(dim=1).double()
    M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))  # all -inf: lse = -inf
    total = (part_s.double() * torch.exp(part_m.double() - M[:, None])).sum(1)
    return M + torch.log(total)


def merge_topk(part_m, part_s, keys, k: int):
    """Top-k, tail mass and lse of each row from per-tile candidates.

    part_m [R, T] tile maxima, part_s [R, T] tile sums exp(l - m_t) over NON-candidates,
    keys [R, C] int64 candidate keys (`pack_key`, unique; KEY_NONE for empty slots).
    Returns (top keys [R, k] descending, tail float64 [R], lse float64 [R]). The tail is
    summed directly from the mass outside the top-k (non-candidates + unselected
    candidates), never as 1 - sum(top-k). Transient memory ~20 B per candidate.
    """
    top = torch.topk(keys, k, dim=1, sorted=True).values
    M = part_m.amax(dim=1)
    M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))
    outside = (part_s.double() * torch.exp(part_m.double() - M.double()[:, None])).sum(1)
    mass = key_values(keys).sub_(M[:, None]).exp_()  # fp32 terms <= 1, summed in float64
    selected = keys >= top[:, k - 1 :]
    inside = torch.where(selected, mass, 0.0).sum(1, dtype=torch.float64)
    mass.masked_fill_(selected.logical_or_(keys == KEY_NONE), 0.0)
    outside += mass.sum(1, dtype=torch.float64)
    del mass, selected
    total = outside + inside
    return top, outside / total, M.double() + torch.log(total)


def remerge_topk(keys, part_m, part_s, tiles, keys2, part_m2, part_s2, k: int):
    """`merge_topk` after re-running vocab `tiles` [L]: the first pass's candidates keys
    [F, T, n] and statistics part_m / part_s [F, T] (overwritten) take the re-run's keys2
    [F, L, n2] and part_m2 / part_s2 [F, L] for those tiles."""
    F = keys.shape[0]
    keys[:, tiles, :] = KEY_NONE
    part_m[:, tiles] = part_m2
    part_s[:, tiles] = part_s2
    keys = torch.cat([keys.reshape(F, -1), keys2.reshape(F, -1)], dim=1)
    return merge_topk(part_m, part_s, keys, k)


def tile_lengths(V: int, block_v: int, draft_ids: torch.Tensor | None, device) -> torch.Tensor:
    """[T] int64: ids per vocab tile that can be top-k candidates, the tile's width, or with
    `draft_ids` (a top-k over the draft columns) the draft ids it holds."""
    T = -(-V // block_v)
    if draft_ids is not None:
        return torch.bincount(draft_ids // block_v, minlength=T)
    return (V - torch.arange(T, device=device) * block_v).clamp_(max=block_v)


def candidate_rounds(lens: torch.Tensor, k: int, first_pass: int, exact: bool) -> int:
    """Top-k candidates per (row, tile) for tiles of `lens` ids: min(k, fullest tile) is
    exact; a first pass keeps `first_pass` when that is fewer (unless the tiles could then
    not hold k candidates between them)."""
    fullest, capacity = torch.stack([lens.max(), lens.clamp(max=first_pass).sum()]).tolist()
    full = min(k, fullest)
    return full if exact or full <= first_pass or capacity < k else first_pass


def saturated_tiles(cand, kth, lens) -> torch.Tensor:
    """[R, T] bool: tile t of row r had all its n candidates selected (key >= the k-th
    selected key `kth` [R, 1]) and holds more than n candidate ids (`lens` [T]), so it may
    hide further top-k members. Tiles that are not saturated provably hide none."""
    n = cand.shape[2]
    last = cand[:, :, n - 1]
    return (last >= kth) & (lens > n)[None, :] & (last != KEY_NONE)


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values of `pack_key` keys (a new tensor). Empty slots decode to NaN."""
    hi = (keys >> 32).to(torch.int32)
    return torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).view(torch.float32)


def unpack_keys(keys: torch.Tensor):
    """Inverse of `pack_key`: (fp32 values, int64 ids)."""
    return key_values(keys), 0x7FFFFFFF - (keys & 0xFFFFFFFF)
