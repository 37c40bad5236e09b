"""A family's output-head rules, read from transformers' own modules for it, not from a list.

`derive_head_rules(config)` builds the checkpoint's transformers class on the meta device (no
weights), finds its final norm and LM head, and classifies them by what they compute:
- the final norm, materialised on CPU with a known weight (and bias), is fed known inputs and
  compared with the candidate formulas: `x * rsqrt(mean(x^2) + eps) * w` ("rms"), `* (1 + w)`
  ("rms_one_plus"), mean-centred LayerNorm `(x - mean) * rsqrt(var + eps) * w (+ b)`
  ("layernorm"), at each eps the module or the config holds (else the eps its output implies);
- the logit scale and softcap: the causal LM's own `forward` runs over a stand-in decoder
  (`FixedStates`) on known states and a known LM head, and its logits are fitted as
  `softcap * tanh(scale * raw / softcap)`, each value snapped to the config's when one agrees;
- tying, from the built model; the names the checkpoint stores the three tensors under.
The result is cached per (model_type, config digest). `family_logits` is the oracle the head is
held to before a run (`head.check_head`): the same forward, with the real final norm and LM head.

Limits: an LM head with a bias, a norm with buffers or other parameters, or a logit transform
other than scale + softcap are refused with what was found; a family transformers cannot build
(no class, remote code not trusted) needs its rules given (`head_overrides`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from eagle_fast.errors import UserError

__all__ = [
    "NORMS",
    "HeadRules",
    "HeadSpec",
    "derive_head_rules",
    "family_logits",
    "head_rules",
    "layer_norm",
    "text_config",
]

NORMS = ("rms", "rms_one_plus", "layernorm", "none")
EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
OVERRIDE_KEYS = ("norm", "eps", "logit_scale", "softcap")
# Decoder children that may be the final norm, most likely first (any other 1-D [H] weight holder
# is a candidate too, after these).
NORM_NAMES = ("norm", "final_layernorm", "norm_f", "ln_f", "final_norm", "final_layer_norm")
FORMULA_RTOL = 1e-5  # fp32 formula vs the module, both fp32: observed ~1e-7
# What code cannot tell: wrappers whose head transformers computes otherwise than the engines that
# serve them, so their rules are read from their text decoder's causal LM instead, with why.
READ_FROM_TEXT_MODEL = {
    # transformers 5.18's wrapper drops text_config.final_logit_softcapping, which its own
    # Gemma3ForCausalLM and vLLM's Gemma-3 apply (released Gemma-3 checkpoints set none)
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
}


@dataclass(frozen=True)
class HeadSpec:
    """What the head computes besides the GEMM: `norm` (one of NORMS), `eps`, `logit_scale`, `softcap`."""

    norm: str
    eps: float
    logit_scale: float = 1.0
    softcap: float | None = None


@dataclass(frozen=True)
class HeadRules:
    """A family's head: its `spec`, whether the LM head is the input embedding (`tied`), whether the
    norm has a bias, and the names its decoder gives the tensors (`norm` relative to the decoder,
    e.g. "norm" or "norm_f"; `embed`, e.g. "embed_tokens"; `lm_head`), with the classes read."""

    spec: HeadSpec
    tied: bool | None
    norm_bias: bool = False
    norm_name: str = "norm"
    embed_name: str = "embed_tokens"
    lm_head_name: str = "lm_head"
    model_class: str | None = None  # None: given through overrides, not derived
    norm_class: str | None = None

    def describe(self) -> str:
        s = self.spec
        parts = [s.norm + (" with bias" if self.norm_bias else ""), f"eps {s.eps:g}"]
        parts += [f"logit scale {s.logit_scale:g}"] if s.logit_scale != 1.0 else []
        parts += [f"softcap {s.softcap:g}"] if s.softcap is not None else []
        parts += ["tied" if self.tied else "untied"] if self.tied is not None else []
        origin = f"{self.model_class}'s {self.norm_class}" if self.model_class else "given"
        return f"{', '.join(parts)} ({origin})"


def text_config(config: Any) -> Any:
    """The decoder's config: `config.get_text_config(decoder=True)` when the wrapper has one."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except TypeError:  # older transformers: no `decoder` keyword
            return get()
    return getattr(config, "text_config", None) or config


