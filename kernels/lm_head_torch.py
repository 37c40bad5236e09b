"""The head op in PyTorch, optimised for CPUs: tiled, MKL's bf16 GEMM, no full logits.

`lm_head_torch(req)` turns N final pre-norm hidden states into the outputs that
`HeadRequest.outputs` asks for, looping over vocabulary chunks so that full [N, V] logits
exist only when "logits" or "logprobs" were requested; `lm_head_logits_torch` writes the
logits alone. What it computes is defined by `reference.py` (semantics in its header); the
tests check this path against that reference in float64. Any device; the fallback where
Triton does not run.

Design
    Vocab chunks of C columns (`choose_chunk`), each over row blocks of R rows
    (`choose_row_block`; on CUDA R = N). Per [R, C] tile: GEMM, scale/softcap in place, then
    the running max / argmax / top-k merges (`_torch_running`), draft columns into an
    fp32 [N, Vd] buffer, and exp(tile - running max) into a float64 running sum rescaled
    whenever the max grows, only where needed: every tile for lse / logprobs / top-k, else
    the draft tiles alone (a tile costs its GEMM and one max). Draft-first order (draft
    without top-k or an [N, V] output): draft ids first, so their tiles land straight in the
    draft buffer and its logsumexp is the running one at the end of that range. topk_tail is
    summed directly over the tokens outside the top-k, never as 1 - sum(top-k), which cancels
    to noise (~k * 6e-8) when the top-k holds almost all the mass.
    GEMM precision by device: every GEMM is y @ W.T with operands in the weight dtype and
    fp32 accumulation and output, never rounded to 16 bits. CPU with bf16 weights on
    AVX512-BF16/AMX: MKL's bf16 GEMM with fp32 output (`_cpu.gemm_bf16_f32`); other CPUs and
    dtypes: an fp32 GEMM on operands upcast chunk by chunk (exact for bf16/fp16). PyTorch's
    bf16 CPU GEMM rounds its output to bf16 and oneDNN's bf16 math mode is process-global,
    so neither is used: the head changes no global state. CUDA: tensor cores with fp32
    output (`torch.mm(..., out_dtype=torch.float32)`), or the upcast chunk where that
    overload is missing.
    Compiled walk (`_native`): on AMX, ("draft", "argmax") and ("draft", "lse") with bf16
    weights go to a compiled two-pass AMX kernel (fp32 sums, reductions in cache, the draft
    log-probs rounded once); this path runs wherever it cannot (see `_native.serves`).
    Screen, then verify (`_torch_screen`): for ("draft", "argmax") with bf16 weights on
    AVX512-BF16/AMX, the columns past the draft range only decide the argmax. PyTorch's
    bf16-output GEMM (oneDNN) screens them; a proved error bound keeps only the columns that
    may reach the row's max, which are recomputed exactly (near ties: the exact walk's own
    tiles), so the result is byte-identical to the exact walk. EAGLE_FAST_CPU_SCREEN=0 (read at
    import) turns it off; `_torch_screen.switched` does so for one block.
    Bit-identity: a given call (inputs, tiles, thread count) is deterministic; MKL's fp32
    GEMM may round differently for another tile shape or thread count, by a few fp32 ulps of
    the logits, so different plans agree within the oracle's tolerance.

Limits
    Extra memory: one tile, on CPU one fp32 weight chunk, the draft buffer, and the requested
    outputs (logits/logprobs are the only [N, V]). Non-finite inputs propagate (NaN in, NaN
    out); a NaN logit ranks as +inf in the argmax and top-k, so their ids stay real ids.
    On CUDA, fp32 weights use whatever `torch.backends.cuda.matmul.allow_tf32` says.
    No autograd: the head produces supervision, not a differentiable loss.
"""

from __future__ import annotations

import math

import torch

