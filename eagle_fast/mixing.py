"""What several `--data` give together: the sources, their weights and caps, the column names, and
the draw that picks the rows (`DataSpec`, `draw`).

- `--data SRC[:WEIGHT[:CAP]]`, repeatable (`SRC::CAP` caps without a weight). SRC is any form
  `sources` reads, or a Hub dataset id (`hub.resolve_data`).
- The draw. A source's rows available are min(its rows, CAP). The total is `--max-samples`, or,
  without it, every available row when no weight is given, else the largest total at which every
  source fills its share. Shares follow the weights (no weights: the rows available); a source
  that cannot fill its share gives all it has and the others fill the rest by their weights
  (each source's count says `short`). Which rows a source gives: all of them, or a subset drawn
  with `random.Random(f"{seed}:{source}")`, kept in the source's order. The sources' rows are
  then interleaved evenly (the k-th of n rows of a source sits at (k + 1/2) / n of the way), so
  every shard holds the mix in proportion. All of it depends only on the data and the settings.
- Columns: `--data-columns messages=conversation,...` reads a row's column `conversation` as
  `messages` (the row forms `inputs` knows); a row without that column is read as it is.
- One plain source (no weight, cap, --max-samples or columns) reads exactly as before: every
  row, in order, and the data's sha256 as `sources.Source.digest` gives it. Any other spec's
  digest hashes the sources' digests with the settings, so a changed mix never resumes.
Rows are streamed by `sources.iter_rows` each time a `Draw` is iterated; none is held.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_fast.errors import UserError
from eagle_fast.hub import is_hub_id, resolve_data
from eagle_fast.sources import iter_rows, open_source, survey

KNOWN_COLUMNS = ("messages", "conversations", "text", "input_ids", "loss_mask", "tools", "source_line")
_NUM = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"


@dataclass(frozen=True)
class SourceSpec:
    given: str                 # as typed, without its weight and cap
    path: str                  # what `sources.open_source` reads (a Hub id resolved to its files)
    weight: float | None = None
    cap: int | None = None
    hub: dict | None = None    # hub.DataRef.describe() of a Hub id

    def describe(self) -> dict:
        return {"data": self.given, "path": self.path, "weight": self.weight, "cap": self.cap,
                **({"hub": self.hub} if self.hub else {})}


@dataclass(frozen=True)
class DataSpec:
    sources: tuple[SourceSpec, ...]
    columns: tuple[tuple[str, str], ...] = ()
    max_samples: int | None = None
    seed: int = 0

    @classmethod
    def of(cls, data: str | Path | DataSpec) -> DataSpec:
        return data if isinstance(data, DataSpec) else cls((SourceSpec(str(data), str(data)),))

    @property
    def plain(self) -> bool:
        s = self.sources[0]
        return len(self.sources) == 1 and (s.weight, s.cap, self.max_samples, self.columns) == (None, None, None, ())

    def paths(self) -> list[Path]:
        return [Path(s.path) for s in self.sources]

    def __str__(self) -> str:
        if self.plain:
            return self.sources[0].path
        return " + ".join(s.given + (f":{s.weight:g}" if s.weight is not None else "")
                          + (f"{'' if s.weight is not None else ':'}:{s.cap}" if s.cap is not None else "")
                          for s in self.sources)


def parse_source(text: str) -> tuple[str, float | None, int | None]:
    """`SRC`, `SRC:W`, `SRC:W:CAP` or `SRC::CAP` -> (SRC, W, CAP); a path that exists is SRC as a whole."""
    if Path(text).expanduser().exists():
        return text, None, None
    m = re.fullmatch(rf"(.+?):({_NUM})?:([0-9]+)", text) or re.fullmatch(rf"(.+):({_NUM})()", text)
    if not m:
        return text, None, None
    src, w, cap = m.group(1), m.group(2), m.group(3)
    weight = float(w) if w else None
    if weight is not None and not weight > 0:
        raise UserError(f"--data {text}: the weight must be above 0", "give e.g. --data rows.jsonl:0.4")
    if cap is not None and cap != "" and int(cap) < 1:
        raise UserError(f"--data {text}: the cap must be at least 1 row", "give e.g. --data rows.jsonl:0.4:5000")
    return src, weight, int(cap) if cap else None


def parse_columns(text: str | None) -> tuple[tuple[str, str], ...]:
    """`--data-columns messages=conversation,text=body` -> ((known, column), ...)."""
    if not text:
        return ()
    out = []
    for part in text.split(","):
        known, sep, column = (x.strip() for x in part.partition("="))
        if not sep or not known or not column:
            raise UserError(f"--data-columns {text}: {part!r} is not NAME=COLUMN",
                            "give e.g. --data-columns messages=conversation,text=body")
        if known not in KNOWN_COLUMNS:
            raise UserError(f"--data-columns {text}: {known!r} is not a field eagle-fast reads",
                            f"map one of {', '.join(KNOWN_COLUMNS)}")
        if known in dict(out):
            raise UserError(f"--data-columns {text}: {known!r} is mapped twice", "map each field once")
        out.append((known, column))
    return tuple(out)


def resolve_spec(data: Iterable[str], split: str = "train", config: str | None = None, revision: str | None = None,
                 columns: str | None = None, max_samples: int | None = None, seed: int = 0) -> DataSpec:
    """The spec of the command line's `--data` (each resolved, a Hub id to its files)."""
    parsed = [parse_source(t) for t in data]
    if not parsed:
        raise UserError("no --data given", "pass --data FILE (or several, each SRC[:WEIGHT[:CAP]])")
    if max_samples is not None and max_samples < 1:
        raise UserError(f"--max-samples {max_samples} must be at least 1", "give e.g. --max-samples 100000")
    weighted = [w is not None for _, w, _ in parsed]
    if any(weighted) and not all(weighted):
        raise UserError("some --data have a weight and some do not",
                        "give every source a weight (SRC:W), or none (each then counts by its rows)")
    hub_ids = [src for src, _, _ in parsed if is_hub_id(src)]
    if (revision, config) != (None, None) and not hub_ids:
        raise UserError("--data-revision / --data-config apply to a Hub dataset id, and no --data is one",
                        "drop them, or pass the dataset's Hub id (ORG/NAME)")
    sources = []
    for src, w, cap in parsed:
        hub = src in hub_ids
        ref = resolve_data(src, split, config if hub else None, revision if hub else None)
        sources.append(SourceSpec(src, ref.path, w, cap, ref.describe()))
    if len({s.path for s in sources}) < len(sources):
        raise UserError("one source is given twice in --data", "give each source once (its weight sets its share)")
    return DataSpec(tuple(sources), parse_columns(columns), max_samples, seed)


