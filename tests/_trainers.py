"""Helpers shared by the tests that train with SpecForge's and speculators' own code on our data."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle_fast.cli import main
from eagle_fast.vocab import DraftVocab, save_draft_vocab

V = 1031           # the tiny checkpoints' vocabulary
DRAFT_SIZE = 300


def draft_vocab(path: Path, seed: int = 0) -> DraftVocab:
    """A random draft vocabulary of DRAFT_SIZE ids, saved at `path` (eagle-fast vocab's format)."""
    g = torch.Generator().manual_seed(seed)
    vocab = DraftVocab(torch.randperm(V, generator=g)[:DRAFT_SIZE].sort().values, V)
    save_draft_vocab(path, vocab)
    return vocab


def extract_cli(*argv) -> None:
    """`eagle-fast extract ARGV` in process with the hf engine; fails the test on a non-zero exit."""
    code = main(["extract", "--engine", "hf", *[str(a) for a in argv]])
    assert code == 0, f"eagle-fast extract exited {code}"


def nemo_target_probs(nemo_reference, vocab: DraftVocab, input_ids: list[int]) -> torch.Tensor:
    """NeMo AutoModel's in-process target for one sequence (`compute_supervision` on the same
    checkpoint): fp32 [T, Vd] in NeMo's shifted frame (row t: the target for position t + 1; the
    last row, which no token follows, is zero)."""
    ids = torch.tensor([input_ids], dtype=torch.int64)
    ones = torch.ones_like(ids)
    return nemo_reference(vocab.ids, vocab.t2d(), ids, ones, ones)["target_probs"][0]
