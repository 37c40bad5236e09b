"""`eagle-fast accept`: a trained draft's acceptance (or the target's own MTP layers'), as vLLM's
speculative decoding counts it beside the target.

Flow: check the settings, the method and the draft's fit to the target (`methods.plan_method`:
eagle3, dflash, dspark or mtp, refused before any engine starts with the mismatch or vLLM's
refusal named); stream the rows up to the N-th prompt
(`rows.stream_rows`: a bad line is reported with its number, not fatal); make one prompt per row (`rows.record_prompt`: a
conversation up to its last user turn, rendered with the chat template and its generation
prompt); then one vLLM engine with the method's `speculative_config` generates an
answer to every prompt, and the engine's own counters are read before and after. `accept_each`
runs the prompts once per sampling setting on that one engine (from a cold prefix cache each
time), a result per setting.

Reported: mean acceptance length (1 + accepted / drafts: the bonus token counts, as vLLM
counts it), the acceptance rate at each of the K positions (accepted there / drafts), drafts,
draft tokens, accepted tokens, and output tokens over the generate call's wall time.
Limits: vLLM only; one engine in this process (the CLI's own); prompts are run as one batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_fast.chat import ChatFormat
from eagle_fast.checkpoint import resolve_dtype_name
from eagle_fast.errors import UserError
from eagle_fast.files import atomic_write_json
from eagle_fast.inputs import load_tokenizer
from eagle_fast.loop.drafts import DraftFit
from eagle_fast.loop.engine import (
    Sampling,
    check_settings,
    generation_kwargs,
    spec_counters,
)
from eagle_fast.loop.methods import METHODS, MethodPlan, plan_method
from eagle_fast.loop.rows import Failure, Row, record_prompt, stream_rows
from eagle_fast.mixing import DataSpec, draw
from eagle_fast.runners import generation
from eagle_fast.runners.engine_settings import VLLMSettings


@dataclass
class AcceptConfig:
    model: str
    draft: str | None     # None for --method mtp (the target's own layers)
    data: str | DataSpec  # one file, or the sources and their draw (`mixing`)
    num_speculative_tokens: int = 3
    num_prompts: int | None = None    # the first N prompts (None: all)
    dtype: str = "auto"
    sampling: Sampling = field(default_factory=Sampling)
    chat: ChatFormat = field(default_factory=ChatFormat)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    json_path: str | None = None
    method: str = "eagle3"            # vLLM's speculative method: eagle3 | dflash | dspark | mtp

    def check(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"--method {self.method!r} is not one of {', '.join(METHODS)}",
                            "pick one of them (vLLM's names)")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UserError(f"--num-speculative-tokens must be a positive integer, got {k!r}", "pass e.g. -k 3")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UserError(f"--num-prompts must be at least 1, got {self.num_prompts}",
                            "pass e.g. --num-prompts 100, or leave it out for all")
        if not Path(self.model).is_dir():
            raise UserError(f"--model {self.model} is not a checkpoint directory",
                            "pass the directory holding config.json and the weights")
        generation.check_model(self.model)
        if self.draft is not None and not Path(self.draft).is_dir():
            raise UserError(f"--draft {self.draft} is not a directory", f"pass the {self.method} draft's directory")
        if self.json_path is not None:
            out = Path(self.json_path)
            if not out.parent.is_dir():
                raise UserError(f"--json {out}: directory {out.parent} does not exist", "create it, or pass another path")
            if out.resolve() in {p.resolve() for p in DataSpec.of(self.data).paths()}:
                raise UserError(f"--json {out} is the input file", "write the result to another file")
        self.sampling.check()
        check_settings(self.vllm)

    def plan(self) -> MethodPlan:
        """The method's speculative_config, engine arguments, draft fit and notes (refusals raise)."""
        return plan_method(self.method, self.draft, self.model, resolve_dtype_name(self.model, self.dtype),
                           self.num_speculative_tokens, self.vllm)


@dataclass
class Prompt:
    line: int
    ids: list[int]


