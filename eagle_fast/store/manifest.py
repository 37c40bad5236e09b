"""The dataset manifest, crash-safe file writes and checksums.

A dataset directory is a set of immutable shard files plus one JSON manifest that says what
they are. Design:
  - Every file is written to a temp name in the same directory, fsynced, renamed over the
    final name, and the directory is fsynced: a file under its final name is complete.
  - The manifest is the only source of truth for which shards are done. It is rewritten
    (atomically) after each finished shard, so a run killed at any instant leaves a
    manifest that lists only complete, checksummed shards; the next run redoes the rest.
  - `settings` holds everything that shapes shard bytes (model weights and config, tokenizer,
    data file, engine, dtypes, aux layers, supervision, draft vocabulary, max length, shard
    size, layout). Resume and merge refuse when any of it differs, naming the keys.
  - Per shard: samples, tokens, bytes, sha256 of the whole file, and sha256 of its
    safetensors header. Readers check size + header hash on open (cheap); `verify` or
    `Eagle3Dataset(..., verify="full")` re-hashes the whole file.
  - `--shard I/N` runs write `manifest.part-I-of-N.json`; `eagle-fast merge` turns complete
    parts into the one `manifest.json`.
Limits: the manifest lists shards inline, which stays small up to tens of thousands of
shards; volatile run statistics live under "runs" and are excluded from comparisons.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle_fast.errors import UserError
from eagle_fast.files import (
    read_json,
    read_safetensors_header,
    sha256_bytes,
    sha256_file,
)

FORMAT_NAME = "eagle-fast"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PART_RE = re.compile(r"^manifest\.part-(\d+)-of-(\d+)\.json$")
# Top-level keys that describe one particular invocation, not the dataset's content.
VOLATILE_KEYS = ("runs",)


def file_record(path: str | os.PathLike, root: str | os.PathLike) -> dict:
    """Size and checksums of one written file, as the manifest stores them."""
    p = Path(path)
    rec = {
        "path": p.relative_to(root).as_posix(),
        "bytes": p.stat().st_size,
        "sha256": sha256_file(p),
    }
    if p.suffix == ".safetensors":
        rec["header_sha256"] = sha256_bytes(read_safetensors_header(p)[1])
    return rec


def check_file_cheap(root: Path, rec: dict) -> str | None:
    """None if `rec`'s file exists with the recorded size and header hash, else the reason."""
    p = root / rec["path"]
    if not p.exists():
        return f"{rec['path']} is missing"
    size = p.stat().st_size
    if size != rec["bytes"]:
        return f"{rec['path']} has {size} bytes, the manifest says {rec['bytes']}"
    if "header_sha256" in rec:
        try:
            raw = read_safetensors_header(p)[1]
        except ValueError as exc:
            return str(exc)
        if sha256_bytes(raw) != rec["header_sha256"]:
            return f"{rec['path']} has a different safetensors header than the manifest records"
    return None


def check_file_full(root: Path, rec: dict) -> str | None:
    reason = check_file_cheap(root, rec)
    if reason is None and sha256_file(root / rec["path"]) != rec["sha256"]:
        reason = f"{rec['path']} fails its sha256 checksum (corrupted or modified)"
    return reason


# -------------------------------------------------------------------------- manifests


def part_manifest_name(index: int, count: int) -> str:
    return f"manifest.part-{index}-of-{count}.json"


def manifest_name(part: tuple[int, int] | None) -> str:
    return MANIFEST_NAME if part is None or part[1] == 1 else part_manifest_name(*part)


def load_json(path: Path) -> dict:
    """A manifest file's JSON; a UserError naming the file when it is not JSON."""
    return read_json(path, "restore it from a backup, or delete the dataset directory and extract again")


def eagle_section(manifest: dict) -> dict:
    """Our manifest inside whatever the layout's manifest file holds.

    The native layout's manifest IS our manifest. The nemo layout's manifest.json must be
    NeMo AutoModel's (its reader checks `format_version == 2` and reads top-level fields), so
    ours lives under its "eagle_fast" key there.
    """
    if manifest.get("format") == FORMAT_NAME:
        return manifest
    inner = manifest.get("eagle_fast")
    if isinstance(inner, dict) and inner.get("format") == FORMAT_NAME:
        return inner
    raise KeyError("no eagle-fast manifest")


def read_manifest(directory: str | os.PathLike, name: str = MANIFEST_NAME) -> dict:
    """Read and validate our manifest (the eagle-fast section) from `directory/name`."""
    root = Path(directory)
    path = root / name
    if not root.is_dir():
        raise UserError(f"{root} is not a directory", "pass the --out directory of an extraction")
    if not path.exists():
        parts = sorted(p.name for p in root.glob("manifest.part-*-of-*.json"))
        if parts and name == MANIFEST_NAME:
            raise UserError(
                f"{root} holds only per-node parts ({', '.join(parts)}), no merged manifest",
                f"run `eagle-fast merge {root}` once every node has finished",
            )
        raise UserError(
            f"{path} not found: {root} is not an eagle-fast dataset (or its extraction never started)",
            "point at the --out directory of `eagle-fast extract`",
        )
    raw = load_json(path)
    try:
        ours = eagle_section(raw)
    except KeyError:
        raise UserError(
            f"{path} was not written by eagle-fast",
            "point at a directory written by `eagle-fast extract`",
        ) from None
    version = ours.get("format_version")
    if version != FORMAT_VERSION:
        raise UserError(
            f"{path} has eagle-fast format_version {version}; this eagle-fast reads {FORMAT_VERSION}",
            "re-extract with this version of eagle-fast, or install the version that wrote it",
        )
    for key in ("settings", "layout", "num_samples", "num_shards", "shards"):
        if key not in ours:
            raise UserError(f"{path} lacks the field {key!r}", "re-extract the dataset")
    return ours


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def diff_settings(old: dict, new: dict) -> list[str]:
    """Human-readable differences `key: old -> new` between two settings dicts."""
    a, b = flatten(old), flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {_short(a.get(key))} -> {_short(b.get(key))}")
    return out


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:18] + "..." + s[-18:]


def without_volatile(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in VOLATILE_KEYS}


def shard_index_map(manifest: dict) -> dict[int, dict]:
    return {int(s["index"]): s for s in manifest.get("shards", [])}


def part_slice(num_shards: int, part: tuple[int, int] | None) -> range:
    """The contiguous block of global shard indices node `part=(I, N)` owns.

    The first `num_shards % N` nodes take one extra shard (as NeMo AutoModel's
    `partition_cache_shards` does), so every shard has exactly one owner.
    """
    if part is None:
        return range(num_shards)
    index, count = part
    base, extra = divmod(num_shards, count)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def list_part_manifests(directory: Path) -> list[tuple[int, int, Path]]:
    out = []
    for p in sorted(directory.glob("manifest.part-*-of-*.json")):
        m = PART_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), p))
    return out


def iter_files(manifest: dict) -> Iterable[dict]:
    for shard in manifest.get("shards", []):
        yield from shard.get("files", [])
    yield from manifest.get("extra_files", [])


def record_dirs(directory: str | os.PathLike) -> list[str]:
    """The dataset directories under `directory`: itself, or for an extraction of several records
    (layout "multi", store/multi.py) each record's subdirectory, in the manifest's order."""
    m = read_manifest(Path(directory))
    if m["layout"] != "multi":
        return [str(directory)]
    return [str(Path(directory) / p["dir"]) for p in m["parts"]]
