"""Bytes per token by field (eagle_fast.store.sizes): counted from the layouts' declared fields,
checked against the tensors an extraction really writes, shown in the summary and `inspect`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _pipeline import chat_lines, write_jsonl

from eagle_fast import ExtractConfig, extract
from eagle_fast.files import read_safetensors_header
from eagle_fast.pipeline.inspect import inspect_text
from eagle_fast.store import make_layout, spec_from_manifest
from eagle_fast.store.layouts import KINDS, LayoutSpec
from eagle_fast.store.manifest import read_manifest
from eagle_fast.store.sizes import (
    bytes_per_token,
    field_sizes,
    layout_bytes_per_token,
    tensor_bytes,
)

V = 1031
QWEN3_8B = {"hidden_size": 4096, "vocab_size": 151_936, "draft_size": 32_000}
HAS_AUX_DTYPE = "aux_dtype" in {f.name for f in dataclasses.fields(LayoutSpec)}


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's tensor entries and the size of its data section."""
    header, raw = read_safetensors_header(path)
    header.pop("__metadata__", None)
    return header, path.stat().st_size - 8 - len(raw)


CASES = [  # (format, supervision, extra settings)
    ("native", "topk", {"k": 6}),
    ("native", "draft", {"out_dtype": "bf16"}),
    ("native", "hidden", {}),
    ("native", "draft-topk", {"k": 5, "aux_dtype": "fp8"}),
    ("nemo", "topk", {"k": 5}),
    ("speculators", "hidden", {"aux_dtype": "fp8"}),
]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("sizes") / "d.jsonl", chat_lines(5))


@pytest.fixture(scope="module")
def draft_vocab(tmp_path_factory):
    from eagle_fast.vocab import DraftVocab, save_draft_vocab

    return save_draft_vocab(tmp_path_factory.mktemp("vocab") / "v.pt", DraftVocab(torch.arange(1, V, 3), V))


@pytest.mark.parametrize("layout, supervision, extra", CASES, ids=[f"{a}-{b}" for a, b, _ in CASES])
def test_field_bytes_match_the_shard_files(tmp_path, tiny_llama, chat_data, draft_vocab, layout,
                                           supervision, extra):
    if supervision not in KINDS or ("aux_dtype" in extra and not HAS_AUX_DTYPE):
        pytest.skip(f"{supervision} / {extra} is not built yet")
    out = tmp_path / "out"
    summary = extract(ExtractConfig(
        model=str(tiny_llama), data=str(chat_data), out=str(out), engine="hf", dtype="fp32", layout=layout,
        supervision=supervision, max_len=64, shard_size=3, batch_tokens=512, progress_tty=False,
        draft_vocab=str(draft_vocab) if supervision.startswith("draft") else None, **extra))
    m = read_manifest(out)
    sizes = field_sizes(make_layout(spec_from_manifest(m)))
    assert len(m["shards"]) == 2 and summary.tokens == sum(r["tokens"] for r in m["shards"])
    for rec in m["shards"]:
        got: dict[str, int] = {}
        data_bytes = 0
        for f in rec["files"]:
            header, n = _header(out / f["path"])
            data_bytes += n
            for name, t in header.items():
                got[name] = got.get(name, 0) + t["data_offsets"][1] - t["data_offsets"][0]
        units = {"token": rec["tokens"], "sample": rec["samples"], "position": rec["samples"] * m["layout_spec"]["max_len"]}
        expected = {f.name: f.nbytes * units[f.per] + f.fixed * len(rec["files"]) for f in sizes}
        assert got == expected, (rec["index"], got, expected)
        # the file's whole data section, beside its header: nothing stored that sizes does not count
        predicted = tensor_bytes(sizes, rec["tokens"], rec["samples"], len(rec["files"]),
                                 positions=units["position"])
        assert data_bytes == predicted
        assert sum(f["bytes"] for f in rec["files"]) - predicted < 2048 * len(rec["files"])  # headers
    # the summary and `inspect` show the same by-field table
    text, shown = summary.text(), inspect_text(str(out))
    for name, nbytes in bytes_per_token(sizes).items():
        row = next(ln for ln in text.splitlines() if ln.split()[:1] == [name])
        assert row.split()[1] == f"{nbytes:,}", row
        assert row in shown.splitlines()
    assert "by field" in text and "bytes/token" in text and "fp32 logits" in text


def test_reference_figures_at_qwen3_8b_shapes():
    """Native `draft` at Qwen3-8B shapes: aux 3H bf16 24.6 KB + bf16 draft log-probs 64 KB = ~89 KB."""
    spec = LayoutSpec(layout="native", kind="draft", k=0, num_aux=3, dtype=torch.bfloat16,
                      out_dtype=torch.bfloat16, max_len=4096, **QWEN3_8B)
    per_field = bytes_per_token(make_layout(spec))
    assert per_field["aux_hidden_states"] == 3 * 4096 * 2 == 24_576
    assert per_field["draft_logprobs"] == 32_000 * 2
    total = layout_bytes_per_token("native", "draft", out_dtype="bf16", **QWEN3_8B)
    assert total == sum(per_field.values()) and 88_000 < total < 89_500
    # fp32 log-probs double that field only; nemo counts per padded position, independent of length
    assert layout_bytes_per_token("native", "draft", out_dtype="fp32", **QWEN3_8B) - total == 64_000
    nemo = [layout_bytes_per_token("nemo", "draft", max_len=n, **QWEN3_8B) for n in (512, 4096)]
    assert nemo[0] == nemo[1] > 24_576 + 64_000


def test_unknown_layout_option_is_a_type_error():
    with pytest.raises(TypeError):
        layout_bytes_per_token("native", "draft", not_an_option=1, **QWEN3_8B)


def test_storage_table_finds_the_options_the_layouts_declare():
    from _bench import load_bench

    table = load_bench("storage_table")
    rows = table.options()
    assert ("native", "draft", 0, "auto") in rows and ("speculators", "hidden", 0, "auto") in rows
    assert not [r for r in rows if r[0] == "speculators" and r[1] != "hidden"]  # refused kinds are left out
    # k is swept exactly where the declared fields depend on it
    assert [r[2] for r in rows if r[:2] == ("native", "topk") and r[3] == "auto"] == list(table.K_SWEEP)
    assert [r[2] for r in rows if r[:2] == ("nemo", "draft")] == [0]
    if HAS_AUX_DTYPE:  # fp8 rows only where the layout's fields change: not nemo's cache
        assert ("native", "draft", 0, "fp8") in rows and not [r for r in rows if r[0] == "nemo" and r[3] != "auto"]
    records = table.table()
    ref = next(r for r in records if (r["format"], r["supervision"], r["k"], r["aux"]) == table.REFERENCE)
    assert ref["bytes_per_token"]["Qwen3-8B bf16"] == layout_bytes_per_token(
        "native", "draft", out_dtype="bf16", **QWEN3_8B)
    md = table.markdown(records)
    assert md.count("\n| ") == len(records) + 1 and "| native | draft |  | bf16 | 88.6 |" in md
