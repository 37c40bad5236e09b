"""`eagle-fast` command line: subcommands, user errors (cause + fix, exit 2, no
traceback), verify's exit status, progress output, the summary."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _pipeline import chat_lines, mixed_jsonl, run_main, tree_digest, write_jsonl

from eagle_fast.pipeline.run import Progress

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cli_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return mixed_jsonl(root / "d.jsonl", n_chat=10)


def extract_args(model, data, out, *extra):
    return ["extract", "--model", model, "--data", data, "--out", out, "--engine", "hf", "--max-len", "80",
            "--shard-size", "4", "--k", "6", *extra]


def test_extract_inspect_verify_merge(tmp_path, capsys, tiny_llama, cli_data):
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, *extract_args(tiny_llama, cli_data, out))
    assert code == 0, err
    for needle in ("12 (", "tokens", "tokens/s", "bytes/token", "fp32 logits", "saved"):
        assert needle in stdout, needle
    # plain progress lines when stderr is not a TTY, ending with the final state
    assert "tok/s ETA" in err and "\r[" not in err and "eagle-fast: 100.0% 12/12 samples" in err

    code, stdout, _ = run_main(capsys, "inspect", out)
    assert code == 0 and "supervision topk, k=6" in stdout and "3/3 shards complete" in stdout
    assert "lengths     min" in stdout
    code, stdout, _ = run_main(capsys, "inspect", out, "--json")
    assert code == 0 and json.loads(stdout)["num_samples"] == 12

    code, stdout, err = run_main(capsys, "verify", out, "--model", tiny_llama, "--samples", "5")
    assert code == 0, stdout + err
    assert "verify: PASS" in stdout and "topk_logprobs" in stdout

    # per-node parts, then merge
    for i in range(2):
        code, stdout, err = run_main(capsys, *extract_args(tiny_llama, cli_data, tmp_path / "parts",
                                                           "--shard", f"{i}/2"))
        assert code == 0, err
    assert "eagle-fast merge" in stdout
    code, stdout, _ = run_main(capsys, "inspect", tmp_path / "parts")
    assert code == 0 and "not merged yet" in stdout
    code, stdout, _ = run_main(capsys, "merge", tmp_path / "parts")
    assert code == 0 and "merged 3 shards" in stdout
    assert tree_digest(tmp_path / "parts", skip_manifest=True) == tree_digest(out, skip_manifest=True)


def test_verify_fails_past_tolerance(tmp_path, capsys, tiny_llama, cli_data, monkeypatch):
    import eagle_fast.pipeline.verify as verify_mod

    out = tmp_path / "out"
    assert run_main(capsys, *extract_args(tiny_llama, cli_data, out))[0] == 0
    real = verify_mod.default_runner_factory

    class Drifted:  # a target whose final hidden state carries 10 % noise (a scale alone would
        def __init__(self, runner):  # vanish in the final RMSNorm)
            self.runner = runner

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def capture(self, seqs):
            g = torch.Generator().manual_seed(0)
            return [(a, f + 0.1 * f.std() * torch.randn(f.shape, generator=g)) for a, f in self.runner.capture(seqs)]

    monkeypatch.setattr(verify_mod, "default_runner_factory", lambda *a: Drifted(real(*a)))
    code, stdout, _ = run_main(capsys, "verify", out, "--samples", "4")
    assert code == 1 and "verify: FAIL" in stdout and "FAIL" in stdout.split("topk_logprobs")[1].splitlines()[0]


def _vocab_file(tmp_path):
    from eagle_fast.vocab import DraftVocab, save_draft_vocab

    return save_draft_vocab(tmp_path / "v2.pt", DraftVocab(torch.arange(10), 1031))


def _bad_line_file(tmp_path):
    return write_jsonl(tmp_path / "bad.jsonl", chat_lines(2) + ['{"messages": [{"role": "robot", "content": "x"}]}'])


USER_ERRORS = [
    # (argv builder, expected message fragment)
    (lambda m, d, t: extract_args(t / "nope", d, t / "o"), "model directory"),
    (lambda m, d, t: extract_args(m, t / "missing.jsonl", t / "o"), "data file"),
    (lambda m, d, t: extract_args(m, _bad_line_file(t), t / "o"), "bad.jsonl:3: unknown role 'robot'"),
    (lambda m, d, t: extract_args(m, d, t / "o", "--shard", "3/2"), "need 0 <= I < N"),
    (lambda m, d, t: extract_args(m, d, t / "o", "--aux-layers", "1,1,2"), "with repeats"),
    (lambda m, d, t: extract_args(m, d, t / "o", "--aux-layers", "0,1,9"), "out of range"),
    (lambda m, d, t: extract_args(m, d, t / "o", "--supervision", "draft"), "needs a draft vocabulary"),
    (lambda m, d, t: extract_args(m, d, t / "o", "--format", "nemo", "--supervision", "lse"), "--format nemo"),
    (lambda m, d, t: extract_args(m, d, t / "o", "--draft-vocab", t / "v.pt"), "draft vocabulary file"),
    (lambda m, d, t: extract_args(m, d, t / "o", "--draft-vocab", _vocab_file(t), "--supervision", "topk"),
     "only applies to --supervision"),
    (lambda m, d, t: extract_args(m, d, t / "o", "--max-len", "99999"), "max_position_embeddings"),
    (lambda m, d, t: ["verify", t], "not an eagle-fast dataset"),
    (lambda m, d, t: ["inspect", t / "nothing"], "is not a directory"),
    (lambda m, d, t: ["merge", t / "empty"], "no part manifests"),
    (lambda m, d, t: ["vocab", "--model", m, "--data", d, "--size", "0", "--out", t / "v.pt"], "--size must be"),
]


@pytest.mark.parametrize("build, message", USER_ERRORS)
def test_user_errors_exit_2_with_cause_and_fix(tmp_path, capsys, tiny_llama, cli_data, build, message):
    code, _, err = run_main(capsys, *build(str(tiny_llama), str(cli_data), tmp_path))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines[-2].startswith("eagle-fast: error: ") and message in lines[-2], err
    assert lines[-1].startswith("eagle-fast: fix: ")
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_mixed_settings_refused_dir_unchanged(tmp_path, capsys, tiny_llama, cli_data):
    out = tmp_path / "out"
    assert run_main(capsys, *extract_args(tiny_llama, cli_data, out))[0] == 0
    before = tree_digest(out)
    code, _, err = run_main(capsys, *extract_args(tiny_llama, cli_data, out, "--supervision", "lse"))
    assert code == 2 and "different settings (" in err and "supervision: \"topk\" -> \"lse\"" in err and "fix:" in err
    assert tree_digest(out) == before


def test_argparse_errors_exit_2(capsys):
    code, _, err = run_main(capsys, "extract", "--model", "m")
    assert code == 2 and "required" in err
    code, _, _ = run_main(capsys)
    assert code == 2


def test_console_script_and_module_entry(tmp_path, tiny_llama):
    env = {**os.environ, "PYTHONPATH": ""}
    script = BIN / "eagle-fast"
    assert script.exists()
    res = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.returncode == 0 and "extract" in res.stdout and "demo" in res.stdout
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    res = subprocess.run([sys.executable, "-m", "eagle_fast", "extract", "--model", str(tiny_llama), "--data",
                          str(bad), "--out", str(tmp_path / "o"), "--engine", "hf"],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert res.returncode == 2 and "bad.jsonl:1: invalid JSON" in res.stderr
    lines = res.stderr.strip().splitlines()  # the derived head rules' one line, then error: and fix:
    assert "Traceback" not in res.stderr and len(lines) == 3 and lines[0].startswith("eagle-fast: head rules: ")
    assert lines[1].startswith("eagle-fast: error: ") and lines[2].startswith("eagle-fast: fix: "), lines


def test_progress_bar_on_a_terminal():
    # On a terminal: tqdm's bar, with tokens/s and samples done; off one: plain log lines.
    stream = io.StringIO()
    p = Progress(total_tokens=1000, total_samples=10, stream=stream, tty=True)
    p.update(3, 300, force=True)
    p.update(7, 700, force=True)
    p.close()
    text = stream.getvalue()
    assert "\r" in text and "100%" in text and "10/10 samples" in text and "tok/s" in text
    assert "1.00k/1.00k" in text and text.endswith("\n")
    plain = io.StringIO()
    q = Progress(total_tokens=10, total_samples=1, stream=plain, tty=False)
    q.update(1, 10, force=True)
    assert plain.getvalue().startswith("eagle-fast: 100.0% 1/1 samples") and "\r" not in plain.getvalue()


def test_dtype_auto_follows_the_checkpoint(tiny_llama, tmp_path):
    from eagle_fast.checkpoint import resolve_dtype_name as resolve_dtype

    assert resolve_dtype(str(tiny_llama), "auto") == "fp32"
    cfg = json.loads((Path(tiny_llama) / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_dtype(str(tmp_path), "auto") == "bf16" and resolve_dtype(str(tmp_path), "fp16") == "fp16"
    assert torch.float32  # torch imported for the fixture models


def test_default_max_len_fits_a_short_context_model(tmp_path, capsys, tiny_short_ctx):
    from eagle_fast.store.dataset import Eagle3Dataset
    from eagle_fast.vocab import load_draft_vocab

    # 512 positions: the default max len is 511 (vLLM generates one token past the prompt). The
    # long line's tokens past 511 are all id 1000: counted by `vocab` only if it truncates wrongly.
    long = {"input_ids": list(range(3, 514)) + [1000] * 89}
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(4) + [json.dumps(long)])
    out = tmp_path / "out"
    base = ["extract", "--model", tiny_short_ctx, "--data", data, "--engine", "hf", "--k", "4"]
    code, _, err = run_main(capsys, *base, "--out", out)
    assert code == 0, err
    m = json.loads((out / "manifest.json").read_text())
    assert m["settings"]["max_len"] == 511 and m["data"]["truncated"] == 1
    ds = Eagle3Dataset(out)
    assert max(ds.length(i) for i in range(len(ds))) == 511
    code, stdout, _ = run_main(capsys, "inspect", out)
    assert code == 0 and "1 truncated, 0 skipped at max_len 511" in stdout

    code, _, err = run_main(capsys, *base, "--out", tmp_path / "o", "--max-len", "1024")
    assert code == 2 and "--max-len 1024 exceeds the model's max_position_embeddings 512" in err
    assert "fix: pass --max-len 512 or less" in err and not (tmp_path / "o").exists()

    code, _, err = run_main(capsys, "vocab", "--model", tiny_short_ctx, "--data", data, "--size", "64",
                            "--out", tmp_path / "v.pt")
    assert code == 0, err
    assert 1000 not in load_draft_vocab(tmp_path / "v.pt", 1031).ids.tolist()


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "empty-out"])
def test_nan_head_is_refused_and_leaves_out_as_it_was(tmp_path, capsys, tiny_llama, cli_data, existing):
    """A NaN in lm_head.weight is found when the head is built, after the run has begun: the
    refusal names the row and leaves --out as it found it (no manifest to resume from)."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan_model"
    shutil.copytree(tiny_llama, model)
    weights = model / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"][11, 3] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    out = tmp_path / "o"
    if existing:
        out.mkdir()
    code, _, err = run_main(capsys, *extract_args(str(model), cli_data, out))
    assert code == 2 and "row 11 has NaN" in err and "corrupt" in err, err
    assert out.exists() == existing and (not existing or not any(out.iterdir()))
