"""On-disk layouts of an extracted dataset: native, NeMo AutoModel's cache, vLLM speculators'.

Every layout turns one sample's canonical result (what the pipeline computed: `input_ids`,
`loss_mask`, `aux_hidden_states`, optionally the pre-norm final `hidden`, and the head fields
named as in `HeadOutput`) into per-sample tensors (`encode`), writes them into a shard
(`open_shard` -> `ShardSink`), and reads one sample back (`read_sample`). `verify` compares
`encode(recomputed)` with `read_sample(stored)`, so every layout is checked the same way.

Layouts
  native       shard-{g:06d}.safetensors. Samples are concatenated along tokens without
               padding; `offsets [n+1]` gives row ranges. Per-token fields (T = tokens):
               input_ids int32 [T], loss_mask bool [T], aux_hidden_states [T, 3H] (target
               dtype), then per supervision kind: draft -> draft_logprobs [T, Vd] +
               argmax_in_draft; topk -> topk_ids int32 [T, k] + topk_logprobs [T, k] +
               topk_tail; logits -> logits [T, V]; hidden -> hidden [T, H]; every head kind
               also lse fp32 [T] and argmax int32 [T]. Unshifted: row t is the target's
               output after reading tokens 0..t (it predicts token t+1). Ids are int32 on disk
               and int64 when read.
  nemo         NeMo AutoModel 0.7's EAGLE-3 offline cache (datasets/llm/eagle3_cache.py):
               shard-{g:06d}.safetensors with fixed `shard_size` samples, every field padded to
               `seq_length`: input_ids/attention_mask/loss_mask int64 [n, S], aux_hidden_states
               [n, S, 3H], position_mask bool [n, S, 1], and target_probs [n, S, Vd] (or
               target_probs_values [n, S, k] + target_probs_indices int32 [n, S, k] with
               --supervision topk). input_ids, loss_mask, target_probs and position_mask are
               shifted left by one with zero fill, exactly as NeMo's HFEagle3TargetModel does;
               aux_hidden_states and attention_mask are not. Plus target_embeddings.safetensors
               and NeMo's manifest.json (format_version 2) with ours under "eagle_fast".
  speculators  hidden_states/hs_{i}.safetensors per sample: hidden_states [T, 4, H] (the
               three aux layers in ascending order, then the final pre-norm hidden state, as
               vLLM's extract_hidden_states writes them) and token_ids int64 [T], plus our
               loss_mask bool [T]. When `datasets` is importable the finished directory also
               holds the Arrow table (input_ids, loss_mask, seq_len) speculators' ArrowDataset
               loads from the same path.

Limits: nemo pads to `seq_length` (NeMo's format); its padded positions hold zeros for the
aux states and a uniform distribution for target_probs where NeMo would have run the model on
pad tokens, which its loss masks out either way.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle_fast.dtypes import SAFETENSORS_CODES, SHORT_NAMES, long_name, short_name
from eagle_fast.head import read_input_embedding
from eagle_fast.manifest import commit_temp, file_record, fsync_dir, temp_path_for

LAYOUTS = ("native", "nemo", "speculators")
KINDS = ("draft", "topk", "lse", "logits", "hidden")
NEMO_FORMAT_VERSION = 2  # nemo_automodel.components.datasets.llm.eagle3_cache._FORMAT_VERSION

# ------------------------------------------------------------------ safetensors writing


class SafetensorsWriter:
    """A safetensors file whose layout is fixed up front and filled block by block.

    The header (tensor names, dtypes, shapes, offsets) is written first and the file is
    preallocated; `write(name, row, tensor)` then places rows with `os.pwrite`, in any order.
    This bounds memory by one batch instead of one shard and lets length-bucketed batches
    land in sample order. The bytes depend only on the specs and the data: tensors are laid
    out in name order, the JSON header has sorted keys and is space-padded to 8-byte
    alignment (as safetensors itself does). `commit()` fsyncs and renames the temp file
    into place; `abort()` removes it.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        tag: str = "",
    ):
        self.path = Path(path)
        self.tmp = temp_path_for(self.path, tag)
        header: dict[str, Any] = {}
        self._layout: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name in sorted(specs):
            dtype, shape = specs[name]
            shape = tuple(int(s) for s in shape)
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            row_bytes = nbytes // shape[0] if shape and shape[0] else 0
            header[name] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._layout[name] = (offset, row_bytes, dtype, shape)
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        raw += b" " * ((-(8 + len(raw))) % 8)
        self._data_start = 8 + len(raw)
        self.total_bytes = self._data_start + offset
        self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(self._fd, self.total_bytes)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, row: int, tensor: torch.Tensor) -> None:
        """Write `tensor` (rows of `name`'s trailing shape) starting at row `row`."""
        begin, row_bytes, dtype, shape = self._layout[name]
        t = tensor.detach()
        if t.dtype != dtype:
            t = t.to(dtype)
        if tuple(t.shape[1:]) != shape[1:]:
            raise ValueError(f"{name}: rows of shape {tuple(t.shape[1:])}, expected {shape[1:]}")
        if row < 0 or row + t.shape[0] > shape[0]:
            raise ValueError(f"{name}: rows [{row}, {row + t.shape[0]}) outside [0, {shape[0]})")
        if t.numel() == 0:
            return
        buf = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        os.pwrite(self._fd, buf, self._data_start + begin + row * row_bytes)

    def commit(self) -> Path:
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None, tag: str = "") -> Path:
    """Atomically write whole tensors (deterministic bytes, see SafetensorsWriter)."""
    w = SafetensorsWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, metadata, tag)
    try:
        for k, v in tensors.items():
            if v.dim() == 0:
                raise ValueError(f"{k}: 0-d tensors are not supported")
            w.write(k, 0, v)
        return w.commit()
    except BaseException:
        w.abort()
        raise


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class LayoutSpec:
    """Everything a layout needs to size and encode tensors."""

    layout: str
    kind: str                 # draft | topk | lse | logits | hidden
    k: int                    # top-k width (topk kind), else 0
    hidden_size: int          # H
    num_aux: int              # aux layers (3)
    vocab_size: int           # V
    draft_size: int           # Vd; equals V when no draft vocabulary is given
    dtype: torch.dtype        # target dtype = stored hidden-state dtype
    out_dtype: torch.dtype    # stored supervision float dtype (native)
    max_len: int              # nemo: seq_length every field is padded to
    pad_token_id: int = 0


