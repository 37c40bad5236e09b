"""`eagle-fast regenerate`: the data's assistant turns rewritten by the target, so a draft
learns the target's own distribution (what SpecForge, speculators, NeMo AutoModel and ModelOpt
users do before extracting).

Flow: read every line (`rows.stream_rows`: a bad line is reported, not fatal), split the rows
into chunks of `--chunk-rows` by position, regenerate each chunk turn by turn through one
vLLM engine (`turns.run_chunk`), append its rows to `OUT.part` in input order, then record the
chunk in the sidecar `OUT.part.json` (after an fsync). At the end `OUT.part` becomes `OUT`
(a rename) and `OUT.report.json` holds the counts (read = regenerated + passed through +
failed), every failure with its line and cause, and the turns stopped at `--max-tokens`.

Resume: re-run the same command. The sidecar holds the settings and the input's sha256 (a run
with other settings or another input is refused, never mixed in) and the byte length of
`OUT.part` after each finished chunk. Lines written past that (a chunk cut short by kill -9,
a torn last line) are checked: complete lines of the unfinished chunk are kept, a torn one is
cut, and the chunk is recomputed; its rows already on disk are not written twice. A chunk's
output depends only on its rows and the settings (`turns.run_chunk`), so at temperature 0 (and
at any temperature, rows being seeded by line) the resumed file equals an uninterrupted one.
The rows are streamed twice (a first pass counts them and finds the bad ones and the calling
ones; the second reads each chunk as the engine asks for it), so one chunk of rows is held.
Limits: rows are written per chunk, not per row.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle_fast.chat import ChatFormat
from eagle_fast.errors import UserError
from eagle_fast.files import atomic_write_json, fsync_dir
from eagle_fast.inputs import load_tokenizer
from eagle_fast.loop.engine import Sampling, check_settings, generation_kwargs
from eagle_fast.loop.regen_ray import ray_chunks
from eagle_fast.loop.rows import Failure, Row, stream_rows
from eagle_fast.loop.turns import TurnOutput, chunk_outputs, tool_parser_names
from eagle_fast.mixing import DataSpec, draw
from eagle_fast.pipeline.config import fmt_secs
from eagle_fast.runners import generation
from eagle_fast.runners.engine_settings import VLLMSettings

logger = logging.getLogger(__name__)
STATE_VERSION = 1


@dataclass
class RegenerateConfig:
    model: str
    data: str | DataSpec  # one file, or the sources and their draw (`mixing`)
    out: str
    dtype: str = "auto"
    sampling: Sampling = field(default_factory=lambda: Sampling(max_tokens=2048))
    reasoning: str = "keep"           # keep | drop
    tool_call_parser: str | None = None  # vLLM's tool parser name (hermes for Qwen3, ...)
    tool_turns: str = "regenerate"    # regenerate | keep (tool calls and their results verbatim)
    chunk_rows: int = 1024
    chat: ChatFormat = field(default_factory=ChatFormat)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)

    def check(self) -> None:
        if self.reasoning not in ("keep", "drop"):
            raise UserError(f"--reasoning must be keep or drop, got {self.reasoning!r}", "pass --reasoning keep")
        if self.tool_turns not in ("regenerate", "keep"):
            raise UserError(f"--tool-turns must be regenerate or keep, got {self.tool_turns!r}",
                            "pass --tool-turns keep to keep tool calls and their results verbatim")
        if self.tool_call_parser is not None and self.tool_call_parser not in tool_parser_names():
            raise UserError(f"--tool-call-parser {self.tool_call_parser!r} is not one of this vLLM's tool parsers",
                            "pass one of: " + ", ".join(tool_parser_names()))
        if self.chunk_rows < 1:
            raise UserError(f"--chunk-rows must be at least 1, got {self.chunk_rows}", "pass e.g. --chunk-rows 256")
        if not Path(self.model).is_dir():
            raise UserError(f"--model {self.model} is not a checkpoint directory",
                            "pass the directory holding config.json and the weights")
        generation.check_model(self.model)
        if Path(self.out).resolve() in {p.resolve() for p in DataSpec.of(self.data).paths()}:
            raise UserError(f"--out {self.out} is the input file", "write the output to another file")
        self.sampling.check()
        check_settings(self.vllm)

    def settings(self) -> dict[str, Any]:
        """What decides the output's bytes (recorded; a resume must match)."""
        return {"model": str(Path(self.model).resolve()), "dtype": self.dtype,
                "sampling": self.sampling.describe(), "reasoning": self.reasoning,
                "tool_turns": self.tool_turns, "tool_call_parser": self.tool_call_parser,
                "chunk_rows": self.chunk_rows, "chat": self.chat.describe(),
                "engine": {k: v for k, v in asdict(self.vllm).items() if k != "capture_dir"}}


