"""`eagle-fast regenerate` without an engine: the turn order, the verbatim turns, reasoning,
bad rows with their lines, and resume (an interrupted run plus a torn line gives the bytes of an
uninterrupted one). A deterministic fake engine stands in for vLLM; tests/test_regenerate_vllm.py
runs the real one (kill -9, transformers' greedy decode, extract on the output, Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _templates import shipped, tokenizer

from eagle_fast.chat import ChatFormat
from eagle_fast.errors import UserError
from eagle_fast.loop import regenerate as R
from eagle_fast.loop.engine import Sampling
from eagle_fast.loop.rows import read_rows
from eagle_fast.loop.turns import run_chunk, split_reasoning
from eagle_fast.runners.engine_settings import VLLMSettings


class FakeEngine:
    """Answers a prompt with ids derived from it alone (so a chunk's output depends on its rows
    only, as the real engine's does); records every call."""

    def __init__(self, tok, reply=None, fail_on_call: int | None = None):
        self.tok, self.calls, self.fail_on_call = tok, [], fail_on_call
        self.reply = reply or (lambda text, line: f"answer {len(text)} to line {line}")

    def __call__(self, prompts):
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise KeyboardInterrupt  # an interrupted run
        self.calls.append([(self.tok.decode(ids), line) for ids, line in prompts])
        out = []
        for ids, line in prompts:
            text = self.reply(self.tok.decode(ids), line)
            gen = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids("<|im_end|>")]
            out.append((gen, "length" if "LONG" in text else "stop"))
        return out


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return tokenizer("qwen3", tmp_path_factory.mktemp("qwen3tok"))


def _rows(tmp_path: Path, objs: list) -> list:
    path = tmp_path / "in.jsonl"
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    rows, failures, n, _ = read_rows(path)
    return rows, failures, n


CHAT = {"id": "c1", "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "First question?"},
    {"role": "assistant", "content": "original answer one", "reasoning_content": "old thoughts"},
    {"role": "user", "content": "Second question?"},
    {"role": "assistant", "content": "original answer two"},
]}


def test_turn_by_turn_from_the_targets_own_answers(tmp_path, qwen_tok):
    fmt = ChatFormat(template=shipped("qwen3"))
    rows, _, _ = _rows(tmp_path, [CHAT])
    engine = FakeEngine(qwen_tok)
    [out] = run_chunk(rows, qwen_tok, fmt, engine, max_model_len=4096)
    obj = json.loads(out.text)
    msgs = obj["messages"]
    # system and user turns verbatim, in order; both assistant turns regenerated
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[0] == CHAT["messages"][0] and msgs[1] == CHAT["messages"][1] and msgs[3] == CHAT["messages"][3]
    first, second = msgs[2]["content"], msgs[4]["content"]
    assert first.startswith("answer ") and second.startswith("answer ") and first != second
    # two engine calls: turn 2 is prompted with turn 1's regenerated answer, never the original
    assert len(engine.calls) == 2
    [(p1, _)], [(p2, _)] = engine.calls
    assert p1.rsplit("<|im_start|>", 1)[1].startswith("assistant\n") and "original answer" not in p1
    assert first in p2 and "original answer" not in p2 and "old thoughts" not in p2
    assert obj["id"] == "c1" and obj["source_line"] == 1 and obj["regenerated_turns"] == 2
    assert out.turns == 2 and not out.truncated


def test_kept_turns_final_turn_and_passthrough(tmp_path, qwen_tok):
    fmt = ChatFormat(template=shipped("qwen3"))
    tool_call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    objs = [
        {"messages": [{"role": "user", "content": "Add 1 and 2"}, tool_call,
                      {"role": "tool", "content": "3"}, {"role": "assistant", "content": "It is 3."},
                      {"role": "user", "content": "Thanks, and 2+2?"}]},
        {"text": "plain text passes through"},
        {"input_ids": [1, 2, 3]},
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
    ]
    rows, _, _ = _rows(tmp_path, objs)
    outs = run_chunk(rows, qwen_tok, fmt, FakeEngine(qwen_tok), max_model_len=4096)
    msgs = json.loads(outs[0].text)["messages"]
    # the tool-calling turn and the tool result stay; the answer after them and a final turn
    # for the trailing user message are generated
    assert msgs[1] == tool_call and msgs[2] == objs[0]["messages"][2]
    assert msgs[3]["content"].startswith("answer ") and msgs[4] == objs[0]["messages"][4]
    assert len(msgs) == 6 and msgs[5]["role"] == "assistant" and outs[0].turns == 2
    for out, obj, line in zip(outs[1:], objs[1:], (2, 3, 4)):
        assert out.passed_through and json.loads(out.text) == {**obj, "source_line": line}


