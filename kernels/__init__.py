"""The head op's public API: `lm_head` (validate, flatten, dispatch) and draft-vocab helpers.

What it does
    `lm_head(hidden, weight, norm_weight, ...)` turns final pre-norm hidden states [..., H] into
    EAGLE-3 supervision (lse, argmax, top-k, draft-vocab log-probs, optionally full logits /
    logprobs) through one of two implementations with the same semantics
    (`reference.py` defines them):
      impl="torch"  `lm_head_torch.lm_head_torch`: PyTorch, any device, chunked over the vocabulary;
      impl="triton" `lm_head_triton.lm_head_triton`: the fused Triton kernel (CUDA, or the Triton
                    interpreter for CPU tensors);
      impl="auto"   Triton for CUDA tensors when Triton is importable, torch otherwise.
    `lm_head_logits(...)` is the logits-only sibling (the drop-in `forward_eagle3` path): the
    same logits, no reductions, written in place into an optional `out` (PyTorch, any device).

Design
    Every argument is checked here, once, so each implementation receives a `HeadRequest` it
    can trust: 2-D contiguous hidden [N, H], weight rows with unit stride, int64 sorted
    draft_ids, k in [1, V]. Leading dims are flattened to N rows and restored on the way out.
    Bad input raises ValueError naming the argument and the shapes; nothing is silently fixed
    except layout (contiguity) and the draft id dtype (any integer dtype -> int64).

Limits
    No autograd (runs under torch.no_grad): the outputs are training targets, not a loss.
    `k` is read only when "topk" is requested and `draft_ids` only when "draft" is; both are
    ignored otherwise. `norm_weight` with norm="none" is rejected (it would be ignored, which is
    almost certainly a caller bug).
    Importing this package imports neither triton nor the kernel module and touches no CUDA.
    The kernel module is `lm_head_triton` (not `lm_head`: a submodule of the same name as the
    public function would replace it as a package attribute the first time it is imported).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import threading
import weakref
from collections.abc import Iterable

import torch

from . import lm_head_torch  # the module (a function of the same name would shadow it)
from ._common import (
    HEAD_PHASES,
    LSE_OUTPUTS,
    NORM_MODES,
    OUT_DTYPE_FIELDS,
    OUTPUT_NAMES,
    SPAN_PREFIX,
    HeadOutput,
    HeadRequest,
    empty_output,
)
from ._cpu import one_thread_here, per_thread_counts_available
from ._native import serves as compiled_walk_serves
from .lm_head_torch import lm_head_logits_torch

__all__ = ["HEAD_PHASES", "LSE_OUTPUTS", "OUTPUT_NAMES", "OUT_DTYPE_FIELDS", "SPAN_PREFIX", "HeadOutput",
           "compiled_walk_serves", "draft_ids_from_d2t", "draft_ids_from_t2d", "lm_head", "lm_head_logits", "one_thread_here",
           "per_thread_counts_available"]

IMPLS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _triton_available() -> bool:
    """Whether the triton package can be imported, checked without importing it."""
    return importlib.util.find_spec("triton") is not None


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


# Wrong types raise ValueError too (hence the TRY004 waivers): the API promises one exception
# type, naming the argument, for every bad input.
def _check_float_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} is not supported; use one of {FLOAT_DTYPES}")


def _check_real(name: str, value, *, positive: bool = False, nonnegative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")  # noqa: TRY004
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


# draft_ids tensors already checked: the range and order checks read values back to the host, a
# device synchronisation on CUDA, so a caller who passes the same tensor on every call (one
# draft vocabulary per run) pays it once. Keyed by the tensor object (held weakly) and its
# version counter, which every in-place change bumps. Heads run in threads (group-parallel).
_CHECKED_DRAFT_IDS: dict[int, tuple] = {}
_CHECKED_LOCK = threading.Lock()


def _check_draft_ids(draft_ids, vocab: int, device: torch.device, which: str = "draft") -> torch.Tensor:
    """draft_ids -> int64 [Vd], strictly increasing, within [0, vocab), on `device`."""
    if not isinstance(draft_ids, torch.Tensor):
        raise ValueError(  # noqa: TRY004
            f"outputs include {which!r} but draft_ids is "
            + (
                "missing (None)"
                if draft_ids is None
                else f"a {type(draft_ids).__name__}, not a tensor"
            )
        )
    if draft_ids.dtype == torch.bool or draft_ids.is_floating_point() or draft_ids.is_complex():
        raise ValueError(
            f"draft_ids must be an integer tensor of target ids, got dtype {draft_ids.dtype} "
            "(for a boolean t2d mask use draft_ids_from_t2d)"
        )
    if draft_ids.dim() != 1 or draft_ids.numel() == 0:
        raise ValueError(f"draft_ids must be a non-empty 1-D tensor, got shape {_shape(draft_ids)}")
    if draft_ids.device != device:
        raise ValueError(f"draft_ids is on {draft_ids.device} but hidden is on {device}")
    with _CHECKED_LOCK:
        seen = _CHECKED_DRAFT_IDS.get(id(draft_ids))
    if seen and seen[0]() is draft_ids and seen[1] == (draft_ids._version, vocab):
        return draft_ids if seen[2] is None else seen[2]
    ids = draft_ids.to(torch.int64).contiguous()
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(
            f"draft_ids must lie in [0, V={vocab}) (weight rows); got min {lo}, max {hi} "
            f"(shape {_shape(ids)})"
        )
    _check_strictly_increasing("draft_ids", ids)
    copy = None if ids is draft_ids else ids  # never a strong reference to the key itself
    with _CHECKED_LOCK:
        if len(_CHECKED_DRAFT_IDS) >= 8:
            _CHECKED_DRAFT_IDS.pop(next(iter(_CHECKED_DRAFT_IDS)))
        _CHECKED_DRAFT_IDS[id(draft_ids)] = (weakref.ref(draft_ids), (draft_ids._version, vocab), copy)
    return ids


def _check_strictly_increasing(name: str, ids: torch.Tensor) -> None:
    bad = (ids[1:] <= ids[:-1]).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        what = "duplicated" if int(ids[i]) == int(ids[i + 1]) else "unsorted"
        raise ValueError(
            f"{name} must be strictly increasing (sorted, no duplicates); {what} at position "
            f"{i}: {name}[{i}]={int(ids[i])}, {name}[{i + 1}]={int(ids[i + 1])} "
            f"(shape {_shape(ids)})"
        )


def _normalise_outputs(outputs) -> frozenset:
    if isinstance(outputs, str):
        outputs = (outputs,)
    try:
        names = list(outputs)
    except TypeError:
        raise ValueError(
            f"outputs must be a sequence of names from {OUTPUT_NAMES}, got {outputs!r}"
        ) from None
    unknown = [n for n in names if n not in OUTPUT_NAMES]
    if unknown:
        raise ValueError(f"outputs: unknown name(s) {unknown}; valid names are {OUTPUT_NAMES}")
    return frozenset(names)


def _validate(
    hidden,
    weight,
    norm_weight,
    *,
    eps,
    norm,
    logit_scale,
    softcap,
    outputs,
    k,
    draft_ids,
    out_dtype,
    impl,
) -> tuple[HeadRequest, tuple[int, ...], str]:
    """Check every argument; return the 2-D request, the leading dims, and the resolved impl."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _check_float_tensor("hidden", hidden)
    if hidden.dim() < 1:
        raise ValueError(
            f"hidden must have a trailing hidden dim [..., H], got shape {_shape(hidden)}"
        )
    _check_float_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {_shape(weight)}")
    V, H = weight.shape
    if V == 0:
        raise ValueError(f"weight has an empty vocabulary: shape {_shape(weight)}")
    if H == 0 or hidden.shape[-1] != H:
        raise ValueError(
            f"hidden size mismatch: hidden {_shape(hidden)} has H={hidden.shape[-1]}, weight "
            f"{_shape(weight)} has H={H}" + (" (H must be >= 1)" if H == 0 else "")
        )
    device = hidden.device
    if weight.device != device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {device}")

    if norm not in NORM_MODES:
        raise ValueError(f"norm must be one of {NORM_MODES}, got {norm!r}")
    if norm == "none":
        if norm_weight is not None:
            raise ValueError(
                f"norm='none' takes no norm_weight (got shape {_shape(norm_weight)}); pass "
                "norm='rms' or 'rms_one_plus' to apply it, or norm_weight=None"
            )
    else:
        if norm_weight is None:
            raise ValueError(f"norm={norm!r} needs norm_weight [H={H}], got None")
        _check_float_tensor("norm_weight", norm_weight)
        if _shape(norm_weight) != (H,):
            raise ValueError(
                f"norm_weight must have shape ({H},) to match weight {_shape(weight)}, "
                f"got {_shape(norm_weight)}"
            )
        if norm_weight.device != device:
            raise ValueError(f"norm_weight is on {norm_weight.device} but hidden is on {device}")
    eps = _check_real("eps", eps, nonnegative=True)
    logit_scale = _check_real("logit_scale", logit_scale)
    if softcap is not None:
        softcap = _check_real("softcap", softcap, positive=True)
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")

    names = _normalise_outputs(outputs)
    if "draft_topk" in names:
        clash = sorted(names & {"topk", "logits", "logprobs"})
        if clash:
            raise ValueError(
                f"outputs: 'draft_topk' cannot be combined with {clash} ('draft_topk' is the "
                "sparse draft target: one k, and no [N, V] output); make two calls"
            )
    draft = None
    if names & {"draft", "draft_topk"}:
        draft = _check_draft_ids(draft_ids, V, device, "draft" if "draft" in names else "draft_topk")
    if names & {"topk", "draft_topk"}:
        which = "topk" if "topk" in names else "draft_topk"
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise ValueError(f"k must be an int when {which!r} is requested, got {k!r}")
        k = int(k)
        top = V if which == "topk" else draft.numel()
        if not 1 <= k <= top:
            where = f"V={V}] (weight {_shape(weight)})" if which == "topk" else (
                f"Vd={top}] (the draft vocabulary)")
            raise ValueError(f"k must be in [1, {where} when {which!r} is requested, got k={k}")
    else:
        k = 0

    if impl == "triton" and not _triton_available():
        raise ValueError(
            "impl='triton' needs the triton package, which is not importable here; "
            "use impl='torch' (or 'auto', which falls back to torch)"
        )
    if impl == "auto":
        impl = "triton" if hidden.is_cuda and _triton_available() else "torch"

    lead = tuple(hidden.shape[:-1])
    req = HeadRequest(
        hidden=hidden.detach().reshape(-1, H).contiguous(),
        weight=weight.detach() if weight.stride(1) == 1 else weight.detach().contiguous(),
        norm_weight=None if norm_weight is None else norm_weight.detach().contiguous(),
        eps=eps,
        norm=norm,
        logit_scale=logit_scale,
        softcap=softcap,
        outputs=names,
        k=k,
        draft_ids=draft,
        out_dtype=out_dtype,
    )
    return req, lead, impl


