"""Layouts: how one sample's supervision is laid out on disk; the base and the native layout.

Every layout turns one sample's canonical result (`input_ids`, `loss_mask`,
`aux_hidden_states`, optionally the pre-norm final `hidden`, and the head fields named as in
`HeadOutput`) into per-sample tensors (`encode`), writes them into a shard (`open_shard` ->
`ShardSink`), and reads one sample back (`read_sample`). `verify` compares
`encode(recomputed)` with `read_sample(stored)`, so every layout is checked the same way.

native: shard-{g:06d}.safetensors; samples concatenated along tokens without padding,
`offsets [n+1]` gives row ranges. Per token: input_ids int32, loss_mask bool,
aux_hidden_states [T, 3H] (target dtype; or fp8 + aux_hidden_states_scale fp32 [T] with
--aux-dtype fp8, see store/fp8.py), then per supervision kind draft_logprobs [T, Vd] +
argmax_in_draft | draft_topk_ids [T, k] (indices into the draft vocabulary, in the smallest
integer type holding them) + draft_topk_logprobs (over the draft vocabulary) + draft_topk_tail
fp32 + argmax_in_draft | topk_ids int32 + topk_logprobs + topk_tail | logits [T, V] |
hidden [T, H]; every head kind also argmax int32, and all but draft-topk lse fp32. Unshifted: row t is the target's output after
tokens 0..t. Ids are int32 on disk and int64 when read. `hidden` takes --aux-dtype fp8 too
(its own per-token scale, hidden_scale).
draft-topk with --keep-mass P (ragged): draft_topk_lengths [T] (k_t, the fewest ids holding P of
the draft mass, at most k; uint8 up to k = 255) replaces the [T, k] width: draft_topk_ids and
draft_topk_logprobs are 1-d, each token's k_t kept ids in order, token after token, and
draft_topk_offsets [n+1] (per sample, like offsets) gives each sample's range in them;
draft_topk_tail is the mass outside the kept ids. The ragged fields are written at commit
(`SafetensorsWriter`'s late tensors), so a shard's kept ids wait in memory until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_fast.dtypes import long_name
from eagle_fast.errors import UserError
from eagle_fast.inputs import SamplePlan, ShardPlan
from eagle_fast.store.fp8 import FP8, SCALE_NAMES, quantize, stored_dtype
from eagle_fast.store.manifest import file_record
from eagle_fast.store.safetensors import SafetensorsWriter, open_safetensors, write_safetensors
from eagle_fast.supervision import keep_mass_lengths

LAYOUTS = ("native", "nemo", "speculators", "specforge")  # --format; "multi" is several of them (store/multi.py)
KINDS = ("draft", "draft-topk", "topk", "lse", "logits", "hidden")


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class LayoutSpec:
    """Everything a layout needs to size and encode tensors."""

    layout: str
    kind: str                 # draft | draft-topk | topk | lse | logits | hidden
    k: int                    # top-k width (topk, draft-topk kinds), else 0
    hidden_size: int          # H
    num_aux: int              # aux layers (3)
    vocab_size: int           # V
    draft_size: int           # Vd; equals V when no draft vocabulary is given
    dtype: torch.dtype        # target dtype = stored hidden-state dtype
    out_dtype: torch.dtype    # stored supervision float dtype (native)
    max_len: int              # nemo: seq_length every field is padded to
    pad_token_id: int = 0
    aux_dtype: str = "auto"   # stored hidden states: auto (= dtype) | fp8 (store/fp8.py)
    keep_mass: float = 0.0    # draft-topk: keep per token the fewest ids holding this mass (0: k ids)
    types: tuple = ()         # draft_types.TypeLayers this record serves (empty: EAGLE-3, as captured)
    capture_ids: tuple = ()   # the captured layers, in the order a result's aux_hidden_states holds them
    num_layers: int = 0       # N decoder layers, where a layout's ids read id N - 1 as the final norm's output (NeMo's DSpark); else 0
    parts: tuple = ()         # layout "multi": (subdirectory, LayoutSpec) per record (store/multi.py)

    def union_layers(self) -> tuple[int, ...]:
        """Every layer the record's types read, in capture order (empty `types`: the capture's own)."""
        wanted = {i for t in self.types for i in t.layer_ids}
        return tuple(i for i in self.capture_ids if i in wanted)

    def final_states(self) -> set[str]:
        """The final hidden states the record's types read: "pre" (as captured) and/or "post" (normed)."""
        return {t.final for t in self.types} - {"none"}

    @property
    def draft_types(self) -> tuple[str, ...]:
        return tuple(t.draft_type for t in self.types) or ("eagle3",)


