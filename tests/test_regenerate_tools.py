"""regenerate on agentic chats (issue 46): tool-calling turns regenerated, the target's calls read
by vLLM's own tool parser (hermes, Qwen3's), a result kept only for the call it answered.

A fake engine answers (tests/test_regenerate.py's), vLLM's parser reads its text: a call equal to
the original keeps the original results (and their call ids), a diverging call or a missing one
cuts the conversation after the target's turn and is counted; `--tool-turns keep` keeps the
calls and results byte for byte; rows with calls and no parser are refused up front.
"""

from __future__ import annotations

import json

import pytest
from _templates import shipped, tokenizer
from test_agentic_inputs import OPENAI
from test_regenerate import FakeEngine

from eagle_fast.chat import ChatFormat
from eagle_fast.errors import UserError
from eagle_fast.loop import regenerate as R
from eagle_fast.loop.engine import Sampling
from eagle_fast.loop.rows import read_rows
from eagle_fast.loop.turns import run_chunk, tool_parser

pytest.importorskip("vllm")


def hermes(*cities: str) -> str:
    return "\n".join('<tool_call>\n' + json.dumps({"name": "get_weather", "arguments": {"city": c}}) + "\n</tool_call>"
                     for c in cities)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tokenizer("qwen3", tmp_path_factory.mktemp("qwen3"))


def _regen(tmp_path, qwen, reply, tool_turns="regenerate"):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(OPENAI) + "\n")
    rows, _, _, _ = read_rows(path)
    engine = FakeEngine(qwen, reply=reply)
    [out] = run_chunk(rows, qwen, ChatFormat(template=shipped("qwen3")), engine, 4096, tool_turns=tool_turns,
                      parse=tool_parser("hermes", qwen))
    return out, json.loads(out.text), engine


def test_a_call_equal_to_the_original_keeps_its_results(tmp_path, qwen):
    out, row, engine = _regen(tmp_path, qwen, lambda text, line: "Both fetched." if "<tool_response>" in text
                              else hermes("Paris", "Rome"))
    msgs = row["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant"]
    calls = msgs[1]["tool_calls"]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "Rome")]
    assert [c["id"] for c in calls] == ["c1", "c2"]  # the original ids: the results answer them
    assert msgs[2] == OPENAI["messages"][2] and msgs[3] == OPENAI["messages"][3]
    assert msgs[4]["content"] == "Both fetched." and "cut_after_message" not in row and out.cut is None
    assert len(engine.calls) == 2 and "Sunny, 21C" in engine.calls[1][0][0]


@pytest.mark.parametrize("reply", [hermes("Rome"), hermes("Paris", "Madrid"), "I cannot look that up."])
def test_a_diverging_or_missing_call_cuts_the_conversation(tmp_path, qwen, reply):
    out, row, engine = _regen(tmp_path, qwen, lambda text, line: reply)
    msgs = row["messages"]
    assert len(msgs) == 2 and msgs[1]["role"] == "assistant"  # no result paired with a call it did not answer
    assert row["cut_after_message"] == 1 and out.cut == 1 and len(engine.calls) == 1
    if "<tool_call>" in reply:
        assert msgs[1]["tool_calls"] and all(c["id"].startswith("call_1_1_") for c in msgs[1]["tool_calls"])
    else:
        assert "tool_calls" not in msgs[1] and msgs[1]["content"] == reply


def test_tool_turns_keep_keeps_calls_and_results_byte_for_byte(tmp_path, qwen):
    out, row, engine = _regen(tmp_path, qwen, lambda text, line: "Both fetched.", tool_turns="keep")
    assert row["messages"][:4] == OPENAI["messages"][:4] and row["messages"][4]["content"] == "Both fetched."
    assert len(engine.calls) == 1 and out.turns == 1


def test_calls_without_a_parser_are_refused_up_front(tmp_path, qwen, monkeypatch):
    model = tmp_path / "model"
    qwen.save_pretrained(model)
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps(OPENAI) + "\n")
    monkeypatch.setattr(R, "local_chunks", lambda cfg, chunks: pytest.fail("an engine was started"))
    cfg = R.RegenerateConfig(model=str(model), data=str(data), out=str(tmp_path / "o.jsonl"),
                             sampling=Sampling(max_tokens=8))
    with pytest.raises(UserError, match=r"1 rows have tool calls \(the first on line 2\)") as exc:
        R.regenerate(cfg)
    assert "--tool-call-parser" in exc.value.fix and "--tool-turns keep" in exc.value.fix
    with pytest.raises(UserError, match="'nope' is not one of this vLLM's tool parsers") as exc:
        R.regenerate(R.RegenerateConfig(**{**cfg.__dict__, "tool_call_parser": "nope"}))
    assert "hermes" in exc.value.fix


def test_the_report_counts_cut_conversations(tmp_path, qwen, monkeypatch):
    model = tmp_path / "model"
    qwen.save_pretrained(model)
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(OPENAI) + "\n" + json.dumps({"messages": OPENAI["messages"][:1]}) + "\n")

    def local_chunks(cfg, chunks):
        engine = FakeEngine(qwen, reply=lambda text, line: hermes("Oslo") if line == 1 else "Sure.")
        for rows in chunks:
            yield run_chunk(rows, qwen, cfg.chat, engine, 4096, tool_turns=cfg.tool_turns,
                            parse=tool_parser(cfg.tool_call_parser, qwen))

    monkeypatch.setattr(R, "local_chunks", local_chunks)
    s = R.regenerate(R.RegenerateConfig(model=str(model), data=str(data), out=str(tmp_path / "o.jsonl"),
                                        sampling=Sampling(max_tokens=8), tool_call_parser="hermes",
                                        chat=ChatFormat(template=shipped("qwen3"))))
    report = json.loads(R.report_path(tmp_path / "o.jsonl").read_text())
    assert s.regenerated == 2 and report["cut"] == 1 and report["rows_cut"] == [{"line": 1, "after_message": 1}]
    assert "1 conversations cut after a tool call" in s.text()


def test_calls_written_with_special_tokens_are_still_read(tmp_path):
    """A tokenizer that marks <tool_call> special (Hermes-2-Pro does): the text the parser reads
    keeps it, as vLLM keeps it for its parsers; only the stop token is dropped."""
    from eagle_fast import tiny

    tok = tiny.build_tokenizer(tmp_path / "tok", 600)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
                            "eos_token": "<|im_end|>"})
    tok.add_tokens(["<think>", "</think>"])
    out, row, _ = _regen(tmp_path, tok, lambda text, line: "Both fetched." if "<tool_response>" in text
                         else hermes("Paris", "Rome"))
    assert out.cut is None and [c["id"] for c in row["messages"][1]["tool_calls"]] == ["c1", "c2"]
    assert row["messages"][4]["content"] == "Both fetched."
