"""Rows as records: one row of `--data` (a jsonl line, or a table's or JSON array's row)
validated and read as `Record` (input_ids [+ loss_mask] | text | chat `messages` | ShareGPT
`conversations`, agentic rows' `tools` and tool calls included), and the drawn rows of a
`mixing.Draw` read into records. A bad row raises UserError naming its file and row.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from eagle_fast.chat import REASONING_FIELDS
from eagle_fast.errors import bad_line
from eagle_fast.mixing import DataSpec, Draw, Item, draw, renamed

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool",
                  # LLaMA-Factory's agentic roles: a call (its value the JSON call) and its result
                  "function_call": "assistant", "observation": "tool"}

@dataclass
class Record:
    line: int
    kind: str          # input_ids | text | messages
    value: Any
    loss_mask: list[int] | None = None
    source_line: int | None = None  # the line of the original data (a `regenerate` output's rows say)
    tools: list[dict] | None = None  # a chat row's function schemas, passed to the chat template
    source: int = 0  # which --data it came from (`mixing`); `line` is its row there
    where: tuple[str, int] | None = None  # the file and row an error names (a table's own file), if not line


_FIX_FORMAT = ('make each line one JSON object with "messages" (chat), "text", or "input_ids" '
               '(+ optional "loss_mask")')


def _arguments(path: str, line: int, where: str, args: Any) -> dict:
    """A call's arguments as the object templates expect (the OpenAI wire form is a JSON string)."""
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise bad_line(path, line, f"{where}: arguments are not valid JSON ({exc.msg} at column {exc.colno})",
                           "give the arguments as a JSON object, or a string holding one") from None
    if not isinstance(args, dict):
        raise bad_line(path, line, f"{where}: arguments must be a JSON object, got {type(args).__name__}",
                       "give the arguments as a JSON object, or a string holding one")
    return args


def _tool_calls(path: str, line: int, i: int, calls: Any) -> list[dict]:
    """OpenAI `tool_calls` (or LLaMA-Factory's {"name", "arguments"} calls), normalised."""
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise bad_line(path, line, f"message {i}: tool_calls must be a non-empty list of calls", _FIX_TOOLS)
    out = []
    for j, call in enumerate(calls, 1):
        fn = call.get("function", call) if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_line(path, line, f"message {i}, call {j}: no function name", _FIX_TOOLS)
        norm: dict[str, Any] = {"type": call.get("type", "function"),
                                "function": {"name": name, "arguments": _arguments(
                                    path, line, f"message {i}, call {j} ({name})", fn.get("arguments"))}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str) or not call["id"]:
                raise bad_line(path, line, f"message {i}, call {j} ({name}): its id must be a non-empty string",
                               "give the call's id as a string, or leave it out")
            norm["id"] = call["id"]
        out.append(norm)
    return out


_MEDIA = {"image", "image_url", "input_image", "video", "video_url", "audio", "input_audio"}


