"""A conversation regenerated turn by turn, and one chunk of them through one engine.

`Conversation` walks a chat row's messages in order. System, user and tool messages, and an
assistant turn that calls tools (the tool results after it answer those calls), are kept
verbatim; every other assistant turn is generated from the conversation so far, whose earlier
assistant turns are the target's own regenerated answers. A conversation that ends in a user
(or tool) turn gets one generated final assistant turn. A row with nothing to generate passes
through unchanged.

`run_chunk` regenerates a chunk of rows in rounds: round r prompts every conversation still
waiting for a turn, in row order, in one `generate` call. Nothing outside the chunk decides
what a chunk produces (the prefix cache is reset first), so a resumed run, or a Ray worker,
recomputes a chunk exactly as one uninterrupted process does.

Reasoning: when the rendered prompt ends by opening a think block (`<think>`), or the output
starts with one, the text up to `</think>` is the turn's reasoning. It is kept under
`reasoning_content` (`--reasoning keep`), where Qwen3- and DeepSeek-style templates read it, or
dropped (`--reasoning drop`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle_fast.chat import ChatFormat
from eagle_fast.errors import UserError
from eagle_fast.loop.rows import Failure, Row, prompt_text, raw_messages

THINK_OPEN_RE = re.compile(r"^\s*<think>")
# (prompt ids, row line) -> (generated ids, finish reason) per prompt, in order
Generate = Callable[[list[tuple[list[int], int]]], list[tuple[list[int], str]]]
# (a turn's content, the row's tools) -> (the content left, the tool calls found in it)
ParseCalls = Callable[[str, "list[dict] | None"], tuple[str, list[dict]]]


@dataclass
class TurnOutput:
    """What `run_chunk` made of one row: its output JSON line, or its failure."""

    line: int
    text: str | None = None
    failure: Failure | None = None
    passed_through: bool = False
    turns: int = 0
    tokens: int = 0
    truncated: list[int] = field(default_factory=list)  # message indices stopped at --max-tokens
    cut: int | None = None  # the message after which the conversation was cut (a diverging tool call)


def split_reasoning(prompt: str, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a generated turn (see the module doc)."""
    opened = prompt.rstrip().endswith("<think>")
    m = None if opened else THINK_OPEN_RE.match(text)
    if not opened and m is None:
        return None, text
    body = text[m.end():] if m else text
    if "</think>" not in body:
        return body.strip("\n"), ""  # stopped inside its reasoning (flagged when truncated)
    reasoning, content = body.split("</think>", 1)
    return reasoning.strip("\n"), content.lstrip("\n")


