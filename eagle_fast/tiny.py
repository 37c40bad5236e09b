"""Tiny target checkpoints (random, or trained for seconds) and an offline tokenizer, built locally.

No model hub is reachable here (nor needed): the tests, the benchmarks and `eagle-fast demo`
build small checkpoints of the families in `FAMILIES` (Llama, Qwen, Mistral, Phi-3, OLMo-2,
Granite, Gemma-2/3) with transformers' `save_pretrained` (safetensors)
and a byte-level BPE tokenizer trained on an embedded corpus, with a ChatML chat template
whose `{% generation %}` markers let transformers return the assistant-token mask.

`build_trained_tiny` also trains one (plain AdamW, under a minute on 2 cores) on the bundled
chat data until its next-token distributions are peaked like a real LM's, for measurements that
need that (storage fidelity); `training.json` beside it records the loss and the held-out
peakedness before and after.

Design limits: the random models' "predictions" are noise; they exist to exercise every code
path with real file formats; the trained one knows only the templated demo chats. Head dims
are kept in vLLM-CPU's supported set (32, 64, 80, 96, 112, 128, ...), and vocab sizes are
deliberately not powers of two.
Everything is deterministic for a given seed, and a build is atomic (temp dir + rename), so
a cache dir is either complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
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
    # Gemma-4 text: a plain RMSNorm head (w, not Gemma-3's 1 + w) with the final softcap, sliding
    # and full layers, per-layer input embeddings (their vocabulary: the model's, set below).
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                    {"final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 16, "sliding_window": 128}),
    # MoE: a few small experts, two per token, on every layer.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    # gpt-oss as released: RMSNorm eps 1e-5, the value vLLM's model hard-codes (factory.engine_differs)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                      "rms_norm_eps": 1e-5}),
    # DeepSeek-V3: MLA at the released head shapes (kv_lora_rank 512 + a RoPE part of 64: vllm-cpu's
    # MLA backend takes no other), low-rank q, and MoE after a dense layer, routed as released
    # (noaux_tc: sigmoid scores and e_score_correction_bias, which vLLM's loader then expects).
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "moe_intermediate_size": 64, "kv_lora_rank": 512, "q_lora_rank": 96,
                     "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64,
                     "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                     "num_key_value_heads": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
    # Qwen3-Next: gated-delta-net linear attention on every other layer (at the released head
    # dim of 128, the only one vllm-cpu's GDN kernel takes), full attention between, MoE with
    # a shared expert on every layer.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {"linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    # Qwen3.5 text (dense): Qwen3-Next's gated-delta-net layers, at the same head dim, between full ones.
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                     {"linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 128,
                      "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 2}),
    # Qwen2.5-VL: a multimodal wrapper (vision tower + Qwen2 decoder with M-RoPE); the decoder takes
    # the shared shape (`text_config`), the rest is the family's. Both engines refuse it on vllm-cpu.
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   {"text_config": {"rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}},
                    "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                                      "out_hidden_size": 128, "fullatt_block_indexes": [1]},
                    "image_token_id": 1000, "video_token_id": 1001, "vision_start_token_id": 1002,
                    "vision_end_token_id": 1003}),
    # Llama-4 text: MoE on every layer, QK norm, no-RoPE layers; chunked attention at vLLM's
    # smallest chunk (a multiple of its 128-token KV block).
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
                     "interleave_moe_layer_step": 1, "attention_chunk_size": 128}),
    # Families eagle_fast names nowhere else: their head rules are derived from transformers' own
    # modules (head_rules.py). MoE ones at a few small experts, two per token. Where vLLM reads a
    # config key that transformers' class does not define, the released checkpoints' value is set.
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   {"num_local_experts": 4, "num_experts_per_tok": 2, "rotary_dim": 16, "scoring_func": "sigmoid",
                    "use_routing_bias": True}),
    # Nemotron-H: Mamba-2, MoE, attention and MLP layers; its decoder names its norm `norm_f`, its
    # embedding `embeddings`
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   {"layers_block_type": ["mamba", "moe", "attention", "mlp"], "mamba_num_heads": 4,
                    "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1, "chunk_size": 16,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "moe_shared_expert_intermediate_size": 64, "layer_norm_epsilon": 1e-5}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM",
              {"num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 64,
               "num_dense_layers": 1, "global_attn_every_n_layers": 2, "sliding_window": 128,
               "score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}),
    # Cohere2-MoE as released: a mean-centred LayerNorm head (no rms_norm_eps), logits times logit_scale
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM",
                    {"num_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": None, "layer_norm_eps": 1e-5,
                     "logit_scale": 0.25, "sliding_window": 128, "sliding_window_pattern": 2}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 64,
                  "first_k_dense_replace": 1}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": 128}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     {"moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1, "moe_intermediate_size": 64,
                      "moe_layer_start_index": 1}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {"num_experts": 4, "moe_topk": 2}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": 128, "sliding_window_pattern": 2}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {}),
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


def _random_model(spec: TinySpec):
    """The transformers model of `spec`, randomly initialised from `spec.seed` (fp32)."""
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
    if spec.arch == "gemma4_text":  # per-layer embeddings over the whole (tiny) vocabulary, not 262,144
        family = {**family, "vocab_size_per_layer_input": spec.vocab_size}
    Model = getattr(transformers, model_name)
    if "vision_config" in family:  # a multimodal wrapper: the shared shape is its decoder's
        family = {**family, "text_config": {**common, **family["text_config"]},
                  "tie_word_embeddings": spec.tie_word_embeddings}
        common = {}
    cfg = getattr(transformers, config_name)(**{**common, **family})  # a family's own values win
    torch.manual_seed(spec.seed)
    model = Model(cfg)
    # Random norm weights (not all ones) so a missed or mis-ordered norm shows in tests.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.25 * torch.randn_like(p))
    return model


def _save_model(model, spec: TinySpec, out: Path) -> None:
    """save_pretrained in `spec`'s dtype (safetensors), the config saying that dtype."""
    dtype = getattr(torch, spec.torch_dtype)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(str(out), safe_serialization=True)


