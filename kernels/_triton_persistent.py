"""The head's persistent, TMA-fed Triton kernel: one program per SM, running row statistics.

Design: `lm_head_persistent_kernel` launches `num_programs` programs (one per SM on a GPU).
Row blocks go in groups of GROUP_SIZE; inside a group, program p owns row block p % rows and
the vocabulary lane p // rows, i.e. the vocab tiles lane, lane + lanes, ... So the programs
of a group stream consecutive weight tiles together (each weight tile is read from HBM once
per group, like the tiled kernel's grouped order) while every program keeps its row block's
max / argmax (lowest id on ties) / sum exp in registers across its tiles, storing them once
per (row block, lane) into [rows, num_programs] partials that `_triton_merge` reduces as it
reduces per-tile partials. A draft tile stores its draft max / sum exp per (draft tile, row)
instead, as the tiled kernel does (on a full draft tile: the tile's own max and sum), so no
draft statistic is carried. Both GEMM operands arrive by TMA through host tensor descriptors
(zero-filled past N, V and H); the K loop is software-pipelined (num_stages). Flattening the
tile loop into it, so that the next tile's loads fly during the epilogue as in triton's
persistent matmul tutorial, is one switch (`FLATTEN`), off: see there.
Draft tiles first: TMA on sm_90 loads boxes of consecutive rows, it cannot gather the
draft-first order, and that order permutes the non-draft rows as well (they skip the draft
ids). Pointer loads for the draft tiles alone would therefore not suffice, so the weight is
copied once in walk order (`walk_weight`: V*H*2 bytes, 1.2 GB at Qwen3-8B next to a 16 GB
model), cached for the last (weight, draft ids) pair; the copy is one gather at HBM speed and
every tile is then TMA-fed with no id lookup in the loads.
Registers (`persistent_config`): argmax / lse run 128x256 tiles (128 accumulator registers
per thread); the draft and softcap epilogues spilled beside that accumulator in every 128x256
variant tried (softcap but on 2 stages), so they run 128x128 (64): 0 B spilled in every mode,
at ~0.5 more SASS per logit on non-draft tiles (bench/RESULTS-head-gpu.md, the static report).
Limits: modes lse / argmax / draft (with or without lse), optional scale and softcap, 16-bit
weights whose rows are 16-byte multiples; everything else (logits, logprobs, top-k, draft
top-k, fp32 weights) runs the tiled kernel (`supports`). No GPU has run it yet.
"""

from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl

from ._triton_config import Config, Variant, aligned_row, persistent_config
from ._triton_interpret import run_kernel
from ._triton_jit import exp_shifted, tanh
from ._triton_merge import merge_argmax, merge_lse

try:  # host-side TMA descriptors: triton >= 3.3 (3.6 on the GPU image, 3.9 here)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: the launcher keeps the tiled kernel
    TensorDescriptor = None

_INT_MAX = 2**31 - 1
# Flattening the tile loop into the K loop (triton's persistent matmul) would issue the next
# tile's loads during the epilogue, but with this 128x256 fp32 accumulator and epilogue
# (triton 3.9, ptxas 13) every mode gets its wgmma serialised (C7514: the epilogue reads the
# accumulator inside the pipeline), and draft + argmax needs 272 KB of shared memory (over
# sm_90's 227 KB) and spills 592 B. Unflattened, each tile refills the K loop's num_stages
# pipeline (about 3 of its 64 K steps) after the epilogue.
FLATTEN = False


@triton.jit
def _sum_exp(x, m):
    # sum exp(x - m) of each row of x [BLOCK_N, BLOCK_V] at its max m (0, not NaN, for a row
    # of -inf)
    return tl.sum(exp_shifted(x, tl.where(m == float("-inf"), 0.0, m)), axis=1)


