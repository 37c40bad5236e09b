"""Agentic rows, the input side: a row's `tools`, OpenAI tool calls (null content,
JSON-string arguments), tool results with text parts, LLaMA-Factory's ShareGPT
`function_call` / `observation` turns, through `inputs` and the chat masks.

What: the tool schemas reach the template; a tool call is part of its assistant turn's mask
and tool results never are, equal to the `{% generation %}` oracles of the templates as they
ship (vLLM's Qwen3-style, Llama-4, Mistral v11, Llama-3.1, gpt-oss) with the tools passed; the OpenAI and ShareGPT forms of one conversation give the same
ids and mask; JSON-string arguments render as the object does; a malformed call or schema fails
its line, with the number.
"""

from __future__ import annotations

import json

import pytest
from _templates import oracle, oracle_mask, shipped, tokenizer

from eagle_fast.chat import ChatFormat, for_template
from eagle_fast.errors import UserError
from eagle_fast.inputs import tokenize_record
from eagle_fast.records import parse_line

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def call(city: str, as_string: bool = False, cid: str = "c1") -> dict:
    args = {"city": city}
    return {"id": cid, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(args) if as_string else args}}


OPENAI = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "reasoning_content": "two cities, two calls",
     "tool_calls": [call("Paris", True, "c1"), call("Rome", True, "c2")]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Sunny, 21C"}]},
    {"role": "tool", "tool_call_id": "c2", "content": "Rain, 14C"},
    {"role": "assistant", "content": "Paris is sunny; Rome is rainy."}]}
SHAREGPT = {"tools": json.dumps([t["function"] for t in TOOLS]), "conversations": [  # bare schemas, LLaMA-Factory's
    {"from": "human", "value": "Weather in Paris and Rome?"},
    {"from": "function_call", "value": json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                   {"name": "get_weather", "arguments": {"city": "Rome"}}])},
    {"from": "observation", "value": "Sunny, 21C"},
    {"from": "observation", "value": "Rain, 14C"},
    {"from": "gpt", "value": "Paris is sunny; Rome is rainy."}]}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tokenizer("qwen3", tmp_path_factory.mktemp("qwen3"))


def _rec(obj: dict, line: int = 1):
    return parse_line("data.jsonl", line, json.dumps(obj))


def test_openai_form_is_read_and_normalised():
    rec = _rec(OPENAI)
    assert rec.tools == TOOLS
    msgs = rec.value
    assert msgs[1]["content"] == "" and msgs[1]["reasoning"] == "two cities, two calls"
    assert [c["function"]["arguments"] for c in msgs[1]["tool_calls"]] == [{"city": "Paris"}, {"city": "Rome"}]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2] == {"role": "tool", "content": "Sunny, 21C", "tool_call_id": "c1"}


def test_tools_reach_the_template_and_masks_equal_the_oracle(qwen):
    chat = ChatFormat(template=shipped("qwen3"))
    rec = _rec(OPENAI)
    ids, mask = tokenize_record(rec, qwen, "data.jsonl", chat)
    text = qwen.decode(ids)
    assert "# Tools" in text and '"name": "get_weather"' in text  # the schema, in the system block
    msgs = for_template(rec.value, chat.template)
    want_ids, want_mask = oracle_mask(qwen, msgs, oracle("qwen3"), tools=TOOLS)
    assert ids == want_ids and mask == want_mask
    supervised = qwen.decode([t for t, m in zip(ids, mask) if m])
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in supervised  # the calls are trained on
    assert "Sunny" not in supervised and "Rain" not in supervised and "# Tools" not in supervised


def test_openai_and_sharegpt_forms_give_the_same_ids_and_mask(qwen):
    chat = ChatFormat(template=shipped("qwen3"))
    plain = {**OPENAI, "messages": [{k: v for k, v in m.items() if k not in ("reasoning_content", "tool_call_id")}
                                    for m in OPENAI["messages"]]}
    a = tokenize_record(_rec(plain), qwen, "d", chat)
    b = tokenize_record(_rec(SHAREGPT), qwen, "d", chat)
    assert a == b and sum(a[1]) > 0


def test_string_and_object_arguments_render_alike(qwen):
    chat = ChatFormat(template=shipped("qwen3"))
    as_obj = json.loads(json.dumps(OPENAI))
    for c in as_obj["messages"][1]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    assert tokenize_record(_rec(OPENAI), qwen, "d", chat) == tokenize_record(_rec(as_obj), qwen, "d", chat)