def _publish(tmp: Path, out: Path) -> None:
    """Put a finished build at `out`, replacing whatever was there (same filesystem: a rename)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


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
        model = _random_model(spec)
        _save_model(model, spec, tmp)
        build_tokenizer(tmp, spec.tokenizer_vocab)
        (tmp / ".complete").write_text(json.dumps(asdict(spec), sort_keys=True))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ------------------------------------------------------------------------- trained targets
# A random target's next-token distributions are nearly flat, so storage fidelity measured on
# one (KL of a top-k or fp8 copy) says nothing about a real LM. These helpers train a tiny
# target on the bundled chat data until its distributions are peaked, and cache it the same
# way (temp dir + rename; `.complete` names the exact build, so any other dir is rebuilt).

TRAINING_REPORT = "training.json"


@dataclass(frozen=True)
class TrainSpec:
    """How a tiny target is trained: plain AdamW on demo_chat.jsonl, every token a target."""

    steps: int = 160
    batch_size: int = 16      # conversations per step (the data averages ~72 tokens each)
    lr: float = 5e-3          # peak; linear warm-up, then cosine decay to lr / 10
    warmup: int = 10
    weight_decay: float = 0.01
    held_out: int = 40        # the data's last lines: never trained on, the peakedness report
    seed: int = 0             # batch order (the init comes from TinySpec.seed)


# Qwen3-style, 4 layers of hidden 128 (2 heads of 64, a vLLM-CPU head size), tied head; the vocab
# is the bundled BPE's full size (the corpus saturates it at 1,923 tokens).
TRAINED_SPEC = TinySpec(arch="qwen3", hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64, intermediate_size=384, vocab_size=1923,
                        tie_word_embeddings=True, max_position_embeddings=2048, torch_dtype="float32",
                        seed=11, tokenizer_vocab=1923)


def _data_path() -> Path:
    return Path(__file__).with_name("data") / "demo_chat.jsonl"


def _build_key(spec: TinySpec, train: TrainSpec) -> dict:
    data = hashlib.sha256(_data_path().read_bytes()).hexdigest()[:16]
    return {"spec": asdict(spec), "train": asdict(train), "data_sha256": data}


def trained_tiny_dir(cache: str | os.PathLike, spec: TinySpec = TRAINED_SPEC,
                     train: TrainSpec = TrainSpec()) -> Path:
    """Where `build_trained_tiny` caches this build under a cache root (cf. demo.cache_dir)."""
    blob = json.dumps(_build_key(spec, train), sort_keys=True).encode()
    return Path(cache) / "models" / f"trained-{spec.key()}-s{train.steps}-{hashlib.sha256(blob).hexdigest()[:10]}"


def _is_complete(out: Path, key: dict) -> bool:
    marker = out / ".complete"
    try:
        return (out / "config.json").exists() and (out / TRAINING_REPORT).exists() and \
            json.loads(marker.read_text()) == key
    except (OSError, ValueError):
        return False


def _chat_sequences(tok, lines: list[str]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, assistant mask) per conversation line, through the tokenizer's chat template."""
    out = []
    for raw in lines:
        enc = tok.apply_chat_template(json.loads(raw)["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), [int(bool(m)) for m in enc["assistant_masks"]]))
    return out


def _pad(seqs: list[list[int]], value: int) -> torch.Tensor:
    T = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (T - len(s)) for s in seqs], dtype=torch.int64)


