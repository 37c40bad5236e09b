"""The target's output head, read straight from the checkpoint: final norm + LM head (+ embeddings).

A vLLM engine keeps the target's weights in its own processes, so the supervision head cannot
borrow them. `TargetHead.from_pretrained` opens the checkpoint's safetensors (a sharded
`model.safetensors.index.json` or single files) and loads exactly the tensors the head needs:
the final-norm weight and the LM-head weight (the input embedding when the embeddings are tied),
plus, lazily and only when asked, the input embedding of an untied model. Nothing else is read:
safetensors headers are parsed and the three tensors are fetched by name.

Weight names are found by suffix, so the decoder may sit under any prefix (`model.`,
`model.language_model.` in multimodal wrappers, `language_model.model.`, ...). The norm variant,
`rms_norm_eps`, logit scale and final-logit softcap come from the HF config of a known
architecture (`_ARCH_HEADS`); for anything else the error names what is missing, and
`overrides={"norm": ..., "eps": ..., "logit_scale": ..., "softcap": ...}` supplies it.

Weights that are not finite are refused when the head is built (`check_finite`: one read).
`TargetHead.compute` runs `eagle_fast.kernels.lm_head` (fused Triton on CUDA, PyTorch
elsewhere) and returns its `HeadOutput`. Limits: RMSNorm-style final norms only (LayerNorm with
bias, e.g. Cohere or GPT-2, is rejected); no tensor-parallel sharding of the head.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle_fast.checkpoint import weight_files
from eagle_fast.errors import UserError
from eagle_fast.kernels import compiled_walk_serves, lm_head, lm_head_logits
from eagle_fast.kernels.lm_head_torch import normalize

__all__ = ["HeadSpec", "TargetHead", "check_finite", "head_spec_from_config", "text_config"]

# model_type -> (norm variant, how the logit scale is derived, softcap attribute or None).
# Every entry was checked against the transformers modeling code of the family: the final norm
# is `x * rsqrt(mean(x^2) + eps) * w` ("rms") or `... * (1 + w)` ("rms_one_plus"), followed by a
# bias-free linear head. Gemma-2/3 cap the final logits; Granite divides them by a constant.
# olmo2 / gpt_oss multiply by `w` in fp32 before rounding (others round first): identical in
# fp32, at most one ulp apart on the normalised activation in bf16.
_RMS = "rms"
_ONE_PLUS = "rms_one_plus"
_ARCH_HEADS: dict[str, tuple[str, str | None, str | None]] = {
    "llama": (_RMS, None, None),
    "llama4_text": (_RMS, None, None),
    "mistral": (_RMS, None, None),
    "mixtral": (_RMS, None, None),
    "qwen2": (_RMS, None, None),
    "qwen2_moe": (_RMS, None, None),
    # The Qwen-VL language models: plain RMSNorm heads (Qwen2_5_VLRMSNorm, Qwen3VLTextRMSNorm)
    "qwen2_vl_text": (_RMS, None, None),
    "qwen2_5_vl_text": (_RMS, None, None),
    "qwen3_vl_text": (_RMS, None, None),
    "qwen3_vl_moe_text": (_RMS, None, None),
    "qwen3": (_RMS, None, None),
    "qwen3_moe": (_RMS, None, None),
    "phi3": (_RMS, None, None),
    "deepseek_v2": (_RMS, None, None),
    "deepseek_v3": (_RMS, None, None),
    "glm4": (_RMS, None, None),
    "olmo2": (_RMS, None, None),
    "gpt_oss": (_RMS, None, None),
    "granite": (_RMS, "inv:logits_scaling", None),
    "granitemoe": (_RMS, "inv:logits_scaling", None),
    "gemma": (_ONE_PLUS, None, None),
    "gemma2": (_ONE_PLUS, None, "final_logit_softcapping"),
    "gemma3": (_ONE_PLUS, None, "final_logit_softcapping"),
    "gemma3_text": (_ONE_PLUS, None, "final_logit_softcapping"),
    # Gemma-4: a plain RMSNorm (times w in fp32, as olmo2's), unlike Gemma-1/2/3's 1 + w
    "gemma4": (_RMS, None, "final_logit_softcapping"),
    "gemma4_text": (_RMS, None, "final_logit_softcapping"),
    "qwen3_next": (_ONE_PLUS, None, None),
    "qwen3_5": (_ONE_PLUS, None, None),
    "qwen3_5_text": (_ONE_PLUS, None, None),
    "qwen3_5_moe": (_ONE_PLUS, None, None),
    "qwen3_5_moe_text": (_ONE_PLUS, None, None),
}
# Families whose head we knowingly do not support, with the reason (clearer than "unknown").
_UNSUPPORTED = {
    "cohere": "its final norm is a LayerNorm (mean-centred), not an RMSNorm",
    "cohere2": "its final norm is a LayerNorm (mean-centred), not an RMSNorm",
    "gpt2": "its final norm is a LayerNorm with bias, not an RMSNorm",
}
_EPS_KEYS = ("rms_norm_eps", "layer_norm_epsilon", "norm_eps")


@dataclass(frozen=True)
class HeadSpec:
    """What the head computes besides the GEMM: `norm`, `eps`, `logit_scale`, `softcap`."""

    norm: str
    eps: float
    logit_scale: float = 1.0
    softcap: float | None = None


def text_config(config: Any) -> Any:
    """The decoder's config: `config.get_text_config(decoder=True)` when the wrapper has one."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except TypeError:  # older transformers: no `decoder` keyword
            return get()
    return getattr(config, "text_config", None) or config