class Conversation:
    """One chat row being regenerated: the canonical messages the template renders, and the
    messages as they will be written (verbatim ones as the row had them)."""

    def __init__(self, row: Row, reasoning: str, tool_turns: str = "keep", parse: ParseCalls | None = None):
        self.row = row
        self.reasoning = reasoning
        self.tool_turns = tool_turns
        self.parse = parse
        self.original: dict | None = None       # the source turn being regenerated (None: a final one)
        self.cut: int | None = None             # the message after which a diverging call cut it
        self.source = row.record.value          # canonical (reasoning under "reasoning")
        self.raw = raw_messages(row)            # as written in the file
        self.canon: list[dict] = []
        self.out: list[dict] = []
        self.pos = 0
        self.turns = 0
        self.tokens = 0
        self.truncated: list[int] = []
        self.pending_prompt: str | None = None
        self.failure: Failure | None = None

    def next_turn(self) -> list[dict] | None:
        """Copy verbatim messages up to the next turn to generate; the conversation it is
        generated from, or None when the row is complete."""
        if self.cut is not None:
            return None
        while self.pos < len(self.source):
            m, raw = self.source[self.pos], self.raw[self.pos]
            self.pos += 1
            if m["role"] == "assistant" and (self.tool_turns == "regenerate" or not m.get("tool_calls")):
                self.original = m
                return self.canon
            self.canon.append(m)
            self.out.append(raw)
        if self.canon and self.canon[-1]["role"] in ("user", "tool"):
            self.pos += 1  # the final turn it ends waiting for
            self.original = None
            return self.canon
        return None

    def answer(self, ids: list[int], text: str, finish: str) -> None:
        reasoning, content = split_reasoning(self.pending_prompt or "", text)
        canon: dict[str, Any] = {"role": "assistant", "content": content}
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None and self.reasoning == "keep":
            canon["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
        if finish == "length":
            self.truncated.append(len(self.out))
        if self.tool_turns == "regenerate":
            self._pair_calls(canon, out)
        self.canon.append(canon)
        self.out.append(out)
        self.turns += 1
        self.tokens += len(ids)

    def _pair_calls(self, canon: dict, out: dict) -> None:
        """The target's tool calls (vLLM's parser) set on its turn; a result is kept only for the
        call it answered: calls equal to the original's (names and arguments, in order) keep their
        ids and the results after them; any other call, or none where the original called, cuts
        the conversation after this turn."""
        calls: list[dict] = []
        if self.parse is not None:
            canon["content"], calls = self.parse(canon["content"], self.row.record.tools)
            out["content"] = canon["content"]
        want = (self.original or {}).get("tool_calls") or []
        if calls and [c["function"] for c in calls] == [c["function"] for c in want]:
            calls = [{**c, **({"id": w["id"]} if "id" in w else {})} for c, w in zip(calls, want)]
        elif calls or want:
            self.cut = len(self.out)
            calls = [{**c, "id": f"call_{self.row.line}_{len(self.out)}_{j}"} for j, c in enumerate(calls)]
        if calls:
            canon["tool_calls"] = out["tool_calls"] = calls

    def output(self) -> TurnOutput:
        if self.failure is not None:
            return TurnOutput(self.row.line, failure=self.failure)
        if self.turns == 0:
            return passthrough(self.row)
        obj = _with_messages(self.row.obj, self.out)
        obj.update(provenance(self.row))
        obj["regenerated_turns"] = self.turns
        if self.truncated:
            obj["truncated_turns"] = list(self.truncated)
        if self.cut is not None:
            obj["cut_after_message"] = self.cut
        return TurnOutput(self.row.line, text=dump_row(obj), turns=self.turns, tokens=self.tokens,
                          truncated=list(self.truncated), cut=self.cut)


def _with_messages(obj: dict, messages: list[dict]) -> dict:
    """`obj` with its messages (or ShareGPT conversations) replaced by `messages`, in place."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if key in ("messages", "conversations"):
            out["messages"] = messages
        elif key not in ("regenerated_turns", "truncated_turns", "cut_after_message"):
            out[key] = value
    return out


def dump_row(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False)


def passthrough(row: Row) -> TurnOutput:
    obj = {**row.obj, **provenance(row)}
    return TurnOutput(row.line, text=dump_row(obj), passed_through=True)


def provenance(row: Row) -> dict[str, Any]:
    """What an output row keeps of its origin: the original data's line, and a mix's source."""
    return {"source_line": row.origin, **({"data_source": row.obj.get("data_source", row.source)} if row.source else {})}


def decode(tok, outputs: list[list[int]], keep_special: bool = False) -> list[str]:
    """Generated ids as text. `keep_special` (a tool parser reads the text): special tokens stay,
    as vLLM keeps them for its parsers (some models mark <tool_call> special), but for the stop
    token(s) that end the turn."""
    if not keep_special:
        return tok.batch_decode(outputs, skip_special_tokens=True)
    special = set(tok.all_special_ids)
    trimmed = []
    for ids in outputs:
        end = len(ids)
        while end and ids[end - 1] in special:
            end -= 1
        trimmed.append(ids[:end])
    return tok.batch_decode(trimmed, skip_special_tokens=False)


def run_chunk(rows: list[Row], tok, fmt: ChatFormat, generate: Generate, max_model_len: int,
              reasoning: str = "keep", on_round: Callable[[int, int], None] | None = None,
              tool_turns: str = "keep", parse: ParseCalls | None = None) -> list[TurnOutput]:
    """Regenerate `rows` (see the module doc); one TurnOutput per row, in order. `on_round`:
    called with (turns, tokens) after each engine call, for progress."""
    convs: list[tuple[int, Conversation]] = []
    outputs: dict[int, TurnOutput] = {}
    for i, row in enumerate(rows):
        if row.record.kind == "messages":
            convs.append((i, Conversation(row, reasoning, tool_turns, parse)))
        else:
            outputs[i] = passthrough(row)
    active = [c for _, c in convs]
    while active:
        texts: list[tuple[Conversation, str]] = []
        for conv in active:
            msgs = conv.next_turn()
            if msgs is None:
                continue
            try:
                texts.append((conv, prompt_text(tok, msgs, fmt, conv.row.record.tools)))
            except UserError:
                raise  # the run's problem (no template at all), not this row's
            except Exception as exc:  # noqa: BLE001 -- a template that raises fails its row only
                conv.failure = Failure(conv.row.line, f"message {conv.pos}: the chat template cannot render the "
                                       f"conversation before it ({type(exc).__name__}: {exc})",
                                       "fix the row, or pass a --chat-template that renders it")
        # one tokenizer call per round (the fast tokenizer batches), as extract tokenises: no added specials
        encoded = tok([t for _, t in texts], add_special_tokens=False)["input_ids"] if texts else []
        batch: list[tuple[Conversation, list[int]]] = []
        for (conv, text), ids in zip(texts, encoded):
            if len(ids) >= max_model_len:
                conv.failure = Failure(conv.row.line, f"message {conv.pos}: the conversation before it is "
                                       f"{len(ids)} tokens, and the engine's context (--max-model-len) is "
                                       f"{max_model_len}, with no room left for an answer",
                                       "raise --max-model-len, or shorten or split the conversation")
                continue
            conv.pending_prompt = text
            batch.append((conv, list(ids)))
        if batch:
            results = generate([(ids, conv.row.line) for conv, ids in batch])
            decoded = decode(tok, [r[0] for r in results], keep_special=parse is not None)
            for (conv, _), (out_ids, finish), text in zip(batch, results, decoded):
                conv.answer(out_ids, text, finish)
            if on_round is not None:
                on_round(len(batch), sum(len(r[0]) for r in results))
        active = [c for c, _ in batch]
    for i, conv in convs:
        outputs[i] = conv.output()
    return [outputs[i] for i in range(len(rows))]


def chunk_outputs(llm, tok, cfg, rows: list[Row], max_model_len: int) -> list[TurnOutput]:
    """One chunk on the vLLM engine `llm` under `cfg` (a RegenerateConfig: sampling, chat,
    reasoning), from an empty prefix cache, so nothing run before decides its output."""
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()

    def generate(prompts: list[tuple[list[int], int]]) -> list[tuple[list[int], str]]:
        params = [cfg.sampling.params(line) for _, line in prompts]
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), str(o.outputs[0].finish_reason)) for o in outs]

    parse = tool_parser(cfg.tool_call_parser, tok) if cfg.tool_call_parser else None
    return run_chunk(rows, tok, cfg.chat, generate, max_model_len, cfg.reasoning, tool_turns=cfg.tool_turns,
                     parse=parse)


def tool_parser_names() -> list[str]:
    """vLLM's tool parser names (`--tool-call-parser`)."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def tool_parser(name: str, tok) -> ParseCalls:
    """A turn's tool calls as vLLM's `name` parser reads them from the generated text, normalised
    as `inputs` normalises a row's calls (arguments as an object)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    cls = ToolParserManager.get_tool_parser(name)

    def parse(content: str, tools: list[dict] | None) -> tuple[str, list[dict]]:
        request = ChatCompletionRequest(model="target", messages=[{"role": "user", "content": ""}], tools=tools)
        info = cls(tok, request.tools).extract_tool_calls(content, request)
        if not info.tools_called:
            return content, []
        calls = []
        for c in info.tool_calls:
            try:
                args = json.loads(c.function.arguments or "{}")
            except json.JSONDecodeError:
                args = c.function.arguments  # kept as the model wrote it: it will not match
            calls.append({"type": "function", "function": {"name": c.function.name, "arguments": args}})
        return (info.content or "").rstrip("\n"), calls

    return parse
