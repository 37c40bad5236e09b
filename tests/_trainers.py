"""Helpers shared by the tests that train with SpecForge's and speculators' own code on our data."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

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


def with_index_json(model: Path, out: Path) -> Path:
    """`model` linked file by file into `out`, plus the model.safetensors.index.json that
    SpecForge's TargetHead requires (a single-file checkpoint has none)."""
    out.mkdir(parents=True, exist_ok=True)
    for p in model.iterdir():
        if not p.name.startswith(".") and not (out / p.name).exists():
            (out / p.name).symlink_to(p.resolve())
    weight_map = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            weight_map.update(dict.fromkeys(h.keys(), f.name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def nemo_target_probs(nemo_reference, vocab: DraftVocab, input_ids: list[int]) -> torch.Tensor:
    """NeMo AutoModel's in-process target for one sequence (`compute_supervision` on the same
    checkpoint): fp32 [T, Vd] in NeMo's shifted frame (row t: the target for position t + 1; the
    last row, which no token follows, is zero)."""
    ids = torch.tensor([input_ids], dtype=torch.int64)
    ones = torch.ones_like(ids)
    return nemo_reference(vocab.ids, vocab.t2d(), ids, ones, ones)["target_probs"][0]
