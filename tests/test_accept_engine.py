"""`eagle-fast accept`: vLLM's own EAGLE-3 counters over a draft, and the drafts it refuses.

The rigged pair: a target and a draft whose final norms are zeroed compute all-zero logits, so
both always pick id 0 and every drafted token is accepted: exactly K + 1, every per-position
rate 1.0. A random draft beside the trained tiny target is accepted far less. The engine runs
happen through the CLI in a subprocess (vLLM's engine needs a `__main__` guard); the refusals
are checked in-process with the engine start replaced by a failure, so a refusal that came
after the engine would fail the test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _bench import load_bench
from safetensors.torch import load_file, save_file

from eagle_fast import cli
from eagle_fast.demo import cache_dir, demo_data_path
from eagle_fast.errors import UserError
from eagle_fast.inputs import load_tokenizer
from eagle_fast.loop import accept as accept_mod
from eagle_fast.loop.drafts import DraftFit, check_draft
from eagle_fast.loop.rows import Failure, read_rows
from eagle_fast.tiny import build_trained_tiny, trained_tiny_dir

ROOT = Path(__file__).resolve().parents[1]
AUX = (1, 2, 4)          # vLLM's ids on the 4-layer target: layers 0, 1 and 3's outputs
DRAFT_VOCAB = 512


# ------------------------------------------------------------------------------ builders
def eagle3_draft(target: Path, out: Path, *, aux_ids=AUX, draft_vocab=DRAFT_VOCAB, hidden=None, zero_norm=False,
                 seed=0, config: dict | None = None, weights: dict | None = None) -> Path:
    """A random EAGLE-3 draft in the HF layout (LlamaForCausalLMEagle3: midlayer.*, fc, d2t, t2d)
    for `target`; its draft vocabulary holds id 0 first. `config` / `weights` override entries
    (a weight set to None is left out)."""
    t = json.loads((target / "config.json").read_text())
    h, v = hidden or t["hidden_size"], t["vocab_size"]
    heads, kv, hd, inter = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"], t["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    selected = torch.cat([torch.tensor([0]), 1 + torch.randperm(v - 1, generator=g)[: draft_vocab - 1].sort().values])
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[selected] = True
    w = {"fc.weight": rand(h, len(aux_ids) * h),
         "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * h),
         "midlayer.self_attn.k_proj.weight": rand(kv * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": rand(kv * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": rand(h, heads * hd),
         "midlayer.mlp.gate_proj.weight": rand(inter, h), "midlayer.mlp.up_proj.weight": rand(inter, h),
         "midlayer.mlp.down_proj.weight": rand(h, inter),
         "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.post_attention_layernorm.weight": torch.ones(h),
         "midlayer.hidden_norm.weight": torch.ones(h),
         "norm.weight": torch.zeros(h) if zero_norm else torch.ones(h),
         "lm_head.weight": rand(draft_vocab, h), "d2t": selected - torch.arange(draft_vocab), "t2d": t2d}
    for k, val in (weights or {}).items():
        w.pop(k) if val is None else w.__setitem__(k, val)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
           "num_hidden_layers": 1, "vocab_size": v, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6,
           "max_position_embeddings": t["max_position_embeddings"], "rope_theta": 10000.0,
           "tie_word_embeddings": False, "eagle_aux_hidden_state_layer_ids": list(aux_ids), "torch_dtype": "float32"}
    cfg.update(config or {})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: x.contiguous() for k, x in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def speculators_draft(target: Path, out: Path, *, k: int, zero_norm: bool) -> Path:
    """A speculators Eagle3DraftModel built as its trainer builds one (verifier embeddings and head
    rows), draft vocabulary holding id 0 first, saved through speculators' own save_pretrained."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    trainers = load_bench("accept_trainers")
    v = json.loads((target / "config.json").read_text())["vocab_size"]
    selected = torch.cat([torch.tensor([0]), 1 + torch.randperm(v - 1)[: DRAFT_VOCAB - 1].sort().values])
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[selected] = True
    layer = create_transformer_layer_config(str(target), 1, "llama", None, None, [])
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        layer, t2d=t2d, d2t=selected - torch.arange(DRAFT_VOCAB), verifier_name_or_path=str(target),
        draft_vocab_size=DRAFT_VOCAB, norm_before_residual=False, ttt_steps=k, draft_attn_impl="eager",
        target_layer_ids=list(AUX)).to(torch.float32)
    if zero_norm:
        with torch.no_grad():
            model.norm.weight.zero_()
    return trainers.save_speculators_draft(model, out)