def _text(path: str, line: int, i: int, key: str, content: Any) -> str | None:
    """A message's content as text: a string, or OpenAI text parts joined; None when absent."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    media = sorted({p.get("type") for p in content if isinstance(p, dict)} & _MEDIA) if isinstance(content, list) else []
    if media:
        raise bad_line(path, line, f'message {i} has {" and ".join(media)} parts: eagle_fast extracts text chats '
                       "only (its engines here run no vision tower)",
                       "drop the line, or keep its text parts only (images are never supervised)")
    raise bad_line(path, line, f'message {i} has no string "{key}" (nor a list of text parts)',
                   f'give every message a "{key}" string')


_FIX_TOOLS = ('give each call {"type": "function", "function": {"name": ..., "arguments": {...}}} (OpenAI '
              'form; arguments may be a JSON string)')


def _parse_messages(path: str, line: int, msgs: Any, sharegpt: bool) -> list[dict]:
    key = "conversations" if sharegpt else "messages"
    if not isinstance(msgs, list):
        raise bad_line(path, line, f'"{key}" must be a list of messages, got {type(msgs).__name__}', _FIX_FORMAT)
    if not msgs:
        raise bad_line(path, line, f'empty "{key}" list', "drop the line or give it at least one message")
    out = []
    for i, m in enumerate(msgs, 1):
        if not isinstance(m, dict):
            raise bad_line(path, line, f"message {i} is a {type(m).__name__}, not an object", _FIX_FORMAT)
        role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
        role = m.get(role_key)
        allowed = SHAREGPT_ROLES if sharegpt else ROLES
        if role not in allowed:
            raise bad_line(
                path, line, f"unknown role {role!r} in message {i}",
                f"use one of {', '.join(sorted(allowed) if sharegpt else ROLES)}",
            )
        content = _text(path, line, i, content_key, m.get(content_key))
        calls = None
        if sharegpt and role == "function_call":
            try:
                calls = json.loads(content or "")
            except json.JSONDecodeError as exc:
                raise bad_line(path, line, f"message {i} (function_call): its value is not a JSON call "
                               f"({exc.msg} at column {exc.colno})", _FIX_TOOLS) from None
            content = ""
        elif not sharegpt and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
        msg = {"role": SHAREGPT_ROLES[role] if sharegpt else role}
        if calls is not None:
            if msg["role"] != "assistant":
                raise bad_line(path, line, f"message {i} ({msg['role']}) has tool_calls",
                               "only assistant messages call tools")
            msg["content"] = content or ""
            msg["tool_calls"] = _tool_calls(path, line, i, calls)
        elif content is None:
            raise bad_line(path, line, f'message {i} has no string "{content_key}"',
                           f'give every message a "{content_key}" string')
        else:
            msg["content"] = content
        for extra in ("name", "tool_call_id"):
            if not sharegpt and m.get(extra) is not None:  # a table's message structs hold nulls
                if not isinstance(m[extra], str):
                    raise bad_line(path, line, f'message {i}: "{extra}" must be a string, got {type(m[extra]).__name__}',
                                   f'give "{extra}" as a string, or leave it out')
                msg[extra] = m[extra]
        given = {name: m[name] for name in REASONING_FIELDS if m.get(name) is not None}
        if given:
            if msg["role"] != "assistant":
                raise bad_line(path, line, f"message {i} ({msg['role']}) has {', '.join(given)}",
                               "only assistant messages carry reasoning")
            if any(not isinstance(v, str) for v in given.values()) or len(set(given.values())) > 1:
                raise bad_line(path, line, f"message {i} has {' and '.join(given)} that are not one string",
                               f"give the reasoning once, as a string, in one of {', '.join(REASONING_FIELDS)}")
            msg["reasoning"] = next(iter(given.values()))
        out.append(msg)
    if not any(m["content"] or m.get("tool_calls") for m in out):
        raise bad_line(path, line, "every message is empty", "drop the line or fill in its messages")
    return out


_FIX_SCHEMA = ('give each tool {"type": "function", "function": {"name": ..., "parameters": {...}}} (OpenAI '
               'form), or the bare {"name": ..., "parameters": {...}} (LLaMA-Factory\'s), as a list or a JSON string')


def _tools(path: str, line: int, tools: Any) -> list[dict] | None:
    """A row's `tools` in the form templates read (OpenAI's, which transformers also makes from
    schemas): each {"type": "function", "function": SCHEMA}, whether the row wraps it so or gives
    the bare schema (LLaMA-Factory's ShareGPT, the Responses API's flat form), as a list or a JSON
    string of one. Every form of one tool list gives the same list."""
    if tools is None:
        return None
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise bad_line(path, line, f'"tools" is a string that is not JSON ({exc.msg} at column {exc.colno})',
                           _FIX_SCHEMA) from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_line(path, line, '"tools" must be a list of function schemas (objects)', _FIX_SCHEMA)
    out = []
    for k, tool in enumerate(tools, 1):
        kind = tool.get("type", "function")
        if kind != "function":
            raise bad_line(path, line, f'"tools" item {k} is a {kind!r} tool, not a function', _FIX_SCHEMA)
        if "function" in tool:  # wrapped: {"type": "function", "function": {...}}, other keys kept after it
            fn, extra = tool["function"], {key: v for key, v in tool.items() if key not in ("type", "function")}
        else:  # bare (or flat): the schema itself
            fn, extra = {key: v for key, v in tool.items() if key != "type"}, {}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_line(path, line, f'"tools" item {k} has no function name', _FIX_SCHEMA)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_line(path, line, f'"tools" item {k} ({fn["name"]}): "parameters" must be a JSON schema object',
                           _FIX_SCHEMA)
        out.append({"type": "function", "function": fn, **extra})
    return out or None


def _system(path: str, line: int, msgs: list[dict], system: Any) -> list[dict]:
    """LLaMA-Factory's ShareGPT `system` column, as the system message it stands for."""
    if system is None or (isinstance(system, str) and not system.strip()):
        return msgs
    if not isinstance(system, str):
        raise bad_line(path, line, f'"system" must be a string, got {type(system).__name__}',
                       'give "system" as the system prompt\'s text')
    if msgs[0]["role"] == "system":
        raise bad_line(path, line, 'the row has a "system" column and a system message', "keep one of the two")
    return [{"role": "system", "content": system}, *msgs]