@triton.jit
def _tile_argmax_walk(
    logits, pos, start, Order_ptr, V, Vd, BLOCK_V: tl.constexpr, HAS_ORDER: tl.constexpr
):
    # `_triton_jit.tile_argmax` of a tile at walk positions `pos`, found by position and
    # mapped to the target id once per row: no [BLOCK_V] id vector held beside the tile. Inside
    # a tile, positions order target ids the same way (the draft ids ascending, then the other
    # ids ascending), except in the one tile holding both, where the lowest draft and the
    # lowest other position among the maxima are both mapped and the lower id wins.
    logits = tl.where(logits == logits, logits, float("inf"))  # noqa: PLR0124 (NaN as +inf)
    m = tl.max(logits, axis=1)
    # (the maxima are compared in each branch: a [BLOCK_N, BLOCK_V] mask live across the
    # branch costs its bits packed into registers)
    if HAS_ORDER and start < Vd and start + BLOCK_V > Vd:
        is_draft = (pos < Vd)[None, :]
        at_max = logits == m[:, None]
        pd = tl.min(tl.where(at_max & is_draft, pos[None, :], 0x7FFFFFFF), axis=1)
        po = tl.min(tl.where(at_max & ~is_draft, pos[None, :], 0x7FFFFFFF), axis=1)
        id_d = tl.load(Order_ptr + pd, mask=pd < V, other=0x7FFFFFFF)
        id_o = tl.load(Order_ptr + po, mask=po < V, other=0x7FFFFFFF)
        arg = tl.minimum(id_d, id_o)
    else:
        arg = tl.min(tl.where(logits == m[:, None], pos[None, :], 0x7FFFFFFF), axis=1)
        if HAS_ORDER:  # the tile's first column, a real one, is the lowest of an all -inf row
            arg = tl.load(Order_ptr + arg)
    return logits, m, arg


@triton.jit
def _merge_running(m_run, s_run, m, x, SUM: tl.constexpr):
    # Running (max, sum exp(l - max)) of a row block updated with a tile x [BLOCK_N, BLOCK_V]
    # whose row max is m: the sum is rescaled to the new max (exp(-inf) = 0 on the first
    # tile; an all -inf row keeps 0, not NaN).
    m_new = tl.maximum(m_run, m)
    if SUM:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_run = s_run * tl.exp(m_run - m_safe) + tl.sum(exp_shifted(x, m_safe), axis=1)
    return m_new, s_run


@triton.jit
def _tile_update(
    logits, pos, start, row_mask, d_off, Order_ptr, Draft_ptr, PartDM_ptr, PartDS_ptr,
    stride_dm, V, Vd, m_run, s_run, arg_run,
    BLOCK_V: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_LSE: tl.constexpr,
):  # fmt: skip
    # One tile's epilogue: its max / argmax / sum exp merged into the running ones. A draft
    # tile also stores its dense raw draft logits (Draft_ptr: the row block's first row) and
    # its own draft max / sum exp at d_off, not carried: on a full draft tile they are the
    # tile's max and its sum exp at that max, one exp pass for both. Returns the running ones.
    logits, m, arg = _tile_argmax_walk(logits, pos, start, Order_ptr, V, Vd, BLOCK_V, HAS_ORDER)
    arg_run = tl.where(m > m_run, arg, tl.where(m == m_run, tl.minimum(arg, arg_run), arg_run))
    if HAS_DRAFT and start < Vd:  # constexpr False short-circuits
        # int32 offsets inside the row block: BLOCK_N (<= 128) x stride_dm < 2^31 for Vd < 2^24
        r = tl.arange(0, logits.shape[0])
        d_ptrs = Draft_ptr + (r * stride_dm)[:, None] + pos[None, :]
        if start + BLOCK_V > Vd:  # the last, mixed draft tile: its draft columns' own
            is_draft = pos < Vd
            tl.store(d_ptrs, logits, mask=row_mask[:, None] & is_draft[None, :])
            dl = tl.where(is_draft[None, :], logits, float("-inf"))
            dm = tl.max(dl, axis=1)
            tl.store(PartDM_ptr + d_off, dm, mask=row_mask)
            tl.store(PartDS_ptr + d_off, _sum_exp(dl, dm), mask=row_mask)
            m_run, s_run = _merge_running(m_run, s_run, m, logits, HAS_LSE)
        else:  # every column a draft one: no column mask
            tl.store(d_ptrs, logits, mask=row_mask[:, None])
            s = _sum_exp(logits, m)
            tl.store(PartDM_ptr + d_off, m, mask=row_mask)
            tl.store(PartDS_ptr + d_off, s, mask=row_mask)
            m_new = tl.maximum(m_run, m)
            if HAS_LSE:  # the tile's sum moved from its max to the new one (exp(-inf) = 0)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                s_run = s_run * tl.exp(m_run - m_safe) + s * tl.exp(m - m_safe)
            m_run = m_new
    else:
        m_run, s_run = _merge_running(m_run, s_run, m, logits, HAS_LSE)
    return m_run, s_run, arg_run


