"""Host side of the Triton head: per-tile scratch and the merges that reduce it per row.

Design: `lm_head_fwd_kernel` leaves, per (row, vocab tile), a max, a sum of exp and an
argmax, top-k candidates as int64 keys (`_triton_jit.pack_key`; target ids, or draft indices
for the draft top-k) and draft statistics, in a `Scratch`. Torch merges them: lse by
logaddexp over tiles, top-k by torch.topk over the keys, and the mass outside the top-k
summed directly from the non-selected terms, never as 1 - sum(top-k). The same merge serves
the draft top-k on the draft tiles' statistics; the argmax merge takes the lowest id among the
tiles holding the max, whatever order they walk the vocabulary in (`draft_first_order`).
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
    """Per-launch scratch for R rows, T vocab tiles of which TD are draft tiles, and top-k
    candidates on C tiles (T for top-k, TD for the draft top-k); lm_head_triton.py bounds it."""

    part_m: torch.Tensor  # [R, T] fp32
    part_s: torch.Tensor  # [R, T] fp32
    part_arg: torch.Tensor  # [R, T] int32
    cand: torch.Tensor  # [R, C, n_rounds] int64 (top-k, draft top-k) or a 1-element dummy
    part_dm: torch.Tensor  # [R, TD] fp32 (draft, draft top-k) or dummy
    part_ds: torch.Tensor  # [R, TD] fp32 (draft, draft top-k) or dummy

    @staticmethod
    def alloc(rows: int, T: int, C: int, n_rounds: int, TD: int, device) -> Scratch:
        f32 = {"dtype": torch.float32, "device": device}
        dummy = torch.empty(1, **f32)
        return Scratch(
            part_m=torch.empty((rows, T), **f32),
            part_s=torch.empty((rows, T), **f32),
            part_arg=torch.empty((rows, T), dtype=torch.int32, device=device),
            cand=torch.empty(
                (rows, C, n_rounds) if n_rounds else (1,), dtype=torch.int64, device=device
            ),
            part_dm=torch.empty((rows, TD), **f32) if TD else dummy,
            part_ds=torch.empty((rows, TD), **f32) if TD else dummy,
        )

    def empty_(self) -> Scratch:
        """Every slot empty (the exact re-run's, which fills only some): no candidate, a max of
        -inf and a sum of 0."""
        for t, empty in ((self.part_m, float("-inf")), (self.part_dm, float("-inf")),
                         (self.part_s, 0.0), (self.part_ds, 0.0), (self.cand, KEY_NONE)):  # fmt: skip
            t.fill_(empty)
        return self

    @staticmethod
    def bytes_per_row(T: int, C: int, n_rounds: int, TD: int) -> int:
        # a top-k candidate: its 8 B key plus up to ~24 B of transients in merge_topk
        return T * 12 + TD * 8 + C * 32 * n_rounds


def draft_first_order(draft_ids: torch.Tensor, V: int):
    """The draft-first walk of the vocabulary: (order int32 [V], the target id at each
    position: the Vd draft ids ascending, then the other ids ascending; in_draft bool [V]).
    Device ops only (a cumsum and a scatter): no host synchronisation."""
    device = draft_ids.device
    in_draft = torch.zeros(V, dtype=torch.bool, device=device).index_fill_(0, draft_ids, True)
    ids = torch.arange(V, device=device)
    drafts_below = torch.cumsum(in_draft, 0) - in_draft.long()  # draft ids < id
    pos = torch.where(in_draft, drafts_below, draft_ids.numel() + ids - drafts_below)
    order = torch.empty(V, dtype=torch.int32, device=device).scatter_(0, pos, ids.int())
    return order, in_draft


def merge_argmax(part_m: torch.Tensor, part_arg: torch.Tensor) -> torch.Tensor:
    """int64 [R]: the lowest target id among the tiles holding the row max (tiles may walk
    the vocabulary in any order; each tile's argmax is its lowest id among its maxima)."""
    top = part_m.amax(dim=1, keepdim=True)
    return torch.where(part_m == top, part_arg, 2**31 - 1).amin(dim=1).long()


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


def remerge_topk(keys, part_m, part_s, sat, keys2, part_m2, part_s2, k: int):
    """`merge_topk` after the exact re-run of the saturated tiles `sat` [R, C]: their first-pass
    candidates keys [R, C, n] and statistics part_m / part_s [R, C] give way to the re-run's
    slots keys2 [R, S, n2], part_m2 / part_s2 [R, S] (empty slots: KEY_NONE, -inf, 0)."""
    R = keys.shape[0]
    keys = keys.masked_fill(sat[..., None], KEY_NONE).reshape(R, -1)
    part_m = torch.cat([part_m.masked_fill(sat, float("-inf")), part_m2], 1)
    part_s = torch.cat([part_s.masked_fill(sat, 0.0), part_s2], 1)
    return merge_topk(part_m, part_s, torch.cat([keys, keys2.reshape(R, -1)], 1), k)


def tile_lengths(count: int, block_v: int, device) -> torch.Tensor:
    """[cdiv(count, block_v)] int64: ids per tile that can be top-k candidates, when `count`
    of them fill the walk's tiles from the first (V for top-k; Vd, the draft tiles, for the
    draft top-k). Device arithmetic, no copy from the host."""
    T = -(-count // block_v)
    return (count - torch.arange(T, device=device) * block_v).clamp_(max=block_v)


def candidate_rounds(count: int, block_v: int, k: int, first_pass: int, exact: bool) -> int:
    """Top-k candidates per (row, tile) for `count` ids filling tiles of `block_v`:
    min(k, fullest tile) is exact; a first pass keeps `first_pass` when that is fewer
    (unless the tiles could then not hold k candidates between them). Host integers only."""
    full_tiles, last = divmod(count, block_v)
    fullest = block_v if full_tiles else last
    capacity = full_tiles * min(block_v, first_pass) + min(last, first_pass)
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


def write_topk(out, prefix: str, rows, top: torch.Tensor, tail, lse64) -> None:
    """out.topk_* (prefix "topk": ids = target ids) or out.draft_topk_* (ids = draft indices,
    lse64 the draft vocabulary's) for `rows`, from merged keys `top` and the tail mass."""
    vals, ids = unpack_keys(top)
    getattr(out, prefix + "_ids")[rows] = ids
    logprobs = getattr(out, prefix + "_logprobs")
    logprobs[rows] = (vals.double() - lse64[:, None]).to(logprobs.dtype)
    getattr(out, prefix + "_tail")[rows] = tail.clamp(0.0, 1.0).float()