def parse_line(path: str, line: int, raw: str, columns: tuple[tuple[str, str], ...] = ()) -> Record:
    """Validate one jsonl line; raise UserError with file:line and the reason."""
    if not raw.strip():
        raise bad_line(path, line, "empty line", "remove blank lines from the file")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise bad_line(path, line, f"invalid JSON ({exc.msg} at column {exc.colno})", _FIX_FORMAT) from None
    if not isinstance(obj, dict):
        raise bad_line(path, line, f"expected a JSON object, got {type(obj).__name__}", _FIX_FORMAT)
    obj = renamed(obj, columns)
    return _with_source(path, line, obj, _parse_object(path, line, obj))


def parse_row(path: str, line: int, obj: Any, columns: tuple[tuple[str, str], ...] = ()) -> Record:
    """One row of a table or JSON array (`line`: its number from 1), as `parse_line` reads a line."""
    obj = renamed(obj, columns)
    if not isinstance(obj, dict):
        raise bad_line(path, line, f"expected an object, got {type(obj).__name__}", _FIX_FORMAT)
    return _with_source(path, line, obj, _parse_object(path, line, obj))


def _with_source(path: str, line: int, obj: dict, rec: Record) -> Record:
    source = obj.get("source_line")
    if source is not None:
        if isinstance(source, bool) or not isinstance(source, int) or source < 1:
            raise bad_line(path, line, f'"source_line" must be a positive line number, got {source!r}',
                           "drop the field, or give the line of the original data it came from")
        rec.source_line = source
    return rec


def _parse_object(path: str, line: int, obj: dict) -> Record:
    if "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_line(path, line, '"input_ids" must be a list of integers', _FIX_FORMAT)
        if not ids:
            raise bad_line(path, line, 'empty "input_ids"', "drop the line or give it tokens")
        if min(ids) < 0:
            raise bad_line(path, line, f"negative token id {min(ids)} in input_ids", "token ids are >= 0")
        mask = obj.get("loss_mask")
        if mask is not None:
            if not isinstance(mask, list) or not all(v in (0, 1) for v in mask):
                raise bad_line(path, line, '"loss_mask" must be a list of 0/1 (or true/false)', _FIX_FORMAT)
            if len(mask) != len(ids):
                raise bad_line(path, line, f"loss_mask has {len(mask)} entries for {len(ids)} input_ids",
                           "give loss_mask exactly one entry per token")
            mask = [int(v) for v in mask]
        return Record(line, "input_ids", ids, mask)
    if "messages" in obj or "conversations" in obj:
        sharegpt = "messages" not in obj
        msgs = _parse_messages(path, line, obj["conversations" if sharegpt else "messages"], sharegpt)
        if sharegpt:
            msgs = _system(path, line, msgs, obj.get("system"))
        return Record(line, "messages", msgs, tools=_tools(path, line, obj.get("tools")))
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            raise bad_line(path, line, f'"text" must be a string, got {type(text).__name__}', _FIX_FORMAT)
        if not text.strip():
            raise bad_line(path, line, 'empty "text"', "drop the line or give it text")
        return Record(line, "text", text)
    keys = ", ".join(sorted(obj)) or "none"
    raise bad_line(path, line, f"no usable field (found keys: {keys})", _FIX_FORMAT)


def read_records(data: str | os.PathLike | DataSpec) -> tuple[list[Record], str]:
    """All records of `--data` plus its sha256 (`read_data`)."""
    records, drawn = read_data(data)
    return records, drawn.digest


def read_data(data: str | os.PathLike | DataSpec) -> tuple[list[Record], Draw]:
    """The records `--data` gives (`mixing.draw`: one source, every row; several, the draw), and
    the draw's digest and counts. Every form `sources` reads; the first bad row raises, naming
    its file and row."""
    spec = DataSpec.of(data)
    drawn = draw(spec)
    return [record_of(item, spec.columns) for item in drawn], drawn


def record_of(item: Item, columns: tuple[tuple[str, str], ...] = ()) -> Record:
    """One drawn row as a record (a jsonl line's bytes checked and parsed; a table's row parsed)."""
    path, line = item.where
    if isinstance(item.payload, bytes):
        try:
            text = item.payload.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_line(path, line, "not valid UTF-8", "save the file as UTF-8") from None
        rec = parse_line(path, line, text, columns)
    else:
        rec = parse_row(path, line, item.payload, columns)
    rec.line, rec.source, rec.where = item.row, item.source, item.where
    return rec


def at(rec: Record, path: str) -> tuple[str, int]:
    """(file, row) an error about `rec` names: where it was read, else `path` and its line."""
    return rec.where or (path, rec.line)
