"""`eagle-fast serve` streams a `generate` response while the head still computes it.

- The body begins before the engine has finished the request: with the head held from its
  third group on, a raw client already reads the aux entry and the first group's probabilities.
- Responses made of many head groups (pieces that split rows, rows that end inside a group,
  several requests in one engine call) are still exactly NeMo's in-process supervision.
- A head failure after the body has begun closes the connection before the body's last chunk:
  NeMo's client raises for that request (never partial data), and the next request rebuilds
  the engine and succeeds.
"""

from __future__ import annotations

import struct
import threading
import time

import pytest
import torch
from test_serve import Running, _as_dict, _batch, _check, _generate_body, _mapping

requests = pytest.importorskip("requests")

from eagle_fast.serve import wire
from eagle_fast.serve.batching import StreamedFields
from eagle_fast.serve.protocol import SUPERVISION_KEYS
from eagle_fast.supervision import GROUP_TOKENS, MIN_TOKENS, plan_supervision_groups


class HeadGate:
    """Wraps a runner's head: every call from the `hold_at`-th on waits for `release` (on a CPU
    `supervise` runs a group per torch thread at once, so calls start in any order within that
    window); call `fail_at` raises. `returned` counts the calls that have returned."""

    def __init__(self, runner, hold_at: int | None = None, fail_at: int | None = None):
        self.calls, self.returned, self.hold_at, self.fail_at = 0, 0, hold_at, fail_at
        self.held, self.release = threading.Event(), threading.Event()
        lock = threading.Lock()
        head, compute = runner.head, runner.head.compute

        def gated(*args, **kwargs):
            with lock:
                self.calls += 1
                call = self.calls
            if call == self.fail_at:
                raise RuntimeError("injected head fault")
            if self.hold_at is not None and call >= self.hold_at:
                self.held.set()
                assert self.release.wait(30), "the test never released the head"
            out = compute(*args, **kwargs)
            with lock:
                self.returned += 1
            return out

        head.compute = gated


@pytest.fixture
def small_groups(monkeypatch):
    """Head groups of MIN_TOKENS tokens, so a small batch streams in several."""
    monkeypatch.setattr(StreamedFields, "staging_bytes", 1)


@pytest.fixture(scope="module")
def running(tiny_llama):
    r = Running(tiny_llama)
    yield r
    r.stop()


def _runner(running):
    return running.server.batcher.call(lambda runner: runner).result(timeout=60)


class Body:
    """A streamed response body read piece by piece; `seen` keeps every byte read."""

    def __init__(self, raw):
        self.raw, self.seen = raw, bytearray()

    def read(self, n: int | None = None) -> bytes:
        piece = self.raw.read(n)
        self.seen += piece
        return piece

    def entry_header(self) -> tuple[str, list[int], int]:
        """(key, shape, nbytes) of the next wire entry."""
        key = self.read(struct.unpack("<I", self.read(4))[0]).decode()
        flags, _code, ndim = self.read(3)
        assert flags == 0, key
        shape = list(struct.unpack(f"<{ndim}q", self.read(8 * ndim)))
        return key, shape, struct.unpack("<Q", self.read(8))[0]


def test_the_body_begins_before_the_head_has_finished(running, small_groups):
    selected, mask = _mapping()
    client = running.client()
    client.set_vocab_mapping(selected, mask)
    ids, am, lm = _batch(seed=51, lengths=(20, 20))
    n_groups = len(plan_supervision_groups([20, 20], 1, 0, 1, max_tokens=GROUP_TOKENS, min_tokens=MIN_TOKENS))
    assert n_groups >= 3
    gate = HeadGate(_runner(running), hold_at=3)  # groups 0 and 1 run, in either order
    try:
        r = requests.post(f"{running.url}/generate", data=_generate_body(ids, am, lm), stream=True, timeout=20)
        assert r.status_code == 200
        assert gate.held.wait(30), "the head never reached its third group"
        # all of this was computed before the held group: each read blocks (and times out,
        # failing the test) unless the server sent it while the head was still running
        body = Body(r.raw)
        assert struct.unpack("<I", body.read(4))[0] == 0x4E4D4554
        key, shape, nbytes = body.entry_header()
        assert key == "aux_hidden_states" and shape[:2] == list(ids.shape)
        assert len(body.read(nbytes)) == nbytes
        key, shape, nbytes = body.entry_header()
        assert key == "target_probs" and shape == [*ids.shape, selected.numel()]
        row = torch.frombuffer(bytearray(body.read(4 * selected.numel())), dtype=torch.float32)
        assert abs(float(row.sum()) - 1.0) < 1e-4, "the first slot's probabilities do not sum to one"
        assert not gate.release.is_set() and gate.returned < n_groups  # the head has not finished
    finally:
        gate.release.set()
    body.read()
    # the whole blob came, and nothing after it
    assert list(wire.decode(bytes(body.seen))) == list(SUPERVISION_KEYS)
    assert gate.calls == n_groups
    client.close()


def test_many_groups_and_requests_per_call_are_nemos_supervision(running, small_groups, nemo_reference):
    selected, mask = _mapping(seed=8)
    client = running.client(copies=3)
    client.set_vocab_mapping(selected, mask)
    gate = threading.Event()
    blocker = running.server.batcher.call(lambda runner: gate.wait(30))  # queue all three together
    calls = running.server.batcher.stats["engine_calls"]
    work = [_batch(seed=60 + j, lengths=ls) for j, ls in enumerate(((9, 14, 1, 6), (33,), (2, 17, 15)))]
    handles = [client.generate_batch_async(*b) for b in work]
    t0 = time.monotonic()
    while running.server.batcher._queue.qsize() < len(work):
        assert time.monotonic() - t0 < 30, "the requests never reached the engine's queue"
        time.sleep(0.02)
    gate.set()
    blocker.result(timeout=30)
    for (ids, am, lm), h in zip(work, handles):
        _check(_as_dict(h.result(timeout=60)), nemo_reference(selected, mask, ids, am, lm), am, name="groups")
    assert running.server.batcher.stats["engine_calls"] == calls + 1
    client.close()


def test_a_head_failure_mid_body_fails_that_request_and_the_next_rebuilds(running, small_groups, nemo_reference):
    selected, mask = _mapping()
    client = running.client()
    client.set_vocab_mapping(selected, mask)
    ids, am, lm = _batch(seed=71, lengths=(20, 20))
    builds = running.faults.builds
    HeadGate(_runner(running), fail_at=2)  # the body has begun by then
    with pytest.raises(requests.RequestException):
        client.generate_batch(ids, am, lm)
    assert running.server.batcher.stats["failures"] >= 1
    got = client.generate_batch(ids, am, lm)
    assert running.faults.builds == builds + 1, "the failed engine was not rebuilt"
    _check(_as_dict(got), nemo_reference(selected, mask, ids, am, lm), am, name="after the failure")
    client.close()