@dataclass
class Item:
    """One drawn row: its source (index), its row there (from 1; a jsonl line), where an error
    about it points (file, row in that file), and the row (a jsonl line's bytes, or an object)."""

    source: int
    row: int
    where: tuple[str, int]
    payload: Any


class Draw:
    """The rows a spec gives, streamed each time it is iterated (`Item`s in dataset order), with
    the data's digest and each source's counts (rows, available, wanted, drawn, short), known
    before a row is read."""

    def __init__(self, sources: list, keep: list, digest: str, counts: list[dict]):
        self._sources, self._keep = sources, keep
        self.digest, self.counts = digest, counts

    def __len__(self) -> int:
        return sum(c["drawn"] for c in self.counts)

    @property
    def rows_read(self) -> int:
        return sum(c["rows"] for c in self.counts)

    def __iter__(self) -> Iterator[Item]:
        streams = [_items(i, src, keep) for i, (src, keep) in enumerate(zip(self._sources, self._keep))]
        if len(streams) == 1:
            yield from streams[0]
            return
        # the k-th of a source's n rows sits at (k + 1/2) / n of the way: every prefix holds the mix
        for _, i in heapq.merge(*[_slots(i, c["drawn"]) for i, c in enumerate(self.counts)]):
            yield next(streams[i])


def _items(source: int, src, keep: set[int] | None) -> Iterator[Item]:
    for n, where, payload in iter_rows(src, keep):
        yield Item(source, n, where, payload)


def _slots(source: int, n: int) -> Iterator[tuple[float, int]]:
    for k in range(n):
        yield (2 * k + 1) / (2 * n), source


