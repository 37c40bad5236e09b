"""Bytes per token, by field: what a layout's declared fields cost on disk, from shapes alone.

`field_sizes(layout)` reads what the layout declares it writes (the native layout's
`token_fields()`, whose dtypes are the disk dtypes, plus its per-sample index fields; every
other layout's `fields()`) and gives each field's bytes = dtype itemsize x elements per unit:
per token (a "T" axis), per padded position (nemo pads every field to seq_length = max_len, so
its count is per position, which is per real token only for samples that fill seq_length), or
per sample. A field a layout starts declaring (fp8 scales, sparse draft targets) is counted
with no change here. `layout_bytes_per_token(...)` does the same from shapes, for tables.
Limits: safetensors headers (~100 B per tensor and file) and the files beside the shards
(NeMo's target_embeddings, the speculators Arrow table, manifests) are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from eagle_fast.dtypes import SHORT_NAMES, long_name
from eagle_fast.store import make_layout
from eagle_fast.store.layouts import Layout, LayoutSpec, NativeLayout, native_index_fields
from eagle_fast.store.multi import MultiLayout

PER = ("token", "position", "sample", "kept")


@dataclass(frozen=True)
class FieldSize:
    """One stored field: `shape` is per `per` unit (token | position | sample); `fixed` bytes come
    once per shard file (native `offsets` holds n + 1 entries). "kept": one element per kept
    draft id (--keep-mass), `shape` (k,) its most per token, so `nbytes` is a bound per token."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    per: str
    fixed: int = 0
    same_as: str = ""  # another field whose bytes this one is (SpecForge: one tensor under two keys)

    @property
    def nbytes(self) -> int:
        """Bytes per unit: itemsize x elements (none for a field stored as another's bytes)."""
        if self.same_as:
            return 0
        return torch.empty((), dtype=self.dtype).element_size() * math.prod(self.shape)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"a layout declares dtype {name!r}, which torch does not know")


def field_sizes(layout: Layout) -> list[FieldSize]:
    """Every field `layout` writes into its shard files, with its bytes per token / position / sample
    (several records: each one's, named `dir/field`)."""
    if isinstance(layout, MultiLayout):
        return [replace(f, name=f"{d}/{f.name}", same_as=f"{d}/{f.same_as}" if f.same_as else "")
                for d, part in layout.parts for f in field_sizes(part)]
    if isinstance(layout, NativeLayout):
        out = [FieldSize(n, d, tuple(t), "token") for n, (d, t) in layout.token_fields().items()]
        out += [FieldSize(n, d, (layout.spec.k,), "kept") for n, d in layout.kept_fields().items()]
        one, none = native_index_fields(1, layout.ragged), native_index_fields(0, layout.ragged)
        for name, (dtype, shape) in one.items():
            fixed = math.prod(none[name][1])
            out.append(FieldSize(name, dtype, (shape[0] - fixed,), "sample",
                                 fixed * torch.empty((), dtype=dtype).element_size()))
        return out
    out = []
    for name, f in layout.fields().items():
        dtype, shape = _dtype(f["dtype"]), list(f["shape"])
        if "T" in shape:  # per token; other dims are its elements (specforge's leading 1 is none)
            t = shape.index("T")
            trailing = tuple(d for d in shape[:t] if d != 1) + tuple(shape[t + 1:])
            out.append(FieldSize(name, dtype, trailing, "token", same_as=f.get("same_as", "")))
        elif shape and shape[0] == layout.spec.max_len:  # padded to seq_length
            out.append(FieldSize(name, dtype, tuple(shape[1:]), "position"))
        else:
            out.append(FieldSize(name, dtype, tuple(shape), "sample"))
    return out


def bytes_per_token(sizes: list[FieldSize] | Layout, mean_k: float | None = None) -> dict[str, float]:
    """Field -> bytes per token (nemo: per padded position), for the fields that grow with tokens;
    "kept" fields at `mean_k` kept ids per token (default: at the cap k, a bound)."""
    sizes = field_sizes(sizes) if isinstance(sizes, Layout) else sizes
    return {f.name: f.nbytes if f.per != "kept" or mean_k is None else f.nbytes / f.shape[0] * mean_k
            for f in sizes if f.per != "sample"}


