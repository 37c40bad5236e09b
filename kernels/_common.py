"""Shared pieces of the head op: the output record and the request both implementations take.

`eagle_fast.kernels.lm_head` validates user input once, flattens leading dims to N rows, and
hands a `HeadRequest` to one implementation:
  - `lm_head_torch.lm_head_torch(req)`  (PyTorch, any device; the CPU fallback), and
  - `lm_head_triton.lm_head_triton(req)`   (the fused Triton kernel; CUDA, or the Triton interpreter
    for CPU tensors).
Both return a `HeadOutput` with 2-D / 1-D fields (N leading); the public function reshapes.
`reference.lm_head_reference` defines what both compute, and returns a `HeadOutput` too.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from dataclasses import dataclass, fields

import torch

OUTPUT_NAMES = ("logits", "logprobs", "lse", "argmax", "topk", "draft", "draft_topk")
NORM_MODES = ("rms", "rms_one_plus", "none")
# Outputs that need the full-vocabulary logsumexp (an exp of every logit): lse itself, and the
# log-probs and top-k tail that are relative to it. Requested alone, the others skip that pass.
LSE_OUTPUTS = frozenset({"lse", "logprobs", "topk"})
# HeadOutput fields returned in the request's out_dtype (lse and topk_tail stay fp32).
OUT_DTYPE_FIELDS = ("logits", "logprobs", "topk_logprobs", "draft_logprobs", "draft_topk_logprobs")


@dataclass
class HeadOutput:
    """What `lm_head` returns. Fields not requested are None; leading dims `...` follow `hidden`.

    logits, logprobs    [..., V]   out_dtype. logprobs = log_softmax over the full vocabulary.
    lse                 [...]      fp32 logsumexp over the full vocabulary. Filled when "lse",
                                   "logprobs" or "topk" is requested: only those need an exp
                                   of every logit, so "draft" / "argmax" alone never pay for it.
    argmax              [...]      int64, ties to the lower id (always filled: one max per tile).
    topk_ids            [..., k]   int64, descending probability, ties to the lower id.
    topk_logprobs       [..., k]   out_dtype, normalised over the FULL vocabulary.
    topk_tail           [...]      fp32, probability mass outside the top-k (clamped >= 0).
    draft_logprobs      [..., Vd]  out_dtype, log_softmax over the draft subset only
                                   (exp() of it is EAGLE-3's target_p).
    argmax_in_draft     [...]      bool, whether the full-vocab argmax is a draft token.
    draft_topk_ids      [..., k]   int64 indices INTO draft_ids (0..Vd-1), descending
                                   probability, ties to the lower index ("draft_topk").
    draft_topk_logprobs [..., k]   out_dtype, normalised over the draft subset (as draft_logprobs).
    draft_topk_tail     [...]      fp32, draft mass outside the draft top-k (clamped >= 0).
    """

    lse: torch.Tensor | None
    argmax: torch.Tensor
    logits: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_tail: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None
    argmax_in_draft: torch.Tensor | None = None
    draft_topk_ids: torch.Tensor | None = None
    draft_topk_logprobs: torch.Tensor | None = None
    draft_topk_tail: torch.Tensor | None = None

    def reshape(self, lead: tuple[int, ...]) -> HeadOutput:
        """Restore leading dims: each field's dim 0 (N rows) becomes `lead`."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            out[f.name] = None if t is None else t.reshape(*lead, *t.shape[1:])
        return HeadOutput(**out)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class HeadRequest:
    """A validated head call on 2-D input. Produced only by `eagle_fast.kernels.lm_head`.

    hidden       [N, H] (N may be 0), contiguous, bf16 | fp16 | fp32
    weight       [V, H] contiguous rows (stride(1) == 1)
    norm_weight  [H] or None (None iff norm == "none")
    draft_ids    int64 [Vd] strictly increasing in [0, V), same device, or None
                 (given iff "draft" or "draft_topk" is requested)
    outputs      frozenset of OUTPUT_NAMES; "argmax" is always computed, "lse" when
                 `needs_lse` (requested, or the by-product of logprobs / top-k)
    k            0 unless "topk" (1 <= k <= V) or "draft_topk" (1 <= k <= Vd) is requested;
                 never both, and "draft_topk" never with logits / logprobs
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    norm_weight: torch.Tensor | None
    eps: float
    norm: str
    logit_scale: float
    softcap: float | None
    outputs: frozenset
    k: int
    draft_ids: torch.Tensor | None
    out_dtype: torch.dtype

    @property
    def n_rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def wants(self, name: str) -> bool:
        return name in self.outputs

    @property
    def needs_lse(self) -> bool:
        """Whether the full-vocabulary logsumexp (an exp of every logit) is computed: for
        "lse" itself, and for logprobs and top-k (log-probs and tail mass are relative to it)."""
        return bool(self.outputs & LSE_OUTPUTS)


def empty_output(req: HeadRequest) -> HeadOutput:
    """Outputs for N = 0 rows: every requested field, with the right trailing shape and dtype."""
    dev, V = req.hidden.device, req.vocab
    out = HeadOutput(
        lse=torch.empty(0, dtype=torch.float32, device=dev) if req.needs_lse else None,
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
    if req.wants("draft_topk"):
        out.draft_topk_ids = torch.empty(0, req.k, dtype=torch.int64, device=dev)
        out.draft_topk_logprobs = torch.empty(0, req.k, dtype=req.out_dtype, device=dev)
        out.draft_topk_tail = torch.empty(0, dtype=torch.float32, device=dev)
        out.argmax_in_draft = torch.empty(0, dtype=torch.bool, device=dev)
    return out


# The PyTorch head's phases (lm_head_torch.py): each runs inside a `torch.profiler.record_function`
# span named "lm_head.<phase>", so a profiler attached to a call shows where its time goes
# (bench/_floor.py `phases` reads them). norm; upcast (weight chunk gather / upcast); gemm; merge
# (running argmax / top-k); exp (the logsumexp passes); copy-out (outputs written, normalised
# and rounded).
HEAD_PHASES = ("norm", "upcast", "gemm", "merge", "exp", "copy-out")
SPAN_PREFIX = "lm_head."
_NO_SPAN = contextlib.nullcontext()


def phase(name: str):
    """The span of phase `name` while a torch profiler runs, else a no-op context: opening a
    span with none attached costs as much as a small tile's work. The test reads the flag the
    profiler sets for the whole process (`torch.autograd._profiler_enabled()` answers for the
    profiling thread only, and the head runs in pool threads too). What the head computes, and
    how, never depends on it."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):  # a torch without the flag: always
        return torch.profiler.record_function(SPAN_PREFIX + name)
    return _NO_SPAN


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value):
    """`var` set to `value` for the calls made inside the block: this thread, and threads that
    run in a copy of its context (`supervision.supervise`'s head pool does)."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


class TensorMemo:
    """Values made from tensors (a weight's norm bounds, its packed draft rows), each made once
    and again after any of its tensors changes, kept for the `size` latest keys.

    Keyed by each tensor's storage (held weakly: the public head call passes a fresh `detach()`
    of the caller's tensor each time, whose storage object is the same), its view (offset,
    shape, strides, dtype) and its version counter, which every in-place change bumps and which
    detached views share. Thread-safe; two threads may make the same value once each."""

    def __init__(self, size: int):
        self._size, self._lock, self._seen = size, threading.Lock(), {}

    def get(self, tensors: tuple, make):
        key = tuple((id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
                    for t in tensors)
        versions = tuple(t._version for t in tensors)
        with self._lock:
            seen = self._seen.get(key)
        if (seen and seen[1] == versions
                and all(ref() is t.untyped_storage() for ref, t in zip(seen[0], tensors))):
            return seen[2]
        value = make()
        with self._lock:
            if len(self._seen) >= self._size and key not in self._seen:
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = (tuple(weakref.ref(t.untyped_storage()) for t in tensors), versions, value)
        return value
