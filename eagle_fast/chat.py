"""Chat rows to token ids and the assistant-token loss mask, read off the full rendering.

A turn is supervised as the full conversation renders it, never as a rendering of a prefix:
templates such as Qwen3's render a turn differently once later turns exist (the think block
of a turn after the last user query, reasoning dropped from history, trimmed content).
`encode_chat` renders the conversation once (the ids are those of that text) and finds each
assistant turn in it:
  1. where its text is: the conversation is rendered again with only that turn's content
     swapped for a probe character; the two renderings differ exactly where the turn's
     content (and reasoning) lands; a turn that calls tools is rendered twice more, with its
     calls' arguments swapped (its text runs through its last call's) and with their names
     and ids swapped (its text starts no later than its first call's name or id);
  2. where the turn starts: after the assistant header, the longest part of the template's
     generation prompt written just before that place (so a think opener the prompt writes is
     not supervised, and one the model writes is); a template with no header (Mistral's)
     starts the turn where the message before it ends, when only special tokens lie between
     (`[/INST][TOOL_CALLS]name...`: the turn's own `[TOOL_CALLS]`);
  3. where it ends: through the first special token after its text that does not open a
     header (`<|im_end|>`, `<|eot_id|>`, `<|end|>`, `</s>`), before the next turn's text.
Characters map to tokens as transformers maps `{% generation %}` blocks (every token from
the first character's to the last's), so on a template with those markers the markers decide,
and both rules give one mask. An empty think block at the start of a turn (the one a template
inserts when there is no reasoning) is not supervised unless `supervise_empty_think`; the
content's own leading whitespace always is. A turn that cannot be placed unambiguously (the
probe changes text before the turn, or no header is found), or whose template writes only some
of its tool calls (gpt-oss's writes a turn's first), raises `ChatMaskError`; `inputs` reports
it with the line.
`for_template` gives the messages as the template reads them: reasoning under the field it
reads, and, where it reads call ids (Mistral renders and checks them), an id for every call
without one (ShareGPT's have none) and each result its call's.

Limits: fast tokenizers only (character offsets); the probe must leave the template's branches
on other turns alone, which every shipped template tested here does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

from eagle_fast.errors import UserError

# The rule `encode_chat` applies, recorded in manifests: a dataset made under another rule is
# never resumed with this one.
# v2: a tool-calling turn runs through its calls (Llama-4); v3: from its first call's name or id,
# and its own special tokens on a template without a header (Mistral), and a content's leading
# whitespace after an empty think block
MASK_RULE = "full-render-v3"
GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
EMPTY_THINK_RE = re.compile(r"<think>\s*</think>\n*")  # the newlines the template writes after it
# Where the message's reasoning goes, by the field name a template reads it from (Qwen3 and
# DeepSeek: reasoning_content; vLLM's own templates: reasoning; gpt-oss: thinking).
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
_FIELD_RE = {name: re.compile(rf"(?:\.|\[\s*['\"]){name}\b") for name in REASONING_FIELDS}
# A template that reads a call's id or a result's tool_call_id (Mistral: 9 letters or digits);
# on the others an id changes nothing, so none is made up for them.
READS_IDS_RE = re.compile(r"tool_call_id|(?:\.|\[\s*['\"])id\b")
_ID_CHARS = string.digits + string.ascii_letters


class ChatMaskError(ValueError):
    """A conversation whose assistant turns cannot be placed in its rendering (the reason), and
    the fix where it is not the generic one."""

    def __init__(self, reason: str, fix: str | None = None):
        super().__init__(reason)
        self.fix = fix


@dataclass(frozen=True)
class ChatFormat:
    """How chats are rendered and masked: the same for vocab, extract, serve and inspect.

    template: the chat template's text (`--chat-template FILE`), or None for the tokenizer's;
    kwargs: extra template variables (`--chat-template-kwargs`, e.g. enable_thinking);
    supervise_empty_think: keep an empty think block's tokens in the mask.
    """

    template: str | None = None
    template_file: str | None = None
    kwargs: dict = field(default_factory=dict)
    supervise_empty_think: bool = False

    def __hash__(self) -> int:
        return hash((self.template, json.dumps(self.kwargs, sort_keys=True), self.supervise_empty_think))

    @classmethod
    def from_args(cls, template_file: str | None = None, kwargs_json: str | None = None,
                  supervise_empty_think: bool = False) -> ChatFormat:
        """From the CLI's `--chat-template FILE`, `--chat-template-kwargs JSON` and
        `--supervise-empty-think`; a bad file or JSON raises UserError."""
        template = None
        if template_file is not None:
            p = Path(template_file)
            if not p.is_file():
                raise UserError(f"--chat-template {p} not found", "pass a Jinja chat template file")
            template = p.read_text(encoding="utf-8")
            if p.suffix == ".json":  # a tokenizer_config.json-style file holding the template
                try:
                    template = json.loads(template)["chat_template"]
                except (ValueError, KeyError, TypeError):
                    raise UserError(f"--chat-template {p} is JSON without a \"chat_template\" string",
                                    "pass the .jinja file, or a JSON object with \"chat_template\"") from None
            if not isinstance(template, str) or not template.strip():
                raise UserError(f"--chat-template {p} is empty", "pass a Jinja chat template file")
        kwargs: dict = {}
        if kwargs_json is not None:
            try:
                kwargs = json.loads(kwargs_json)
            except json.JSONDecodeError as exc:
                raise UserError(f"--chat-template-kwargs is not valid JSON ({exc.msg} at column {exc.colno})",
                                "pass a JSON object, e.g. '{\"enable_thinking\": false}'") from None
            if not isinstance(kwargs, dict):
                raise UserError(f"--chat-template-kwargs must be a JSON object, got {type(kwargs).__name__}",
                                "pass a JSON object, e.g. '{\"enable_thinking\": false}'")
            reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools", "documents"})
            if reserved:
                raise UserError(f"--chat-template-kwargs sets {', '.join(reserved)}, which eagle-fast sets itself",
                                "drop those keys")
        return cls(template, str(template_file) if template_file else None, kwargs, supervise_empty_think)

    def template_for(self, tok) -> str | None:
        """The template text in force: ours, else the tokenizer's (its default if it has several)."""
        if self.template is not None:
            return self.template
        t = getattr(tok, "chat_template", None)
        if isinstance(t, dict):
            t = t.get("default", next(iter(t.values()), None))
        return t

    def describe(self, tok=None) -> dict:
        """What the manifest records about how masks were made (the template by its sha256)."""
        template = self.template_for(tok) if tok is not None else self.template
        return {
            "rule": MASK_RULE,
            "template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "template_file": self.template_file,
            "kwargs": dict(sorted(self.kwargs.items())),
            "supervise_empty_think": self.supervise_empty_think,
        }


