"""The head op in Triton: RMSNorm prologue + LM-head GEMM fused with its vocabulary reductions.

`lm_head_triton(req)` turns final pre-norm hidden states [N, H] into EAGLE-3 supervision
(lse, argmax, top-k, draft-vocab log-probs, the sparse draft top-k, optionally logits /
logprobs) with the semantics `reference.py` defines, without materialising fp32 [N, V]
logits unless asked for.

Design
  1. The norm prologue (`_triton_norm`) writes y = norm(x) in the weight dtype, rounded as
     `reference.final_norm` rounds it, so both GEMM operands stream from global to shared
     memory unchanged; a norm inside the K-loop would route every A tile through registers.
  2. `lm_head_fwd_kernel`: one program per [BLOCK_N rows x BLOCK_V vocab] tile in grouped
     order (GROUP_SIZE row blocks sweep the vocabulary together, so a weight tile is read
     from HBM once per group), fp32 accumulation, then an epilogue on the fp32 tile: scale,
     softcap, per-(row, tile) max / argmax (ties to the lower id, NaN ranked as +inf so every
     index stays in the tile: `_triton_jit.tile_argmax`), the sum exp only when
     lse / logprobs / top-k need it (HAS_LSE; "draft" / "argmax" / "draft_topk" alone skip
     it), draft statistics and raw draft logits (through a target -> draft map), the tile's
     best `n_rounds` top-k candidates as int64 keys: over the whole tile (HAS_TOPK) or over
     its draft columns with draft indices as ids (DRAFT_TOPK, whose draft sum then covers
     the other draft columns only), and the logits / fp32 logprobs stores.
  3. Torch merges the per-tile partials (`_triton_merge`). A tile whose `n_rounds`
     candidates all made the top-k may hide more; the rows concerned re-run just those
     tiles with all the candidates they can hold (`_Head._redo_topk`), so the top-k is exact.
  So "draft_topk" is one pass over the vocabulary, with no [N, Vd] buffer unless "draft" is
  asked for too. Rows run in chunks that keep the scratch under `_SCRATCH_BYTES`. CPU tensors
  run the same kernels in triton's interpreter (`_triton_interpret`); it multiplies bf16 bit
  patterns in tl.dot and truncates fp32 -> 16-bit casts, so INTERPRET=True upcasts dot
  operands to fp32 and rounds to nearest-even before any 16-bit store.
Limits: V < 2^31 (ids live in 31 bits of a key); fp32 weights use full-precision fp32 FMA
("ieee", no tf32: the reference is full fp32), correct but far slower than bf16 on a GPU.
Block sizes and EAGLE_FAST_AUTOTUNE=1: `_triton_config`; the sm_90 compile checks:
`_triton_aot` and tests/test_lm_head_aot.py.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl
from eagle_fast.kernels._common import HeadOutput, HeadRequest

from ._triton_config import (
    TL_NAME,
    Config,
    Variant,
    autotune_config,
    default_config,
    fwd_constexprs,
    next_pow2,
)
from ._triton_interpret import run_kernel
from ._triton_jit import draft_epilogue, round_rne, store_candidates, tanh, tile_argmax
from ._triton_merge import (
    Scratch,
    candidate_rounds,
    merge_lse,
    merge_topk,
    remerge_topk,
    saturated_tiles,
    tile_lengths,
    unpack_keys,
)
from ._triton_norm import normalize_triton

# Scratch budget per launch, besides the requested outputs and y [N, H]: per-tile stats and
# top-k candidates (`Scratch.bytes_per_row`; a re-run adds its tiles' exact candidates) and,
# with a 16-bit out_dtype, fp32 staging of logprobs (rows x V) and draft logprobs (rows x
# Vd), so the final value is rounded once from fp32 like the reference. Rows go in chunks
# that fit, one BLOCK_N row block at least. 256 MiB keeps the head's extra memory small
# next to an 8B model's weights and activations while each launch still has thousands of
# tiles (N=8192, V=151,936: lse/argmax and draft in one launch; top-64 in 5 row chunks of
# 1664 rows, 7722 tiles each).
_SCRATCH_BYTES = 256 << 20
# Top-k candidates kept per (row, tile) in the first pass when k > this: enough that a row
# needs recomputation only if 9 of its top-k share one 128-256 wide vocab tile, cheap enough
# that 8 extraction rounds (~5 ops per element each) cost ~10% of the tile's GEMM at H=4096.
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
    PartArg_ptr,  # [N, T] int32 per-tile argmax (global id)
    Cand_ptr,  # [N, T, n_rounds] int64 top-k candidate keys (HAS_TOPK | DRAFT_TOPK)
    T2D_ptr,  # [V] int32 draft column of each target id, -1 if none (HAS_DRAFT | DRAFT_TOPK)
    Draft_ptr,  # [N, Vd] fp32 raw draft logits             (HAS_DRAFT)
    PartDM_ptr,  # [N, T] fp32 per-tile max over draft columns (HAS_DRAFT | DRAFT_TOPK)
    PartDS_ptr,  # [N, T] fp32 per-tile draft sum exp (DRAFT_TOPK: over non-candidates)
    Tiles_ptr,  # [T] int32 vocab tiles to compute          (HAS_TILE_LIST)
    # sizes
    N,
    V,
    H,
    n_vtiles,  # vocab tiles this launch covers (T): ceil(V / BLOCK_V), or the list's length
    n_rounds,  # top-k candidates per (row, tile)
    # strides (rows; every inner stride is 1)
    stride_ym,
    stride_wv,
    stride_lm,
    stride_sm,
    stride_pm,
    stride_cm,
    stride_dm,
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
    HAS_SOFTCAP: tl.constexpr,
    HAS_LSE: tl.constexpr,  # sum exp over the whole tile (lse); else maxima only
    HAS_TILE_LIST: tl.constexpr,  # top-k re-run on listed tiles only (position -> tile id)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 weights (and the interpreter)
    INTERPRET: tl.constexpr,  # fp32 dot operands + RNE before 16-bit stores
):
    # ---- grouped program ordering: GROUP_SIZE row blocks walk the vocab tiles together
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_v = n_vtiles
    num_pid_in_group = GROUP_SIZE * num_pid_v
    group_id = pid // num_pid_in_group
    first_pid_n = group_id * GROUP_SIZE
    group_rows = tl.minimum(num_pid_n - first_pid_n, GROUP_SIZE)
    pid_n = first_pid_n + ((pid % num_pid_in_group) % group_rows)
    pid_v = (pid % num_pid_in_group) // group_rows  # column of the partial buffers
    if HAS_TILE_LIST:
        tile = tl.load(Tiles_ptr + pid_v)
    else:
        tile = pid_v

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = cols < V
    # loads wrap ragged edges onto valid rows / ids (no load masks); results there are
    # masked out below
    rows_ld = (rows % N).to(tl.int64)
    cols_ld = (cols % V).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    y_ptrs = Y_ptr + rows_ld[:, None] * stride_ym + offs_h[None, :]
    w_ptrs = W_ptr + cols_ld[:, None] * stride_wv + offs_h[None, :]

    # ---- GEMM: acc[n, v] = sum_h y[n, h] * w[v, h], fp32 accumulation
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
            y = y.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(y, tl.trans(w), acc, input_precision=DOT_PRECISION)
        y_ptrs += BLOCK_H
        w_ptrs += BLOCK_H

    # ---- epilogue: logits of this tile in fp32
    logits = acc * logit_scale
    if HAS_SOFTCAP:
        logits = softcap * tanh(logits / softcap)
    rows64 = rows.to(tl.int64)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if HAS_LOGITS:
        out = logits
        if INTERPRET:
            out = round_rne(out, Logits_ptr.dtype.element_ty)
        l_ptrs = Logits_ptr + rows64[:, None] * stride_lm + cols[None, :]
        tl.store(l_ptrs, out.to(Logits_ptr.dtype.element_ty), mask=out_mask)
    if HAS_LOGPROBS:
        tl.store(Stage_ptr + rows64[:, None] * stride_sm + cols[None, :], logits, mask=out_mask)
    logits = tl.where(col_mask[None, :], logits, float("-inf"))

    # ---- per (row, tile) statistics: max and argmax (lowest id among maxima, NaN as +inf)
    local = tl.arange(0, BLOCK_V)
    logits, m, arg = tile_argmax(logits, local, BLOCK_V)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf -> sums of 0, not NaN
    p_off = rows64 * stride_pm + pid_v
    tl.store(PartM_ptr + p_off, m, mask=row_mask)
    tl.store(PartArg_ptr + p_off, tile * BLOCK_V + arg, mask=row_mask)
    if HAS_LSE and not HAS_TOPK:  # here, so the tile can die after the draft step
        s = tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        tl.store(PartS_ptr + p_off, s, mask=row_mask)

    # ---- draft vocabulary: raw logits, max, sum exp and the draft top-k candidates
    c_ptrs = Cand_ptr + rows64 * stride_cm + pid_v * n_rounds
    if HAS_DRAFT or DRAFT_TOPK:
        draft_epilogue(
            logits, cols, col_mask, rows64, row_mask, p_off, c_ptrs, n_rounds,
            T2D_ptr, Draft_ptr, PartDM_ptr, PartDS_ptr, stride_dm, HAS_DRAFT, DRAFT_TOPK,
        )  # fmt: skip

    # ---- top-k candidates: the tile's best n_rounds (value, id) by max extraction; the
    # sum exp then covers only the rest of the tile, so the merge sums the mass outside
    # the top-k directly (no 1 - sum(top-k) cancellation)
    if HAS_TOPK:
        base = tile * BLOCK_V
        logits = store_candidates(logits, local, m, arg, c_ptrs, n_rounds, row_mask, base)
        s = tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        tl.store(PartS_ptr + p_off, s, mask=row_mask)


# ----------------------------------------------------------------------------- launcher


def lm_head_triton(req: HeadRequest) -> HeadOutput:
    """Fused Triton head. `req` is validated and 2-D (see `_common.HeadRequest`).

    Returns argmax int64 [N], lse fp32 [N] when `req.needs_lse`, and whatever `req.outputs`
    asks for, with the reference's semantics (the module header has the algorithm,
    `_SCRATCH_BYTES` the scratch bound). CUDA tensors run compiled kernels; CPU tensors run
    the same kernels in triton's interpreter.
    """
    hidden, weight = req.hidden, req.weight
    device = hidden.device
    N, H = hidden.shape
    V = weight.shape[0]
    out_dtype = req.out_dtype

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
    head = _Head(req, out, interpret)
    if interpret:
        head.run()
        return out
    with torch.cuda.device(device):  # triton launches on the current device
        if os.environ.get("EAGLE_FAST_AUTOTUNE") == "1":
            key = (V, H, min(next_pow2(N), 8192), head.variant)
            head.cfg = autotune_config(head.variant, head.cfg, key, head.trial)
        head.run()
    return out


class _Head:
    """One `lm_head_triton` call: variant and config, row chunks, launches and merges."""

    def __init__(self, req: HeadRequest, out: HeadOutput, interpret: bool):
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
        self.Vd = req.draft_ids.numel() if self.variant.draft else 0  # the dense draft buffer
        self.t2d = None
        if req.draft_ids is not None:  # target id -> draft column, -1 outside the draft vocabulary
            i32 = {"dtype": torch.int32, "device": self.device}
            self.t2d = torch.full((self.V,), -1, **i32)
            self.t2d[req.draft_ids] = torch.arange(req.draft_ids.numel(), **i32)
        self._lens: dict = {}
        self.y = None

    def _tiles(self, cfg: Config) -> int:
        return triton.cdiv(self.V, cfg.BLOCK_V)

    def _tile_len(self, cfg: Config) -> torch.Tensor:
        if cfg.BLOCK_V not in self._lens:
            draft = self.req.draft_ids if self.variant.draft_topk else None
            self._lens[cfg.BLOCK_V] = tile_lengths(self.V, cfg.BLOCK_V, draft, self.device)
        return self._lens[cfg.BLOCK_V]

    def _rounds(self, cfg: Config, exact: bool) -> int:
        """Top-k candidates per (row, tile): all a tile can hold of the top-k when `exact`,
        else _TOPK_ROUNDS when that is fewer (`candidate_rounds`)."""
        return candidate_rounds(self._tile_len(cfg), self.k, _TOPK_ROUNDS, exact) if self.k else 0

    def _chunk_rows(self, cfg: Config, per_row: int) -> int:
        bn = cfg.BLOCK_N
        return min(self.N, max(bn, _SCRATCH_BYTES // max(1, per_row) // bn * bn))

    def _topk_stats(self, scr: Scratch):
        """The per-tile (max, sum exp outside the candidates) the top-k merge reads: the draft
        columns' for draft_topk, the whole tile's for topk."""
        if self.variant.draft_topk:
            return scr.part_dm, scr.part_ds
        return scr.part_m, scr.part_s

    # -- one launch of the fused kernel over the rows of y_rows
    def _launch(
        self, y_rows, cfg, variant, n_rounds, scr, logits=None, stage=None, draft=None, tiles=None
    ):
        R = y_rows.shape[0]
        T = self._tiles(cfg) if tiles is None else tiles.numel()
        w = self.req.weight
        variant = replace(variant, even_h=self.H % cfg.BLOCK_H == 0)
        softcap = self.req.softcap
        run_kernel(
            lm_head_fwd_kernel, (triton.cdiv(R, cfg.BLOCK_N) * T,), self.interpret,
            y_rows, w,
            logits if logits is not None else scr.part_m,
            stage if stage is not None else scr.part_m,
            scr.part_m, scr.part_s, scr.part_arg, scr.cand,
            self.t2d if self.t2d is not None else scr.part_arg,
            draft if draft is not None else scr.part_m,
            scr.part_dm, scr.part_ds,
            tiles if tiles is not None else scr.part_arg,
            R, self.V, self.H, T, n_rounds,
            y_rows.stride(0), w.stride(0),
            logits.stride(0) if logits is not None else 0,
            stage.stride(0) if stage is not None else 0,
            T, T * max(1, n_rounds),
            draft.stride(0) if draft is not None else 0,
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
        scr = Scratch.alloc(rows, self._tiles(cfg), n_rounds, v.draft or v.draft_topk, dev)
        logits = (
            torch.empty((rows, self.V), dtype=self.req.out_dtype, device=dev) if v.logits else None
        )
        stage = torch.empty((rows, self.V), dtype=torch.float32, device=dev) if v.logprobs else None
        draft = torch.empty((rows, self.Vd), dtype=torch.float32, device=dev) if v.draft else None
        self._launch(self.y[:rows], cfg, v, n_rounds, scr, logits, stage, draft)

    def run(self):
        req, out, v, cfg = self.req, self.out, self.variant, self.cfg
        N, V = self.N, self.V
        if self.y is None:
            self.y = normalize_triton(req, self.interpret)
        T = self._tiles(cfg)
        n_rounds = self._rounds(cfg, exact=False)
        exact = n_rounds == self._rounds(cfg, exact=True)
        stage_logprobs = v.logprobs and not self.out_f32
        stage_draft = v.draft and not self.out_f32
        per_row = Scratch.bytes_per_row(T, n_rounds, v.draft or v.draft_topk)
        per_row += 4 * V * stage_logprobs + 4 * self.Vd * stage_draft
        chunk = self._chunk_rows(cfg, per_row)
        scr = Scratch.alloc(chunk, T, n_rounds, v.draft or v.draft_topk, self.device)
        f32 = {"dtype": torch.float32, "device": self.device}
        stage_buf = torch.empty((chunk, V), **f32) if stage_logprobs else None
        draft_buf = torch.empty((chunk, self.Vd), **f32) if stage_draft else None
        for r0 in range(0, N, chunk):
            r1 = min(N, r0 + chunk)
            R = r1 - r0
            logits = out.logits[r0:r1] if v.logits else None
            stage = (out.logprobs[r0:r1] if self.out_f32 else stage_buf[:R]) if v.logprobs else None
            draft = (
                (out.draft_logprobs[r0:r1] if self.out_f32 else draft_buf[:R]) if v.draft else None
            )
            self._launch(self.y[r0:r1], cfg, v, n_rounds, scr, logits, stage, draft)

            # -- merges over [R, T] partials
            part_m = scr.part_m[:R]
            best_tile = torch.argmax(part_m, dim=1)  # first tile holding the max: lowest id
            amax = scr.part_arg[:R].gather(1, best_tile[:, None]).squeeze(1).long()
            out.argmax[r0:r1] = amax
            dlse = None
            if self.k:  # topk: lse over the vocabulary; draft_topk: over the draft columns
                cand = scr.cand[:R]
                tm, ts = (t[:R] for t in self._topk_stats(scr))
                top, tail, top_lse = merge_topk(tm, ts, cand.reshape(R, -1), self.k)
                if not exact:
                    sat = saturated_tiles(cand, top[:, self.k - 1 :], self._tile_len(cfg))
                    rows = sat.any(1).nonzero().squeeze(1)  # (a host sync per chunk)
                    if rows.numel():
                        self._redo_topk(r0, rows, sat[rows], scr, top, tail)
                self._write_topk(slice(r0, r1), top, tail, top_lse)
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
            if v.draft:
                if dlse is None:
                    dlse = merge_lse(scr.part_dm[:R], scr.part_ds[:R])
                if self.out_f32:
                    draft.sub_(dlse.float()[:, None])
                else:
                    out.draft_logprobs[r0:r1] = draft.sub_(dlse.float()[:, None])
            if out.argmax_in_draft is not None:
                out.argmax_in_draft[r0:r1] = self.t2d[amax] >= 0

    def _write_topk(self, rows, top, tail, lse64):
        """topk_* (ids = target ids), or draft_topk_* (ids = draft indices, lse64 the draft
        vocabulary's), from merged keys."""
        vals, ids = unpack_keys(top)
        prefix = "draft_topk" if self.variant.draft_topk else "topk"
        getattr(self.out, prefix + "_ids")[rows] = ids
        logprobs = (vals.double() - lse64[:, None]).to(self.req.out_dtype)
        getattr(self.out, prefix + "_logprobs")[rows] = logprobs
        getattr(self.out, prefix + "_tail")[rows] = tail.clamp(0.0, 1.0).float()

    def _redo_topk(self, r0, rows, sat, scr, top, tail):
        """Exact top-k for chunk-local `rows` (whose tiles `sat` [F, T] may hide more top-k
        members): recompute just the union of their flagged vocab tiles with the exact
        number of candidates each (`_rounds`), swap those tiles' candidates and sums in,
        and select again. The other tiles were not saturated against a threshold that can
        only rise, so the result is exact. lse stays the first pass's (logprobs / draft
        already used it). Updates `top` and `tail` in place."""
        cfg, T, k = self.cfg, self._tiles(self.cfg), self.k
        n_exact = self._rounds(cfg, exact=True)
        variant = replace(self.variant, tile_list=True)
        n_tiles = int(sat.any(0).sum())
        dstats = variant.draft_topk
        per_row = Scratch.bytes_per_row(n_tiles, n_exact, dstats) + T * 33 * scr.cand.shape[2]
        chunk = min(rows.numel(), self._chunk_rows(cfg, per_row))
        for i0 in range(0, rows.numel(), chunk):
            idx, sat_i = rows[i0 : i0 + chunk], sat[i0 : i0 + chunk]
            F = idx.numel()
            tiles = sat_i.any(0).nonzero().squeeze(1)
            scr2 = Scratch.alloc(F, tiles.numel(), n_exact, dstats, self.device)
            y_rows = self.y.index_select(0, idx + r0)
            self._launch(y_rows, cfg, variant, n_exact, scr2, tiles=tiles.to(torch.int32))
            (m1, s1), (m2, s2) = self._topk_stats(scr), self._topk_stats(scr2)
            first = (scr.cand[idx], m1[idx], s1[idx])  # copies (advanced indexing)
            rerun = (scr2.cand[:F], m2[:F], s2[:F])
            top[idx], tail[idx], _ = remerge_topk(*first, tiles, *rerun, k)