def head_family_error(config: Any) -> str | None:
    """Why the head rules of this config's family are unknown (None: known). The model type only,
    so a config read from config.json without transformers' defaults is judged right."""
    text = text_config(config)
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    if model_type in _ARCH_HEADS or getattr(config, "model_type", None) in _ARCH_HEADS:
        return None
    why = _UNSUPPORTED.get(model_type)
    archs = getattr(config, "architectures", None)
    if why is not None:
        return f"TargetHead: model_type {model_type!r} ({archs}) is not supported: {why}."
    return (f"TargetHead: unknown architecture model_type={model_type!r} ({archs}). Missing: the final "
            "norm variant ('rms' or Gemma's 'rms_one_plus'), its logit scale and final softcap. "
            f"Known: {sorted(_ARCH_HEADS)}. Pass overrides={{'norm': ..., 'eps': ..., "
            "'logit_scale': ..., 'softcap': ...}} if you know them.")


def head_spec_from_config(config: Any, overrides: Mapping[str, Any] | None = None) -> HeadSpec:
    """Derive the head's norm variant, eps, logit scale and softcap from an HF config.

    `overrides` (keys `norm`, `eps`, `logit_scale`, `softcap`) win over the config and make an
    unknown architecture usable. Raises ValueError naming what could not be determined.
    """
    overrides = dict(overrides or {})
    unknown_keys = set(overrides) - {"norm", "eps", "logit_scale", "softcap"}
    if unknown_keys:
        raise ValueError(
            f"head overrides: unknown keys {sorted(unknown_keys)}; "
            "use norm, eps, logit_scale, softcap"
        )
    text = text_config(config)
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    arch = _ARCH_HEADS.get(model_type) or _ARCH_HEADS.get(getattr(config, "model_type", None))
    if arch is None and "norm" not in overrides:
        raise ValueError(head_family_error(config))
    norm, scale_rule, softcap_key = arch if arch is not None else (overrides["norm"], None, None)

    eps = overrides.get("eps")
    if eps is None:
        for key in _EPS_KEYS:
            value = getattr(text, key, None)
            if value is None:
                value = getattr(config, key, None)
            if value is not None:
                eps = value
                break
    if eps is None:
        raise ValueError(
            f"TargetHead: the config of model_type={model_type!r} has none of {list(_EPS_KEYS)}, "
            "so the final norm's epsilon is unknown; pass overrides={'eps': ...}."
        )

    logit_scale = 1.0
    if scale_rule is not None:
        kind, key = scale_rule.split(":")
        value = getattr(text, key, None)
        if value is None:
            raise ValueError(
                f"TargetHead: model_type={model_type!r} needs config.{key} for its logit scale"
            )
        logit_scale = 1.0 / float(value) if kind == "inv" else float(value)
    softcap = getattr(text, softcap_key, None) if softcap_key else None

    spec = HeadSpec(
        norm=overrides.get("norm", norm),
        eps=float(eps),
        logit_scale=float(overrides.get("logit_scale", logit_scale)),
        softcap=overrides.get("softcap", softcap),
    )
    if spec.norm not in (_RMS, _ONE_PLUS, "none"):
        raise ValueError(f"TargetHead: norm={spec.norm!r}; use 'rms', 'rms_one_plus' or 'none'")
    return spec