@torch.no_grad()
def peakedness(model, sequences: list[tuple[list[int], list[int]]], batch_size: int = 16) -> dict:
    """How peaked `model`'s next-token distributions are on `sequences` ((ids, assistant mask)).

    Over every position t with a next token (`all`) and over those whose next token is an
    assistant token (`assistant`, the positions a draft is supervised on): mean max
    probability, mean entropy (nats) and mean NLL of the actual next token (nats).
    """
    model.eval()
    sums = {g: {"max_prob": 0.0, "entropy": 0.0, "nll": 0.0, "positions": 0} for g in ("all", "assistant")}
    for i in range(0, len(sequences), batch_size):
        chunk = sequences[i: i + batch_size]
        ids = _pad([s for s, _ in chunk], 0)
        valid = _pad([[1] * len(s) for s, _ in chunk], 0).bool()
        asst = _pad([m for _, m in chunk], 0).bool()
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=valid.long()).logits.float(), dim=-1)
        logp, nxt = logp[:, :-1], ids[:, 1:]
        stats = {"max_prob": logp.max(dim=-1).values.exp(),
                 "entropy": -(logp.exp() * logp).sum(dim=-1),
                 "nll": -logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)}
        for group, mask in (("all", valid[:, 1:]), ("assistant", valid[:, 1:] & asst[:, 1:])):
            sums[group]["positions"] += int(mask.sum())
            for name, value in stats.items():
                sums[group][name] += float(value[mask].double().sum())
    return {g: {k: (v if k == "positions" else round(v / max(s["positions"], 1), 4)) for k, v in s.items()}
            for g, s in sums.items()}


def _lr_at(step: int, train: TrainSpec) -> float:
    if step < train.warmup:
        return train.lr * (step + 1) / train.warmup
    frac = (step - train.warmup) / max(train.steps - train.warmup, 1)
    return train.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def _train(model, sequences: list[tuple[list[int], list[int]]], train: TrainSpec) -> list[float]:
    """Next-token cross-entropy on every real token, AdamW; returns the loss of every step."""
    gen = torch.Generator().manual_seed(train.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=train.lr, betas=(0.9, 0.95))
    model.train()
    order: list[int] = []
    losses = []
    for step in range(train.steps):
        if len(order) < train.batch_size:  # epoch by epoch, so every conversation is seen
            order += torch.randperm(len(sequences), generator=gen).tolist()
        batch, order = order[: train.batch_size], order[train.batch_size:]
        ids = _pad([sequences[i][0] for i in batch], 0)
        valid = _pad([[1] * len(sequences[i][0]) for i in batch], 0)
        labels = ids.masked_fill(valid == 0, -100)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, train)
        loss = model(input_ids=ids, attention_mask=valid, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(round(float(loss.detach()), 5))
    model.eval()
    return losses


def build_trained_tiny(out_dir: str | os.PathLike, spec: TinySpec = TRAINED_SPEC,
                       train: TrainSpec = TrainSpec()) -> Path:
    """Train a tiny target on the bundled chat data and save it (config, safetensors, tokenizer).

    The model is `spec`'s random init trained for `train.steps` AdamW steps on every line of
    demo_chat.jsonl but the last `train.held_out`; `training.json` beside it records the loss
    of every step, the seconds taken, and `peakedness` on the held-out lines before and after
    training (`training_report` reads it). Deterministic for a given machine and thread count.
    Atomic and cached: a directory whose `.complete` marker names this exact build (spec,
    training, data) is returned as it is; anything else there is rebuilt.
    """
    out = Path(out_dir)
    key = _build_key(spec, train)
    if _is_complete(out, key):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        t0 = time.perf_counter()
        tok = build_tokenizer(tmp, spec.tokenizer_vocab)
        if len(tok) > spec.vocab_size:
            raise ValueError(f"the tokenizer has {len(tok)} tokens, more than vocab_size={spec.vocab_size}")
        lines = [raw for raw in _data_path().read_text().splitlines() if raw.strip()]
        if not 0 < train.held_out < len(lines):
            raise ValueError(f"TrainSpec.held_out={train.held_out}: keep between 1 and {len(lines) - 1} lines")
        fit = _chat_sequences(tok, lines[: -train.held_out])
        held = _chat_sequences(tok, lines[-train.held_out:])
        model = _random_model(spec)
        before = peakedness(model, held)
        # Adam's tiny early second moments are denormals, which crawl on CPUs; torch has no
        # getter, so the default (off) is put back.
        torch.set_flush_denormal(True)
        try:
            losses = _train(model, fit, train)
        finally:
            torch.set_flush_denormal(False)
        after = peakedness(model, held)
        _save_model(model, spec, tmp)
        report = {**key, "seconds": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "losses": losses,
                  "held_out": {"random_init": before, "trained": after}}
        (tmp / TRAINING_REPORT).write_text(json.dumps(report, indent=1, sort_keys=True))
        (tmp / ".complete").write_text(json.dumps(key, sort_keys=True))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def training_report(model_dir: str | os.PathLike) -> dict:
    """The `training.json` of a `build_trained_tiny` directory (losses, peakedness, seconds)."""
    return json.loads((Path(model_dir) / TRAINING_REPORT).read_text())
