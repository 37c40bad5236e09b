"""Crash-safe file writes, checksums and safetensors headers: the file primitives every stage uses.

A file is written to a temp name in the same directory, fsynced, renamed over the final name,
and the directory is fsynced: a file under its final name is complete (POSIX rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from eagle_fast.errors import UserError

# A file written by another process (vLLM's engine writes captures): it is written under
# `name + PARTIAL_SUFFIX` and renamed into place, and a failed write leaves `name + FAILED_SUFFIX`
# holding the cause (runners/connector.py writes, runners/_vllm_compat.py reads).
PARTIAL_SUFFIX = ".part"
FAILED_SUFFIX = ".failed"


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory entry (a rename or a new file) on POSIX filesystems."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def temp_path_for(path: str | os.PathLike, tag: str = "") -> Path:
    """The temp name a file is written under before its atomic rename (same directory).

    Hidden (leading dot) so no reader globbing for shards picks it up; `tag` keeps writers
    of the same file on different nodes (a shared sidecar) from sharing a temp file.
    """
    p = Path(path)
    return p.with_name(f".{p.name}.{tag}.tmp" if tag else f".{p.name}.tmp")


def commit_temp(tmp: Path, final: Path) -> None:
    """fsync `tmp`, rename it over `final`, fsync the directory."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, tag: str = "") -> Path:
    """Write `data` to `path` through its temp file (`temp_path_for(path, tag)`); returns `path`."""
    final = Path(path)
    tmp = temp_path_for(final, tag)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def canonical_json(obj: Any) -> str:
    """Deterministic JSON (sorted keys, fixed indent): equal content gives equal bytes."""
    return json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=True) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, canonical_json(obj).encode())


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 23) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, bytes]:
    """(parsed header, raw header bytes) of a safetensors file, reading only the header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * (1 << 20):
            raise ValueError(f"{path}: not a safetensors file (header size {n})")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError(f"{path}: truncated safetensors header")
    return json.loads(raw.decode()), raw


def read_json(path: Path, fix: str) -> Any:
    """The JSON in `path`; a UserError naming the file, the parse error and `fix` when it is
    not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})", fix) from None
