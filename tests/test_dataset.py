"""`Eagle3Dataset`: lazy reads, the manifest's field contract, validation on open."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _pipeline import mixed_jsonl

from eagle_fast import Eagle3Dataset, ExtractConfig, extract
from eagle_fast.errors import UserError


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory, tiny_qwen3):
    root = tmp_path_factory.mktemp("ds")
    data = mixed_jsonl(root / "d.jsonl", n_chat=12)
    extract(ExtractConfig(model=str(tiny_qwen3), data=str(data), out=str(root / "out"), engine="hf",
                          dtype="fp32", max_len=80, shard_size=4, supervision="topk", k=5, progress_tty=False))
    return root / "out"


@pytest.fixture
def copy(dataset_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(dataset_dir, dst)
    return dst


def test_samples_follow_the_manifest_contract(dataset_dir):
    ds = Eagle3Dataset(dataset_dir)
    m = ds.manifest
    assert len(ds) == m["num_samples"] == 14 and not ds.open_files  # nothing opened yet
    dtypes = {"int64": torch.int64, "bool": torch.bool, "float32": torch.float32}
    total = 0
    for i in range(len(ds)):
        s = ds[i]
        assert set(s) == set(m["fields"])
        T = s["input_ids"].shape[0]
        total += T
        for name, spec in m["fields"].items():
            assert s[name].dtype == dtypes[spec["dtype"]], name
            assert list(s[name].shape) == [T, *spec["shape"][1:]], name
        assert s["topk_ids"].shape == (T, 5) and bool((s["topk_logprobs"][:, :-1] >= s["topk_logprobs"][:, 1:]).all())
        assert torch.equal(s["topk_ids"][:, 0], s["argmax"])
        assert ds.length(i) == T
    assert total == m["num_tokens"]
    assert torch.equal(ds[-1]["input_ids"], ds[len(ds) - 1]["input_ids"])
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert any(f.endswith("shard-000000.safetensors") for f in ds.open_files)  # opened lazily


def test_collate_and_dataloader_workers(dataset_dir):
    from torch.utils.data import DataLoader

    ds = Eagle3Dataset(dataset_dir)
    batch = Eagle3Dataset.collate([ds[0], ds[1], ds[2]])
    lens = [ds.length(i) for i in range(3)]
    assert batch["input_ids"].shape == (3, max(lens)) and batch["attention_mask"].sum(1).tolist() == lens
    assert not batch["loss_mask"][~batch["attention_mask"]].any()
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=Eagle3Dataset.collate)
    seen = torch.cat([b["input_ids"][b["attention_mask"]] for b in loader])
    assert torch.equal(seen, torch.cat([ds[i]["input_ids"] for i in range(len(ds))]))


def _corrupt(copy, how):
    shard = copy / "shard-000001.safetensors"
    if how == "missing":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif how == "header":
        raw = bytearray(shard.read_bytes())
        i = raw.index(b'"shard":"1"')
        raw[i: i + 11] = b'"shard":"9"'
        shard.write_bytes(bytes(raw))
    elif how == "manifest":
        (copy / "manifest.json").write_text("{not json")
    elif how == "version":
        m = json.loads((copy / "manifest.json").read_text())
        m["format_version"] = 99
        (copy / "manifest.json").write_text(json.dumps(m))
    elif how == "incomplete":
        m = json.loads((copy / "manifest.json").read_text())
        m["shards"] = m["shards"][:2]
        m["complete"] = False
        (copy / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("how, message", [
    ("missing", "shard-000001.safetensors is missing"),
    ("truncated", "bytes, the manifest says"),
    ("header", "different safetensors header"),
    ("manifest", "is not valid JSON"),
    ("version", "format_version 99"),
    ("incomplete", "incomplete (2/4 shards written)"),
])
def test_open_validates_cheaply(copy, how, message):
    _corrupt(copy, how)
    with pytest.raises(UserError) as e:
        Eagle3Dataset(copy)
    assert message in e.value.cause and e.value.fix


def test_full_verification_catches_a_flipped_byte(copy):
    shard = copy / "shard-000002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-7] ^= 0x40  # inside the data, so size and header still match
    shard.write_bytes(bytes(raw))
    Eagle3Dataset(copy)  # the cheap check cannot see it
    with pytest.raises(UserError, match="fails its sha256 checksum"):
        Eagle3Dataset(copy, verify="full")


def test_not_a_dataset(tmp_path):
    with pytest.raises(UserError, match="not an eagle-fast dataset"):
        Eagle3Dataset(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 2, "num_samples": 1}))
    with pytest.raises(UserError, match="not written by eagle-fast"):
        Eagle3Dataset(tmp_path)
    with pytest.raises(UserError, match="is not a directory"):
        Eagle3Dataset(tmp_path / "nope")
