"""What `--data` names, read as rows: a jsonl file, a JSON array, parquet or Arrow files (one, a
directory of them, or a glob), or a directory `datasets` wrote with `save_to_disk`.

`open_source(path)` finds the form and its files; `iter_rows(source, keep)` streams its rows
(a jsonl line's bytes, for `inputs`' byte-level checks; a table's rows a batch at a time, each
with the file and row an error names); `survey` counts them (a table's metadata) and hashes them. A table's null
fields are dropped from its rows (a column the row does not use), so every form of one row set
gives the same records. `digest` hashes every file's bytes, in name order, with its name: what
manifests record as the data's sha256. Several sources, their mix and column names: `mixing`.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_fast.errors import UserError

TABLE_SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 1024  # rows decoded at a time from a table
_FIX = ("pass --data as a jsonl file, a .json array, parquet / Arrow files (a file, a directory or a glob), "
        "or a directory written by datasets' save_to_disk")


@dataclass(frozen=True)
class Source:
    path: str           # as given
    kind: str           # jsonl | json | table | saved
    files: tuple[Path, ...]

    def digest(self) -> str:
        if self.kind == "jsonl":
            return _file_sha256(self.files[0]).hexdigest()
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode() + b"\0" + _file_sha256(f).digest())
        return h.hexdigest()


def _file_sha256(f: Path):
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h


def open_source(path: str | Path) -> Source:
    """The form of `path` and the files it reads (UserError when it is none of the forms)."""
    text = str(path)
    p = Path(path)
    if any(c in text for c in "*?[") and not p.exists():
        files = tuple(sorted(Path(f) for f in glob.glob(text) if f.endswith(TABLE_SUFFIXES)))
        if not files:
            raise UserError(f"--data {text}: the pattern matches no .parquet or .arrow file", _FIX)
        return Source(text, "table", files)
    if p.is_dir():
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            return Source(text, "saved", tuple(sorted(q for q in p.iterdir() if q.suffix == ".arrow")))
        files = tuple(sorted(q for q in p.iterdir() if q.suffix in TABLE_SUFFIXES))
        if not files:
            raise UserError(f"--data {text} is a directory with no .parquet or .arrow file and no save_to_disk "
                            "dataset", _FIX)
        return Source(text, "table", files)
    if not p.is_file():
        raise UserError(f"data file {p} not found", "pass --data FILE.jsonl (one JSON object per line)")
    if p.suffix in TABLE_SUFFIXES:
        return Source(text, "table", (p,))
    if p.suffix == ".json" and _starts_array(p):
        return Source(text, "json", (p,))
    return Source(text, "jsonl", (p,))


def _starts_array(p: Path) -> bool:
    with open(p, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def survey(src: Source) -> tuple[int, str]:
    """(rows, digest) of `src`, reading a jsonl file once for both."""
    if src.kind != "jsonl":
        return count_rows(src), src.digest()
    n, last, h = 0, b"\n", hashlib.sha256()
    with open(src.files[0], "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n"), h.hexdigest()


def count_rows(src: Source) -> int:
    """How many rows `src` holds, without decoding them (a table's metadata; a jsonl file's lines)."""
    if src.kind == "jsonl":
        return survey(src)[0]
    if src.kind == "json":
        return len(_json_array(src))
    if src.kind == "saved":
        from datasets import load_from_disk

        return len(load_from_disk(src.path))
    return sum(_file_rows(f) for f in src.files)


def iter_rows(src: Source, keep: set[int] | None = None) -> Iterator[tuple[int, tuple[str, int], Any]]:
    """(row number from 1, (the file, the row in that file) an error names, row) for every row of
    `src`, or those numbered in `keep` (0-based), streamed: a jsonl line as bytes (no newline),
    a table's row as a dict without its nulls (a column the row does not use), so every form of
    one row set gives the same rows."""
    if src.kind == "jsonl":
        with open(src.files[0], "rb") as f:
            for n, raw in enumerate(f, 1):
                if keep is None or n - 1 in keep:
                    yield n, (src.path, n), raw[:-1] if raw.endswith(b"\n") else raw
        return
    if src.kind == "json":
        for n, row in enumerate(_json_array(src), 1):
            if keep is None or n - 1 in keep:
                yield n, (src.path, n), row
        return
    for n, f, local, row in _table_dicts(src, keep):
        where = (str(f), local) if src.kind == "table" and len(src.files) > 1 else (src.path, n)
        yield n, where, {k: v for k, v in row.items() if v is not None} if isinstance(row, dict) else row


def _json_array(src: Source) -> list:
    try:
        rows = json.loads(src.files[0].read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{src.path}: not a valid JSON array ({exc})", "save it as one JSON array of row "
                        "objects, or as jsonl") from None
    if not isinstance(rows, list):
        raise UserError(f"{src.path}: the JSON holds a {type(rows).__name__}, not an array of rows",
                        "save it as one JSON array of row objects, or as jsonl")
    return rows


def _file_rows(f: Path) -> int:
    import pyarrow.parquet as pq

    if f.suffix == ".parquet":
        return pq.ParquetFile(f).metadata.num_rows
    return _arrow_table(f).num_rows


def _arrow_table(f: Path):
    import pyarrow as pa
    from pyarrow import ipc

    source = pa.memory_map(str(f))
    try:
        return ipc.open_file(source).read_all()
    except Exception:  # noqa: BLE001 -- not the file format: the stream format datasets writes
        return ipc.open_stream(pa.memory_map(str(f))).read_all()


def _table_dicts(src: Source, keep: set[int] | None) -> Iterator[tuple[int, Path, int, dict]]:
    """(row of the source from 1, file, row in that file from 1, row) of a table or saved source,
    read a batch at a time; with `keep`, only a batch holding a kept row is decoded."""
    wanted = sorted(keep) if keep is not None else None
    if src.kind == "saved":
        from datasets import load_from_disk

        ds = load_from_disk(src.path)
        for i in range(len(ds)) if wanted is None else wanted:
            yield i + 1, Path(src.path), i + 1, ds[i]
        return
    import pyarrow.parquet as pq

    base = 0
    for f in src.files:
        if f.suffix == ".parquet":
            pf = pq.ParquetFile(f)
            batches, rows = pf.iter_batches(batch_size=BATCH_ROWS), pf.metadata.num_rows
        else:
            table = _arrow_table(f)
            batches, rows = table.to_batches(max_chunksize=BATCH_ROWS), table.num_rows
        local = 0
        for batch in batches:
            lo, hi = base + local, base + local + batch.num_rows
            if wanted is None or bisect.bisect_left(wanted, lo) < bisect.bisect_left(wanted, hi):
                for j, row in enumerate(batch.to_pylist()):
                    if wanted is None or lo + j in keep:
                        yield lo + j + 1, f, local + j + 1, row
            local += batch.num_rows
        base += rows
