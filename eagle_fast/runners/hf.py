"""`HFTargetRunner`: the same runner surface on plain transformers (reference and no-vLLM fallback).

Forward hooks on the decoder layers collect the aux layers' outputs (aux id i = output of
`layers[i]` = HF `hidden_states[i + 1]`, NeMo's convention) and the last layer's output, which
is the final hidden state BEFORE the final norm (HF's own `hidden_states[-1]` is after it).

- `forward_eagle3` returns transformers' OWN logits (the model's norm + lm_head), so it is an
  independent reference for the vLLM path and for `TargetHead`.
- `capture` / `forward_eagle3_supervision` go through the shared path: final hidden ->
  `TargetHead` (weights read from the checkpoint, as on vLLM). `capture` batches rows by a
  padded-token budget and runs the decoder alone (`_bare_decoder`: no LM head), or, where the
  model exposes none, asks it for the last position's logits only.
- After loading, the head borrows the model's own LM-head (and final-norm) tensors when they
  hold the same values (`_share_head_weights`), so the `[V, H]` weight is not held twice.
Limits: single device, no tensor parallelism; right-padded batches only.
"""

from __future__ import annotations

import gc
import inspect
import logging
from typing import Any

import torch
from torch import nn

from eagle_fast.head import TargetHead, text_config
from eagle_fast.runners.base import RunnerBase, load_config_and_head, unpad
from eagle_fast.runners.captures import scan_rows

logger = logging.getLogger(__name__)

__all__ = ["HFTargetRunner"]


def _decoder_layers(model) -> list:
    """Decoder layers as a list, for the layouts NeMo's HF backend supports."""

    candidates = (
        ("model", "layers"),
        ("model", "language_model", "layers"),
        ("language_model", "layers"),
        ("layers",),
        ("transformer", "h"),
    )
    for path in candidates:
        obj = model
        for attr in path:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None:
            if isinstance(obj, nn.ModuleDict):
                return [obj[str(i)] for i in range(len(obj))]
            return list(obj)
    raise ValueError(f"HFTargetRunner: cannot find the decoder layers of {type(model).__name__}")


def _same_tensor(name: str, own: torch.Tensor, theirs: torch.Tensor | None) -> bool:
    """True when `theirs` can replace `own`: same shape, dtype, device, contiguity and values."""
    if theirs is None:
        logger.debug("head %s: the model has no such tensor; keeping the head's copy", name)
        return False
    meta = (own.shape, own.dtype, own.device, own.is_contiguous())
    other = (theirs.shape, theirs.dtype, theirs.device, theirs.is_contiguous())
    if meta != other:
        logger.debug("head %s: (shape, dtype, device, contiguous) %s != model's %s; "
                     "keeping the head's copy", name, meta, other)  # fmt: skip
        return False
    # One full pass over both at build time: transformers may have changed the weight on load
    # (a conversion, a resize, remote code), and a wrong head would go unnoticed.
    if not torch.equal(own, theirs):
        logger.debug("head %s: values differ from the model's; keeping the head's copy", name)
        return False
    return True


def _share_head_weights(head: TargetHead, model: nn.Module) -> None:
    """Point `head` at the model's own LM-head and final-norm tensors where they are identical.

    The head read its weights from the checkpoint, so without this the `[V, H]` LM head (and
    the tied embedding) would be held twice. Each tensor is replaced only if `_same_tensor`
    holds; the head's copy is dropped with its last reference. Results are unchanged.
    """
    out_embed = model.get_output_embeddings()
    theirs = None if out_embed is None else getattr(out_embed, "weight", None)
    if _same_tensor("lm_head", head.lm_head_weight, theirs):
        head.lm_head_weight = theirs.detach()  # and the embedding, when tied (`embed_weight()`)
    if head.norm_weight is not None:
        try:  # the checkpoint's name is the model's parameter name unless transformers renamed it
            theirs = model.get_parameter(head.tensor_names["norm"])
        except (AttributeError, KeyError):
            theirs = None
        if _same_tensor("norm", head.norm_weight, theirs):
            head.norm_weight = theirs.detach()


def _switches_off(module: nn.Module) -> dict[str, bool]:
    """The forward switches a capture turns off (KV cache, extra outputs) that `module` takes."""
    params = inspect.signature(module.forward).parameters
    return {n: False for n in ("use_cache", "output_hidden_states", "output_attentions") if n in params}


def _bare_decoder(model: nn.Module, layers: list) -> tuple[nn.Module | None, dict]:
    """The causal LM's decoder (embeddings, layers, final norm; no LM head) and its forward's
    switches, or (None, {}) when the model does not expose one holding `layers`.

    Captures need no logits: the CausalLM's head costs a [V, H] GEMM per row even at
    `logits_to_keep=1`, and on CPU transformers runs that one-row linear as a bmm over a copy
    of the weight: most of a capture at V=151,936, H=256 (`bench/bench_pipeline.py`'s HF engine
    went from 945 to 1,331 tok/s without it).
    """
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or decoder is model or not any(m is layers[-1] for m in decoder.modules()):
        return None, {}
    return decoder, _switches_off(decoder)


