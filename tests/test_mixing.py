"""Several `--data` mixed, `--max-samples`, `--data-columns`, and sources streamed (issue 48):

- the draw is deterministic, its proportions hold exactly (and in every prefix: each shard holds
  the mix), a short source gives all it has and the others fill the rest, and the counts say so;
- the manifest records each source's rows read, drawn, skipped and taken, and each shard which
  source each sample came from; the same mix gives the same bytes, and a changed mix never resumes;
- columns under other names give the bytes the known names give;
- a bad row names its source's file and row; regenerate's reader takes mixes too;
- a parquet source's run killed with SIGKILL mid-way resumes to the same dataset.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _pipeline import (
    HELD_DRIVER,
    chat_lines,
    killed_and_resumed,
    manifest_core,
    tree_digest,
    write_jsonl,
)

from eagle_fast import ExtractConfig, extract
from eagle_fast.errors import UserError
from eagle_fast.loop.rows import read_rows
from eagle_fast.loop.turns import passthrough
from eagle_fast.mixing import DataSpec, draw, parse_columns, parse_source, resolve_spec, shares
from eagle_fast.records import read_data
from eagle_fast.sources import BATCH_ROWS, count_rows, iter_rows, open_source

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _text_rows(path, n, tag):
    return write_jsonl(path, [{"text": f"{tag} row {i}"} for i in range(1, n + 1)])


def _parquet(path, rows, row_group_size=None):
    keys = sorted({k for r in rows for k in r})
    pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys}), path,
                   row_group_size=row_group_size)
    return path


def test_source_specs_parse():
    assert parse_source("a.jsonl") == ("a.jsonl", None, None)
    assert parse_source("a.jsonl:0.6") == ("a.jsonl", 0.6, None)
    assert parse_source("org/name:2:500") == ("org/name", 2.0, 500)
    assert parse_source("a.parquet::500") == ("a.parquet", None, 500)
    assert parse_source("data/*.parquet:1e-1") == ("data/*.parquet", 0.1, None)
    with pytest.raises(UserError, match="the weight must be above 0"):
        parse_source("a.jsonl:0")
    assert parse_columns("messages=conversation, text=body") == (("messages", "conversation"), ("text", "body"))
    with pytest.raises(UserError, match="'prompt' is not a field eagle-fast reads"):
        parse_columns("prompt=question")
    with pytest.raises(UserError, match="is not NAME=COLUMN"):
        parse_columns("messages")


def test_a_path_with_a_colon_is_a_path(tmp_path):
    p = _text_rows(tmp_path / "rows:0.5.jsonl", 3, "c")
    assert parse_source(str(p)) == (str(p), None, None)


def test_shares_split_by_weight_and_refill_what_a_short_source_lacks():
    assert shares([5000, 5000], [0.6, 0.4], 2000) == [1200, 800]
    assert shares([5000, 300], [0.5, 0.5], 1000) == [700, 300]
    assert shares([100, 100], [1, 1], 1000) == [100, 100]  # all there is
    assert shares([10, 10, 10], [1, 1, 1], 10) == [4, 3, 3]  # largest remainder, ties to the first
    assert sum(shares([7, 1000, 13], [0.2, 0.5, 0.3], 500)) == 500


def test_a_weighted_mix_is_deterministic_and_in_proportion_in_every_prefix(tmp_path):
    a = _text_rows(tmp_path / "a.jsonl", 3000, "a")
    b = _parquet(tmp_path / "b.parquet", [{"text": f"b row {i}"} for i in range(1, 2501)], row_group_size=700)
    spec = resolve_spec([f"{a}:0.6", f"{b}:0.4"], max_samples=2000)
    first = draw(spec)
    again = draw(spec)
    assert [(i.source, i.row) for i in first] == [(i.source, i.row) for i in again]
    assert first.digest == again.digest
    picks = [i.source for i in first]
    assert len(picks) == 2000 and picks.count(0) == 1200 and picks.count(1) == 800
    for end in range(100, 2001, 100):  # every shard of the dataset holds the mix, to a row
        assert abs(picks[:end].count(0) - 0.6 * end) <= 1, end
    rows_a = [i.row for i in first if i.source == 0]
    assert rows_a == sorted(rows_a) and len(set(rows_a)) == 1200 and max(rows_a) > 2500  # a draw, in order
    assert [c["rows"] for c in first.counts] == [3000, 2500]
    other = draw(resolve_spec([f"{a}:0.6", f"{b}:0.4"], max_samples=2000, seed=1))
    assert [i.row for i in other if i.source == 0] != rows_a and other.digest != first.digest
    # the rows a draw names are the rows it holds
    for item in list(first)[:50]:
        want = f"{'ab'[item.source]} row {item.row}"
        got = item.payload if isinstance(item.payload, dict) else json.loads(item.payload)
        assert got["text"] == want


def test_without_max_samples_weights_take_the_largest_total_that_keeps_them(tmp_path):
    a, b = _text_rows(tmp_path / "a.jsonl", 1000, "a"), _text_rows(tmp_path / "b.jsonl", 300, "b")
    d = draw(resolve_spec([f"{a}:0.6", f"{b}:0.4"]))
    assert [c["drawn"] for c in d.counts] == [450, 300]
    d = draw(resolve_spec([str(a), f"{b}::120"]))  # no weights: every row available, b capped
    assert [c["drawn"] for c in d.counts] == [1000, 120] and [c["available"] for c in d.counts] == [1000, 120]
    d = draw(resolve_spec([f"{a}:1", f"{b}:1"], max_samples=1000))  # b short: a fills the rest
    assert [(c["wanted"], c["drawn"], c["short"]) for c in d.counts] == [(500, 700, False), (500, 300, True)]
    with pytest.raises(UserError, match="some --data have a weight and some do not"):
        resolve_spec([f"{a}:1", str(b)])
    with pytest.raises(UserError, match="given twice"):
        resolve_spec([f"{a}:1", f"{a}:2"])
    with pytest.raises(UserError, match="--data-revision / --data-config apply to a Hub dataset id"):
        resolve_spec([str(a)], revision="main")


def test_tables_stream_a_batch_at_a_time_and_errors_name_the_file_and_row(tmp_path):
    rows = [{"text": f"r{i}"} for i in range(1, 2 * BATCH_ROWS + 300)]
    (tmp_path / "dir").mkdir()
    _parquet(tmp_path / "dir" / "part-0.parquet", rows[:BATCH_ROWS + 10], row_group_size=500)
    _parquet(tmp_path / "dir" / "part-1.parquet", rows[BATCH_ROWS + 10:])
    src = open_source(tmp_path / "dir")
    assert count_rows(src) == len(rows)
    keep = {0, 5, BATCH_ROWS + 9, BATCH_ROWS + 10, len(rows) - 1}
    got = list(iter_rows(src, keep))
    assert [n for n, _, _ in got] == sorted(k + 1 for k in keep)
    assert [r["text"] for _, _, r in got] == [rows[k]["text"] for k in sorted(keep)]
    assert got[3][1] == (str(tmp_path / "dir" / "part-1.parquet"), 1)  # its own file's first row
    bad = [*rows[:BATCH_ROWS + 10], *rows[BATCH_ROWS + 10: BATCH_ROWS + 15], {"text": ""}]
    _parquet(tmp_path / "dir" / "part-1.parquet", bad[BATCH_ROWS + 10:])
    with pytest.raises(UserError, match=r"part-1\.parquet:6: empty \"text\""):
        read_data(tmp_path / "dir")
    _, failures, read, _ = read_rows(tmp_path / "dir")
    assert read == len(bad) and len(failures) == 1
    assert failures[0].line == len(bad) and failures[0].where == f"{tmp_path / 'dir' / 'part-1.parquet'}:6"


def test_columns_under_other_names_read_as_the_known_ones(tmp_path):
    chats = [json.loads(x) for x in chat_lines(6)]
    known = write_jsonl(tmp_path / "known.jsonl", chats)
    other = _parquet(tmp_path / "other.parquet", [{"conversation": c["messages"], "id": i} for i, c in enumerate(chats)])
    want, _ = read_data(known)
    got, drawn = read_data(resolve_spec([str(other)], columns="messages=conversation"))
    assert [r.value for r in got] == [r.value for r in want]
    assert drawn.digest != draw(DataSpec.of(other)).digest  # the mapping is part of what the data is
    with pytest.raises(UserError, match=r"other\.parquet:1: no usable field \(found keys: conversation, id\)"):
        read_data(other)
    rows, failures, _, _ = read_rows(resolve_spec([str(other)], columns="messages=conversation"))
    assert not failures and rows[2].obj["messages"] == chats[2]["messages"] and rows[2].obj["id"] == 2


def _cfg(model, data, out, **kw) -> ExtractConfig:
    return ExtractConfig(model=str(model), data=data, out=str(out), engine="hf", dtype="fp32", max_len=96,
                         shard_size=4, supervision="lse", progress_tty=False, **kw)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    chats = [json.loads(x) for x in chat_lines(40)]
    a = write_jsonl(root / "a.jsonl", chats[:24])
    b = _parquet(root / "b.parquet", [{"conversation": c["messages"]} for c in chats[24:]])
    return root, a, b


def test_a_mix_extracts_the_same_bytes_every_time_and_records_its_draw(two_sources, tiny_llama, tmp_path):
    _, a, b = two_sources
    spec = resolve_spec([f"{a}:0.5", f"{b}:0.5"], columns="messages=conversation", max_samples=20, seed=3)
    extract(_cfg(tiny_llama, spec, tmp_path / "one"))
    extract(_cfg(tiny_llama, spec, tmp_path / "two"))
    assert tree_digest(tmp_path / "one", skip_manifest=True) == tree_digest(tmp_path / "two", skip_manifest=True)
    assert manifest_core(tmp_path / "one") == manifest_core(tmp_path / "two")
    m = json.loads((tmp_path / "one" / "manifest.json").read_text())
    src = m["data"]["sources"]
    assert [(s["rows"], s["drawn"], s["taken"], s["skipped"]) for s in src] == [(24, 10, 10, 0), (16, 10, 10, 0)]
    assert [s["weight"] for s in src] == [0.5, 0.5] and m["data"]["columns"] == {"messages": "conversation"}
    assert (m["data"]["max_samples"], m["data"]["seed"], m["num_samples"]) == (20, 3, 20)
    per_sample = [(s, line) for rec in m["shards"] for s, line in zip(rec.get("sources", [0] * rec["samples"]),
                                                                       rec["lines"])]
    assert sorted(s for s, _ in per_sample) == [0] * 10 + [1] * 10
    assert all(1 <= line <= (24, 16)[s] for s, line in per_sample)
    # a changed mix is another dataset: it never resumes into this one
    other = resolve_spec([f"{a}:0.5", f"{b}:0.5"], columns="messages=conversation", max_samples=20, seed=4)
    with pytest.raises(UserError, match="different settings|another"):
        extract(_cfg(tiny_llama, other, tmp_path / "one"))


def test_a_mix_split_across_nodes_merges_to_the_single_run(two_sources, tiny_llama, tmp_path):
    from eagle_fast.pipeline.merge import merge

    _, a, b = two_sources
    spec = resolve_spec([f"{a}:0.7", f"{b}:0.3"], columns="messages=conversation", max_samples=16, seed=5)
    extract(_cfg(tiny_llama, spec, tmp_path / "single"))
    for i in range(2):
        extract(_cfg(tiny_llama, spec, tmp_path / "shared", shard=f"{i}/2"))
    merge(str(tmp_path / "shared"))
    assert tree_digest(tmp_path / "shared", skip_manifest=True) == tree_digest(tmp_path / "single", skip_manifest=True)
    assert manifest_core(tmp_path / "shared") == manifest_core(tmp_path / "single")


def test_a_mix_of_one_source_under_its_own_names_gives_the_plain_bytes(two_sources, tiny_llama, tmp_path):
    _, a, _ = two_sources
    extract(_cfg(tiny_llama, str(a), tmp_path / "plain"))
    extract(_cfg(tiny_llama, resolve_spec([f"{a}::1000"]), tmp_path / "capped"))  # a cap above its rows
    assert tree_digest(tmp_path / "plain", skip_manifest=True) == tree_digest(tmp_path / "capped", skip_manifest=True)


def test_regenerates_reader_takes_a_mix_and_its_rows_say_where_they_came_from(two_sources):
    _, a, b = two_sources
    spec = resolve_spec([f"{a}:0.5", f"{b}:0.5"], columns="messages=conversation", max_samples=8)
    rows, failures, read, _ = read_rows(spec)
    assert (len(rows), failures, read) == (8, [], 8) and [r.line for r in rows] == list(range(1, 9))
    assert {r.source for r in rows} == {str(a), str(b)}
    out = json.loads(passthrough(rows[1]).text)
    assert out["data_source"] == rows[1].source and out["source_line"] == rows[1].source_row


def test_a_parquet_run_killed_mid_way_resumes_byte_identical(two_sources, tiny_llama, tmp_path):
    root, a, _ = two_sources
    chats = [json.loads(x) for x in a.read_text().splitlines()]
    data = _parquet(root / "all.parquet", chats, row_group_size=5)
    script = tmp_path / "held.py"
    script.write_text(HELD_DRIVER)

    def argv(mode, out):
        return [sys.executable, str(script), mode, "extract", "--model", str(tiny_llama), "--data", str(data),
                "--out", str(out), "--engine", "hf", "--dtype", "fp32", "--max-len", "96", "--shard-size", "3",
                "--batch-tokens", "200", "--supervision", "lse"]

    ref = subprocess.run(argv("fast", tmp_path / "ref"), check=False, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    out = tmp_path / "killed"
    killed_and_resumed(argv, out)
    assert tree_digest(out, skip_manifest=True) == tree_digest(tmp_path / "ref", skip_manifest=True)
    assert manifest_core(out) == manifest_core(tmp_path / "ref")


def test_every_data_command_takes_the_same_mix(two_sources, tiny_llama, tmp_path, capsys):
    from _pipeline import run_main

    from eagle_fast.cli import build_parser
    from eagle_fast.cli_args import data_spec

    _, a, b = two_sources
    flags = ["--data", f"{a}:0.5", "--data", f"{b}:0.5", "--data-columns", "messages=conversation",
             "--max-samples", "12", "--data-seed", "7"]
    want = resolve_spec([f"{a}:0.5", f"{b}:0.5"], columns="messages=conversation", max_samples=12, seed=7)
    for command in (["regenerate", "--model", "m", "--out", "o"], ["accept", "--model", "m", "--draft", "d"],
                    ["vocab", "--model", "m", "--out", "o"], ["extract", "--model", "m", "--out", "o"]):
        assert data_spec(build_parser().parse_args([*command, *flags])) == want, command[0]
    code, out, err = run_main(capsys, "vocab", "--model", tiny_llama, "--out", tmp_path / "v.pt", "--size", "32",
                              *flags)
    assert code == 0 and "in 12 samples" in out + err, out + err


def test_the_plan_of_a_large_source_holds_about_five_bytes_a_token(tmp_path):
    import tracemalloc

    from eagle_fast.inputs import plan_inputs

    n, length = 2000, 500
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [(i * 7 + j) % 30000 + 300 for j in range(length)]}
                                                for i in range(n)])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        plan = plan_inputs(data, None, 32000, max_len=length, overlong="truncate")
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert plan.tokens == n * length and plan.samples[5].input_ids[:2] == [335, 336]
    assert held < 5 * n * length + 300 * n, f"{held / (n * length):.1f} bytes a token"  # a list: ~40


def test_regenerate_reads_its_chunks_as_they_are_asked_for(two_sources):
    from eagle_fast.loop.regenerate import ChunkStream
    from eagle_fast.loop.rows import Row

    _, a, b = two_sources
    spec = resolve_spec([f"{a}:0.5", f"{b}:0.5"], columns="messages=conversation", max_samples=14)
    rows, _, _, _ = read_rows(spec)
    want = [rows[i: i + 4] for i in range(0, len(rows), 4)]
    chunks = ChunkStream(spec, draw(spec), 4, 1, len(want))  # resumed after chunk 0
    assert len(chunks) == len(want) - 1
    got = list(chunks)
    assert [[(r.line, r.obj) for r in c] for c in got] == [[(r.line, r.obj) for r in c] for c in want[1:]]
    assert all(isinstance(r, Row) for c in got for r in c)
    again = ChunkStream(spec, draw(spec), 4, 0, len(want))
    with pytest.raises(IndexError, match="out of order"):
        again[1]
