"""The runner contract (NeMo AutoModel's `TargetRunner`) and what both engines share.

`TargetRunner` is NeMo AutoModel's protocol
(`nemo_automodel.components.speculative.eagle.target_runner.TargetRunner`), member for member,
so a runner here drops into `RunnerEagle3TargetModel` unchanged. Everything beyond it lives on
`RunnerBase`, which both engines share:

- aux-layer validation with NeMo's rules (3 distinct ids in `[0, L)`, id i = OUTPUT of decoder
  layer i = HF `hidden_states[i + 1]`) and the capture plan (capture ids = aux ids + 1 plus
  `L` for the final pre-norm hidden; aux id `L-1` shares the final slot);
- unpadding: a right-padded `[B, S]` batch becomes one token list per row (no pad work);
- `forward_eagle3` (full fp32 logits, the drop-in) and `forward_eagle3_supervision` (only what
  the loss needs, through `eagle_fast.supervision.supervise`), both built on the engine's
  `capture`.

An engine implements `_capture(sequences) -> [(aux [T, 3H], final [T, H]), ...]` (CPU tensors in
the target dtype) and `_release()`; it calls `_init_common` from its `build`.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from eagle_fast.dtypes import parse_dtype
from eagle_fast.head import TargetHead, text_config
from eagle_fast.kernels import HeadOutput
from eagle_fast.supervision import SUPERVISION_OUTPUTS, PaddedFields, Supervision, supervise, zeros

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "RunnerBase",
    "TargetRunner",
    "capture_plan",
    "load_config_and_head",
    "resolve_dtype",
    "unpad",
    "validate_aux_layer_ids",
]

@runtime_checkable
class TargetRunner(Protocol):
    """NeMo AutoModel's engine surface, exactly (`...speculative.eagle.target_runner.TargetRunner`).

    `model` exposes `.config` (`num_hidden_layers`, `hidden_size`, `vocab_size`) and
    `.parameters()` (yields a tensor on the target's device).
    """

    model: nn.Module

    def set_aux_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Tell the underlying model which decoder layers to capture (EAGLE-3: three)."""

    def forward_eagle3(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the target once: `(logits [B, S, V], aux_hidden_states [B, S, 3H])`, unshifted."""

    def input_embedding_weight(self) -> torch.Tensor:
        """Return the target input-embedding weight `[V, H]`."""


# -- shared helpers ----------------------------------------------------------------------------
def validate_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int, count: int | None = 3) -> list[int]:
    """NeMo's rules: exactly `count` (EAGLE-3: 3) distinct integer ids in `[0, num_layers)`; `count`
    None: any number (the other draft types' captures; MTP's none). Returns them as a list."""
    try:
        ids = list(aux_layer_ids)
    except TypeError:
        raise ValueError(
            f"aux_layer_ids must be a sequence of {count or 'any number of'} ints, got {aux_layer_ids!r}"
        ) from None
    if count is not None and len(ids) != count:
        raise ValueError(
            f"EAGLE-3 expects exactly {count} aux_layer_ids, got {len(ids)}: {ids}. "
            "This must match the draft model's num_aux_hidden_states."
        )
    try:
        if any(isinstance(i, bool) for i in ids):
            raise TypeError
        ids = [operator.index(i) for i in ids]
    except TypeError:
        raise ValueError(f"aux_layer_ids must be ints, got {ids}") from None
    if len(set(ids)) != len(ids):
        raise ValueError(f"{'EAGLE-3 ' if count == 3 else ''}aux_layer_ids must be distinct, got {ids}")
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
        """Validate and record the 3 aux layers (id i = output of decoder layer i): NeMo's protocol."""
        self.set_capture_layers(aux_layer_ids, count=3)

    def set_capture_layers(self, layer_ids: Sequence[int], count: int | None = None) -> None:
        """`set_aux_layers` for any number of distinct layers (every draft type's capture from one
        prefill; MTP's none): `capture` then returns them concatenated in this order."""
        self._check_open()
        aux_layer_ids = layer_ids
        ids = validate_aux_layer_ids(aux_layer_ids, self.num_layers, count)
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

    def capture_stream(
        self, batches: Iterable[Sequence[Sequence[int]]], depth: int = 1
    ) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """`capture` over many batches, yielded in order; close the iterator when stopping early.

        An engine in a process of its own (vLLM) runs ahead: it captures the next batch while the
        caller consumes this one, with at most `depth` finished batches waiting, so it never
        waits on the caller's head or writer unless they fall `depth` batches behind. Others
        capture each batch when the caller asks for it.
        """
        self._require_aux()
        checked = (validate_sequences(b, self.max_model_len, self.head.vocab_size) for b in batches)
        return self._capture_stream(checked, depth)

    def _capture_stream(
        self, batches: Iterator[list[list[int]]], depth: int
    ) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        for sequences in batches:
            yield self._capture(sequences)

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
        aux = scatter_rows([a for a, _ in captures], lens, B, S, device)
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
        # The aux field first; then each capture is dropped as soon as it has been used, so
        # the inputs do not add to the peak next to the outputs being filled.
        aux = scatter_rows([a for a, _ in captures], lens, B, S, device)
        finals: list[torch.Tensor | None] = [f for _, f in captures]
        del captures
        into = PaddedFields(B, S, device, out_dtype)
        supervise(self.head, finals, outputs, into, draft_ids=draft_ids, k=k, out_dtype=out_dtype,
                  impl=impl)
        hidden = into.fields.pop("hidden", None)
        head = HeadOutput(**{"lse": None, "argmax": None, **into.fields})
        return Supervision(aux, attention_mask, head, hidden)

    def input_embedding_weight(self) -> torch.Tensor:
        """The target input embedding `[V, H]`, read from the checkpoint (shared with a tied head)."""
        self._check_open()
        return self.head.embed_weight()

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


def scatter_rows(rows: list[torch.Tensor], lens: list[int], B: int, S: int, device) -> torch.Tensor:
    """Rows `[n_b, D]` into one zero-padded `[B, S, D]` tensor on `device` (row b in `[b, :n_b]`)."""
    out = zeros((B, S, rows[0].shape[-1]), rows[0].dtype, device)
    for b, (row, n) in enumerate(zip(rows, lens)):
        out[b, :n] = row.to(device)
    return out
