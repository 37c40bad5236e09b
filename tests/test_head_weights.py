"""TargetHead: the three head tensors read straight from safetensors, and the head's settings.

Checked against transformers' own loaded weights (tied and untied), through a sharded index,
under multimodal prefixes, and for every norm variant / scale / softcap rule, with errors that
name what is missing. A recording `safe_open` proves nothing beyond the needed tensors is read.
The rules come from the family's transformers modules (head_rules.py); overrides win, and carry a
family transformers cannot build.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _assert import assert_close
from safetensors.torch import save_file

from eagle_fast.errors import UserError
from eagle_fast.head import TargetHead
from eagle_fast.head_rules import head_rules


@pytest.fixture
def record_reads(monkeypatch):
    """`start()` -> list that records every tensor name fetched through `safetensors.safe_open`.

    Started only once transformers is done loading (it opens files through the same name).
    """
    import safetensors

    real = safetensors.safe_open
    names: list[str] = []

    class _Handle:
        def __init__(self, *args, **kwargs):
            self._h = real(*args, **kwargs)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_tensor(self, name):
            names.append(name)
            return self._h.get_tensor(name)

        def __getattr__(self, attr):  # get_slice & co. count as reads too
            names.append(f"<{attr}>")
            return getattr(self._h, attr)

    def start() -> list[str]:
        import eagle_fast.head

        monkeypatch.setattr(eagle_fast.head, "safe_open", _Handle)  # the head's only reader
        return names

    return start


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_head_reads_only_its_tensors_and_matches_transformers(fixture, request, record_reads):
    path = request.getfixturevalue(fixture)
    model = _hf_model(path)
    record_reads = record_reads()
    head = TargetHead.from_pretrained(path)
    tied = fixture == "tiny_qwen3"
    assert head.tied is tied
    assert sorted(record_reads) == sorted(
        {"model.norm.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"}
    )
    assert torch.equal(head.lm_head_weight, model.lm_head.weight)
    assert torch.equal(head.norm_weight, model.model.norm.weight)
    assert head.spec.norm == "rms" and head.spec.eps == model.config.rms_norm_eps
    assert head.spec.logit_scale == 1.0 and head.spec.softcap is None
    # The untied embedding is read only when asked for, once.
    before = len(record_reads)
    assert torch.equal(head.embed_weight(), model.model.embed_tokens.weight)
    assert torch.equal(head.embed_weight(), model.model.embed_tokens.weight)
    assert len(record_reads) - before == (0 if tied else 1)
    if tied:
        assert head.embed_weight() is head.lm_head_weight


def test_sharded_index_checkpoint(tiny_llama, tmp_path, record_reads):
    model = _hf_model(tiny_llama)
    out = tmp_path / "sharded"
    model.save_pretrained(str(out), max_shard_size="200KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 3, "the checkpoint should really be sharded"
    assert len({index["weight_map"][n] for n in ("lm_head.weight", "model.norm.weight")}) == 2
    record_reads = record_reads()
    head = TargetHead.from_pretrained(out, dtype=torch.bfloat16)
    assert sorted(record_reads) == ["lm_head.weight", "model.norm.weight"]
    assert head.dtype == torch.bfloat16
    assert torch.equal(head.lm_head_weight, model.lm_head.weight.to(torch.bfloat16))


def _write(path, tensors: dict, config=None):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    if config is not None:
        config.save_pretrained(str(path))
    return path


def _gemma3_config(softcap=30.0):
    from transformers import Gemma3Config

    text = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 300,
        "rms_norm_eps": 1e-5,
        "final_logit_softcapping": softcap,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    return Gemma3Config(text_config=text, vision_config=vision)


def test_multimodal_prefix_gemma_one_plus_norm_and_softcap(tmp_path, record_reads):
    g = torch.Generator().manual_seed(0)
    V, H = 300, 64
    embed = torch.randn(V, H, generator=g)
    norm_w = 0.3 * torch.randn(H, generator=g)
    path = _write(
        tmp_path / "gemma3",
        {
            "model.language_model.embed_tokens.weight": embed,
            "model.language_model.norm.weight": norm_w,
            "model.language_model.layers.0.mlp.down_proj.weight": torch.randn(H, 96, generator=g),
            "model.vision_tower.vision_model.embeddings.patch_embedding.weight": torch.randn(
                32, 3, 14, 14
            ),
            "model.vision_tower.vision_model.post_layernorm.weight": torch.randn(32),
        },
        _gemma3_config(),
    )
    record_reads = record_reads()
    head = TargetHead.from_pretrained(path)
    assert head.tensor_names == {
        "embed": "model.language_model.embed_tokens.weight",
        "norm": "model.language_model.norm.weight",
        "lm_head": "model.language_model.embed_tokens.weight",
    }
    assert sorted(record_reads) == [
        "model.language_model.embed_tokens.weight",
        "model.language_model.norm.weight",
    ]
    assert (
        head.tied
        and head.spec.norm == "rms_one_plus"
        and head.spec.softcap == 30.0
        and head.spec.eps == 1e-5
    )
    x = 3 * torch.randn(5, 7, H, generator=g)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + norm_w.double())
    expected = 30.0 * torch.tanh((normed @ embed.double().T) / 30.0)
    assert_close(head.logits(x), expected, atol=2e-5, rtol=1e-5, name="gemma logits")


def _llama_config(V, H, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1, num_attention_heads=2,
                       vocab_size=V, **kw)


def test_language_model_prefix_untied_head(tmp_path):
    g = torch.Generator().manual_seed(1)
    V, H = 211, 64
    cfg = _llama_config(V, H, rms_norm_eps=1e-6, tie_word_embeddings=False)
    path = _write(
        tmp_path / "llava",
        {
            "language_model.model.embed_tokens.weight": torch.randn(V, H, generator=g),
            "language_model.model.norm.weight": torch.randn(H, generator=g),
            "language_model.lm_head.weight": torch.randn(V, H, generator=g),
            "multi_modal_projector.linear_1.weight": torch.randn(H, 32, generator=g),
        },
    )
    head = TargetHead.from_pretrained(path, cfg)
    assert head.tensor_names["lm_head"] == "language_model.lm_head.weight" and not head.tied


def test_logit_scale_layernorm_and_overrides():
    from transformers import CohereConfig, GraniteConfig

    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
             "vocab_size": 300}
    assert head_rules(GraniteConfig(**small, logits_scaling=8.0)).spec.logit_scale == 0.125
    cohere = head_rules(CohereConfig(**small, logit_scale=0.0625, layer_norm_eps=1e-5))  # mean-centred, no bias
    assert (cohere.spec.norm, cohere.spec.eps, cohere.spec.logit_scale, cohere.norm_bias) == (
        "layernorm", 1e-5, 0.0625, False)
    # a family transformers cannot build takes its rules from the overrides alone
    from transformers import PretrainedConfig

    unknown = PretrainedConfig(architectures=["MyArchForCausalLM"])
    with pytest.raises(UserError, match=r"cannot build .*MyArchForCausalLM") as e:
        head_rules(unknown)
    assert "head_overrides" in e.value.fix
    odd = head_rules(unknown, {"norm": "rms_one_plus", "eps": 1e-6, "softcap": 50.0})
    assert (odd.spec.norm, odd.spec.eps, odd.spec.softcap, odd.model_class) == ("rms_one_plus", 1e-6, 50.0, None)


def test_rules_that_cannot_be_read_name_what_is_missing():
    with pytest.raises(UserError, match=r"not a NoneType") as e:
        head_rules(None)  # no transformers config, no overrides
    assert "head_overrides" in e.value.fix
    with pytest.raises(ValueError, match="unknown keys"):
        head_rules(_llama_config(300, 64), {"nrom": "rms"})
    with pytest.raises(ValueError, match="norm='rmsnorm'"):
        head_rules(_llama_config(300, 64), {"norm": "rmsnorm"})


def test_checkpoint_missing_norm_or_head_errors(tiny_llama, tmp_path):
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_llama / "model.safetensors"))
    broken = tmp_path / "no_norm"
    shutil.copytree(tiny_llama, broken)
    save_file(
        {k: v for k, v in tensors.items() if k != "model.norm.weight"},
        str(broken / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"no final-norm weight.*model\.norm\.weight"):
        TargetHead.from_pretrained(broken)

    no_head = tmp_path / "no_head"
    shutil.copytree(tiny_llama, no_head)
    save_file(
        {k: v for k, v in tensors.items() if k != "lm_head.weight"},
        str(no_head / "model.safetensors"),
    )
    with pytest.raises(
        ValueError, match="tie_word_embeddings=False but the checkpoint has no LM-head"
    ):
        TargetHead.from_pretrained(no_head)

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny_llama / "config.json", empty / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        TargetHead.from_pretrained(empty)