@dataclass
class SamplePlan:
    """One input sample after tokenisation. `index` is its global position in the dataset."""

    index: int
    line: int
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass
class ShardPlan:
    index: int
    samples: list[SamplePlan]

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)


HEAD_FIELDS = {
    "draft": ("draft_logprobs", "argmax_in_draft", "lse", "argmax"),
    "topk": ("topk_ids", "topk_logprobs", "topk_tail", "lse", "argmax"),
    "lse": ("lse", "argmax"),
    "logits": ("logits", "lse", "argmax"),
    "hidden": (),
}
HEAD_OUTPUTS = {"draft": ("draft",), "topk": ("topk",), "lse": (), "logits": ("logits",)}


def validate_layout_kind(layout: str, kind: str) -> None:
    """Raise a UserError for a supervision kind the layout cannot store."""
    from eagle_fast.errors import UserError

    if layout == "nemo" and kind not in ("draft", "topk"):
        raise UserError(
            f"--format nemo stores NeMo's draft-vocab target_probs, not --supervision {kind}",
            "use --supervision draft (full draft distribution) or topk (NeMo's top-k "
            "compressed target_probs), or --format native",
        )
    if layout == "speculators" and kind != "hidden":
        raise UserError(
            f"--format speculators stores hidden states only, not --supervision {kind}",
            "use --supervision hidden with --format speculators, or --format native",
        )


class Layout:
    name = ""

    def __init__(self, spec: LayoutSpec):
        self.spec = spec

    # what the pipeline must compute
    def head_outputs(self) -> tuple[str, ...] | None:
        """Outputs to request from the head, or None when the head is not run."""
        raise NotImplementedError

    def head_out_dtype(self) -> torch.dtype:
        return self.spec.out_dtype

    def needs_final_hidden(self) -> bool:
        return False

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


def shard_file_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def _safe_open(path: Path, handles: dict | None):
    from safetensors import safe_open

    key = str(path)
    if handles is not None and key in handles:
        return handles[key]
    h = safe_open(key, framework="pt")
    if handles is not None:
        handles[key] = h
    return h


# ------------------------------------------------------------------------------ native

_INT_ON_DISK = ("input_ids", "argmax", "topk_ids")


