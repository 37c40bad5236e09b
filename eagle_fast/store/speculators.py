"""vLLM speculators' hidden-state files (its hs_connectors read them).

hidden_states/hs_{i}.safetensors per sample: hidden_states [T, n + 1, H] (the record's n layers in
ascending order, then the final pre-norm hidden state, as vLLM's extract_hidden_states writes
them; every draft type speculators trains reads this one record: its reader takes all n layers
and the final slot, MTP the final slot alone) and token_ids int64 [T], plus our loss_mask bool [T]. With --aux-dtype fp8 it is
hs_connectors 0.9.0's FP8 layout (what its FP8HiddenStatesConnector writes and FP8Transfer
reads): hidden_states float8_e4m3fn [T, n + 1, H] + hidden_states_scales fp32 [T, 1, 1], one
scale per token over all its slots. When `datasets` is importable the
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
from safetensors import safe_open
from safetensors.torch import load_file

from eagle_fast.dtypes import long_name
from eagle_fast.files import atomic_write_bytes, fsync_dir
from eagle_fast.store.fp8 import quantize, stored_dtype
from eagle_fast.store.layouts import FilePerSampleSink, Layout, select_layers
from eagle_fast.store.manifest import file_record
from eagle_fast.store.safetensors import write_safetensors

# ------------------------------------------------------------------------- speculators


class SpeculatorsLayout(Layout):
    name = "speculators"
    SUBDIR = "hidden_states"

    def head_outputs(self):
        return None

    def final_states(self) -> set[str]:
        return {"pre"}

    def stored_layers(self) -> tuple[int, ...]:
        """The layers of the record, ascending (every type it serves reads the same ones; MTP none)."""
        return next((t.layer_ids for t in self.spec.types if t.layer_ids), ())

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
        aux = select_layers(result["aux_hidden_states"], s.capture_ids, self.stored_layers(), s.hidden_size)
        aux = aux.to(s.dtype).reshape(T, s.num_aux, s.hidden_size)
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

    def sidecar_names(self, ctx):
        names = super().sidecar_names(ctx)
        return names + list(vocab_file_names(int(ctx.draft_ids.numel()))) if ctx.draft_ids is not None else names

    def write_sidecars(self, root, have, ctx):
        out = super().write_sidecars(root, have, ctx)
        if ctx.draft_ids is not None and not set(vocab_file_names(int(ctx.draft_ids.numel()))) <= have:
            out += write_speculators_vocab(root, ctx.d2t, ctx.t2d, tag=ctx.tag)
        return out

    def finalize(self, root, m, pairs=None):
        if pairs is None:
            write_speculators_arrow(root, arrow_pairs_from_files(root, m))
        else:
            write_speculators_arrow(root, pairs())


def arrow_pairs_from_files(root: Path, m: dict) -> list[tuple[list[int], list[int]]]:
    """Every sample's (token ids, loss mask) read back from its hs_{i}.safetensors, in sample order."""
    pairs = []
    for rec in sorted(m["shards"], key=lambda r: r["index"]):
        for f in rec["files"]:
            with safe_open(str(root / f["path"]), framework="pt") as h:  # ids and mask only
                pairs.append((h.get_tensor("token_ids").tolist(), h.get_tensor("loss_mask").to(torch.int64).tolist()))
    return pairs


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
