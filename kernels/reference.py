"""PyTorch path of the head op: the reference semantics, the CPU fallback, and a float64 oracle.

What it does
    `lm_head_torch(req)` turns N final pre-norm hidden states into the head outputs that
    `HeadRequest.outputs` asks for, looping over vocabulary chunks so that full [N, V] logits
    exist only when "logits" or "logprobs" were requested. `lm_head_oracle(...)` computes the
    same outputs in float64 from full logits; tests use it as truth.

Semantics (both implementations follow them; this module defines them)
    x32    = hidden.float()                                       [N, H]
    r      = rsqrt(mean(x32 ** 2, -1) + eps)                       [N]    fp32
    y      = rounded to weight.dtype as the served model rounds it  [N, H]
             "rms" (Llama/Qwen, transformers and vLLM): rnd(rnd(x32 * r) * rnd(norm_weight))
             "rms_one_plus" (Gemma): rnd(x32 * r * (1 + norm_weight.float()))
             "none": rnd(x32);  rnd = round to nearest-even in weight.dtype
    logits = (y @ weight.T accumulated in fp32) * logit_scale      [N, V] fp32
             then softcap * tanh(logits / softcap) when softcap is set
    lse    = logsumexp(logits)                                     fp32
    argmax = first index of max(logits)                            int64 (ties -> lower id)
    top-k  = k largest logits, ordered by (value desc, id asc)     exact tie rule, any k in [1, V]
    topk_logprobs   = topk logits - lse
    topk_tail       = probability mass OUTSIDE the top-k           fp32, in [0, 1]
    draft_logprobs  = log_softmax(logits[:, draft_ids])            over the draft columns only
    argmax_in_draft = argmax in draft_ids

Design
    One pass over vocab chunks of C columns (`choose_chunk`). Per chunk: GEMM into a reused
    fp32 tile [N, C]; scale/softcap in place; row max/argmax merged into the running ones
    (strict `>`, so an equal later value never replaces the earlier, lower id); top-k
    candidates merged into a running [N, k] set by a stable sort; draft columns copied into
    an fp32 [N, Vd] buffer (log-softmaxed in place once, after the loop); then
    exp(tile - running max) in place and its row sum added to the running sum. The running sum
    is float64 ([N], so free) and rescaled by exp(m_old - m_new) whenever the max grows.
    Peak extra memory: the tile, on CPU the fp32 weight chunk and a bool mask of the tile, the
    draft buffer, and whatever outputs were requested (logits/logprobs are the only [N, V]).
    topk_tail is summed directly from the tokens outside the top-k (positions that become top-k
    candidates are zeroed in the exp tile; tokens later evicted from the top-k add their mass
    back), never as 1 - sum(top-k probabilities): when the top-k holds almost all the mass, that
    difference cancels to noise (~k * 6e-8 absolute), while a direct sum keeps fp32 relative
    accuracy even for a tail of 1e-12.
    GEMM precision by device: on CPU the chunk GEMM runs in fp32 on the upcast operands (bf16
    and fp16 convert to fp32 exactly, and every bf16/fp16 product is exact in fp32, so this is
    the same math as a bf16 GEMM with fp32 accumulation), because PyTorch's CPU fp32 GEMM is
    ~8x faster than its bf16 GEMM on this project's machines (175 vs 21 GFLOP/s measured on 2
    AVX2 cores). On CUDA it runs in the weight dtype on tensor cores with fp32 output
    (`torch.mm(..., out_dtype=torch.float32)`); where that overload is missing it upcasts the
    chunk to fp32 instead (slower, same result).

Limits
    Non-finite hidden or weight values propagate (NaN in, NaN out); nothing here checks them.
    On CUDA, fp32 weights use whatever `torch.backends.cuda.matmul.allow_tf32` says.
    No autograd: the head produces supervision, not a differentiable loss.
"""

from __future__ import annotations

import math

import torch

from ._common import HeadOutput, HeadRequest