@pytest.mark.parametrize("keep", ["keep", "drop"])
def test_reasoning_kept_or_dropped(tmp_path, qwen_tok, keep):
    fmt = ChatFormat(template=shipped("qwen3"))
    rows, _, _ = _rows(tmp_path, [{"messages": CHAT["messages"][1:3]}])
    engine = FakeEngine(qwen_tok, reply=lambda text, line: "<think>\nlet me see\n</think>\n\nthe answer")
    [out] = run_chunk(rows, qwen_tok, fmt, engine, max_model_len=4096, reasoning=keep)
    msg = json.loads(out.text)["messages"][1]
    assert msg["content"] == "the answer"
    assert msg.get("reasoning_content") == ("let me see" if keep == "keep" else None)


def test_split_reasoning_rules():
    assert split_reasoning("<|im_start|>assistant\n<think>\n", "a\nb\n</think>\n\nc") == ("a\nb", "c")
    assert split_reasoning("<|im_start|>assistant\n", "<think>x</think>y") == ("x", "y")
    assert split_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", "plain") == (None, "plain")
    assert split_reasoning("p<think>\n", "cut short in thought") == ("cut short in thought", "")


def test_overlong_context_and_bad_lines_are_reported(tmp_path, qwen_tok):
    fmt = ChatFormat(template=shipped("qwen3"))
    long_user = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "x"}]}
    rows, failures, n = _rows(tmp_path, [CHAT, "{not json", {"foo": 1}, long_user])
    assert n == 4 and [f.line for f in failures] == [2, 3]
    assert "invalid JSON" in failures[0].cause and "no usable field" in failures[1].cause
    outs = run_chunk(rows, qwen_tok, fmt, FakeEngine(qwen_tok), max_model_len=200)
    assert outs[0].failure is None
    assert outs[1].failure.line == 4 and "--max-model-len" in outs[1].failure.cause
    assert "is 200" in outs[1].failure.cause


def _config(tmp_path, tok_dir, data, chunk_rows=2, **kw):
    return R.RegenerateConfig(model=str(tok_dir), data=str(data), out=str(tmp_path / "out.jsonl"),
                              sampling=Sampling(max_tokens=8), chunk_rows=chunk_rows,
                              chat=ChatFormat(template=shipped("qwen3")), **kw)


@pytest.fixture
def fake_engine_run(monkeypatch, qwen_tok):
    """regenerate() with FakeEngine in place of vLLM; `fail_on_call` interrupts it there."""
    def use(fail_on_call=None):
        def local_chunks(cfg, chunks):
            engine = FakeEngine(qwen_tok, fail_on_call=fail_on_call)
            for rows in chunks:
                yield run_chunk(rows, qwen_tok, cfg.chat, engine, 4096, cfg.reasoning)
        monkeypatch.setattr(R, "local_chunks", local_chunks)
        monkeypatch.setattr(R, "load_tokenizer", lambda model: qwen_tok)
    return use


def _data(tmp_path):
    objs = []
    for i in range(7):
        objs.append({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"},
                                  {"role": "user", "content": f"again {i}"}, {"role": "assistant", "content": "b"}]})
    objs.insert(3, {"text": "through"})
    objs.insert(5, "{broken")
    path = tmp_path / "in.jsonl"
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


@pytest.fixture
def model_and_data(tmp_path, qwen_tok):
    """The test tokenizer saved as a model directory, and `_data`'s rows."""
    tok_dir = tmp_path / "model"
    qwen_tok.save_pretrained(tok_dir)
    return tok_dir, _data(tmp_path)


def _whole_run(tmp_path, tok_dir, data, fake_engine_run):
    """An uninterrupted run into tmp_path/whole: (its directory, its summary)."""
    whole = tmp_path / "whole"
    whole.mkdir()
    fake_engine_run()
    return whole, R.regenerate(_config(whole, tok_dir, data))


