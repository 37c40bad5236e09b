"""One agentic chat in every form a row brings it, on the templates of Qwen3, Llama-3.3, gpt-oss and
Mistral-Small-3.2 as their models ship them (and vLLM's Qwen3-style, Llama-4's, Mistral v7's and
v11's): every tool-call token of an assistant turn supervised, no tool result, and one row's forms
giving one set of ids and one mask.

What: two tool steps (two parallel weather calls, then a conversion), string and object arguments,
in OpenAI form (tools wrapped, bare, or a JSON string; calls with ids or none) and LLaMA-Factory's
ShareGPT (function_call / observation turns, a `system` column, tools as a JSON string of bare
schemas); the product's ids and mask (`inputs.tokenize_record`) equal the `{% generation %}`-marked
copy's (`_templates.oracle`) for every form. Llama-3.3's template refuses a turn of two calls and
gpt-oss's writes only the first: there the chat gives each call its own turn, and the parallel
form fails its line with the reason. A turn's edge whitespace is supervised as it is rendered;
`inspect --show-mask` marks the calls.
Limits: the tokenizers are the tiny test BPE with each family's special and added tokens.
"""

from __future__ import annotations

import json

import pytest
from _pipeline import run_main, write_jsonl
from _templates import oracle, oracle_mask, shipped, tokenizer

from eagle_fast.chat import ChatFormat, for_template
from eagle_fast.errors import UserError
from eagle_fast.inputs import tokenize_record
from eagle_fast.records import parse_line

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "convert", "description": "Convert money",
                                      "parameters": {"type": "object", "properties": {
                                          "amount": {"type": "number"}, "to": {"type": "string"}}}}}]
WEATHER = [("get_weather", '{"city": "Paris"}'), ("get_weather", {"city": "Rome"})]  # a string, an object
CONVERT = ("convert", {"amount": 20, "to": "USD"})
RESULTS = ["Sunny, 21C", "Rain, 14C", "USD 21.60"]
ANSWER = "Paris: sunny. Rome: rain. 20 EUR = 21.60 USD."
# each step: the calls one assistant turn makes, then their results
PARALLEL = [(WEATHER, RESULTS[:2]), ([CONVERT], RESULTS[2:])]
ONE_A_TURN = [([WEATHER[0]], RESULTS[:1]), ([WEATHER[1]], RESULTS[1:2]), ([CONVERT], RESULTS[2:])]
CHAT_OF = {"qwen3-0.6b": PARALLEL, "mistral-small-3.2": PARALLEL, "llama3": ONE_A_TURN, "gpt_oss": ONE_A_TURN,
           "qwen3": PARALLEL, "llama4": PARALLEL, "mistral": PARALLEL, "mistral-v7": PARALLEL}
SYSTEM, QUESTION = "You plan trips.", "Weather in Paris and Rome, and 20 EUR in USD?"


def openai_row(steps, ids: bool = False, tools=TOOLS) -> dict:
    msgs, n = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 0
    for calls, results in steps:
        made = []
        for name, args in calls:
            n += 1
            made.append({"type": "function", "function": {"name": name, "arguments": args},
                         **({"id": f"call{n:05d}"} if ids else {})})
        msgs.append({"role": "assistant", "content": None, "tool_calls": made})
        msgs += [{"role": "tool", "content": r, **({"tool_call_id": c["id"]} if ids else {})}
                 for c, r in zip(made, results)]
    return {"tools": tools, "messages": msgs + [{"role": "assistant", "content": ANSWER}]}


def sharegpt_row(steps, tools: str) -> dict:
    conv = [{"from": "human", "value": QUESTION}]
    for calls, results in steps:
        made = [{"name": name, "arguments": args} for name, args in calls]
        conv.append({"from": "function_call", "value": json.dumps(made if len(made) > 1 else made[0])})
        conv += [{"from": "observation", "value": r} for r in results]
    return {"system": SYSTEM, "tools": tools, "conversations": conv + [{"from": "gpt", "value": ANSWER}]}


