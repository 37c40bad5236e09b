"""Several records from one capture: one dataset directory per record, under one --out.

An extraction asked for several draft types or formats whose trainers cannot share one record
(`draft_types.resolve_records`) writes each record into its own subdirectory, as a dataset of its
own: its layout's shard files, sidecar files and manifest (`part_manifest`, derived from --out's),
so each trainer, `verify`, `inspect` and `DraftDataset` read one subdirectory as they would a
dataset extracted alone. `MultiLayout` is the layout of --out: it encodes every record of a sample
from the one result (the union of the layers, the final state before and after the norm as the
records read it, and the head fields the records ask for, computed once), writes a shard into
every subdirectory, and commits the shard when every record's files are on disk. --out's manifest
(layout "multi") lists each shard's files under their subdirectories and stays the one source of
truth for resume, merge and Ray.
Limits: one head call serves every record (one --supervision, --k and --draft-vocab), in fp32
when the records' stored dtypes differ; `--head-in-worker` is refused.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from eagle_fast.store.layouts import Layout, ShardSink, SidecarContext


class MultiLayout(Layout):
    name = "multi"

    def __init__(self, spec, parts: list[tuple[str, Layout]]):
        super().__init__(spec)
        self.parts = parts  # (subdirectory, layout) per record

    def head_outputs(self):
        outputs = [o for _, p in self.parts for o in (p.head_outputs() or ())]
        return tuple(dict.fromkeys(outputs)) or None

    def head_fields(self):
        return tuple(dict.fromkeys(f for _, p in self.parts for f in p.head_fields()))

    def head_out_dtype(self) -> torch.dtype:
        dtypes = {p.head_out_dtype() for _, p in self.parts if p.head_outputs()}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32

    def final_states(self):
        return set().union(*(p.final_states() for _, p in self.parts))

    def fields(self):
        return {f"{d}/{name}": f for d, p in self.parts for name, f in p.fields().items()}

    def encode(self, sample, result):
        return {d: p.encode(sample, result) for d, p in self.parts}

    def shard_paths(self, shard):
        return [f"{d}/{path}" for d, p in self.parts for path in p.shard_paths(shard)]

    def open_shard(self, root, shard):
        sinks = []
        try:
            for d, p in self.parts:
                (root / d).mkdir(parents=True, exist_ok=True)
                sinks.append((d, p.open_shard(root / d, shard)))
        except BaseException:
            for _, sink in sinks:
                sink.abort()
            raise
        return MultiSink(root, sinks)

    def read_sample(self, root, shard_record, local_index, handles=None):
        raise TypeError("a multi-record dataset is read one record at a time: open one of its subdirectories")

    def shard_extras(self, shard):
        out: dict = {}
        for _, p in self.parts:
            out.update(p.shard_extras(shard))
        return out

    def sidecar_names(self, ctx):
        return [f"{d}/{name}" for d, p in self.parts for name in p.sidecar_names(ctx)]

    def write_sidecars(self, root, have, ctx):
        out = []
        for d, p in self.parts:
            (root / d).mkdir(parents=True, exist_ok=True)
            mine = {name[len(d) + 1:] for name in have if name.startswith(d + "/")}
            out += [prefixed(rec, d) for rec in p.write_sidecars(root / d, mine, ctx)]
        return out

    def write_part_manifests(self, root: Path, m: dict, ctx: SidecarContext, write_json) -> None:
        """Each record's own manifest (`part_manifest`) into its subdirectory, through `write_json(path, body)`."""
        for i, (d, p) in enumerate(self.parts):
            (root / d).mkdir(parents=True, exist_ok=True)
            write_json(root / d / "manifest.json", p.manifest_body(part_manifest(m, i), ctx))

    def finalize(self, root, m, pairs=None):
        for i, (d, p) in enumerate(self.parts):
            p.finalize(root / d, part_manifest(m, i), pairs)


class MultiSink(ShardSink):
    """One shard of every record: committed once each record's sink has committed."""

    def __init__(self, root: Path, sinks: list[tuple[str, ShardSink]]):
        super().__init__(root)
        self.sinks = sinks

    def write(self, local_index, encoded):
        for d, sink in self.sinks:
            sink.write(local_index, encoded[d])

    def commit(self):
        return [prefixed(rec, d) for d, sink in self.sinks for rec in sink.commit()]

    def abort(self):
        for _, sink in self.sinks:
            sink.abort()


def prefixed(rec: dict, subdir: str) -> dict:
    """A file record of `subdir` as --out's manifest holds it."""
    return {**rec, "path": f"{subdir}/{rec['path']}"}


def part_manifest(m: dict, index: int) -> dict:
    """Record `index`'s own manifest, from --out's (layout "multi"): its layout, spec, fields, layers
    and draft types, and the shard and sidecar files under its subdirectory, relative to it."""
    part = m["parts"][index]
    d = part["dir"] + "/"
    out = copy.deepcopy({k: v for k, v in m.items() if k not in ("parts", "shards", "extra_files")})
    out.update({k: copy.deepcopy(v) for k, v in part.items() if k != "dir"})
    out["settings"] = {**out["settings"], "layout": part["layout"]}
    out["shards"] = [{**{k: v for k, v in rec.items() if k != "files"},
                      "files": [{**f, "path": f["path"][len(d):]} for f in rec["files"] if f["path"].startswith(d)]}
                     for rec in m["shards"]]
    out["extra_files"] = [{**f, "path": f["path"][len(d):]} for f in m.get("extra_files", [])
                          if f["path"].startswith(d)]
    out["record_of"] = {"dir": "..", "subdir": part["dir"]}
    return out
