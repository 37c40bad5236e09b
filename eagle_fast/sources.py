"""What `--data` names, read as rows: a jsonl file, a JSON array, parquet or Arrow files (one, a
directory of them, or a glob), or a directory `datasets` wrote with `save_to_disk`.

`open_source(path)` finds the form and its files; `table_rows(source)` yields (row number from 1,
object) for the non-jsonl forms (a jsonl file is read line by line by `inputs`, which keeps its
byte-level checks). A table's null fields are dropped from its rows (a column the row does not
use), so every form of one row set gives the same records. `digest` hashes every file's bytes,
in name order, with its name: what manifests record as the data's sha256.
Limits: the rows are read whole (as jsonl is); Hub dataset ids, column renaming and mixing
several sources are not here yet.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_fast.errors import UserError

TABLE_SUFFIXES = (".parquet", ".arrow")
_FIX = ("pass --data as a jsonl file, a .json array, parquet / Arrow files (a file, a directory or a glob), "
        "or a directory written by datasets' save_to_disk")


@dataclass(frozen=True)
class Source:
    path: str           # as given
    kind: str           # jsonl | json | table | saved
    files: tuple[Path, ...]

    def digest(self) -> str:
        if self.kind == "jsonl":
            return hashlib.sha256(self.files[0].read_bytes()).hexdigest()
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
        return h.hexdigest()


def jsonl_lines(src: Source) -> tuple[list[bytes], str]:
    """A jsonl source's lines (bytes; the final newline ends the last line, it starts none) and
    the file's sha256, read once; UserError for an empty file."""
    data = src.files[0].read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if not lines:
        raise UserError(f"data file {src.files[0]} is empty", "give it one JSON object per line")
    return lines, hashlib.sha256(data).hexdigest()


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


def table_rows(src: Source) -> Iterator[tuple[int, Any]]:
    """(row number from 1, row) of a json / table / saved source; a table row's nulls dropped."""
    if src.kind == "json":
        try:
            rows = json.loads(src.files[0].read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{src.path}: not a valid JSON array ({exc})", "save it as one JSON array of row "
                            "objects, or as jsonl") from None
        if not isinstance(rows, list):
            raise UserError(f"{src.path}: the JSON holds a {type(rows).__name__}, not an array of rows",
                            "save it as one JSON array of row objects, or as jsonl")
        yield from enumerate(rows, 1)
        return
    for n, row in enumerate(_table_dicts(src), 1):
        yield n, {k: v for k, v in row.items() if v is not None} if isinstance(row, dict) else row


def _table_dicts(src: Source) -> Iterator[dict]:
    if src.kind == "saved":
        from datasets import load_from_disk

        yield from load_from_disk(src.path)
        return
    import pyarrow.parquet as pq
    from pyarrow import ipc

    for f in src.files:
        if f.suffix == ".parquet":
            table = pq.read_table(f)
        else:
            try:
                table = ipc.open_file(f).read_all()
            except Exception:  # noqa: BLE001 -- not the file format: the stream format datasets writes
                table = ipc.open_stream(f).read_all()
        yield from table.to_pylist()