BARE = [t["function"] for t in TOOLS]
FORMS = {
    "openai": lambda steps: openai_row(steps),
    "openai-tools-json-string": lambda steps: openai_row(steps, tools=json.dumps(TOOLS)),
    "openai-bare-tools": lambda steps: openai_row(steps, tools=BARE),
    "sharegpt": lambda steps: sharegpt_row(steps, json.dumps(BARE)),  # as LLaMA-Factory writes it
    "sharegpt-wrapped-tools": lambda steps: sharegpt_row(steps, json.dumps(TOOLS)),
}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return {name: tokenizer(name, tmp_path_factory.mktemp(name)) for name in CHAT_OF}


def _encode(tok, row: dict, line: int = 1, **kwargs):
    rec = parse_line("agent.jsonl", line, json.dumps(row))
    return rec, tokenize_record(rec, tok, "agent.jsonl", ChatFormat(kwargs=kwargs))


def _oracle(tok, name, rec, **kwargs):
    return oracle_mask(tok, for_template(rec.value, tok.chat_template), oracle(name), tools=rec.tools, **kwargs)


def _supervised(tok, ids, mask) -> str:
    return tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)


# what each template writes for a call (name, its id where it writes one, arguments), all supervised
CALL_TEXT = {
    "qwen3-0.6b": '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
    "qwen3": '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
    "llama3": '{{"name": "{name}", "parameters": {args}}}<|eot_id|>',
    "gpt_oss": " to=functions.{name}<|channel|>commentary json<|message|>{args}<|call|>",
    "mistral-small-3.2": "[TOOL_CALLS]{name}[CALL_ID]{id}[ARGS]{args}",
    "mistral": "[TOOL_CALLS]{name}[CALL_ID]{id}[ARGS]{args}",
    "mistral-v7": '{{"name": "{name}", "arguments": {args}, "id": "{id}"}}',
    "llama4": '{{"name": "{name}", "parameters": {args}}}',
}


@pytest.mark.parametrize("name", list(CHAT_OF))
def test_every_form_gives_the_oracles_ids_and_mask(toks, name):
    tok, steps = toks[name], CHAT_OF[name]
    got = {}
    for form, make in FORMS.items():
        rec, got[form] = _encode(tok, make(steps))
        assert got[form] == _oracle(tok, name, rec), form
    first = got["openai"]
    assert all(v == first for v in got.values()), [f for f, v in got.items() if v != first]
    ids, mask = first
    supervised = _supervised(tok, ids, mask)
    msgs = for_template(parse_line("a", 1, json.dumps(FORMS["openai"](steps))).value, tok.chat_template)
    calls = [c for m in msgs for c in m.get("tool_calls", [])]
    assert len(calls) == 3
    for c in calls:  # every call in full: its markers, name, id (where written) and arguments
        fn = c["function"]
        text = CALL_TEXT[name].format(name=fn["name"], id=c.get("id"), args=json.dumps(fn["arguments"]))
        assert text in supervised, (name, text, supervised)
    assert ANSWER in supervised
    for r in RESULTS + [SYSTEM, QUESTION, "Weather in a city"]:  # results, prompts and schemas never are
        assert r not in supervised, (name, r)


@pytest.mark.parametrize("name", ["mistral-small-3.2", "mistral", "qwen3-0.6b"])
def test_given_call_ids_are_kept_and_supervised(toks, name):
    """A row's own ids reach the template (ShareGPT's calls have none: those get made ones)."""
    tok = toks[name]
    rec, (ids, mask) = _encode(tok, openai_row(CHAT_OF[name], ids=True))
    assert (ids, mask) == _oracle(tok, name, rec)
    supervised = _supervised(tok, ids, mask)
    if name.startswith("mistral"):
        assert '[TOOL_CALLS]get_weather[CALL_ID]call00002[ARGS]{"city": "Rome"}' in supervised
        assert "[TOOL_RESULTS]call00001" in tok.decode(ids) and "call00001[TOOL_CONTENT]" not in supervised
    else:  # Qwen3 writes no ids: the same ids as a row without them
        assert (ids, mask) == _encode(tok, FORMS["sharegpt"](CHAT_OF[name]))[1]


