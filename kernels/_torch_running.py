"""Running reductions of the chunked PyTorch head: argmax and top-k, merged tile by tile.

Design: `lm_head_torch.lm_head_torch` walks the vocabulary in [R, C] logits tiles; each tile is
merged into per-row running state with the head's tie rule (lower id first). The running
argmax searches a tile's index only in the rows whose max grew; the running top-k keeps each
row's k best (value, id) pairs and reports which tile entries became candidates and which
values were evicted, so the caller sums the mass outside the top-k directly.
Limits: tiles must arrive in ascending id order for the top-k (the argmax also takes an
explicit id map); memory is O(rows x max(k, C)).
"""

from __future__ import annotations

import math

import torch


def update_argmax(
    tile: torch.Tensor,
    c0: int,
    run_max: torch.Tensor,
    run_arg: torch.Tensor,
    on_cpu: bool,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge one tile into the running argmax (in place on `run_arg`); return the new running
    max, the tile's row max and the tile as the argmax ranked it (for the top-k).

    Column j of the tile is token `c0 + j`, or `ids[j]` when the vocabulary is walked in another
    order (`ids` ascending within the tile). Ties go to the lower token id: `argmax` returns the
    first maximal column, so within a tile the lowest id; across tiles a strictly larger max
    takes over and, when tiles are not in id order, an equal one keeps the lower id.
    On CPU, `torch.max(dim=1)` with indices is several times slower than `amax` (`python
    bench/bench_cpu_ops.py`, "reductions"), so the index is searched only in the rows whose max
    grew (or tied):
    for logits in random order that is ~ln(#chunks) of the ~V/C chunks of a row; for logits
    rising with the id, every tile (no worse than `torch.max`).
    NaN ranks as +inf, the Triton kernel's rule (`_triton_jit.tile_argmax`): on CPU a tile
    whose row max is NaN is ranked, here and by the top-k, through a copy with NaN as +inf
    (the caller's exp sums still see the NaN, so lse turns NaN). On CUDA (no host sync per
    tile) only the maxima are: torch.max's index is then the row's first NaN, which differs
    from the kernel's id only in a row holding +inf before a NaN.
    """
    if not on_cpu:
        c_max, c_arg = torch.max(tile, dim=1)
        c_max = torch.where(c_max.isnan(), math.inf, c_max)
        cand = c_arg + c0 if ids is None else ids[c_arg]
        take = c_max > run_max
        if ids is not None:
            take |= (c_max == run_max) & (cand < run_arg)
        run_arg.copy_(torch.where(take, cand, run_arg))
        return torch.maximum(run_max, c_max), c_max, tile
    c_max = torch.amax(tile, dim=1)
    if bool(c_max.isnan().any()):
        tile = torch.where(tile.isnan(), math.inf, tile)
        c_max = torch.amax(tile, dim=1)
    grew = c_max > run_max
    if ids is not None:
        grew |= c_max == run_max
    rows = grew.nonzero(as_tuple=True)[0]
    if rows.numel():
        if rows.numel() == tile.shape[0]:
            cand = torch.argmax(tile, dim=1)
        else:
            cand = torch.argmax(tile[rows], dim=1)
        cand = cand + c0 if ids is None else ids[cand]
        if ids is not None:  # an equal max keeps the lower id
            cand = torch.where(c_max[rows] > run_max[rows], cand, torch.minimum(cand, run_arg[rows]))
        if rows.numel() == tile.shape[0]:
            run_arg.copy_(cand)
        else:
            run_arg[rows] = cand
    return torch.maximum(run_max, c_max), c_max, tile


def _chunk_topk_select(tile: torch.Tensor, kc: int) -> torch.Tensor | None:
    """Local ids [N, kc] of each row's kc largest entries, exact tie rule, in ascending id order.

    None means "every column" (kc >= chunk width). torch.topk picks an arbitrary member of a
    tie that straddles the kc-th place; asking for kc + 1 values exposes it (kc-th value ==
    (kc+1)-th value), and only those rows are redone with a stable full sort, which orders
    equal values by id.
    """
    _n, c = tile.shape
    if kc >= c:
        return None
    vals, idx = torch.topk(tile, kc + 1, dim=1, largest=True, sorted=True)
    idx = idx[:, :kc]
    ambiguous = vals[:, kc - 1] == vals[:, kc]
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero(as_tuple=True)[0]
        _, order = torch.sort(tile[rows], dim=1, descending=True, stable=True)
        idx = idx.clone()
        idx[rows] = order[:, :kc]
    return torch.sort(idx, dim=1).values


class RunningTopK:
    """Each row's k largest logits so far, ordered by (value desc, id asc), over the chunk loop.

    `update(tile, c0)` merges one chunk. It remembers which tile entries became candidates, so
    the caller can leave them out of the chunk's outside-top-k mass (`zero_candidates` on the
    exp tile), and `evicted` holds the values that fell out of the set, whose mass the caller
    adds back. Two ways to pick a chunk's candidates:
      - threshold (CPU, once the set holds k): only entries strictly above the running k-th
        value can enter (an equal one loses the tie to the lower running id). Past the first
        chunk that is ~k/j entries per row, and gathering them with one compare + nonzero beats
        torch.topk, which is slow on narrow rows.
        Worst case (logits rising with the id, so every entry passes) the nonzero index lists
        are 4x the tile before the fallback below: still O(N x C).
      - topk: the chunk's own top-min(k, C) (`_chunk_topk_select`). Used on CUDA (no host sync
        per chunk beyond the tie check), to fill the set, and when a row has more than k
        entries above the threshold.
    """

    def __init__(self, n: int, k: int, device: torch.device, use_threshold: bool):
        self.k = k
        self.use_threshold = use_threshold
        self.values = torch.empty(n, 0, dtype=torch.float32, device=device)
        self.ids = torch.empty(n, 0, dtype=torch.int64, device=device)
        self.evicted: torch.Tensor | None = None
        self._zero: tuple = ()

    def update(self, tile: torch.Tensor, c0: int, tile_max: torch.Tensor | None = None) -> None:
        """Merge one tile whose column j is token c0 + j; `tile_max` ([n], optional) is each
        row's maximum over the tile, which lets the threshold path skip rows without a
        candidate."""
        self.evicted, self._zero = None, ()
        if (
            self.use_threshold
            and self.values.shape[1] == self.k
            and self._update_above_threshold(tile, c0, tile_max)
        ):
            return
        sel = _chunk_topk_select(tile, min(self.k, tile.shape[1]))
        if sel is None:
            ids = torch.arange(c0, c0 + tile.shape[1], device=tile.device).expand_as(tile)
            self._merge(tile, ids)
            self._zero = ("all",)
        else:
            self._merge(torch.gather(tile, 1, sel), sel + c0)
            self._zero = ("scatter", sel)

    def _update_above_threshold(
        self, tile: torch.Tensor, c0: int, tile_max: torch.Tensor | None
    ) -> bool:
        n = tile.shape[0]
        threshold = self.values[:, -1:]
        if tile_max is None:
            rows, cols = torch.nonzero(tile > threshold, as_tuple=True)
        else:
            # Only rows whose tile max passes the threshold can hold a candidate; past the
            # first chunks that is a fraction of them, and compare + nonzero (the slow part:
            # ~1 ns per element) then scan only those rows.
            live = (tile_max > threshold[:, 0]).nonzero(as_tuple=True)[0]
            if live.numel() == 0:
                return True
            if live.numel() == n:
                rows, cols = torch.nonzero(tile > threshold, as_tuple=True)
            else:
                sub_rows, cols = torch.nonzero(tile[live] > threshold[live], as_tuple=True)
                rows = live[sub_rows]
        if rows.numel() == 0:
            return True
        counts = torch.bincount(rows, minlength=n)
        width = int(counts.max())
        if width > self.k:
            return False
        # nonzero is row-major, so each row's candidates arrive in ascending id order; pad the
        # short rows with -inf, which the merge drops past k.
        pos = (
            torch.arange(rows.numel(), device=tile.device)
            - (torch.cumsum(counts, 0) - counts)[rows]
        )
        cand_v = torch.full((n, width), -math.inf, dtype=torch.float32, device=tile.device)
        cand_i = torch.zeros((n, width), dtype=torch.int64, device=tile.device)
        cand_v[rows, pos] = tile[rows, cols]
        cand_i[rows, pos] = cols + c0
        self._merge(cand_v, cand_i)
        self._zero = ("index", rows, cols)
        return True

    def _merge(self, cand_v: torch.Tensor, cand_i: torch.Tensor) -> None:
        """Stable-sort merge. Running entries are ordered (value desc, id asc), candidates are
        id-ascending and all above every running id (chunks arrive in id order), so a STABLE
        descending sort by value alone orders equal values by id."""
        v = torch.cat([self.values, cand_v], dim=1)
        i = torch.cat([self.ids, cand_i], dim=1)
        v, order = torch.sort(v, dim=1, descending=True, stable=True)
        self.values, self.ids = v[:, : self.k], torch.gather(i, 1, order[:, : self.k])
        self.evicted = v[:, self.k :]

    def zero_candidates(self, exp_tile: torch.Tensor) -> None:
        if not self._zero:
            return
        if self._zero[0] == "all":
            exp_tile.zero_()
        elif self._zero[0] == "scatter":
            exp_tile.scatter_(1, self._zero[1], 0.0)
        else:
            exp_tile[self._zero[1], self._zero[2]] = 0.0
