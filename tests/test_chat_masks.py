"""Loss masks on chat templates as models ship them: the assistant's tokens as the full
rendering shows them, equal to a `{% generation %}`-marker oracle of each template.

What: the product's mask (`chat.encode_chat`, via `inputs.tokenize_record` as extract calls it)
equals the oracle's (`_templates.oracle`, read through transformers'
`return_assistant_tokens_mask`) on vLLM's Qwen3-style, ChatML and DeepSeek-VL2 templates,
Llama-4's and Mistral's v11, for multi-turn chats, a system prompt, a chat ending in a user
turn, reasoning (kept on the last turn, dropped from history) and content the template trims;
the empty think block is unsupervised by default and kept with the flag; `enable_thinking`
moves the think opener into the prompt; a turn that cannot be placed fails its line.
Limits: the tokenizer is the tiny test BPE with each family's special tokens, not the family's
own vocabulary (the rule works on characters; offsets come from the fast tokenizer).
"""

from __future__ import annotations

import json

import pytest
from _templates import oracle, oracle_mask, tokenizer

from eagle_fast.chat import ChatFormat, encode_chat, for_template
from eagle_fast.errors import UserError
from eagle_fast.inputs import tokenize_record
from eagle_fast.records import parse_line

CHATS = {
    "multi-turn": [
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello friend"},
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    "system": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hey."}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye now."}],
    "ends-in-user": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey."},
        {"role": "user", "content": "And then?"}],
    "three-turns": [
        {"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Pear."},
        {"role": "user", "content": "One more."}, {"role": "assistant", "content": "Plum, then."}],
}
REASONING_CHATS = {  # the Qwen3-style template only: it reads `reasoning` and splits inline think
    "reasoning-dropped-from-history": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey.", "reasoning": "greet back"},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "add them"}],
    "inline-think-trimmed": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\n\nplan it\n\n</think>\n\n\nHey there.  "},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add\n</think>\n\n4 "}],
    "reasoning-before-a-tool-free-last-turn": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey."},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "two and two"}],
}
TEMPLATES = ("qwen3", "chatml", "deepseek", "llama4", "mistral")


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return {name: tokenizer(name, tmp_path_factory.mktemp(name)) for name in TEMPLATES}


def _show(tok, ids, mask):
    return "".join(f"[{tok.decode([t])}]" if m else tok.decode([t]) for t, m in zip(ids, mask))


def _check(tok, name, messages, fmt, prompt_think=False):
    ids, mask = tokenize_record(parse_line("chats.jsonl", 7, json.dumps({"messages": messages})), tok,
                                "chats.jsonl", fmt)
    want_ids, want = oracle_mask(tok, for_template(_canonical(messages), tok.chat_template),
                                 oracle(name, keep_empty_think=fmt.supervise_empty_think,
                                        prompt_think=prompt_think), **fmt.kwargs)
    assert ids == want_ids
    assert mask == want, f"\nproduct {_show(tok, ids, mask)!r}\noracle  {_show(tok, ids, want)!r}"
    assert any(mask)
    return ids, mask


def _canonical(messages):
    return [{("reasoning" if k in ("reasoning_content", "thinking") else k): v for k, v in m.items()}
            for m in messages]


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_mask_equals_the_marker_oracle(toks, name, chat):
    _check(toks[name], name, CHATS[chat], ChatFormat())


@pytest.mark.parametrize("keep", [False, True], ids=["default", "supervise-empty-think"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}],
                         ids=["no-kwargs", "thinking-on", "thinking-off"])
@pytest.mark.parametrize("chat", list(CHATS) + list(REASONING_CHATS))
def test_qwen3_style_reasoning_and_think_blocks(toks, chat, kwargs, keep):
    messages = {**CHATS, **REASONING_CHATS}[chat]
    _check(toks["qwen3"], "qwen3", messages, ChatFormat(kwargs=kwargs, supervise_empty_think=keep),
           prompt_think=kwargs.get("enable_thinking") is True)