from ._common import HeadOutput, HeadRequest, empty_output, phase
from ._cpu import bf16_gemm_available, gemm_bf16_f32
from ._native import draft_argmax as native_draft_argmax
from ._native import serves as native_serves
from ._torch_draft import draft_log_softmax, draft_topk_outputs
from ._torch_running import RunningTopK, update_argmax
from ._torch_screen import norm_upper, screen_enabled, screen_rest, weight_norms

# CPU tiling: a [R, C] fp32 logits tile of 4 MiB (R = 1024 rows at C = 1024) and an fp32
# weight chunk [C, H] of at most 4 MiB (C = 1024 columns up to H = 1024). Time barely depends on
# the shape in this range: `python bench/bench_cpu_ops.py` ("tile-sweep") has 256 x 4096 up to
# 1024 x 4096 and the earlier [N, C] 64 MiB tiles within noise of one another. Small tiles are
# chosen for memory: the tile and the weight chunk are a call's only scratch besides its outputs.
_CPU_TILE_BYTES = 4 << 20
_CPU_WCHUNK_BYTES = 4 << 20
_CPU_CHUNK_COLS = 1024
# On CUDA the tile only has to amortise kernel launches (~20 per chunk). 128 MiB gives N=4096
# rows chunks of 8,192 columns (19 chunks for a 151,936 vocabulary), and keeps the worst case
# (tile + fp32 weight chunk when mm has no out_dtype) under a fifth of the 2.5 GB of full
# fp32 logits.
_CUDA_TILE_BYTES = 128 << 20
# Chunk widths are multiples of 256 so every chunk but the last is a whole number of GEMM
# register blocks and cache lines.
_CHUNK_ALIGN = 256