class HFTargetRunner(RunnerBase):
    """transformers-backed `TargetRunner` (NeMo AutoModel protocol) with the eagle_fast extras."""

    @classmethod
    def build(
        cls,
        model_path: str,
        dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
        *,
        device: str | torch.device | None = None,
        head_overrides: dict | None = None,
        max_batch_tokens: int = 16384,
        model_kwargs: dict | None = None,
    ) -> HFTargetRunner:
        """Load the model (eval, no grad) and the head.

        dtype: default the checkpoint's. device: default CUDA when available, else CPU.
        max_batch_tokens: padded tokens per forward in `capture`. model_kwargs: extra
        `from_pretrained` arguments (e.g. `attn_implementation`).
        """
        from transformers import AutoModelForCausalLM


        config, dtype, head = load_config_and_head(
            model_path, dtype, device,
            trust_remote_code=trust_remote_code, head_overrides=head_overrides,
        )  # fmt: skip
        device = head.device
        max_len = getattr(text_config(config), "max_position_embeddings", None) or 1 << 31
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            **(model_kwargs or {}),
        )
        model = model.to(device).eval().requires_grad_(False)
        _share_head_weights(head, model)

        self = cls.__new__(cls)
        self._init_common(model_path, config, dtype, head, device, int(max_len))
        self.hf_model = model  # `self.model` stays the shim: NeMo reads the DECODER's config there
        self._layers = _decoder_layers(model)
        if len(self._layers) != self.num_layers:
            raise ValueError(
                f"found {len(self._layers)} decoder layers, config says {self.num_layers}"
            )
        self.max_batch_tokens = int(max_batch_tokens)
        params = inspect.signature(model.forward).parameters
        self._extra = _switches_off(model)
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._decoder, self._decoder_extra = _bare_decoder(model, self._layers)
        return self

    # -- forward with hooks ---------------------------------------------------------------------
    def _run(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, want_logits: bool
    ) -> tuple:
        """One forward: (logits or None, aux [B, S, n H], final pre-norm [B, S, H]) on the model device."""
        captured: dict[int, torch.Tensor] = {}
        wanted = set(self._aux_layer_ids) | {self.num_layers - 1}

        def hook(layer_id):
            def _hook(_module, _inputs, output):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

            return _hook

        handles = [self._layers[i].register_forward_hook(hook(i)) for i in sorted(wanted)]
        try:
            call, extra = self.hf_model, dict(self._extra)
            if not want_logits and self._decoder is not None:
                call, extra = self._decoder, dict(self._decoder_extra)
            elif not want_logits:
                extra.update(self._last_logits_only)
            out = call(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                **extra,
            )
        finally:
            for h in handles:
                h.remove()
        missing = wanted - set(captured)
        if missing:
            raise RuntimeError(
                f"decoder layers {sorted(missing)} produced no output in the forward"
            )
        final = captured[self.num_layers - 1]
        aux = torch.cat([captured[i] for i in self._aux_layer_ids], dim=-1) if self._aux_layer_ids \
            else final.new_empty((*final.shape[:-1], 0))  # MTP alone: the final state only
        logits = (out.logits if hasattr(out, "logits") else out) if want_logits else None
        return logits, aux, final

    @torch.no_grad()
    def forward_eagle3(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' own `(logits [B, S, V] fp32, aux [B, S, 3H])`, zero at pad positions."""
        self._require_aux()
        unpad(input_ids, attention_mask)  # same input rules as the vLLM runner
        logits, aux, _ = self._run(input_ids, attention_mask, want_logits=True)
        keep = attention_mask.to(self.device).bool().unsqueeze(-1)
        logits = logits.float().masked_fill(~keep, 0.0)
        aux = aux.masked_fill(~keep, 0)
        return logits.to(input_ids.device), aux.to(input_ids.device)

    @torch.no_grad()
    def _capture(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        results: list[Any] = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        batch: list[int] = []
        for pos, i in enumerate(order):
            batch.append(i)
            nxt = order[pos + 1] if pos + 1 < len(order) else None
            # rows are sorted by length, so the batch's padded size is (rows) x (longest so far)
            if nxt is None or (len(batch) + 1) * len(sequences[nxt]) > self.max_batch_tokens:
                self._capture_batch(sequences, batch, results)
                batch = []
        return results

    def _capture_batch(self, sequences, rows: list[int], results: list) -> None:
        S = max(len(sequences[i]) for i in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.long)
        for b, i in enumerate(rows):
            n = len(sequences[i])
            ids[b, :n] = torch.tensor(sequences[i])
            mask[b, :n] = 1
        _, aux, final = self._run(ids, mask, want_logits=False)
        for b, i in enumerate(rows):  # real tokens only: padding may hold anything
            for name, x in (("aux", aux), ("final", final)):
                bad = scan_rows(x[b, : len(sequences[i])]).first_nonfinite()
                if bad is not None:
                    raise RuntimeError(
                        f"the target produced a non-finite {name} hidden state for sequence {i} "
                        f"at [token, dim]={bad}; check the dtype (fp16 overflows on some models)"
                    )
        for b, i in enumerate(rows):
            n = len(sequences[i])
            results[i] = (aux[b, :n].to("cpu", copy=True), final[b, :n].to("cpu", copy=True))

    def input_embedding_weight(self) -> torch.Tensor:
        """The model's input embedding `[V, H]` (what NeMo's HF backend hands the draft)."""
        self._check_open()
        return self.hf_model.get_input_embeddings().weight

    def _release(self) -> None:
        self.hf_model = None
        self._layers = []
        gc.collect()
