"""`eagle-fast serve` against NeMo AutoModel 0.7.0's own remote-target client (loopback only).

- NeMo's `RemoteEagle3TargetModel` (model_info, get_input_embeddings, set_vocab_mapping,
  generate_batch, generate_batch_async) gets, for right-padded batches, what NeMo's in-process
  `compute_supervision(HFEagle3TargetModel(...))` computes on the same checkpoint: every key,
  shape and dtype; aux on real positions, target_probs on positions a token follows (zero
  elsewhere), position_mask / input_ids / loss_mask everywhere.
- Two clients with three batches in flight each: one engine call serves all six, and every
  result is its own request's.
- Every bad input gets its status and message, and the next good request succeeds; an engine
  failure gets a 500 and the next request rebuilds it (or a 503 saying why it cannot).
- Lifecycle: --exit-when-idle stops the server; SIGTERM lets an in-flight request finish, then
  stops the engine's processes and removes its capture directory (vLLM when installed, else hf).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _runner_helpers import make_batch
from conftest import RUNNER_AUX_IDS

requests = pytest.importorskip("requests")
nemo_remote = pytest.importorskip(
    "nemo_automodel.components.speculative.eagle.remote.client",
    reason="nemo-automodel==0.7.0 (installed --no-deps, plus datasets and pillow) is not importable",
)
from nemo_automodel.components.speculative.eagle.remote import wire as nemo_wire

from eagle_fast.serve.app import ServeConfig, TargetServer

KEYS = ["aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask"]
V = 1031
AUX = ",".join(map(str, RUNNER_AUX_IDS))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, timeout: float = 60.0, proc=None) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            r = requests.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy after {timeout} s")


class Faults:
    """Engine faults a test can switch on: the next capture raises; builds are refused."""

    def __init__(self):
        self.fail_next_capture = False
        self.refuse_builds = False
        self.builds = 0

    def factory(self, engine, model, dtype, max_len):
        from eagle_fast import HFTargetRunner

        if self.refuse_builds:
            raise RuntimeError("injected: no engine can start")
        runner = HFTargetRunner.build(model, dtype=dtype)
        capture = runner._capture

        def faulty(sequences):
            if self.fail_next_capture:
                self.fail_next_capture = False
                raise RuntimeError("injected engine fault")
            return capture(sequences)

        runner._capture = faulty
        self.builds += 1
        return runner


class Running:
    """A TargetServer on a free loopback port, run by uvicorn in a thread."""

    def __init__(self, model, **kw):
        self.faults = Faults()
        cfg = ServeConfig(model=str(model), engine="hf", aux_layers=AUX, port=_free_port(), **kw)
        self.server = TargetServer(cfg, runner_factory=self.faults.factory)
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.uv = self.server.make_uvicorn()
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        _wait_healthy(self.url)

    def client(self, copies: int = 1):
        return nemo_remote.RemoteEagle3TargetModel([self.url] * copies, device="cpu", max_retries=0)

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.server.engine.runner is None, "the engine outlived the server"


@pytest.fixture(scope="module")
def served(tiny_llama):
    running = Running(tiny_llama)
    yield running
    running.stop()


def _mapping(seed: int = 3, size: int = 600):
    g = torch.Generator().manual_seed(seed)
    selected = torch.randperm(V, generator=g)[:size]  # NOT sorted: columns follow the client's order
    mask = torch.zeros(V, dtype=torch.bool)
    mask[selected] = True
    return selected, mask


def _batch(seed: int, lengths=(9, 14, 1, 6)):
    ids, am = make_batch(lengths, vocab=V, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    lm = am * (torch.rand(am.shape, generator=g) < 0.8).long()
    return ids, am, lm


def _check(got: dict, ref: dict, am: torch.Tensor, *, probs_rtol: float = 1e-4, name: str) -> None:
    keep = am.bool()
    followed = torch.cat((keep[:, 1:], torch.zeros_like(keep[:, :1])), dim=1)  # a token follows
    for k in KEYS:
        assert got[k].shape == ref[k].shape, f"{name}.{k}: shape {tuple(got[k].shape)} vs {tuple(ref[k].shape)}"
    for k in ("aux_hidden_states", "position_mask", "input_ids", "loss_mask"):
        assert got[k].dtype == ref[k].dtype, f"{name}.{k}: {got[k].dtype} vs {ref[k].dtype}"
    assert_close(got["aux_hidden_states"][keep], ref["aux_hidden_states"][keep], atol=1e-5, rtol=1e-4,
                 name=f"{name}.aux")
    assert_close(got["target_probs"][followed], ref["target_probs"][followed], atol=1e-6, rtol=probs_rtol,
                 name=f"{name}.target_probs")
    assert not got["target_probs"][~followed].any(), f"{name}: target_probs not zero where no token follows"
    assert_ids_equal(got["position_mask"], ref["position_mask"], name=f"{name}.position_mask")
    assert got["position_mask"].any(), "the test needs supervised positions"
    assert_ids_equal(got["input_ids"], ref["input_ids"], name=f"{name}.input_ids")
    assert_ids_equal(got["loss_mask"], ref["loss_mask"], name=f"{name}.loss_mask")


def _as_dict(batch) -> dict:
    return {k: getattr(batch, k) for k in KEYS}


def _post(url: str, endpoint: str, body: bytes) -> requests.Response:
    return requests.post(f"{url}/{endpoint}", data=body, timeout=60,
                         headers={"Content-Type": "application/octet-stream"})


def _generate_body(ids, am, lm) -> bytes:
    return nemo_wire.encode_to_bytes({"input_ids": ids, "attention_mask": am, "loss_mask": lm})


# -- the wire format, byte for byte -------------------------------------------------------------------
def test_wire_format_is_nemos_byte_for_byte():
    from eagle_fast.serve import wire

    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(2, 7, generator=g).bfloat16(),
               "none": None, "bool": torch.rand(4, 1, generator=g) > 0.5, "i64": torch.arange(6).view(2, 3),
               "scalar": torch.tensor(3.5, dtype=torch.float64),
               "noncontig": torch.randn(4, 6, generator=g).t(), "u8": torch.arange(5, dtype=torch.uint8)}
    blob = nemo_wire.encode_to_bytes(tensors)
    assert wire.encode(tensors) == blob
    assert wire.encoded_size(tensors) == len(blob)
    assert sum(len(memoryview(p)) for p in wire.encode_chunks(tensors, chunk_bytes=7)) == len(blob)
    ours, theirs = wire.decode(blob), nemo_wire.decode(blob)
    assert list(ours) == list(theirs)
    for k, t in theirs.items():
        assert (ours[k] is None) if t is None else (ours[k].dtype == t.dtype and torch.equal(ours[k], t)), k
    # an empty tensor (NeMo's own decoder refuses one: torch.frombuffer of 0 bytes)
    empty = wire.decode(wire.encode({"e": torch.zeros(0, 4, dtype=torch.int32)}))["e"]
    assert empty.shape == (0, 4) and empty.dtype == torch.int32


# -- NeMo's client against the server ------------------------------------------------------------
def test_nemo_client_gets_nemo_in_process_supervision(served, nemo_reference, hf_llama):
    client = served.client()
    info = client.model_info()
    assert {k: info[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size", "aux_layer_ids")} == {
        "num_hidden_layers": 4, "hidden_size": 128, "vocab_size": V, "aux_layer_ids": list(RUNNER_AUX_IDS)}
    emb = client.get_input_embeddings().weight
    assert torch.equal(emb, hf_llama.hf_model.get_input_embeddings().weight)

    selected, mask = _mapping()
    client.set_vocab_mapping(selected, mask)
    ids, am, lm = _batch(seed=11)
    ref = nemo_reference(selected, mask, ids, am, lm)
    got = client.generate_batch(ids, am, lm)
    assert got.target_probs.dtype == torch.float32 and got.logits is None
    assert got.attention_mask is not None and torch.equal(got.attention_mask, am)
    _check(_as_dict(got), ref, am, name="generate_batch")

    batches = [_batch(seed=s, lengths=ls) for s, ls in ((12, (5, 17, 3)), (13, (20,)))]
    handles = [client.generate_batch_async(*b) for b in batches]
    for (ids, am, lm), h in zip(batches, handles):
        _check(_as_dict(h.result(timeout=60)), nemo_reference(selected, mask, ids, am, lm), am, name="async")
    client.close()


def test_bf16_probs_halve_the_bytes(tiny_llama, nemo_reference):
    running = Running(tiny_llama, probs_dtype="bf16")
    try:
        client = running.client()
        selected, mask = _mapping(seed=5, size=300)
        client.set_vocab_mapping(selected, mask)
        ids, am, lm = _batch(seed=21)
        got = client.generate_batch(ids, am, lm)
        assert got.target_probs.dtype == torch.bfloat16
        _check(_as_dict(got), nemo_reference(selected, mask, ids, am, lm), am, probs_rtol=2 ** -8, name="bf16")
    finally:
        running.stop()


def test_two_clients_with_batches_in_flight_each_get_their_own(served, nemo_reference):
    selected, mask = _mapping()
    clients = [served.client(copies=3) for _ in range(2)]  # 3 URLs each: 3 requests in flight per client
    for c in clients:
        c.set_vocab_mapping(selected, mask)
    gate = threading.Event()
    blocker = served.server.batcher.call(lambda runner: gate.wait(30))  # hold the engine thread
    calls_before = served.server.batcher.stats["engine_calls"]
    work = [(c, _batch(seed=100 + 10 * i + j, lengths=(3 + i + 2 * j, 11 - j))) for i, c in enumerate(clients)
            for j in range(3)]
    handles = [c.generate_batch_async(*b) for c, b in work]
    t0 = time.monotonic()
    while served.server.batcher._queue.qsize() < len(work):
        assert time.monotonic() - t0 < 30, "the requests never reached the engine's queue"
        time.sleep(0.02)
    gate.set()
    blocker.result(timeout=30)
    for (c, (ids, am, lm)), h in zip(work, handles):
        _check(_as_dict(h.result(timeout=60)), nemo_reference(selected, mask, ids, am, lm), am, name="in flight")
    stats = served.server.batcher.stats
    assert stats["engine_calls"] == calls_before + 1, "six waiting requests should make one engine call"
    assert stats["largest_batch"] >= len(work)
    for c in clients:
        c.close()


# -- bad input never takes the server down ---------------------------------------------------------
def test_bad_inputs_get_4xx_naming_the_problem_and_the_server_keeps_serving(tiny_llama):
    running = Running(tiny_llama, max_len=64, max_batch_tokens=512)
    url = running.url
    try:
        good = _batch(seed=31)
        r = _post(url, "generate", _generate_body(*good))
        assert r.status_code == 409 and "set_vocab_mapping" in r.json()["error"], r.text
        selected, mask = _mapping()
        bad_mappings = [
            ({"selected_token_ids": torch.tensor([0, V]), "selected_token_mask": mask}, "outside the target vocabulary"),
            ({"selected_token_ids": selected, "selected_token_mask": mask[:-1]}, "vocabulary size"),
            ({"selected_token_ids": torch.tensor([4, 4]), "selected_token_mask": mask}, "repeated"),
        ]
        for body, words in bad_mappings:
            r = _post(url, "set_vocab_mapping", nemo_wire.encode_to_bytes(body))
            assert r.status_code == 422 and words in r.json()["error"], (words, r.status_code, r.text)
        r = _post(url, "set_vocab_mapping",
                  nemo_wire.encode_to_bytes({"selected_token_ids": selected, "selected_token_mask": mask}))
        assert r.status_code == 200, r.text

        ids, am, lm = good
        left = torch.flip(am, dims=[1])
        long_row = torch.randint(10, V, (1, 100))
        cases = [
            (b"not a wire blob", 400, "wire format"),
            (_generate_body(ids, am, lm)[:-5], 400, "truncated"),
            (_generate_body(ids.float(), am, lm), 422, "integer"),
            (_generate_body(ids[0], am[0], lm[0]), 422, "rank 2"),
            (_generate_body(ids, am[:, :5], lm), 422, "shape"),
            (_generate_body(torch.where(am.bool(), ids, ids) + V, am, lm), 422, "outside the target vocabulary"),
            (_generate_body(ids, left, lm), 422, "right-padded"),
            (nemo_wire.encode_to_bytes({"input_ids": ids, "attention_mask": am}), 422, "'loss_mask' is missing"),
            (nemo_wire.encode_to_bytes({"input_ids": ids, "attention_mask": am, "loss_mask": lm,
                                        "seq_lens": am.sum(1)}), 422, "unsupported key"),
            (_generate_body(*(torch.ones(2, 300, dtype=torch.long),) * 3), 413, "budget"),
            (_generate_body(long_row, torch.ones_like(long_row), torch.ones_like(long_row)), 413, "--max-len"),
        ]
        for body, status, words in cases:
            r = _post(url, "generate", body)
            assert r.status_code == status and words in r.json()["error"], (words, r.status_code, r.text)
            assert r.json()["fix"], r.text
            ok = _post(url, "generate", _generate_body(ids, am, lm))
            assert ok.status_code == 200, (words, ok.text)
            out = nemo_wire.decode(ok.content)
            assert list(out) == KEYS and out["target_probs"].shape == (*ids.shape, selected.numel())

        # NeMo's client sees the 4xx as an HTTPError (not retried), then keeps working
        client = running.client()
        with pytest.raises(requests.HTTPError, match="422"):
            client.generate_batch(ids + V, am, lm)
        assert client.generate_batch(ids, am, lm).target_probs.shape == (*ids.shape, selected.numel())

        # an engine failure: 500, and the next request rebuilds the engine
        running.faults.fail_next_capture = True
        r = _post(url, "generate", _generate_body(ids, am, lm))
        assert r.status_code == 500 and "injected engine fault" in r.json()["error"], r.text
        assert requests.get(url + "/health").status_code == 503
        builds = running.faults.builds
        assert _post(url, "generate", _generate_body(ids, am, lm)).status_code == 200
        assert running.faults.builds == builds + 1
        # ... or reports why it cannot
        running.faults.fail_next_capture = running.faults.refuse_builds = True
        assert _post(url, "generate", _generate_body(ids, am, lm)).status_code == 500
        r = _post(url, "generate", _generate_body(ids, am, lm))
        assert r.status_code == 503 and "no engine can start" in r.json()["error"], r.text
        assert "no engine can start" in requests.get(url + "/health").json()["error"]
        running.faults.refuse_builds = False
        assert _post(url, "generate", _generate_body(ids, am, lm)).status_code == 200
        assert requests.get(url + "/health").status_code == 200
        for endpoint, want in (("init_nccl", {"status": "disabled"}), ("heartbeat", {"status": "ok"})):
            assert _post(url, endpoint, b"{}").json() == want
    finally:
        running.stop()


# -- lifecycle -------------------------------------------------------------------------------------
def test_exit_when_idle_stops_the_server(tiny_llama):
    running = Running(tiny_llama, exit_when_idle=1.0)
    assert _post(running.url, "heartbeat", b"{}").status_code == 200
    running.thread.join(15)
    assert not running.thread.is_alive(), "--exit-when-idle 1 did not stop the server"
    assert running.server.engine.runner is None


ENGINE = "vllm" if importlib.util.find_spec("vllm") else "hf"  # the one engine start with processes to stop


def test_cli_sigterm_drains_the_request_in_flight_and_stops_the_engine(tiny_llama):
    import psutil

    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle_fast", "serve", "--model", str(tiny_llama), "--engine", ENGINE,
         "--aux-layers", AUX, "--port", str(port)],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, timeout=180, proc=proc)
        engine_procs = psutil.Process(proc.pid).children(recursive=True)
        captures = glob.glob(f"/dev/shm/eagle_fast-hs-{proc.pid}.*") + glob.glob(
            f"{tempfile.gettempdir()}/eagle_fast-hs-{proc.pid}.*")
        if ENGINE == "vllm":
            assert engine_procs and captures, "expected vLLM's engine processes and a capture directory"
        selected, mask = _mapping()
        client = nemo_remote.RemoteEagle3TargetModel([url], device="cpu", max_retries=0)
        info = client.model_info()
        assert info["engine"] == ENGINE
        if ENGINE == "vllm":  # checked against the engine's own log-probs before it served
            assert info["engine_check"]["positions"] > 0, info["engine_check"]
            assert info["engine_check"]["max_abs_err"] <= info["engine_check"]["tolerance"]
        client.set_vocab_mapping(selected, mask)
        ids, am, lm = _batch(seed=41, lengths=(1000,) * 4)  # a second or more of work: in flight at SIGTERM
        handle = client.generate_batch_async(ids, am, lm)
        t0 = time.monotonic()
        while requests.get(url + "/health", timeout=10).json()["in_flight"] < 1:
            assert time.monotonic() - t0 < 30 and not handle._future.done(), "the request never arrived"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        got = handle.result(timeout=120)
        assert got.target_probs.shape == (*ids.shape, selected.numel())
        assert got.position_mask.any() and got.aux_hidden_states[0, -1].abs().sum() > 0
        rc = proc.wait(timeout=60)
        err = proc.stderr.read()
        assert rc == 0, err[-3000:]
        assert "SIGTERM: draining 1 request(s) in flight" in err and "stopped" in err, err[-3000:]
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=2)
        psutil.wait_procs(engine_procs, timeout=10)
        alive = [p.pid for p in engine_procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"engine processes {alive} outlived the server"
        assert not [c for c in captures if os.path.exists(c)], "the capture directory was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the server runs the Triton head")
def test_cli_hf_server_on_a_cpu_maps_no_triton_and_serves_nemos_supervision(tiny_llama, nemo_reference):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: nothing to keep out")
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle_fast", "serve", "--model", str(tiny_llama), "--engine", "hf",
         "--aux-layers", AUX, "--port", str(port)],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, timeout=120, proc=proc)
        client = nemo_remote.RemoteEagle3TargetModel([url], device="cpu", max_retries=0)
        selected, mask = _mapping(seed=8)
        client.set_vocab_mapping(selected, mask)
        ids, am, lm = _batch(seed=43)
        _check(_as_dict(client.generate_batch(ids, am, lm)), nemo_reference(selected, mask, ids, am, lm), am,
               name="cli hf")
        maps = Path(f"/proc/{proc.pid}/maps").read_text()  # the engine and transformers are loaded by now
        assert "libtorch_cpu" in maps and "libtriton" not in maps, "the CPU hf server mapped libtriton"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_keep_triton_out_leaves_vllm_and_a_loaded_triton_alone(monkeypatch):
    from eagle_fast.serve.app import keep_triton_out

    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert keep_triton_out("vllm") is False and "triton" not in sys.modules
    loaded = object()
    monkeypatch.setitem(sys.modules, "triton", loaded)
    assert keep_triton_out("hf") is False and sys.modules["triton"] is loaded