class NativeLayout(Layout):
    name = "native"

    def head_outputs(self):
        return None if self.spec.kind == "hidden" else HEAD_OUTPUTS[self.spec.kind]

    def needs_final_hidden(self) -> bool:
        return self.spec.kind == "hidden"

    def _token_fields(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Field -> (disk dtype, trailing shape) for per-token fields."""
        s = self.spec
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            "input_ids": (torch.int32, ()),
            "loss_mask": (torch.bool, ()),
            "aux_hidden_states": (s.dtype, (s.num_aux * s.hidden_size,)),
        }
        if s.kind == "hidden":
            out["hidden"] = (s.dtype, (s.hidden_size,))
            return out
        out["lse"] = (torch.float32, ())
        out["argmax"] = (torch.int32, ())
        if s.kind == "draft":
            out["draft_logprobs"] = (s.out_dtype, (s.draft_size,))
            out["argmax_in_draft"] = (torch.bool, ())
        elif s.kind == "topk":
            out["topk_ids"] = (torch.int32, (s.k,))
            out["topk_logprobs"] = (s.out_dtype, (s.k,))
            out["topk_tail"] = (torch.float32, ())
        elif s.kind == "logits":
            out["logits"] = (s.out_dtype, (s.vocab_size,))
        return out

    def fields(self) -> dict[str, dict]:
        out = {}
        for name, (dtype, trailing) in self._token_fields().items():
            read_dtype = torch.int64 if name in _INT_ON_DISK else dtype
            out[name] = {"dtype": long_name(read_dtype), "shape": ["T", *trailing]}
        return out

    def encode(self, sample, result):
        out = {}
        for name, (dtype, _) in self._token_fields().items():
            t = result[name]
            out[name] = t.to(torch.int64) if name in _INT_ON_DISK else t.to(dtype)
        return out

    def shard_paths(self, shard):
        return [shard_file_name(shard.index)]

    def open_shard(self, root, shard):
        return _NativeSink(self, root, shard)

    def read_sample(self, root, shard_record, local_index, handles=None):
        path = root / shard_record["files"][0]["path"]
        h = _safe_open(path, handles)
        offsets = h.get_slice("offsets")[local_index: local_index + 2]
        a, b = int(offsets[0]), int(offsets[1])
        out = {}
        for name in self._token_fields():
            t = h.get_slice(name)[a:b]
            out[name] = t.to(torch.int64) if name in _INT_ON_DISK else t
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
        n = len(shard.samples)
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            "offsets": (torch.int64, (n + 1,)),
            "sample_index": (torch.int64, (n,)),
            "source_line": (torch.int64, (n,)),
        }
        self.fields = layout._token_fields()
        for name, (dtype, trailing) in self.fields.items():
            specs[name] = (dtype, (total, *trailing))
        meta = {"format": "eagle-fast", "layout": "native", "shard": str(shard.index)}
        self.writer = SafetensorsWriter(root / shard_file_name(shard.index), specs, meta)
        try:
            self.writer.write("offsets", 0, torch.tensor(offsets, dtype=torch.int64))
            self.writer.write("sample_index", 0, torch.tensor([s.index for s in shard.samples]))
            self.writer.write("source_line", 0, torch.tensor([s.line for s in shard.samples]))
        except BaseException:
            self.writer.abort()
            raise

    def write(self, local_index, encoded):
        row = self.offsets[local_index]
        for name in self.fields:
            self.writer.write(name, row, encoded[name])

    def commit(self):
        path = self.writer.commit()
        return [file_record(path, self.root)]

    def abort(self):
        self.writer.abort()


# -------------------------------------------------------------------------------- nemo


def _shift_left(t: torch.Tensor) -> torch.Tensor:
    """NeMo's `_shift_left_with_zero` for one unbatched sequence (dim 0)."""
    return torch.cat((t[1:], torch.zeros_like(t[:1])), dim=0)


class NemoLayout(Layout):
    name = "nemo"

    def head_outputs(self):
        return ("draft",)

    def head_out_dtype(self) -> torch.dtype:
        # NeMo takes the softmax in fp32, then casts target_probs to the cache dtype.
        return torch.float32

    @property
    def compressed(self) -> bool:
        # NeMo's `is_compressed`: a positive k below the draft width.
        return self.spec.kind == "topk" and 0 < self.spec.k < self.spec.draft_size

    def _specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        s = self.spec
        S = s.max_len
        out = {
            "input_ids": (torch.int64, (S,)),
            "attention_mask": (torch.int64, (S,)),
            "loss_mask": (torch.int64, (S,)),
            "aux_hidden_states": (s.dtype, (S, s.num_aux * s.hidden_size)),
            "position_mask": (torch.bool, (S, 1)),
        }
        if self.compressed:
            out["target_probs_values"] = (s.dtype, (S, s.k))
            out["target_probs_indices"] = (torch.int32, (S, s.k))
        else:
            out["target_probs"] = (s.dtype, (S, s.draft_size))
        return out

    def fields(self):
        return {n: {"dtype": long_name(d), "shape": list(shape)} for n, (d, shape) in self._specs().items()}

    def encode(self, sample, result):
        s = self.spec
        S = s.max_len
        T = sample.length
        if T > S:
            raise ValueError(f"sample {sample.index} has {T} tokens > seq_length {S}")
        ids = torch.full((S,), s.pad_token_id, dtype=torch.int64)
        ids[:T] = result["input_ids"].to(torch.int64)
        loss = torch.zeros(S, dtype=torch.int64)
        loss[:T] = result["loss_mask"].to(torch.int64)
        attn = torch.zeros(S, dtype=torch.int64)
        attn[:T] = 1
        aux = torch.zeros(S, s.num_aux * s.hidden_size, dtype=s.dtype)
        aux[:T] = result["aux_hidden_states"].to(s.dtype)
        # Row t of the shifted fields describes position t+1 (NeMo's shifted target frame).
        # Where no real position t+1 exists, NeMo's zero-filled logits give a uniform
        # distribution; its padded positions are masked out of the loss anyway.
        probs = torch.full((S, s.draft_size), 1.0 / s.draft_size, dtype=torch.float32)
        draft_lp = result["draft_logprobs"].to(torch.float32)
        probs[: T - 1] = torch.softmax(draft_lp[1:T], dim=-1) if T > 1 else probs[:0]
        in_draft = torch.zeros(S, dtype=torch.bool)
        in_draft[:T] = result["argmax_in_draft"].to(torch.bool)
        shifted_loss = _shift_left(loss)
        out = {
            "input_ids": _shift_left(ids),
            "attention_mask": attn,
            "loss_mask": shifted_loss,
            "aux_hidden_states": aux,
            "position_mask": (_shift_left(in_draft) & shifted_loss.bool()).unsqueeze(-1),
        }
        if self.compressed:
            # nemo_automodel eagle3_cache.compress_target_probs, for one sequence.
            values, indices = torch.topk(probs, s.k, dim=-1)
            values = values / values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
            out["target_probs_values"] = values.to(s.dtype)
            out["target_probs_indices"] = indices.to(torch.int32)
        else:
            out["target_probs"] = probs.to(s.dtype)
        return out

    def shard_paths(self, shard):
        return [shard_file_name(shard.index)]

    def open_shard(self, root, shard):
        return _NemoSink(self, root, shard)

    def read_sample(self, root, shard_record, local_index, handles=None):
        h = _safe_open(root / shard_record["files"][0]["path"], handles)
        return {name: h.get_slice(name)[local_index] for name in self._specs()}


class _NemoSink(ShardSink):
    def __init__(self, layout: NemoLayout, root: Path, shard: ShardPlan):
        super().__init__(root)
        n = len(shard.samples)
        self.names = list(layout._specs())
        specs = {name: (d, (n, *shape)) for name, (d, shape) in layout._specs().items()}
        # No __metadata__: byte-for-byte the fields NeMo's write_shard stores.
        self.writer = SafetensorsWriter(root / shard_file_name(shard.index), specs)

    def write(self, local_index, encoded):
        for name in self.names:
            self.writer.write(name, local_index, encoded[name].unsqueeze(0))

    def commit(self):
        return [file_record(self.writer.commit(), self.root)]

    def abort(self):
        self.writer.abort()


def nemo_manifest_fields(spec: LayoutSpec, *, model_id: str, data_path: str, num_samples: int,
                         shard_size: int, aux_layer_ids: list[int],
                         draft_ids: list[int] | None) -> dict:
    """The top-level manifest NeMo AutoModel's precompute_eagle3 writes (format_version 2)."""
    selected = list(range(spec.vocab_size)) if draft_ids is None else list(draft_ids)
    return {
        "format_version": NEMO_FORMAT_VERSION,
        "target_model": model_id,
        "target_vocab_size": spec.vocab_size,
        "draft_vocab_size": len(selected),
        "seq_length": spec.max_len,
        "dtype": short_name(spec.dtype),
        "num_samples": num_samples,
        "shard_size": shard_size,
        "target_probs_topk": spec.k if spec.kind == "topk" else 0,
        "aux_hidden_dim": spec.hidden_size * spec.num_aux,
        "aux_layer_ids": list(aux_layer_ids),
        "selected_token_ids": selected,
        "input_data": data_path,
        "split": None,
        # No shuffling: sample i is line-order sample i. NeMo records an int seed here.
        "shuffle_seed": 0,
        # Assistant masks come from the template's {% generation %} blocks (or the rendered
        # assistant spans), as NeMo's defaults compute them.
        "mask_reasoning_content": False,
        "mask_generation_prompt": False,
    }


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
        return {
            "hidden_states": {"dtype": long_name(s.dtype), "shape": ["T", s.num_aux + 1, s.hidden_size]},
            "token_ids": {"dtype": "int64", "shape": ["T"]},
            "loss_mask": {"dtype": "bool", "shape": ["T"]},
        }

    def encode(self, sample, result):
        s = self.spec
        T = sample.length
        aux = result["aux_hidden_states"].to(s.dtype).reshape(T, s.num_aux, s.hidden_size)
        final = result["hidden"].to(s.dtype).reshape(T, 1, s.hidden_size)
        return {
            "hidden_states": torch.cat([aux, final], dim=1).contiguous(),
            "token_ids": result["input_ids"].to(torch.int64),
            "loss_mask": result["loss_mask"].to(torch.bool),
        }

    @classmethod
    def sample_path(cls, index: int) -> str:
        return f"{cls.SUBDIR}/hs_{index}.safetensors"

    def shard_paths(self, shard):
        return [self.sample_path(s.index) for s in shard.samples]

    def open_shard(self, root, shard):
        (root / self.SUBDIR).mkdir(parents=True, exist_ok=True)
        return _SpeculatorsSink(root, shard)

    def read_sample(self, root, shard_record, local_index, handles=None):
        from safetensors.torch import load_file

        return load_file(str(root / shard_record["files"][local_index]["path"]))


class _SpeculatorsSink(ShardSink):
    def __init__(self, root: Path, shard: ShardPlan):
        super().__init__(root)
        self.shard = shard
        self.paths: dict[int, Path] = {}

    def write(self, local_index, encoded):
        index = self.shard.samples[local_index].index
        path = self.root / SpeculatorsLayout.sample_path(index)
        self.paths[local_index] = write_safetensors(path, encoded)

    def commit(self):
        missing = [i for i in range(len(self.shard.samples)) if i not in self.paths]
        if missing:
            raise RuntimeError(f"shard {self.shard.index}: samples {missing[:5]} never written")
        return [file_record(self.paths[i], self.root) for i in range(len(self.shard.samples))]

    def abort(self):
        pass  # written files are complete samples; the shard is redone as a whole


def write_speculators_arrow(root: Path, samples: list[tuple[list[int], list[int]]]) -> bool:
    """Write the preprocessed table speculators' ArrowDataset loads next to hidden_states/.

    Returns False (and writes nothing) when `datasets` is not importable.
    """
    try:
        from datasets import Dataset
    except ImportError:
        return False
    import shutil
    import tempfile

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


def make_layout(spec: LayoutSpec) -> Layout:
    return {"native": NativeLayout, "nemo": NemoLayout, "speculators": SpeculatorsLayout}[spec.layout](spec)


def spec_from_manifest(m: dict) -> LayoutSpec:
    s = m["layout_spec"]
    return LayoutSpec(
        layout=m["layout"], kind=s["kind"], k=int(s["k"]), hidden_size=int(s["hidden_size"]),
        num_aux=int(s["num_aux"]), vocab_size=int(s["vocab_size"]), draft_size=int(s["draft_size"]),
        dtype=SHORT_NAMES[s["dtype"]], out_dtype=SHORT_NAMES[s["out_dtype"]],
        max_len=int(s["max_len"]), pad_token_id=int(s["pad_token_id"]),
    )


def spec_to_json(spec: LayoutSpec) -> dict:
    return {
        "kind": spec.kind, "k": spec.k, "hidden_size": spec.hidden_size, "num_aux": spec.num_aux,
        "vocab_size": spec.vocab_size, "draft_size": spec.draft_size,
        "dtype": short_name(spec.dtype), "out_dtype": short_name(spec.out_dtype),
        "max_len": spec.max_len, "pad_token_id": spec.pad_token_id,
    }


def write_target_embeddings(root: Path, model_dir: str, tag: str = "") -> dict:
    """NeMo's target_embeddings.safetensors: {"weight": fp32 [V, H]} (input embeddings)."""
    weight = read_input_embedding(model_dir)
    path = write_safetensors(root / "target_embeddings.safetensors",
                             {"weight": weight.to(torch.float32).contiguous()}, tag=tag)
    return file_record(path, root)


__all__ = [
    "KINDS",
    "LAYOUTS",
    "Layout",
    "LayoutSpec",
    "SafetensorsWriter",
    "SamplePlan",
    "ShardPlan",
    "commit_temp",
    "make_layout",
    "nemo_manifest_fields",
    "validate_layout_kind",
    "write_safetensors",
    "write_speculators_arrow",
]