def _model_type(config: Any) -> str | None:
    return getattr(text_config(config), "model_type", None) or getattr(config, "model_type", None)


def config_digest(config: Any) -> str:
    to_dict = getattr(config, "to_dict", None)
    body = to_dict() if callable(to_dict) else repr(config)
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- the family's model, on the meta device ----------------------------------------------------
def build_meta_model(config: Any, trust_remote_code: bool = False) -> nn.Module:
    """The class transformers loads the checkpoint as (the causal-LM, else image-text-to-text class of
    its config, else its `architectures`), built on the meta device: modules and shapes, no memory, no
    weights. A wrapper READ_FROM_TEXT_MODEL names gives its text decoder's causal LM."""
    import transformers

    if not isinstance(config, transformers.PretrainedConfig):
        raise UserError(f"the head rules are read from a transformers config, not a {type(config).__name__}",
                        "pass the checkpoint's AutoConfig, or the head rules themselves (head_overrides)")
    archs = [a for a in (getattr(config, "architectures", None) or []) if hasattr(transformers, a)]
    errors, model = [], None
    with torch.device("meta"):  # the class transformers loads the checkpoint as, as the hf engine does
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
            try:
                if model is None:
                    model = auto.from_config(config, trust_remote_code=trust_remote_code)
            except (ValueError, KeyError, ImportError, OSError) as e:
                errors.append(str(e).splitlines()[0][:160])
        if model is None and archs:
            model = getattr(transformers, archs[0])(config)
        text_model = READ_FROM_TEXT_MODEL.get(type(model).__name__)
        if text_model is not None:
            model = getattr(transformers, text_model)(text_config(config))
    if model is not None:
        return model
    raise UserError(
        f"transformers {transformers.__version__} cannot build model_type {_model_type(config)!r} "
        f"({getattr(config, 'architectures', None)}), so its head rules cannot be read from its code: {errors[0]}",
        "use a transformers that defines the family (or trust its remote code), or pass the head rules "
        "through the API (head_overrides={'norm': ..., 'eps': ..., 'logit_scale': ..., 'softcap': ...})")


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def head_modules(model: nn.Module) -> tuple[nn.Module, str, nn.Module, nn.Module]:
    """(decoder, its path in `model`, final norm, LM head) of a causal LM built by transformers."""
    cls = type(model).__name__
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    if decoder is None or decoder is model:  # the child that holds the input embedding
        decoder = next((c for _, c in model.named_children() if any(m is embed for m in c.modules())), None)
    if not isinstance(head, nn.Linear) or decoder is None:
        raise UserError(f"{cls} has no linear LM head or no decoder eagle_fast can find "
                        f"(get_output_embeddings: {type(head).__name__})",
                        "pass the head rules through the API (head_overrides)")
    hidden = head.weight.shape[1]
    found = [(name, child) for name, child in decoder.named_children()
             if child is not embed and not isinstance(child, (nn.ModuleList, nn.Embedding))
             and getattr(child, "weight", None) is not None and tuple(child.weight.shape) == (hidden,)]
    found.sort(key=lambda nc: NORM_NAMES.index(nc[0]) if nc[0] in NORM_NAMES else len(NORM_NAMES))
    if not found:
        raise UserError(f"{cls}'s decoder {type(decoder).__name__} has no final norm with a [{hidden}] weight "
                        f"(children: {[n for n, _ in decoder.named_children()]})",
                        "pass the head rules through the API (head_overrides)")
    return decoder, _path_of(model, decoder), found[0][1], head