def for_template(messages: list[dict], template: str) -> list[dict]:
    """Messages as `template` reads them: a message's reasoning (canonical key "reasoning")
    goes under every reasoning field the template reads, else inline as <think>...</think>
    before the content where the template splits that, else it cannot be rendered; where the
    template reads call ids, calls and results without one get theirs (`with_call_ids`)."""
    fields = [name for name in REASONING_FIELDS if _FIELD_RE[name].search(template)]
    out = []
    for i, m in enumerate(messages, 1):
        reasoning = m.get("reasoning")
        m = {k: v for k, v in m.items() if k != "reasoning"}
        if reasoning is not None:
            if fields:
                m.update({name: reasoning for name in fields})
            elif "</think>" in template:
                m["content"] = f"<think>\n{reasoning}\n</think>\n\n{m.get('content') or ''}"
            else:
                raise ChatMaskError(f"message {i} has reasoning, and this chat template renders none "
                                    f"(it reads none of {', '.join(REASONING_FIELDS)} and no inline <think>)")
        out.append(m)
    return with_call_ids(out) if READS_IDS_RE.search(template) else out


def call_id(index: int, j: int, call: dict) -> str:
    """A 9-character id (letters and digits: Mistral's form, which its templates check) for call
    j of message `index`, made from the call, so every form of one row gets the same ids."""
    fn = call["function"]
    key = json.dumps([index, j, fn["name"], fn.get("arguments")], sort_keys=True, default=str)
    n = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "".join(_ID_CHARS[(n // 62 ** k) % 62] for k in range(9))


def with_call_ids(messages: list[dict]) -> list[dict]:
    """Every call without an id given one (`call_id`), and every tool result without a
    tool_call_id the id of the call it answers: the k-th result after a calling turn answers
    its k-th call (LLaMA-Factory's order)."""
    out, waiting = [], []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = [c if c.get("id") is not None else {**c, "id": call_id(i, j, c)}
                     for j, c in enumerate(m["tool_calls"])]
            m, waiting = {**m, "tool_calls": calls}, [c["id"] for c in calls]
        elif m["role"] == "tool":
            if m.get("tool_call_id") is None and waiting:
                m = {**m, "tool_call_id": waiting[0]}
            waiting = waiting[1:]
        else:
            waiting = []
        out.append(m)
    return out


def render(tok, messages: list[dict], fmt: ChatFormat, template: str, add_generation_prompt=False,
           tools: list[dict] | None = None) -> str:
    """The conversation as the template writes it; `tools`: the row's function schemas."""
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tools,
                                   add_generation_prompt=add_generation_prompt, **fmt.kwargs)


def encode_chat(tok, messages: list[dict], fmt: ChatFormat,
                tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation (see the header), its `tools` passed to the
    template (a tool call is part of its assistant turn; schemas and results never are). Raises
    ChatMaskError for a turn that cannot be placed; template errors propagate."""
    template = fmt.template_for(tok)
    msgs = for_template(messages, template)
    text = render(tok, msgs, fmt, template, tools=tools)
    enc = tok(text, add_special_tokens=False)
    if not enc.is_fast:
        raise ChatMaskError("masking chats needs a fast tokenizer (tokenizer.json) for character offsets")
    ids = list(enc["input_ids"])
    if GENERATION_RE.search(template):
        spans = _marked_spans(tok, msgs, fmt, template, text, tools)
        if not fmt.supervise_empty_think:
            spans = [_skip_empty_think(text, s, e) for s, e in spans]
    else:
        spans = assistant_spans(tok, msgs, fmt, template, text, tools)
    return ids, spans_to_mask(enc, spans, len(ids))


def spans_to_mask(enc, spans: list[tuple[int, int]], n: int) -> list[int]:
    """Token mask of character spans, as transformers turns `{% generation %}` blocks into one:
    every token from the one holding the span's first character to the one holding its last."""
    mask = [0] * n
    for s, e in spans:
        if e <= s:
            continue
        first = enc.char_to_token(s)
        if first is None:
            continue
        last = enc.char_to_token(e - 1)
        for t in range(first, (last if last is not None else n - 1) + 1):
            mask[t] = 1
    return mask


def _skip_empty_think(text: str, s: int, e: int, content: int | None = None) -> tuple[int, int]:
    """The span without an empty think block at its start, or one whose opener the generation
    prompt wrote just before it (enable_thinking: `<think>\\n` in the prompt, `\\n</think>` in
    the turn); never past `content`, where the turn's content starts (its own whitespace)."""
    opened = text.rfind("<think>", max(0, s - 16), s)
    for at in ([opened] if opened >= 0 and not text[opened + 7: s].strip() else []) + [s]:
        m = EMPTY_THINK_RE.match(text, at, e)
        if m:
            return max(m.end() if content is None else min(m.end(), content), s), e
    return s, e


def _marked_spans(tok, msgs, fmt, template, text, tools=None) -> list[tuple[int, int]]:
    """The `{% generation %}` blocks of a template that has them, as character spans."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(
        conversations=[msgs], tools=tools, chat_template=template, return_assistant_tokens_mask=True,
        **{**tok.special_tokens_map, **fmt.kwargs})
    if rendered[0] != text:
        raise ChatMaskError("the template renders differently with its generation blocks tracked")
    return [tuple(span) for span in indices[0]]


@functools.lru_cache(maxsize=64)
def _header(tok, fmt: ChatFormat, template: str) -> tuple[str, int, str | None]:
    """(header, least, opener): the assistant header the generation prompt writes (without a
    trailing empty think block), the least of it a turn must be preceded by (through its
    opener), and its opener: the special token written before the role's name (`<|im_start|>`,
    `<|start_header_id|>`), else its last special token, else None. A prompt may begin with
    the end of the message before it (`<|im_end|>` in vLLM's ChatML), which is no opener."""
    user = [{"role": "user", "content": "u"}]
    with_prompt = render(tok, user, fmt, template, add_generation_prompt=True)
    without = render(tok, user, fmt, template)
    if not with_prompt.startswith(without):
        return "", 0, None
    prompt = with_prompt[len(without):]
    m = re.search(r"<think>\s*</think>\s*$", prompt)
    if m:
        prompt = prompt[: m.start()]
    if not prompt:
        return "", 0, None
    specials = special_spans(tok, prompt, 0, len(prompt))
    named = [(s, e, t) for s, e, t in specials if e < len(prompt) and not prompt[e].isspace()
             and not any(s2 == e for s2, _, _ in specials)]
    pick = named[0] if named else (specials[-1] if specials else None)
    if pick is not None:
        return prompt, pick[1], pick[2]
    enc = tok(prompt, add_special_tokens=False, return_offsets_mapping=True)
    least = enc["offset_mapping"][0][1] if enc["input_ids"] else len(prompt)
    return prompt, max(1, least), None


def _varying(a: str, b: str) -> tuple[int, int]:
    """[start, end) of `a` outside the longest common prefix and suffix of a and b."""
    n = min(len(a), len(b))
    start = 0
    while start < n and a[start] == b[start]:
        start += 1
    tail = 0
    while tail < n - start and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
        tail += 1
    return start, len(a) - tail


def _probes(text: str, n: int) -> list[str]:
    """n private-use characters (never in real text) that `text` does not hold."""
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text)
    return [next(free) for _ in range(n)]


def _swap(msgs: list[dict], i: int, probe: str) -> list[dict]:
    m = {k: v for k, v in msgs[i].items() if k not in REASONING_FIELDS}
    m["content"] = probe
    return msgs[:i] + [m] + msgs[i + 1:]


def _swap_calls(msgs: list[dict], i: int, probes: list[str]) -> list[dict]:
    """Message i with call j's arguments made of probes[j] (which calls the template writes)."""
    calls = [{**c, "function": {**c["function"], "arguments": {p: p}}} for c, p in zip(msgs[i]["tool_calls"], probes)]
    return msgs[:i] + [{**msgs[i], "tool_calls": calls}] + msgs[i + 1:]


def _swap_names(msgs: list[dict], i: int, probe: str) -> list[dict]:
    """Message i with its calls' names and ids made of the probe (an id keeps its length: Mistral
    checks it), and the results that quote an id likewise. Only where the rendering first
    changes is read: the names reappear in the results (gpt-oss: `<|start|>functions.NAME`)."""
    ids = {c["id"]: probe * len(str(c["id"])) for c in msgs[i]["tool_calls"] if c.get("id") is not None}
    calls = [{**c, "function": {**c["function"], "name": probe}, **({"id": ids[c["id"]]} if c.get("id") in ids else {})}
             for c in msgs[i]["tool_calls"]]
    after = [{**m, "tool_call_id": ids[m["tool_call_id"]]} if m.get("tool_call_id") in ids else m
             for m in msgs[i + 1:]]
    return msgs[:i] + [{**msgs[i], "tool_calls": calls}] + after


@functools.lru_cache(maxsize=16)
def _special_pattern(tok) -> re.Pattern | None:
    specials = sorted(set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values()
                                                      if t.special}, key=len, reverse=True)
    specials = [s for s in specials if s]
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def special_spans(tok, text: str, start: int, stop: int) -> list[tuple[int, int, str]]:
    """(start, end, token) of each special token written in text[start:stop], in order."""
    pattern = _special_pattern(tok)
    if pattern is None:
        return []
    return [(m.start(), m.end(), m.group()) for m in pattern.finditer(text, start, stop)]


def _calls_extent(tok, msgs, i, fmt, template, text, tools, turn: int) -> tuple[int, int, int] | None:
    """(first, start, end) of what turn i's tool calls write: `start`..`end` where swapping
    their arguments changes the rendering, `first` where swapping their names and ids first
    does; None where the template checks what was swapped. Raises ChatMaskError where it writes
    some of the calls and not others (gpt-oss's writes a turn's first call only)."""
    calls = msgs[i]["tool_calls"]
    probes = _probes(text, len(calls))
    try:
        called = render(tok, _swap_calls(msgs, i, probes), fmt, template, tools=tools)
    except Exception:  # noqa: BLE001 -- a template that checks its calls: the content's span stands
        return None
    written = [p in called for p in probes]
    if any(written) and not all(written):
        lost = ", ".join(str(j + 1) for j, w in enumerate(written) if not w)
        raise ChatMaskError(f"assistant turn {turn} makes {len(calls)} tool calls and the chat template writes "
                            f"only {sum(written)} of them (call {lost} would be lost)",
                            "give each call its own assistant turn, each followed by its result (this template "
                            "writes one call a turn), or drop the line")
    if called == text:
        return None
    start, end = _varying(text, called)
    try:
        named = render(tok, _swap_names(msgs, i, probes[0]), fmt, template, tools=tools)
    except Exception:  # noqa: BLE001 -- a template that checks names or ids: the arguments' span stands
        named = text
    return (_varying(text, named)[0] if named != text else start), start, end


def _message_end(tok, msgs, j, fmt, template, text, tools, probe, stop: int) -> int | None:
    """Where message j ends in `text`: through the first special token after its content."""
    swapped = render(tok, _swap(msgs, j, probe), fmt, template, tools=tools)
    if swapped == text:
        return None
    _, b = _varying(text, swapped)
    after = special_spans(tok, text, b, stop)
    return after[0][1] if after else None


def assistant_spans(tok, msgs: list[dict], fmt: ChatFormat, template: str, text: str,
                    tools: list[dict] | None = None) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text`, the rendering of `msgs` (see header)."""
    header, least, opener = _header(tok, fmt, template)
    [probe] = _probes(text, 1)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        turn = sum(1 for x in msgs[: i + 1] if x["role"] == "assistant")
        swapped = render(tok, _swap(msgs, i, probe), fmt, template, tools=tools)
        a, b = _varying(text, swapped) if swapped != text else (len(text), 0)
        content = a if swapped != text else None
        if m.get("tool_calls"):
            # its calls too: a template may write them after a special token that ends the content
            # (Llama-4: <|python_start|>content<|python_end|>{calls}<|eot|>), or without the content
            # (Mistral-Small-3.2: [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}</s>)
            extent = _calls_extent(tok, msgs, i, fmt, template, text, tools, turn)
            if extent is not None:
                first, ca, cb = extent
                a, b = min(a, ca, first if first >= cursor else ca), max(b, cb)
        if b <= a:
            continue  # the template does not render this turn: nothing of it to supervise
        if a < cursor:
            raise ChatMaskError(f"assistant turn {turn} changes the rendering before the end of the turn "
                                "ahead of it, so its tokens cannot be told apart")
        start = a
        if header:
            for n in range(len(header), least - 1, -1):
                at = text.rfind(header[:n], cursor, a)
                if at >= 0:
                    start = at + n
                    break
            else:
                raise ChatMaskError(f"assistant turn {turn}: the template's assistant header "
                                    f"{header!r} is not written before it")
        else:
            # no header: the special tokens right before the turn's text, back to where the
            # message before it ends, are the turn's own (Mistral's [TOOL_CALLS])
            run = a
            for s, e, _ in reversed(special_spans(tok, text, cursor, a)):
                if e != run:
                    break
                run = s
            if run < a and i > 0:
                prev = cursor if msgs[i - 1]["role"] == "assistant" else _message_end(
                    tok, msgs, i - 1, fmt, template, text, tools, probe, a)
                if prev is not None and run <= prev <= a:
                    start = prev
        stop = len(text)
        if i + 1 < len(msgs):
            nxt, _ = _varying(text, render(tok, _swap(msgs, i + 1, probe), fmt, template, tools=tools))
            if nxt >= b:
                stop = nxt
        end = b
        for s, e, token in special_spans(tok, text, b, stop):
            if token != opener:
                end = e
            break
        if not fmt.supervise_empty_think:
            start, end = _skip_empty_think(text, start, end, content)
        spans.append((start, end))
        cursor = end
    return spans