def tensor_bytes(sizes: list[FieldSize] | Layout, tokens: int, samples: int, shards: int = 1,
                 positions: int | None = None, kept: int | None = None) -> int:
    """Bytes of tensor data (headers aside) that `tokens` tokens in `samples` samples and `shards`
    shard files take; `positions` defaults to samples x max_len for padded layouts; `kept`
    (the kept draft ids, --keep-mass) to every token at the cap."""
    layout = sizes if isinstance(sizes, Layout) else None
    sizes = field_sizes(sizes) if layout is not None else sizes
    if positions is None:
        positions = samples * layout.spec.max_len if layout is not None else 0
    units = {"token": tokens, "position": positions, "sample": samples}
    return sum(f.nbytes * units[f.per] + f.fixed * shards if f.per != "kept" else
               f.nbytes // f.shape[0] * (tokens * f.shape[0] if kept is None else kept) for f in sizes)


def layout_bytes_per_token(layout: str, supervision: str, *, hidden_size: int, vocab_size: int,
                           draft_size: int | None = None, k: int = 0, dtype: str = "bf16",
                           out_dtype: str = "fp32", num_aux: int = 3, max_len: int = 4096,
                           **options) -> int:
    """Bytes per token (nemo: per padded position) of one layout at a model's shapes.

    dtype / out_dtype are short names ("bf16", "fp32"); `options` are further `LayoutSpec`
    fields (e.g. aux_dtype="fp8"), passed as they are. Raises TypeError for a field this
    `LayoutSpec` does not have, so a caller can tell an option apart from one not built yet.
    """
    spec = LayoutSpec(layout=layout, kind=supervision, k=k, hidden_size=hidden_size, num_aux=num_aux,
                      vocab_size=vocab_size, draft_size=draft_size or vocab_size,
                      dtype=SHORT_NAMES[dtype], out_dtype=SHORT_NAMES[out_dtype], max_len=max_len, **options)
    return sum(bytes_per_token(make_layout(spec)).values())


def _fmt(n: float) -> str:
    return f"{n:,.0f}" if n >= 10 or n == int(n) else f"{n:.2f}"


def size_table(sizes: list[FieldSize], tokens: int = 0, samples: int = 0, max_len: int = 0,
               indent: str = "  ") -> list[str]:
    """The by-field table a summary prints: one line per field, then the totals.

    With `tokens` and `samples` of a dataset, per-sample fields (and nemo's padding) are also
    given per real token.
    """
    per_unit = [f for f in sizes if f.per != "sample"]
    padded = any(f.per == "position" for f in per_unit)
    unit = "position" if padded else "token"
    total = sum(f.nbytes for f in per_unit)
    width = max([len(f.name) for f in sizes] + [10])
    head = f"by field     bytes/{unit}"
    if padded:
        head += f" (every sample is padded to seq_length {max_len:,})" if max_len else " (padded)"
    lines = [head]
    shapes = ["[" + ", ".join(str(d) for d in ("S" if padded else "T", *f.shape)) + "]" if f.per != "kept"
              else f"[T, <={f.shape[0]}]" for f in per_unit]
    shape_width = max(map(len, shapes), default=0)
    for f, shape in zip(per_unit, shapes):
        share = f"= {f.same_as}, stored once" if f.same_as else f"{100 * f.nbytes / max(total, 1):5.1f} %"
        lines.append(f"{indent}{f.name:<{width}} {_fmt(f.nbytes):>10}  {long_name(f.dtype):<13} "
                     f"{shape:<{shape_width}} {share}")
    lines.append(f"{indent}{'total':<{width}} {_fmt(total):>10}")
    per_sample = [f for f in sizes if f.per == "sample"]
    if per_sample:
        each = sum(f.nbytes for f in per_sample)
        line = (f"{indent}{'per sample':<{width}} {_fmt(each):>10}  "
                f"({', '.join(f.name for f in per_sample)})")
        if tokens:
            line += f", {_fmt(each * samples / tokens)} bytes/token here"
        lines.append(line)
    if padded and tokens and max_len:
        real = total * max_len * samples / tokens
        lines.append(f"{indent}{'per token':<{width}} {_fmt(real):>10}  "
                     f"(real tokens fill {100 * tokens / (max_len * samples):.1f} % of the positions)")
    return lines
