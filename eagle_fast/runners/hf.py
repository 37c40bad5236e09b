"""`HFTargetRunner`: the same runner surface on plain transformers (reference and no-vLLM fallback).

Forward hooks on the decoder layers collect the aux layers' outputs (aux id i = output of
`layers[i]` = HF `hidden_states[i + 1]`, NeMo's convention) and the last layer's output, which
is the final hidden state BEFORE the final norm (HF's own `hidden_states[-1]` is after it).

- `forward_eagle3` returns transformers' OWN logits (the model's norm + lm_head), so it is an
  independent reference for the vLLM path and for `TargetHead`.
- `capture` / `forward_eagle3_supervision` go through the shared path: final hidden ->
  `TargetHead` (weights read from the checkpoint, as on vLLM). `capture` batches rows by a
  padded-token budget and asks the model for the last position's logits only.
Limits: single device, no tensor parallelism; right-padded batches only.
"""

from __future__ import annotations

import gc
import inspect
from typing import Any

import torch
from torch import nn

from eagle_fast.head import text_config
from eagle_fast.runners.base import RunnerBase, load_config_and_head, unpad

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
        self._extra = {
            name: False
            for name in ("use_cache", "output_hidden_states", "output_attentions")
            if name in params
        }
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        return self

    # -- forward with hooks ---------------------------------------------------------------------
    def _run(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, want_logits: bool
    ) -> tuple:
        """One forward: (logits or None, aux [B, S, 3H], final pre-norm [B, S, H]) on the model device."""
        captured: dict[int, torch.Tensor] = {}
        wanted = set(self._aux_layer_ids) | {self.num_layers - 1}

        def hook(layer_id):
            def _hook(_module, _inputs, output):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

            return _hook

        handles = [self._layers[i].register_forward_hook(hook(i)) for i in sorted(wanted)]
        try:
            extra = dict(self._extra)
            if not want_logits:
                extra.update(self._last_logits_only)
            out = self.hf_model(
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
        aux = torch.cat([captured[i] for i in self._aux_layer_ids], dim=-1)
        logits = (out.logits if hasattr(out, "logits") else out) if want_logits else None
        return logits, aux, captured[self.num_layers - 1]

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
