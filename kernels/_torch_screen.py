"""Screen, then verify: the argmax over the non-draft columns at the bf16 GEMM's speed, exact.

`lm_head_torch` walks the draft ids first for ("draft", "argmax"). When that range ends, its
running max is exact and nothing but the argmax needs the other ~80 % of the vocabulary, so
`screen_rest` answers "which column holds the row's maximum?" there without fp32 logits:
  1. screen: PyTorch's bf16 GEMM (oneDNN; bf16 output, the cheapest GEMM on AVX512-BF16/AMX)
     gives z ~ y @ W.T per tile, and `screen_bound` bounds the exact walk's fp32 logit from
     above (bf16 rounding plus an accumulation-order term from ||y|| ||w_j||, `fp32_gap`). A
     row's tile is looked at only when the bound of its max reaches the row's certified lower
     bound `low` (one integer max per tile), a column only when its own bound does;
  2. verify: those (row, column) pairs are recomputed in float64 (`verify_pairs`), which puts
     the exact walk's value within a stated distance of them and raises `low`;
  3. resolve: a row whose single remaining contender is clear of the draft max takes it; a row
     with a near tie recomputes the contenders' very tiles of the exact walk (same call, same
     shapes: the same bits) and takes the lowest id among the largest values, NaN ranking as
     +inf, as `_torch_running.update_argmax` does.
So the argmax is byte-identical to the exact walk's (tests/test_screen.py). Why this route:
draft+argmax needs exact fp32 logits on the draft columns only, and PyTorch's fastest CPU GEMM
rounds to bf16; its fp32-output mode is a process-wide flag a library must not set.

Limits: bf16 weights on CPU with MKL's bf16 GEMM in hardware where the compiled AMX walk
(`_native`) does not serve the call, logit_scale 1, no softcap,
N >= MIN_ROWS rows, H <= 8192 (the norm bound's margin), finite y and draft max; otherwise
`screen_rest` returns False and the exact walk goes on. Many near-equal maxima (copied weight
rows) cost an exact tile each. `counting()` totals the work of the calls made inside it
(tiles, rows looked at, pairs recomputed, exact tiles), in the caller's thread and in the
threads that run in a copy of its context (`supervision.supervise`'s head pool does).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import threading
from collections import Counter

import torch

from ._common import TensorMemo, phase, scoped
from ._cpu import bf16_gemm_is_native, gemm_bf16_f32

# Read once, at import: EAGLE_FAST_CPU_SCREEN=0 turns the screen off for the process.
# `switched(on)` overrides it for the calls inside a block (tests, the floor benchmark).
ENABLED = os.environ.get("EAGLE_FAST_CPU_SCREEN", "1") != "0"
_ENABLED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("screen_enabled", default=None)
_COUNTS: contextvars.ContextVar[Counter | None] = contextvars.ContextVar("screen_counts", default=None)


def switched(on: bool) -> contextlib.AbstractContextManager:
    """The screen on or off for the calls made inside the block (`_common.scoped`)."""
    return scoped(_ENABLED, on)


def counting() -> contextlib.AbstractContextManager[Counter]:
    """A Counter of the screen's work in the calls made inside the block (as `switched`)."""
    return scoped(_COUNTS, Counter())


_COUNT_LOCK = threading.Lock()  # the counter is shared by the context copies of a head pool


def _count(what: str, n: int = 1) -> None:
    counts = _COUNTS.get()
    if counts is not None:
        with _COUNT_LOCK:
            counts[what] += n

MAX_HIDDEN = 8192
# Below this many rows the screen's per-chunk costs (column norms, small calls) outweigh the
# GEMM time it saves (`python bench/bench_floors.py` has the shapes where it pays).
MIN_ROWS = 128
SCREEN_WCHUNK_BYTES = 4 << 20  # the screen's gathered bf16 weight chunk, at most
_U = 2.0**-24  # fp32 unit roundoff
_BF16_REL = 2.0**-7 * 1.02  # faithful rounding to bf16, 2 % over for evaluating the bound in fp32
_NORM_REL = 2.0**-9  # over-estimate of an fp32 norm: its relative error is below (H + 2) u <= 2^-11
_NORM_ABS = 2.0**-50  # squares below 2^-126 that fp32 loses: at most H * 2^-126 under the root
_TINY = 2.0**-118  # flushed subnormals (FTZ/DAZ), 4x over 2^-126 per operation