def run_accept(target: Path, draft: Path, data: Path, out: Path, k: int) -> tuple[dict, str]:
    """`eagle-fast accept` in a subprocess: (its --json result, its stdout)."""
    proc = subprocess.run([sys.executable, "-m", "eagle_fast", "accept", "--model", str(target), "--draft", str(draft),
                           "--data", str(data), "-k", str(k), "--max-tokens", "16", "--enforce-eager",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def target() -> Path:
    return build_trained_tiny(trained_tiny_dir(cache_dir()))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("accept")


@pytest.fixture(scope="module")
def rigged_target(target, work) -> Path:
    out = work / "rigged-target"
    shutil.copytree(target, out)
    w = load_file(str(out / "model.safetensors"))
    w["model.norm.weight"] = torch.zeros_like(w["model.norm.weight"])
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def data(work) -> Path:
    """Four chats, then a chat with no user turn (line 5), a broken line (6), a text row (7)."""
    chats = demo_data_path().read_text().splitlines()[:4]
    lines = chats + ['{"messages": [{"role": "assistant", "content": "hello"}]}', "{not json",
                     '{"text": "Tell me about pancakes."}']
    path = work / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def rigged_hf(rigged_target, data, work):
    draft = eagle3_draft(rigged_target, work / "rigged-hf", zero_norm=True)
    return run_accept(rigged_target, draft, data, work / "rigged-hf.json", k=3)


# ------------------------------------------------------------------------------ engine runs
def test_rigged_pair_accepts_every_draft_token(rigged_hf):
    res, _ = rigged_hf
    assert res["num_drafts"] > 0
    assert res["mean_acceptance_length"] == 4.0
    assert res["acceptance_per_position"] == [1.0, 1.0, 1.0]
    assert res["num_accepted_tokens"] == res["num_draft_tokens"] == 3 * res["num_drafts"]
    assert res["draft_fit"]["layout"] == "eagle3-hf"
    assert res["output_tokens"] == 5 * 16 and res["output_tokens_per_s"] > 0


def test_bad_prompt_lines_are_reported_with_their_numbers(rigged_hf):
    res, stdout = rigged_hf
    assert (res["read"], res["prompts"], res["failed"]) == (7, 5, 2)
    assert [f["line"] for f in res["failures"]] == [5, 6]
    assert "no user turn" in res["failures"][0]["cause"]
    assert "invalid JSON" in res["failures"][1]["cause"]
    assert "line 5: the conversation has no user turn" in stdout
    assert "line 6: invalid JSON" in stdout


def test_speculators_saved_draft_loads(rigged_target, data, work):
    """speculators' own save, loaded by vLLM: the rigged pair at K=2 reads exactly 3."""
    draft = speculators_draft(rigged_target, work / "rigged-speculators", k=2, zero_norm=True)
    res, _ = run_accept(rigged_target, draft, data, work / "rigged-speculators.json", k=2)
    assert res["draft_fit"]["layout"] == "speculators"
    assert res["mean_acceptance_length"] == 3.0
    assert res["acceptance_per_position"] == [1.0, 1.0]


def test_random_draft_is_accepted_far_less(target, data, work):
    draft = eagle3_draft(target, work / "random-hf", seed=1)
    res, _ = run_accept(target, draft, data, work / "random-hf.json", k=3)
    assert res["num_drafts"] > 0
    assert res["mean_acceptance_length"] < 1.5
    assert len(res["acceptance_per_position"]) == 3 and max(res["acceptance_per_position"]) < 0.5


# ------------------------------------------------------------------------------ refusals
def _hidden_64(target, out):
    return eagle3_draft(target, out, hidden=64)


MISFITS = {
    "hidden size": (_hidden_64, "built for a target of hidden size 64 (its hidden_size), but"),
    "aux id out of range": (lambda t, o: eagle3_draft(t, o, aux_ids=(1, 2, 5)),
                            "aux layer id [5] (config: [1, 2, 5]) out of range"),
    "default taps collapse": (lambda t, o: eagle3_draft(t, o, config={"eagle_aux_hidden_state_layer_ids": None}),
                              "vLLM taps 2 distinct target layers (vLLM's default: [2, 2, 1])"),
    "d2t past the vocabulary": (lambda t, o: eagle3_draft(t, o, weights={"d2t": torch.full((DRAFT_VOCAB,), 1500)}),
                                "d2t maps draft id 423 to target id 1923"),
    "no d2t": (lambda t, o: eagle3_draft(t, o, weights={"d2t": None}), "its weights have no d2t"),
    "fc width": (lambda t, o: eagle3_draft(t, o, weights={"fc.weight": torch.zeros(128, 256)}),
                 "fc.weight is [128, 256], but vLLM builds it as [128, 384]"),
    "vocab size": (lambda t, o: eagle3_draft(t, o, config={"vocab_size": 1031}), "has vocab_size 1031, but"),
    "layers never loaded": (lambda t, o: eagle3_draft(t, o, config={"num_hidden_layers": 4}),
                            "its config says num_hidden_layers 4, but its weights hold 1 decoder layer"),
    "NeMo training checkpoint": (lambda t, o: eagle3_draft(t, o, config={"architectures": ["LlamaEagle3DraftModel"]}),
                                 "is NeMo AutoModel's training checkpoint"),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_misfit_draft_is_refused_before_any_engine(case, target, data, tmp_path, monkeypatch, capsys):
    build, named = MISFITS[case]
    draft = build(target, tmp_path / "draft")

    def no_engine(kwargs):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(accept_mod.generation, "start", no_engine)
    rc = cli.main(["accept", "--model", str(target), "--draft", str(draft), "--data", str(data)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert named in err, err
    assert "eagle-fast: fix:" in err
    with pytest.raises(UserError, match="EAGLE-3|draft|fc|d2t|vocab|layer"):
        check_draft(draft, target)


def test_bench_measure_reports_a_refusal(target, tmp_path):
    """bench/accept_vllm.py measures through the product: its refusal comes back as one."""
    bench = load_bench("accept_vllm")
    draft = eagle3_draft(target, tmp_path / "draft", aux_ids=(1, 2, 9))
    res = bench.measure_vllm_acceptance(target, draft, [[5, 6, 7]], timeout_s=120)
    assert res["ok"] is False and res["stage"] == "refused", res
    assert "out of range" in res["error"]


# ------------------------------------------------------------------------------ no engine
def test_num_prompts_takes_the_first_rows(target, data):
    rows, _, _, _ = read_rows(data)
    tok = load_tokenizer(str(target))
    prompts, bad, looked = accept_mod.build_prompts(tok, iter(rows), cli.ChatFormat(), 2)
    assert [p.line for p in prompts] == [1, 2] and not bad and len(rows) - looked == 4  # rows 3, 4, 5, 7 unread
    prompts, bad, looked = accept_mod.build_prompts(tok, rows, cli.ChatFormat(), None)
    assert [p.line for p in prompts] == [1, 2, 3, 4, 7] and [f.line for f in bad] == [5] and looked == len(rows)
    text = tok.decode(prompts[0].ids)  # up to the last user turn, then the generation prompt
    assert text.endswith("<|im_start|>assistant\n")
    assert "How many vowels are in 'embarrass'?" in text and "has 3 vowels" not in text


def test_result_counts_and_text():
    fit = DraftFit("eagle3-hf", "LlamaForCausalLMEagle3", 128, 1, [1, 2, 4], "config", 1923, 512, True)
    res = accept_mod.AcceptResult("m", "d", "data", "sha", 3, "fp32", {}, fit, read=3, prompts=2,
                                  failures=[Failure(3, "invalid JSON", "fix it")],
                                  counters={"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
                                            "num_accepted_tokens_per_pos": [6, 4, 2]},
                                  output_tokens=50, generate_seconds=2.0)
    assert res.mean_acceptance_length() == 2.2
    assert res.acceptance_per_position() == [0.6, 0.4, 0.2]
    assert res.output_tokens_per_s() == 25.0
    assert "line 3: invalid JSON (fix: fix it)" in res.text()