# The per-chunk working set on CPU: the fp32 logits tile [N, C] and the fp32 copy of the weight
# chunk [C, H], 64 MiB each at most. Large on purpose: every elementwise op on a tile is one
# OpenMP parallel region with a barrier, ~17 per chunk, and on a shared machine each barrier
# can wait a scheduler quantum for a preempted thread. Measured (N=1024, H=1024, V=151,936,
# top-64 + 32k draft, 2 cores, load ~7 from other jobs; seed fp32 path 13.1 s): 8 / 16 / 32 /
# 64 MiB took 29.7 / 22.5 / 16.7 / 13.8 s. Alone on the machine (or single-threaded) the
# sizes are within noise of each other (2.5-2.8 s), because the epilogue is ~25 % of the
# GEMM; so the largest budget that keeps peak memory far below the naive path wins. Peak
# extra at that shape: 64 MiB tile + 64 MiB weight chunk + 16 MiB mask + the 125 MiB draft
# output ~ 0.3 GB, against ~1.8 GB for the fp32 full-logits path.
_CPU_TILE_BYTES = 64 << 20
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
    """Vocabulary columns per chunk: C = clamp(budget / (4 * max(N, H)), 256 | k) rounded to 256.

    max(N, H) bounds both the fp32 logits tile [N, C] and, on CPU, the fp32 weight chunk [C, H]
    to the tile budget. C is at least k (rounded up to 256) so that merging the running top-k
    with one chunk's candidates stays a sort of O(k + C) per row rather than the top-k merge
    dominating a small chunk; memory stays O(N x max(C, k)), the size of the top-k outputs.
    Returns a value in [1, vocab].
    """
    budget = _CUDA_TILE_BYTES if device_type == "cuda" else _CPU_TILE_BYTES
    cols = budget // (4 * max(n_rows, hidden_size, 1))
    cols = max(_CHUNK_ALIGN, cols // _CHUNK_ALIGN * _CHUNK_ALIGN)
    if k > 0:
        cols = max(cols, -(-k // _CHUNK_ALIGN) * _CHUNK_ALIGN)
    return max(1, min(cols, vocab))


# ----------------------------------------------------------------------------------------------
# Normalisation: shared by the reference, the oracle and the tests, so all round y identically.
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
# The chunked reference
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


def _empty_output(req: HeadRequest) -> HeadOutput:
    """Outputs for N = 0 rows: every requested field, with the right trailing shape and dtype."""
    dev, V = req.hidden.device, req.vocab
    out = HeadOutput(
        lse=torch.empty(0, dtype=torch.float32, device=dev),
        argmax=torch.empty(0, dtype=torch.int64, device=dev),
    )
    if req.wants("logits"):
        out.logits = torch.empty(0, V, dtype=req.out_dtype, device=dev)
    if req.wants("logprobs"):
        out.logprobs = torch.empty(0, V, dtype=req.out_dtype, device=dev)
    if req.wants("topk"):
        out.topk_ids = torch.empty(0, req.k, dtype=torch.int64, device=dev)
        out.topk_logprobs = torch.empty(0, req.k, dtype=req.out_dtype, device=dev)
        out.topk_tail = torch.empty(0, dtype=torch.float32, device=dev)
    if req.wants("draft"):
        out.draft_logprobs = torch.empty(0, req.draft_ids.numel(), dtype=req.out_dtype, device=dev)
        out.argmax_in_draft = torch.empty(0, dtype=torch.bool, device=dev)
    return out


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


class _RunningTopK:
    """Each row's k largest logits so far, ordered by (value desc, id asc), over the chunk loop.

    `update(tile, c0)` merges one chunk. It remembers which tile entries became candidates, so
    the caller can leave them out of the chunk's outside-top-k mass (`zero_candidates` on the
    exp tile), and `evicted` holds the values that fell out of the set, whose mass the caller
    adds back. Two ways to pick a chunk's candidates:
      - threshold (CPU, once the set holds k): only entries strictly above the running k-th
        value can enter (an equal one loses the tie to the lower running id). Past the first
        chunk that is ~k/j entries per row, and gathering them with one compare + nonzero beats
        torch.topk, which is slow on narrow rows (1024 x 2048 tile, k=64: 11 ms vs ~2 ms).
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

    def update(self, tile: torch.Tensor, c0: int) -> None:
        self.evicted, self._zero = None, ()
        if (
            self.use_threshold
            and self.values.shape[1] == self.k
            and self._update_above_threshold(tile, c0)
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

    def _update_above_threshold(self, tile: torch.Tensor, c0: int) -> bool:
        n = tile.shape[0]
        rows, cols = torch.nonzero(tile > self.values[:, -1:], as_tuple=True)
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


def _draft_log_softmax_(draft_buf: torch.Tensor, chunk: int) -> torch.Tensor:
    """log_softmax over dim 1 of fp32 [N, Vd], in place, through a temporary of ~one tile.

    Row blocks of about N x chunk elements bound the temporary to the tile budget; torch's
    fused log_softmax does max, sum-exp and the subtraction per row in one kernel.
    """
    n, vd = draft_buf.shape
    rows = max(1, min(n, (n * chunk) // max(vd, 1)))
    tmp = torch.empty(rows, vd, dtype=draft_buf.dtype, device=draft_buf.device)
    for r0 in range(0, n, rows):
        blk = draft_buf[r0 : r0 + rows]
        out = tmp[: blk.shape[0]]
        torch.log_softmax(blk, dim=1, out=out)
        blk.copy_(out)
    return draft_buf


@torch.no_grad()
def lm_head_torch(req: HeadRequest) -> HeadOutput:
    """The head op in PyTorch, chunked over the vocabulary (see the module header).

    Input: a validated `HeadRequest` (hidden [N, H], weight [V, H], ...). Output: `HeadOutput`
    with N-leading fields: lse fp32 [N], argmax int64 [N], and when requested logits/logprobs
    [N, V], topk_ids int64 / topk_logprobs [N, k], topk_tail fp32 [N], draft_logprobs [N, Vd],
    argmax_in_draft bool [N]; float outputs other than lse/topk_tail are in req.out_dtype.
    Extra memory: O(N x C) for the tile plus the requested outputs (C from `choose_chunk`).
    """
    if req.n_rows == 0:
        return _empty_output(req)
    hidden, weight = req.hidden, req.weight
    dev = hidden.device
    N, H = hidden.shape
    V = req.vocab
    k = req.k if req.wants("topk") else 0
    want_draft = req.wants("draft")
    f32, f64 = torch.float32, torch.float64

    y = normalize(hidden, req.norm_weight, eps=req.eps, norm=req.norm, dtype=weight.dtype)
    on_cpu = dev.type != "cuda"
    C = choose_chunk(N, H, V, k, dev.type)
    tile_buf = w_buf = None
    if on_cpu:
        # fp32 GEMM on exactly-upcast operands (see "GEMM precision by device" above), into one
        # reused tile: a fresh multi-MiB allocation per chunk would page-fault every time.
        y = y.float()
        tile_buf = torch.empty(N * C, dtype=f32, device=dev)
        w_buf = None if weight.dtype == f32 else torch.empty(C * H, dtype=f32, device=dev)
    elif y.dtype != f32 and not _mm_out_dtype_works(y):
        y = y.float()  # same math through exactly-upcast operands, one chunk of W at a time

    # Running statistics, one entry per row.
    run_max = torch.full((N,), -math.inf, dtype=f32, device=dev)
    run_sum = torch.zeros(N, dtype=f64, device=dev)  # sum of exp(logit - run_max) outside top-k
    run_arg = torch.zeros(N, dtype=torch.int64, device=dev)
    topk = _RunningTopK(N, k, dev, use_threshold=on_cpu) if k else None

    logits_out = logprobs32 = None
    if req.wants("logits"):
        logits_out = torch.empty(N, V, dtype=req.out_dtype, device=dev)
    if req.wants("logprobs"):
        # logprobs need the final lse, so the fp32 logits wait in a full buffer (allowed: the
        # caller asked for an [N, V] output) and are shifted in place at the end.
        logprobs32 = torch.empty(N, V, dtype=f32, device=dev)

    if want_draft:
        draft_ids = req.draft_ids
        Vd = draft_ids.numel()
        # Raw fp32 draft logits, filled chunk by chunk and normalised once at the end (fewer
        # ops per chunk than an online draft logsumexp; see `_draft_log_softmax_`).
        draft_buf = torch.empty(N, Vd, dtype=f32, device=dev)
        # draft_ids[bounds[j]:bounds[j+1]] fall in chunk j; one searchsorted, one host copy.
        starts = torch.arange(0, V + C, C, device=dev).clamp_max(V)
        bounds = torch.searchsorted(draft_ids, starts).tolist()

    for j, c0 in enumerate(range(0, V, C)):
        c1 = min(c0 + C, V)
        c = c1 - c0
        w_chunk = weight[c0:c1]
        if on_cpu:
            tile = tile_buf[: N * c].view(N, c)
            if w_buf is not None:
                w32 = w_buf[: c * H].view(c, H)
                w32.copy_(w_chunk)
            else:
                w32 = w_chunk
            torch.mm(y, w32.t(), out=tile)
        else:
            tile = _mm_fp32_out(y, w_chunk)
        if req.logit_scale != 1.0:
            tile.mul_(req.logit_scale)
        if req.softcap is not None:
            tile.div_(req.softcap).tanh_().mul_(req.softcap)

        # max / argmax: a strictly larger chunk max takes over, so ties keep the lower id.
        c_max, c_arg = torch.max(tile, dim=1)
        run_arg = torch.where(c_max > run_max, c_arg + c0, run_arg)
        new_max = torch.maximum(run_max, c_max)

        if logits_out is not None:
            logits_out[:, c0:c1].copy_(tile)
        if logprobs32 is not None:
            logprobs32[:, c0:c1].copy_(tile)

        if want_draft and bounds[j + 1] > bounds[j]:
            a, b = bounds[j], bounds[j + 1]
            draft_buf[:, a:b] = tile.index_select(1, draft_ids[a:b] - c0)

        if topk is not None:
            topk.update(tile, c0)

        # This chunk's mass outside the top-k candidates, relative to the new running max.
        tile.sub_(new_max[:, None]).exp_()
        if topk is not None:
            topk.zero_candidates(tile)
        run_sum = run_sum * torch.exp((run_max - new_max).double()) + tile.sum(dim=1).double()
        if topk is not None and topk.evicted is not None and topk.evicted.shape[1]:
            run_sum += torch.exp(topk.evicted.double() - new_max.double()[:, None]).sum(1)
        run_max = new_max
        del tile  # CUDA: free this chunk's tile before the next GEMM allocates its own
    tile_buf = w_buf = None  # free the chunk buffers before the draft normalisation's temporary

    max64 = run_max.double()
    if topk is not None:
        total = run_sum + torch.exp(topk.values.double() - max64[:, None]).sum(1)
    else:
        total = run_sum
    lse64 = max64 + torch.log(total)
    out = HeadOutput(lse=lse64.float(), argmax=run_arg)
    if logits_out is not None:
        out.logits = logits_out
    if logprobs32 is not None:
        out.logprobs = logprobs32.sub_(out.lse[:, None]).to(req.out_dtype)
    if topk is not None:
        out.topk_ids = topk.ids
        out.topk_logprobs = (topk.values.double() - lse64[:, None]).to(req.out_dtype)
        out.topk_tail = (run_sum / total).clamp_(0.0, 1.0).float()
    if want_draft:
        out.draft_logprobs = _draft_log_softmax_(draft_buf, C).to(req.out_dtype)
        pos = torch.searchsorted(draft_ids, run_arg).clamp_max(Vd - 1)
        out.argmax_in_draft = draft_ids[pos] == run_arg
    return out


# ----------------------------------------------------------------------------------------------
# float64 oracle (tests)
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def lm_head_oracle(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    norm: str = "rms",
    logit_scale: float = 1.0,
    softcap: float | None = None,
    k: int = 0,
    draft_ids: torch.Tensor | None = None,
    row_block: int = 1024,
    **_ignored,
) -> HeadOutput:
    """Truth for tests: every output from full float64 logits, after the SAME rounding of y.

    Takes `lm_head`'s arguments (outputs / out_dtype / impl are accepted and ignored: it
    computes logits, logprobs, lse, argmax, plus top-k when k > 0 and draft outputs when
    draft_ids is given). hidden [..., H]; fields keep the leading dims. Float fields are float64,
    ids int64; topk_tail is summed directly over the non-top-k tokens. Rows are processed in
    blocks of `row_block` to bound memory ([row_block, V] float64 plus a stable sort of it).
    """
    lead = hidden.shape[:-1]
    x = hidden.reshape(-1, hidden.shape[-1])
    w64 = weight.double()
    parts = []
    for r0 in range(0, max(x.shape[0], 1), row_block):
        xb = x[r0 : r0 + row_block]
        y = normalize(xb, norm_weight, eps=eps, norm=norm, dtype=weight.dtype)
        logits = (y.double() @ w64.t()) * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        lse = torch.logsumexp(logits, dim=-1)
        logprobs = logits - lse[:, None]
        # stable descending sort = the exact tie rule (equal values keep ascending id order)
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        part = HeadOutput(lse=lse, argmax=order[:, 0], logits=logits, logprobs=logprobs)
        if k:
            part.topk_ids = order[:, :k]
            part.topk_logprobs = torch.gather(logprobs, 1, part.topk_ids)
            part.topk_tail = torch.gather(logprobs, 1, order[:, k:]).exp().sum(-1)
        if draft_ids is not None:
            part.draft_logprobs = torch.log_softmax(logits[:, draft_ids], dim=-1)
            part.argmax_in_draft = torch.isin(part.argmax, draft_ids)
        parts.append(part)
    fields = {name: torch.cat([p.as_dict()[name] for p in parts]) for name in parts[0].as_dict()}
    return HeadOutput(**fields).reshape(tuple(lead))
