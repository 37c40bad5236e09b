"""One registry of LM-head shapes for every benchmark: real model configs plus CPU-sized variants.

What it does
    `MODELS` lists the final-norm + LM-head shapes of real targets (hidden size H, vocabulary V,
    norm variant) and how many tokens N one head call sees per device. `cpu_variant(model)`
    gives the CPU-sized twin: same V (the axis the sweep is about), H and N shrunk so the whole
    CPU sweep fits `make bench`'s 10-minute budget on 2 cores. `suite(device)` is what
    `bench_lm_head.py` runs: the sweep over vocabulary sizes plus the case the target is stated
    on (`TARGETS`).

Design
    Shapes are data, never literals inside a benchmark. The numbers below are the models'
    published `config.json` values (`hidden_size`, `vocab_size`); Gemma-3-12B's config says
    262,208 (262,144 SentencePiece ids plus 64 reserved rows), and we use the round 262,144 the
    vocabulary itself has, as "Gemma-3-12B-class". N=8192 on CUDA is one training micro-batch
    (e.g. 8 x 1024 tokens) and the size the GPU target is stated on.

Limits
    Only the head's shapes: the rest of each model is irrelevant to these benchmarks. The CPU
    variants keep H=1024 for every vocabulary (Qwen3-0.6B's real H), so a CPU number says how
    cost grows with V, not what a 4096-wide model costs on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Tokens per head call on each device. CPU: small enough that the slowest provider (PyTorch's
# bf16 GEMM, ~20 GFLOP/s on 2 AVX2 cores) still finishes a 262k-vocab call in a few seconds.
N_TOKENS = {"cuda": 8192, "cpu": 128}
# EAGLE-3's usual draft vocabulary (SpecForge and NeMo AutoModel default to 32k).
DRAFT_VOCAB = 32_000
# Top-k size the "topk" mode keeps (offline-distillation style: 64 ids + tail mass per token).
TOPK = 64


@dataclass(frozen=True)
class HeadShape:
    """The head of one target. `n_tokens` is N, the rows of one head call."""

    name: str        # registry key, e.g. "qwen3-8b" or "qwen3-8b/cpu"
    model: str       # the real model the shape comes from
    hidden: int      # H
    vocab: int       # V
    n_tokens: int    # N
    norm: str = "rms"  # "rms" | "rms_one_plus" (Gemma)
    dtype: str = "bfloat16"  # weight and hidden dtype (all these models ship bf16)

    @property
    def flop(self) -> int:
        """FLOPs of the head GEMM, 2 * N * H * V (the norm and reductions are O(N * (H + V)))."""
        return 2 * self.n_tokens * self.hidden * self.vocab

    @property
    def logits_bytes_fp32(self) -> int:
        """Bytes of full fp32 [N, V] logits: what the seed's path materialises (at least once)."""
        return 4 * self.n_tokens * self.vocab

    def with_tokens(self, n_tokens: int) -> HeadShape:
        return replace(self, n_tokens=n_tokens)


# name -> (model, H, V, norm)
_REAL = {
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf (also Mistral-7B-v0.1)", 4096, 32_000, "rms"),
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", 4096, 128_256, "rms"),
    "qwen3-8b": ("Qwen/Qwen3-8B", 4096, 151_936, "rms"),
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", 1024, 151_936, "rms"),
    "gemma-3-12b": ("google/gemma-3-12b-it class (262,144-token vocabulary)", 3840, 262_144, "rms_one_plus"),
}

MODELS: dict[str, HeadShape] = {
    name: HeadShape(name=name, model=m, hidden=h, vocab=v, n_tokens=N_TOKENS["cuda"], norm=norm)
    for name, (m, h, v, norm) in _REAL.items()
}

# CPU variants: H fixed at 1024 so the sweep isolates V; see the module header.
CPU_HIDDEN = 1024


def cpu_variant(shape: HeadShape, n_tokens: int = N_TOKENS["cpu"]) -> HeadShape:
    """The CPU-sized twin of a real shape: same V and norm, H=1024, N=n_tokens."""
    return replace(shape, name=f"{shape.name}/cpu", hidden=CPU_HIDDEN, n_tokens=n_tokens)