def select_layers(aux: torch.Tensor, capture_ids, layer_ids, hidden_size: int) -> torch.Tensor:
    """`layer_ids`' states [T, n H] from a result's `aux` [T, C H] (`capture_ids`' order): `aux` itself
    when they are the capture (or no capture order is known), a view when they lie consecutive in
    it, else gathered."""
    capture_ids, layer_ids = tuple(capture_ids), tuple(layer_ids)
    if not capture_ids or layer_ids == capture_ids:
        return aux
    T = aux.shape[0]
    slots = [capture_ids.index(i) for i in layer_ids]
    per_layer = aux.reshape(T, len(capture_ids), hidden_size)
    if not slots:
        return aux.new_empty((T, 0))
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return per_layer[:, slots[0]: slots[0] + len(slots)].reshape(T, -1)
    return per_layer[:, slots].reshape(T, -1)


HEAD_FIELDS = {
    "draft": ("draft_logprobs", "argmax_in_draft", "lse", "argmax"),
    "draft-topk": ("draft_topk_ids", "draft_topk_logprobs", "draft_topk_tail", "argmax_in_draft",
                   "argmax"),
    "topk": ("topk_ids", "topk_logprobs", "topk_tail", "lse", "argmax"),
    "lse": ("lse", "argmax"),
    "logits": ("logits", "lse", "argmax"),
    "hidden": (),
}
# What the head computes for each kind: exactly what HEAD_FIELDS stores ("draft" and "logits"
# name "lse" because this layout keeps it; top-k computes it anyway; the sparse draft target
# stores no lse, so its head call skips the full-vocabulary exp).
HEAD_OUTPUTS = {"draft": ("draft", "lse"), "draft-topk": ("draft_topk",), "topk": ("topk", "lse"),
                "lse": ("lse",),
                "logits": ("logits", "lse")}


def validate_layout_kind(layout: str, kind: str, draft_types: tuple[str, ...] = ("eagle3",)) -> None:
    """Raise a UserError for a supervision kind the layout cannot store (for the draft types it holds)."""

    if layout == "nemo" and draft_types == ("dspark",):
        if kind != "hidden":
            raise UserError(f"NeMo AutoModel's DSpark cache stores hidden states only (its trainer applies the "
                            f"LM head to target_last_hidden_states), not --supervision {kind}",
                            "drop --supervision for --format nemo --draft-type dspark, or use --format native")
        return
    if layout == "nemo" and kind not in ("draft", "topk"):
        raise UserError(
            f"--format nemo stores NeMo's draft-vocab target_probs, not --supervision {kind}",
            "use --supervision draft (full draft distribution) or topk (NeMo's top-k "
            "compressed target_probs), or --format native",
        )
    if layout in ("speculators", "specforge") and kind != "hidden":
        raise UserError(
            f"--format {layout} stores hidden states only (its trainer applies the LM head), "
            f"not --supervision {kind}",
            f"use --supervision hidden with --format {layout}, or --format native",
        )