def _triton_impl():
    from .lm_head_triton import lm_head_triton  # lazy: imports triton

    return lm_head_triton


@torch.no_grad()
def lm_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    norm: str = "rms",
    logit_scale: float = 1.0,
    softcap: float | None = None,
    outputs: str | Iterable[str] = ("lse", "argmax"),
    k: int = 0,
    draft_ids: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> HeadOutput:
    """Final norm + LM head + on-the-fly reductions, without full fp32 logits unless asked.

    logits = softcap * tanh(scale * (round(norm(hidden)) @ weight.T) / softcap), fp32 accumulate
    (`reference.py` defines the exact rounding points).

    Args:
        hidden: [..., H] bf16 | fp16 | fp32, the final hidden state BEFORE the final norm.
        weight: [V, H] bf16 | fp16 | fp32 LM-head weight (may be the tied input embedding).
        norm_weight: [H] final-norm weight; required for norm="rms" / "rms_one_plus", must be
            None for norm="none".
        eps: >= 0, finite. norm: "rms" (x * rsqrt(mean(x^2) + eps) * w), "rms_one_plus" (Gemma:
            ... * (1 + w)) or "none" (hidden already normalised).
        logit_scale: finite, multiplies logits before the softcap.
        softcap: None or > 0: logits = softcap * tanh(logits / softcap) (Gemma 2).
        outputs: any of "logits", "logprobs", "lse", "argmax", "topk", "draft", "draft_topk"
            ("draft_topk": the sparse draft target, the k most likely draft ids with their
            log-probs over the draft vocabulary and the draft mass outside them, with no
            [N, Vd] buffer; not with "topk", "logits" or "logprobs"). Only what is
            asked for is computed: argmax is always filled (one max per tile), lse only with
            "lse", "logprobs" or "topk", the outputs that need an exp of every logit. So
            ("draft", "argmax") pays for the GEMM, a max per tile and an exp over the draft
            columns alone.
        k: top-k size, any integer, 1 <= k <= V for "topk" and 1 <= k <= Vd for "draft_topk";
            read only for those.
        draft_ids: [Vd] strictly increasing target ids of the draft vocabulary (any integer
            dtype); read only for "draft" and "draft_topk". See `draft_ids_from_d2t` / `draft_ids_from_t2d`.
        out_dtype: bf16 | fp16 | fp32 for logits, logprobs, topk_logprobs, draft_logprobs.
        impl: "auto" | "triton" | "torch".

    Returns:
        HeadOutput with leading dims of `hidden`: argmax [...] int64 (ties -> lower id); lse
        [...] fp32 (None unless computed, see `outputs`); logits / logprobs [..., V]; topk_ids [..., k] int64 and topk_logprobs
        [..., k] ordered by (probability desc, id asc), topk_tail [...] fp32 mass outside the
        top-k; draft_logprobs [..., Vd] (log_softmax over the draft ids only) and
        argmax_in_draft [...] bool; draft_topk_ids [..., k] int64 indices into draft_ids,
        draft_topk_logprobs [..., k] and draft_topk_tail [...] fp32. Unrequested fields are None.

    Raises:
        ValueError naming the argument (and shapes) for any invalid input.
    """
    req, lead, impl = _validate(
        hidden,
        weight,
        norm_weight,
        eps=eps,
        norm=norm,
        logit_scale=logit_scale,
        softcap=softcap,
        outputs=outputs,
        k=k,
        draft_ids=draft_ids,
        out_dtype=out_dtype,
        impl=impl,
    )
    if req.n_rows == 0:
        out = empty_output(req)
    elif impl == "triton":
        out = _triton_impl()(req)
    else:
        out = lm_head_torch.lm_head_torch(req)
    return out.reshape(lead)


