"""Storage: how supervision lies on disk, and reading it back.

`manifest` (the dataset's source of truth, atomic writes, checksums), `safetensors` (a
preallocated file filled row block by row block), the layouts (`layouts`: native; `nemo`:
NeMo AutoModel's EAGLE-3 offline cache; `nemo_dspark`: its DSpark cache; `speculators`: vLLM speculators' hidden-state files;
`specforge`: SpecForge's per-sample .ckpt features) and
`dataset` (the PyTorch reader). This module picks a layout by name and (de)serialises its
spec for the manifest.
"""

from __future__ import annotations

from dataclasses import replace

from eagle_fast.draft_types import TypeLayers
from eagle_fast.dtypes import SHORT_NAMES, short_name
from eagle_fast.store.layouts import Layout, LayoutSpec, NativeLayout
from eagle_fast.store.multi import MultiLayout
from eagle_fast.store.nemo import NemoLayout
from eagle_fast.store.nemo_dspark import NemoDSparkLayout
from eagle_fast.store.specforge import SpecForgeLayout
from eagle_fast.store.speculators import SpeculatorsLayout


def make_layout(spec: LayoutSpec) -> Layout:
    """The layout object that writes and reads datasets of `spec.layout` (and its draft types)."""
    if spec.layout == "multi":
        return MultiLayout(spec, [(d, make_layout(part)) for d, part in spec.parts])
    if spec.layout == "nemo" and spec.draft_types == ("dspark",):
        return NemoDSparkLayout(spec)
    return {"native": NativeLayout, "nemo": NemoLayout, "speculators": SpeculatorsLayout,
            "specforge": SpecForgeLayout}[spec.layout](spec)


def spec_from_manifest(m: dict) -> LayoutSpec:
    """The `LayoutSpec` a manifest records (the inverse of `spec_to_json`)."""
    return spec_from_json(m["layout"], m["layout_spec"])


def spec_from_json(layout: str, s: dict) -> LayoutSpec:
    if layout == "multi":
        parts = tuple((p["dir"], spec_from_json(p["layout"], p["layout_spec"])) for p in s["parts"])
        return replace(parts[0][1], layout="multi", parts=parts)
    return LayoutSpec(
        layout=layout, kind=s["kind"], k=int(s["k"]), hidden_size=int(s["hidden_size"]),
        num_aux=int(s["num_aux"]), vocab_size=int(s["vocab_size"]), draft_size=int(s["draft_size"]),
        dtype=SHORT_NAMES[s["dtype"]], out_dtype=SHORT_NAMES[s["out_dtype"]],
        max_len=int(s["max_len"]), pad_token_id=int(s["pad_token_id"]), aux_dtype=s.get("aux_dtype", "auto"),
        keep_mass=float(s.get("keep_mass", 0.0)),
        types=tuple(TypeLayers(t["draft_type"], tuple(t["layer_ids"]), t["final"]) for t in s.get("types", ())),
        capture_ids=tuple(s.get("capture_ids", ())),
        num_layers=int(s.get("num_layers", 0)),
    )


def spec_to_json(spec: LayoutSpec) -> dict:
    if spec.layout == "multi":
        return {"parts": [{"dir": d, "layout": p.layout, "layout_spec": spec_to_json(p)} for d, p in spec.parts]}
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
    if spec.types:  # absent for EAGLE-3 as captured (every manifest before draft types)
        out["types"] = [{"draft_type": t.draft_type, "layer_ids": list(t.layer_ids), "final": t.final}
                        for t in spec.types]
        out["capture_ids"] = list(spec.capture_ids)
    if spec.num_layers:  # absent where no id means the final norm's output (all but NeMo's DSpark cache)
        out["num_layers"] = spec.num_layers
    return out
