"""The runner contract (NeMo AutoModel's `TargetRunner`), the `Supervision` record, shared logic.

`TargetRunner` is NeMo AutoModel's protocol
(`nemo_automodel.components.speculative.eagle.target_runner.TargetRunner`), member for member,
so a runner here drops into `RunnerEagle3TargetModel` unchanged. Everything beyond it lives on
`RunnerBase`, which both engines share:

- aux-layer validation with NeMo's rules (3 distinct ids in `[0, L)`, id i = OUTPUT of decoder
  layer i = HF `hidden_states[i + 1]`) and the capture plan (capture ids = aux ids + 1 plus
  `L` for the final pre-norm hidden; aux id `L-1` shares the final slot);
- unpadding: a right-padded `[B, S]` batch becomes one token list per row (no pad work);
- `forward_eagle3` (full fp32 logits, the drop-in) and `forward_eagle3_supervision` (only what
  the loss needs, through `TargetHead.compute`), both built on the engine's `capture`.

An engine implements `_capture(sequences) -> [(aux [T, 3H], final [T, H]), ...]` (CPU tensors in
the target dtype) and `_release()`; it calls `_init_common` from its `build`.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from eagle_fast.dtypes import NUMPY_TWINS, parse_dtype
from eagle_fast.kernels._common import OUT_DTYPE_FIELDS

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from eagle_fast.head import TargetHead

logger = logging.getLogger(__name__)

__all__ = [
    "HEAD_OUTPUTS",
    "RunnerBase",
    "Supervision",
    "TargetRunner",
    "capture_plan",
    "load_config_and_head",
    "plan_supervision_groups",
    "resolve_dtype",
    "unpad",
    "validate_aux_layer_ids",
    "zeros",
]

# Head outputs `lm_head` knows, plus "hidden" (the final pre-norm hidden state itself).
HEAD_OUTPUTS = ("logits", "logprobs", "lse", "argmax", "topk", "draft")
SUPERVISION_OUTPUTS = HEAD_OUTPUTS + ("hidden",)
# Head calls in `forward_eagle3_supervision` (see `plan_supervision_groups`): a call's results
# are staged while they are copied into the [B, S, ...] fields, and the groups are sized so the
# staging never adds more than _SUPERVISION_STAGING_BYTES to what the filled fields will hold.
# Each call also streams and upcasts the whole weight, a fixed cost per call (tens of ms at
# V=151,936 on this project's CPU: `bench/bench_cpu_ops.py`, "call-overhead"), so groups are as
# large as that allows, up to _SUPERVISION_GROUP_TOKENS, and never smaller than
# _SUPERVISION_MIN_TOKENS.
_SUPERVISION_STAGING_BYTES = 16 << 20
_SUPERVISION_GROUP_TOKENS = 8192
_SUPERVISION_MIN_TOKENS = 16


@runtime_checkable
class TargetRunner(Protocol):
    """NeMo AutoModel's engine surface, exactly (`...speculative.eagle.target_runner.TargetRunner`).

    `model` exposes `.config` (`num_hidden_layers`, `hidden_size`, `vocab_size`) and
    `.parameters()` (yields a tensor on the target's device).
    """

    model: nn.Module

    def set_aux_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Tell the underlying model which 3 decoder layers to capture."""

    def forward_eagle3(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the target once: `(logits [B, S, V], aux_hidden_states [B, S, 3H])`, unshifted."""

    def input_embedding_weight(self) -> torch.Tensor:
        """Return the target input-embedding weight `[V, H]`."""


@dataclass
class Supervision:
    """What `forward_eagle3_supervision` returns: aux hidden states plus the requested head outputs.

    Shapes are `[B, S, ...]`, unshifted (position t describes the distribution after token t).
    Pad positions (attention_mask == 0) are zero (False for bools) in every field.

    aux_hidden_states  [B, S, 3H]  target dtype, the three aux layers concatenated
    attention_mask     [B, S]      as given
    lse, argmax        [B, S]      fp32 / int64, always filled
    logits, logprobs   [B, S, V]   out_dtype (default: the target dtype), only when requested
    topk_ids           [B, S, k]   int64;  topk_logprobs [B, S, k] out_dtype;  topk_tail [B, S] fp32
    draft_logprobs     [B, S, Vd]  out_dtype, log_softmax over the draft ids (exp() = EAGLE-3's target_p)
    argmax_in_draft    [B, S]      bool, full-vocab argmax is a draft token (EAGLE-3's position mask
                                   before the loss mask)
    hidden             [B, S, H]   target dtype, final hidden BEFORE the final norm, when requested
    """

    aux_hidden_states: torch.Tensor
    attention_mask: torch.Tensor
    lse: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_tail: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None
    argmax_in_draft: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The filled fields by name."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def target_probs(self) -> torch.Tensor:
        """EAGLE-3's `target_p` over the draft vocabulary, fp32 `[B, S, Vd]`, UNSHIFTED."""
        if self.draft_logprobs is None:
            raise ValueError("target_probs needs outputs=('draft',) and draft_ids")
        return self.draft_logprobs.float().exp() * self.attention_mask.unsqueeze(-1).to(
            torch.float32
        )

    def to_nemo_batch(self, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """NeMo AutoModel's precomputed-supervision `Eagle3TargetBatch` (draft vocab only).

        Same shift as NeMo's `generate_batch` + `_compute_target_distribution`: `target_probs`,
        `position_mask` (argmax in draft AND loss mask), `input_ids` and `loss_mask` are shifted
        left by one with a zero tail; `aux_hidden_states` and `attention_mask` stay aligned.
        Needs `outputs` to include "draft". Imports nemo_automodel lazily.
        """
        from nemo_automodel.components.speculative.eagle.target import Eagle3TargetBatch

        if self.argmax_in_draft is None:
            raise ValueError("to_nemo_batch needs outputs=('draft',) and draft_ids")
        probs = self.target_probs()
        position_mask = (
            _shift_left(self.argmax_in_draft) & _shift_left(loss_mask.to(probs.device)).bool()
        )
        return Eagle3TargetBatch(
            aux_hidden_states=self.aux_hidden_states,
            input_ids=_shift_left(input_ids),
            attention_mask=self.attention_mask,
            loss_mask=_shift_left(loss_mask),
            target_probs=_shift_left(probs),
            position_mask=position_mask.unsqueeze(-1),
        )


def _shift_left(t: torch.Tensor) -> torch.Tensor:
    return torch.cat((t[:, 1:], torch.zeros_like(t[:, :1])), dim=1)


# -- shared helpers ----------------------------------------------------------------------------
def validate_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """NeMo's rules: exactly 3 distinct integer ids in `[0, num_layers)`. Returns them as a list."""
    try:
        ids = list(aux_layer_ids)
    except TypeError:
        raise ValueError(
            f"aux_layer_ids must be a sequence of 3 ints, got {aux_layer_ids!r}"
        ) from None
    if len(ids) != 3:
        raise ValueError(
            f"EAGLE-3 expects exactly 3 aux_layer_ids, got {len(ids)}: {ids}. "
            "This must match the draft model's num_aux_hidden_states."
        )
    try:
        if any(isinstance(i, bool) for i in ids):
            raise TypeError
        ids = [operator.index(i) for i in ids]
    except TypeError:
        raise ValueError(f"aux_layer_ids must be ints, got {ids}") from None
    if len(set(ids)) != 3:
        raise ValueError(f"EAGLE-3 aux_layer_ids must be distinct, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {bad} are out of range for a target with num_hidden_layers={num_layers} "
            f"(valid: 0..{num_layers - 1}; id i is the OUTPUT of decoder layer i)"
        )
    return ids


def capture_plan(aux_layer_ids: Sequence[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """`(capture_ids, aux_slots, final_slot)` for vLLM's `extract_hidden_states`.

    vLLM capture id c is the residual stream ENTERING layer c (= output of layer c-1, HF
    `hidden_states[c]`), and id `num_layers` is the last layer's output before the final norm.
    So aux id i -> capture id i + 1, and the final hidden is capture id `num_layers`; aux id
    `num_layers - 1` therefore shares the final slot. vLLM returns slots in ascending id order,
    so capture ids are sorted and each aux id maps to its slot index (in the caller's order).
    """
    capture_ids = sorted({i + 1 for i in aux_layer_ids} | {num_layers})
    slot = {c: s for s, c in enumerate(capture_ids)}
    return capture_ids, [slot[i + 1] for i in aux_layer_ids], slot[num_layers]


def unpad(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[list[list[int]], list[int]]:
    """Right-padded `[B, S]` batch -> (token lists, lengths). Raises on left/inner padding or empty rows."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows (B=0)")
    ids = input_ids.detach().cpu()
    if ids.is_floating_point():
        raise ValueError(f"input_ids must be integer token ids, got {ids.dtype}")
    if attention_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        if tuple(attention_mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(ids.shape)}"
            )
        mask = attention_mask.detach().cpu().bool()
    lengths = mask.sum(dim=1)
    # right padding: the mask is ones then zeros, i.e. mask[t] == (t < length)
    expect = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    bad_rows = (mask != expect).any(dim=1).nonzero().flatten().tolist()
    if bad_rows:
        raise ValueError(
            f"attention_mask rows {bad_rows[:8]} are not right-padded (ones then zeros); "
            "left or inner padding is not supported"
        )
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty[:8]} have no tokens (attention_mask all zero)")
    lens = lengths.tolist()
    return [row[:n].tolist() for row, n in zip(ids, lens)], lens


def validate_sequences(
    sequences: Sequence[Sequence[int]], max_model_len: int, vocab_size: int
) -> list[list[int]]:
    """Check a capture request: non-empty rows of int token ids, each within the model's limits."""
    if isinstance(sequences, torch.Tensor):
        raise TypeError("capture takes a list of token-id lists (unpadded), not a tensor")
    seqs = [list(map(int, s)) for s in sequences]
    if not seqs:
        raise ValueError("capture got no sequences")
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"sequence {i} is empty")
        if len(s) > max_model_len:
            raise ValueError(f"sequence {i} has {len(s)} tokens > max_model_len={max_model_len}")
        lo, hi = min(s), max(s)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"sequence {i} has token ids outside [0, {vocab_size}): min {lo}, max {hi}"
            )
    return seqs


def resolve_dtype(config: Any, dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype the target runs in: `dtype` if given, else the checkpoint's (config `dtype` /
    `torch_dtype`), else fp32. Passed explicitly to every engine, so runners agree."""
    from eagle_fast.head import text_config

    if dtype is None:
        for cfg in (config, text_config(config)):
            dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
            if dtype is not None:
                break
    return torch.float32 if dtype is None else parse_dtype(dtype)


def load_config_and_head(
    model_path, dtype, device, *, trust_remote_code: bool = False, head_overrides=None
):
    """What every runner's `build` starts with: `(config, dtype, head)`.

    The HF config, the dtype the target runs in (`resolve_dtype`), and the `TargetHead` read
    from the checkpoint onto `device` (default: CUDA when available, else CPU).
    """
    from transformers import AutoConfig

    from eagle_fast.head import TargetHead

    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    dtype = resolve_dtype(config, dtype)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    head = TargetHead.from_pretrained(
        model_path, config, dtype=dtype, device=torch.device(device), overrides=head_overrides
    )
    return config, dtype, head


class _ModelShim:
    """`.config` + `.parameters()` for NeMo: the config and a device marker, no weights."""

    def __init__(self, config: Any, device: torch.device):
        self.config = config
        self._marker = torch.empty(0, device=device)

    def parameters(self):
        yield self._marker


# -- the shared runner -------------------------------------------------------------------------
class RunnerBase:
    """Everything both runners share; engines implement `_capture` and `_release`.

    Public attributes after `build`: `config` (HF config), `text_config` (the decoder's),
    `model` (NeMo's `.config` + `.parameters()` surface; its config is the decoder's),
    `head` (`TargetHead`), `dtype`, `max_model_len`, `num_layers`, `hidden_size`,
    `aux_layer_ids` (after `set_aux_layers`).
    """

    config: Any
    text_config: Any
    model: Any
    head: TargetHead
    dtype: torch.dtype
    max_model_len: int
    num_layers: int
    hidden_size: int

    def _init_common(
        self,
        model_path: str,
        config: Any,
        dtype: torch.dtype,
        head: TargetHead,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        from eagle_fast.head import text_config

        self.model_path = str(model_path)
        self.config = config
        self.text_config = text_config(config)
        self.dtype = dtype
        self.head = head
        self.device = torch.device(device)
        self.max_model_len = int(max_model_len)
        self.num_layers = int(self.text_config.num_hidden_layers)
        self.hidden_size = int(self.text_config.hidden_size)
        if head.hidden_size != self.hidden_size:
            raise ValueError(
                f"LM head hidden size {head.hidden_size} != config hidden_size {self.hidden_size}"
            )
        self.model = _ModelShim(self.text_config, self.device)
        self._aux_layer_ids: list[int] | None = None
        self._aux_slots: list[int] | None = None
        self._final_slot: int | None = None
        self._closed = False

    # -- aux layers -----------------------------------------------------------------------------
    @property
    def aux_layer_ids(self) -> list[int] | None:
        return None if self._aux_layer_ids is None else list(self._aux_layer_ids)

    def set_aux_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Validate and record the 3 aux layers (id i = output of decoder layer i)."""
        self._check_open()
        ids = validate_aux_layer_ids(aux_layer_ids, self.num_layers)
        _, aux_slots, final_slot = capture_plan(ids, self.num_layers)
        try:
            self._on_aux_layers(ids)
        except BaseException:
            self._aux_layer_ids = self._aux_slots = self._final_slot = (
                None  # no engine serves them now
            )
            raise
        self._aux_layer_ids, self._aux_slots, self._final_slot = ids, aux_slots, final_slot

    def _on_aux_layers(self, aux_layer_ids: list[int]) -> None:
        """Engine hook, called before the ids are recorded (on failure no ids are recorded)."""

    def _require_aux(self) -> None:
        self._check_open()
        if self._aux_layer_ids is None:
            raise RuntimeError(
                "call set_aux_layers([...]) before capturing: it picks the layers to capture"
            )

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError(f"{type(self).__name__} is closed")

    # -- capture --------------------------------------------------------------------------------
    def capture(
        self, sequences: Sequence[Sequence[int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One engine call over unpadded token lists -> `[(aux [T, 3H], final [T, H]), ...]`.

        CPU tensors in the target dtype; `final` is the last decoder layer's output BEFORE the
        final norm; `aux` concatenates the aux layers' outputs in `aux_layer_ids` order.
        """
        self._require_aux()
        seqs = validate_sequences(sequences, self.max_model_len, self.head.vocab_size)
        return self._capture(seqs)

    def _capture(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    # -- NeMo surface ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward_eagle3(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits [B, S, V] fp32, aux [B, S, 3H] target dtype)`, unshifted, zero at pad positions.

        Rows must be right-padded; only each row's `attention_mask` tokens are run.
        """
        self._require_aux()
        seqs, lens = unpad(input_ids, attention_mask)
        captures = self.capture(seqs)
        B, S = input_ids.shape
        device = input_ids.device
        aux = self._scatter_rows([a for a, _ in captures], lens, B, S, device)
        # Each row's logits are GEMMed straight into its slice of the output: no [N, V]
        # transient, no copy, and pad positions are never touched (they stay zero).
        # One head call: the weight is streamed once for all rows, not once per row.
        head_device = self.head.device
        logits = zeros((B, S, self.head.vocab_size), torch.float32, head_device)
        finals = torch.cat([f for _, f in captures]) if len(captures) > 1 else captures[0][1]
        self.head.logits(finals, out=[logits[b, :n] for b, n in enumerate(lens)])
        logits = logits.to(device)  # a no-op unless the caller's device differs from the head's
        return logits, aux

    @torch.no_grad()
    def forward_eagle3_supervision(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        outputs: Sequence[str] = ("draft",),
        draft_ids: torch.Tensor | None = None,
        k: int = 0,
        out_dtype: torch.dtype | None = None,
        impl: str = "auto",
    ) -> Supervision:
        """The fast path: aux hidden states plus only the head outputs the loss needs.

        `outputs` is any of "logits", "logprobs", "lse", "argmax", "topk" (with `k`), "draft"
        (with `draft_ids`, strictly increasing target ids), "hidden". Only non-pad tokens go
        through the head; pad positions are zero/False. See `Supervision` for shapes.
        `out_dtype` is the dtype of the logit/log-prob fields: by default the target's own
        dtype, as transformers returns a model's logits (a bf16 target gives bf16 draft
        log-probs, half the bytes of fp32). The head computes in fp32 either way and rounds
        once; pass `torch.float32` to keep its results unrounded.
        """
        self._require_aux()
        if out_dtype is None:
            out_dtype = self.dtype
        if isinstance(outputs, str):
            outputs = (outputs,)
        outputs = tuple(outputs)
        unknown = [o for o in outputs if o not in SUPERVISION_OUTPUTS]
        if unknown:
            raise ValueError(
                f"outputs: unknown name(s) {unknown}; valid names are {SUPERVISION_OUTPUTS}"
            )
        seqs, lens = unpad(input_ids, attention_mask)
        captures = self.capture(seqs)
        B, S = input_ids.shape
        device = input_ids.device
        head_outputs = tuple(o for o in outputs if o != "hidden")
        # The aux field first; then each capture is dropped as soon as it has been used, so
        # the inputs do not add to the peak next to the outputs being filled.
        aux = self._scatter_rows([a for a, _ in captures], lens, B, S, device)
        finals: list[torch.Tensor | None] = [f for _, f in captures]
        del captures
        # Rows go through the head in groups of about _SUPERVISION_GROUP_TOKENS tokens, and each
        # group's outputs are copied into their rows of the [B, S, ...] fields: the transient is
        # one group's outputs, never all N rows' (for a 32k draft vocab in fp32, 131 MB instead
        # of 0.8 GB at B=8, S=1024), and pad rows are never written (they stay zero pages).
        # 16-bit outputs: the head returns fp32 and the copy into the fields rounds them, the
        # same single rounding as the head's own cast (fp32 -> out_dtype), so no second, 16-bit
        # transient of the group's outputs sits next to the fp32 one. Not with top-k, whose
        # log-probs the head rounds from float64 (fp32 first would round twice).
        head_dtype = out_dtype if "topk" in head_outputs else torch.float32
        staged, kept = self._supervision_bytes_per_token(
            head_outputs, "hidden" in outputs, draft_ids, k, head_dtype, out_dtype
        )
        groups = plan_supervision_groups(
            lens, staged, kept, _SUPERVISION_STAGING_BYTES,
            max_tokens=_SUPERVISION_GROUP_TOKENS, min_tokens=_SUPERVISION_MIN_TOKENS,
        )  # fmt: skip
        last_use = {b: g for g, pieces in enumerate(groups) for b, _, _ in pieces}
        fields_out: dict[str, torch.Tensor] = {}
        for g, pieces in enumerate(groups):
            parts = [finals[b][a:c] for b, a, c in pieces]
            final = torch.cat(parts) if len(parts) > 1 else parts[0]
            del parts
            for b, _, _ in pieces:
                if last_use[b] == g:
                    finals[b] = None
            head = self.head.compute(
                final, head_outputs, k=k, draft_ids=draft_ids, out_dtype=head_dtype, impl=impl
            )
            values = head.as_dict()
            if "hidden" in outputs:
                values["hidden"] = final
            start = 0
            for b, a, c in pieces:
                for name, value in values.items():
                    if name not in fields_out:
                        dtype = out_dtype if name in OUT_DTYPE_FIELDS else value.dtype
                        fields_out[name] = zeros((B, S, *value.shape[1:]), dtype, device)
                    fields_out[name][b, a:c] = value[start : start + c - a]
                start += c - a
            del head, values, final
        sup = Supervision(aux_hidden_states=aux, attention_mask=attention_mask, **fields_out)
        return sup

    def _supervision_bytes_per_token(
        self, head_outputs, with_hidden: bool, draft_ids, k: int, head_dtype, out_dtype
    ) -> tuple[int, int]:
        """(staged, kept): bytes per token of one head call's results (plus its fp32 activation)
        while they are copied, and of the [B, S, ...] fields they end up in."""
        h_el, o_el = head_dtype.itemsize, out_dtype.itemsize
        widths = {"lse": (4, 4), "argmax": (8, 8)}  # name -> (staged, kept) bytes per token
        if "logits" in head_outputs:
            widths["logits"] = (h_el * self.head.vocab_size, o_el * self.head.vocab_size)
        if "logprobs" in head_outputs:
            widths["logprobs"] = (h_el * self.head.vocab_size, o_el * self.head.vocab_size)
        if "topk" in head_outputs:
            widths["topk"] = ((8 + h_el) * k + 4, (8 + o_el) * k + 4)
        if "draft" in head_outputs and draft_ids is not None:
            widths["draft"] = (h_el * draft_ids.numel() + 1, o_el * draft_ids.numel() + 1)
        hidden_bytes = self.hidden_size * self.dtype.itemsize
        if with_hidden:
            widths["hidden"] = (0, hidden_bytes)  # the capture itself, already resident
        staged = sum(w for w, _ in widths.values()) + 4 * self.hidden_size + hidden_bytes
        kept = sum(w for _, w in widths.values())
        return staged, kept

    def input_embedding_weight(self) -> torch.Tensor:
        """The target input embedding `[V, H]`, read from the checkpoint (shared with a tied head)."""
        self._check_open()
        return self.head.embed_weight()

    @staticmethod
    def _scatter_rows(
        rows: list[torch.Tensor], lens: list[int], B: int, S: int, device
    ) -> torch.Tensor:
        out = zeros((B, S, rows[0].shape[-1]), rows[0].dtype, device)
        for b, (row, n) in enumerate(zip(rows, lens)):
            out[b, :n] = row.to(device)
        return out

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the engine and everything it holds. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._release()

    def _release(self) -> None:
        """Engine hook: free the engine (must tolerate partial construction)."""

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_LAZY_ZEROS_MIN_BYTES = 1 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """`torch.zeros(shape)`, but on CPU without writing the zeros.

    `torch.zeros` allocates and then memsets every byte: for a [8, 1024, 151936] fp32 logits
    buffer that is 5 GB written (and resident) before the head writes it again, pad rows
    included. numpy's zeros uses calloc, whose large blocks are fresh pages that the kernel
    zero-fills on first touch, so pages nobody writes (pad rows) cost nothing and never become
    resident, and the rest are written once. Small buffers and other devices use torch.zeros.
    """
    device = torch.device(device)
    numel = math.prod(int(n) for n in shape)
    twin = NUMPY_TWINS.get(dtype)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or twin is None or nbytes < _LAZY_ZEROS_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    out = torch.from_numpy(np.zeros(tuple(int(n) for n in shape), dtype=twin))
    return out.view(dtype) if out.dtype != dtype else out


def plan_supervision_groups(
    lens: Sequence[int],
    staged_per_token: int,
    kept_per_token: int,
    budget_bytes: int,
    *,
    max_tokens: int,
    min_tokens: int = 1,
) -> list[list[tuple[int, int, int]]]:
    """Head-call groups for `forward_eagle3_supervision`: lists of `(row, start, end)` token
    pieces that cover every row's `lens[row]` tokens once, in row-major order (a row may span
    groups).

    While a group of s tokens is copied into the [B, S, ...] fields, memory holds the fields
    written so far, the group's staged results (s * staged_per_token) and its new field pages.
    Sizing every group by s * staged_per_token <= budget_bytes + kept_per_token * after, where
    `after` counts the tokens of the groups that follow, keeps that sum within budget_bytes of
    the fields' final size at every step. Groups are planned from the last one backwards, so
    they shrink towards the end and the first group takes what is left; sizes are clamped to
    [min_tokens, max_tokens] (a first group smaller than the second shares its tokens).
    """
    total = int(sum(lens))
    if staged_per_token <= 0 or kept_per_token < 0 or budget_bytes < 0:
        raise ValueError("plan_supervision_groups: bytes per token and budget must be >= 0")
    if max_tokens < 1 or not 1 <= min_tokens <= max_tokens:
        raise ValueError("plan_supervision_groups: need 1 <= min_tokens <= max_tokens")
    sizes: list[int] = []
    after = 0
    while after < total:
        s = (budget_bytes + kept_per_token * after) // staged_per_token
        s = min(max(s, min_tokens), max_tokens, total - after)
        sizes.append(s)
        after += s
    sizes.reverse()
    if len(sizes) > 1 and sizes[0] < sizes[1]:
        # The first group took what was left, maybe a sliver: a whole call for it (the weight is
        # streamed per call), and tiny calls round differently (the CPU fp32 GEMM's per-row
        # result depends on the row count below ~16). Sharing the first two groups' tokens
        # evenly keeps both within the second group's bound, which the first one's exceeds.
        pair = sizes[0] + sizes[1]
        sizes[0], sizes[1] = pair - pair // 2, pair // 2
    groups: list[list[tuple[int, int, int]]] = []
    row, pos = 0, 0
    for s in sizes:
        pieces = []
        while s:
            while pos == lens[row]:
                row, pos = row + 1, 0
            take = min(s, lens[row] - pos)
            pieces.append((row, pos, pos + take))
            pos += take
            s -= take
        groups.append(pieces)
    return groups