def _tied_flag(config: Any) -> bool | None:
    for cfg in (config, text_config(config)):
        value = getattr(cfg, "tie_word_embeddings", None)
        if value is not None:
            return bool(value)
    return None


def read_input_embedding(model_path: str | Path) -> torch.Tensor:
    """The checkpoint's input embedding `[V, H]` in its stored dtype, on CPU (the decoder's
    `embed_tokens.weight`, chosen as `TargetHead` chooses it), without building a head."""
    model_path = Path(model_path)
    files = weight_files(model_path)
    embed, _, _ = _resolve_names(files, True, model_path)
    return _load_tensors(files, {embed}, dtype=None, device="cpu")[embed]


# Decoder prefixes in order of preference when a checkpoint holds several decoders (e.g. a
# multimodal model whose audio tower also has `embed_tokens`).
_PREFIX_ORDER = (
    "model.",
    "model.language_model.",
    "language_model.model.",
    "model.text_model.",
    "language_model.",
    "",
)


def _resolve_names(names: Iterable[str], tied: bool | None, where: Path) -> tuple[str, str, str]:
    """Pick (embed, final_norm, lm_head) tensor names; lm_head == embed when tied."""
    names = set(names)
    prefixes = sorted(
        n[: -len("embed_tokens.weight")] for n in names if n.endswith("embed_tokens.weight")
    )
    if not prefixes:
        raise ValueError(f"TargetHead: no input-embedding weight (*embed_tokens.weight) in {where}")
    with_norm = [p for p in prefixes if p + "norm.weight" in names]
    if not with_norm:
        raise ValueError(
            "TargetHead: the checkpoint has no final-norm weight: looked for "
            f"{[p + 'norm.weight' for p in prefixes]} in {where}"
        )
    ranked = [p for p in _PREFIX_ORDER if p in with_norm] + [
        p for p in with_norm if p not in _PREFIX_ORDER
    ]
    prefix = ranked[0]
    embed, norm = prefix + "embed_tokens.weight", prefix + "norm.weight"
    heads = sorted(n for n in names if n.endswith("lm_head.weight"))
    # The head belongs to the wrapper around the decoder: "lm_head.weight" for "model." and
    # "model.language_model.", "language_model.lm_head.weight" for "language_model.model.":
    # take the head whose owner is the longest prefix of the decoder's.
    owned = [h for h in heads if prefix.startswith(h[: -len("lm_head.weight")])]
    head = max(owned, key=len) if owned else (heads[0] if len(heads) == 1 else None)
    if tied is True or (tied is None and head is None):
        return embed, norm, embed
    if head is None:
        raise ValueError(
            "TargetHead: config says tie_word_embeddings=False but the checkpoint has no LM-head "
            f"weight (*lm_head.weight; candidates {sorted(heads)}) in {where}"
        )
    return embed, norm, head


