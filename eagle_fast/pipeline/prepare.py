"""The dataset directory an extraction writes, as a run grows it.

`DatasetDir(plan)` holds the manifest (a copy of the plan's, which resolve made: fresh, or the
existing one's complete shards) and rewrites it atomically on every change; it writes the
layout's sidecar files once per directory and adds the layout's extras once the whole dataset is
complete. `clean_temps` removes the temp files a killed run left. Nothing here checks a setting:
the plan is resolved.
"""

from __future__ import annotations

import copy
from pathlib import Path

from eagle_fast.files import atomic_write_json, temp_path_for
from eagle_fast.pipeline.config import ExtractPlan
from eagle_fast.store.layouts import Layout, SidecarContext
from eagle_fast.store.manifest import check_file_cheap, manifest_name, part_slice
from eagle_fast.store.multi import MultiLayout
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
        write_manifests(p.root, m, p.layout, sidecar_context(p), p.part)

    def _write_extra_files(self) -> None:
        """Sidecar files written once per directory (`Layout.write_sidecars`): the draft vocabulary
        (ours, and in the trainer's own format for speculators and SpecForge), NeMo's embeddings."""
        p = self.plan
        have = {f["path"]: f for f in self.manifest.get("extra_files", []) if check_file_cheap(p.root, f) is None}
        for rec in p.layout.write_sidecars(p.root, set(have), sidecar_context(p)):
            have[rec["path"]] = rec
        self.manifest["extra_files"] = [have[k] for k in sorted(have)]

    def _finalize(self) -> None:
        """Layout extras once the whole dataset (not a part) is complete."""
        p = self.plan
        if p.part is None and self.manifest["complete"]:
            p.layout.finalize(p.root, self.manifest, lambda: [(s.input_ids, s.loss_mask) for s in p.inputs.samples])


def sidecar_context(p: ExtractPlan) -> SidecarContext:
    """What the plan's sidecar files are made from (`Layout.write_sidecars`)."""
    v = DraftVocab(p.draft_ids, p.target.info.vocab_size) if p.draft_ids is not None else None
    return SidecarContext(draft_ids=p.draft_ids, d2t=None if v is None else v.d2t(), t2d=None if v is None else v.t2d(),
                          vocab_size=p.target.info.vocab_size, model_dir=p.target.model,
                          model_id=p.target.info.model_id, tag=_part_tag(p))


def write_manifests(root: Path, m: dict, layout: Layout, ctx: SidecarContext, part) -> None:
    """`m` as this directory's manifest (a part's: manifest.part-I-of-N.json); for the whole dataset,
    as its layout writes it (NeMo's, ours inside), and each record's own when it holds several."""
    if part is not None:
        atomic_write_json(root / manifest_name(part), m)
        return
    if isinstance(layout, MultiLayout):
        layout.write_part_manifests(root, m, ctx, atomic_write_json)
    atomic_write_json(root / manifest_name(None), layout.manifest_body(m, ctx))


def clean_temps(p: ExtractPlan) -> None:
    """Remove this node's leftovers of a killed run (temp files of pending shards only)."""
    names = [manifest_name(p.part)]
    if isinstance(p.layout, MultiLayout) and p.part is None:
        names += [f"{d}/{manifest_name(None)}" for d, _ in p.layout.parts]
    for s in p.pending:
        names += p.layout.shard_paths(s)
    tmps = [temp_path_for(p.root / rel) for rel in names]
    tmps += [temp_path_for(p.root / rel, _part_tag(p)) for rel in p.layout.sidecar_names(sidecar_context(p))]
    for tmp in tmps:
        if tmp.exists():
            tmp.unlink()


def _part_tag(p: ExtractPlan) -> str:
    return f"part{p.part[0]}of{p.part[1]}" if p.part else ""