class Layout:
    name = ""
    ragged = False  # a different draft top-k width per token (native --keep-mass only)

    def __init__(self, spec: LayoutSpec):
        self.spec = spec

    # what the pipeline must compute
    def head_outputs(self) -> tuple[str, ...] | None:
        """Outputs to request from the head, or None when the head is not run."""
        raise NotImplementedError

    def head_fields(self) -> tuple[str, ...]:
        """The head's result fields that `encode` reads (the pipeline checks they came back)."""
        return ()

    def head_out_dtype(self) -> torch.dtype:
        return self.spec.out_dtype

    def final_states(self) -> set[str]:
        """The final hidden states `encode` reads: "pre" (result["hidden"], as the engine captured
        it, before the final norm) and/or "post" (result["hidden_normed"], after it, rounded as the
        served model rounds it)."""
        return set()

    # per sample
    def fields(self) -> dict[str, dict]:
        """Field name -> {"dtype", "shape"} of what `read_sample` returns (shape per sample)."""
        raise NotImplementedError

    def encode(self, sample: SamplePlan, result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def open_shard(self, root: Path, shard: ShardPlan) -> ShardSink:
        raise NotImplementedError

    def shard_paths(self, shard: ShardPlan) -> list[str]:
        raise NotImplementedError

    def read_sample(self, root: Path, shard_record: dict, local_index: int,
                    handles: dict | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # per shard and per directory
    def shard_extras(self, shard: ShardPlan) -> dict:
        """What a committed shard's manifest record holds beyond its files (NeMo: first tokens)."""
        return {}

    def sidecar_names(self, ctx: SidecarContext) -> list[str]:
        """The files `write_sidecars` writes (a killed run's temps of them are removed)."""
        return [DRAFT_VOCAB] if ctx.draft_ids is not None else []

    def write_sidecars(self, root: Path, have: set[str], ctx: SidecarContext) -> list[dict]:
        """The files written once per directory beside the shards, those in `have` aside (already
        there and intact); their manifest records. Every layout: the draft vocabulary, ours."""
        if ctx.draft_ids is None or DRAFT_VOCAB in have:
            return []
        path = write_safetensors(root / DRAFT_VOCAB, {
            "d2t": ctx.d2t, "t2d": ctx.t2d, "selected_token_ids": ctx.draft_ids.clone(),
            "target_vocab_size": torch.tensor([ctx.vocab_size], dtype=torch.int64)}, tag=ctx.tag)
        return [file_record(path, root)]

    def manifest_body(self, m: dict, ctx: SidecarContext) -> dict:
        """What the directory's manifest.json holds for our manifest `m` (NeMo: its own, ours inside)."""
        return m

    def finalize(self, root: Path, m: dict, pairs=None) -> None:
        """Once the whole dataset (`m` complete, not a part) is on disk: files its trainer needs that
        only the whole can make (speculators: the Arrow table). `pairs()`: every sample's (input ids,
        loss mask), when the caller has them; else they are read back from the files."""


DRAFT_VOCAB = "draft_vocab.safetensors"


@dataclass(frozen=True)
class SidecarContext:
    """What the files beside the shards are made from: the draft vocabulary (its target ids, and
    d2t / t2d as `vocab.DraftVocab` gives them), the target, and the part's temp-file tag."""

    draft_ids: torch.Tensor | None
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None
    vocab_size: int
    model_dir: str
    model_id: str
    tag: str = ""


class ShardSink:
    """Receives encoded samples of one shard (any order) and commits its files."""

    def __init__(self, root: Path):
        self.root = root
        self.records: list[dict] = []

    def write(self, local_index: int, encoded: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def commit(self) -> list[dict]:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class FilePerSampleSink(ShardSink):
    """A shard as one file per sample (speculators, SpecForge): `write_file(path, encoded)`
    writes (atomically) the file `path_of(sample index)` names under the root and returns its
    path; the shard's records are those files, in sample order."""

    def __init__(self, root: Path, shard: ShardPlan, path_of, write_file):
        super().__init__(root)
        self.shard, self.path_of, self.write_file = shard, path_of, write_file
        self.paths: dict[int, Path] = {}

    def write(self, local_index, encoded):
        index = self.shard.samples[local_index].index
        self.paths[local_index] = self.write_file(self.root / self.path_of(index), encoded)

    def commit(self):
        missing = [i for i in range(len(self.shard.samples)) if i not in self.paths]
        if missing:
            raise RuntimeError(f"shard {self.shard.index}: samples {missing[:5]} never written")
        return [file_record(self.paths[i], self.root) for i in range(len(self.shard.samples))]

    def abort(self):
        pass  # written files are complete samples; the shard is redone as a whole


def shard_file_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


# ------------------------------------------------------------------------------ native

_INT_ON_DISK = ("input_ids", "argmax", "topk_ids", "draft_topk_ids")
_LENGTHS = ("draft_topk_lengths",)  # stored in the smallest type, read as int64


def length_dtype(k: int) -> torch.dtype:
    """The smallest integer dtype that holds lengths 0..k (uint8, int16 or int32)."""
    return draft_index_dtype(k + 1)


def draft_index_dtype(draft_size: int) -> torch.dtype:
    """The smallest integer dtype that holds indices 0..draft_size-1 (uint8, int16 or int32)."""
    if draft_size <= 1 << 8:
        return torch.uint8
    return torch.int16 if draft_size <= 1 << 15 else torch.int32


class NativeLayout(Layout):
    name = "native"

    def head_outputs(self):
        return None if self.spec.kind == "hidden" else HEAD_OUTPUTS[self.spec.kind]

    def head_fields(self):
        return HEAD_FIELDS[self.spec.kind]

    def final_states(self) -> set[str]:
        return {"pre"} if self.spec.kind == "hidden" or "pre" in self.spec.final_states() else set()

    def stored_layers(self) -> tuple[int, ...]:
        """The layers `aux_hidden_states` holds, in order: every type's, in capture order."""
        return self.spec.union_layers()

    def token_fields(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Field -> (disk dtype, trailing shape) for per-token fields."""
        s = self.spec
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            "input_ids": (torch.int32, ()),
            "loss_mask": (torch.bool, ()),
        }
        if s.num_aux:  # MTP alone reads no layer
            out["aux_hidden_states"] = (stored_dtype(s.aux_dtype, s.dtype), (s.num_aux * s.hidden_size,))
            if s.aux_dtype == "fp8":
                out["aux_hidden_states_scale"] = (torch.float32, ())
        if self.final_states():
            out["hidden"] = (stored_dtype(s.aux_dtype, s.dtype), (s.hidden_size,))
            if s.aux_dtype == "fp8":
                out["hidden_scale"] = (torch.float32, ())
        if s.kind == "hidden":
            return out
        if s.kind != "draft-topk":
            out["lse"] = (torch.float32, ())
        out["argmax"] = (torch.int32, ())
        if s.kind == "draft-topk" and self.ragged:
            out["draft_topk_lengths"] = (length_dtype(s.k), ())
            out["draft_topk_tail"] = (torch.float32, ())
            out["argmax_in_draft"] = (torch.bool, ())
        elif s.kind == "draft-topk":
            out["draft_topk_ids"] = (draft_index_dtype(s.draft_size), (s.k,))
            out["draft_topk_logprobs"] = (s.out_dtype, (s.k,))
            out["draft_topk_tail"] = (torch.float32, ())
            out["argmax_in_draft"] = (torch.bool, ())
        elif s.kind == "draft":
            out["draft_logprobs"] = (s.out_dtype, (s.draft_size,))
            out["argmax_in_draft"] = (torch.bool, ())
        elif s.kind == "topk":
            out["topk_ids"] = (torch.int32, (s.k,))
            out["topk_logprobs"] = (s.out_dtype, (s.k,))
            out["topk_tail"] = (torch.float32, ())
        elif s.kind == "logits":
            out["logits"] = (s.out_dtype, (s.vocab_size,))
        return out

    @property
    def ragged(self) -> bool:
        """A different k per token (draft-topk with --keep-mass)."""
        return self.spec.kind == "draft-topk" and self.spec.keep_mass > 0

    def kept_fields(self) -> dict[str, torch.dtype]:
        """Field -> disk dtype of the ragged fields: one element per kept id (empty unless ragged)."""
        if not self.ragged:
            return {}
        return {"draft_topk_ids": draft_index_dtype(self.spec.draft_size),
                "draft_topk_logprobs": self.spec.out_dtype}

    def fields(self) -> dict[str, dict]:
        out = {}
        for name, (dtype, trailing) in self.token_fields().items():
            read_dtype = torch.int64 if name in _INT_ON_DISK + _LENGTHS else dtype
            out[name] = {"dtype": long_name(read_dtype), "shape": ["T", *trailing]}
        for name, dtype in self.kept_fields().items():
            read_dtype = torch.int64 if name in _INT_ON_DISK else dtype
            out[name] = {"dtype": long_name(read_dtype), "shape": ["sum(draft_topk_lengths)"]}
        return out

    def encode(self, sample, result):
        out = {}
        if self.ragged:
            lengths, tail, _ = keep_mass_lengths(result["draft_topk_logprobs"], result["draft_topk_tail"],
                                                 self.spec.keep_mass)
            keep = torch.arange(self.spec.k, device=lengths.device)[None, :] < lengths[:, None]
            out["draft_topk_lengths"] = lengths
            out["draft_topk_tail"] = tail
            out["draft_topk_ids"] = result["draft_topk_ids"][keep].to(torch.int64)
            out["draft_topk_logprobs"] = result["draft_topk_logprobs"][keep].to(self.spec.out_dtype)
        for name, (dtype, _) in self.token_fields().items():
            if name in out:  # a scale, made with its fp8 values; the ragged fields, made above
                continue
            t = result[name]
            if name == "aux_hidden_states":
                t = select_layers(t, self.spec.capture_ids, self.stored_layers(), self.spec.hidden_size)
            if dtype == FP8:  # quantise what --aux-dtype auto would store
                out[name], out[SCALE_NAMES[name]] = quantize(t.to(self.spec.dtype))
            else:
                out[name] = t.to(torch.int64) if name in _INT_ON_DISK else t.to(dtype)
        return out

    def shard_paths(self, shard):
        return [shard_file_name(shard.index)]

    def open_shard(self, root, shard):
        return _NativeSink(self, root, shard)

    def read_sample(self, root, shard_record, local_index, handles=None):
        path = root / shard_record["files"][0]["path"]
        h = open_safetensors(path, handles)
        offsets = h.get_slice("offsets")[local_index: local_index + 2]
        a, b = int(offsets[0]), int(offsets[1])
        out = {}
        for name in self.token_fields():
            t = h.get_slice(name)[a:b]
            out[name] = t.to(torch.int64) if name in _INT_ON_DISK + _LENGTHS else t
        if self.ragged:
            kept = h.get_slice("draft_topk_offsets")[local_index: local_index + 2]
            c, d = int(kept[0]), int(kept[1])
            for name in self.kept_fields():
                t = h.get_slice(name)[c:d]
                out[name] = t.to(torch.int64) if name in _INT_ON_DISK else t
        return out


def native_index_fields(n: int, ragged: bool = False) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Field -> (dtype, shape) of a native shard's per-sample index fields, for `n` samples
    (`ragged`: plus each sample's range in the kept draft ids, draft_topk_offsets)."""
    out = {"offsets": (torch.int64, (n + 1,)), "sample_index": (torch.int64, (n,)),
           "source_line": (torch.int64, (n,))}
    if ragged:
        out["draft_topk_offsets"] = (torch.int64, (n + 1,))
    return out


class _NativeSink(ShardSink):
    def __init__(self, layout: NativeLayout, root: Path, shard: ShardPlan):
        super().__init__(root)
        lengths = [s.length for s in shard.samples]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets
        total = offsets[-1]
        specs = native_index_fields(len(shard.samples), layout.ragged)
        self.fields = layout.token_fields()
        for name, (dtype, trailing) in self.fields.items():
            specs[name] = (dtype, (total, *trailing))
        meta = {"format": "eagle-fast", "layout": "native", "shard": str(shard.index)}
        # Ragged: each sample's kept ids wait here until commit, when their lengths are known.
        self.kept_fields = layout.kept_fields()
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        late = {name: (dtype, total * layout.spec.k) for name, dtype in self.kept_fields.items()}
        self.writer = SafetensorsWriter(root / shard_file_name(shard.index), specs, meta, late=late)
        try:
            self.writer.write("offsets", 0, torch.tensor(offsets, dtype=torch.int64))
            self.writer.write("sample_index", 0, torch.tensor([s.index for s in shard.samples]))
            # the original data's line: a regenerated row's `source_line`, else the row's own line
            self.writer.write("source_line", 0, torch.tensor([s.source_line or s.line for s in shard.samples]))
        except BaseException:
            self.writer.abort()
            raise

    def write(self, local_index, encoded):
        row = self.offsets[local_index]
        for name in self.fields:
            self.writer.write(name, row, encoded[name])
        if self.kept_fields:
            self.kept[local_index] = {n: encoded[n].to(d).cpu() for n, d in self.kept_fields.items()}

    def commit(self):
        late = None
        if self.kept_fields:
            n = len(self.offsets) - 1
            missing = [i for i in range(n) if i not in self.kept]
            if missing:
                raise RuntimeError(f"samples {missing[:5]} never written")
            counts = [int(self.kept[i]["draft_topk_ids"].numel()) for i in range(n)]
            self.writer.write("draft_topk_offsets", 0, torch.tensor([0, *counts]).cumsum(0))
            late = {name: torch.cat([self.kept[i][name] for i in range(n)]) for name in self.kept_fields}
        path = self.writer.commit(late)
        return [file_record(path, self.root)]

    def abort(self):
        self.writer.abort()