@dataclass
class Summary:
    out: str
    read: int = 0
    regenerated: int = 0
    passed_through: int = 0
    failures: list[Failure] = field(default_factory=list)
    turns: int = 0
    tokens: int = 0
    truncated: list[dict] = field(default_factory=list)   # {"line", "messages": [indices]}
    cut: list[dict] = field(default_factory=list)         # {"line", "after_message"}: a diverging call
    seconds: float = 0.0
    resumed_chunks: int = 0
    run_tokens: int = 0        # generated by this run (a resumed one: since it resumed)
    complete: bool = False

    def add(self, out: TurnOutput) -> None:
        if out.failure is not None:
            self.failures.append(out.failure)
        elif out.passed_through:
            self.passed_through += 1
        else:
            self.regenerated += 1
            self.turns += out.turns
            self.tokens += out.tokens
            if out.truncated:
                self.truncated.append({"line": out.line, "messages": out.truncated})
            if out.cut is not None:
                self.cut.append({"line": out.line, "after_message": out.cut})

    def to_json(self) -> dict[str, Any]:
        return {"out": self.out, "complete": self.complete, "read": self.read, "regenerated": self.regenerated,
                "passed_through": self.passed_through, "failed": len(self.failures),
                "failures": [f.to_json() for f in sorted(self.failures, key=lambda f: f.line)],
                "turns_generated": self.turns, "tokens_generated": self.tokens,
                "truncated_turns": len([i for t in self.truncated for i in t["messages"]]),
                "rows_with_truncated_turns": self.truncated, "cut": len(self.cut), "rows_cut": self.cut}

    @classmethod
    def from_json(cls, obj: dict) -> Summary:
        s = cls(obj["out"], obj["read"], obj["regenerated"], obj["passed_through"],
                [Failure(**f) for f in obj["failures"]], obj["turns_generated"], obj["tokens_generated"],
                list(obj["rows_with_truncated_turns"]), list(obj.get("rows_cut", [])))
        s.complete = bool(obj.get("complete"))
        return s

    def text(self) -> str:
        lines = [(f"regenerated {self.regenerated:,} rows ({self.turns:,} turns, {self.tokens:,} tokens), passed "
                  f"through {self.passed_through:,}, failed {len(self.failures):,}, of {self.read:,} read -> {self.out}")]
        if self.seconds:
            lines.append(f"  {fmt_secs(self.seconds)}, {self.run_tokens / self.seconds:,.0f} tokens/s this run"
                         + (f" (resumed after {self.resumed_chunks} chunks)" if self.resumed_chunks else ""))
        if self.truncated:
            n = sum(len(t["messages"]) for t in self.truncated)
            lines.append(f"  {n:,} turns stopped at --max-tokens (listed in the report; raise --max-tokens to "
                         "finish them)")
        if self.cut:
            lines.append(f"  {len(self.cut):,} conversations cut after a tool call unlike the original's (its "
                         "result would not answer it; listed in the report)")
        for f in sorted(self.failures, key=lambda f: f.line)[:10]:
            lines.append(f"  line {f.line}: {f.cause}" + (f" (fix: {f.fix})" if f.fix else ""))
        if len(self.failures) > 10:
            lines.append(f"  ... {len(self.failures) - 10:,} more failed lines in {report_path(self.out)}")
        return "\n".join(lines)


def report_path(out: str | os.PathLike) -> Path:
    return Path(f"{out}.report.json")


def part_path(out: str | os.PathLike) -> Path:
    return Path(f"{out}.part")


def state_path(out: str | os.PathLike) -> Path:
    return Path(f"{out}.part.json")


class _Rate:
    """Progress lines on stderr: rows, tokens/s and the ETA, every `interval` seconds."""

    def __init__(self, total_rows: int, interval: float = 5.0):
        self.total, self.rows, self.tokens, self.interval = max(total_rows, 1), 0, 0, interval
        self.t0 = self.last = time.perf_counter()

    def update(self, rows: int, tokens: int, force: bool = False) -> None:
        self.rows += rows
        self.tokens += tokens
        now = time.perf_counter()
        if force or now - self.last >= self.interval:
            self.last, dt = now, max(now - self.t0, 1e-9)
            eta = (self.total - self.rows) * dt / self.rows if self.rows else float("inf")
            sys.stderr.write(f"eagle-fast: {100 * self.rows / self.total:5.1f}% {self.rows:,}/{self.total:,} rows "
                             f"{self.tokens:,} tok {self.tokens / dt:,.0f} tok/s ETA {fmt_secs(eta)}\n")
            sys.stderr.flush()