@triton.jit
def lm_head_persistent_kernel(
    # tensor descriptors (TMA)
    y_desc,  # [N, H] normalised activations, block [BLOCK_N, BLOCK_H]
    w_desc,  # [V, H] weight rows in walk order (draft ids first), block [BLOCK_V, BLOCK_H]
    # pointers
    PartM_ptr,  # [N, P] fp32 running max per (row, lane); P = NUM_PROGS
    PartS_ptr,  # [N, P] fp32 running sum exp(l - max)        (HAS_LSE)
    PartArg_ptr,  # [N, P] int32 running argmax (target id)
    Order_ptr,  # [V] int32 target id at each walk position    (HAS_ORDER)
    Draft_ptr,  # [N, Vd] fp32 raw draft logits                (HAS_DRAFT)
    PartDM_ptr,  # [TD, N] fp32 draft max per draft tile        (HAS_DRAFT)
    PartDS_ptr,  # [TD, N] fp32 draft sum exp per draft tile    (HAS_DRAFT)
    # sizes: rows, vocabulary, hidden, draft ids (the walk's first Vd positions)
    N,
    V,
    H,
    Vd,
    # strides (rows; inner strides are 1): partials, draft logits
    stride_pm,
    stride_dm,
    # scalars
    logit_scale,
    softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # row blocks per group
    NUM_PROGS: tl.constexpr,  # the grid: a multiple of GROUP_SIZE
    HAS_DRAFT: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LSE: tl.constexpr,
    FLATTEN: tl.constexpr,  # flatten the tile loop with the K loop: next tile's loads in flight
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,  # fp32 dot operands (the interpreter multiplies bf16 bit patterns)
):
    # ---- this program's work: in each full group, row p % GROUP_SIZE and lane p // GROUP_SIZE
    # of NUM_PROGS // GROUP_SIZE lanes; in the last, short group the same with its row count
    p = tl.program_id(0)
    n_vtiles = tl.cdiv(V, BLOCK_V)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    n_full = num_pid_n // GROUP_SIZE
    last_rows = num_pid_n - n_full * GROUP_SIZE
    lanes_f: tl.constexpr = NUM_PROGS // GROUP_SIZE
    lane_f = p // GROUP_SIZE
    cnt_f = (tl.maximum(n_vtiles - lane_f, 0) + lanes_f - 1) // lanes_f  # my tiles per group
    rows_l = tl.maximum(last_rows, 1)
    lanes_l = NUM_PROGS // rows_l
    lane_l = p // rows_l
    cnt_l = tl.cdiv(tl.maximum(n_vtiles - lane_l, 0), lanes_l)
    cnt_l = tl.where((last_rows > 0) & (lane_l < lanes_l), cnt_l, 0)
    n_full_iters = n_full * cnt_f
    k_tiles = tl.cdiv(H, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_V)

    m_run = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_run = tl.zeros((BLOCK_N,), tl.float32)
    arg_run = tl.full((BLOCK_N,), 0x7FFFFFFF, tl.int32)
    for it in tl.range(0, n_full_iters + cnt_l, flatten=FLATTEN):
        in_full = it < n_full_iters
        cnt = tl.where(in_full, cnt_f, cnt_l)
        j = tl.where(in_full, it % tl.maximum(cnt_f, 1), it - n_full_iters)  # my j-th tile
        group = tl.where(in_full, it // tl.maximum(cnt_f, 1), n_full)
        g_rows = tl.where(in_full, GROUP_SIZE, rows_l)
        lanes = NUM_PROGS // g_rows
        pid_n = group * GROUP_SIZE + p % g_rows
        tile = p // g_rows + j * lanes

        # ---- GEMM: both operands by TMA (zeros past N, V and H), fp32 accumulation
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for kk in range(k_tiles):
            y = y_desc.load([pid_n * BLOCK_N, kk * BLOCK_H])
            w = w_desc.load([tile * BLOCK_V, kk * BLOCK_H])
            if INTERPRET:
                y, w = y.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(y, tl.trans(w), acc, input_precision=DOT_PRECISION)

        # ---- epilogue: the tile's logits, its max / argmax merged into the running ones
        logits = acc
        if logit_scale != 1.0:
            logits = logits * logit_scale
        if HAS_SOFTCAP:
            logits = softcap * tanh(logits / softcap)
        start = tile * BLOCK_V
        pos = start + offs_v
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        rows64 = rows.to(tl.int64)
        # draft partials [TD, N] (rows contiguous); the row block's first draft row (int64)
        d_off = tile.to(tl.int64) * N + rows64
        d_row = Draft_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_dm
        at = (pos, start, row_mask, d_off, Order_ptr, d_row, PartDM_ptr, PartDS_ptr, stride_dm,
              V, Vd)  # fmt: skip
        runs = (m_run, s_run, arg_run)
        flags = (BLOCK_V, HAS_DRAFT, HAS_ORDER, HAS_LSE)
        # the ragged last tile masks TMA's zero columns in a branch of its own: no tile-sized
        # value leaves a branch (a yielded tile costs registers), no select on other tiles
        if start + BLOCK_V > V:
            masked = tl.where((pos < V)[None, :], logits, float("-inf"))
            m_run, s_run, arg_run = _tile_update(masked, *at, *runs, *flags)
        else:
            m_run, s_run, arg_run = _tile_update(logits, *at, *runs, *flags)

        # ---- the row block's last tile of this program: store, start over
        if j == cnt - 1:
            p_off = rows64 * stride_pm + p // g_rows
            tl.store(PartM_ptr + p_off, m_run, mask=row_mask)
            tl.store(PartArg_ptr + p_off, arg_run, mask=row_mask)
            if HAS_LSE:
                tl.store(PartS_ptr + p_off, s_run, mask=row_mask)
            m_run = tl.full((BLOCK_N,), float("-inf"), tl.float32)
            s_run = tl.zeros((BLOCK_N,), tl.float32)
            arg_run = tl.full((BLOCK_N,), 0x7FFFFFFF, tl.int32)


# ----------------------------------------------------------------------------- host side


def supports(variant: Variant, weight: torch.Tensor) -> bool:
    """Whether the persistent kernel computes `variant` for this weight (else: tiled kernel)."""
    modes_ok = not (variant.logits or variant.logprobs or variant.topk or variant.draft_topk)
    H = weight.shape[1]
    # TMA: a 16-byte aligned base and row stride (y, written by the norm prologue, follows)
    tma_ok = weight.element_size() == 2 and (H * 2) % 16 == 0 and (weight.stride(0) * 2) % 16 == 0
    tma_ok = tma_ok and weight.data_ptr() % 16 == 0
    return TensorDescriptor is not None and modes_ok and tma_ok and not variant.tile_list


_WALK_LOCK = threading.Lock()
_WALK_CACHE: list = []  # [(key, weight, draft ids, copy)]: one entry


def _walk_key(weight: torch.Tensor, draft_ids: torch.Tensor) -> tuple:
    # what the copy depends on; `lm_head` hands a new detached view of the same weight per
    # call, which shares the storage and the in-place version counter
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t._version)
                 for t in (weight, draft_ids))  # fmt: skip