# -- the final norm, by behaviour --------------------------------------------------------------
def layer_norm(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """Mean-centred LayerNorm, fp32 statistics and weight, rounded once to `dtype` (Cohere's, and
    torch's layer_norm in 16-bit): rnd((x32 - mean) * rsqrt(var + eps) * w32 (+ b32)), [..., H]."""
    x32 = hidden.float()
    centred = x32 - x32.mean(-1, keepdim=True)
    y = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y if bias is None else y + bias.float()).to(dtype)


def formula(norm: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """A candidate final norm in fp32 (`norm` one of NORMS)."""
    if norm == "layernorm":
        return layer_norm(x, weight, bias, eps=eps, dtype=torch.float32)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = y * (1.0 + weight) if norm == "rms_one_plus" else y * weight
    return y if bias is None else y + bias


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _materialise(meta: nn.Module) -> nn.Module:
    module = copy.deepcopy(meta).to_empty(device="cpu").float()
    params = dict(module.named_parameters())
    if list(module.buffers()) or set(params) - {"weight", "bias"}:
        raise UserError(f"the final norm {type(meta).__name__} holds {sorted(params)} and buffers "
                        f"{[n for n, _ in module.named_buffers()]}: no formula eagle_fast knows takes those",
                        "pass the head rules through the API (head_overrides)")
    return module


def _eps_candidates(module: nn.Module, config: Any) -> list[float]:
    values = [v for v in vars(module).values() if isinstance(v, float)]
    text = text_config(config)
    values += [getattr(c, k) for c in (text, config) for k in EPS_KEYS if isinstance(getattr(c, k, None), float)]
    return [v for v in dict.fromkeys(values) if 0 < v < 0.1]


def classify_norm(meta_norm: nn.Module, config: Any) -> tuple[str, float, bool]:
    """(norm variant, eps, has a bias) of the family's final norm, from its output on known inputs:
    rows of ordinary size tell the formula, rows of size ~1e-3 (where eps weighs) tell the eps."""
    module = _materialise(meta_norm)
    hidden = module.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.weight.copy_(1.0 + 0.5 * torch.randn(hidden, generator=g))
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_(0.1 * torch.randn(hidden, generator=g))
        else:
            bias = None
        x = torch.randn(16, hidden, generator=g) + torch.randn(16, 1, generator=g)  # off-centre rows
        small = x * 1e-3
        y, y_small = module(x), module(small)
        w = module.weight.detach()
        for norm in ("rms", "rms_one_plus", "layernorm"):
            if _rel_err(formula(norm, x, w, bias, 1e-6), y) > 1e-3:  # the formula, whatever the eps
                continue
            for eps in _eps_candidates(module, config) + [_implied_eps(norm, small, w, bias, y_small)]:
                if _rel_err(formula(norm, x, w, bias, eps), y) < FORMULA_RTOL and \
                        _rel_err(formula(norm, small, w, bias, eps), y_small) < 1e-4:
                    return norm, eps, bias is not None
    raise UserError(f"the final norm {type(meta_norm).__name__} computes none of RMSNorm (times w or 1 + w) or "
                    "LayerNorm (with or without bias) at any eps its module or config holds",
                    "pass the head rules through the API (head_overrides={'norm': ..., 'eps': ...})")


def _implied_eps(norm: str, x: torch.Tensor, w: torch.Tensor, bias, y: torch.Tensor) -> float:
    """The eps that makes `norm` give `y` on `x` (median over elements), to 4 significant digits."""
    if norm == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    scale = (1.0 + w) if norm == "rms_one_plus" else w
    r = ((y - (0 if bias is None else bias)) / (x * scale)).median(-1).values  # rsqrt(mean(x^2) + eps)
    eps = float((r.double().pow(-2) - x.double().pow(2).mean(-1)).median())
    return float(f"{eps:.4g}") if eps > 0 else 1e-6


# -- the logits: the family's forward over a stand-in decoder ----------------------------------
class FixedStates(nn.Module):
    """Stands in for a decoder: returns `norm(states)` as its last hidden state, whatever it is given."""

    def __init__(self, states: torch.Tensor, norm: nn.Module | None = None):
        super().__init__()
        self.states, self.norm = states, norm

    def forward(self, *args, **kwargs):
        states = self.states if self.norm is None else self.norm(self.states)
        return decoder_output_class()(last_hidden_state=states.unsqueeze(0))


@functools.cache
def decoder_output_class():
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class DecoderOutput(BaseModelOutputWithPast):
        """A decoder's output with nothing but its last hidden state: any other field a family's
        forward reads (router logits, shared KV states, ...) is None."""

        def __getattr__(self, name):  # only reached for a field it does not have: None
            if name.startswith("__"):
                raise AttributeError(name)

    return DecoderOutput


def _run_forward(model: nn.Module, decoder_path: str, states: torch.Tensor, norm: nn.Module | None,
                 lm_head: nn.Linear) -> torch.Tensor:
    """`model`'s own forward with its decoder replaced by `FixedStates` and its LM head by `lm_head`,
    both put back after: fp32 logits [N, rows of lm_head]. `model` may be on the meta device."""
    head_path = _path_of(model, model.get_output_embeddings())  # before the decoder goes (it asks it)
    top = decoder_path.split(".")[0]
    owner = model.get_submodule(head_path.rpartition(".")[0]) if "." in head_path else model
    leaf = head_path.rpartition(".")[2]
    decoder, head = getattr(model, top), getattr(owner, leaf)
    params = inspect.signature(model.forward).parameters
    kwargs = {"input_ids": torch.zeros(1, states.shape[0], dtype=torch.long),
              **{k: False for k in ("use_cache", "output_router_logits") if k in params}}
    setattr(model, top, FixedStates(states, norm))
    setattr(owner, leaf, lm_head)
    try:
        with torch.no_grad():
            return model(**kwargs).logits.reshape(states.shape[0], -1).float()
    finally:
        setattr(owner, leaf, head)
        setattr(model, top, decoder)


def _linear(weight: torch.Tensor) -> nn.Linear:
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(weight.float())
    return head


def _snap(value: float, config: Any, words: tuple[str, ...]) -> float:
    """`value`, or the config attribute (or its inverse) it equals to 1e-5 relative: exactly that."""
    text = text_config(config)
    for cfg in (text, config):
        for key, v in sorted(vars(cfg).items()):
            if any(w in key for w in words) and isinstance(v, (int, float)) and not isinstance(v, bool) and v:
                for exact in (float(v), 1.0 / float(v)):
                    if abs(exact - value) <= 1e-5 * abs(exact):
                        return exact
    return value


def classify_logits(config: Any, meta_model: nn.Module) -> tuple[float, float | None]:
    """(logit scale, softcap) of the family's forward (`meta_model`'s): raw logits near 0 give the
    scale, raw logits far past any softcap the cap."""
    hidden = meta_model.get_output_embeddings().weight.shape[1]
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, hidden, generator=g) / math.sqrt(hidden)
    states = torch.randn(32, hidden, generator=g)
    raws, outs = [], []
    path = head_modules(meta_model)[1]
    for size in (1e-3, 1e3):  # |raw| ~ 1e-3 (linear everywhere) and ~ 1e3 (capped, if capped at all)
        outs.append(_run_forward(meta_model, path, states * size, None, _linear(weight)))
        raws.append((states * size) @ weight.T)
    scale = float((outs[0] * raws[0]).sum() / raws[0].pow(2).sum())
    scale = 1.0 if abs(scale - 1.0) < 1e-6 else _snap(scale, config, ("scal", "logit", "multiplier"))
    if _rel_err(outs[1], scale * raws[1]) < FORMULA_RTOL:
        return scale, None
    cap = float(outs[1].abs().max())  # tanh saturates: the largest |logit| is the cap
    cap = _snap(cap, config, ("softcap", "softcapping"))
    if _rel_err(cap * torch.tanh(scale * raws[1] / cap), outs[1]) > 1e-4:
        raise UserError(f"{type(meta_model).__name__}'s logits are neither a scale nor a scale and a softcap "
                        "of the LM head's output", "pass the head rules through the API (head_overrides)")
    return scale, cap