def sweep(device: str) -> list[HeadShape]:
    """Shapes of the vocabulary sweep on `device` ("cuda" or "cpu"), ordered by V.

    CUDA: every real shape at N=8192. CPU: the CPU twins of one model per distinct vocabulary
    (Qwen3-8B's twin would equal Qwen3-0.6B's, so only the latter is listed).
    """
    if device == "cuda":
        return sorted(MODELS.values(), key=lambda s: (s.vocab, s.hidden))
    return [cpu_variant(MODELS[n]) for n in ("llama-2-7b", "llama-3-8b", "qwen3-0.6b", "gemma-3-12b")]


def draft_size(vocab: int) -> int:
    """Draft-vocabulary size for a target vocabulary: 32k, or all of a vocabulary that small
    (Llama-2's 32,000), or half of a smoke-test vocabulary so the gather is a real subset."""
    if vocab >= DRAFT_VOCAB:
        return DRAFT_VOCAB
    return max(1, vocab // 2)


# The cases the targets are stated on: (shape, output mode).
TARGETS = {
    # CPU, impl="torch": N=1024, H=1024, V=151,936, lse+argmax+topk64+draft32k.
    "cpu": (MODELS["qwen3-0.6b"].with_tokens(1024), "all"),
    # GPU: N=8192, H=4096, V=151,936, bf16.
    "cuda": (MODELS["qwen3-8b"], ("lse+argmax", "draft32k", "topk64")),
}

# The head against the bare GEMM of its shape (`_floor.py`), at the shapes the floor goals are
# stated on: the runner's tiny Qwen3 (H=256: the GEMM is cheap per logit, so every per-logit
# pass shows) at the runner's N=8192, and Qwen3-0.6B's H=1024 at N=2048. Goal: the head's
# ("draft", "argmax") call within FLOOR_GOALS x the floor.
FLOOR_SHAPES = [
    HeadShape(name="tiny-qwen3-h256", model="bench_runner's tiny Qwen3 (H=256, Qwen3's vocabulary)",
              hidden=256, vocab=151_936, n_tokens=8192),
    MODELS["qwen3-0.6b"].with_tokens(2048),
]
# A real target's head at the floor's question (`bench_floors.py --real`, not in `make bench`:
# minutes on 2 cores): Qwen3-8B, H=4096 V=151,936, one 2,048-token call.
FLOOR_REAL_SHAPES = [MODELS["qwen3-8b"].with_tokens(2048)]
FLOOR_MODES = ("draft32k", "lse+argmax")
FLOOR_GOALS = {("tiny-qwen3-h256", 8192): 1.3, ("qwen3-0.6b", 2048): 1.1}
# Where the floor is the bf16-output GEMM (AVX512-BF16/AMX; `_floor.floor_kind`), one goal per
# ISA for both shapes; FLOOR_GOALS hold where it is the fp32 GEMM (AVX2).
FLOOR_GOALS_BF16 = {"AMX": 1.5, "AVX512-BF16": 1.3}


def floor_goal(shape: HeadShape, isa: str) -> float:
    """The head's goal against the floor of `shape` on a CPU whose widest math ISA is `isa`
    (`_cpu.hardware_isa()`; a capped run passes "AVX2")."""
    return FLOOR_GOALS_BF16.get(isa, FLOOR_GOALS[(shape.name, shape.n_tokens)])

# A seconds-long smoke suite: exercises every code path (the Triton provider through the
# interpreter on CPU) without measuring anything meaningful.
SMOKE = [
    HeadShape(name="smoke-a", model="smoke", hidden=64, vocab=1_031, n_tokens=8),
    HeadShape(name="smoke-b", model="smoke", hidden=64, vocab=4_099, n_tokens=8, norm="rms_one_plus"),
]

# The storage table's targets (storage_table.py): a dataset's bytes per token depend on H and V
# only. Llama-3.1-8B has Llama-3-8B's head; Llama-3.1-70B is listed here alone, since the head
# sweep above has no 8192-wide case.
STORAGE_MODELS: dict[str, HeadShape] = {
    "Qwen3-8B": MODELS["qwen3-8b"],
    "Llama-3.1-8B": replace(MODELS["llama-3-8b"], name="llama-3.1-8b", model="meta-llama/Llama-3.1-8B"),
    "Llama-3.1-70B": HeadShape(name="llama-3.1-70b", model="meta-llama/Llama-3.1-70B", hidden=8192,
                               vocab=128_256, n_tokens=N_TOKENS["cuda"]),
}
