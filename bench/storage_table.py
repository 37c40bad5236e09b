"""Bytes per token of every storage option at real model shapes, computed from the layouts alone.

What it does
    For each target in `shapes.STORAGE_MODELS` (bf16, draft vocabulary 32,000) and each stored
    log-prob dtype (--out-dtype bf16, fp32) it asks `eagle_fast.store.sizes` what one token
    costs in every format and supervision the layouts accept, and prints one markdown table
    (KB = 1000 B, as the issue counts). No model, no data: `python bench/storage_table.py`
    (`--by-field` adds each row's by-field table at Qwen3-8B, `--json PATH` writes the rows).

Design
    Nothing about the options is hard-coded here: formats and supervisions are the layouts'
    LAYOUTS x KINDS that `validate_layout_kind` accepts; a kind is swept over k in K_SWEEP when
    its declared fields depend on k; an aux option (`LayoutSpec.aux_dtype`, where that field
    exists) gets rows only in formats whose declared fields change with it.

Limits
    Per-token fields only: native's 24 B per sample, safetensors headers and the files beside
    the shards are left out (see store/sizes.py). nemo pads every sample to seq_length, so its
    figure is per padded position, what a sample that fills seq_length pays per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import shapes

from eagle_fast.dtypes import SHORT_NAMES
from eagle_fast.errors import UserError
from eagle_fast.store import make_layout
from eagle_fast.store.layouts import KINDS, LAYOUTS, LayoutSpec, validate_layout_kind
from eagle_fast.store.sizes import field_sizes, layout_bytes_per_token, size_table

K_SWEEP = (8, 16, 32, 64, 128)
OUT_DTYPES = ("bf16", "fp32")
# Values tried on LayoutSpec.aux_dtype; each is shown only where a layout's fields change with it.
AUX_CANDIDATES = ("fp8",)
MAX_LEN = 4096  # nemo's seq_length; its per-position figure does not depend on it
REFERENCE = ("native", "draft", 0, "auto")  # the issue's ~89 KB/token baseline


def _spec(layout: str, kind: str, shape, k: int, out_dtype: str, aux: str) -> LayoutSpec:
    extra = {} if aux == "auto" else {"aux_dtype": aux}
    return LayoutSpec(layout=layout, kind=kind, k=k, hidden_size=shape.hidden, num_aux=3,
                      vocab_size=shape.vocab, draft_size=shapes.draft_size(shape.vocab),
                      dtype=SHORT_NAMES["bf16"], out_dtype=SHORT_NAMES[out_dtype], max_len=MAX_LEN, **extra)


def _declared(layout: str, kind: str, k: int, aux: str) -> tuple | None:
    """The layout's declared fields at Qwen3-8B shapes, or None where this option cannot be built."""
    try:
        return tuple(field_sizes(make_layout(_spec(layout, kind, shapes.STORAGE_MODELS["Qwen3-8B"], k, "bf16", aux))))
    except (TypeError, ValueError, KeyError):
        return None


def options() -> list[tuple[str, str, int, str]]:
    """(format, supervision, k, aux) for every option the layouts declare."""
    has_aux = "aux_dtype" in {f.name for f in dataclasses.fields(LayoutSpec)}
    rows = []
    for layout in LAYOUTS:
        for kind in KINDS:
            try:
                validate_layout_kind(layout, kind)
            except UserError:
                continue
            ks = K_SWEEP if _declared(layout, kind, 8, "auto") != _declared(layout, kind, 16, "auto") else (0,)
            auxes = ["auto"] + [a for a in (AUX_CANDIDATES if has_aux else ())
                                if _declared(layout, kind, ks[0], a) not in (None, _declared(layout, kind, ks[0], "auto"))]
            rows += [(layout, kind, k, aux) for aux in auxes for k in ks]
    return rows


def table() -> list[dict]:
    """One record per option: bytes/token per (model, out dtype)."""
    out = []
    for layout, kind, k, aux in options():
        rec = {"format": layout, "supervision": kind, "k": k, "aux": aux, "bytes_per_token": {}}
        for model, shape in shapes.STORAGE_MODELS.items():
            for od in OUT_DTYPES:
                extra = {} if aux == "auto" else {"aux_dtype": aux}
                rec["bytes_per_token"][f"{model} {od}"] = layout_bytes_per_token(
                    layout, kind, hidden_size=shape.hidden, vocab_size=shape.vocab,
                    draft_size=shapes.draft_size(shape.vocab), k=k, dtype="bf16", out_dtype=od,
                    max_len=MAX_LEN, **extra)
        out.append(rec)
    return out


def markdown(records: list[dict]) -> str:
    cols = [f"{m} {od}" for m in shapes.STORAGE_MODELS for od in OUT_DTYPES]
    ref = next((r for r in records if (r["format"], r["supervision"], r["k"], r["aux"]) == REFERENCE), None)
    lines = [
        ("KB/token (1 KB = 1000 B) of each stored field summed, bf16 targets, draft vocabulary "
         f"{shapes.DRAFT_VOCAB:,}; columns: target, stored log-prob dtype (--out-dtype). nemo: per "
         "padded position. `vs draft`: native draft (bf16 aux, bf16 log-probs) over the row, at Qwen3-8B."),
        "",
        "| format | supervision | k | aux | " + " | ".join(cols) + " | vs draft |",
        "|---|---|---:|---|" + "---:|" * (len(cols) + 1),
    ]
    for r in records:
        b = r["bytes_per_token"]
        ratio = ref["bytes_per_token"]["Qwen3-8B bf16"] / b["Qwen3-8B bf16"] if ref else float("nan")
        aux = "bf16" if r["aux"] == "auto" else r["aux"]
        lines.append(f"| {r['format']} | {r['supervision']} | {r['k'] or ''} | {aux} | "
                     + " | ".join(f"{b[c] / 1000:,.1f}" for c in cols) + f" | {ratio:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--by-field", action="store_true", help="each row's by-field table at Qwen3-8B, bf16 log-probs")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = ap.parse_args(argv)
    records = table()
    print(markdown(records))
    if a.by_field:
        for layout, kind, k, aux in options():
            spec = _spec(layout, kind, shapes.STORAGE_MODELS["Qwen3-8B"], k, "bf16", aux)
            print(f"\n{layout} {kind}" + (f" k={k}" if k else "") + f" aux {aux}, Qwen3-8B:")
            print("\n".join(size_table(field_sizes(make_layout(spec)), max_len=MAX_LEN)))
    if a.json:
        Path(a.json).write_text(json.dumps({"models": {m: {"hidden": s.hidden, "vocab": s.vocab}
                                                       for m, s in shapes.STORAGE_MODELS.items()},
                                            "draft_vocab": shapes.DRAFT_VOCAB, "rows": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
