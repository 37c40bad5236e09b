"""The engine side of `eagle-fast serve`: one thread owns the runner and coalesces waiting
`generate` requests into one engine call.

`Batcher` runs jobs from a queue on its own thread. A `generate` job takes every other
`generate` waiting behind it with the same vocabulary mapping, up to the token budget, and
runs them as ONE `runner.capture` over all their rows plus ONE `supervise` over all their
final hidden states (the head streams its weight once per group, not once per request).
`StreamedFields` is `supervise`'s destination: it hands each head group's NeMo fields (shifted
left by one, target_probs = exp of the draft-vocab log-softmax, position_mask from the full-vocab
argmax) to that request's `ResponseStream`, which sends them while the next group runs, so
nothing `[tokens, vocab]` exists and no response exists whole.
`Engine` builds the runner, drops it after a failure and rebuilds it on the next job.

With `--supervision draft-topk` (`TargetSpec`) the head computes the sparse draft target instead
(k ids, or with --keep-mass the fewest holding that mass) and target_probs is its dense rebuild
(`supervision.sparse_target_p`, the tail per `tail` mode): what a draft-topk dataset's
`Eagle3Dataset.nemo_inputs` gives, so online and offline training see one target. The wire
still carries dense target_probs (NeMo's client reads nothing else).

Limits: one engine, one thread; a batch shares one mapping (requests with another one wait for
the next call).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle_fast.runners.base import RunnerBase, scatter_rows
from eagle_fast.serve.protocol import GenerateRequest, VocabMapping
from eagle_fast.serve.stream import ResponseStream
from eagle_fast.supervision import shift_left, sparse_target_p, supervise

logger = logging.getLogger(__name__)
_STOP = object()
# Head groups of a streamed response: at most this many bytes of fp32 draft results per group
# (128 tokens at a 32k draft). Each group is one head call, which streams the whole LM-head
# weight (a fixed cost, `bench/bench_cpu_ops.py` "call-overhead"); on a CPU `supervise` runs
# one group per torch thread at once, so the response's memory in the server is about that
# many groups per engine call.
STREAM_GROUP_BYTES = 16 << 20


class EngineUnavailable(RuntimeError):
    """The engine cannot be built (the message says why); the app answers 503."""


class EngineFailure(RuntimeError):
    """The engine raised during a call; the app answers 500 and the next job rebuilds it."""


class Engine:
    """The runner's lifecycle: `get()` builds it when there is none (first job, or after a
    failure), `fail()` closes a runner that raised, `close()` releases it for good."""

    def __init__(self, build: Callable[[], RunnerBase]):
        self._build = build
        self.runner: RunnerBase | None = None
        self.error: str | None = None
        self.builds = 0
        self.ready = threading.Event()
        self.ready_at: float | None = None  # monotonic time of the last successful build

    def get(self) -> RunnerBase:
        if self.runner is None:
            t0 = time.perf_counter()
            try:
                self.runner = self._build()
            except Exception as exc:
                self.error = f"the engine could not be built: {type(exc).__name__}: {exc}"
                logger.error("%s", self.error)
                raise EngineUnavailable(self.error) from exc
            self.builds += 1
            self.error = None
            self.ready_at = time.monotonic()
            logger.info("engine ready in %.1f s (build %d)", time.perf_counter() - t0, self.builds)
            self.ready.set()
        return self.runner

    def fail(self, exc: BaseException) -> None:
        self.error = f"the engine failed: {type(exc).__name__}: {exc}; the next request rebuilds it"
        logger.error("%s", self.error)
        runner, self.runner = self.runner, None
        self.ready.clear()
        if runner is not None:
            try:
                runner.close()
            except Exception:
                logger.exception("closing the failed engine")

    def close(self) -> None:
        runner, self.runner = self.runner, None
        self.ready.clear()
        if runner is not None:
            runner.close()


@dataclass(frozen=True)
class TargetSpec:
    """What target_probs holds: the draft softmax ("draft"), or the sparse draft target's
    rebuild ("draft-topk": the `k` most likely draft ids, or with `keep_mass` per token the
    fewest of them holding that mass, and the rest of the mass per `tail` mode)."""

    kind: str = "draft"
    k: int = 0
    keep_mass: float | None = None
    tail: str = "spread"

    @property
    def head_outputs(self) -> tuple[str, ...]:
        return ("draft_topk",) if self.kind == "draft-topk" else ("draft",)


class StreamedFields:
    """`supervise` destination: each request's NeMo fields, in its shifted frame, sent as they
    are computed (`ResponseStream`): target_probs row pieces go out group by group, in body
    order; position_mask fills here and goes out at the end (`finish`).

    For request i, row b, unshifted position t (1 <= t < n_b) the head's results land at t - 1:
    target_probs[b, t-1] = exp(draft_logprobs[t]) (client's column order, `probs_dtype`; with
    `target` draft-topk: row t of `sparse_target_p` instead),
    position_mask[b, t-1] = selected_mask[argmax[t]] & loss_mask[b, t]. Slots from n_b - 1 on
    are zero / False: no token follows them in the row.
    """

    copies = True  # the head returns fp32 and put() rounds once, while it copies
    keeps = False  # nothing stays: groups are bounded by `staging_bytes` alone
    staging_bytes = STREAM_GROUP_BYTES

    def __init__(self, requests: list[GenerateRequest], streams: list[ResponseStream], mapping: VocabMapping,
                 probs_dtype: torch.dtype, vocab_size: int, target: TargetSpec = TargetSpec()):
        self.target = target
        self.where = [(i, b) for i, r in enumerate(requests) for b in range(len(r.rows))]
        self.requests, self.streams = requests, streams
        self.mapping, self.probs_dtype = mapping, probs_dtype
        mask = mapping.selected_mask
        if mask.numel() < vocab_size:  # an LM head padded past config.vocab_size: extra ids are no draft
            mask = F.pad(mask, (0, vocab_size - mask.numel()))
        self._mask = mask
        self._row_zeros = mapping.draft_ids.numel() * probs_dtype.itemsize
        self.position_mask = [torch.zeros(*r.input_ids.shape, 1, dtype=torch.bool) for r in requests]
        self._loss_next = [r.loss_mask[:, 1:].bool() for r in requests]

    def put(self, pieces: list[tuple[int, int, int]], values: dict[str, torch.Tensor]) -> None:
        # popped: once the columns are picked, the head's own [n, Vd] buffer is freed here, not
        # when the caller drops the group's values
        if self.target.kind == "draft-topk":
            probs = sparse_target_p(values.pop("draft_topk_ids"), values.pop("draft_topk_logprobs"),
                                    values.pop("draft_topk_tail"), self.mapping.draft_ids.numel(),
                                    self.target.keep_mass, self.target.tail)
        else:
            probs = values.pop("draft_logprobs").float().exp_()
        if self.mapping.columns is not None:
            probs = probs.index_select(1, self.mapping.columns.to(probs.device))
        probs = probs.to(device="cpu", dtype=self.probs_dtype)
        mask = self._mask.to(values["argmax"].device)
        in_draft = mask[values["argmax"]].cpu()
        start = 0
        for row, a, c in pieces:
            i, b = self.where[row]
            first = max(a, 1)  # position 0 has no slot after the shift
            lo, hi = start + first - a, start + c - a
            if hi > lo:
                self.streams[i].send(probs[lo:hi])
                self.position_mask[i][b, first - 1:c - 1, 0] = (
                    in_draft[lo:hi] & self._loss_next[i][b, first - 1:c - 1])
            n, S = self.requests[i].lengths[b], self.requests[i].input_ids.shape[1]
            if c == n:  # the row's last piece: the slots after it are zero
                self.streams[i].send_zeros((S - (n - 1)) * self._row_zeros)
            start += c - a


def supervise_requests(runner: RunnerBase, requests: list[GenerateRequest], streams: list[ResponseStream],
                       probs_dtype: torch.dtype, begun: Callable[[int], None],
                       target: TargetSpec = TargetSpec()) -> None:
    """One engine call and one head pass for all `requests` (one mapping), each answered on its
    stream with the keys, shapes, dtypes and shifts of NeMo's `compute_supervision`.

    `begun(i)` is called once request i's stream has begun (after the capture, before the head):
    a failure before it is the request's to report, after it the stream's."""
    mapping = requests[0].mapping
    captures = runner.capture([row for r in requests for row in r.rows])
    Vd, k = mapping.draft_ids.numel(), 0
    for i, (r, stream) in enumerate(zip(requests, streams)):
        B, S = r.input_ids.shape
        n = len(r.rows)
        aux = scatter_rows([a for a, _ in captures[k:k + n]], r.lengths, B, S, "cpu")
        k += n
        tail = {"position_mask": (torch.bool, (B, S, 1)), "input_ids": (r.input_ids.dtype, (B, S)),
                "loss_mask": (r.loss_mask.dtype, (B, S))}
        stream.begin(aux, (B, S, Vd), probs_dtype, tail)
        begun(i)
        del aux
    finals: list[torch.Tensor | None] = [f for _, f in captures]
    del captures
    into = StreamedFields(requests, streams, mapping, probs_dtype, runner.head.vocab_size, target)
    supervise(runner.head, finals, target.head_outputs, into, draft_ids=mapping.draft_ids, k=target.k,
              out_dtype=probs_dtype)
    for r, stream, pmask in zip(requests, streams, into.position_mask):
        stream.finish({"position_mask": pmask, "input_ids": shift_left(r.input_ids),
                       "loss_mask": shift_left(r.loss_mask)})


class _Job:
    __slots__ = ("fn", "future", "request", "stream")

    def __init__(self, request: GenerateRequest | None, fn: Callable | None, stream: ResponseStream | None = None):
        self.request, self.fn, self.future, self.stream = request, fn, Future(), stream


class Batcher:
    """The engine's thread. `generate(request)` and `call(fn)` return Futures; the thread builds
    the engine first, then runs jobs in arrival order, coalescing waiting generates.

    stats: engine calls, requests and real tokens served, the most requests one call served, and
    the seconds spent in engine calls (busy time / wall time = the engine's utilisation).
    """

    def __init__(self, engine: Engine, probs_dtype: torch.dtype, max_batch_tokens: int,
                 target: TargetSpec = TargetSpec()):
        self.engine = engine
        self.target = target
        self.probs_dtype = probs_dtype
        self.max_batch_tokens = max_batch_tokens
        self._queue: queue.Queue = queue.Queue()
        self._held: collections.deque[_Job] = collections.deque()
        self.stats = {"engine_calls": 0, "requests": 0, "largest_batch": 0, "failures": 0, "tokens": 0,
                      "engine_seconds": 0.0}
        self._thread = threading.Thread(target=self._loop, name="eagle-fast-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop the thread (the engine stays: `Engine.close` frees it)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def generate(self, request: GenerateRequest, stream: ResponseStream) -> Future:
        """Queue `request`; the Future resolves (None) once `stream` has begun, or raises the
        engine's failure before that. Later failures end the stream instead."""
        job = _Job(request, None, stream)
        self._queue.put(job)
        return job.future

    def call(self, fn: Callable[[RunnerBase], object]) -> Future:
        job = _Job(None, fn)
        self._queue.put(job)
        return job.future

    def _next(self, block: bool):
        if self._held:
            return self._held.popleft()
        return self._queue.get() if block else self._queue.get_nowait()

    def _loop(self) -> None:
        try:
            self.engine.get()
        except EngineUnavailable:
            pass  # every job will retry the build and report why it fails
        stopping = False
        while True:
            try:
                job = self._next(block=not stopping)
            except queue.Empty:
                return
            if job is _STOP:
                stopping = True
                continue
            batch = [job]
            if job.request is not None:
                budget = self.max_batch_tokens - job.request.input_ids.numel()
                while True:
                    try:
                        nxt = self._next(block=False)
                    except queue.Empty:
                        break
                    if nxt is _STOP:
                        stopping = True
                        continue
                    r = nxt.request
                    if r is None or r.mapping is not job.request.mapping or r.input_ids.numel() > budget:
                        self._held.append(nxt)
                        break
                    batch.append(nxt)
                    budget -= r.input_ids.numel()
            self._run(batch)
            # the jobs hold the streams: drop them now, not when the next job arrives
            batch = job = nxt = r = None

    def _run(self, batch: list[_Job]) -> None:
        live = [j for j in batch if j.future.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            runner = self.engine.get()
        except EngineUnavailable as exc:
            for j in live:
                j.future.set_exception(exc)
            return
        try:
            if live[0].request is None:
                live[0].future.set_result(live[0].fn(runner))
            else:
                t0 = time.perf_counter()
                supervise_requests(runner, [j.request for j in live], [j.stream for j in live],
                                   self.probs_dtype, lambda i: live[i].future.set_result(None), self.target)
                self.stats["engine_seconds"] += time.perf_counter() - t0
                self.stats["engine_calls"] += 1
                self.stats["requests"] += len(live)
                self.stats["tokens"] += sum(j.request.tokens for j in live)
                self.stats["largest_batch"] = max(self.stats["largest_batch"], len(live))
        except Exception as exc:  # noqa: BLE001 - the engine's failure goes to every request in the call
            self.stats["failures"] += 1
            self.engine.fail(exc)
            failure = EngineFailure(f"{type(exc).__name__}: {exc}")
            for j in live:
                if j.future.done():  # its response has begun: the stream ends with the failure
                    j.stream.fail(failure)
                else:
                    j.future.set_exception(failure)
