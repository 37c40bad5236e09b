"""Data as users bring it (issue 48, the forms): one row set written as jsonl, as a JSON array, as
parquet (one file, a directory, a glob), as an Arrow file and through `datasets`' save_to_disk
gives byte-identical datasets (the manifest's data path and hash aside), and the same vocabulary;
a bad row in a parquet file fails with the file and its row number; regenerate's reader takes
the forms too and reports a bad row without stopping.
"""

from __future__ import annotations

import json

import pytest
import torch
from _pipeline import mixed_jsonl, tree_digest

from eagle_fast import ExtractConfig, extract
from eagle_fast.errors import UserError
from eagle_fast.loop.rows import read_rows
from eagle_fast.records import read_records
from eagle_fast.sources import open_source
from eagle_fast.vocab import build_vocab

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    from datasets import Dataset

    root = tmp_path_factory.mktemp("forms")
    jsonl = mixed_jsonl(root / "rows.jsonl", n_chat=10)
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
    (root / "rows.json").write_text(json.dumps(rows, indent=1))
    keys = sorted({k for r in rows for k in r})  # one schema for all: the columns a row lacks are null
    columns = {k: [r.get(k) for r in rows] for k in keys}
    table = pa.Table.from_pydict(columns)
    pq.write_table(table.slice(0, 5), root / "rows.parquet")  # one file, then a directory of two
    (root / "dir").mkdir()
    pq.write_table(table.slice(0, 7), root / "dir" / "part-0.parquet")
    pq.write_table(table.slice(7), root / "dir" / "part-1.parquet")
    with pa.ipc.new_file(str(root / "rows.arrow"), table.schema) as w:
        w.write_table(table)
    Dataset.from_dict(columns).save_to_disk(str(root / "saved"))
    return root, jsonl, len(rows)


def _cfg(model, data, out) -> ExtractConfig:
    return ExtractConfig(model=str(model), data=str(data), out=str(out), engine="hf", dtype="fp32", max_len=96,
                         shard_size=5, supervision="lse", progress_tty=False)


def test_every_form_gives_the_same_records(forms):
    root, jsonl, n = forms
    want, _ = read_records(jsonl)
    assert len(want) == n
    for data, kind in ((root / "rows.json", "json"), (root / "dir", "table"), (str(root / "dir" / "*.parquet"), "table"),
                       (root / "rows.arrow", "table"), (root / "saved", "saved")):
        assert open_source(data).kind == kind
        got, digest = read_records(data)
        assert [(r.line, r.kind, r.value, r.loss_mask, r.tools) for r in got] == \
               [(r.line, r.kind, r.value, r.loss_mask, r.tools) for r in want], data
        assert len(digest) == 64
    rows, failures, read, _ = read_rows(root / "saved")
    assert (len(rows), failures, read) == (n, [], n)


def test_every_form_extracts_the_same_bytes_and_vocabulary(forms, tiny_llama, tmp_path):
    root, jsonl, _ = forms
    extract(_cfg(tiny_llama, jsonl, tmp_path / "jsonl"))
    ref = tree_digest(tmp_path / "jsonl", skip_manifest=True)
    build_vocab(str(tiny_llama), str(jsonl), 32, str(tmp_path / "v.pt"), max_len=96, log=lambda *_: None)
    ref_vocab = torch.load(tmp_path / "v.pt")
    for name, data in (("json", root / "rows.json"), ("dir", root / "dir"), ("saved", root / "saved")):
        extract(_cfg(tiny_llama, data, tmp_path / name))
        assert tree_digest(tmp_path / name, skip_manifest=True) == ref, name
        build_vocab(str(tiny_llama), str(data), 32, str(tmp_path / f"{name}.pt"), max_len=96, log=lambda *_: None)
        got = torch.load(tmp_path / f"{name}.pt")
        assert all(torch.equal(got[k], ref_vocab[k]) for k in ref_vocab if torch.is_tensor(ref_vocab[k])), name


def test_a_bad_row_names_its_file_and_row(forms, tmp_path):
    _, jsonl, _ = forms
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
    rows[5] = {"messages": [{"role": "wizard", "content": "hi"}]}
    keys = sorted({k for r in rows for k in r})
    pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys}), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=r"bad\.parquet:6: unknown role 'wizard' in message 1"):
        read_records(tmp_path / "bad.parquet")
    good, failures, read, _ = read_rows(tmp_path / "bad.parquet")  # regenerate's reader goes on past it
    assert read == len(rows) and [f.line for f in failures] == [6] and len(good) == len(rows) - 1
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="a directory with no .parquet or .arrow file"):
        read_records(tmp_path / "d")
    with pytest.raises(UserError, match="the pattern matches no .parquet or .arrow file"):
        read_records(str(tmp_path / "nothing-*.parquet"))
