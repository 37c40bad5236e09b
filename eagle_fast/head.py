"""The target's output head, read straight from the checkpoint: final norm + LM head (+ embeddings).

A vLLM engine keeps the target's weights in its own processes, so the supervision head cannot
borrow them. `TargetHead.from_pretrained` opens the checkpoint's safetensors (a sharded index or
single files) and loads exactly the tensors the head needs: the final-norm weight (and bias), the
LM-head weight (the input embedding when tied), and, lazily and only when asked, the input
embedding of an untied model.

The rules (norm formula, eps, logit scale, softcap, tying, the tensors' names) are read from the
family's own transformers modules (`head_rules.py`), `overrides` winning; names are matched by
suffix, so the decoder may sit under any prefix (`model.`, `model.language_model.`, ...). Before a
run the head is held to transformers' own logits (`check_head`, `check_checkpoint_head`: random
states through the family's real final norm and LM head), and a head that misses is refused with
the numbers. Weights that are not finite are refused when the head is built (`check_finite`).
`TargetHead.compute` runs `eagle_fast.kernels.lm_head`; a LayerNorm head (Cohere's) is normalised
here first, the kernel taking the normalised state. Limits: no LM-head bias; no tensor-parallel
sharding of the head.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle_fast.checkpoint import weight_files
from eagle_fast.errors import UserError
from eagle_fast.head_rules import (
    HeadRules,
    HeadSpec,
    family_logits,
    head_rules,
    layer_norm,
    text_config,
)
from eagle_fast.kernels import compiled_walk_serves, lm_head, lm_head_logits
from eagle_fast.kernels.lm_head_torch import normalize

__all__ = ["HeadSpec", "TargetHead", "auto_config", "check_checkpoint_head", "check_finite", "check_head",
           "text_config"]

# The check before a run: this many random pre-norm states (row sizes from 1e-3, where eps weighs, to
# 1e2), over the first CHECK_ROWS rows of the LM head, fp32 on both sides; a head within CHECK_RTOL
# of transformers' largest logit (at least 1) passes. Both fp32: they differ by op order, ~1e-6.
CHECK_STATES, CHECK_ROWS, CHECK_RTOL = 256, 2048, 1e-4
_CHECKED: set[tuple] = set()  # (checkpoint files, rules) already held to transformers in this process


def read_input_embedding(model_path: str | Path, config: Any = None) -> torch.Tensor:
    """The checkpoint's input embedding `[V, H]` in its stored dtype, on CPU (the decoder's
    `embed_tokens.weight`, chosen as `TargetHead` chooses it), without building a head."""
    model_path = Path(model_path)
    files = weight_files(model_path)
    embed, _, _ = _resolve_names(files, replace(_rules_for(model_path, config), tied=True), model_path)
    return _load_tensors(files, {embed}, dtype=None, device="cpu")[embed]


def _rules_for(model_path: Path, config: Any, overrides=None, trust_remote_code: bool = False) -> HeadRules:
    return head_rules(config if config is not None else auto_config(model_path, trust_remote_code), overrides,
                      trust_remote_code)


def auto_config(model_path: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """The checkpoint's transformers config; UserError when transformers does not know its family."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as e:
        raise UserError(f"transformers {transformers.__version__} cannot read {model_path}'s config, so the "
                        f"family's head rules cannot be read from its code: {str(e).splitlines()[0][:200]}",
                        "use a transformers that defines the family, or pass the head rules through the API "
                        "(head_overrides) with the model's own code") from None


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