def test_history_turn_is_masked_as_rendered(toks):
    """The case prefix renderings got wrong: the first of two turns renders without a think
    block once a later user turn exists, so its own tokens and end token are the supervised
    ones, and nothing of the next turn's header is."""
    tok = toks["qwen3"]
    ids, mask = encode_chat(tok, CHATS["multi-turn"], ChatFormat())
    shown = _show(tok, ids, mask)
    assert "<|im_start|>assistant\n[H][ell][o][ friend][<|im_end|>]\n<|im_start|>user" in shown, shown
    assert "<think>" not in "".join(tok.decode([t]) for t, m in zip(ids, mask) if m)


def test_empty_think_block_is_left_out_unless_asked(toks):
    tok = toks["qwen3"]
    text = {}
    for keep in (False, True):
        ids, mask = encode_chat(tok, CHATS["multi-turn"], ChatFormat(supervise_empty_think=keep))
        text[keep] = tok.decode([t for t, m in zip(ids, mask) if m])
    assert "think>" not in text[False] and text[False].endswith("It is 4.<|im_end|>")
    assert "<think>\n\n</think>\n\nIt is 4.<|im_end|>" in text[True]


def test_reasoning_fields_render_where_the_template_reads_them(toks):
    """reasoning_content / reasoning / thinking all reach vLLM's template (it reads `reasoning`);
    the last turn's reasoning is supervised, the history's is dropped by the template."""
    tok = toks["qwen3"]
    masks = []
    for field in ("reasoning_content", "reasoning", "thinking"):
        msgs = [dict(m) for m in REASONING_CHATS["reasoning-dropped-from-history"]]
        for m in msgs:
            if "reasoning" in m:
                m[field] = m.pop("reasoning")
        masks.append(_check(tok, "qwen3", msgs, ChatFormat()))
    assert masks[0] == masks[1] == masks[2]
    supervised = tok.decode([t for t, m in zip(*masks[0]) if m])
    assert "add them" in supervised and "greet back" not in tok.decode(masks[0][0])


def test_reasoning_a_template_cannot_render_fails_its_line(toks):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey.", "reasoning": "hm"}]
    with pytest.raises(UserError, match=r"chats.jsonl:3: cannot mask this chat: message 2 has reasoning"):
        tokenize_record(parse_line("chats.jsonl", 3, json.dumps({"messages": msgs})), toks["llama4"],
                        "chats.jsonl", ChatFormat())


ECHO_LAST = ("{%- if messages[-1].role == 'assistant' %}{{- 'Previously: ' + messages[-1].content + '\\n' }}"
             "{%- endif %}")


def test_a_turn_that_cannot_be_placed_fails_its_line(toks):
    """A template that also writes the last assistant turn at the top: changing that turn
    changes text before the earlier turns, so its tokens cannot be told apart."""
    tok = toks["chatml"]
    fmt = ChatFormat(template=ECHO_LAST + tok.chat_template)
    line = parse_line("chats.jsonl", 12, json.dumps({"messages": CHATS["multi-turn"]}))
    with pytest.raises(UserError, match=r"chats\.jsonl:12: cannot mask this chat: assistant turn 2 changes "
                                        r"the rendering before"):
        tokenize_record(line, tok, "chats.jsonl", fmt)
    # The same template masks a conversation whose last turn is a user's.
    ok = parse_line("chats.jsonl", 13, json.dumps({"messages": CHATS["ends-in-user"]}))
    assert any(tokenize_record(ok, tok, "chats.jsonl", fmt)[1])


def test_chat_format_from_args(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    fmt = ChatFormat.from_args(str(f), '{"enable_thinking": false}', True)
    assert fmt.template == "{{ messages[0].content }}" and fmt.kwargs == {"enable_thinking": False}
    assert fmt.describe()["template_sha256"] and fmt.describe()["supervise_empty_think"] is True
    for bad, match in [("{", "not valid JSON"), ("[1]", "must be a JSON object"),
                       ('{"add_generation_prompt": true}', "sets add_generation_prompt")]:
        with pytest.raises(UserError, match=match):
            ChatFormat.from_args(None, bad)
    with pytest.raises(UserError, match="not found"):
        ChatFormat.from_args(str(tmp_path / "missing.jinja"))