@torch.no_grad()
def lm_head_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    norm: str = "rms",
    logit_scale: float = 1.0,
    softcap: float | None = None,
    out: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None,
):
    """Full fp32 logits `[..., V]` and nothing else: `lm_head(..., outputs=("logits",)).logits`
    without any reduction (not even the argmax `lm_head` always runs), written in place into `out`.

    Same arguments and semantics as `lm_head` (norm, rounding of the normalised activation,
    fp32 accumulation, scale, softcap). `out`, when given, is an fp32 tensor on hidden's device
    of shape `[..., V]` holding hidden's N rows (e.g. `hidden.shape[:-1] + (V,)`), viewable as
    `[N, V]` with unit column stride, e.g. `logits[b, :n]` of a
    `[B, S, V]` buffer; it is filled and returned. `out` may also be a list of such fp32
    `[n_i, V]` pieces whose rows, in order, are hidden's N rows (e.g. `[logits[b, :n_b] for b]`):
    one call then serves rows that are not contiguous in the caller's buffer, and the weight is
    streamed once. Raises ValueError for any invalid input.
    """
    req, lead, _ = _validate(
        hidden,
        weight,
        norm_weight,
        eps=eps,
        norm=norm,
        logit_scale=logit_scale,
        softcap=softcap,
        outputs=("logits",),
        k=0,
        draft_ids=None,
        out_dtype=torch.float32,
        impl="torch",
    )
    N, V = req.n_rows, req.vocab
    if out is None:
        flat = torch.empty(N, V, dtype=torch.float32, device=req.hidden.device)
        lm_head_logits_torch(req, [flat])
        return flat.view(*lead, V)
    pieces = list(out) if isinstance(out, (list, tuple)) else [out]
    names = [f"out[{i}]" for i in range(len(pieces))] if isinstance(out, (list, tuple)) else ["out"]
    pieces = [_logits_piece(n, t, V, req.hidden.device) for n, t in zip(names, pieces)]
    rows = sum(p.shape[0] for p in pieces)
    if rows != N:
        raise ValueError(
            f"out must have shape {(*lead, V)} (or pieces [n_i, {V}] with sum n_i = N) for hidden "
            f"{_shape(hidden)} and weight {_shape(weight)}; got rows {[p.shape[0] for p in pieces]}"
        )
    lm_head_logits_torch(req, pieces)
    return out