def _resume_state(cfg: RegenerateConfig, sha: str, n_chunks: int) -> dict:
    """The sidecar to continue from (a fresh one when there is none); refuses a mismatch."""
    state = {"version": STATE_VERSION, "data_sha256": sha, "settings": cfg.settings(), "chunks": []}
    sp, pp = state_path(cfg.out), part_path(cfg.out)
    if not sp.exists():
        pp.unlink(missing_ok=True)  # rows with no sidecar were never recorded: start over
        return state
    try:
        old = json.loads(sp.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{sp} is unreadable ({exc})", f"delete {sp} and {pp} to start over") from None
    fix = f"re-run with the settings of the interrupted run, or delete {sp} and {pp} to start over"
    if old.get("data_sha256") != sha:
        raise UserError(f"{pp} was made from another version of {cfg.data}", fix)
    if old.get("settings") != state["settings"]:
        diff = sorted(k for k in state["settings"] if old.get("settings", {}).get(k) != state["settings"][k])
        raise UserError(f"{pp} was made with other settings ({', '.join(diff)} differ)", fix)
    if len(old.get("chunks", [])) > n_chunks:
        raise UserError(f"{sp} records more chunks than {cfg.data} has", fix)
    return old


def regenerate(cfg: RegenerateConfig, ray=None) -> Summary:
    """Run (or resume) `cfg`; returns the summary, also written to `OUT.report.json`."""
    cfg.check()
    spec = DataSpec.of(cfg.data)
    drawn = draw(spec)
    n_read, sha = len(drawn), drawn.digest
    failures: list[Failure] = []
    n_rows, calling = 0, []  # a first pass, streamed: the counts, the failures and the calling rows
    for got in stream_rows(spec, drawn):
        if isinstance(got, Failure):
            failures.append(got)
            continue
        n_rows += 1
        if got.record.kind == "messages" and any(m.get("tool_calls") for m in got.record.value):
            calling.append(got.line)
    if calling and cfg.tool_turns == "regenerate" and cfg.tool_call_parser is None:
        raise UserError(f"{len(calling):,} rows have tool calls (the first on line {calling[0]}), and regenerating them "
                        "needs vLLM's tool parser for this model",
                        "pass --tool-call-parser NAME (vLLM's name: hermes for Qwen3, llama3_json, mistral, openai "
                        "for gpt-oss, ...), or --tool-turns keep to keep tool calls and their results verbatim")
    n_chunks = -(-n_rows // cfg.chunk_rows)

    def chunk_len(c: int) -> int:
        return min(cfg.chunk_rows, n_rows - c * cfg.chunk_rows)

    report = report_path(cfg.out)
    if Path(cfg.out).exists() and not state_path(cfg.out).exists():
        done = json.loads(report.read_text()) if report.exists() else {}
        if done.get("data_sha256") == sha and done.get("settings") == cfg.settings():
            logger.info(f"{cfg.out} is complete; nothing to do")
            return Summary.from_json(done)
        raise UserError(f"{cfg.out} exists" + (", made from other data or settings" if done else
                                                ", and is not the output of a finished regenerate run"),
                        "pass another --out, or delete it (and its .report.json) to redo it")
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    state = _resume_state(cfg, sha, n_chunks)
    summary = Summary(cfg.out, n_read, failures=list(failures))
    for rec in state["chunks"]:
        summary_part = Summary.from_json(rec["summary"])
        _merge(summary, summary_part)
    summary.resumed_chunks = len(state["chunks"])
    pending = list(range(len(state["chunks"]), n_chunks))
    t0 = time.perf_counter()
    if pending:
        kept = _trim_part(cfg, state)
        chunks = ChunkStream(spec, drawn, cfg.chunk_rows, pending[0], n_chunks)  # read as the engines ask
        results = ray_chunks(cfg, chunks, ray) if ray is not None else local_chunks(cfg, chunks)
        rate = _Rate(sum(chunk_len(c) for c in pending))
        for c, outputs in zip(pending, results):
            try:
                _commit_chunk(cfg, state, summary, c, outputs, kept if c == pending[0] else 0)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                left = sum(chunk_len(d) for d in pending if d >= c)
                raise UserError(f"the disk filled while writing {part_path(cfg.out)} ({exc.strerror}): {left:,} rows "
                                "are still to be written; the chunks finished so far are kept",
                                "free space, then re-run the same command: it resumes from the last finished "
                                "chunk") from exc
            summary.run_tokens += sum(o.tokens for o in outputs)
            rate.update(len(outputs), sum(o.tokens for o in outputs), force=c == pending[-1])
    summary.seconds = time.perf_counter() - t0
    summary.complete = True
    _finish(cfg, state, summary, sha)
    return summary


def _merge(total: Summary, part: Summary) -> None:
    total.regenerated += part.regenerated
    total.passed_through += part.passed_through
    total.failures += part.failures
    total.turns += part.turns
    total.tokens += part.tokens
    total.truncated += part.truncated
    total.cut += part.cut


def _trim_part(cfg: RegenerateConfig, state: dict) -> int:
    """Cut `OUT.part` back to its last recorded chunk plus the complete lines after it; the
    number of those lines (rows of the next chunk already written)."""
    pp = part_path(cfg.out)
    size = state["chunks"][-1]["bytes"] if state["chunks"] else 0
    if not pp.exists():
        if size:
            raise UserError(f"{pp} is missing but {state_path(cfg.out)} records {size} bytes of it",
                            f"delete {state_path(cfg.out)} to start over")
        pp.touch()
        return 0
    data = pp.read_bytes()
    if len(data) < size:
        raise UserError(f"{pp} is shorter ({len(data)} bytes) than recorded ({size})",
                        f"delete {pp} and {state_path(cfg.out)} to start over")
    tail = data[size:]
    keep = tail[: tail.rfind(b"\n") + 1]
    with open(pp, "r+b") as f:
        f.truncate(size + len(keep))
        os.fsync(f.fileno())
    return keep.count(b"\n")


def _commit_chunk(cfg: RegenerateConfig, state: dict, summary: Summary, c: int, outputs: list[TurnOutput],
                  already: int) -> None:
    """Append chunk c's rows (skipping the `already` written ones), fsync, record it."""
    part = Summary(cfg.out)
    lines = []
    for out in outputs:
        part.add(out)
        if out.text is not None:
            lines.append(out.text)
    pp = part_path(cfg.out)
    with open(pp, "ab") as f:
        f.write("".join(line + "\n" for line in lines[already:]).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    state["chunks"].append({"chunk": c, "bytes": size, "summary": part.to_json()})
    atomic_write_json(state_path(cfg.out), state)
    _merge(summary, part)


def _finish(cfg: RegenerateConfig, state: dict, summary: Summary, sha: str) -> None:
    """Report, then OUT.part -> OUT, then drop the sidecar; each step is safe to redo after a crash."""
    atomic_write_json(report_path(cfg.out), {**summary.to_json(), "data": str(cfg.data), "data_sha256": sha,
                                              "settings": state["settings"]})
    if part_path(cfg.out).exists() or not Path(cfg.out).exists():
        os.replace(part_path(cfg.out), cfg.out)
        fsync_dir(Path(cfg.out).resolve().parent)
    state_path(cfg.out).unlink()


class ChunkStream:
    """Chunks [first, n) of the data's good rows, `size` rows each, read from the data as they
    are asked for, in order (`ray_chunks` dispatches them so): one chunk of rows held at a time."""

    def __init__(self, spec: DataSpec, drawn, size: int, first: int, n: int):
        self._rows = (r for r in stream_rows(spec, drawn) if isinstance(r, Row))
        self._size, self._first, self._n, self._next = size, first, n, 0
        for _ in itertools.islice(self._rows, first * size):
            pass

    def __len__(self) -> int:
        return self._n - self._first

    def __getitem__(self, k: int) -> list[Row]:
        if k != self._next or k >= len(self):
            raise IndexError(f"chunk {k} asked for out of order (next is {self._next} of {len(self)})")
        self._next += 1
        return list(itertools.islice(self._rows, self._size))

    def __iter__(self):
        return (self[k] for k in range(self._next, len(self)))


def local_chunks(cfg: RegenerateConfig, chunks):
    """Each chunk's outputs, from one engine in this process (a generator: the engine stops
    when it is exhausted or closed)."""
    tok = load_tokenizer(cfg.model)
    llm = generation.start(generation_kwargs(cfg.model, cfg.dtype, cfg.vllm))
    try:
        max_len = generation.max_model_len(llm)
        for rows in chunks:
            yield chunk_outputs(llm, tok, cfg, rows, max_len)
    finally:
        generation.stop(llm)
