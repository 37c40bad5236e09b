"""`extract --ray`: Ray actors pulling shards give a single process's bytes, and faults lose nothing.

One local Ray instance (2 CPUs) serves the in-process tests; the CLI runs in subprocesses start
and stop their own, and are checked for Ray processes left behind (every process they start
inherits a marker in its environment). All on the transformers engine and the tiny Llama, which
are deterministic across processes at one thread count (every engine here runs 1 torch thread,
as each worker does), so "the same bytes" is exact: every data file identical,
and the manifest identical but for its `runs` list (per-invocation statistics), as for resumed
and merged runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from _pipeline import (
    HELD_DRIVER,
    assert_same_records,
    manifest_core,
    mixed_jsonl,
    tree_digest,
    wait_for_shards,
)

from eagle_fast import ExtractConfig, extract
from eagle_fast.cli import main
from eagle_fast.errors import UserError
from eagle_fast.pipeline.distributed import RayOptions
from eagle_fast.runners.factory import default_runner_factory

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'eagle-fast[ray]')")

SETTINGS = {"engine": "hf", "dtype": "fp32", "max_len": 96, "shard_size": 4, "batch_tokens": 100,
            "supervision": "topk", "k": 8, "aux_layers": "0,1,3"}


def cfg_for(model, data, out, **kw) -> ExtractConfig:
    return ExtractConfig(model=str(model), data=str(data), out=str(out), progress_tty=False,
                         **{**SETTINGS, **kw})


def argv_for(model, data, out) -> list[str]:
    argv = ["extract", "--model", str(model), "--data", str(data), "--out", str(out)]
    for key, value in SETTINGS.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def assert_same_dataset(got: Path, want: Path) -> None:
    assert tree_digest(got, skip_manifest=True) == tree_digest(want, skip_manifest=True)
    assert manifest_core(got) == manifest_core(want)
    assert not [p for p in got.iterdir() if p.name.startswith(".")], "temp or probe files left"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every engine in this module runs 1 torch thread, as each Ray worker here does (2 workers on
    2 CPUs). On AVX2, MKL's fp32 GEMM rounds some row counts (5, 9, 10, ...) differently with
    another thread count (measured on an AMD EPYC), so "the same bytes" is a promise for equal
    thread counts (docs/ray.md, "Same bytes"), and the single-process runs here match the workers'."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_llama):
    """32 samples in 8 shards, and the single-process dataset they make."""
    root = tmp_path_factory.mktemp("ray")
    data = mixed_jsonl(root / "d.jsonl", n_chat=30)
    ref = extract(cfg_for(tiny_llama, data, root / "ref"))
    assert ref.complete and ref.shards_total == 8
    return data, root / "ref"


@pytest.fixture(scope="module")
def local_ray():
    """One small local Ray instance; `extract(..., ray=...)` uses it rather than starting its own."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             logging_level="WARNING")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting factory
    yield ray
    ray.shutdown()