def _logits_piece(name: str, t, V: int, device) -> torch.Tensor:
    """Check one logits destination `[..., V]`; return it viewed as fp32 [n, V] rows with unit
    column stride (the view writes through to `t`)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 (logits are fp32), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but hidden is on {device}")
    if t.dim() < 1 or t.shape[-1] != V:
        raise ValueError(f"{name} must have shape [..., V={V}], got {_shape(t)}")
    try:
        flat = t.view(-1, V)
    except RuntimeError:
        flat = None
    if flat is None or (flat.shape[0] and V > 1 and flat.stride(1) != 1):
        raise ValueError(
            f"{name} (shape {_shape(t)}, strides {t.stride()}) cannot be written as [n, V] rows "
            "with unit column stride; pass a contiguous tensor or a row slice of one"
        )
    return flat


def draft_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """Draft vocabulary as target ids from EAGLE-3 `d2t` offsets: target_id[i] = i + d2t[i].

    d2t: integer [Vd] (SpecForge / NeMo AutoModel store it so). Returns int64 [Vd] on d2t's
    device. Draft index i keeps column i (draft_logprobs[..., i] is draft token i), so the
    result must already be strictly increasing; it is validated, never re-sorted, because a
    silent sort would misalign columns and draft tokens.
    """
    if (
        not isinstance(d2t, torch.Tensor)
        or d2t.dtype == torch.bool
        or d2t.is_floating_point()
        or d2t.is_complex()
    ):
        raise ValueError(
            "d2t must be an integer tensor of offsets, got "
            f"{getattr(d2t, 'dtype', type(d2t).__name__)}"
        )
    if d2t.dim() != 1 or d2t.numel() == 0:
        raise ValueError(f"d2t must be a non-empty 1-D tensor, got shape {_shape(d2t)}")
    ids = torch.arange(d2t.numel(), device=d2t.device, dtype=torch.int64) + d2t.to(torch.int64)
    if int(ids.min()) < 0:
        raise ValueError(
            f"d2t gives negative target ids (min {int(ids.min())}); shape {_shape(d2t)}"
        )
    _check_strictly_increasing("draft ids from d2t (i + d2t[i])", ids)
    return ids


def draft_ids_from_t2d(t2d_mask: torch.Tensor) -> torch.Tensor:
    """Draft vocabulary as target ids from EAGLE-3's `t2d` mask: bool [V] -> int64 [Vd], sorted."""
    if not isinstance(t2d_mask, torch.Tensor) or t2d_mask.dtype != torch.bool:
        raise ValueError(
            "t2d_mask must be a bool tensor, got "
            f"{getattr(t2d_mask, 'dtype', type(t2d_mask).__name__)}"
        )
    if t2d_mask.dim() != 1:
        raise ValueError(f"t2d_mask must be 1-D [V], got shape {_shape(t2d_mask)}")
    ids = t2d_mask.nonzero(as_tuple=True)[0].to(torch.int64)
    if ids.numel() == 0:
        raise ValueError(f"t2d_mask selects no token (shape {_shape(t2d_mask)})")
    return ids