def screen_enabled(y: torch.Tensor, logit_scale: float, softcap) -> bool:
    """Whether `screen_rest` may serve this call (EAGLE_FAST_CPU_SCREEN=0, `switched(False)`: no)."""
    on = _ENABLED.get()
    return ((ENABLED if on is None else on)
            and y.device.type == "cpu" and y.dtype == torch.bfloat16 and logit_scale == 1.0
            and softcap is None and y.shape[0] >= MIN_ROWS and y.shape[1] <= MAX_HIDDEN
            and bf16_gemm_is_native())


def norm_upper(x: torch.Tensor) -> torch.Tensor:
    """fp32 [n]: an upper bound on each row's Euclidean norm (x 2-D, bf16; rows <= MAX_HIDDEN)."""
    norm = torch.linalg.vector_norm(x, dim=1, dtype=torch.float32)
    return norm.mul_(1 + _NORM_REL).add_(_NORM_ABS)


# Row-norm bounds of the weights walked lately, one fp32 [V] each (0.6 MB at V=152k). A head
# call walks all V rows: at the row counts supervision groups use (hundreds of tokens),
# recomputing them per call cost about as much as the screen's GEMM.
_WEIGHT_NORMS = TensorMemo(4)


def weight_norms(weight: torch.Tensor) -> torch.Tensor:
    """`norm_upper(weight)`, computed once per weight (and again after it changes). Any fp32
    evaluation of a row's norm is within 2^-11 of it, so the bound holds whichever rows or
    shapes it was computed over."""
    return _WEIGHT_NORMS.get((weight,), lambda: norm_upper(weight))


def fp32_gap(y_norm: torch.Tensor, w_norm: torch.Tensor, hidden: int) -> torch.Tensor:
    """Bound on |a - b| for two fp32 evaluations a, b of the same bf16 dot product y . w.

    Proof. The K = hidden products y_k w_k of bf16 values are exact in fp32 (8 + 8 significant
    bits), so a and b are fp32 sums of the same K terms, in orders (blocking, FMA, pairwise
    dot instructions) we do not know. Any summation order of K terms has error at most
    gamma_K * sum |y_k w_k| with gamma_K = K u / (1 - K u) (Higham, Accuracy and Stability,
    4.2), and sum |y_k w_k| <= ||y|| ||w|| (Cauchy-Schwarz). Flushed subnormals (FTZ/DAZ) add
    at most 2^-126 per operation (2K) and 2^-126 |other operand| per flushed input, in all
    below eta = 2^-118 (K + sqrt(K) (||y|| + ||w||)). So |a - d| and |b - d| are each at most
    gamma_K ||y|| ||w|| + eta around the exact d, and |a - b| <= 2 (gamma_K ||y|| ||w|| + eta).
    The result is 0.1 % over that, to absorb the fp32 rounding of evaluating it and of the
    sums it enters (a few u of each term). y_norm and w_norm (upper bounds, `norm_upper`)
    broadcast against each other.
    """
    gamma = hidden * _U / (1 - hidden * _U)
    eta = _TINY * (hidden + math.sqrt(hidden) * (y_norm + w_norm))
    return 2.002 * (gamma * y_norm * w_norm + eta)


def screen_bound(z: torch.Tensor, gap: torch.Tensor) -> torch.Tensor:
    """Upper bound (fp32) on today's exact fp32 logit s, from the bf16 screen value z.

    z = bf16(t), t being the screen GEMM's own fp32 sum: |z - t| < 2^-7 |t| for any faithful
    rounding (below bf16's normal range, |z - t| <= 2^-133, inside gap's eta), so t <= z + 2^-7 |z| / (1 - 2^-7); and |s - t| <= gap (`fp32_gap`: both are fp32
    sums of the same products). Hence s <= z + c |z| + gap with c = 2^-7 * 1.02 (the 2 % covers
    1 / (1 - 2^-7) and the rounding of this fp32 expression). The bound rises with z, so a
    row's max z bounds the whole row. NaN or inf anywhere gives NaN or inf, which the caller
    treats as "may be the max".
    """
    return z + _BF16_REL * z.abs() + gap