class TargetHead:
    """Final norm + LM head of a target, applied by `eagle_fast.kernels.lm_head`.

    Attributes: `lm_head_weight [V, H]` and `norm_weight [H]` in the target dtype on `device`,
    `spec` (`HeadSpec`), `tied`, `vocab_size`, `hidden_size`, and the tensor names it read.
    """

    def __init__(
        self,
        lm_head_weight: torch.Tensor,
        norm_weight: torch.Tensor | None,
        spec: HeadSpec,
        *,
        embed_weight: torch.Tensor | None = None,
        tied: bool = False,
        source: dict | None = None,
    ):
        if lm_head_weight.dim() != 2:
            raise ValueError(f"lm_head_weight must be [V, H], got {tuple(lm_head_weight.shape)}")
        if spec.norm != "none" and (
            norm_weight is None or norm_weight.shape != lm_head_weight.shape[1:]
        ):
            shape = None if norm_weight is None else tuple(norm_weight.shape)
            raise ValueError(
                f"norm_weight must be [H={lm_head_weight.shape[1]}] for norm={spec.norm!r}, got {shape}"
            )
        names = (source or {}).get("lm_head", "lm_head_weight"), (source or {}).get("norm", "norm_weight")
        for name, w in zip(names, (lm_head_weight, norm_weight)):
            if w is not None:
                check_finite(name, w)
        self.lm_head_weight = lm_head_weight
        self.norm_weight = norm_weight
        self.spec = spec
        self.tied = tied
        self._embed_weight = None if tied else embed_weight  # tied: the LM head, whatever it is now
        self._source = source or {}

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model_path: str | os.PathLike,
        config: Any = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        overrides: Mapping[str, Any] | None = None,
        trust_remote_code: bool = False,
    ) -> TargetHead:
        """Load the head from a checkpoint directory, reading only the tensors it needs.

        `config` is the HF config (loaded with `AutoConfig` when None). `dtype` casts the weights
        (default: keep the checkpoint's). Raises ValueError naming a missing tensor or setting.
        """
        model_path = Path(model_path)
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(
                str(model_path), trust_remote_code=trust_remote_code
            )
        spec = head_spec_from_config(config, overrides)
        files = weight_files(model_path)
        tied_cfg = _tied_flag(config)
        embed_name, norm_name, head_name = _resolve_names(files, tied_cfg, model_path)
        tied = head_name == embed_name
        wanted = {head_name} if spec.norm == "none" else {head_name, norm_name}
        loaded = _load_tensors(files, wanted, dtype=dtype, device=device)
        source = {
            "path": str(model_path),
            "embed": embed_name,
            "norm": norm_name,
            "lm_head": head_name,
            "dtype": dtype,
            "device": device,
            "files": files,
        }
        head = cls(
            loaded[head_name],
            loaded.get(norm_name),
            spec,
            embed_weight=loaded[head_name] if tied else None,
            tied=tied,
            source=source,
        )
        cfg_vocab = getattr(text_config(config), "vocab_size", None)
        if cfg_vocab is not None and head.vocab_size < int(cfg_vocab):
            raise ValueError(
                f"TargetHead: {head_name} has {head.vocab_size} rows < config vocab_size={cfg_vocab}"
            )
        return head

    # -- properties -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.lm_head_weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head_weight.shape[1])

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    @property
    def tensor_names(self) -> dict[str, str]:
        """Checkpoint names of the tensors this head uses (`embed`, `norm`, `lm_head`)."""
        return {k: self._source[k] for k in ("embed", "norm", "lm_head") if k in self._source}

    def embed_weight(self) -> torch.Tensor:
        """Input embedding `[V, H]`: the LM head when tied, else loaded once on first use."""
        if self.tied:
            return self.lm_head_weight
        if self._embed_weight is None:
            src = self._source
            if not src:
                raise RuntimeError("TargetHead built from tensors has no checkpoint to read the embedding from")
            name = src["embed"]
            self._embed_weight = _load_tensors(src["files"], {name}, dtype=src["dtype"], device=src["device"])[name]
        return self._embed_weight

    # -- compute --------------------------------------------------------------------------------
    def compute(
        self,
        final_hidden: torch.Tensor,
        outputs: Sequence[str] = ("lse", "argmax"),
        *,
        k: int = 0,
        draft_ids: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
        impl: str = "auto",
    ):
        """Supervision from the final PRE-norm hidden state `[..., H]` -> `HeadOutput` (`[...]` lead dims).

        logits = softcap(logit_scale * (norm(final_hidden) @ lm_head_weight.T)); see
        `eagle_fast.kernels.lm_head` for each output. `final_hidden` is moved to the head's
        device and dtype; `draft_ids` to the head's device.
        """

        if draft_ids is not None:
            draft_ids = torch.as_tensor(draft_ids, dtype=torch.long).to(self.device)
        return lm_head(
            self._on_device(final_hidden),
            self.lm_head_weight,
            **self._norm_args(),
            outputs=tuple(outputs),
            k=k,
            draft_ids=draft_ids,
            out_dtype=out_dtype,
            impl=impl,
        )

    def logits(
        self,
        final_hidden: torch.Tensor,
        *,
        out: torch.Tensor | list[torch.Tensor] | None = None,
        impl: str = "auto",
    ):
        """Full-vocabulary fp32 logits `[..., V]` (what the drop-in `forward_eagle3` returns), into
        `out` (returned) when given: an fp32 `[..., V]` tensor or a list of fp32 `[n_i, V]` row
        pieces (`kernels.lm_head_logits`), on the head's device. impl="auto"/"torch" runs
        `lm_head_logits` (no reductions); "triton" the fused kernel."""
        if impl == "triton":
            logits = self.compute(final_hidden, ("logits",), impl=impl).logits
            if out is None:
                return logits
            pieces = out if isinstance(out, (list, tuple)) else [out]
            rows = logits.reshape(-1, self.vocab_size).split([p.numel() // self.vocab_size for p in pieces])
            for piece, src in zip(pieces, rows):
                piece.copy_(src.view_as(piece))
            return out
        if impl not in ("auto", "torch"):
            raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
        return lm_head_logits(
            self._on_device(final_hidden), self.lm_head_weight, **self._norm_args(), out=out
        )

    def final_norm(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The final norm alone: the post-norm hidden state `[..., H]` in the head's dtype and on its
        device, rounded as the served model rounds it (what SGLang captures as the last hidden)."""
        weight = self.norm_weight if self.spec.norm != "none" else None
        return normalize(self._on_device(final_hidden), weight, eps=self.spec.eps, norm=self.spec.norm,
                         dtype=self.dtype)

    def _on_device(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(device=self.device, dtype=self.dtype)

    def rounds_once(self, outputs: Sequence[str], k: int = 0, impl: str = "auto") -> bool:
        """Whether `compute` rounds these outputs once from fp32 and keeps no fp32 copy (the compiled CPU walk)."""
        w, spec = self.lm_head_weight, self.spec
        return impl in ("auto", "torch") and compiled_walk_serves(outputs, k, w, spec.logit_scale, spec.softcap)

    def _norm_args(self) -> dict:
        """The head's `lm_head` / `lm_head_logits` arguments besides hidden and weight."""
        return {
            "norm_weight": self.norm_weight if self.spec.norm != "none" else None,
            "eps": self.spec.eps,
            "norm": self.spec.norm,
            "logit_scale": self.spec.logit_scale,
            "softcap": self.spec.softcap,
        }

    def __repr__(self) -> str:
        return (
            f"TargetHead(V={self.vocab_size}, H={self.hidden_size}, dtype={self.dtype}, "
            f"device={self.device}, tied={self.tied}, spec={self.spec})"
        )


def check_finite(name: str, weight: torch.Tensor, rows_per_chunk: int = 1024) -> None:
    """Raise UserError naming the first row (of [V, H]; element of [H]) of `weight` holding NaN
    or inf. One read in row chunks: a row's max |x| is NaN or inf exactly when the row holds
    one, so no bool tensor the size of the weight exists; one host sync."""
    rows = weight.reshape(-1, weight.shape[-1]) if weight.dim() > 1 else weight.reshape(-1, 1)
    peak = torch.cat([c.abs().amax(dim=1) for c in rows.split(rows_per_chunk)])
    bad = ~torch.isfinite(peak)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        what = "NaN" if bool(rows[row].isnan().any()) else "inf"
        where = f"row {row}" if weight.dim() > 1 else f"element {row}"
        raise UserError(
            f"{name} {where} has {what} ({int(bad.sum())} of {rows.shape[0]} "
            f"{where.split()[0]}s are not finite): the checkpoint is corrupt",
            "re-download or re-convert the checkpoint",
        )


def _load_tensors(
    files: Mapping[str, Path], names: set, *, dtype, device
) -> dict[str, torch.Tensor]:
    """Read `names` from their safetensors files, one open per file, nothing else."""

    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(Path(files[name]), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as sf:
            for key in keys:
                t = sf.get_tensor(key)
                if dtype is not None:
                    t = t.to(dtype)
                out[key] = t.to(device).contiguous()
    return out
