"""SpecForge 0.2.0's offline EAGLE-3 features (`specforge_hidden_states_v1`; its
`OfflineManifestReader` reads them).

One `torch.save` dict per sample (the default zip serialisation, which its `torch.load(mmap=True)`
needs) at rows_{g}-{g+2000}/data_{i}.ckpt, g = 2000 * (i // 2000), as SpecForge's own capture
names them. Keys, unshifted: input_ids int64 [T], loss_mask int64 [T], aux_hidden_state
[1, T, 3H] (the aux layers in ascending order) and hidden_state [1, T, H], the final hidden state
AFTER the final norm (its `TargetHead` applies the LM head alone); both in the target dtype.
The draft vocabulary, when given, is also written as the `torch.save({"d2t", "t2d"})` file its
`model.vocab_mapping_path` names (`VOCAB_MAPPING`).
Limits: no fp8 (SpecForge has no reader for it; `fp8.check_aux_dtype` refuses it); its reader
walks every *.ckpt under the directory in sorted order, so sample order there is by path.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from eagle_fast.dtypes import long_name
from eagle_fast.files import atomic_write_bytes
from eagle_fast.store.layouts import FilePerSampleSink, Layout
from eagle_fast.store.manifest import file_record

ROWS_PER_DIR = 2000           # SpecForge's prepare_hidden_states: rows_{g}-{g+2000}
VOCAB_MAPPING = "vocab_mapping.pt"


class SpecForgeLayout(Layout):
    name = "specforge"

    def head_outputs(self):
        return None

    def needs_final_hidden(self) -> bool:
        return True

    def final_hidden(self, head, final):
        """After the final norm, rounded as the served model rounds it (what SGLang captures)."""
        return head.final_norm(final)

    def fields(self):
        s = self.spec
        dtype = long_name(s.dtype)
        return {
            "input_ids": {"dtype": "int64", "shape": ["T"]},
            "loss_mask": {"dtype": "int64", "shape": ["T"]},
            "aux_hidden_state": {"dtype": dtype, "shape": [1, "T", s.num_aux * s.hidden_size]},
            "hidden_state": {"dtype": dtype, "shape": [1, "T", s.hidden_size]},
        }

    def encode(self, sample, result):
        s = self.spec
        T = sample.length
        # clone: torch.save writes a view's whole storage, so each field gets its own
        return {
            "input_ids": result["input_ids"].to(torch.int64).clone(),
            "loss_mask": result["loss_mask"].to(torch.int64).clone(),
            "aux_hidden_state": result["aux_hidden_states"].to(s.dtype)
            .reshape(1, T, s.num_aux * s.hidden_size).clone(),
            "hidden_state": result["hidden"].to(s.dtype).reshape(1, T, s.hidden_size).clone(),
        }

    @staticmethod
    def sample_path(index: int) -> str:
        g = index // ROWS_PER_DIR * ROWS_PER_DIR
        return f"rows_{g}-{g + ROWS_PER_DIR}/data_{index}.ckpt"

    def shard_paths(self, shard):
        return [self.sample_path(s.index) for s in shard.samples]

    def open_shard(self, root, shard):
        return FilePerSampleSink(root, shard, self.sample_path, save_torch)

    def read_sample(self, root, shard_record, local_index, handles=None):
        path = root / shard_record["files"][local_index]["path"]
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)


def save_torch(path: Path, obj, tag: str = "") -> Path:
    """`torch.save(obj)` to `path` atomically (temp file, fsync, rename); returns `path`."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(path, buf.getvalue(), tag)


def write_vocab_mapping(root: Path, d2t: torch.Tensor, t2d: torch.Tensor, tag: str = "") -> dict:
    """SpecForge's vocab mapping file: {"d2t": int64 [Vd] offsets, "t2d": bool [V]}."""
    path = save_torch(root / VOCAB_MAPPING, {"d2t": d2t.to(torch.int64).clone(),
                                             "t2d": t2d.to(torch.bool).clone()}, tag)
    return file_record(path, root)