# -- the rules, cached --------------------------------------------------------------------------
_CACHE: dict[tuple[str | None, str], HeadRules] = {}


def derive_head_rules(config: Any, trust_remote_code: bool = False) -> HeadRules:
    """The family's head rules, read from transformers' modules for `config` (cached per
    model_type and config digest). Raises UserError naming what could not be read."""
    key = (_model_type(config), config_digest(config))
    if key not in _CACHE:
        model = build_meta_model(config, trust_remote_code)
        path, norm, head = head_modules(model)[1:]
        if head.bias is not None:
            raise UserError(f"{type(model).__name__}'s LM head has a bias, which eagle_fast's head does not add",
                            "use a checkpoint without an LM-head bias")
        variant, eps, bias = classify_norm(norm, config)
        scale, cap = classify_logits(config, model)
        embed = model.get_input_embeddings()
        tied = embed is not None and embed.weight is head.weight
        norm_path, embed_path = _path_of(model, norm), _path_of(model, embed) if embed is not None else ""
        _CACHE[key] = HeadRules(
            spec=HeadSpec(norm=variant, eps=eps, logit_scale=scale, softcap=cap), tied=tied, norm_bias=bias,
            norm_name=norm_path[len(path) + 1:], embed_name=embed_path.rpartition(".")[2] or "embed_tokens",
            lm_head_name=_path_of(model, head).rpartition(".")[2], model_class=type(model).__name__,
            norm_class=type(norm).__name__)
    return _CACHE[key]


