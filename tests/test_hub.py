"""Models by Hub id (issue 47), offline: a Hugging Face cache laid out as huggingface_hub reads it
(`models--ORG--NAME/refs/`, `snapshots/COMMIT/`) in a temporary HF_HOME, HF_HUB_OFFLINE=1, the
CLI in a subprocess (huggingface_hub reads its settings at import).

`extract --model ORG/NAME` writes the bytes `--model SNAPSHOT_DIR` writes and the manifest names
the id and commit (inspect shows them); `--revision` picks between two cached snapshots; a missing
id, a local directory with --revision, and a snapshot without safetensors are refused before
anything is written; a dry run needs no weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _pipeline import mixed_jsonl, tree_digest

REPO = Path(__file__).resolve().parents[1]
MAIN, OTHER = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama, tiny_qwen3):
    root = tmp_path_factory.mktemp("hf")
    repo = root / "hub" / "models--org--tiny"
    shutil.copytree(tiny_llama, repo / "snapshots" / MAIN)
    shutil.copytree(tiny_qwen3, repo / "snapshots" / OTHER)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "qwen").write_text(OTHER)
    nobin = root / "hub" / "models--org--binonly"
    shutil.copytree(tiny_llama, nobin / "snapshots" / MAIN, ignore=shutil.ignore_patterns("*.safetensors"))
    (nobin / "refs").mkdir()
    (nobin / "refs" / "main").write_text(MAIN)
    data = mixed_jsonl(root / "data.jsonl", n_chat=6)
    return root, repo, data


def _cli(hf_home: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "eagle_fast", *argv], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False)


def _extract(hub_root, model, data, out, *extra):
    return _cli(hub_root, "extract", "--model", str(model), "--data", str(data), "--out", str(out), "--engine", "hf",
                "--dtype", "fp32", "--supervision", "lse", "--max-len", "96", *extra)


def test_a_hub_id_writes_what_its_snapshot_directory_writes(hub, tmp_path):
    root, repo, data = hub
    by_id, by_dir = tmp_path / "by_id", tmp_path / "by_dir"
    r = _extract(root, "org/tiny", data, by_id)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _extract(root, str(repo / "snapshots" / MAIN), data, by_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert tree_digest(by_id, skip_manifest=True) == tree_digest(by_dir, skip_manifest=True)
    m = json.loads((by_id / "manifest.json").read_text())
    assert m["model"]["hub"] == {"id": "org/tiny", "revision": None, "commit": MAIN}
    assert m["model"]["id"] == str((repo / "snapshots" / MAIN).resolve())
    assert "hub" not in json.loads((by_dir / "manifest.json").read_text())["model"]
    r = _cli(root, "inspect", str(by_id))
    assert r.returncode == 0 and f"hub         org/tiny at commit {MAIN}" in r.stdout, r.stdout


def test_revision_picks_a_cached_snapshot(hub, tmp_path):
    root, _, data = hub
    plans = {}
    for rev in ("main", "qwen", OTHER):
        r = _cli(root, "extract", "--model", "org/tiny", "--revision", rev, "--data", str(data), "--out",
                 str(tmp_path / "o"), "--engine", "hf", "--dry-run", "--json", "--max-len", "96")
        assert r.returncode == 0, r.stderr[-2000:]
        plan = json.loads(r.stdout)
        plans[rev] = (plan["tokens"], plan["by_field"], plan["pending_bytes"])  # the model's, not the disk's
    assert plans["qwen"] == plans[OTHER] and plans["qwen"] != plans["main"]


def test_bad_references_are_refused_before_anything_is_written(hub, tmp_path, tiny_llama):
    root, _, data = hub
    out = tmp_path / "out"
    cases = [
        (("org/missing",), "not in the Hugging Face cache, and the Hub cannot be reached"),
        (("org/tiny", "--revision", "nope"), "org/tiny --revision nope"),
        ((str(tiny_llama), "--revision", "main"), "is a local directory, not a Hub id"),
        (("org/binonly",), "has no *.safetensors weights"),
        (("./not-here",), "model directory not found, and not a Hub id"),
    ]
    for (model, *extra), message in cases:
        r = _extract(root, model, data, out, *extra)
        assert r.returncode == 2 and message in r.stderr, (model, r.stderr[-1500:])
        assert "fix:" in r.stderr and not out.exists()
    r = _cli(root, "extract", "--model", "org/binonly", "--data", str(data), "--out", str(out), "--engine", "hf",
             "--max-len", "96", "--dry-run")  # a plan needs the config and tokenizer only
    assert r.returncode == 0 and "on disk:" in r.stdout, r.stderr[-1500:]


def test_a_ray_worker_without_the_drivers_snapshot_reads_the_same_commit(hub, tmp_path):
    """`distributed.node_model`, as a worker on another node calls it: the driver's path when it
    is there, else the commit the driver resolved (not the branch, which may have moved)."""
    root, repo, _ = hub
    code = ("import json, sys; from eagle_fast.pipeline.distributed import node_model; "
            "print(json.dumps([node_model(sys.argv[1], None), node_model('/elsewhere/snap', "
            "{'id': 'org/tiny', 'revision': 'main', 'commit': sys.argv[2]})]))")
    env = {**os.environ, "HF_HOME": str(root), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code, str(repo / "snapshots" / MAIN), OTHER], env=env, cwd=REPO,
                       capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    here, elsewhere = json.loads(r.stdout.strip().splitlines()[-1])
    assert here == str(repo / "snapshots" / MAIN) and Path(elsewhere).name == OTHER


@pytest.fixture(scope="module")
def hub_data(hub):
    """A Hub dataset in the same cache: its default config's train split in two parquet shards, a
    test split, and a config of its own (`datasets--org--chats`)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root, _, data = hub
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    keys = sorted({k for r in rows for k in r})
    table = pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys})
    snap = root / "hub" / "datasets--org--chats" / "snapshots" / MAIN
    (snap / "data").mkdir(parents=True)
    pq.write_table(table.slice(0, 5), snap / "data" / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(5), snap / "data" / "train-00001-of-00002.parquet")
    pq.write_table(table.slice(0, 3), snap / "data" / "test-00000-of-00001.parquet")
    (snap / "small").mkdir()
    pq.write_table(table.slice(0, 2), snap / "small" / "train-00000-of-00001.parquet")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(MAIN)
    return root, data