def screen_rest(weight, y, order, start: int, chunk: int, row_block: int, run_max, run_arg) -> bool:
    """Finish the walk over order[start:] (the non-draft ids, ascending) for the argmax alone.

    weight bf16 [V, H]; y bf16 [N, H] contiguous; order int64 [V], the walk's column order;
    chunk / row_block: the exact walk's C and R. run_max fp32 [N] / run_arg int64 [N]: the
    running max and argmax over order[:start], exact; run_arg is updated in place (run_max is
    left as it was: nothing reads it after the walk). Returns False, having changed nothing,
    where the screen cannot promise the exact walk's answer (non-finite y or running max).
    """
    N, H = y.shape
    V = order.numel()
    with phase("norm"):
        y_norm = norm_upper(y)
    if not (bool(torch.isfinite(y_norm).all()) and bool(torch.isfinite(run_max).all())):
        return False
    low = run_max.clone()  # certified lower bound on each row's exact maximum
    found = []  # per tile: (rows, order positions, float64 values d, their distance e)
    rows_per_tile = min(2 * row_block, N)  # bf16: the exact walk's tile bytes, half the calls
    # The screen's own chunk: as wide as keeps its bf16 tile within the exact walk's tile bytes
    # (row_block x chunk fp32) and its gathered weight chunk within SCREEN_WCHUNK_BYTES, so few
    # rows (supervision's groups) make few, wide tiles rather than many small calls. Exact
    # tiles (`_resolve`) keep the walk's own chunk.
    widest = min(2 * row_block * chunk // rows_per_tile, SCREEN_WCHUNK_BYTES // (2 * H))
    step = max(chunk, widest // 256 * 256)
    z_buf = torch.empty(rows_per_tile * step, dtype=torch.bfloat16)
    w_buf = torch.empty(step * H, dtype=torch.bfloat16)
    y_norm_max = float(y_norm.max())
    norms = weight_norms(weight)
    for p0 in range(start, V, step):
        p1 = min(p0 + step, V)
        c = p1 - p0
        with phase("upcast"):
            w_chunk = w_buf[: c * H].view(c, H)
            torch.index_select(weight, 0, order[p0:p1], out=w_chunk)
            w_norm = norms.index_select(0, order[p0:p1])
            w_max = float(w_norm.max())
        # Below 2^120 no partial sum can reach fp32's overflow (|partial| <= ||y|| ||w||), so
        # z holds no NaN and the tile's max can be read off its bits (`_row_max_upper`).
        finite = y_norm_max * w_max < 2.0**120
        for r0 in range(0, N, rows_per_tile):
            r1 = min(r0 + rows_per_tile, N)
            z = z_buf[: (r1 - r0) * c].view(r1 - r0, c)
            with phase("gemm"):
                torch.mm(y[r0:r1], w_chunk.t(), out=z)
            with phase("merge"):
                _count("tiles")
                if finite:
                    row_ub = screen_bound(_row_max_upper(z), fp32_gap(y_norm[r0:r1], w_max, H))
                    live = (~(row_ub < low[r0:r1])).nonzero(as_tuple=True)[0]
                else:
                    live = torch.arange(r1 - r0)
                if live.numel() == 0:
                    continue
                rows = live + r0
                gap = fp32_gap(y_norm.index_select(0, rows)[:, None], w_norm[None, :], H)
                ub = screen_bound(z.index_select(0, live).float(), gap)
                li, cols = (~(ub < low.index_select(0, rows)[:, None])).nonzero(as_tuple=True)
                _count("rows_looked_at", live.numel())
                if cols.numel() == 0:
                    continue
                rows = rows[li]
                value, gap = verify_pairs(y, w_chunk, rows, cols, y_norm, w_norm)
                lo = value - gap
                lo = (lo - lo.abs() * 2.0**-22).float()  # rounded down to fp32
                low.scatter_reduce_(0, rows, torch.where(torch.isfinite(lo), lo, -math.inf), "amax")
                found.append((rows, cols + p0, value, gap))
                _count("pairs_recomputed", rows.numel())
    with phase("merge"):
        _resolve(weight, y, order, start, chunk, row_block, run_max, run_arg, low, found)
    return True


def _row_max_upper(z: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: an upper bound on each row's max of a NaN-free bf16 tile, from one integer
    max over its bits (several times faster than a float amax): non-negative bf16 values order
    as their int16 bits do and every negative one sorts below them, so a row with a
    non-negative entry gets its exact max; an all-negative row gets 0."""
    top = torch.amax(z.view(torch.int16), dim=1)
    return top.clamp_min_(0).view(torch.bfloat16).float()


def verify_pairs(y, w_chunk, rows, cols, y_norm, w_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d, e)` float64 [P]: the exact walk's fp32 logit s of each pair (y[rows[n]],
    w_chunk[cols[n]]) lies in [d - e, d + e].

    d is the float64 dot product: the bf16 products are exact in float64 and its sum is off
    the real one by at most gamma64_K A, A = sum_k |y_k w_k| (computed alongside, in float64).
    s, an fp32 sum of the same products in any order, is off by at most gamma_K A + eta
    (`fp32_gap`'s proof, with A in place of ||y|| ||w||). So |s - d| <= (gamma_K + gamma64_K) A
    + eta, and e is 0.1 % over that (float64 rounding of the terms).
    """
    H = y.shape[1]
    gamma = H * _U / (1 - H * _U) + H * 2.0**-53 / (1 - H * 2.0**-53)
    d = torch.empty(rows.numel(), dtype=torch.float64)
    a = torch.empty_like(d)
    step = max(1, (1 << 21) // H)  # float64 [step, H]: 16 MiB
    for i in range(0, rows.numel(), step):
        prod = y.index_select(0, rows[i : i + step]).double()
        prod.mul_(w_chunk.index_select(0, cols[i : i + step]))
        torch.sum(prod, dim=1, out=d[i : i + step])
        torch.sum(prod.abs_(), dim=1, out=a[i : i + step])
    eta = _TINY * (H + math.sqrt(H) * (y_norm[rows] + w_norm[cols]).double())
    return d, 1.001 * (gamma * a + eta)


def _resolve(weight, y, order, start, chunk, row_block, run_max, run_arg, low, found) -> None:
    """Set run_arg from the draft's exact (max, argmax) and the recomputed pairs (see header)."""
    if not found:
        return
    rows, pos, value, gap = (torch.cat(t) for t in zip(*found))
    keep = ~((value + gap) < low[rows])  # may still be a row's maximum (NaN-safe)
    rows, pos, value, gap = rows[keep], pos[keep], value[keep], gap[keep]
    if rows.numel() == 0:
        return
    N = run_max.numel()
    per_row = torch.bincount(rows, minlength=N)
    # A row with one contender that is clear of the draft max takes it; any other row with a
    # contender (two of them, one within reach of the draft max, or anything non-finite) is
    # settled on the exact walk's own values.
    lo = value - gap
    clear = (per_row[rows] == 1) & (lo > run_max[rows]) & torch.isfinite(lo)
    run_arg[rows[clear]] = order[pos[clear]]
    unsure = ~clear
    if not bool(unsure.any()):
        return
    rows, pos = rows[unsure], pos[unsure]
    exact = _exact_values(weight, y, order, start, chunk, row_block, rows, pos)
    ids = order[pos]
    urows = torch.unique(rows)
    all_rows = torch.cat([urows, rows])
    all_vals = torch.cat([run_max[urows], exact])
    all_vals = torch.where(all_vals.isnan(), math.inf, all_vals)
    all_ids = torch.cat([run_arg[urows], ids])
    best = torch.full((N,), -math.inf).scatter_reduce_(0, all_rows, all_vals, "amax")
    top = all_vals == best[all_rows]
    first = torch.full((N,), torch.iinfo(torch.int64).max).scatter_reduce_(
        0, all_rows[top], all_ids[top], "amin")
    run_arg[urows] = first[urows]
    _count("exact_pairs", rows.numel())


def _exact_values(weight, y, order, start, chunk, row_block, rows, pos) -> torch.Tensor:
    """The exact walk's fp32 logits at (rows[n], order[pos[n]]): each from the very tile the
    walk computes there (row block of R rows, chunk of C positions after `start`), by the same
    call on the same shapes, so bit for bit the walk's value."""
    N = y.shape[0]
    V = order.numel()
    out = torch.empty(rows.numel(), dtype=torch.float32)
    block = rows // row_block
    tile_chunk = (pos - start) // chunk
    keys = block * (V // chunk + 1) + tile_chunk
    for key in torch.unique(keys).tolist():
        sel = (keys == key).nonzero(as_tuple=True)[0]
        b, q = int(block[sel[0]]), int(tile_chunk[sel[0]])
        r0, p0 = b * row_block, start + q * chunk
        r1, p1 = min(r0 + row_block, N), min(p0 + chunk, V)
        w_chunk = weight.index_select(0, order[p0:p1])
        tile = torch.empty(r1 - r0, p1 - p0, dtype=torch.float32)
        gemm_bf16_f32(y[r0:r1], w_chunk, tile)
        out[sel] = tile[rows[sel] - r0, pos[sel] - p0]
        _count("exact_tiles")
    return out