def choose_chunk(
    n_rows: int, hidden_size: int, vocab: int, k: int = 0, device_type: str = "cpu"
) -> int:
    """Vocabulary columns per chunk, a multiple of 256 in [1, vocab] (or at least k).

    CPU: C = min(_CPU_CHUNK_COLS, _CPU_WCHUNK_BYTES / (4 H)): the fp32 weight chunk [C, H] is
    upcast once per chunk and stays in cache while every row block multiplies it.
    CUDA: C = _CUDA_TILE_BYTES / (4 max(N, H)), one [N, C] tile per chunk (rows are not
    blocked there).
    C is at least k (rounded up to 256) so that merging the running top-k with one tile's
    candidates stays a sort of O(k + C) per row rather than the top-k merge dominating a small
    chunk; memory stays O(N x max(C, k)), the size of the top-k outputs.
    """
    if device_type == "cuda":
        cols = _CUDA_TILE_BYTES // (4 * max(n_rows, hidden_size, 1))
    else:
        cols = min(_CPU_CHUNK_COLS, _CPU_WCHUNK_BYTES // (4 * max(hidden_size, 1)))
    cols = max(_CHUNK_ALIGN, cols // _CHUNK_ALIGN * _CHUNK_ALIGN)
    if k > 0:
        cols = max(cols, -(-k // _CHUNK_ALIGN) * _CHUNK_ALIGN)
    return max(1, min(cols, vocab))


def choose_row_block(n_rows: int, chunk: int, device_type: str = "cpu") -> int:
    """Rows per tile: all of them on CUDA; on CPU as many as keep the fp32 [R, C] tile within
    `_CPU_TILE_BYTES` (at least 16, a multiple of 16), so every pass over it hits cache."""
    if device_type == "cuda":
        return max(1, n_rows)
    rows = _CPU_TILE_BYTES // (4 * max(chunk, 1))
    rows = max(16, rows // 16 * 16)
    return max(1, min(rows, n_rows))


# ----------------------------------------------------------------------------------------------
# Normalisation: y rounded as `reference.final_norm` defines it, with a fast "rms" branch.
# ----------------------------------------------------------------------------------------------


def normalize_fp32(
    hidden: torch.Tensor, norm_weight: torch.Tensor | None, *, eps: float, norm: str
) -> torch.Tensor:
    """The normalised activation before its rounding, fp32 [N, H].

    "rms":          (x32 * rsqrt(mean(x32^2, -1) + eps)) * norm_weight.float()
    "rms_one_plus": (x32 * rsqrt(mean(x32^2, -1) + eps)) * (1 + norm_weight.float())
    "none":         x32
    """
    x32 = hidden.float()
    if norm == "none":
        return x32
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    w32 = norm_weight.float()
    if norm == "rms_one_plus":
        w32 = 1.0 + w32
    return (x32 * r) * w32


def normalize(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor | None,
    *,
    eps: float,
    norm: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """y, the GEMM's input in `dtype` (the weight dtype), rounded as the served model rounds it.

    "rms":          y = rnd(rnd(x32 * r) * rnd(w)), r = rsqrt(mean(x32^2) + eps): transformers'
                    Llama/Qwen RMSNorm (`weight * hidden.to(dtype)`) and vLLM's rms_norm both
                    round the normalised activation, then multiply by the weight in `dtype`.
    "rms_one_plus": y = rnd(x32 * r * (1 + w32)): Gemma multiplies in fp32 and rounds once.
    "none":         y = rnd(x32).
    rnd = round to nearest-even in `dtype` (the identity for fp32).
    """
    if norm != "rms" or dtype == torch.float32:
        return normalize_fp32(hidden, norm_weight, eps=eps, norm=norm).to(dtype)
    x32 = hidden.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    xn = (x32 * r).to(dtype).float()
    return (xn * norm_weight.to(dtype).float()).to(dtype)


# ----------------------------------------------------------------------------------------------
# The chunked PyTorch path
# ----------------------------------------------------------------------------------------------

# (device type, dtype) -> whether torch.mm(..., out_dtype=torch.float32) works there; probed once.
_MM_OUT_DTYPE_OK: dict[tuple[str, torch.dtype], bool] = {}


def _mm_out_dtype_works(y: torch.Tensor) -> bool:
    """Whether this torch has a 16-bit GEMM with fp32 output (`mm(..., out_dtype=fp32)`) for y."""
    key = (y.device.type, y.dtype)
    if key not in _MM_OUT_DTYPE_OK:
        try:
            torch.mm(y[:1], y[:1].t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE_OK[key] = True
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE_OK[key] = False
    return _MM_OUT_DTYPE_OK[key]


def _mm_fp32_out(y: torch.Tensor, w_chunk: torch.Tensor) -> torch.Tensor:
    """y [N, H] @ w_chunk [C, H].T -> fp32 [N, C], fp32 accumulation (GPU path).

    16-bit y: tensor-core GEMM with fp32 output. fp32 y (fp32 weights, or a torch without
    out_dtype): fp32 GEMM on the upcast chunk, exact for 16-bit operands.
    """
    if y.dtype == torch.float32:
        return torch.mm(y, w_chunk.float().t())
    return torch.mm(y, w_chunk.t(), out_dtype=torch.float32)


def _gemm_operands(req: HeadRequest, k: int):
    """`(y, on_cpu, C, R, w_buf)`: the GEMM's left operand and the tiling of one head call.

    y is the normalised activation (`normalize`) in the weight dtype, upcast to fp32 where the
    GEMM runs on exactly-upcast operands (see "GEMM precision by device"): on CPU unless MKL's
    bf16 GEMM serves a bf16 weight, and where CUDA lacks `mm(..., out_dtype)`; C and R come
    from `choose_chunk` / `choose_row_block`; w_buf is the reused fp32 buffer for one upcast
    weight chunk (CPU with 16-bit weights on the fp32 GEMM, else None).
    """
    hidden, weight = req.hidden, req.weight
    dev = hidden.device
    N, H = hidden.shape
    with phase("norm"):
        y = normalize(hidden, req.norm_weight, eps=req.eps, norm=req.norm, dtype=weight.dtype)
        on_cpu = dev.type != "cuda"
        C = choose_chunk(N, H, req.vocab, k, dev.type)
        R = choose_row_block(N, C, dev.type)
        w_buf = None
        if on_cpu:
            if not (weight.dtype == torch.bfloat16 and bf16_gemm_available()):
                y = y.float()  # else y stays bf16 (and contiguous, as `normalize` makes it)
                if weight.dtype != torch.float32:
                    w_buf = torch.empty(C * H, dtype=torch.float32, device=dev)
        elif y.dtype != torch.float32 and not _mm_out_dtype_works(y):
            y = y.float()  # same math through exactly-upcast operands, one chunk of W at a time
    return y, on_cpu, C, R, w_buf


def _weight_chunk(weight, c0: int, c1: int, ids, w_buf, gather_buf=None):
    """`(w_chunk, w32)`: the weight rows of chunk [c0, c1) (rows `ids` when given, gathered into
    the reused `gather_buf` when there is one), and the operand the CPU GEMM takes: the chunk
    upcast into `w_buf`, or the chunk itself. Reused buffers matter: a fresh half-MiB block per
    chunk is an mmap, page faults and an munmap whenever malloc hands large blocks to mmap."""
    with phase("upcast"):
        if ids is None:
            w_chunk = weight[c0:c1]
        elif gather_buf is None:
            w_chunk = weight.index_select(0, ids)
        else:
            w_chunk = gather_buf[: ids.numel() * weight.shape[1]].view(ids.numel(), weight.shape[1])
            torch.index_select(weight, 0, ids, out=w_chunk)
        if w_buf is None:
            return w_chunk, w_chunk
        w32 = w_buf[: w_chunk.numel()].view(w_chunk.shape)
        w32.copy_(w_chunk)
        return w_chunk, w32


def _gemm_tile(req: HeadRequest, y_rows, w_chunk, w32, tile, on_cpu: bool) -> torch.Tensor:
    """Logits of one [rows, chunk] tile: GEMM (into `tile` when given), then scale and softcap
    in place. On CUDA with `tile=None` the GEMM's own output is the tile."""
    with phase("gemm"):
        if on_cpu and y_rows.dtype == torch.bfloat16:
            gemm_bf16_f32(y_rows, w_chunk, tile)
        elif on_cpu:
            torch.mm(y_rows, w32.t(), out=tile)
        elif tile is None:
            tile = _mm_fp32_out(y_rows, w_chunk)
        else:
            tile.copy_(_mm_fp32_out(y_rows, w_chunk))
        if req.logit_scale != 1.0:
            tile.mul_(req.logit_scale)
        if req.softcap is not None:
            tile.div_(req.softcap).tanh_().mul_(req.softcap)
    return tile


@torch.no_grad()
def lm_head_torch(req: HeadRequest) -> HeadOutput:
    """The head op in PyTorch, tiled over rows and vocabulary (see the module header).

    Input: a validated `HeadRequest` (hidden [N, H], weight [V, H], ...). Output: `HeadOutput`
    with N-leading fields: lse fp32 [N], argmax int64 [N], and when requested logits/logprobs
    [N, V], topk_ids int64 / topk_logprobs [N, k], topk_tail fp32 [N], draft_logprobs [N, Vd],
    argmax_in_draft bool [N]; float outputs other than lse/topk_tail are in req.out_dtype.
    Extra memory: one [R, C] tile and one weight chunk plus the requested outputs.
    """
    if req.n_rows == 0:
        return empty_output(req)
    hidden, weight = req.hidden, req.weight
    dev = hidden.device
    N = hidden.shape[0]
    V = req.vocab
    want_dtopk = req.wants("draft_topk")
    k = req.k if req.wants("topk") or want_dtopk else 0
    want_draft = req.wants("draft") or want_dtopk  # the walk's draft-first order
    keep_draft = req.wants("draft")  # the [N, Vd] draft buffer
    need_lse = req.needs_lse
    f32, f64 = torch.float32, torch.float64

    y, on_cpu, C, R, w_buf = _gemm_operands(req, k)
    if native_serves(req.outputs, k, weight, req.logit_scale, req.softcap):
        # ("draft", "argmax"[, "lse"]) on AMX: the compiled walk (`_native`), every column in one
        # pass, before any of this path's buffers or its column order exist
        with phase("gemm"):
            got = native_draft_argmax(y, weight, req.draft_ids, norm_upper(y), weight_norms(weight).max().item(),
                                      lse=need_lse, out_dtype=req.out_dtype)
        if got is not None:
            draft_logprobs, run_arg, lse = got
            pos = torch.searchsorted(req.draft_ids, run_arg).clamp_max(req.draft_ids.numel() - 1)
            return HeadOutput(lse=lse, argmax=run_arg, draft_logprobs=draft_logprobs,
                              argmax_in_draft=req.draft_ids[pos] == run_arg)
    # CPU: one reused, cache-sized tile; the weight chunk is upcast once per chunk and serves
    # every row block.
    tile_buf = torch.empty(R * C, dtype=f32, device=dev) if on_cpu else None

    # Running statistics, one entry per row.
    run_max = torch.full((N,), -math.inf, dtype=f32, device=dev)
    run_sum = torch.zeros(N, dtype=f64, device=dev)  # sum of exp(logit - run_max) outside top-k
    run_arg = torch.zeros(N, dtype=torch.int64, device=dev)
    blocks = [(r0, min(r0 + R, N)) for r0 in range(0, N, R)]
    topks = [RunningTopK(r1 - r0, k, dev, use_threshold=on_cpu) for r0, r1 in blocks] if k else None

    logits_out = logprobs32 = None
    if req.wants("logits"):
        logits_out = torch.empty(N, V, dtype=req.out_dtype, device=dev)
    if req.wants("logprobs"):
        # logprobs need the final lse, so the fp32 logits wait in a full buffer (allowed: the
        # caller asked for an [N, V] output) and are shifted in place at the end.
        logprobs32 = torch.empty(N, V, dtype=f32, device=dev)
    # The GEMM writes straight into a requested fp32 [N, V] output when there is one (the tile
    # is then that output's [R, C] window, still in cache for the reductions below).
    gemm_into = logprobs32
    if logits_out is not None and logits_out.dtype == f32:
        gemm_into = logits_out

    # Column order. Draft-first (draft wanted, no [N, V] output, no full-vocab top-k; always
    # for draft_topk): the vocabulary is walked as draft_ids, then the other ids, both
    # ascending, so the draft columns are one contiguous range whose GEMM tiles land straight
    # in the draft buffer (no gather), the draft logsumexp is the running one when that range
    # ends, and a top-k over that range (draft_topk) has draft indices for ids. Otherwise: id
    # order, and the draft columns of each chunk are gathered from its tile.
    draft_ids = req.draft_ids if want_draft else None
    draft_first = want_dtopk or (want_draft and gemm_into is None and logits_out is None and not k)
    draft_lse = None
    if want_draft:
        Vd = draft_ids.numel()
    if keep_draft:
        # Raw fp32 draft logits, filled tile by tile and shifted by their lse at the end.
        draft_buf = torch.empty(N, Vd, dtype=f32, device=dev)
    if draft_first:
        rest = torch.ones(V, dtype=torch.bool, device=dev)
        rest[draft_ids] = False
        order = torch.cat([draft_ids, rest.nonzero(as_tuple=True)[0]])
        del rest
        chunks = [(p, min(p + C, Vd)) for p in range(0, Vd, C)]
        chunks += [(p, min(p + C, V)) for p in range(Vd, V, C)]
        gather_buf = torch.empty(C * weight.shape[1], dtype=weight.dtype, device=dev)
    else:
        order = gather_buf = None
        chunks = [(c0, min(c0 + C, V)) for c0 in range(0, V, C)]
        if want_draft:
            # draft_ids[bounds[j]:bounds[j+1]] fall in chunk j; one searchsorted, one host copy.
            starts = torch.tensor([c0 for c0, _ in chunks] + [V], device=dev)
            bounds = torch.searchsorted(draft_ids, starts).tolist()

    # ("draft", "argmax") past the draft range: a bf16 screen, verified (`_torch_screen`)
    screen = draft_first and not (need_lse or k) and screen_enabled(y, req.logit_scale, req.softcap)
    for j, (c0, c1) in enumerate(chunks):
        if screen and c0 == Vd and screen_rest(weight, y, order, Vd, C, R, run_max, run_arg):
            break
        c = c1 - c0
        ids = None if order is None else order[c0:c1]
        w_chunk, w32 = _weight_chunk(weight, c0, c1, ids, w_buf, gather_buf)
        local_draft = None
        if want_draft and not draft_first and bounds[j + 1] > bounds[j]:
            a, b = bounds[j], bounds[j + 1]
            local_draft = draft_ids[a:b] - c0
        into, draft_dst = gemm_into, None
        if draft_first and c1 <= Vd and keep_draft:
            # CPU: the GEMM writes the cache-resident tile, which the passes below read, and
            # one streaming copy moves it into the draft buffer (a GEMM into the buffer's
            # strided window runs at half speed); CUDA: straight into the window
            if on_cpu:
                draft_dst = draft_buf[:, c0:c1]
            else:
                into = draft_buf[:, c0:c1]
        elif into is not None:
            into = into[:, c0:c1]
        for blk, (r0, r1) in enumerate(blocks):
            r = r1 - r0
            scratch = tile_buf[: r * c].view(r, c) if on_cpu else None
            tile = into[r0:r1] if into is not None else scratch
            tile = _gemm_tile(req, y[r0:r1], w_chunk, w32, tile, on_cpu)
            if scratch is None and into is None:
                scratch = tile  # CUDA: the GEMM's fresh output is this tile's scratch

            rmax, rsum, rarg = run_max[r0:r1], run_sum[r0:r1], run_arg[r0:r1]
            with phase("merge"):
                new_max, tile_max, ranked = update_argmax(tile, c0, rmax, rarg, on_cpu, ids)
                topk = topks[blk] if topks is not None and not (want_dtopk and c1 > Vd) else None
                if topk is not None:
                    topk.update(ranked, c0, tile_max)
                del ranked

            with phase("copy-out"):
                if logits_out is not None and logits_out is not gemm_into:
                    logits_out[r0:r1, c0:c1].copy_(tile)
                if logprobs32 is not None and logprobs32 is not gemm_into:
                    logprobs32[r0:r1, c0:c1].copy_(tile)
                if local_draft is not None:
                    draft_buf[r0:r1, a:b] = tile.index_select(1, local_draft)
                elif draft_dst is not None:
                    draft_dst[r0:r1].copy_(tile)
            if not (need_lse or (draft_first and c1 <= Vd)):
                rmax.copy_(new_max)  # nothing needs this tile's exp: its max was all
                del tile, scratch
                continue

            # This tile's mass outside the top-k candidates, relative to the new running
            # max, in the scratch tile (a tile that is an output stays intact).
            with phase("exp"):
                if scratch is None:
                    scratch = torch.empty_like(tile)
                if scratch is tile:
                    scratch.sub_(new_max[:, None])
                else:
                    torch.sub(tile, new_max[:, None], out=scratch)
                scratch.exp_()
                if topk is not None:
                    topk.zero_candidates(scratch)
                rsum.mul_(torch.exp((rmax - new_max).double())).add_(scratch.sum(dim=1))
                if topk is not None and topk.evicted is not None and topk.evicted.shape[1]:
                    rsum += torch.exp(topk.evicted.double() - new_max.double()[:, None]).sum(1)
                rmax.copy_(new_max)
            del tile, scratch  # CUDA: free this tile before the next GEMM allocates its own
        if draft_first and c1 == Vd and want_dtopk:  # the draft range is complete
            values = torch.cat([t.values for t in topks])
            draft_lse, dtopk_logprobs, dtopk_tail = draft_topk_outputs(
                run_max, run_sum, values, req.out_dtype)
        elif draft_first and c1 == Vd:  # the draft range is complete: its logsumexp
            draft_lse = (run_max.double() + torch.log(run_sum)).float()
    tile_buf = w_buf = gather_buf = None  # free the chunk buffers before the draft normalisation

    with phase("copy-out"):
        out = HeadOutput(lse=None, argmax=run_arg)
        if need_lse:
            max64 = run_max.double()
            if topks is not None:
                top_values = torch.cat([t.values for t in topks])
                total = run_sum + torch.exp(top_values.double() - max64[:, None]).sum(1)
            else:
                total = run_sum
            lse64 = max64 + torch.log(total)
            out.lse = lse64.float()
        if logits_out is not None:
            out.logits = logits_out
        if logprobs32 is not None:
            out.logprobs = logprobs32.sub_(out.lse[:, None]).to(req.out_dtype)
        if req.wants("topk"):
            out.topk_ids = torch.cat([t.ids for t in topks])
            out.topk_logprobs = (top_values.double() - lse64[:, None]).to(req.out_dtype)
            out.topk_tail = (run_sum / total).clamp_(0.0, 1.0).float()
        if want_dtopk:
            out.draft_topk_ids = torch.cat([t.ids for t in topks])
            out.draft_topk_logprobs, out.draft_topk_tail = dtopk_logprobs, dtopk_tail
        if keep_draft:
            out.draft_logprobs = draft_log_softmax(draft_buf, draft_lse, req.out_dtype, R * C)
        if want_draft:
            pos = torch.searchsorted(draft_ids, run_arg).clamp_max(Vd - 1)
            out.argmax_in_draft = draft_ids[pos] == run_arg
    return out


@torch.no_grad()
def lm_head_logits_torch(req: HeadRequest, pieces: list[torch.Tensor]) -> None:
    """Full fp32 logits only, written into `pieces`: fp32 [n_i, V] tensors (unit column stride,
    any row stride) whose rows, in order, are the N rows of `req.hidden`.

    The same logits as `lm_head_torch` (same rounding of y, same GEMM precision, same tiles),
    with no reductions: the drop-in `forward_eagle3` path, which must return full logits
    anyway. Each [R, C] tile is GEMMed straight into its piece (CUDA: one tensor-core GEMM with
    fp32 output, copied in) and scaled/capped while in cache. Pieces let one call serve rows
    that are not contiguous in the caller's buffer (`logits[b, :n_b]` of a padded [B, S, V]),
    so the weight is streamed and upcast once per call, not once per row.
    """
    if req.n_rows == 0:
        return
    y, on_cpu, C, R, w_buf = _gemm_operands(req, 0)
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + piece.shape[0])
    # CPU: each tile is GEMMed into a cached buffer and streamed out in one copy (a GEMM into
    # the logits' strided window runs at about half speed); CUDA: straight into the window.
    tile_buf = torch.empty(R * C, dtype=torch.float32, device=req.hidden.device) if on_cpu else None
    for c0 in range(0, req.vocab, C):
        c1 = min(c0 + C, req.vocab)
        w_chunk, w32 = _weight_chunk(req.weight, c0, c1, None, w_buf)
        for piece, p0 in zip(pieces, starts):
            for r0 in range(0, piece.shape[0], R):
                r1 = min(r0 + R, piece.shape[0])
                window = piece[r0:r1, c0:c1]
                tile = tile_buf[: window.numel()].view(window.shape) if on_cpu else window
                _gemm_tile(req, y[p0 + r0 : p0 + r1], w_chunk, w32, tile, on_cpu)
                if on_cpu:
                    with phase("copy-out"):
                        window.copy_(tile)