def test_report_counts_and_resume_after_interrupt_and_torn_line(tmp_path, model_and_data, fake_engine_run):
    tok_dir, data = model_and_data
    whole, s = _whole_run(tmp_path, tok_dir, data, fake_engine_run)
    assert (s.read, s.regenerated, s.passed_through, len(s.failures)) == (9, 7, 1, 1)
    report = json.loads(R.report_path(whole / "out.jsonl").read_text())
    assert report["read"] == report["regenerated"] + report["passed_through"] + report["failed"] == 9
    assert report["failures"][0]["line"] == 6 and "invalid JSON" in report["failures"][0]["cause"]
    reference = (whole / "out.jsonl").read_bytes()
    assert [json.loads(x)["source_line"] for x in reference.decode().splitlines()] == [1, 2, 3, 4, 5, 7, 8, 9]

    part = tmp_path / "part"
    part.mkdir()
    fake_engine_run(fail_on_call=5)  # chunks of 2 chats take 2 calls each: stops inside the third chunk
    with pytest.raises(KeyboardInterrupt):
        R.regenerate(_config(part, tok_dir, data))
    out = part / "out.jsonl"
    assert not out.exists() and R.state_path(out).exists()
    state = json.loads(R.state_path(out).read_text())
    assert len(state["chunks"]) == 2
    # as a kill -9 in the middle of writing the third chunk leaves it: one whole row, one torn
    done = state["chunks"][-1]["bytes"]
    rest = reference[done:].split(b"\n")
    with open(R.part_path(out), "ab") as f:
        f.write(rest[0] + b"\n" + rest[1][: len(rest[1]) // 2])
    fake_engine_run()
    s2 = R.regenerate(_config(part, tok_dir, data))
    assert out.read_bytes() == reference
    assert s2.resumed_chunks == 2 and (s2.regenerated, s2.passed_through, len(s2.failures)) == (7, 1, 1)
    assert not R.state_path(out).exists() and not R.part_path(out).exists()
    # a finished output is left alone; other settings are refused, naming what differs
    assert R.regenerate(_config(part, tok_dir, data)).regenerated == 7
    with pytest.raises(UserError, match="other data or settings"):
        R.regenerate(_config(part, tok_dir, data, chunk_rows=3))


def test_resume_with_other_settings_is_refused(tmp_path, model_and_data, fake_engine_run):
    tok_dir, data = model_and_data
    fake_engine_run(fail_on_call=3)
    with pytest.raises(KeyboardInterrupt):
        R.regenerate(_config(tmp_path, tok_dir, data))
    fake_engine_run()
    with pytest.raises(UserError, match=r"other settings \(sampling differ\)") as exc:
        R.regenerate(R.RegenerateConfig(**{**_config(tmp_path, tok_dir, data).__dict__,
                                           "sampling": Sampling(max_tokens=8, temperature=0.5)}))
    assert "delete" in exc.value.fix
    data.write_text(data.read_text() + json.dumps({"text": "more"}) + "\n")
    with pytest.raises(UserError, match="another version"):
        R.regenerate(_config(tmp_path, tok_dir, data))


def test_bad_settings_refused_before_any_engine(tmp_path, model_and_data):
    tok_dir, data = model_and_data
    for kw, match in (({"sampling": Sampling(temperature=-1)}, "--temperature"),
                      ({"sampling": Sampling(top_p=0)}, "--top-p"),
                      ({"sampling": Sampling(max_tokens=0)}, "--max-tokens"),
                      ({"reasoning": "maybe"}, "--reasoning"),
                      ({"vllm": VLLMSettings(engine_args={"speculative_config": {}})}, "speculative_config"),
                      ({"vllm": VLLMSettings(capture_dir="/tmp")}, "--capture-dir")):
        cfg = R.RegenerateConfig(**{**_config(tmp_path, tok_dir, data).__dict__, **kw})
        with pytest.raises(UserError, match=match):
            R.regenerate(cfg)
    with pytest.raises(UserError, match="is the input file"):
        R.regenerate(R.RegenerateConfig(model=str(tok_dir), data=str(data), out=str(data)))


def test_source_line_is_read_and_checked():
    from eagle_fast.records import parse_line

    assert parse_line("f", 3, json.dumps({"text": "a", "source_line": 17})).source_line == 17
    assert parse_line("f", 3, json.dumps({"text": "a"})).source_line is None
    for bad in (0, -2, "4", True, 1.5):
        with pytest.raises(UserError, match=r"f:3: \"source_line\" must be a positive line number"):
            parse_line("f", 3, json.dumps({"text": "a", "source_line": bad}))


def test_a_full_disk_stops_clearly_and_resumes(tmp_path, model_and_data, fake_engine_run, monkeypatch):
    import errno

    tok_dir, data = model_and_data
    whole, _ = _whole_run(tmp_path, tok_dir, data, fake_engine_run)
    real = R.atomic_write_json
    calls = []

    def full_after_two(path, obj):
        calls.append(path)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(R, "atomic_write_json", full_after_two)
    part = tmp_path / "part"
    part.mkdir()
    with pytest.raises(UserError, match=r"the disk filled while writing .*out.jsonl.part .*: 4 rows are still to be "
                                        r"written; the chunks finished so far are kept") as exc:
        R.regenerate(_config(part, tok_dir, data))
    assert "resumes from the last finished chunk" in exc.value.fix
    monkeypatch.setattr(R, "atomic_write_json", real)
    R.regenerate(_config(part, tok_dir, data))
    assert (part / "out.jsonl").read_bytes() == (whole / "out.jsonl").read_bytes()