def test_a_hub_dataset_id_reads_its_split(hub_data, tiny_llama, tmp_path):
    root, data = hub_data
    by_id, by_file = tmp_path / "by_id", tmp_path / "by_file"
    r = _extract(root, str(tiny_llama), "org/chats", by_id)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _extract(root, str(tiny_llama), data, by_file).returncode == 0
    assert tree_digest(by_id, skip_manifest=True) == tree_digest(by_file, skip_manifest=True)
    m = json.loads((by_id / "manifest.json").read_text())
    assert m["data"]["hub"] == {"id": "org/chats", "revision": None, "commit": MAIN, "split": "train", "config": None}
    for extra, samples in ((("--data-split", "test"), 3), (("--data-config", "small"), 2)):
        r = _cli(root, "extract", "--model", str(tiny_llama), "--data", "org/chats", *extra, "--out",
                 str(tmp_path / "o"), "--engine", "hf", "--max-len", "96", "--dry-run", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["samples"] == samples, r.stderr[-1500:]
    r = _cli(root, "extract", "--model", str(tiny_llama), "--data", "org/chats", "--data-split", "validation",
             "--out", str(tmp_path / "o"), "--engine", "hf", "--dry-run")
    assert r.returncode == 2 and "no one set of files for split 'validation'" in r.stderr, r.stderr[-1500:]
    r = _cli(root, "extract", "--model", str(tiny_llama), "--data", "org/none", "--out", str(tmp_path / "o"),
             "--engine", "hf", "--dry-run")
    assert r.returncode == 2 and "not in the Hugging Face cache" in r.stderr and not (tmp_path / "o").exists()
