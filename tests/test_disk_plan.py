"""Disk planned before the run (issue 42): `extract --dry-run` gives the bytes the run writes,
a run that cannot fit is refused before any engine starts, and a disk that fills mid-run is a
clear error whose rerun resumes to the same bytes.

The dry run's total is held to the bytes the real run writes (every file under --out but the
manifest) on native, draft-topk with --keep-mass (a bound there: every token at the cap k) and
speculators; the free space is a `shutil.disk_usage` stub, the full disk an `os.pwrite` stub
that fails once the first shard is committed (the transformers engine; no vLLM needed).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from _pipeline import mixed_jsonl, tree_digest

from eagle_fast import ExtractConfig, cli, extract
from eagle_fast.errors import UserError
from eagle_fast.pipeline import disk as P
from eagle_fast.pipeline.plan import dry_run, resolve
from eagle_fast.store import safetensors as S
from eagle_fast.vocab import build_vocab


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("disk")
    data = mixed_jsonl(root / "data.jsonl", n_chat=14)
    vocab = root / "vocab.pt"
    build_vocab(str(tiny_llama), str(data), 64, str(vocab), max_len=96, log=lambda *_: None)
    return data, vocab


def _cfg(model, data, out, **kw) -> ExtractConfig:
    base = {"model": str(model), "data": str(data), "out": str(out), "engine": "hf", "dtype": "fp32",
            "max_len": 96, "shard_size": 5, "batch_tokens": 300, "progress_tty": False}
    return ExtractConfig(**{**base, **kw})


def _written(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.name.startswith("manifest"))


@pytest.mark.parametrize("opts,bound", [
    ({"supervision": "draft"}, False),
    ({"supervision": "draft-topk", "k": 16, "keep_mass": 0.9}, True),
    ({"layout": "speculators"}, False),
], ids=["native-draft", "draft-topk-keep-mass", "speculators"])
def test_dry_run_total_is_what_the_run_writes(tiny_llama, inputs, tmp_path, opts, bound):
    data, vocab = inputs
    cfg = _cfg(tiny_llama, data, tmp_path / "out", draft_vocab=str(vocab), **opts)
    plan = dry_run(cfg)
    assert not (tmp_path / "out").exists()  # a plan writes nothing
    extract(cfg)
    real = _written(tmp_path / "out")
    assert plan.bound == bound and plan.pending_shards == plan.shards == 4
    planned = plan.pending_bytes - P.MANIFEST_BYTES  # the manifest is not counted in `real`
    if bound:
        assert real <= planned, (real, planned)
    else:
        assert abs(planned - real) <= 8 << 10, (planned, real)  # a few KB: header and file allowances
    # resumed, nothing is left to write
    again = dry_run(cfg)
    assert again.pending_shards == 0 and again.pending_bytes <= P.MANIFEST_BYTES + 16 * 1024 * 4


def test_a_run_that_cannot_fit_is_refused_before_any_engine(tiny_llama, inputs, tmp_path, monkeypatch):
    data, vocab = inputs
    monkeypatch.setattr(P.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 20, 10 << 20, 64 << 10))

    def no_engine(*a, **k):
        raise AssertionError("an engine was built")

    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"this run writes .* and .* has 64\.0 KiB free") as exc:
        extract(_cfg(tiny_llama, data, out, draft_vocab=str(vocab), supervision="draft"), runner_factory=no_engine)
    assert "--aux-dtype fp8" in exc.value.fix and "--no-space-check" in exc.value.fix and "--shard" in exc.value.fix
    assert not out.exists()
    s = extract(_cfg(tiny_llama, data, out, draft_vocab=str(vocab), supervision="draft", space_check=False))
    assert s.complete


def test_a_disk_that_fills_mid_run_is_a_clear_error_and_resumes(tiny_llama, inputs, tmp_path, monkeypatch):
    data, _ = inputs
    reference = tmp_path / "reference"
    extract(_cfg(tiny_llama, data, reference, supervision="lse"))
    out = tmp_path / "out"
    real_pwrite = os.pwrite
    committed = []
    real_commit = S.SafetensorsWriter.commit

    def commit(self, *a, **k):
        path = real_commit(self, *a, **k)
        committed.append(path)
        return path

    def pwrite(fd, data, offset):
        if committed:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(S.SafetensorsWriter, "commit", commit)
    monkeypatch.setattr(S.os, "pwrite", pwrite)
    with pytest.raises(UserError, match=r"the disk filled while writing .*: 3 shards, about .* are still to be "
                                        r"written; the 1 shards committed so far are complete") as exc:
        extract(_cfg(tiny_llama, data, out, supervision="lse"))
    assert "re-run the same command" in exc.value.fix
    monkeypatch.undo()
    s = extract(_cfg(tiny_llama, data, out, supervision="lse"))
    assert s.complete
    assert tree_digest(out, skip_manifest=True) == tree_digest(reference, skip_manifest=True)


def test_cli_dry_run_needs_no_weights(tiny_llama, inputs, tmp_path, capsys):
    data, vocab = inputs
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model, ignore=shutil.ignore_patterns("*.safetensors"))
    argv = ["extract", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"), "--engine", "hf",
            "--max-len", "96", "--shard-size", "5", "--draft-vocab", str(vocab)]
    assert cli.main([*argv, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["samples"] == 16 and plan["pending_shards"] == 4 and plan["pending_bytes"] > 0
    assert set(plan["by_field"]) >= {"aux_hidden_states", "draft_logprobs"}
    assert cli.main([*argv, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "on disk:" in text and "the seed's full fp32 logits" in text and "free" in text
    assert cli.main(argv) == 2 and "has no *.safetensors weights" in capsys.readouterr().err
    assert cli.main([*argv, "--json"]) == 2 and "--json applies to --dry-run" in capsys.readouterr().err


def test_a_full_disk_is_found_through_chained_and_ray_causes(tiny_llama, inputs, tmp_path):
    data, _ = inputs
    p = resolve(_cfg(tiny_llama, data, tmp_path / "out", supervision="lse"))

    class RayTaskError(RuntimeError):  # as ray.exceptions.RayTaskError carries a worker's exception
        def __init__(self, cause):
            super().__init__("worker failed")
            self.cause = cause

    full = OSError(errno.ENOSPC, "No space left on device", "/data/ds/.shard-000002.safetensors.tmp")
    chained = RuntimeError("the writer thread failed")
    chained.__cause__ = full
    for exc in (full, chained, RayTaskError(chained)):
        err = P.disk_full(exc, p, {0})
        assert err is not None and ".shard-000002.safetensors.tmp" in err.cause and "3 shards" in err.cause
    assert P.disk_full(RuntimeError("something else"), p, set()) is None
    looped = RayTaskError(None)  # a chain that comes back to itself ends, it does not spin
    inner = RuntimeError("engine died")
    inner.__context__ = looped
    looped.cause = inner
    assert P.disk_full(looped, p, set()) is None
    assert P.disk_full(OSError(errno.EACCES, "Permission denied"), p, set()) is None


def test_a_real_tmpfs_that_fills_mid_run(tiny_llama, inputs, tmp_path):
    """The same on a real filesystem: a tmpfs with room for the first shard only (the check
    skipped, as another writer would fill it), then grown; skipped where mounting is not allowed."""
    import subprocess

    data, _ = inputs
    reference = tmp_path / "reference"
    extract(_cfg(tiny_llama, data, reference, supervision="lse"))
    first = (reference / "shard-000000.safetensors").stat().st_size
    total = sum(f.stat().st_size for f in reference.rglob("*") if f.is_file())
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def mount(*opts: str) -> bool:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(mnt)],
                              capture_output=True, check=False).returncode == 0

    if not mount(f"size={first + (32 << 10)}"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN) here")
    try:
        out = mnt / "ds"
        with pytest.raises(UserError, match=r"the disk filled while writing .*shard-00000[1-3].*are still to be "
                                            r"written; the 1 shards committed so far are complete"):
            extract(_cfg(tiny_llama, data, out, supervision="lse", space_check=False))
        assert mount("remount", f"size={2 * total + (1 << 20)}")
        assert extract(_cfg(tiny_llama, data, out, supervision="lse")).complete
        assert tree_digest(out, skip_manifest=True) == tree_digest(reference, skip_manifest=True)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, check=False)


def test_merge_on_a_full_disk_stops_clearly_and_resumes(tiny_llama, inputs, tmp_path, monkeypatch):
    from eagle_fast.pipeline import merge as M

    data, _ = inputs
    extract(_cfg(tiny_llama, data, tmp_path / "single", supervision="lse"))
    nodes = [tmp_path / f"node{i}" for i in range(2)]
    for i, node in enumerate(nodes):
        extract(_cfg(tiny_llama, data, node, supervision="lse", shard=f"{i}/2"))
    real_copy = M.shutil.copyfile
    copied = []

    def copyfile(src, dst):  # across filesystems (no hard link), and the disk fills after one file
        if copied:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        copied.append(src)
        return real_copy(src, dst)

    monkeypatch.setattr(M.os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device")))
    monkeypatch.setattr(M.shutil, "copyfile", copyfile)
    out = tmp_path / "merged"
    with pytest.raises(UserError, match=r"the disk filled while bringing .* files, about .* are still to be "
                                        r"brought; those brought so far are kept") as exc:
        M.merge(str(out), [str(n) for n in nodes])
    assert "re-run the same `eagle-fast merge`" in exc.value.fix
    monkeypatch.undo()
    M.merge(str(out), [str(n) for n in nodes])
    assert tree_digest(out, skip_manifest=True) == tree_digest(tmp_path / "single", skip_manifest=True)
