"""The head op in Triton: RMSNorm prologue + LM-head GEMM fused with its vocabulary reductions.

`lm_head_triton(req)` turns final pre-norm hidden states [N, H] into EAGLE-3 supervision (lse,
argmax, top-k, draft-vocab log-probs, the sparse draft top-k, optionally logits / logprobs) with
the semantics `reference.py` defines, without materialising fp32 [N, V] logits unless asked for.

Design
  1. The norm prologue (`_triton_norm`) writes y = norm(x) in the weight dtype, rounded as
     `reference.final_norm` rounds it, so both GEMM operands stream unchanged into shared memory.
  2. `lm_head_fwd_kernel`: one program per [BLOCK_N rows x BLOCK_V vocab] tile in grouped
     order (GROUP_SIZE row blocks sweep the vocabulary together, so a weight tile is read
     from HBM once per group), fp32 accumulation, then an epilogue on the fp32 tile: scale,
     softcap, per-(row, tile) max / argmax (lowest id, NaN ranked as +inf:
     `_triton_jit.tile_argmax`), the sum exp only when lse / logprobs / top-k need it
     (HAS_LSE), the tile's best `n_rounds` top-k candidates as int64 keys (HAS_TOPK), and
     the logits / fp32 logprobs stores. With a draft vocabulary the vocabulary is walked
     draft ids first (`_triton_merge.draft_first_order`; weight rows are gathered, free with
     pointer loads): the first cdiv(Vd, BLOCK_V) tiles are the draft tiles, whose draft
     column index is their position, so raw draft logits store dense and coalesced, and the
     draft max / sum exp / draft top-k candidates (DRAFT_TOPK) run on those tiles alone
     (`_triton_jit.draft_tile`); every other tile runs the argmax-only epilogue.
  3. Torch merges the per-tile partials (`_triton_merge`): argmax as the lowest id among the
     tiles holding the max, so ties still go to the lowest target id; draft log-probs in one
     pass from the raw fp32 logits into the output dtype. A tile whose `n_rounds` candidates
     all made the top-k may hide more; one re-run launch recomputes just those (row, tile)
     pairs with all the candidates they can hold (`_Head._redo_topk`): the top-k is exact.
  Rows run in chunks that keep the scratch under `_SCRATCH_BYTES`. Every size is known on the
  host (the re-run's too), so the CUDA call path never waits on the device.
  CPU tensors run the same kernels in triton's interpreter (`_triton_interpret`); INTERPRET upcasts
  dot operands (it multiplies bf16 bit patterns), rounds to nearest-even before 16-bit stores.
Limits: V < 2^31 (ids live in 31 bits of a key); fp32 weights use full-precision fp32 FMA
("ieee", no tf32: the reference is full fp32), correct but far slower than bf16 on a GPU.
Block sizes, EAGLE_FAST_AUTOTUNE=1, the switch to the persistent TMA-fed kernel of the lse / argmax
/ draft modes (`_triton_persistent`): `_triton_config`; the sm_90 compile checks: `_triton_aot`.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from ._common import HeadOutput, HeadRequest
from ._triton_config import (
    KERNEL,
    TL_NAME,
    Config,
    Variant,
    aligned_row,
    autotune_config,
    default_config,
    fwd_constexprs,
    next_pow2,
)
from ._triton_interpret import run_kernel
from ._triton_jit import (
    draft_tile,
    exp_shifted,
    round_rne,
    store_candidates,
    tanh,
    tile_stats,
)
from ._triton_merge import (
    Scratch,
    candidate_rounds,
    draft_first_order,
    merge_argmax,
    merge_lse,
    merge_topk,
    remerge_topk,
    saturated_tiles,
    tile_lengths,
    write_topk,
)
from ._triton_norm import normalize_triton
from ._triton_persistent import run_persistent, supports

# Scratch budget per launch, besides the outputs and y [N, H]: per-tile stats and top-k
# candidates (`Scratch.bytes_per_row`) and, with a 16-bit out_dtype, fp32 staging of logprobs
# (rows x V) and draft logprobs (rows x Vd), rounded once from fp32 like the reference. Rows
# go in chunks that fit (one BLOCK_N row block at least): small next to an 8B model, and
# still thousands of tiles per launch (N=8192, V=151,936: top-64 in 5 chunks of 1664 rows).
_SCRATCH_BYTES = 256 << 20
# Top-k candidates kept per (row, tile) in the first pass when k > this: a row is recomputed
# only if 9 of its top-k share one 128-256 wide tile; 8 rounds cost ~10% of a tile's GEMM.
_TOPK_ROUNDS = 8


# ------------------------------------- kernels (public: _triton_aot compiles them ahead of time)


@triton.jit
def lm_head_fwd_kernel(
    # pointers
    Y_ptr,  # [N, H] normalised activations, weight dtype
    W_ptr,  # [V, H] LM-head weight (row stride stride_wv, unit column stride)
    Logits_ptr,  # [N, V] out_dtype                         (HAS_LOGITS)
    Stage_ptr,  # [N, V] fp32 raw logits for logprobs       (HAS_LOGPROBS)
    PartM_ptr,  # [N, T] fp32 per-tile max
    PartS_ptr,  # [N, T] fp32 per-tile sum exp(l - max) (top-k: over non-candidates)
    PartArg_ptr,  # [N, T] int32 per-tile argmax (target id)
    Cand_ptr,  # [N, T or TD, n_rounds] int64 top-k candidate keys (HAS_TOPK | DRAFT_TOPK)
    Order_ptr,  # [V] int32 target id at each vocabulary position, draft ids first (HAS_ORDER)
    Draft_ptr,  # [N, Vd] fp32 raw draft logits             (HAS_DRAFT)
    PartDM_ptr,  # [N, TD] fp32 per-draft-tile max over draft columns (HAS_DRAFT | DRAFT_TOPK)
    PartDS_ptr,  # [N, TD] fp32 per-draft-tile draft sum exp (DRAFT_TOPK: over non-candidates)
    Slot_ptr,  # [N, T] int32 re-run slot of each (row, tile), -1 for none (IS_RERUN)
    # sizes: rows, vocabulary, hidden; Vd draft ids = the walk's first positions (draft tiles:
    # the first cdiv(Vd, BLOCK_V)); T vocab tiles this launch covers (cdiv(V, BLOCK_V) or the
    # list's length); top-k candidates per (row, tile)
    N,
    V,
    H,
    Vd,
    n_vtiles,
    n_rounds,
    # strides (rows; every inner stride is 1): y, weight, logits, stage, partials, candidates,
    # draft logits, draft partials
    stride_ym,
    stride_wv,
    stride_lm,
    stride_sm,
    stride_pm,
    stride_cm,
    stride_dm,
    stride_dpm,
    # scalars
    logit_scale,
    softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    EVEN_H: tl.constexpr,  # H % BLOCK_H == 0: no K-edge masks
    HAS_LOGITS: tl.constexpr,
    HAS_LOGPROBS: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_DRAFT: tl.constexpr,
    DRAFT_TOPK: tl.constexpr,  # top-k candidates among the draft columns, ids = draft indices
    HAS_ORDER: tl.constexpr,  # walk the vocabulary through Order (draft tiles first)
    HAS_SOFTCAP: tl.constexpr,
    HAS_LSE: tl.constexpr,  # sum exp over the whole tile (lse); else maxima only
    IS_RERUN: tl.constexpr,  # exact top-k of the (row, tile) pairs given a slot; outputs by slot
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 weights (and the interpreter)
    INTERPRET: tl.constexpr,  # fp32 dot operands + RNE before 16-bit stores
):
    # ---- grouped program ordering: GROUP_SIZE row blocks walk the vocab tiles together
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_SIZE * n_vtiles
    group_id = pid // num_pid_in_group
    first_pid_n = group_id * GROUP_SIZE
    group_rows = tl.minimum(num_pid_n - first_pid_n, GROUP_SIZE)
    pid_n = first_pid_n + ((pid % num_pid_in_group) % group_rows)
    tile = (pid % num_pid_in_group) // group_rows
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    if IS_RERUN:  # a row's outputs go to its slot; a tile no row of the block needs exits
        slot = tl.load(Slot_ptr + rows.to(tl.int64) * n_vtiles + tile, mask=row_mask, other=-1)
        if tl.max(slot, axis=0) < 0:
            return
        row_mask = row_mask & (slot >= 0)
        pcol = slot  # column of the partial buffers, per row
    else:
        pcol = tile
    pos = tile * BLOCK_V + tl.arange(0, BLOCK_V)  # positions of the vocabulary walk
    col_mask = pos < V
    # columns past V repeat the last one, (value, id) pairs already in the tile: the max and
    # the argmax need no mask there, sums and top-k do (below); rows past N wrap, masked out
    ids = tl.minimum(pos, V - 1)
    if HAS_ORDER:  # a row gather: free with pointer loads
        ids = tl.load(Order_ptr + ids)
    ids_ld = ids.to(tl.int64)
    rows_ld = (rows % N).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    y_ptrs = Y_ptr + rows_ld[:, None] * stride_ym + offs_h[None, :]
    w_ptrs = W_ptr + ids_ld[:, None] * stride_wv + offs_h[None, :]

    # ---- GEMM: acc[n, v] = sum_h y[n, h] * w[ids[v], h], fp32 accumulation
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        if EVEN_H:
            y = tl.load(y_ptrs)
            w = tl.load(w_ptrs)
        else:
            h_mask = (offs_h + h0) < H
            y = tl.load(y_ptrs, mask=h_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=h_mask[None, :], other=0.0)
        if INTERPRET:
            y, w = y.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(y, tl.trans(w), acc, input_precision=DOT_PRECISION)
        y_ptrs += BLOCK_H
        w_ptrs += BLOCK_H

    # ---- epilogue: logits of this tile in fp32
    logits = acc  # a branch with one outcome per tile costs no per-logit select
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if HAS_SOFTCAP:
        logits = softcap * tanh(logits / softcap)
    rows64 = rows.to(tl.int64)
    out_mask = row_mask[:, None] & col_mask[None, :]
    cols = ids if HAS_ORDER else pos  # pos: contiguous, vector stores (ids is clamped)
    if HAS_LOGITS:
        out = logits
        if INTERPRET:
            out = round_rne(out, Logits_ptr.dtype.element_ty)
        l_ptrs = Logits_ptr + rows64[:, None] * stride_lm + cols[None, :]
        tl.store(l_ptrs, out.to(Logits_ptr.dtype.element_ty), mask=out_mask)
    if HAS_LOGPROBS:
        tl.store(Stage_ptr + rows64[:, None] * stride_sm + cols[None, :], logits, mask=out_mask)

    # ---- per (row, tile) max, argmax (lowest id among maxima, NaN as +inf), sum exp for lse:
    # all a tile past the draft ones does for "draft" / "argmax". For a sum, the ragged last
    # tile masks columns past V in a branch with stores (no select elsewhere); the top-k
    # masks every tile. Constexprs short-circuit the conditions.
    p_off = rows64 * stride_pm + pcol
    stats = (p_off, row_mask, PartM_ptr, PartArg_ptr, PartS_ptr, HAS_LSE and not HAS_TOPK)
    if HAS_TOPK or (HAS_LSE and tile * BLOCK_V + BLOCK_V > V):
        logits, m, arg = tile_stats(tl.where(col_mask[None, :], logits, float("-inf")), ids, *stats)
    else:
        logits, m, arg = tile_stats(logits, ids, *stats)

    # ---- draft tiles only: dense raw draft logits, draft max, sum exp, draft top-k
    c_ptrs = Cand_ptr + rows64 * stride_cm + pcol * n_rounds
    if (HAS_DRAFT or DRAFT_TOPK) and tile * BLOCK_V < Vd:  # constexpr False short-circuits
        draft_tile(
            logits, pos, rows64, row_mask, rows64 * stride_dpm + pcol, c_ptrs, n_rounds, Vd,
            Draft_ptr, PartDM_ptr, PartDS_ptr, stride_dm, HAS_DRAFT, DRAFT_TOPK,
        )  # fmt: skip

    # ---- top-k candidates: the tile's best n_rounds (value, id) by max extraction; the
    # sum exp then covers only the rest of the tile, so the merge sums the mass outside
    # the top-k directly (no 1 - sum(top-k) cancellation)
    if HAS_TOPK:
        logits = store_candidates(logits, ids, m, arg, c_ptrs, n_rounds, row_mask)
        s = tl.sum(exp_shifted(logits, tl.where(m == float("-inf"), 0.0, m)), axis=1)
        tl.store(PartS_ptr + p_off, s, mask=row_mask)


# ----------------------------------------------------------------------------- launcher


def lm_head_triton(req: HeadRequest, kernel: str = KERNEL) -> HeadOutput:
    """Fused Triton head. `req` is validated and 2-D (see `_common.HeadRequest`); `kernel`:
    "tiled", or "persistent" for the modes `_triton_persistent.supports` (others run tiled).

    Returns argmax int64 [N], lse fp32 [N] when `req.needs_lse`, and whatever `req.outputs`
    asks for, with the reference's semantics (the module header has the algorithm,
    `_SCRATCH_BYTES` the scratch bound). CUDA tensors run compiled kernels; CPU tensors run
    the same kernels in triton's interpreter.
    """
    hidden, weight, device, out_dtype = req.hidden, req.weight, req.hidden.device, req.out_dtype
    (N, H), V = hidden.shape, weight.shape[0]

    # ---- 1. check constraints
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"lm_head_triton: unsupported device {device}")
    interpret = device.type != "cuda"
    for name, dt in (("hidden", hidden.dtype), ("weight", weight.dtype), ("out_dtype", out_dtype)):
        if dt not in TL_NAME:
            raise ValueError(f"lm_head_triton: unsupported {name} dtype {dt}")
    if weight.stride(1) != 1 or not hidden.is_contiguous():
        raise ValueError(
            f"lm_head_triton: needs contiguous hidden {tuple(hidden.shape)} and unit-stride "
            f"weight rows {tuple(weight.shape)} (strides {weight.stride()})"
        )
    if V >= 2**31 - 1:
        raise ValueError(f"lm_head_triton: vocabulary V={V} does not fit 31-bit ids")
    if req.norm_weight is not None and req.norm_weight.dtype not in TL_NAME:
        raise ValueError(f"lm_head_triton: unsupported norm_weight dtype {req.norm_weight.dtype}")

    # ---- 2. allocate outputs
    f32 = {"dtype": torch.float32, "device": device}
    out = HeadOutput(
        lse=torch.empty(N, **f32) if req.needs_lse else None,
        argmax=torch.empty(N, dtype=torch.int64, device=device),
    )
    if req.wants("logits"):
        out.logits = torch.empty((N, V), dtype=out_dtype, device=device)
    if req.wants("logprobs"):
        out.logprobs = torch.empty((N, V), dtype=out_dtype, device=device)
    for top in ("topk", "draft_topk"):  # never both
        if req.wants(top):
            setattr(out, top + "_ids", torch.empty((N, req.k), dtype=torch.int64, device=device))
            setattr(out, top + "_logprobs", torch.empty((N, req.k), dtype=out_dtype, device=device))
            setattr(out, top + "_tail", torch.empty(N, **f32))
    if req.wants("draft"):
        out.draft_logprobs = torch.empty((N, req.draft_ids.numel()), dtype=out_dtype, device=device)
    if req.wants("draft") or req.wants("draft_topk"):
        out.argmax_in_draft = torch.empty(N, dtype=torch.bool, device=device)
    if N == 0:
        return out

    # ---- 3. launch: norm prologue, then row chunks of the fused GEMM + small merges
    head = _Head(req, out, interpret, kernel)
    if interpret:
        head.run()
        return out
    with torch.cuda.device(device):  # triton launches on the current device
        if os.environ.get("EAGLE_FAST_AUTOTUNE") == "1" and not head.persistent:
            key = (V, H, min(next_pow2(N), 8192), head.variant)
            head.cfg = autotune_config(head.variant, head.cfg, key, head.trial)
        head.run()
    return out


class _Head:
    """One `lm_head_triton` call: variant and config, row chunks, launches and merges."""

    def __init__(self, req: HeadRequest, out: HeadOutput, interpret: bool, kernel: str = "tiled"):
        self.req, self.out, self.interpret = req, out, interpret
        self.N, self.H = req.hidden.shape
        self.V = req.weight.shape[0]
        self.device = req.hidden.device
        draft_topk = req.wants("draft_topk")
        self.k = req.k if req.wants("topk") or draft_topk else 0
        self.out_f32 = req.out_dtype == torch.float32
        self.variant = Variant(
            weight=TL_NAME[req.weight.dtype],
            # the logits pointer is an fp32 dummy when no logits are stored
            out=TL_NAME[req.out_dtype] if out.logits is not None else "fp32",
            logits=out.logits is not None,
            # fp32 logits requested too: logprobs come from them; otherwise fp32 staging
            logprobs=out.logprobs is not None and not (out.logits is not None and self.out_f32),
            topk=req.wants("topk"),
            draft=out.draft_logprobs is not None,
            draft_topk=draft_topk,
            softcap=req.softcap is not None,
            lse=req.needs_lse,
        )
        self.cfg = default_config(self.variant, self.N, self.V, self.H, interpret)
        # the draft vocabulary is walked first: draft index = position (`draft_first_order`)
        self.Vd = req.draft_ids.numel() if (self.variant.draft or draft_topk) else 0
        self.n_cand = self.Vd if draft_topk else self.V  # ids that can be top-k candidates
        self.order = self.in_draft = None
        if self.Vd:
            self.order, self.in_draft = draft_first_order(req.draft_ids, self.V)
        self.y, self.persistent = None, kernel == "persistent" and supports(self.variant, req.weight)

    def _tiles(self, cfg: Config) -> tuple[int, int, int]:
        """(T vocab tiles, TD draft tiles, C tiles with top-k candidates: T, or TD for draft_topk)."""
        T, TD = triton.cdiv(self.V, cfg.BLOCK_V), triton.cdiv(self.Vd, cfg.BLOCK_V)
        return T, TD, TD if self.variant.draft_topk else T

    def _rounds(self, cfg: Config, exact: bool) -> int:
        """Top-k candidates per (row, tile): all a tile can hold of the top-k when `exact`,
        else _TOPK_ROUNDS when that is fewer (`candidate_rounds`)."""
        return candidate_rounds(self.n_cand, cfg.BLOCK_V, self.k, _TOPK_ROUNDS, exact) if self.k else 0

    def _scratch(self, rows: int, cfg: Config, n_rounds: int) -> Scratch:
        T, TD, C = self._tiles(cfg)
        return Scratch.alloc(rows, T, C, n_rounds, TD, self.device)

    def _chunk_rows(self, cfg: Config, per_row: int) -> int:
        bn = cfg.BLOCK_N
        return min(self.N, max(bn, _SCRATCH_BYTES // max(1, per_row) // bn * bn))

    def _topk_stats(self, scr: Scratch):
        """(max, sum exp outside the candidates) per tile: the draft tiles' for draft_topk."""
        return (scr.part_dm, scr.part_ds) if self.variant.draft_topk else (scr.part_m, scr.part_s)

    # -- one launch of the fused kernel over the rows of y_rows
    def _launch(
        self, y_rows, cfg, variant, n_rounds, scr, logits=None, stage=None, draft=None, slots=None
    ):
        R = y_rows.shape[0]
        T = self._tiles(cfg)[0] if slots is None else slots.shape[1]  # the re-run: C tiles
        C, TD = scr.cand.shape[1] if n_rounds else 0, scr.part_dm.shape[-1]
        w = self.req.weight
        variant = replace(variant, even_h=self.H % cfg.BLOCK_H == 0)
        softcap = self.req.softcap
        run_kernel(
            lm_head_fwd_kernel, (triton.cdiv(R, cfg.BLOCK_N) * T,), self.interpret,
            y_rows, w,
            logits if logits is not None else scr.part_m,
            stage if stage is not None else scr.part_m,
            scr.part_m, scr.part_s, scr.part_arg, scr.cand,
            self.order if self.order is not None else scr.part_arg,
            draft if draft is not None else scr.part_m,
            scr.part_dm, scr.part_ds,
            slots if slots is not None else scr.part_arg,
            R, self.V, self.H, self.Vd, T, n_rounds,
            y_rows.stride(0), w.stride(0),
            logits.stride(0) if logits is not None else 0,
            stage.stride(0) if stage is not None else 0,
            scr.part_m.shape[1], C * n_rounds, draft.stride(0) if draft is not None else 0, TD,
            float(self.req.logit_scale), float(softcap) if softcap is not None else 1.0,
            **fwd_constexprs(variant, cfg, self.interpret),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def trial(self, cfg: Config):
        """Autotune probe: the first-pass kernel on up to 4096 rows, outputs discarded."""
        if self.y is None:
            self.y = normalize_triton(self.req, self.interpret)
        rows, v, dev = min(self.N, 4096), self.variant, self.device
        n_rounds = self._rounds(cfg, exact=False)
        scr = self._scratch(rows, cfg, n_rounds)
        logits = (
            torch.empty((rows, self.V), dtype=self.req.out_dtype, device=dev) if v.logits else None
        )
        stage = torch.empty((rows, self.V), dtype=torch.float32, device=dev) if v.logprobs else None
        draft = self._draft_staging(rows) if v.draft else None
        self._launch(self.y[:rows], cfg, v, n_rounds, scr, logits, stage, draft)

    def _draft_staging(self, rows: int) -> torch.Tensor:
        """fp32 [rows, Vd] for the raw draft logits, rows 64-byte aligned (an unaligned row
        stride costs the kernel its vector stores: 2 KB spilled at Vd=10,001)."""
        buf = torch.empty((rows, aligned_row(self.Vd)), dtype=torch.float32, device=self.device)
        return buf[:, : self.Vd]

    def run(self):
        req, out, v, cfg = self.req, self.out, self.variant, self.cfg
        N, V = self.N, self.V
        if self.y is None:
            self.y = normalize_triton(req, self.interpret)
        if self.persistent:
            return run_persistent(self, _SCRATCH_BYTES)
        n_rounds = self._rounds(cfg, exact=False)
        exact = n_rounds == self._rounds(cfg, exact=True)
        stage_logprobs = v.logprobs and not self.out_f32
        T, TD, C = self._tiles(cfg)
        per_row = Scratch.bytes_per_row(T, C, n_rounds, TD)
        if not exact:  # the re-run's slots, and the merge again with them
            per_row += Scratch.bytes_per_row(0, self.k // n_rounds, self._rounds(cfg, True), 0)
        per_row += 4 * V * stage_logprobs + 4 * aligned_row(self.Vd) * v.draft
        chunk = self._chunk_rows(cfg, per_row)
        scr = self._scratch(chunk, cfg, n_rounds)
        f32 = {"dtype": torch.float32, "device": self.device}
        stage_buf = torch.empty((chunk, V), **f32) if stage_logprobs else None
        draft_buf = self._draft_staging(chunk) if v.draft else None
        for r0 in range(0, N, chunk):
            r1 = min(N, r0 + chunk)
            R = r1 - r0
            logits = out.logits[r0:r1] if v.logits else None
            stage = (out.logprobs[r0:r1] if self.out_f32 else stage_buf[:R]) if v.logprobs else None
            draft = draft_buf[:R] if v.draft else None
            self._launch(self.y[r0:r1], cfg, v, n_rounds, scr, logits, stage, draft)

            # -- merges over [R, T] partials
            part_m = scr.part_m[:R]
            amax = merge_argmax(part_m, scr.part_arg[:R])
            out.argmax[r0:r1] = amax
            dlse = None
            if self.k:  # topk: lse over the vocabulary; draft_topk: over the draft columns
                cand = scr.cand[:R]
                tm, ts = (t[:R] for t in self._topk_stats(scr))
                top, tail, top_lse = merge_topk(tm, ts, cand.reshape(R, -1), self.k)
                if not exact:
                    lens = tile_lengths(self.n_cand, cfg.BLOCK_V, self.device)
                    sat = saturated_tiles(cand, top[:, self.k - 1 :], lens)
                    top, tail = self._redo_topk(r0, sat, scr)
                prefix = "draft_topk" if v.draft_topk else "topk"
                write_topk(out, prefix, slice(r0, r1), top, tail, top_lse)
                lse, dlse = (None, top_lse) if v.draft_topk else (top_lse, None)
            if out.lse is not None and not v.topk:
                lse = merge_lse(part_m, scr.part_s[:R])
            if out.lse is not None:
                out.lse[r0:r1] = lse
            if out.logprobs is not None:
                lse32 = out.lse[r0:r1, None]
                if not v.logprobs:  # derived from the fp32 logits output
                    torch.sub(out.logits[r0:r1], lse32, out=out.logprobs[r0:r1])
                elif self.out_f32:
                    stage.sub_(lse32)
                else:
                    out.logprobs[r0:r1] = stage.sub_(lse32)
            if v.draft:  # one pass from the raw fp32 logits into the output dtype
                if dlse is None:
                    dlse = merge_lse(scr.part_dm[:R], scr.part_ds[:R])
                torch.sub(draft, dlse.float()[:, None], out=out.draft_logprobs[r0:r1])
            if out.argmax_in_draft is not None:
                out.argmax_in_draft[r0:r1] = self.in_draft[amax]

    def _redo_topk(self, r0, sat, scr):
        """Exact top-k of chunk rows r0.. whose tiles `sat` [R, C] may hide more top-k members:
        one re-run launch over every (row block, tile) computes, with the exact number of
        candidates (`_rounds`), the pairs `sat` flags, each into its row's next slot; blocks
        with nothing flagged exit at once. A saturated tile put all its n candidates in the
        top-k, so a row has at most k // n of them: the slots, the launch and the merge have
        host-known sizes, and nothing waits on the device. Those tiles' first-pass candidates
        and sums give way to the re-run's and the top-k is selected again; the other tiles were
        not saturated against a threshold that can only rise, so it is exact. lse stays the
        first pass's (logprobs / draft already used it). Returns (top keys, tail)."""
        cfg, k, R = self.cfg, self.k, sat.shape[0]
        n_exact = self._rounds(cfg, exact=True)
        S = k // self._rounds(cfg, exact=False)
        slots = torch.where(sat, torch.cumsum(sat, 1, dtype=torch.int32) - 1, -1).int()
        scr2 = Scratch.alloc(R, S, S, n_exact, S if self.Vd else 0, self.device).empty_()
        variant = replace(self.variant, tile_list=True)
        self._launch(self.y[r0 : r0 + R], cfg, variant, n_exact, scr2, slots=slots)
        first = (t[:R] for t in (scr.cand, *self._topk_stats(scr)))
        top, tail, _ = remerge_topk(*first, sat, scr2.cand, *self._topk_stats(scr2), k)
        return top, tail