@pytest.mark.parametrize("edit,match", [
    (lambda o: o["messages"][1]["tool_calls"][0]["function"].update(arguments="{city: Paris"),
     r"message 2, call 1 \(get_weather\): arguments are not valid JSON"),
    (lambda o: o["messages"][1]["tool_calls"][1]["function"].pop("name"), r"message 2, call 2: no function name"),
    (lambda o: o["messages"][1]["tool_calls"][0]["function"].update(arguments="[1, 2]"),
     r"message 2, call 1 \(get_weather\): arguments must be a JSON object"),
    (lambda o: o["messages"][0].update(tool_calls=[call("x")]), r"message 1 \(user\) has tool_calls"),
    (lambda o: o["messages"][1]["tool_calls"][1].update(id=["c2"]),
     r"message 2, call 2 \(get_weather\): its id must be a non-empty string"),
    (lambda o: o["messages"][2].update(tool_call_id=1), r'message 3: "tool_call_id" must be a string, got int'),
    (lambda o: o.update(tools="not json"), r'"tools" is a string that is not JSON'),
    (lambda o: o.update(tools=[1]), r'"tools" must be a list of function schemas'),
    (lambda o: o.update(tools=[TOOLS[0], {"description": "no name"}]), r'"tools" item 2 has no function name'),
    (lambda o: o.update(tools=[{"type": "web_search"}]), r"\"tools\" item 1 is a 'web_search' tool, not a function"),
    (lambda o: o.update(tools=json.dumps([{"name": "f", "parameters": "city"}])),
     r'"tools" item 1 \(f\): "parameters" must be a JSON schema object'),
    (lambda o: o["messages"][2].update(content=[{"type": "image_url"}]), r"message 3 has image_url parts: eagle_fast extracts text chats only"),
    (lambda o: o["messages"][2].update(content=[{"type": "table"}]), r"message 3 has no string \"content\""),
])
def test_a_malformed_call_or_schema_fails_its_line(edit, match):
    obj = json.loads(json.dumps(OPENAI))
    edit(obj)
    with pytest.raises(UserError, match=rf"data.jsonl:7: {match}"):
        _rec(obj, line=7)


def test_tools_in_every_form_are_read_as_openai_wraps_them():
    bare = [t["function"] for t in TOOLS]
    flat = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's form
    for tools in (TOOLS, json.dumps(TOOLS), bare, json.dumps(bare), bare[0], flat):
        assert _rec({**OPENAI, "tools": tools}).tools == TOOLS, tools


def test_sharegpt_system_column_is_the_system_message():
    rec = _rec({**SHAREGPT, "system": "Be brief."})
    assert rec.value[0] == {"role": "system", "content": "Be brief."} and rec.value[1]["role"] == "user"
    with pytest.raises(UserError, match=r'data.jsonl:2: "system" must be a string, got list'):
        _rec({**SHAREGPT, "system": ["Be brief."]}, line=2)
    both = {**SHAREGPT, "system": "Be brief.",
            "conversations": [{"from": "system", "value": "Hi"}, *SHAREGPT["conversations"]]}
    with pytest.raises(UserError, match=r'data.jsonl:3: the row has a "system" column and a system message'):
        _rec(both, line=3)


def test_sharegpt_function_call_must_be_json():
    bad = json.loads(json.dumps(SHAREGPT))
    bad["conversations"][1]["value"] = "get_weather(Paris)"
    with pytest.raises(UserError, match=r"data.jsonl:3: message 2 \(function_call\): its value is not a JSON call"):
        _rec(bad, line=3)


LLAMA_CHAT = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [call("Paris"), call("Rome", cid="c2")]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21C"},
    {"role": "tool", "tool_call_id": "c2", "content": "Rain, 14C"},
    {"role": "assistant", "content": "Paris is sunny; Rome is rainy."}]


@pytest.mark.parametrize("tools_in_user_message", [True, False])
def test_llama4_tool_calls_are_supervised_after_their_special_opener(tmp_path, tools_in_user_message):
    """Llama-4's template writes a call turn as <|python_start|>content<|python_end|> then the calls:
    the calls after that special token are the assistant's too (equal to the marked oracle)."""
    tok = tokenizer("llama4", tmp_path)
    chat = ChatFormat(template=shipped("llama4"), kwargs={"tools_in_user_message": tools_in_user_message})
    rec = _rec({"tools": TOOLS, "messages": LLAMA_CHAT})
    ids, mask = tokenize_record(rec, tok, "data.jsonl", chat)
    want = oracle_mask(tok, for_template(rec.value, chat.template), oracle("llama4"), tools=TOOLS,
                       tools_in_user_message=tools_in_user_message)
    assert (ids, mask) == want
    supervised = tok.decode([t for t, m in zip(ids, mask) if m])
    assert '"name": "get_weather", "parameters": {"city": "Paris"}' in supervised
    assert '"name": "get_weather", "parameters": {"city": "Rome"}' in supervised
    assert "Sunny" not in supervised and "Rain" not in supervised and "Weather in" not in supervised