@dataclass
class AcceptResult:
    model: str
    draft: str | None
    data: str
    data_sha256: str
    num_speculative_tokens: int
    dtype: str
    sampling: dict[str, Any]
    fit: DraftFit
    read: int = 0
    prompts: int = 0
    unused_rows: int = 0              # rows past --num-prompts
    failures: list[Failure] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    output_tokens: int = 0
    generate_seconds: float = 0.0
    engine_start_seconds: float = 0.0
    json_path: str | None = None
    method: str = "eagle3"
    notes: list[str] = field(default_factory=list)  # what the method set or warns of (methods.plan_method)

    @property
    def num_drafts(self) -> int:
        return int(self.counters.get("num_drafts", 0))

    def mean_acceptance_length(self) -> float | None:
        d = self.num_drafts
        return 1.0 + self.counters["num_accepted_tokens"] / d if d else None

    def acceptance_per_position(self) -> list[float | None]:
        d, per_pos = self.num_drafts, list(self.counters.get("num_accepted_tokens_per_pos", []))
        per_pos += [0] * (self.num_speculative_tokens - len(per_pos))
        return [a / d if d else None for a in per_pos[: self.num_speculative_tokens]]

    def output_tokens_per_s(self) -> float | None:
        return self.output_tokens / self.generate_seconds if self.generate_seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        drafted = int(self.counters.get("num_draft_tokens", 0))
        accepted = int(self.counters.get("num_accepted_tokens", 0))
        return {
            "mean_acceptance_length": self.mean_acceptance_length(),
            "acceptance_per_position": self.acceptance_per_position(),
            "num_drafts": self.num_drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": list(self.counters.get("num_accepted_tokens_per_pos", [])),
            "draft_acceptance_rate": accepted / drafted if drafted else None,
            "output_tokens": self.output_tokens, "output_tokens_per_s": self.output_tokens_per_s(),
            "generate_seconds": round(self.generate_seconds, 3),
            "engine_start_seconds": round(self.engine_start_seconds, 3),
            "num_speculative_tokens": self.num_speculative_tokens, "dtype": self.dtype, "sampling": self.sampling,
            "method": self.method, "notes": list(self.notes), "model": self.model, "draft": self.draft, "draft_fit": self.fit.to_json(),
            "data": self.data, "data_sha256": self.data_sha256, "read": self.read, "prompts": self.prompts,
            "unused_rows": self.unused_rows, "failed": len(self.failures),
            "failures": [f.to_json() for f in sorted(self.failures, key=lambda f: f.line)],
        }

    def text(self) -> str:
        k = self.num_speculative_tokens
        what = f"{self.draft} ({self.fit.layout})" if self.draft is not None else f"its own {self.fit.architecture}"
        lines = [f"accept --method {self.method}: {what} on {self.model}, K={k}, {self.prompts:,} prompts of "
                 f"{self.read:,} lines read ({len(self.failures):,} failed"
                 + (f", {self.unused_rows:,} past --num-prompts" if self.unused_rows else "") + ")"]
        lines += [f"  {n}" for n in self.notes]
        mean = self.mean_acceptance_length()
        if mean is None:
            lines.append("  no drafts were made (every answer ended at its first token?)")
        else:
            c = self.counters
            lines.append(f"  mean acceptance length {mean:.3f} (at most {k + 1})")
            lines.append("  acceptance per position: " + " ".join(f"{r:.3f}" for r in self.acceptance_per_position()))
            lines.append(f"  drafts {self.num_drafts:,}, draft tokens {c['num_draft_tokens']:,}, accepted tokens "
                         f"{c['num_accepted_tokens']:,}")
        rate = self.output_tokens_per_s()
        lines.append(f"  output {self.output_tokens:,} tokens in {self.generate_seconds:.2f} s"
                     + (f": {rate:,.1f} tokens/s" if rate is not None else "")
                     + f" ({self.dtype}; engine start {self.engine_start_seconds:.1f} s)")
        for f in sorted(self.failures, key=lambda f: f.line)[:10]:
            lines.append(f"  line {f.line}: {f.cause}" + (f" (fix: {f.fix})" if f.fix else ""))
        if len(self.failures) > 10:
            lines.append(f"  ... {len(self.failures) - 10:,} more failed lines "
                         + (f"in {self.json_path}" if self.json_path else "(listed with --json FILE)"))
        return "\n".join(lines)


def build_prompts(tok, rows: Iterable[Row | Failure], fmt: ChatFormat,
                  limit: int | None) -> tuple[list[Prompt], list[Failure], int]:
    """(prompts, rows that made none (bad rows included), rows looked at): `rows` is read only
    up to the `limit`-th prompt, so a stream of rows is read no further."""
    prompts: list[Prompt] = []
    failures: list[Failure] = []
    looked = 0
    for row in rows:
        if limit is not None and len(prompts) == limit:
            break
        looked += 1
        if isinstance(row, Failure):
            failures.append(row)
            continue
        try:
            ids = record_prompt(tok, row, fmt)
        except UserError:
            raise  # the run's problem (no chat template at all), not this row's
        except Exception as exc:  # noqa: BLE001 -- a template that raises fails its row only
            failures.append(Failure(row.line, f"the chat template cannot render the conversation "
                                    f"({type(exc).__name__}: {exc})",
                                    "fix the row, or pass a --chat-template that renders it"))
            continue
        if ids is None:
            failures.append(Failure(row.line, "the conversation has no user turn, so there is nothing to answer",
                                    "add a user turn, or drop the row"))
        elif not ids:
            failures.append(Failure(row.line, "the prompt is empty", "give the row some text"))
        else:
            prompts.append(Prompt(row.line, ids))
    return prompts, failures, looked


