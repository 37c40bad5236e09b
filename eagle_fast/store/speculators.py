"""vLLM speculators' hidden-state files (its hs_connectors read them).

hidden_states/hs_{i}.safetensors per sample: hidden_states [T, 4, H] (the three aux layers in
ascending order, then the final pre-norm hidden state, as vLLM's extract_hidden_states writes
them) and token_ids int64 [T], plus our loss_mask bool [T]. With --aux-dtype fp8 it is
hs_connectors 0.9.0's FP8 layout (what its FP8HiddenStatesConnector writes and FP8Transfer
reads): hidden_states float8_e4m3fn [T, 4, H] + hidden_states_scales fp32 [T, 1, 1], one
scale per token over all four slots. When `datasets` is importable the
finished directory also holds the Arrow table (input_ids, loss_mask, seq_len; saved with the
"torch" format, which its ArrowDataset needs) that speculators' ArrowDataset loads from the same
path. With a draft vocabulary, d2t-{N}.npy (int64 offsets) and t2d-{N}.npy (bool [V]) sit beside
it, the names its trainer finds by --draft-vocab-size N.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from eagle_fast.dtypes import long_name
from eagle_fast.files import atomic_write_bytes, fsync_dir
from eagle_fast.store.fp8 import quantize, stored_dtype
from eagle_fast.store.layouts import FilePerSampleSink, Layout
from eagle_fast.store.manifest import file_record
from eagle_fast.store.safetensors import write_safetensors

# ------------------------------------------------------------------------- speculators


class SpeculatorsLayout(Layout):
    name = "speculators"
    SUBDIR = "hidden_states"

    def head_outputs(self):
        return None

    def needs_final_hidden(self) -> bool:
        return True

    def fields(self):
        s = self.spec
        out = {
            "hidden_states": {"dtype": long_name(stored_dtype(s.aux_dtype, s.dtype)),
                              "shape": ["T", s.num_aux + 1, s.hidden_size]},
            "token_ids": {"dtype": "int64", "shape": ["T"]},
            "loss_mask": {"dtype": "bool", "shape": ["T"]},
        }
        if s.aux_dtype == "fp8":
            out["hidden_states_scales"] = {"dtype": "float32", "shape": ["T", 1, 1]}
        return out

    def encode(self, sample, result):
        s = self.spec
        T = sample.length
        aux = result["aux_hidden_states"].to(s.dtype).reshape(T, s.num_aux, s.hidden_size)
        final = result["hidden"].to(s.dtype).reshape(T, 1, s.hidden_size)
        out = {
            "hidden_states": torch.cat([aux, final], dim=1).contiguous(),
            "token_ids": result["input_ids"].to(torch.int64),
            "loss_mask": result["loss_mask"].to(torch.bool),
        }
        if s.aux_dtype == "fp8":
            q, scale = quantize(out["hidden_states"])
            out["hidden_states"], out["hidden_states_scales"] = q, scale.reshape(T, 1, 1)
        return out

    @classmethod
    def sample_path(cls, index: int) -> str:
        return f"{cls.SUBDIR}/hs_{index}.safetensors"

    def shard_paths(self, shard):
        return [self.sample_path(s.index) for s in shard.samples]

    def open_shard(self, root, shard):
        (root / self.SUBDIR).mkdir(parents=True, exist_ok=True)
        return FilePerSampleSink(root, shard, self.sample_path, write_safetensors)

    def read_sample(self, root, shard_record, local_index, handles=None):
        return load_file(str(root / shard_record["files"][local_index]["path"]))


def write_speculators_arrow(root: Path, samples: list[tuple[list[int], list[int]]]) -> bool:
    """Write the preprocessed table speculators' ArrowDataset loads next to hidden_states/.

    Returns False (and writes nothing) when `datasets` is not importable.
    """
    try:
        from datasets import Dataset
    except ImportError:
        return False

    try:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except ImportError:  # pragma: no cover - older datasets
        pass
    table = Dataset.from_dict({
        "input_ids": [ids for ids, _ in samples],
        "loss_mask": [mask for _, mask in samples],
        "seq_len": [len(ids) for ids, _ in samples],
    })
    table = table.with_format("torch")
    tmp = Path(tempfile.mkdtemp(prefix=".arrow.", dir=root))
    try:
        table.save_to_disk(str(tmp))
        for p in sorted(tmp.iterdir()):
            final = root / p.name
            os.replace(p, final)
        fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def vocab_file_names(draft_size: int) -> tuple[str, str]:
    """speculators' default vocabulary file names for a draft of `draft_size` ids: (d2t, t2d)."""
    return f"d2t-{draft_size}.npy", f"t2d-{draft_size}.npy"


def write_speculators_vocab(root: Path, d2t: torch.Tensor, t2d: torch.Tensor, tag: str = "") -> list[dict]:
    """d2t-{N}.npy (int64 [N]: target id = i + d2t[i]) and t2d-{N}.npy (bool [V]), atomically;
    their manifest records."""
    records = []
    for name, array in zip(vocab_file_names(int(d2t.numel())),
                           (d2t.to(torch.int64).numpy(), t2d.to(torch.bool).numpy())):
        buf = io.BytesIO()
        np.save(buf, array)
        records.append(file_record(atomic_write_bytes(root / name, buf.getvalue(), tag), root))
    return records