def test_mistral_tool_calls_after_their_special_token_match_the_oracle(tmp_path):
    """Mistral v11 writes a call turn as content[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}</s>, its
    ids 9 characters: the calls after [TOOL_CALLS] are the assistant's too (the marked oracle)."""
    tok = tokenizer("mistral", tmp_path)
    chat = ChatFormat(template=shipped("mistral"))
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [call("Paris", cid="call00001"),
                                                               call("Rome", True, cid="call00002")]},
            {"role": "tool", "tool_call_id": "call00001", "content": "Sunny, 21C"},
            {"role": "tool", "tool_call_id": "call00002", "content": "Rain, 14C"},
            {"role": "assistant", "content": "Paris is sunny; Rome is rainy."}]
    rec = _rec({"tools": TOOLS, "messages": msgs})
    ids, mask = tokenize_record(rec, tok, "data.jsonl", chat)
    assert (ids, mask) == oracle_mask(tok, for_template(rec.value, chat.template), oracle("mistral"), tools=TOOLS)
    supervised = tok.decode([t for t, m in zip(ids, mask) if m])
    assert 'get_weather[CALL_ID]call00002[ARGS]{"city": "Rome"}' in supervised
    assert "Sunny" not in supervised and "[AVAILABLE_TOOLS]" not in supervised


AGENTIC = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [call("Paris", True)]},
           {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "Sunny, 21C"},
           {"role": "assistant", "content": "It is sunny, 21C."},
           {"role": "user", "content": "Thanks!"},
           {"role": "assistant", "content": "You are welcome."}]


@pytest.mark.parametrize("kwargs", [{}, {"tools_in_user_message": False}])
def test_llama3_masks_equal_the_oracle_and_parallel_calls_fail_their_line(tmp_path, kwargs):
    """Llama-3.1's template as it ships: a call turn is the JSON call and <|eot_id|> after the
    header; text turns are trimmed; tool results never count. It refuses parallel calls, and so
    does the line (number and reason); reasoning it cannot render fails the line too."""
    tok = tokenizer("llama3", tmp_path)
    chat = ChatFormat(template=shipped("llama3"), kwargs=kwargs)
    rec = _rec({"tools": TOOLS, "messages": AGENTIC})
    ids, mask = tokenize_record(rec, tok, "data.jsonl", chat)
    assert (ids, mask) == oracle_mask(tok, for_template(rec.value, chat.template), oracle("llama3"), tools=TOOLS,
                                      **kwargs)
    supervised = tok.decode([t for t, m in zip(ids, mask) if m])
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in supervised
    assert "Sunny" not in supervised and "ipython" not in supervised and "Weather in" not in supervised
    parallel = [*AGENTIC[:2], {"role": "assistant", "content": None, "tool_calls": [call("Paris"), call("Rome")]}]
    with pytest.raises(UserError, match=r"data\.jsonl:4: the chat template failed .*single tool-calls"):
        tokenize_record(_rec({"tools": TOOLS, "messages": parallel}, 4), tok, "data.jsonl", chat)
    thinking = [*AGENTIC[:4], {"role": "assistant", "content": "Sunny.", "reasoning_content": "say it"}]
    with pytest.raises(UserError, match=r"data\.jsonl:5: cannot mask this chat: .*renders none"):
        tokenize_record(_rec({"tools": TOOLS, "messages": thinking}, 5), tok, "data.jsonl", chat)


def test_gpt_oss_masks_equal_the_oracle_with_reasoning_and_calls(tmp_path):
    """gpt-oss's template as it ships (harmony): an assistant turn is all it writes after
    `<|start|>assistant`: its analysis (the last turn's, and a call's while no final message
    follows it: earlier reasoning is dropped), its call to=functions.NAME ... <|call|>, its final
    message and <|end|> / <|return|>. The tool result's header names the call, and is not the
    assistant's."""
    tok = tokenizer("gpt_oss", tmp_path)
    chat = ChatFormat(template=shipped("gpt_oss"))
    msgs = [dict(m) for m in AGENTIC]
    msgs[2]["reasoning_content"] = "I should look it up."
    msgs[4]["reasoning_content"] = "Report it."
    msgs[6]["reasoning_content"] = "Be polite."
    rec = _rec({"tools": TOOLS, "messages": msgs})
    ids, mask = tokenize_record(rec, tok, "data.jsonl", chat)
    assert (ids, mask) == oracle_mask(tok, for_template(rec.value, chat.template), oracle("gpt_oss"), tools=TOOLS)
    supervised = tok.decode([t for t, m in zip(ids, mask) if m])
    assert ('<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant to=functions.get_weather'
            '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in tok.decode(ids)
    assert ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in supervised
    assert "I should look it up." not in tok.decode(ids)  # a final message follows the call
    assert "Report it." not in supervised and "<|channel|>final<|message|>It is sunny, 21C.<|end|>" in supervised
    assert "Be polite.<|end|><|start|>assistant<|channel|>final<|message|>You are welcome.<|return|>" in supervised
    assert "Sunny" not in supervised and "functions.get_weather to=assistant" not in supervised
    # a chat that ends at the call: its analysis is written, and is the assistant's
    rec = _rec({"tools": TOOLS, "messages": msgs[:3]})
    ids, mask = tokenize_record(rec, tok, "data.jsonl", chat)
    assert (ids, mask) == oracle_mask(tok, for_template(rec.value, chat.template), oracle("gpt_oss"), tools=TOOLS)
    assert ('<|channel|>analysis<|message|>I should look it up.<|end|><|start|>assistant to=functions.get_weather'
            '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in tok.decode([t for t, m in zip(ids, mask) if m])
