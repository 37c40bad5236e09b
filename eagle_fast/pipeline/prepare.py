"""The dataset directory an extraction writes, as a run grows it.

`DatasetDir(plan)` holds the manifest (a copy of the plan's, which resolve made: fresh, or the
existing one's complete shards) and rewrites it atomically on every change; it writes the
layout's sidecar files once per directory and adds the layout's extras once the whole dataset is
complete. `clean_temps` removes the temp files a killed run left. Nothing here checks a setting:
the plan is resolved.
"""

from __future__ import annotations

import copy

import torch

from eagle_fast.files import atomic_write_json, temp_path_for
from eagle_fast.pipeline.config import ExtractPlan
from eagle_fast.store.manifest import check_file_cheap, file_record, manifest_name, part_slice
from eagle_fast.store.nemo import nemo_manifest_fields, write_target_embeddings
from eagle_fast.store.safetensors import write_safetensors
from eagle_fast.store.specforge import VOCAB_MAPPING, write_vocab_mapping
from eagle_fast.store.speculators import (
    vocab_file_names,
    write_speculators_arrow,
    write_speculators_vocab,
)
from eagle_fast.vocab import DraftVocab


class DatasetDir:
    """--out of one run: the plan's directory and the manifest as the run grows it."""

    def __init__(self, plan: ExtractPlan):
        self.plan = plan
        self.manifest = copy.deepcopy(plan.manifest)

    def open(self) -> None:
        """Before any engine starts: a killed run's temp files removed, the manifest written first
        (so even a run killed now leaves a directory we recognise), then the sidecar files."""
        clean_temps(self.plan)
        self._write_manifest()
        self._write_extra_files()
        self._write_manifest()

    def close(self, run: dict | None = None) -> None:
        """The run's record (None: nothing ran) joins the manifest; the layout's extras follow once
        the whole dataset is complete."""
        if run is not None:
            self.manifest["runs"].append(run)
            self._write_manifest()
        self._finalize()

    def committed(self) -> set[int]:
        """The shards complete on disk: the plan's and this run's."""
        return {int(r["index"]) for r in self.manifest["shards"]}

    def record_shard(self, rec: dict) -> None:
        """A committed shard joins the manifest, which is rewritten (atomically) at once."""
        self.manifest["shards"].append(rec)
        self._write_manifest()

    def _write_manifest(self) -> None:
        p, m = self.plan, self.manifest
        m["shards"] = sorted(m["shards"], key=lambda r: r["index"])
        owned = list(part_slice(len(p.shards), p.part))
        m["complete"] = len(m["shards"]) == len(owned)
        name = manifest_name(p.part)
        if p.layout.name == "nemo" and p.part is None:
            body = nemo_manifest_fields(p.spec, model_id=p.target.info.model_id, data_path=m["data"]["path"],
                                        num_samples=m["num_samples"], shard_size=m["shard_size"],
                                        aux_layer_ids=list(p.target.aux_layer_ids),
                                        draft_ids=None if p.draft_ids is None else p.draft_ids.tolist())
            body["eagle_fast"] = m
            atomic_write_json(p.root / name, body)
        else:
            atomic_write_json(p.root / name, m)

    def _write_extra_files(self) -> None:
        """Sidecar files written once per directory: the draft vocabulary (ours, and in the trainer's
        own format for speculators and SpecForge), NeMo's embeddings."""
        p = self.plan
        have = {f["path"] for f in self.manifest.get("extra_files", [])
                if check_file_cheap(p.root, f) is None}
        extra = [f for f in self.manifest.get("extra_files", []) if f["path"] in have]
        tag = _part_tag(p)
        v = DraftVocab(p.draft_ids, p.target.info.vocab_size) if p.draft_ids is not None else None
        if v is not None and "draft_vocab.safetensors" not in have:
            path = write_safetensors(p.root / "draft_vocab.safetensors", {
                "d2t": v.d2t(), "t2d": v.t2d(), "selected_token_ids": v.ids.clone(),
                "target_vocab_size": torch.tensor([v.target_vocab_size], dtype=torch.int64)}, tag=tag)
            extra.append(file_record(path, p.root))
        if v is not None and p.layout.name == "speculators" and not set(vocab_file_names(v.size)) <= have:
            extra = [f for f in extra if f["path"] not in vocab_file_names(v.size)]
            extra += write_speculators_vocab(p.root, v.d2t(), v.t2d(), tag=tag)
        if v is not None and p.layout.name == "specforge" and VOCAB_MAPPING not in have:
            extra.append(write_vocab_mapping(p.root, v.d2t(), v.t2d(), tag=tag))
        if p.layout.name == "nemo" and "target_embeddings.safetensors" not in have:
            extra.append(write_target_embeddings(p.root, p.target.model, tag=tag))
        self.manifest["extra_files"] = sorted(extra, key=lambda f: f["path"])

    def _finalize(self) -> None:
        """Layout extras once the whole dataset (not a part) is complete."""
        p = self.plan
        if p.layout.name == "speculators" and p.part is None and self.manifest["complete"]:
            write_speculators_arrow(p.root, [(s.input_ids, s.loss_mask) for s in p.inputs.samples])


def clean_temps(p: ExtractPlan) -> None:
    """Remove this node's leftovers of a killed run (temp files of pending shards only)."""
    names = [manifest_name(p.part)]
    for s in p.pending:
        names += p.layout.shard_paths(s)
    tmps = [temp_path_for(p.root / rel) for rel in names]
    tmps += [temp_path_for(p.root / rel, _part_tag(p)) for rel in _extra_file_names(p)]
    for tmp in tmps:
        if tmp.exists():
            tmp.unlink()


def _part_tag(p: ExtractPlan) -> str:
    return f"part{p.part[0]}of{p.part[1]}" if p.part else ""


def _extra_file_names(p: ExtractPlan) -> list[str]:
    """The sidecar files this directory gets (`DatasetDir._write_extra_files`)."""
    names = ["draft_vocab.safetensors", "target_embeddings.safetensors"]
    if p.draft_ids is not None and p.layout.name == "speculators":
        names += list(vocab_file_names(int(p.draft_ids.numel())))
    if p.draft_ids is not None and p.layout.name == "specforge":
        names.append(VOCAB_MAPPING)
    return names