def fit_context(prompts: list[Prompt], max_model_len: int) -> tuple[list[Prompt], list[Failure]]:
    """The prompts that leave the engine's context room for an answer, and the others as failures."""
    keep = [p for p in prompts if len(p.ids) < max_model_len]
    failures = [Failure(p.line, f"the prompt is {len(p.ids):,} tokens, and the engine's context (--max-model-len) "
                        f"is {max_model_len:,}, with no room left for an answer",
                        "raise --max-model-len, or shorten the conversation")
                for p in prompts if len(p.ids) >= max_model_len]
    return keep, failures


def accept(cfg: AcceptConfig) -> AcceptResult:
    """Run `cfg`; the result is also written to `cfg.json_path` when given."""
    [result] = accept_each(cfg, [cfg.sampling])
    if cfg.json_path is not None:
        result.json_path = str(cfg.json_path)
        atomic_write_json(cfg.json_path, result.to_json())
    return result


def accept_each(cfg: AcceptConfig, samplings: list[Sampling]) -> list[AcceptResult]:
    """`cfg` run once per sampling on one engine (each result: the counters of its own run)."""
    cfg.check()
    for sampling in samplings:
        sampling.check()
    plan = cfg.plan()
    spec = DataSpec.of(cfg.data)
    drawn = draw(spec)
    n_read, sha = len(drawn), drawn.digest
    tok = load_tokenizer(cfg.model)
    # streamed: the rows past the N-th prompt are not read
    prompts, failures, looked = build_prompts(tok, stream_rows(spec, drawn), cfg.chat, cfg.num_prompts)
    unused = n_read - looked
    if not prompts:
        first = min(failures, key=lambda f: f.line) if failures else None
        raise UserError(f"{cfg.data} gives no prompt" + (f" (line {first.line}: {first.cause})" if first else ""),
                        first.fix if first and first.fix else "give it rows with a user turn")
    dtype = resolve_dtype_name(cfg.model, cfg.dtype)  # "auto": the checkpoint's (vLLM's would run fp32 in bf16)
    kwargs = generation_kwargs(cfg.model, dtype, cfg.vllm, speculative_config=plan.speculative_config,
                               disable_log_stats=False, **plan.engine)
    t0 = time.perf_counter()
    llm = generation.start(kwargs)
    try:
        started = time.perf_counter() - t0
        max_len = generation.max_model_len(llm)
        prompts, too_long = fit_context(prompts, max_len)
        if not prompts:
            raise UserError(f"every prompt of {cfg.data} is longer than the engine's context ({max_len:,} tokens)",
                            "raise --max-model-len, or shorten the conversations")
        results = []
        for sampling in samplings:
            result = AcceptResult(str(cfg.model), None if cfg.draft is None else str(cfg.draft), str(cfg.data), sha,
                                  cfg.num_speculative_tokens, dtype, sampling.describe(), plan.fit, read=n_read,
                                  prompts=len(prompts), unused_rows=unused, failures=failures + too_long,
                                  engine_start_seconds=started, method=cfg.method, notes=list(plan.notes))
            run_prompts(llm, sampling, prompts, result)
            results.append(result)
    finally:
        generation.stop(llm)
    return results


def run_prompts(llm, sampling: Sampling, prompts: list[Prompt], result: AcceptResult) -> None:
    """Generate an answer to every prompt; the engine's counters over that call go to `result`."""
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()  # each run from a cold cache, as the first
    before = spec_counters(llm)
    params = [sampling.params(p.line) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p.ids) for p in prompts], params, use_tqdm=False)
    result.generate_seconds = time.perf_counter() - t0
    after = spec_counters(llm)
    result.output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result.counters = {k: after[k] - before[k] for k in after if k != "num_accepted_tokens_per_pos"}
    old = before["num_accepted_tokens_per_pos"] or [0] * len(after["num_accepted_tokens_per_pos"])
    result.counters["num_accepted_tokens_per_pos"] = [a - b for a, b in zip(after["num_accepted_tokens_per_pos"], old)]
