"""The head's rules, read from each family's own transformers modules, and held to its logits.

What: the rules derived for every model type the hand-written table (`head._ARCH_HEADS`, gone)
listed are the table's (built from each config class's defaults, on the meta device); a norm with
a bias (GPT-2's LayerNorm, its `transformer.ln_f` / `wte` names) and a family with another norm
name (Nemotron-H's `norm_f`) load; a deliberately wrong rule, derived or given, is refused before
anything is written, with the numbers; a derivation is done once per config.
"""

from __future__ import annotations

import pytest
import torch
from _families import tiny_spec
from _pipeline import chat_lines, run_main, write_jsonl

import eagle_fast.head_rules as head_rules_mod
from eagle_fast.errors import UserError
from eagle_fast.head import TargetHead, check_checkpoint_head
from eagle_fast.head_rules import derive_head_rules
from eagle_fast.tiny import build_tiny_checkpoint

# The table the derivation replaced: model_type -> (norm, logit scale, softcap), with the config
# values it read set away from their defaults (so a rule that ignored them would differ).
REPLACED = {
    **dict.fromkeys(("llama", "llama4_text", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl",
                     "qwen3_vl", "qwen3_vl_moe", "qwen3", "qwen3_moe", "phi3", "deepseek_v2", "deepseek_v3", "glm4",
                     "olmo2", "gpt_oss"), ("rms", 1.0, None)),
    "granite": ("rms", 0.125, None), "granitemoe": ("rms", 0.125, None),
    "gemma": ("rms_one_plus", 1.0, None), "gemma2": ("rms_one_plus", 1.0, 30.0),
    "gemma3": ("rms_one_plus", 1.0, 30.0), "gemma3_text": ("rms_one_plus", 1.0, 30.0),
    "gemma4": ("rms", 1.0, 30.0), "gemma4_text": ("rms", 1.0, 30.0),
    **dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
                    ("rms_one_plus", 1.0, None)),
    # refused by the table ("a LayerNorm, not an RMSNorm"); read from their code now
    "cohere": ("layernorm", 0.0625, None), "cohere2": ("layernorm", 0.0625, None), "gpt2": ("layernorm", 1.0, None),
}
SET = {"granite": {"logits_scaling": 8.0}, "granitemoe": {"logits_scaling": 8.0},
       "gemma2": {"final_logit_softcapping": 30.0}, "gemma3_text": {"final_logit_softcapping": 30.0},
       "gemma4_text": {"final_logit_softcapping": 30.0},
       "gemma3": {"text_config": {"final_logit_softcapping": 30.0}},
       "gemma4": {"text_config": {"final_logit_softcapping": 30.0}}}


@pytest.mark.parametrize("model_type", sorted(REPLACED))
def test_derived_rules_are_the_table_they_replace(model_type):
    from transformers import AutoConfig

    rules = derive_head_rules(AutoConfig.for_model(model_type, **SET.get(model_type, {})))
    assert (rules.spec.norm, rules.spec.logit_scale, rules.spec.softcap) == REPLACED[model_type], rules
    assert rules.norm_bias is (model_type == "gpt2")


def test_gpt2_layernorm_with_bias_and_its_names(tmp_path):
    """GPT-2's head: nn.LayerNorm with a bias as `transformer.ln_f`, the tied `transformer.wte`; the
    head equals transformers' logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=300, n_positions=64)).eval()
    with torch.no_grad():
        model.transformer.ln_f.bias.normal_()
        model.transformer.ln_f.weight.normal_()
    model.save_pretrained(tmp_path)
    head = TargetHead.from_pretrained(tmp_path)
    assert head.tensor_names == {"embed": "transformer.wte.weight", "norm": "transformer.ln_f.weight",
                                 "lm_head": "transformer.wte.weight"}
    assert head.spec.norm == "layernorm" and head.norm_bias is not None
    captured = []  # the last block's output: the final pre-norm state
    model.transformer.h[-1].register_forward_hook(lambda _m, _i, o: captured.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, 300, (1, 9))).logits[0]
    torch.testing.assert_close(head.logits(captured[0][0]), logits, atol=1e-4, rtol=1e-4)


def test_a_wrong_derived_rule_is_caught_before_anything_is_written(tiny_dir, tmp_path, capsys, monkeypatch):
    """1 + w read on a plain RMSNorm family (Nemotron-H, whose norm is also named norm_f): `extract`
    stops at the plan with the numbers; the same rule given through the API is refused alike."""
    path = build_tiny_checkpoint(tiny_dir / "family-nemotron_h", tiny_spec("nemotron_h"))
    assert check_checkpoint_head(path).spec.norm == "rms"
    real = head_rules_mod.classify_norm
    monkeypatch.setattr(head_rules_mod, "classify_norm", lambda *a: ("rms_one_plus", *real(*a)[1:]))
    monkeypatch.setattr(head_rules_mod, "_CACHE", {})
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    code, _, err = run_main(capsys, "extract", "--model", path, "--data", data, "--out", tmp_path / "out",
                            "--engine", "hf")
    assert code == 2 and "rms_one_plus" in err and "do not reproduce transformers' own logits" in err, err
    assert "max |error|" in err and "256 random states x 517 vocabulary rows" in err, err
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"max \|error\| .* > 0.0001") as e:
        TargetHead.from_pretrained(path, overrides={"eps": 1e-2})  # a wrong eps: the small states show it
    assert "head_overrides" in e.value.fix


def test_a_derivation_is_done_once_per_config(tiny_dir, monkeypatch):
    from transformers import AutoConfig

    path = build_tiny_checkpoint(tiny_dir / "family-nemotron_h", tiny_spec("nemotron_h"))
    first = derive_head_rules(AutoConfig.from_pretrained(path))
    monkeypatch.setattr(head_rules_mod, "build_meta_model", lambda *a: pytest.fail("derived again"))
    assert derive_head_rules(AutoConfig.from_pretrained(path)) is first
    assert (first.norm_name, first.embed_name, first.spec.eps) == ("norm_f", "embeddings", 1e-5)
    other = AutoConfig.from_pretrained(path)
    other.layer_norm_epsilon = 1e-6
    with pytest.raises(pytest.fail.Exception, match="derived again"):  # another config: derived anew
        derive_head_rules(other)
