"""`DraftDataset` (`Eagle3Dataset` before draft types): a torch Dataset over an extracted directory,
read lazily from memory maps.

    ds = DraftDataset("out/")           # validates the manifest and every file (cheaply)
    sample = ds[0]                      # dict of CPU tensors for one sample
    ds = DraftDataset("out/", aux_dtype=torch.float32)   # hidden states in fp32
    ds = DraftDataset("out/", draft_type="dflash")       # one type of a native record of several
    loader = DataLoader(ds, batch_size=8, collate_fn=DraftDataset.collate)

Native layout samples hold `input_ids` int64 [T], `loss_mask` bool [T], `aux_hidden_states`
[T, n H] (target dtype; the manifest's `aux_layer_ids`, or with `draft_type` that type's layers;
absent for MTP alone), `hidden` [T, H] (the pre-norm final state) where MTP is among the types, and the supervision fields named as in `HeadOutput` (`draft_logprobs`
+ `argmax_in_draft`, or the sparse `draft_topk_ids` (int64 indices into the draft vocabulary)
+ `draft_topk_logprobs` + `draft_topk_tail` + `argmax_in_draft`, or `topk_ids` +
`topk_logprobs` + `topk_tail`, or `logits`; `argmax` always, `lse` with all but draft-topk; or
`hidden`, the pre-norm final hidden state), row t being the target's output after tokens
0..t. With --keep-mass the draft top-k is ragged: `draft_topk_lengths` int64 [T] (k_t) and
1-d `draft_topk_ids` / `draft_topk_logprobs` (each token's k_t, token after token; see
store/layouts.py). `target_p(i, tail)` (or `DraftDataset(dir, target_p="spread")`, which adds it to every
sample) gives the dense draft distribution, rebuilt from the sparse fields where stored so. The nemo,
speculators and specforge layouts yield their stored per-sample tensors
as their own readers would (use NeMo's `CachedEagle3Dataset` / `CachedDSparkDataset` for NeMo training).
Hidden states stored in fp8 (`--aux-dtype fp8`) are dequantised on read (`store/fp8.py`) to the
target's dtype, or to `aux_dtype` when given (which also casts non-fp8 ones); their scale
fields are dropped. `raw(i)` returns the stored tensors as they are.
`nemo_inputs(i)` / `nemo_collate` give a native draft or draft-topk sample in the shifted frame
NeMo AutoModel's `Eagle3TrainerModule` trains on (bench/bench_accept.py trains drafts so).

Opening checks the manifest (format, version, completeness) and each file's size and
safetensors-header hash; `verify="full"` re-hashes every byte (slow on big datasets).
Safetensors handles are opened on first use and reopened in each DataLoader worker process.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

from eagle_fast.errors import UserError
from eagle_fast.inputs import SamplePlan
from eagle_fast.store import make_layout, spec_from_manifest
from eagle_fast.store.fp8 import dequantize_sample
from eagle_fast.store.layouts import select_layers
from eagle_fast.store.manifest import check_file_cheap, check_file_full, iter_files, read_manifest
from eagle_fast.store.nemo import trainer_frame
from eagle_fast.store.safetensors import open_safetensors as _safe_open
from eagle_fast.supervision import (
    TAIL_MODES,
    dense_target_p,
    dense_target_p_ragged,
    keep_mass_lengths,
)


def keep_mass_stats(root: Path, shards: list[dict], spec, handles: dict | None = None) -> tuple[float, int, int]:
    """(mean kept k, tokens that hit the cap, tokens) of the native --keep-mass `shards` (manifest
    records) under `root`; see `DraftDataset.keep_mass_stats`."""
    kept = capped = tokens = 0
    for rec in shards:
        h = _safe_open(Path(root) / rec["files"][0]["path"], handles)
        lengths = h.get_tensor("draft_topk_lengths").long()
        logprobs = h.get_tensor("draft_topk_logprobs")
        full = (lengths == spec.k).nonzero().squeeze(-1)
        starts = lengths.cumsum(0) - lengths
        rows = logprobs[starts[full, None] + torch.arange(spec.k)]
        capped += int(keep_mass_lengths(rows, torch.zeros(len(full)), spec.keep_mass)[2].sum())
        kept, tokens = kept + int(lengths.sum()), tokens + lengths.numel()
    return kept / max(tokens, 1), capped, tokens


class DraftDataset(Dataset):
    """Samples of an eagle-fast dataset directory (see module doc); `draft_type` picks one draft type
    of a native record of several, whose layers `aux_hidden_states` then holds."""

    def __init__(self, directory: str | os.PathLike, verify: str = "cheap", allow_incomplete: bool = False,
                 aux_dtype: torch.dtype | None = None, target_p: str | None = None, draft_type: str | None = None):
        if verify not in ("cheap", "full", "none"):
            raise ValueError(f"verify must be 'cheap', 'full' or 'none', got {verify!r}")
        if aux_dtype is not None and not (isinstance(aux_dtype, torch.dtype) and aux_dtype.is_floating_point):
            raise ValueError(f"aux_dtype must be a floating-point torch.dtype, got {aux_dtype!r}")
        self.aux_dtype = aux_dtype
        if target_p is not None and target_p not in TAIL_MODES:
            raise ValueError(f"target_p must be None or one of {TAIL_MODES}, got {target_p!r}")
        self.target_p_mode = target_p
        self.root = Path(directory)
        self.manifest = m = read_manifest(self.root)
        if m["layout"] == "multi":
            dirs = [p["dir"] for p in m["parts"]]
            raise UserError(f"{self.root} holds {len(dirs)} records, one per subdirectory ({', '.join(dirs)}), "
                            "each a dataset of its own", f"open one of them, e.g. DraftDataset('{self.root / dirs[0]}')")
        if not m.get("complete") and not allow_incomplete:
            raise UserError(
                f"{self.root} is incomplete ({len(m['shards'])}/{m['num_shards']} shards written)",
                "re-run the same `eagle-fast extract` command to resume it"
                + (", or `eagle-fast merge` the per-node parts" if m.get("part") else ""),
            )
        if verify != "none":
            check = check_file_full if verify == "full" else check_file_cheap
            for rec in iter_files(m):
                reason = check(self.root, rec)
                if reason is not None:
                    raise UserError(
                        f"{self.root}: {reason}",
                        "delete that file and re-run the extract command to rewrite it"
                        if m["layout"] != "nemo" or "shard-" in rec["path"] else "re-extract the dataset",
                    )
        self.spec = spec_from_manifest(m)
        self.layout = make_layout(self.spec)
        self.draft_type, self._layers = draft_type, None
        if draft_type is not None:
            if draft_type not in self.spec.draft_types:
                raise UserError(f"{self.root} holds draft types {', '.join(self.spec.draft_types)}, not {draft_type}",
                                f"pass draft_type= one of them, or extract with --draft-type {draft_type}")
            if self.layout.name == "native" and self.spec.types:
                stored = self.layout.stored_layers()
                self._layers = (stored, next(t.layer_ids for t in self.spec.types if t.draft_type == draft_type))
        self.shards = sorted(m["shards"], key=lambda r: r["index"])
        self._starts: list[int] = []
        total = 0
        for rec in self.shards:
            self._starts.append(total)
            total += int(rec["samples"])
        self._len = total
        if m.get("complete") and total != int(m["num_samples"]):
            raise UserError(f"{self.root}: shards hold {total} samples, the manifest says {m['num_samples']}",
                            "re-extract the dataset")
        self._handles: dict = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self._len

    @property
    def open_files(self) -> list[str]:
        """The shard files this process has opened so far (they open lazily, memory-mapped)."""
        return sorted(str(k) for k in self._h())

    def _locate(self, index: int) -> tuple[dict, int]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(index)
        s = bisect.bisect_right(self._starts, index) - 1
        return self.shards[s], index - self._starts[s]

    def _h(self) -> dict:
        if os.getpid() != self._pid:  # a forked DataLoader worker: do not share mmaps/handles
            self._handles, self._pid = {}, os.getpid()
        return self._handles

    def raw(self, index: int) -> dict[str, torch.Tensor]:
        """The stored per-sample tensors, exactly as this layout's `encode` produces them."""
        rec, local = self._locate(index)
        return self.layout.read_sample(self.root, rec, local, self._h())

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """`raw(index)` with hidden states in `aux_dtype` (default: the target's), fp8 dequantised,
        plus `target_p` [T, Vd] when the dataset was opened with `target_p=MODE`."""
        sample = self.raw(index)
        if not (self.spec.aux_dtype == "auto" and self.aux_dtype is None):
            sample = dequantize_sample(sample, self.aux_dtype or self.spec.dtype)
        if self._layers is not None and "aux_hidden_states" in sample:  # one type of several: its layers
            stored, wanted = self._layers
            sample["aux_hidden_states"] = select_layers(sample["aux_hidden_states"], stored, wanted,
                                                        self.spec.hidden_size)
        if self.target_p_mode is not None:
            sample["target_p"] = self._target_p(sample, self.target_p_mode)
        return sample

    def target_p(self, index: int, tail: str = "spread") -> torch.Tensor:
        """EAGLE-3's target distribution over the draft vocabulary, fp32 [T, Vd], unshifted.

        --supervision draft: exp(draft_logprobs). draft-topk: rebuilt from the sparse fields
        (`supervision.dense_target_p`): the tail mass spread evenly over the other draft ids
        ("spread"), left out ("drop": rows sum to 1 - tail) or left out with the top-k scaled
        to sum to 1 ("renormalize")."""
        return self._target_p(self.raw(index), tail)

    def _target_p(self, sample: dict[str, torch.Tensor], tail: str) -> torch.Tensor:
        if "draft_logprobs" in sample:
            return sample["draft_logprobs"].float().exp()
        if "draft_topk_lengths" in sample:  # --keep-mass: a different k per token
            return dense_target_p_ragged(sample["draft_topk_lengths"], sample["draft_topk_ids"],
                                         sample["draft_topk_logprobs"], sample["draft_topk_tail"],
                                         self.spec.draft_size, tail)
        if "draft_topk_ids" in sample:
            return dense_target_p(sample["draft_topk_ids"], sample["draft_topk_logprobs"],
                                  sample["draft_topk_tail"], self.spec.draft_size, tail)
        raise UserError(f"{self.root} stores --supervision {self.spec.kind} ({self.layout.name} "
                        "format), which has no draft distribution",
                        "extract with --supervision draft or draft-topk (and --draft-vocab)")

    def nemo_inputs(self, index: int, tail: str = "spread") -> dict[str, torch.Tensor]:
        """Sample `index` as NeMo AutoModel's `Eagle3TrainerModule.forward` takes it, unpadded:
        `store.nemo.trainer_frame` of the native draft / draft-topk fields (`target_p(i, tail)`
        shifted into NeMo's frame). Batch with `nemo_collate`."""
        if self.layout.name != "native" or self.spec.kind not in ("draft", "draft-topk"):
            raise UserError(f"{self.root} is a {self.layout.name} dataset of --supervision {self.spec.kind}; "
                            "nemo_inputs needs the native format with --supervision draft or draft-topk",
                            "re-extract with --format native --supervision draft (or draft-topk) "
                            "--draft-vocab FILE, or read a --format nemo cache with NeMo's CachedEagle3Dataset")
        s = self[index]
        return trainer_frame(s["input_ids"], s["loss_mask"], s["aux_hidden_states"], self._target_p(s, tail),
                             s["argmax_in_draft"])

    @staticmethod
    def nemo_collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-pad `nemo_inputs` samples into `Eagle3TrainerModule.forward` kwargs (int64
        attention_mask, as NeMo's cache reader gives it); padded rows are zero and unsupervised."""
        out = DraftDataset.collate(batch)
        out["attention_mask"] = out["attention_mask"].to(torch.int64)
        return out

    def keep_mass_stats(self) -> tuple[float, int, int]:
        """--keep-mass datasets: (mean kept k, tokens that hit the cap, tokens) over every shard.

        A token hit the cap when its k ids (k = --k) hold less than the kept mass, decided as the
        writer decided it (`supervision.keep_mass_lengths` on the stored log-probs)."""
        if not self.layout.ragged:
            raise UserError(f"{self.root} keeps a fixed k = {self.spec.k} per token", "extract with --keep-mass P")
        return keep_mass_stats(self.root, self.shards, self.spec, self._h())

    def length(self, index: int) -> int:
        """Token count of sample `index` (unpadded)."""
        rec, local = self._locate(index)
        if self.layout.name == "native":

            h = _safe_open(self.root / rec["files"][0]["path"], self._h())
            off = h.get_slice("offsets")[local: local + 2]
            return int(off[1] - off[0])
        if self.layout.name == "nemo":
            return int(self.raw(index)["attention_mask"].sum())
        if self.layout.name == "nemo-dspark":  # no attention mask: the lengths are in the manifest
            return int(rec["lengths"][local])
        return int(self.raw(index)["token_ids" if self.layout.name == "speculators" else "input_ids"].numel())

    def sample_plan(self, index: int) -> SamplePlan:
        """The tokenised input of sample `index` (what the engine was given)."""
        rec, local = self._locate(index)
        line = int(rec.get("lines", [0] * (local + 1))[local])
        t = self.raw(index)
        if self.layout.name == "native":
            ids, mask = t["input_ids"], t["loss_mask"]
        elif self.layout.name == "speculators":
            ids, mask = t["token_ids"], t["loss_mask"]
        elif self.layout.name == "specforge":
            ids, mask = t["input_ids"], t["loss_mask"]
        elif self.layout.name == "nemo-dspark":  # unshifted, padded to seq_length
            n = int(rec["lengths"][local])
            ids, mask = t["input_ids"][:n], t["loss_mask"][:n]
        else:
            n = int(t["attention_mask"].sum())
            first = torch.tensor([int(rec["first_tokens"][local])], dtype=torch.int64)
            ids = torch.cat([first, t["input_ids"][: n - 1]])
            # Position 0's loss flag is shifted out of NeMo's frame; any value encodes the same.
            mask = torch.cat([torch.zeros(1, dtype=torch.int64), t["loss_mask"][: n - 1]])
        return SamplePlan(index, line, ids.to(torch.int64).tolist(), mask.to(torch.int64).tolist())

    @staticmethod
    def collate(batch: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-pad native samples to the longest one; adds `attention_mask` [B, T] (bool).

        Padded rows are zero (`pad_id` for input_ids, False for masks), so `loss_mask` keeps
        them out of any loss. Ragged draft top-k samples (--keep-mass): `draft_topk_lengths` is
        padded with 0, so the kept ids and log-probs, joined sample after sample, stay 1-d and
        in row-major order of the padded `[B, T]` lengths.
        """
        lengths = [b["input_ids"].shape[0] for b in batch]
        T = max(lengths)
        out: dict[str, torch.Tensor] = {}
        ragged = "draft_topk_lengths" in batch[0]
        for name in batch[0]:
            first = batch[0][name]
            if ragged and name in ("draft_topk_ids", "draft_topk_logprobs"):
                out[name] = torch.cat([b[name] for b in batch])
                continue
            full = torch.full((len(batch), T, *first.shape[1:]), pad_id if name == "input_ids" else 0,
                              dtype=first.dtype)
            for i, b in enumerate(batch):
                full[i, : lengths[i]] = b[name]
            out[name] = full
        mask = torch.zeros(len(batch), T, dtype=torch.bool)
        for i, n in enumerate(lengths):
            mask[i, :n] = True
        out["attention_mask"] = mask
        return out

    def __repr__(self) -> str:
        return (f"DraftDataset({str(self.root)!r}, layout={self.layout.name}, kind={self.spec.kind}, "
                f"samples={self._len})")


Eagle3Dataset = DraftDataset  # its name before draft types; every EAGLE-3 dataset reads as it did