def walk_weight(weight: torch.Tensor, draft_ids: torch.Tensor | None, order) -> torch.Tensor:
    """The weight rows in walk order: `weight` itself without a draft vocabulary, else a
    one-time copy with the draft rows first (`order`), kept for the last (weight, draft_ids)
    pair. The cache holds both tensors, so no other tensor can take their addresses while it
    is kept, and compares their in-place versions."""
    if order is None:
        return weight
    key = _walk_key(weight, draft_ids)
    with _WALK_LOCK:
        if _WALK_CACHE and _WALK_CACHE[0][0] == key:
            return _WALK_CACHE[0][-1]
        _WALK_CACHE.clear()  # release the old copy before making the new one
        copy = weight.index_select(0, order)
        _WALK_CACHE.append((key, weight, draft_ids, copy))
        return copy


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(cfg: Config, device: torch.device) -> int:
    """The persistent grid: one program per SM, rounded down to a multiple of GROUP_SIZE (so
    every full group splits the vocabulary into the same number of lanes)."""
    if device.type != "cuda":  # the interpreter: 3 lanes per full group, more in a short one
        return 3 * cfg.GROUP_SIZE
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(cfg.GROUP_SIZE, sms // cfg.GROUP_SIZE * cfg.GROUP_SIZE)


def persistent_constexprs(variant: Variant, cfg: Config, n_progs: int, interpret: bool) -> dict:
    """Meta-parameters of `lm_head_persistent_kernel` (for the launcher and the AOT compiler)."""
    return {
        "BLOCK_N": cfg.BLOCK_N,
        "BLOCK_V": cfg.BLOCK_V,
        "BLOCK_H": cfg.BLOCK_H,
        "GROUP_SIZE": cfg.GROUP_SIZE,
        "NUM_PROGS": n_progs,
        "HAS_DRAFT": variant.draft,
        "HAS_ORDER": variant.draft,
        "HAS_SOFTCAP": variant.softcap,
        "HAS_LSE": variant.lse,
        "FLATTEN": FLATTEN,
        "DOT_PRECISION": "ieee" if interpret else "tf32",
        "INTERPRET": interpret,
    }


def run_persistent(head, scratch_bytes: int) -> None:
    """`lm_head_triton`'s work for a `_Head` whose variant `supports` covers: norm prologue,
    row chunks of the persistent kernel (fp32 draft staging under `scratch_bytes`), merges."""
    req, out, v, dev = head.req, head.out, head.variant, head.device
    N, V, H, Vd = head.N, head.V, head.H, head.Vd
    cfg = persistent_config(v, N, V, H, head.interpret)
    P = num_programs(cfg, dev)
    y = head.y
    w = walk_weight(req.weight, req.draft_ids if v.draft else None, head.order if v.draft else None)
    w_desc = TensorDescriptor.from_tensor(w, [cfg.BLOCK_V, cfg.BLOCK_H])
    TD = triton.cdiv(Vd, cfg.BLOCK_V) if v.draft else 0  # draft tiles
    per_row = 12 * P + (4 * aligned_row(Vd) + 8 * TD) * v.draft
    chunk = min(N, max(cfg.BLOCK_N, scratch_bytes // per_row // cfg.BLOCK_N * cfg.BLOCK_N))
    f32 = {"dtype": torch.float32, "device": dev}
    part_m, part_s = (torch.empty((chunk, P), **f32) for _ in range(2))
    part_arg = torch.empty((chunk, P), dtype=torch.int32, device=dev)
    # per draft tile statistics, [TD, rows] (every (draft tile, row) is written)
    part_dm, part_ds = (torch.empty(max(1, TD * chunk), **f32) for _ in range(2))
    # raw draft logits, rows 64-byte aligned (the tiled kernel's staging, `aligned_row`)
    draft_buf = torch.empty((chunk, aligned_row(Vd)), **f32)[:, :Vd] if v.draft else None
    softcap = req.softcap
    for r0 in range(0, N, chunk):
        R = min(N, r0 + chunk) - r0
        # lanes a row block never reaches keep the empty statistics
        pm, ps, pa = (t[:R] for t in (part_m, part_s, part_arg))
        for t, empty in zip((pm, ps, pa), (float("-inf"), 0.0, _INT_MAX)):
            t.fill_(empty)
        pdm, pds = (t[: TD * R].view(TD, R) if v.draft else t for t in (part_dm, part_ds))
        draft = draft_buf[:R] if v.draft else None
        y_desc = TensorDescriptor.from_tensor(y[r0 : r0 + R], [cfg.BLOCK_N, cfg.BLOCK_H])
        run_kernel(
            lm_head_persistent_kernel, (P,), head.interpret,
            y_desc, w_desc, pm, ps, pa,
            head.order if v.draft else pa,
            draft if draft is not None else pm,
            pdm, pds,
            R, V, H, Vd, pm.stride(0), draft.stride(0) if draft is not None else 0,
            float(req.logit_scale), float(softcap) if softcap is not None else 1.0,
            **persistent_constexprs(v, cfg, P, head.interpret),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        amax = merge_argmax(pm, pa)
        out.argmax[r0 : r0 + R] = amax
        if out.lse is not None:
            out.lse[r0 : r0 + R] = merge_lse(pm, ps)
        if v.draft:  # one pass from the raw fp32 logits into the output dtype
            dlse = merge_lse(pdm.T, pds.T)
            torch.sub(draft, dlse.float()[:, None], out=out.draft_logprobs[r0 : r0 + R])
        if out.argmax_in_draft is not None:
            out.argmax_in_draft[r0 : r0 + R] = head.in_draft[amax]