def head_rules(config: Any, overrides: Mapping[str, Any] | None = None,
               trust_remote_code: bool = False) -> HeadRules:
    """`derive_head_rules`, with `overrides` (keys OVERRIDE_KEYS) winning over what was derived. A
    family transformers cannot build takes its rules from `overrides` alone (`norm` and `eps` at
    least; Llama's tensor names)."""
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(OVERRIDE_KEYS)
    if unknown:
        raise ValueError(f"head overrides: unknown keys {sorted(unknown)}; use {', '.join(OVERRIDE_KEYS)}")
    if overrides.get("norm", "rms") not in NORMS:
        raise ValueError(f"TargetHead: norm={overrides['norm']!r}; use one of {', '.join(NORMS)}")
    try:
        rules = derive_head_rules(config, trust_remote_code)
    except UserError:
        if not {"norm", "eps"} <= set(overrides):
            raise
        rules = HeadRules(spec=HeadSpec(norm=overrides["norm"], eps=float(overrides["eps"])), tied=None)
    fields = {k: overrides[k] for k in OVERRIDE_KEYS if k in overrides}
    if "eps" in fields:
        fields["eps"] = float(fields["eps"])
    return replace(rules, spec=replace(rules.spec, **fields)) if fields else rules


def family_logits(config: Any, rules: HeadRules, states: torch.Tensor, norm_weight: torch.Tensor,
                  norm_bias: torch.Tensor | None, lm_head_rows: torch.Tensor,
                  trust_remote_code: bool = False) -> torch.Tensor:
    """Transformers' own logits, fp32 [N, R]: the family's forward, final norm and LM head, with the
    checkpoint's norm weight (and bias) and `lm_head_rows` [R, H], over pre-norm `states` [N, H]."""
    model = build_meta_model(config, trust_remote_code)
    _, path, meta_norm, _ = head_modules(model)
    norm = _materialise(meta_norm)
    with torch.no_grad():
        norm.weight.copy_(norm_weight.float())
        if norm_bias is not None:
            norm.bias.copy_(norm_bias.float())
    return _run_forward(model, path, states.float(), norm, _linear(lm_head_rows))
