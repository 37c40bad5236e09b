"""On a CPU, `supervise` computes one head group per torch thread at once (each on one thread).

- Every destination gets the sequential path's bits: padded fields (in-process supervision),
  per-row fields (the extraction, whose row parts are joined in put order) and the server's
  streamed fields; the head really ran groups concurrently.
- Only the pool's threads run single-threaded: while the groups run, a thread that already ran
  torch and a thread started then both read their own count, and the caller's never changes.
- A group that raises fails the call with its own error.
- A profiler changes neither the scheduling nor the bits: the groups still run at once, and
  the profile holds the head's phase spans from both pool threads.
- One group, an explicit Triton impl (the interpreter on a CPU), CUDA-less inputs gone (all
  None) and one torch thread stay sequential.
"""

from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch
from _runner_helpers import draft_vocab, make_batch, rows
from eagle_fast.kernels import SPAN_PREFIX

from eagle_fast import supervision as SV


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Recorder:
    """Wraps head.compute: which threads ran it (by name: each call's pool names its two threads
    alike, while their idents are only reused by chance), and the most calls running at once."""

    def __init__(self, head, fail_at: int | None = None, when_both_run=None):
        self.threads, self.running, self.most, self.calls = set(), 0, 0, 0
        self.fail_at, self._lock, self._compute = fail_at, threading.Lock(), head.compute
        self.when_both_run = when_both_run
        self.both_in = threading.Barrier(2, timeout=5)

    def __call__(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
            call = self.calls
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            if call <= 2:  # the first two groups meet: they run at the same time, or this times out
                self.both_in.wait()
                if call == 1 and self.when_both_run is not None:
                    self.when_both_run()
            if call == self.fail_at:
                raise RuntimeError("injected head fault")
            assert torch.get_num_threads() == 1, "a parallel group runs more than one thread"
            return self._compute(*args, **kwargs)
        finally:
            with self._lock:
                self.running -= 1


def _finals(hf_llama, ids, mask):
    return [f for _, f in hf_llama.capture(rows(ids, mask))]


def test_parallel_groups_give_the_sequential_bits(hf_llama, two_threads):
    ids, mask = make_batch(lengths=(40, 33, 1, 50), seed=3)
    draft_ids = draft_vocab()
    kw = {"outputs": ("draft", "topk", "lse"), "draft_ids": draft_ids, "k": 4, "out_dtype": torch.float32}
    with mock.patch.object(SV, "GROUP_TOKENS", 16), mock.patch.object(SV, "group_workers", lambda *a: 1):
        want = hf_llama.forward_eagle3_supervision(ids, mask, **kw)
        want_rows = SV.RowFields(4)
        SV.supervise(hf_llama.head, _finals(hf_llama, ids, mask), kw["outputs"], want_rows,
                     draft_ids=draft_ids, k=4, out_dtype=torch.bfloat16)
    rec = Recorder(hf_llama.head)
    with mock.patch.object(SV, "GROUP_TOKENS", 16), mock.patch.object(hf_llama.head, "compute", rec):
        got = hf_llama.forward_eagle3_supervision(ids, mask, **kw)
        got_rows = SV.RowFields(4)
        SV.supervise(hf_llama.head, _finals(hf_llama, ids, mask), kw["outputs"], got_rows,
                     draft_ids=draft_ids, k=4, out_dtype=torch.bfloat16)
    assert rec.most == 2 and len(rec.threads) == 2, (rec.most, rec.threads)
    assert torch.get_num_threads() == 2
    for name in ("draft_logprobs", "argmax_in_draft", "argmax", "lse", "topk_ids", "topk_logprobs", "topk_tail",
                 "aux_hidden_states"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for g, w in zip(got_rows.rows(), want_rows.rows()):
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), name


def test_other_threads_keep_their_own_thread_count_while_groups_run(hf_llama, two_threads):
    # Read while both groups are running: a thread that already ran torch (its count is set)
    # and one started then (its count is the process-wide default a new thread takes).
    seen, started = {}, threading.Event()
    read, done = threading.Event(), threading.Event()

    def trainer_thread():
        torch.get_num_threads()
        started.set()
        read.wait(timeout=10)
        seen["a running thread"] = torch.get_num_threads()
        done.set()

    def fresh_thread():
        seen["a new thread"] = torch.get_num_threads()

    def while_both_run():
        read.set()
        assert done.wait(timeout=10)
        fresh = threading.Thread(target=fresh_thread)
        fresh.start()
        fresh.join()

    trainer = threading.Thread(target=trainer_thread)
    trainer.start()
    started.wait(timeout=10)
    ids, mask = make_batch(lengths=(40, 33), seed=7)
    rec = Recorder(hf_llama.head, when_both_run=while_both_run)
    with mock.patch.object(SV, "GROUP_TOKENS", 16), mock.patch.object(hf_llama.head, "compute", rec):
        hf_llama.forward_eagle3_supervision(ids, mask, outputs=("draft",), draft_ids=draft_vocab(),
                                            out_dtype=torch.float32)
    trainer.join()
    assert rec.most == 2, "the groups did not run at once"
    assert seen == {"a running thread": 2, "a new thread": 2}, seen
    fresh_thread()
    assert torch.get_num_threads() == 2 and seen["a new thread"] == 2


def test_a_failing_group_fails_the_call(hf_llama, two_threads):
    ids, mask = make_batch(lengths=(40, 33), seed=5)
    rec = Recorder(hf_llama.head, fail_at=2)
    with mock.patch.object(SV, "GROUP_TOKENS", 16), mock.patch.object(hf_llama.head, "compute", rec), \
            pytest.raises(RuntimeError, match="injected head fault"):
        hf_llama.forward_eagle3_supervision(ids, mask, outputs=("draft",), draft_ids=draft_vocab(),
                                            out_dtype=torch.float32)
    assert torch.get_num_threads() == 2


def test_a_profiler_changes_neither_the_scheduling_nor_the_bits(hf_llama, two_threads):
    ids, mask = make_batch(lengths=(40, 33, 20), seed=11)
    kw = {"outputs": ("draft", "lse"), "draft_ids": draft_vocab(), "out_dtype": torch.float32}
    with mock.patch.object(SV, "GROUP_TOKENS", 16):
        want = hf_llama.forward_eagle3_supervision(ids, mask, **kw)
        rec = Recorder(hf_llama.head)
        every_thread = torch.profiler._ExperimentalConfig(profile_all_threads=True)
        with mock.patch.object(hf_llama.head, "compute", rec), \
                torch.profiler.profile(experimental_config=every_thread) as prof:
            got = hf_llama.forward_eagle3_supervision(ids, mask, **kw)
    assert rec.most == 2 and len(rec.threads) == 2, (rec.most, rec.threads)
    for name in ("draft_logprobs", "argmax_in_draft", "argmax", "lse"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    gemm_threads = {e.thread for e in prof.events() if e.name == SPAN_PREFIX + "gemm"}
    assert len(gemm_threads) == 2, f"the profile holds head spans from {len(gemm_threads)} thread(s)"


def test_when_groups_stay_sequential(two_threads):
    cpu = [torch.zeros(3, 4)]
    assert SV.group_workers(cpu, 5, "auto") == 2 and SV.group_workers(cpu, 5, "torch") == 2
    assert SV.group_workers(cpu, 1, "auto") == 1  # one group keeps every thread
    assert SV.group_workers(cpu, 5, "triton") == 1  # the interpreter patches triton globally
    assert SV.group_workers([None, None], 5, "auto") == 1
    torch.set_num_threads(1)
    assert SV.group_workers(cpu, 5, "auto") == 1


def test_a_foreign_openmp_runtime_does_not_turn_the_groups_off():
    """Packages bundle their own libgomp (sentencepiece does); ATen's is still the one in
    torch's lib dir, so per-thread counts stay available and groups still run at once."""
    import ctypes
    from pathlib import Path

    import eagle_fast.kernels._cpu as cpu

    foreign = sorted((Path(torch.__file__).parents[1]).glob("*.libs/libgomp*"))
    if not foreign:
        pytest.skip("no package here bundles a second libgomp")
    ctypes.CDLL(str(foreign[0]))
    cpu._thread_count_setters.cache_clear()
    assert cpu.per_thread_counts_available()


def test_pool_threads_run_in_the_callers_context(hf_llama, two_threads):
    """What the caller scoped for its calls (the CPU screen switched off, its work counted)
    holds in the pool's threads: each group runs in a copy of the caller's context."""
    from eagle_fast.kernels import _torch_screen

    ids, mask = make_batch(lengths=(40, 33, 1, 50), seed=3)
    seen, lock, compute = [], threading.Lock(), hf_llama.head.compute

    def spy(*args, **kwargs):
        with lock:
            seen.append((threading.get_ident(), _torch_screen._ENABLED.get(), _torch_screen._COUNTS.get()))
        return compute(*args, **kwargs)

    with mock.patch.object(SV, "GROUP_TOKENS", 16), mock.patch.object(hf_llama.head, "compute", spy), \
         _torch_screen.switched(False), _torch_screen.counting() as counts:
        SV.supervise(hf_llama.head, _finals(hf_llama, ids, mask), ("draft", "argmax"), SV.RowFields(4),
                     draft_ids=draft_vocab(), out_dtype=torch.bfloat16)
    assert len({t for t, _, _ in seen}) == 2, "the groups did not run on the pool's threads"
    assert all(on is False and c is counts for _, on, c in seen), seen
