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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from eagle_fast.chat import ChatFormat, for_template, render
from eagle_fast.errors import UserError
from eagle_fast.mixing import DataSpec, Draw, draw, renamed
from eagle_fast.records import Record, record_of


@dataclass
class Row:
    """One parsed input row: its place in the data from 1 (a plain file's line), the JSON object
    as read (mapped columns under their known names), and the record. A mix's row also names
    its source (`source`: the --data as given) and its row there."""

    line: int
    obj: dict[str, Any]
    record: Record
    source: str | None = None
    source_row: int | None = None

    @property
    def origin(self) -> int:
        """The original data's line: the row's own `source_line`, else its row in its source."""
        return self.obj.get("source_line", self.source_row or self.line)


@dataclass
class Failure:
    """A row that produced no output: where, why and what to do (`where`: a mix's source:row, or
    the file and row of a table in several files)."""

    line: int
    cause: str
    fix: str | None = None
    where: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "cause": self.cause, "fix": self.fix, **({"where": self.where} if self.where else {})}


def read_rows(data: str | os.PathLike | DataSpec) -> tuple[list[Row], list[Failure], int, str]:
    """(rows, failures, rows read, the data's sha256). A bad row is a Failure, never fatal; a
    missing or empty file is (UserError). Every form `extract` reads, and mixes (`mixing`):
    rows are numbered from 1 in the data's order, as a jsonl file's lines are."""
    spec = DataSpec.of(data)
    drawn = draw(spec)
    rows: list[Row] = []
    failures: list[Failure] = []
    for got in stream_rows(spec, drawn):
        (rows if isinstance(got, Row) else failures).append(got)
    return rows, failures, len(drawn), drawn.digest


def stream_rows(spec: DataSpec, drawn: Draw) -> Iterator[Row | Failure]:
    """Each drawn row as a Row, or as a Failure when it is bad, read as it is asked for."""
    mixed = len(spec.sources) > 1
    for n, item in enumerate(drawn, 1):
        path, row = item.where
        where = f"{path}:{row}" if mixed or (path, row) != (spec.sources[0].path, n) else None
        try:
            record = record_of(item, spec.columns)
        except UserError as exc:
            prefix = f"{path}:{row}: "
            yield Failure(n, exc.cause.removeprefix(prefix), exc.fix, where)
            continue
        obj = json.loads(item.payload) if isinstance(item.payload, bytes) else dict(item.payload)
        yield Row(n, renamed(obj, spec.columns), record, spec.sources[item.source].given if mixed else None,
                  item.row if mixed else None)


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
