"""The chat options through the commands: `--chat-template`, `--chat-template-kwargs` and
`--supervise-empty-think` on vocab, extract and inspect, `inspect --show-mask`, the mask rule in
the manifest, and resume refusals (other chat settings; a dataset made by the old rule).

What: extract with vLLM's Qwen3-style template masks each stored sample as the marker oracle
does; vocab counts the same tokens extract supervises; the manifest records the rule, the
template's sha256 and the kwargs; a resume with other kwargs, or of a dataset whose manifest
predates the rule, is refused with nothing written; show-mask marks exactly the stored mask,
on a dataset and on a data file before any extraction.
"""

from __future__ import annotations

import json

import pytest
from _pipeline import run_main, tree_digest, write_jsonl
from _templates import SITE, oracle, oracle_mask

from eagle_fast.chat import MASK_RULE, for_template
from eagle_fast.inputs import load_tokenizer
from eagle_fast.store.dataset import Eagle3Dataset

QWEN3 = SITE / "vllm" / "transformers_utils" / "chat_templates" / "template_minicpmv45.jinja"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."},
     {"role": "user", "content": "And of Japan?"}, {"role": "assistant", "content": "Tokyo."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Spell cat."}, {"role": "assistant", "content": "c a t", "reasoning": "letters"},
     {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}],
    [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"},
     {"role": "user", "content": "Now 4 and 4?"}],
]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("chat") / "chats.jsonl", [{"messages": c} for c in CHATS])


def _extract(model, data, out, *extra):
    return ["extract", "--model", model, "--data", data, "--out", out, "--engine", "hf", "--max-len", "128",
            "--supervision", "lse", "--shard-size", "2", "--chat-template", QWEN3, *extra]


def test_extract_stores_the_full_render_masks(tmp_path, capsys, tiny_llama, chat_data):
    out = tmp_path / "ds"
    kwargs = '{"enable_thinking": false}'
    code, _, err = run_main(capsys, *_extract(tiny_llama, chat_data, out, "--chat-template-kwargs", kwargs))
    assert code == 0, err
    settings = json.loads((out / "manifest.json").read_text())["settings"]
    assert settings["masks"]["rule"] == MASK_RULE
    assert settings["masks"]["kwargs"] == {"enable_thinking": False}
    assert settings["masks"]["template_file"] == str(QWEN3) and settings["masks"]["supervise_empty_think"] is False

    tok = load_tokenizer(str(tiny_llama))
    marked = oracle("qwen3")
    ds = Eagle3Dataset(out)
    for i, chat in enumerate(CHATS):
        ids, want = oracle_mask(tok, for_template(chat, QWEN3.read_text()), marked, enable_thinking=False)
        sample = ds.sample_plan(i)
        assert sample.input_ids == ids and sample.loss_mask == want, i

    # show-mask prints exactly the stored mask, the dataset's and the data file's the same way
    code, shown, err = run_main(capsys, "inspect", out, "--show-mask", 0)
    assert code == 0, err
    assert "[[Paris is the capital of France.<|im_end|>]]\n<|im_start|>user" in shown
    assert "supervised (between [[ and ]])" in shown and "<think>" in shown.split("[[")[-2]
    code, from_file, err = run_main(capsys, "inspect", chat_data, "--show-mask", 1, "--model", tiny_llama,
                                    "--chat-template", QWEN3, "--chat-template-kwargs", kwargs)
    assert code == 0, err
    assert from_file.split("\n", 1)[1] == shown.split("\n", 1)[1]

    # vocab counts the tokens extract supervises, rendered with the same options
    code, stdout, err = run_main(capsys, "vocab", "--model", tiny_llama, "--data", chat_data, "--size", "8",
                                 "--out", tmp_path / "v.pt", "--chat-template", QWEN3,
                                 "--chat-template-kwargs", kwargs)
    assert code == 0, err
    stored = sum(sum(ds.sample_plan(i).loss_mask) for i in range(len(ds)))
    assert f"of {stored:,} supervised tokens in 3 samples" in stdout, stdout


def test_resume_refuses_other_chat_settings_and_old_masks(tmp_path, capsys, tiny_llama, chat_data):
    out = tmp_path / "ds"
    code, _, err = run_main(capsys, *_extract(tiny_llama, chat_data, out, "--shard", "0/2"))
    assert code == 0, err
    before = tree_digest(out)
    code, _, err = run_main(capsys, *_extract(tiny_llama, chat_data, out, "--shard", "0/2",
                                              "--chat-template-kwargs", '{"enable_thinking": true}'))
    assert code == 2 and "different settings" in err and "masks" in err
    code, _, err = run_main(capsys, *_extract(tiny_llama, chat_data, out, "--shard", "0/2",
                                              "--supervise-empty-think"))
    assert code == 2 and "masks" in err
    # A manifest written before the rule existed: its masks came from prefix renderings.
    part = next(out.glob("manifest.part-*.json"))
    m = json.loads(part.read_text())
    del m["settings"]["masks"]
    part.write_text(json.dumps(m))
    before = tree_digest(out)
    code, _, err = run_main(capsys, *_extract(tiny_llama, chat_data, out, "--shard", "0/2"))
    assert code == 2 and "older eagle-fast" in err and "prefixes" in err and "new --out" in err
    assert tree_digest(out) == before


def test_show_mask_errors(tmp_path, capsys, tiny_llama, chat_data):
    code, _, err = run_main(capsys, "inspect", chat_data, "--show-mask", 1)
    assert code == 2 and "--model" in err
    code, _, err = run_main(capsys, "inspect", chat_data, "--show-mask", 9, "--model", tiny_llama)
    assert code == 2 and "lines 1 to 3" in err
    code, _, err = run_main(capsys, "inspect", chat_data, "--model", tiny_llama)
    assert code == 2 and "--show-mask" in err
