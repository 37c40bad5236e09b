"""eagle_fast: EAGLE-3 training supervision from a frozen target LLM, fast and exact.

vLLM's `extract_hidden_states` captures the aux layers and the final pre-norm hidden state in
one prefill; `eagle_fast.kernels.lm_head` turns the final hidden state into the supervision a
draft model trains on without materialising full fp32 [tokens, vocab] logits.

Importing this package touches neither CUDA nor vLLM nor transformers: public names resolve
lazily, so `import eagle_fast` works on a machine with no GPU and no engine installed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_LAZY = {
    "TargetRunner": "eagle_fast.runners.base",
    "Supervision": "eagle_fast.supervision",
    "HFTargetRunner": "eagle_fast.runners.hf",
    "VLLMTargetRunner": "eagle_fast.runners.vllm",
    "TargetHead": "eagle_fast.head",
    "DraftDataset": "eagle_fast.store.dataset",
    "Eagle3Dataset": "eagle_fast.store.dataset",
    "ExtractConfig": "eagle_fast.pipeline.plan",
    "extract": "eagle_fast.pipeline.plan",
    "RayOptions": "eagle_fast.pipeline.distributed",
    "VLLMSettings": "eagle_fast.runners.engine_settings",
}

# The names of _LAZY plus __version__ (tests/test_packaging.py checks they agree).
__all__ = [
    "DraftDataset",
    "Eagle3Dataset",
    "ExtractConfig",
    "HFTargetRunner",
    "RayOptions",
    "Supervision",
    "TargetHead",
    "TargetRunner",
    "VLLMSettings",
    "VLLMTargetRunner",
    "__version__",
    "extract",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'eagle_fast' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