def shares(available: list[int], weights: list[float], total: int) -> list[int]:
    """Rows per source: `total` split by `weights`, none above its `available`; a source that
    cannot fill its share gives all it has and the rest is split among the others (largest
    remainders, ties to the earlier source)."""
    n = [0] * len(available)
    open_ = [i for i in range(len(available)) if available[i] > 0 and weights[i] > 0]
    left = min(total, sum(available[i] for i in open_))
    while open_ and left > 0:
        wsum = sum(weights[i] for i in open_)
        want = {i: left * weights[i] / wsum for i in open_}
        full = [i for i in open_ if want[i] >= available[i]]
        if full:
            for i in full:
                n[i] = available[i]
                left -= available[i]
            open_ = [i for i in open_ if i not in full]
            continue
        base = {i: int(want[i]) for i in open_}
        extra = left - sum(base.values())
        for i in sorted(open_, key=lambda i: (-(want[i] - base[i]), i))[:extra]:
            base[i] += 1
        for i in open_:
            n[i] = base[i]
        break
    return n


def _digest(spec: DataSpec, digests: list[str]) -> str:
    body = {"sources": [[d, s.weight, s.cap] for d, s in zip(digests, spec.sources)],
            "columns": [list(c) for c in spec.columns], "max_samples": spec.max_samples, "seed": spec.seed}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def draw(data: str | Path | DataSpec) -> Draw:
    """The rows `data` gives, in dataset order (module docstring)."""
    spec = DataSpec.of(data)
    opened = [open_source(s.path) for s in spec.sources]
    rows, digests = zip(*(survey(src) for src in opened))  # one read of each source before the rows
    for s, r in zip(spec.sources, rows):
        if r == 0:
            raise UserError(f"--data {s.given} has no rows", "give it at least one row" + ("" if spec.plain else ", or drop it"))
    if spec.plain:
        n = rows[0]
        return Draw(opened, [None], digests[0], [{"rows": n, "available": n, "wanted": n, "drawn": n, "short": False}])
    available = [min(r, s.cap) if s.cap is not None else r for r, s in zip(rows, spec.sources)]
    weights = [s.weight if s.weight is not None else float(a) for s, a in zip(spec.sources, available)]
    if spec.max_samples is not None:
        total = spec.max_samples
    elif spec.sources[0].weight is not None:  # the largest total every source fills its share of
        wsum = sum(weights)
        total = min(int(a * wsum / w + 1e-9) for a, w in zip(available, weights))
    else:
        total = sum(available)
    counts = shares(available, weights, total)
    wanted = shares([total] * len(rows), weights, total)
    keep = [None if n == r else set(random.Random(f"{spec.seed}:{i}").sample(range(r), n))
            for i, (r, n) in enumerate(zip(rows, counts))]
    info = [{"rows": r, "available": a, "wanted": w, "drawn": n, "short": n < w}
            for r, a, w, n in zip(rows, available, wanted, counts)]
    return Draw(opened, keep, _digest(spec, list(digests)), info)


def renamed(obj: Any, columns: tuple[tuple[str, str], ...]) -> Any:
    """A row with its mapped columns read under the names `inputs` knows (a row without a
    mapped column keeps what it has)."""
    if not columns or not isinstance(obj, dict):
        return obj
    obj = dict(obj)
    for known, column in columns:
        if column in obj:
            obj.pop(known, None)
            obj[known] = obj.pop(column)
    return obj


def mix_lines(spec: DataSpec, counts: list[dict]) -> list[str]:
    """One line per source of a mix (or a draw): rows taken of rows read, its share and why it is
    short; none for a plain source."""
    if spec.plain or not counts:
        return []
    total = sum(c.get("taken", c["drawn"]) for c in counts) or 1
    out = []
    for s, c in zip(spec.sources, counts):
        took = c.get("taken", c["drawn"])
        line = (f"{s.given}: {took:,} of {c['rows']:,} rows ({100 * took / total:.1f} %"
                + (f", weight {s.weight:g}" if s.weight is not None else "") + ")")
        if c["short"]:
            line += f"; short of its share {c['wanted']:,}" + (f" (--data ...::{s.cap} caps it)" if s.cap else "")
        if c.get("skipped"):
            line += f"; {c['skipped']:,} over --max-len skipped"
        out.append(line)
    return out
