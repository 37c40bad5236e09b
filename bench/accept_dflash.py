"""Train a DFlash draft with vLLM speculators 0.9.0's own DFlash training step, on CPU.

What it does
    `train_speculators_dflash(model_dir, data_dir, t, ...)` reads an `extract --format speculators`
    record as `speculators train --speculator-type dflash` reads it (train/cli.py main): a
    TrainConfig of its own schema (its DFlash defaults: cross-entropy with D-PACE position weights,
    sliding-window draft layers; here eager attention and loss and fp32, its CPU path), the draft
    built by its CLI's `build_draft_model` (vocabulary mapping found in the record by
    `parse_vocab_mappings`, mask token by `resolve_mask_token_id`), ArrowDataset + CollateFn with no
    preprocess (main()'s choice for the DFlash family), the optimizer and schedule built by its
    Trainer.setup_optimizer; one step is Trainer.train_epoch's (forward with its
    get_trainer_kwargs, backward, clip 1.0, optimizer step, scheduler step).
    Shared with the NeMo EAGLE-3 runs (accept.py): the steps, the batch of 8 conversations drawn
    by the same generator and seed (packed into one row, CollateFn's max_len set to their total),
    AdamW at the same peak learning rate and warm-up, cosine decay (to 0: theirs), clipping 1.0.
    Saved by `accept_trainers.save_speculators_draft` (its own save_pretrained): the layout vLLM
    loads as method dflash.
Limits
    CPU, eager attention (flex attention has no CPU backward); a 1,923-token target.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import accept as A
import accept_trainers as AT
import torch

from eagle_fast.draft_types import vllm_ids


def record_layers(data_dir: Path) -> list[int]:
    """The record's stored layers in speculators' ids (eagle_fast's + 1: `--target-layer-ids`)."""
    return vllm_ids(json.loads((Path(data_dir) / "manifest.json").read_text())["aux_layer_ids"])


def train_config(model_dir: Path, data_dir: Path, t: A.DraftTrain, *, block_size: int, layers: int,
                 max_anchors: int):
    """speculators' TrainConfig for this run (its derived defaults fill the rest), flattened as main() does."""
    from speculators.train.config import TrainConfig

    flat = {"target_layer_ids": record_layers(data_dir), "speculator_type": "dflash", "verifier_name_or_path": str(model_dir), "data_path": str(data_dir),
            "num_layers": layers, "block_size": block_size, "max_anchors": max_anchors,
            "loss_implementation": "eager", "draft_attn_impl": "eager", "hidden_states_dtype": "float32",
            "hidden_states_backend": "file", "hidden_states_path": None, "lr": t.lr, "optimizer": "adamw",
            "seed": t.seed, "draft_vocab_size": A.DRAFT_SIZE}
    return argparse.Namespace(**TrainConfig.from_flat(flat).flatten())


def build_dflash(model_dir: Path, data_dir: Path, t: A.DraftTrain, *, block_size: int, layers: int,
                 max_anchors: int):
    """(model, args): the DFlash draft as `speculators train` builds it, on this record."""
    from speculators.model import SpeculatorModel
    from speculators.train import cli

    args = train_config(model_dir, data_dir, t, block_size=block_size, layers=layers, max_anchors=max_anchors)
    d2t, t2d, size = cli.parse_vocab_mappings(args)
    if d2t is None:
        raise RuntimeError(f"speculators found no d2t-N.npy / t2d-N.npy in {data_dir}")
    torch.manual_seed(t.seed)
    model = cli.build_draft_model(args, SpeculatorModel.registry["dflash"], t2d, d2t, size)
    return model.to(torch.float32), args


def train_speculators_dflash(model_dir: Path, data_dir: Path, t: A.DraftTrain, *, block_size: int, layers: int = 1,
                             max_anchors: int = 512):
    """Train a DFlash draft on `data_dir` with speculators' own step; returns (model, loss of every step)."""
    from speculators.train.data import ArrowDataset, CollateFn

    model, args = build_dflash(model_dir, data_dir, t, block_size=block_size, layers=layers, max_anchors=max_anchors)
    ds = ArrowDataset(max_len=1 << 20, datapath=str(data_dir), transfer=None, on_missing="raise",
                      hidden_states_dtype=torch.float32)
    train_kwargs, _ = type(model).get_trainer_kwargs(**vars(args))
    hidden = model.config.transformer_layer_config.hidden_size

    def collate(items):
        total = sum(int(x["input_ids"].shape[0]) for x in items)
        return CollateFn(total, hidden, num_target_layers=len(model.target_layer_ids), dtype=torch.float32,
                         preprocess=None)(items)

    return model, AT.speculators_steps(model, AT.speculators_optimizer(model, t), ds, t, collate, train_kwargs)


def save(model, out_dir: Path) -> Path:
    """speculators' own save (its checkpointer's): the `speculators_model_type: dflash` layout vLLM loads."""
    return AT.save_speculators_draft(model, out_dir)