class _Dying:
    """A runner whose process SIGKILLs itself in its second engine call, once for the whole test
    (the marker file, created exclusively, says it happened): a worker killed mid-shard."""

    def __init__(self, runner, marker: str):
        self._runner, self._marker, self._calls = runner, marker, 0

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def capture(self, seqs):
        self._calls += 1
        if self._calls == 2:
            try:
                os.close(os.open(self._marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return self._runner.capture(seqs)


class _DieOnce:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __call__(self, *args):
        return _Dying(default_runner_factory(*args), self.marker)


class _Crash(Exception):
    pass


def _crash_at(index):
    def hook(i):
        if i == index:
            raise _Crash
    return hook


# ----------------------------------------------------------------------------- in process


def test_two_workers_write_the_single_process_bytes(inputs, local_ray, tiny_llama, tmp_path):
    data, ref = inputs
    s = extract(cfg_for(tiny_llama, data, tmp_path / "out"), ray=RayOptions(workers=2))
    assert s.complete and s.run_samples == 32
    assert_same_dataset(tmp_path / "out", ref)
    run = json.loads((tmp_path / "out" / "manifest.json").read_text())["runs"][-1]
    assert run["ray_workers"] == 2 and run["worker_restarts"] == 0
    # each worker's engine check, here skipped: transformers' captures are its own forward pass
    assert run["engine_checks"] == [{"skipped": "the hf engine: its captures are its own forward pass"}] * 2


def test_several_records_on_ray_give_one_processes_bytes(inputs, local_ray, tiny_llama, tmp_path):
    data, _ = inputs
    kw = {"layout": "native,specforge", "draft_types": "eagle3,dflash",
          "aux_layers": ["eagle3=0,1,3", "dflash=0,1,2,3"]}
    extract(cfg_for(tiny_llama, data, tmp_path / "ref", **kw))
    s = extract(cfg_for(tiny_llama, data, tmp_path / "out", **kw), ray=RayOptions(workers=2))
    assert s.complete and s.run_samples == 32
    assert_same_records(tmp_path / "out", tmp_path / "ref")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json", "native", "specforge"]


def test_started_in_one_process_finished_on_ray_with_a_worker_killed_mid_shard(
        inputs, local_ray, tiny_llama, tmp_path, capfd):
    data, ref = inputs
    with pytest.raises(_Crash):
        extract(cfg_for(tiny_llama, data, tmp_path / "out"), on_shard=_crash_at(1))
    done = len(json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"])
    assert 1 <= done <= 2
    marker = tmp_path / "killed-once"
    s = extract(cfg_for(tiny_llama, data, tmp_path / "out"), runner_factory=_DieOnce(marker),
                ray=RayOptions(workers=2))
    assert marker.exists() and s.complete and s.run_samples == 32 - 4 * done
    assert_same_dataset(tmp_path / "out", ref)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["runs"][-1]["worker_restarts"] == 1
    err = capfd.readouterr().err
    assert "died on shard" in err and "go back to the queue" in err and "Ray restarts the worker" in err, err


def test_a_worker_that_cannot_see_out_is_refused_before_writing(inputs, local_ray, tiny_llama, tmp_path):
    data, _ = inputs
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:  # the workers look for OUT where it is not mounted
        extract(cfg_for(tiny_llama, data, out), ray=RayOptions(workers=2, worker_out=str(tmp_path / "nfs")))
    assert "worker 0 on node" in e.value.cause and f"cannot see {out}" in e.value.cause, e.value.cause
    assert "every Ray node mounts" in e.value.fix
    assert not out.exists()


def test_without_ray_installed_the_flag_says_how_to_get_it(inputs, tiny_llama, tmp_path, monkeypatch, capsys):
    data, _ = inputs
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(argv_for(tiny_llama, data, tmp_path / "out") + ["--ray"]) == 2
    err = capsys.readouterr().err
    assert "Ray is not installed" in err and "pip install 'eagle-fast[ray]'" in err, err
    assert not (tmp_path / "out").exists()
    assert main(argv_for(tiny_llama, data, tmp_path / "out") + ["--ray-workers", "2"]) == 2
    assert "add --ray" in capsys.readouterr().err


def test_an_unreachable_cluster_is_refused_at_once(inputs, tiny_llama, tmp_path, monkeypatch, capsys):
    data, _ = inputs
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `eagle-fast` process
    t0 = time.monotonic()
    assert main(argv_for(tiny_llama, data, tmp_path / "out") + ["--ray", "--ray-address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Ray cluster at 127.0.0.1:1" in err and "ray start --head" in err, err
    assert time.monotonic() - t0 < 30 and not (tmp_path / "out").exists()


# ------------------------------------------------------------------- the CLI, its own Ray

def _ray_processes(mark: str) -> list[str]:
    """Command lines of live processes that inherited our marker (Ray's included)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"EAGLE_FAST_TEST_RUN={mark}".encode() in env.read_bytes().split(b"\0"):
                found.append((env.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:
            continue
    return found


def _none_left(mark: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while (left := _ray_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left after the run: {left}"


def _cli(tmp_path: Path, mode: str, argv: list[str], mark: str, **kw) -> subprocess.Popen:
    script = tmp_path / "driver.py"
    script.write_text(HELD_DRIVER)
    env = {**os.environ, "EAGLE_FAST_TEST_RUN": mark, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, str(script), mode, *argv, "--ray", "--ray-workers", "2"], env=env,
                            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_cli_driver_killed_mid_run_resumes_and_leaves_no_ray_process(inputs, tiny_llama, tmp_path):
    data, ref = inputs
    out = tmp_path / "out"
    argv = argv_for(tiny_llama, data, out)
    mark = uuid.uuid4().hex
    proc = _cli(tmp_path, "held", argv, mark)
    manifest = out / "manifest.json"
    wait_for_shards(proc, out, 1, timeout=120)
    assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.communicate()[0][-3000:]}"
    proc.kill()  # SIGKILL the driver only: Ray's processes must follow it
    proc.wait()
    m = json.loads(manifest.read_text())
    assert not m["complete"] and len(m["shards"]) < 8
    resumed = uuid.uuid4().hex
    again = _cli(tmp_path, "fast", argv, resumed)  # the same command, at once: a new local instance
    log = again.communicate(timeout=300)[0]
    assert again.returncode == 0, log[-3000:]
    assert "starting a local Ray instance" in log and "8/8 shards" in log, log[-3000:]
    _none_left(resumed)
    # Most of the killed run's go at once; Ray's two agents may first spend up to a minute
    # reporting to the dead GCS.
    _none_left(mark, within=90)
    assert_same_dataset(out, ref)


def test_cli_failed_run_leaves_no_ray_process_and_resumes_without_ray(inputs, tiny_llama, tmp_path):
    data, ref = inputs
    out = tmp_path / "out"
    mark = uuid.uuid4().hex
    proc = _cli(tmp_path, "fail", argv_for(tiny_llama, data, out), mark)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1 and "engine died" in log, log[-3000:]
    _none_left(mark)
    m = json.loads((out / "manifest.json").read_text())
    assert not m["complete"] and len(m["shards"]) < 8
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp files left"
    s = extract(cfg_for(tiny_llama, data, out))
    assert s.complete and s.run_samples == 32 - sum(r["samples"] for r in m["shards"])
    assert_same_dataset(out, ref)
