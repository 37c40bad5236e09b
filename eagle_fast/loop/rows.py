"""Input rows for `regenerate` and `accept`: every line read on its own, a bad one reported.

`extract` stops at the first bad line (nothing may be written from half a dataset). The loop's
commands instead go on past a bad line and report it (`Failure`: the line number, the cause and
the fix), so one malformed row in a million does not cost the run; the counts always add up
(read = done + passed through + failed).

Prompts: a conversation is rendered with the chat template in force (`ChatFormat`), its
generation prompt added, and tokenised without added special tokens, exactly as `extract`
tokenises a conversation (`chat.encode_chat`), so the engine sees the ids extraction will see.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from eagle_fast.chat import ChatFormat, for_template, render
from eagle_fast.errors import UserError
from eagle_fast.inputs import Record, parse_line, parse_row
from eagle_fast.sources import jsonl_lines, open_source, table_rows


@dataclass
class Row:
    """One parsed input line: its 1-based number, the JSON object as read, and the record."""

    line: int
    obj: dict[str, Any]
    record: Record


@dataclass
class Failure:
    """A row that produced no output: where, why and what to do."""

    line: int
    cause: str
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "cause": self.cause, "fix": self.fix}


def read_rows(path: str | os.PathLike) -> tuple[list[Row], list[Failure], int, str]:
    """(rows, failures, lines read, the file's sha256). A bad line is a Failure, never fatal;
    a missing or empty file is (UserError). Every form `extract` reads (`sources`): a table's rows
    are numbered from 1 as a jsonl file's lines are."""
    src = open_source(path)
    if src.kind != "jsonl":
        return _table_rows(src)
    p = src.path
    lines, digest = jsonl_lines(src)
    rows: list[Row] = []
    failures: list[Failure] = []
    for n, raw in enumerate(lines, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            failures.append(Failure(n, "not valid UTF-8", "save the file as UTF-8"))
            continue
        try:
            record = parse_line(p, n, text)
        except UserError as exc:
            failures.append(Failure(n, exc.cause.split(": ", 1)[-1] if exc.cause.startswith(f"{p}:{n}:")
                                    else exc.cause, exc.fix))
            continue
        rows.append(Row(n, json.loads(text), record))
    return rows, failures, len(lines), digest


def _table_rows(src) -> tuple[list[Row], list[Failure], int, str]:
    rows: list[Row] = []
    failures: list[Failure] = []
    n = 0
    for n, obj in table_rows(src):
        try:
            record = parse_row(src.path, n, obj)
        except UserError as exc:
            failures.append(Failure(n, exc.cause.split(": ", 1)[-1], exc.fix))
            continue
        rows.append(Row(n, dict(obj), record))
    if n == 0:
        raise UserError(f"--data {src.path} has no rows", "give it at least one row")
    return rows, failures, n, src.digest()


def raw_messages(row: Row) -> list[dict]:
    """The row's messages as written (ShareGPT rows: normalised, their keys being different)."""
    msgs = row.obj.get("messages")
    return list(msgs) if isinstance(msgs, list) else [dict(m) for m in row.record.value]


def until_last_user(messages: list[dict]) -> list[dict] | None:
    """The conversation up to and including its last user turn (None: it has no user turn)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    return None if last is None else messages[: last + 1]


def prompt_text(tok, messages: list[dict], fmt: ChatFormat, tools: list[dict] | None = None) -> str:
    """`messages` (canonical: reasoning under "reasoning") rendered with the generation prompt,
    the row's `tools` passed to the template."""
    template = fmt.template_for(tok)
    if not template:
        raise UserError("the tokenizer has no chat template, so chats cannot be rendered",
                        "pass --chat-template FILE")
    return render(tok, for_template(messages, template), fmt, template, add_generation_prompt=True, tools=tools)


def prompt_ids(tok, messages: list[dict], fmt: ChatFormat, tools: list[dict] | None = None) -> list[int]:
    """The token ids the engine is prompted with for `messages`: the rendering, tokenised as
    `extract` tokenises chats (no added special tokens)."""
    return list(tok(prompt_text(tok, messages, fmt, tools), add_special_tokens=False)["input_ids"])


def record_prompt(tok, row: Row, fmt: ChatFormat) -> list[int] | None:
    """A row as one prompt (accept): a conversation up to its last user turn with the generation
    prompt; a text row as its text; an input_ids row up to its first supervised token (all of
    it without a loss_mask). None: the row has no prompt (a chat without a user turn)."""
    rec = row.record
    if rec.kind == "messages":
        msgs = until_last_user(rec.value)
        return None if msgs is None else prompt_ids(tok, msgs, fmt, rec.tools)
    if rec.kind == "text":
        return list(tok(rec.value, add_special_tokens=False)["input_ids"])
    ids = list(rec.value)
    if rec.loss_mask is not None and 1 in rec.loss_mask:
        ids = ids[: max(1, rec.loss_mask.index(1))]
    return ids
