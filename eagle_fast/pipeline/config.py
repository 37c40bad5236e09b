"""What an extraction does, resolved, and what it reports.

`ExtractPlan` is an extraction's settings checked and resolved once (`pipeline.plan.resolve`,
which owns `ExtractConfig`, the settings as given): frozen, and the one thing the stages after
it take. `Summary` is what a run reports. The target's part (`TargetPlan`) is
`runners.factory`'s, shared with `serve`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_fast.inputs import InputPlan, ShardPlan
from eagle_fast.mixing import DataSpec
from eagle_fast.runners.factory import TargetPlan
from eagle_fast.store.layouts import Layout, LayoutSpec
from eagle_fast.store.sizes import size_table

# ------------------------------------------------------------------------------ formatting


def fmt_secs(s: float) -> str:
    if not math.isfinite(s):
        return "--:--"
    s = round(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class RunSettings:
    """How a run goes, not what it writes (resume may change them)."""

    batch_tokens: int                 # each engine call's token budget (plan_batches, vLLM's step)
    queue_batches: int                # results the writer may have yet to store
    progress_tty: bool | None         # None: a bar when stderr is a terminal
    worker_supervision: dict | None   # --head-in-worker: engine_setup.head_in_worker_settings; None: the head runs here


@dataclass(frozen=True)
class ExtractPlan:
    """An extraction resolved once (`pipeline.plan.resolve`); every stage after it reads this and
    checks nothing again. The dataset directory it writes is `prepare.DatasetDir`."""

    target: TargetPlan                  # engine settings: model, engine, dtype, aux layers, --max-len, vLLM
    layout: Layout                      # its spec: kind, k, dtypes, padding
    draft_ids: torch.Tensor | None      # the draft vocabulary (--draft-vocab), target ids ascending
    data: DataSpec                      # --data as given
    inputs: InputPlan                   # the samples, tokenised and masked
    shards: tuple[ShardPlan, ...]
    part: tuple[int, int] | None        # --shard I/N (None: the whole dataset)
    pending: tuple[ShardPlan, ...]      # this node's shards not yet complete on disk
    root: Path                          # --out
    manifest: dict                      # the manifest a run starts from (never changed after resolve)
    run: RunSettings

    @property
    def spec(self) -> LayoutSpec:
        return self.layout.spec

    @property
    def kind(self) -> str:
        return self.layout.spec.kind

    @property
    def longest(self) -> int:
        """The longest sample's tokens (the runner is sized for it)."""
        return max((s.length for s in self.inputs.samples), default=1)


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
    records: tuple = ()       # each record's draft types and their layers (the manifest's draft_types)

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
        lines += [f"draft types  {line}" for line in self.records]
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
