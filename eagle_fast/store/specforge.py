"""SpecForge 0.2.0's offline EAGLE-3 features (`specforge_hidden_states_v1`; its
`OfflineManifestReader` reads them).

One `torch.save` dict per sample (the default zip serialisation, which its `torch.load(mmap=True)`
needs) at rows_{g}-{g+2000}/data_{i}.ckpt, g = 2000 * (i // 2000), as SpecForge's own capture
names them. Keys, unshifted: input_ids int64 [T], loss_mask int64 [T], then per draft type (its reader loads
the keys it names, so one record serves several): EAGLE-3 aux_hidden_state [1, T, 3H] (the aux
layers in ascending order) and hidden_state [1, T, H], the final hidden state AFTER the final norm
(its `TargetHead` applies the LM head alone); DFlash and Domino hidden_states [1, T, K H] (their
layers ascending; no final state, they train on the data tokens); DSpark hidden_states and
target_last_hidden_states [1, T, H] (after the norm: its teacher, lm_head(last) at train time),
the same tensor as hidden_state where both are stored (torch.save keeps it once). All in the
target dtype.
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
from eagle_fast.store.layouts import FilePerSampleSink, Layout, select_layers
from eagle_fast.store.manifest import file_record

ROWS_PER_DIR = 2000           # SpecForge's prepare_hidden_states: rows_{g}-{g+2000}
VOCAB_MAPPING = "vocab_mapping.pt"


class SpecForgeLayout(Layout):
    name = "specforge"

    def head_outputs(self):
        return None

    def final_states(self) -> set[str]:
        return {"post"} if "post" in self.spec.final_states() or not self.spec.types else set()

    def hidden_keys(self) -> dict[str, tuple[int, ...] | None]:
        """The record's hidden-state keys -> the layers each holds, ascending (None: the final
        state after the norm). EAGLE-3 reads `aux_hidden_state` + `hidden_state`; the DFlash family
        `hidden_states` (the types of one record share its layers), DSpark also
        `target_last_hidden_states`."""
        s = self.spec
        if not s.types:
            return {"aux_hidden_state": tuple(s.capture_ids), "hidden_state": None}
        out: dict[str, tuple[int, ...] | None] = {}
        for t in s.types:
            if t.draft_type == "eagle3":
                out.update(aux_hidden_state=t.layer_ids, hidden_state=None)
            else:
                out["hidden_states"] = t.layer_ids
                if t.draft_type == "dspark":
                    out["target_last_hidden_states"] = None
        return out

    def fields(self):
        s = self.spec
        dtype = long_name(s.dtype)
        out = {"input_ids": {"dtype": "int64", "shape": ["T"]}, "loss_mask": {"dtype": "int64", "shape": ["T"]}}
        final = None
        for key, ids in self.hidden_keys().items():
            width = s.hidden_size if ids is None else (len(ids) or s.num_aux) * s.hidden_size
            out[key] = {"dtype": dtype, "shape": [1, "T", width]}
            if ids is None and final is not None:  # the final state's second name: its bytes are stored once
                out[key]["same_as"] = final
            final = final or (key if ids is None else None)
        return out

    def encode(self, sample, result):
        s = self.spec
        T = sample.length
        # clone: torch.save writes a view's whole storage, so each field gets its own; the final
        # state is one tensor under both of its names (torch.save stores it once)
        out = {"input_ids": result["input_ids"].to(torch.int64).clone(),
               "loss_mask": result["loss_mask"].to(torch.int64).clone()}
        final = None
        for key, ids in self.hidden_keys().items():
            if ids is None:
                if final is None:
                    final = result["hidden_normed"].to(s.dtype).reshape(1, T, s.hidden_size).clone()
                out[key] = final
            else:
                aux = select_layers(result["aux_hidden_states"], s.capture_ids, ids, s.hidden_size)
                out[key] = aux.to(s.dtype).reshape(1, T, -1).clone()
        return out

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

    def sidecar_names(self, ctx):
        return super().sidecar_names(ctx) + ([VOCAB_MAPPING] if ctx.draft_ids is not None else [])

    def write_sidecars(self, root, have, ctx):
        out = super().write_sidecars(root, have, ctx)
        if ctx.draft_ids is not None and VOCAB_MAPPING not in have:
            out.append(write_vocab_mapping(root, ctx.d2t, ctx.t2d, tag=ctx.tag))
        return out


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