def _ends(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def _resolve_names(names: Iterable[str], rules: HeadRules, where: Path) -> tuple[str, str, str]:
    """Pick (embed, final_norm, lm_head) tensor names by the family's leaf names (`rules`);
    lm_head == embed when tied."""
    names = set(names)
    embed_leaf, norm_leaf = rules.embed_name + ".weight", rules.norm_name + ".weight"
    prefixes = sorted(n[: -len(embed_leaf)] for n in names if _ends(n, embed_leaf))
    if not prefixes:
        raise ValueError(f"TargetHead: no input-embedding weight (*{embed_leaf}) in {where}")
    with_norm = [p for p in prefixes if p + norm_leaf in names]
    if not with_norm:
        raise ValueError(
            "TargetHead: the checkpoint has no final-norm weight: looked for "
            f"{[p + norm_leaf for p in prefixes]} in {where}"
        )
    ranked = [p for p in _PREFIX_ORDER if p in with_norm] + [
        p for p in with_norm if p not in _PREFIX_ORDER
    ]
    prefix = ranked[0]
    embed, norm = prefix + embed_leaf, prefix + norm_leaf
    head_leaf = rules.lm_head_name + ".weight"
    heads = sorted(n for n in names if _ends(n, head_leaf))
    # The head belongs to the wrapper around the decoder: "lm_head.weight" for "model." and
    # "model.language_model.", "language_model.lm_head.weight" for "language_model.model.":
    # take the head whose owner is the longest prefix of the decoder's.
    owned = [h for h in heads if prefix.startswith(h[: -len(head_leaf)])]
    head = max(owned, key=len) if owned else (heads[0] if len(heads) == 1 else None)
    if rules.tied is True or (rules.tied is None and head is None):
        return embed, norm, embed
    if head is None:
        raise ValueError(
            "TargetHead: config says tie_word_embeddings=False but the checkpoint has no LM-head "
            f"weight (*{head_leaf}; candidates {sorted(heads)}) in {where}"
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
        norm_bias: torch.Tensor | None = None,
        embed_weight: torch.Tensor | None = None,
        tied: bool = False,
        source: dict | None = None,
        rules: HeadRules | None = None,
    ):
        if lm_head_weight.dim() != 2:
            raise ValueError(f"lm_head_weight must be [V, H], got {tuple(lm_head_weight.shape)}")
        for what, w in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
            if (what == "norm_weight" and spec.norm != "none" or w is not None) and (
                    w is None or w.shape != lm_head_weight.shape[1:]):
                shape = None if w is None else tuple(w.shape)
                raise ValueError(f"{what} must be [H={lm_head_weight.shape[1]}] for norm={spec.norm!r}, got {shape}")
        if norm_bias is not None and spec.norm != "layernorm":
            raise ValueError(f"norm_bias is taken by norm='layernorm' only, not {spec.norm!r}")
        src = source or {}
        names = src.get("lm_head", "lm_head_weight"), src.get("norm", "norm_weight"), src.get("bias", "norm_bias")
        for name, w in zip(names, (lm_head_weight, norm_weight, norm_bias)):
            if w is not None:
                check_finite(name, w)
        self.lm_head_weight = lm_head_weight
        self.norm_weight = norm_weight
        self.norm_bias = norm_bias
        self.spec = spec
        self.rules = rules  # what the head was built from (None: from tensors)
        self.tied = tied
        self._embed_weight = None if tied else embed_weight  # tied: the LM head, whatever it is now
        self._source = src

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
        check: bool = True,
    ) -> TargetHead:
        """Load the head from a checkpoint directory, reading only the tensors it needs.

        `config` is the HF config (loaded with `AutoConfig` when None). `dtype` casts the weights
        (default: keep the checkpoint's). The rules are the family's (`head_rules`), `overrides`
        (norm, eps, logit_scale, softcap) winning; `check` holds the head to transformers' own
        logits first (`check_head`; once per checkpoint and rules in a process). Raises ValueError
        naming a missing tensor, UserError for rules that cannot be read or do not hold.
        """
        model_path = Path(model_path)
        config, rules, files, (embed_name, norm_name, head_name, bias_name) = _plan_head(
            model_path, config, overrides, trust_remote_code)
        tied = head_name == embed_name
        wanted = {head_name} | ({norm_name} if rules.spec.norm != "none" else set()) | ({bias_name} - {None})
        loaded = _load_tensors(files, wanted, dtype=dtype, device=device)
        source = {"path": str(model_path), "embed": embed_name, "norm": norm_name, "lm_head": head_name,
                  "dtype": dtype, "device": device, "files": files, **({"bias": bias_name} if bias_name else {})}
        head = cls(loaded[head_name], loaded.get(norm_name), rules.spec, norm_bias=loaded.get(bias_name),
                   embed_weight=loaded[head_name] if tied else None, tied=tied, source=source, rules=rules)
        cfg_vocab = getattr(text_config(config), "vocab_size", None)
        if cfg_vocab is not None and head.vocab_size < int(cfg_vocab):
            raise ValueError(
                f"TargetHead: {head_name} has {head.vocab_size} rows < config vocab_size={cfg_vocab}"
            )
        if check:
            check_head(head, config, _files_key(files), trust_remote_code, overridden=bool(overrides))
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
            self._kernel_input(final_hidden),
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
            self._kernel_input(final_hidden), self.lm_head_weight, **self._norm_args(), out=out
        )

    def final_norm(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The final norm alone: the post-norm hidden state `[..., H]` in the head's dtype and on its
        device, rounded as the served model rounds it (what SGLang captures as the last hidden)."""
        hidden, spec = self._on_device(final_hidden), self.spec
        if spec.norm == "layernorm":
            return layer_norm(hidden, self.norm_weight, self.norm_bias, eps=spec.eps, dtype=self.dtype)
        weight = self.norm_weight if spec.norm != "none" else None
        return normalize(hidden, weight, eps=spec.eps, norm=spec.norm, dtype=self.dtype)

    def _on_device(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(device=self.device, dtype=self.dtype)

    def _kernel_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the kernel takes: the pre-norm state, or, for a norm it does not fuse (LayerNorm),
        the normalised one (`_norm_args` then says norm="none")."""
        return self.final_norm(hidden) if self.spec.norm == "layernorm" else self._on_device(hidden)

    def rounds_once(self, outputs: Sequence[str], k: int = 0, impl: str = "auto") -> bool:
        """Whether `compute` rounds these outputs once from fp32 and keeps no fp32 copy (the compiled CPU walk)."""
        w, spec = self.lm_head_weight, self.spec
        return impl in ("auto", "torch") and compiled_walk_serves(outputs, k, w, spec.logit_scale, spec.softcap)

    def _norm_args(self) -> dict:
        """The head's `lm_head` / `lm_head_logits` arguments besides hidden and weight."""
        fused = self.spec.norm not in ("none", "layernorm")
        return {
            "norm_weight": self.norm_weight if fused else None,
            "eps": self.spec.eps,
            "norm": self.spec.norm if fused else "none",
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


def _tied_flag(config: Any) -> bool | None:
    for cfg in (config, text_config(config)):
        value = getattr(cfg, "tie_word_embeddings", None)
        if value is not None:
            return bool(value)
    return None


def _plan_head(model_path: Path, config: Any, overrides, trust_remote_code: bool):
    """(config, rules, tensor files, (embed, norm, lm_head, norm bias or None) names) of a checkpoint."""
    config = config if config is not None else auto_config(model_path, trust_remote_code)
    rules = head_rules(config, overrides, trust_remote_code)
    if rules.tied is None:  # given, not derived: the config says
        rules = replace(rules, tied=_tied_flag(config))
    files = weight_files(model_path)
    embed, norm, head = _resolve_names(files, rules, model_path)
    bias = norm[: -len("weight")] + "bias" if rules.norm_bias else None
    if bias is not None and bias not in files:
        raise ValueError(f"TargetHead: the final norm has a bias, but the checkpoint has no {bias} in {model_path}")
    return config, rules, files, (embed, norm, head, bias)


def _files_key(files: Mapping[str, Path]) -> tuple:
    paths = sorted({Path(f).resolve() for f in files.values()})
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)


def check_states(hidden: int, n: int = CHECK_STATES) -> torch.Tensor:
    """The check's pre-norm states [n, H], fp32, seeded: off-centre rows of sizes 1e-3 to 1e2."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, hidden, generator=g) + torch.randn(n, 1, generator=g)
    return x * torch.logspace(-3, 2, n).unsqueeze(1)


def check_head(head: TargetHead, config: Any, key: tuple = (), trust_remote_code: bool = False,
               overridden: bool = False) -> float | None:
    """Hold `head` to transformers' own logits (`head_rules.family_logits`: the family's final norm,
    LM head and forward) on `check_states` over its first CHECK_ROWS vocabulary rows, fp32 on both
    sides, before any run. Returns the largest |error| relative to the largest logit (None: rules
    given for a family transformers cannot build, nothing to hold them to); UserError with the
    numbers when it exceeds CHECK_RTOL. `key` (the checkpoint's files) caches a pass."""
    rules = head.rules
    if rules is None or rules.model_class is None:
        return None
    if key and (key, rules) in _CHECKED:
        return 0.0
    states = check_states(head.hidden_size)
    rows = head.lm_head_weight[:CHECK_ROWS].detach().float().cpu()
    norm_w = None if head.norm_weight is None else head.norm_weight.detach().float().cpu()
    bias = None if head.norm_bias is None else head.norm_bias.detach().float().cpu()
    sub = copy.copy(head)  # the same head on fp32 CPU copies of its tensors (checked for finiteness already)
    sub.lm_head_weight, sub.norm_weight, sub.norm_bias = rows, norm_w, bias
    ours = sub.logits(states)
    theirs = family_logits(config, rules, states, norm_w, bias, rows, trust_remote_code)
    largest = max(1.0, float(theirs.abs().max()))
    err = float((ours - theirs).abs().max()) / largest
    if not err <= CHECK_RTOL:  # NaN fails too
        worst = int((ours - theirs).abs().max(-1).values.argmax())
        raise UserError(
            f"the head rules for {rules.model_class} ({rules.describe()}) do not reproduce transformers' own "
            f"logits: max |error| {err * largest:.3g} against a largest logit of {largest:.3g} (relative "
            f"{err:.2e} > {CHECK_RTOL:g}) over {states.shape[0]} random states x {rows.shape[0]} vocabulary rows; "
            f"worst at a state of RMS {float(states[worst].pow(2).mean().sqrt()):.3g}",
            "drop or correct the head_overrides" if overridden else
            "this family's head is one eagle_fast does not read right: pass its rules through the API "
            "(head_overrides), and report the family")
    if key:
        _CHECKED.add((key, rules))
    return err


def check_checkpoint_head(model_path: str | os.PathLike, config: Any = None, overrides=None,
                          trust_remote_code: bool = False) -> HeadRules:
    """The checkpoint's head rules, held to transformers (`check_head`) before anything runs: reads
    the final norm and only the first CHECK_ROWS rows of the LM head. Returns the rules."""
    model_path = Path(model_path)
    config, rules, files, (_, norm, head_name, bias) = _plan_head(model_path, config, overrides,
                                                                      trust_remote_code)
    key = _files_key(files)
    if (key, rules) in _CHECKED or rules.model_class is None:
        return rules
    by_name = _load_tensors(files, {norm} | ({bias} - {None}), dtype=torch.float32, device="cpu")
    with safe_open(str(files[head_name]), framework="pt", device="cpu") as sf:
        rows = sf.get_slice(head_name)[:CHECK_ROWS].float()
    head = TargetHead(rows, by_name[norm] if rules.spec.norm != "none" else None, rules.spec,
                      norm_bias=by_name.get(bias), rules=rules)
    check_head(head, config, key, trust_remote_code, overridden=bool(overrides))
    return rules


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
