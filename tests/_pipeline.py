"""Helpers shared by the pipeline tests (extract, cli, vocab, formats, dataset, e2e)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

DEMO_DATA = Path(__file__).resolve().parents[1] / "eagle_fast" / "data" / "demo_chat.jsonl"


def chat_lines(n: int, start: int = 0) -> list[str]:
    lines = DEMO_DATA.read_text().splitlines()
    return lines[start: start + n]


def write_jsonl(path: Path, lines: list) -> Path:
    """Write records (dicts are JSON-encoded, strings written as they are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def mixed_jsonl(path: Path, n_chat: int = 16) -> Path:
    """Chat lines from the bundled data plus a `text` line and an `input_ids` line."""
    lines = chat_lines(n_chat)
    lines.insert(3, json.dumps({"text": "The quick brown fox jumps over the lazy dog. 1 2 3"}))
    lines.insert(7, json.dumps({"input_ids": [5, 17, 99, 230, 4, 8, 15, 16, 23, 42],
                                "loss_mask": [0, 0, 0, 1, 1, 1, 1, 0, 1, 1]}))
    return write_jsonl(path, lines)


def tree_digest(root: Path, skip_manifest: bool = False) -> dict[str, str]:
    """relative path -> sha256 of every file under root (hidden temp files included)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            if skip_manifest and rel.startswith("manifest"):
                continue
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def manifest_core(root: Path, name: str = "manifest.json") -> dict:
    """The manifest without per-invocation fields (run statistics), ours or inside NeMo's."""
    m = json.loads((Path(root) / name).read_text())
    inner = m.get("eagle_fast", m)
    inner = {k: v for k, v in inner.items() if k != "runs"}
    if "eagle_fast" in m:
        return {**{k: v for k, v in m.items() if k != "eagle_fast"}, "eagle_fast": inner}
    return inner


def assert_same_records(got: Path, want: Path) -> None:
    """Two extractions are the same dataset: every data file byte-identical, and --out's manifest and
    (several records) each record's own equal but for their run statistics."""
    def data_files(root):
        return {k: v for k, v in tree_digest(root).items() if not k.rsplit("/", 1)[-1].startswith("manifest")}

    assert data_files(got) == data_files(want)
    assert manifest_core(got) == manifest_core(want)
    for part in json.loads((Path(want) / "manifest.json").read_text()).get("parts", []):
        assert manifest_core(Path(got) / part["dir"]) == manifest_core(Path(want) / part["dir"]), part["dir"]


class SharedRunner:
    """Hands one real runner to several `extract` calls: `close()` is deferred to `really_close()`."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def capture_stream(self, batches, depth=1):  # the pipeline runs ahead only through the class's own
        return self._runner.capture_stream(batches, depth)

    def close(self) -> None:
        pass

    def really_close(self) -> None:
        self._runner.close()


def interrupted_after_first_shard(cfg) -> dict:
    """`extract(cfg)` stopped by a KeyboardInterrupt once its first shard is written (`on_shard`,
    in process): the manifest it leaves, which must not say complete."""
    import pytest

    from eagle_fast import extract

    def crash(index):
        if index == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract(cfg, on_shard=crash)
    manifest = json.loads((Path(cfg.out) / "manifest.json").read_text())
    assert not manifest["complete"], manifest
    return manifest


def resumes_to_the_same_bytes(cfg_of, root: Path) -> Path:
    """`cfg_of(out)` extracted whole into root/ref, then interrupted after its first shard into
    root/run and run again: the resumed run ran fewer samples and wrote ref's files byte for byte
    (manifests aside). Returns root/run."""
    from eagle_fast import extract

    extract(cfg_of(root / "ref"))
    interrupted_after_first_shard(cfg_of(root / "run"))
    again = extract(cfg_of(root / "run"))
    assert again.complete and again.run_samples < again.samples
    assert tree_digest(root / "run", skip_manifest=True) == tree_digest(root / "ref", skip_manifest=True)
    return root / "run"


def run_main(capsys, *argv) -> tuple[int, str, str]:
    """`eagle-fast ARGV` in process: (exit code, stdout, stderr); argparse's exits count too."""
    from eagle_fast.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# `eagle-fast` with a runner factory whose engine calls hold once a shard is in the manifest
# (MODE "held": the test kills the run there) or fail after a few (MODE "fail"); on Ray it
# travels to the workers by value. Run as `python driver.py MODE eagle-fast-args...`.
def wait_for_shards(proc, out: Path, n: int, timeout: float) -> None:
    """Poll until the run `proc` writes to `out` has at least `n` shards in its manifest, it ends,
    or `timeout` seconds pass (the caller then kills it mid-run and checks what it left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if len(json.loads((Path(out) / "manifest.json").read_text())["shards"]) >= n:
                return
        except (OSError, ValueError, KeyError):
            pass  # not written yet, or mid-rename
        time.sleep(0.05)


def killed_and_resumed(argv, out: Path, timeout: float = 300) -> None:
    """HELD_DRIVER's run of `argv(mode, out)` killed with SIGKILL once a shard is committed, then the
    same command again to the end: the killed run must have left an incomplete manifest."""
    proc = subprocess.Popen(argv("held", out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_shards(proc, out, 1, timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    m = json.loads((Path(out) / "manifest.json").read_text())
    assert not m["complete"] and 1 <= len(m["shards"]) < m["num_shards"]
    again = subprocess.run(argv("fast", out), check=False, capture_output=True, text=True, timeout=timeout)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]


HELD_DRIVER = r"""
import json, sys, time
import eagle_fast.pipeline.run as ex

MODE = sys.argv[1]
MANIFEST = sys.argv[sys.argv.index("--out") + 1] + "/manifest.json"
_build = ex.default_runner_factory


def shards_done():
    try:
        with open(MANIFEST) as f:
            return len(json.load(f)["shards"])
    except (OSError, ValueError, KeyError):
        return 0  # not written yet


class Runner:
    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    calls = 0

    def capture(self, seqs):
        self.calls += 1
        if MODE == "fail" and self.calls == 5:  # each worker's fifth call: after a shard or two
            raise RuntimeError("engine died")
        deadline = time.monotonic() + 300
        while MODE == "held" and shards_done() >= 1:  # wait here, mid-run, for the kill
            if time.monotonic() > deadline:
                raise RuntimeError("the test never killed the run")
            time.sleep(0.05)
        return self.runner.capture(seqs)


ex.default_runner_factory = lambda *args, **kwargs: Runner(_build(*args, **kwargs))

if __name__ == "__main__":
    from eagle_fast.cli import main

    sys.exit(main(sys.argv[2:]))
"""