@pytest.mark.parametrize("name,match", [
    ("gpt_oss", (r"agent\.jsonl:4: cannot mask this chat: assistant turn 1 makes 2 tool calls and the chat "
                 r"template writes only 1 of them \(call 2 would be lost\).*its own assistant turn")),
    ("llama3", r"agent\.jsonl:4: the chat template failed .*single tool-calls"),
])
@pytest.mark.parametrize("form", ["openai", "sharegpt"])
def test_parallel_calls_a_template_cannot_write_fail_their_line(toks, name, match, form):
    with pytest.raises(UserError, match=match):
        _encode(toks[name], FORMS[form](PARALLEL), line=4)


@pytest.mark.parametrize("form", ["openai", "sharegpt"])
def test_llama3_builtin_calls_after_python_tag(toks, form):
    """Llama-3.x writes a built-in tool's call as <|python_tag|>NAME.call(...) and ends it <|eom_id|>."""
    tok = toks["llama3"]
    steps = [([("brave_search", {"query": "Paris weather"})], ["Sunny"]), ([WEATHER[1]], RESULTS[1:2])]
    kwargs = {"builtin_tools": ["brave_search"]}
    rec, (ids, mask) = _encode(tok, FORMS[form](steps), **kwargs)
    assert (ids, mask) == _oracle(tok, "llama3", rec, **kwargs)
    assert (ids, mask) == _encode(tok, FORMS["openai"](steps), **kwargs)[1]
    supervised = _supervised(tok, ids, mask)
    assert '<|python_tag|>brave_search.call(query="Paris weather")<|eom_id|>' in supervised
    assert '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eom_id|>' in supervised


EDGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello there!  "},
         {"role": "user", "content": "Bye"}, {"role": "assistant", "content": " Bye now. \n"}]


@pytest.mark.parametrize("name", list(CHAT_OF))
def test_edge_whitespace_is_supervised_as_rendered(toks, name):
    """Content with spaces at both ends (and a newline at the end) is written as it is by every
    template here but Llama-3.x's (it trims), and all of it is supervised: none is left to the
    empty think block before it (Qwen3) or to the text around it."""
    tok = toks[name]
    rec, (ids, mask) = _encode(tok, {"messages": EDGES})
    assert (ids, mask) == _oracle(tok, name, rec)
    text, supervised = tok.decode(ids), _supervised(tok, ids, mask)
    for content in ("  Hello there!  ", " Bye now. \n"):
        assert (content in text) == (name != "llama3"), name
        assert (content in supervised) == (name != "llama3"), (name, content)


def test_show_mask_marks_the_calls(tmp_path, capsys, toks):
    """`inspect --show-mask` on a ShareGPT line, Mistral-Small-3.2's template: each call between
    [[ and ]] from its [TOOL_CALLS] through </s>, the results outside."""
    model = tmp_path / "model"
    toks["mistral-small-3.2"].save_pretrained(model)
    data = write_jsonl(tmp_path / "agent.jsonl", [FORMS["sharegpt"](PARALLEL)])
    code, shown, err = run_main(capsys, "inspect", data, "--show-mask", 1, "--model", model)
    assert code == 0, err
    calls = [c for m in for_template(parse_line("a", 1, json.dumps(FORMS["sharegpt"](PARALLEL))).value,
                                     shipped("mistral-small-3.2")) for c in m.get("tool_calls", [])]
    a, b, c = (f'[TOOL_CALLS]{x["function"]["name"]}[CALL_ID]{x["id"]}[ARGS]{json.dumps(x["function"]["arguments"])}'
               for x in calls)
    assert f"[/INST][[{a}{b}</s>]][TOOL_RESULTS]" in shown, shown
    assert f"[/TOOL_RESULTS][[{c}</s>]][TOOL_RESULTS]" in shown and f"[[{ANSWER}</s>]]" in shown
    assert "[[" not in shown.split("[TOOL_RESULTS]", 1)[1].split("[/TOOL_RESULTS]", 1)[0]
