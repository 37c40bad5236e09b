"""Storage: how supervision lies on disk, and reading it back.

`manifest` (the dataset's source of truth, atomic writes, checksums), `safetensors` (a
preallocated file filled row block by row block), the layouts (`layouts`: native; `nemo`:
NeMo AutoModel's offline cache; `speculators`: vLLM speculators' hidden-state files;
`specforge`: SpecForge's per-sample .ckpt features) and
`dataset` (the PyTorch reader). This module picks a layout by name and (de)serialises its
spec for the manifest.
"""

from __future__ import annotations

from eagle_fast.dtypes import SHORT_NAMES, short_name
from eagle_fast.store.layouts import Layout, LayoutSpec, NativeLayout
from eagle_fast.store.nemo import NemoLayout
from eagle_fast.store.specforge import SpecForgeLayout
from eagle_fast.store.speculators import SpeculatorsLayout


def make_layout(spec: LayoutSpec) -> Layout:
    """The layout object that writes and reads datasets of `spec.layout`."""
    return {"native": NativeLayout, "nemo": NemoLayout, "speculators": SpeculatorsLayout,
            "specforge": SpecForgeLayout}[spec.layout](spec)


def spec_from_manifest(m: dict) -> LayoutSpec:
    """The `LayoutSpec` a manifest records (the inverse of `spec_to_json`)."""
    s = m["layout_spec"]
    return LayoutSpec(
        layout=m["layout"], kind=s["kind"], k=int(s["k"]), hidden_size=int(s["hidden_size"]),
        num_aux=int(s["num_aux"]), vocab_size=int(s["vocab_size"]), draft_size=int(s["draft_size"]),
        dtype=SHORT_NAMES[s["dtype"]], out_dtype=SHORT_NAMES[s["out_dtype"]],
        max_len=int(s["max_len"]), pad_token_id=int(s["pad_token_id"]), aux_dtype=s.get("aux_dtype", "auto"),
        keep_mass=float(s.get("keep_mass", 0.0)),
    )


def spec_to_json(spec: LayoutSpec) -> dict:
    out = {
        "kind": spec.kind, "k": spec.k, "hidden_size": spec.hidden_size, "num_aux": spec.num_aux,
        "vocab_size": spec.vocab_size, "draft_size": spec.draft_size,
        "dtype": short_name(spec.dtype), "out_dtype": short_name(spec.out_dtype),
        "max_len": spec.max_len, "pad_token_id": spec.pad_token_id,
    }
    if spec.aux_dtype != "auto":  # absent for auto: those manifests stay as they always were
        out["aux_dtype"] = spec.aux_dtype
    if spec.keep_mass:  # absent for a fixed k, likewise
        out["keep_mass"] = spec.keep_mass
    return out
