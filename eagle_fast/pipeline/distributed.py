"""An extraction's pending shards on Ray actors: `extract(cfg, ray=RayOptions(...))`, `--ray`.

Design: this process (the driver) plans and owns the manifest, as a single-machine run does.
Each worker is a Ray actor holding one runner and the single path's writer thread
(`run.ShardWriter`), so it computes and commits a shard into OUT exactly as `extract` does here.
The driver keeps two pending shards in flight per worker (one computing, the next queued on
the actor so the engine never waits for the driver) and hands the rest to whichever worker
frees a slot: work stealing, not a static I/N split. It records each committed shard in the
manifest once it has checked its files, and puts back the shards of a worker that died while
Ray restarts that actor. Before anything is written, every worker reads a probe file the driver
wrote in OUT and writes one back: a worker that cannot see OUT is refused up front.
Limits: OUT must be storage every node mounts (NFS, Lustre, ...). An exception inside a worker
(not a death) stops the run, as it would on one machine; finished shards are kept either way.
If this process already called `ray.init`, that connection is used and `address` is ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle_fast.errors import UserError
from eagle_fast.files import atomic_write_bytes
from eagle_fast.hub import resolve_model
from eagle_fast.inputs import ShardPlan, plan_batches
from eagle_fast.pipeline.config import ExtractPlan
from eagle_fast.pipeline.engine_setup import build_runner, check_sequences, engine_check
from eagle_fast.pipeline.prepare import DatasetDir, clean_temps
from eagle_fast.pipeline.run import (
    ShardWriter,
    capture_batches,
    new_progress,
    supervise_batch,
)
from eagle_fast.runners.engine_settings import V1_RUNNER_ENV
from eagle_fast.store import make_layout
from eagle_fast.store.layouts import LayoutSpec
from eagle_fast.store.manifest import check_file_cheap

logger = logging.getLogger(__name__)
INSTALL_FIX = ("install it with `pip install 'eagle-fast[ray]'` (or `pip install 'ray>=2.60'`), or run "
               "without --ray")
SHARED_FIX = ("put --out on storage that every Ray node mounts at the same path (NFS, Lustre, ...), or "
              "run without --ray (or with --shard I/N on each node, then `eagle-fast merge`)")
SHARD_ATTEMPTS = 3  # a shard that has killed this many workers stops the run
IN_FLIGHT = 2  # shards per worker: one on its engine, the next one waiting to start at once


def node_model(path: str, source: dict | None) -> str:
    """The model directory on this node: the driver's, where this node sees it; else, for a Hub
    model, the commit the driver resolved, from this node's own Hugging Face cache (or the Hub)."""
    if Path(path).is_dir() or not source:
        return path
    return resolve_model(source["id"], source["commit"]).path


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--ray: Ray is not installed", INSTALL_FIX) from None
    return ray


@dataclass
class RayOptions:
    """How to run on Ray. Every field has a default that fits a local machine."""

    workers: int | None = None            # default: one per GPU, else one per node
    address: str | None = None            # default: $RAY_ADDRESS, else a local Ray instance
    cpus_per_worker: float | None = None  # default: 1 with GPUs, else the CPUs / workers
    max_restarts: int = 3                 # how often Ray restarts a worker that died
    worker_out: str | None = None         # OUT as the workers mount it, when not at OUT's path
    runtime_env: dict | None = None       # Ray's runtime_env for the job (env vars, pip, ...)
    local_object_store_bytes: int = 128 << 20  # a local instance's; shards go to disk, not here
    startup_timeout_s: float = 600.0      # for the cluster to place and start every worker

    def start(self, p: ExtractPlan, factory) -> _Pool:
        """Connect to (or start) Ray, start the workers and probe OUT from each; nothing is written."""
        if self.workers is not None and self.workers < 1:
            raise UserError(f"--ray-workers must be at least 1, got {self.workers}", "pass e.g. --ray-workers 2")
        if self.cpus_per_worker is not None and self.cpus_per_worker <= 0:
            raise UserError(f"--ray-cpus-per-worker must be positive, got {self.cpus_per_worker}",
                            "pass e.g. --ray-cpus-per-worker 4")
        ray = import_ray()
        own = not ray.is_initialized()
        if own:
            init_ray(ray, self)
        pool = _Pool(ray, own, self)
        try:
            pool.launch(p, factory)
        except BaseException:
            pool.close()
            raise
        return pool


def init_ray(ray, opts: RayOptions) -> None:
    """Start a local Ray instance, or connect to `opts.address` (or $RAY_ADDRESS); UserError when
    it cannot be reached."""
    address = opts.address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {"address": address, "logging_level": logging.WARNING,
                              "runtime_env": opts.runtime_env}
    if address == "local":
        kwargs.update(num_cpus=os.cpu_count() or 1, include_dashboard=False,
                      object_store_memory=opts.local_object_store_bytes)
        # Our instance lives and dies with this process. Its agents wait this long for a dead
        # GCS to come back (Ray's default: 60 s) before they exit after a killed driver.
        os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "5")
    logger.info("starting a local Ray instance" if address == "local" else f"connecting to the Ray cluster at {address}")
    fix = ("start the cluster with `ray start --head` and pass its address (--ray-address or RAY_ADDRESS), "
           "or leave both unset for a local instance")
    unreachable = _unreachable(address)
    if unreachable:  # Ray itself would retry for minutes
        raise UserError(f"--ray: cannot reach the Ray cluster at {address}: {unreachable}", fix)
    try:
        ray.init(**kwargs)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise UserError(f"--ray: cannot start or reach Ray at {address}: {_first_line(exc)}", fix) from None


def _unreachable(address: str, timeout: float = 10.0) -> str | None:
    """Why `host:port` (or `ray://host:port`) takes no TCP connection; None when it does, or
    when the address is not of that form ("local", "auto")."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        return f"{host}:{port} takes no connection ({exc.strerror or exc})"
    return None


@dataclass
class _Job:
    """What every worker needs; the shards themselves come one at a time."""

    engine: str
    model: str
    dtype: torch.dtype
    max_len: int
    aux_layer_ids: list[int]
    spec: LayoutSpec
    root: str
    draft_ids: torch.Tensor | None
    k: int
    batch_tokens: int
    queue_batches: int
    threads: int | None
    factory: Any
    check: list  # the engine check's sequences (engine_setup.check_sequences), run on every build
    engine_check: bool = True
    model_source: dict | None = None  # a Hub model's id and commit: a node without the driver's snapshot


class _ShardWorker:
    """A Ray actor: one runner, one writer thread, shards in, manifest records out.

    The runner is built on first use, so an actor Ray restarts rebuilds it by itself.
    """

    def __init__(self, index: int, job: _Job):
        self.index = index
        self.job = job
        self.runner = None
        self.checked: dict = {}  # the engine check of the runner built last
        self.writer: ShardWriter | None = None
        self.committed: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.engine = threading.Lock()  # one shard at a time on the runner; the next waits here
        if job.threads and job.threads < (os.cpu_count() or 1):
            # A share of a node runs that many threads; a whole node keeps torch's default, as a
            # single-machine run there does (CPU GEMMs can round differently with another thread
            # count: bf16 ones, and fp32 ones on AVX2; so this keeps the bytes of one worker per
            # node equal to a plain run's). Process-wide, and this actor's to set: Ray runs each
            # actor in a worker process of its own, which the project starts for this job alone.
            torch.set_num_threads(job.threads)

    def where(self) -> dict:
        import ray

        return {"node": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def probe(self, name: str, token: str) -> dict:
        """Read the driver's probe file in OUT, write this worker's; say what went wrong."""
        here = self.where()
        path = Path(self.job.root) / name
        try:
            seen = path.read_text()
        except OSError as exc:
            return {**here, "ok": False, "reason": f"{path} is not readable there ({exc.strerror or exc})"}
        if seen != token:
            return {**here, "ok": False, "reason": f"{path} there is not the file the driver wrote"}
        try:
            atomic_write_bytes(path.with_name(f"{name}.w{self.index}"), f"{token}:{self.index}".encode())
        except OSError as exc:
            return {**here, "ok": False, "reason": f"cannot write into {path.parent} ({exc.strerror or exc})"}
        return {**here, "ok": True, "reason": ""}

    def build(self) -> dict:
        with self.engine:
            self._ensure()
        return {**self.where(), "engine_check": self.checked}

    def _ensure(self) -> None:
        if self.runner is not None:
            return
        j = self.job
        model = node_model(j.model, j.model_source)  # the driver's commit, on any node
        runner = build_runner(j.factory, j.engine, model, j.dtype, j.max_len, j.aux_layer_ids)
        try:
            self.checked = engine_check(runner, j.engine, j.check, j.engine_check)
        except BaseException:
            runner.close()
            raise
        self.runner = runner
        self.layout = make_layout(j.spec)
        self.writer = ShardWriter(self.layout, Path(j.root), self._committed, None, maxsize=max(1, j.queue_batches))
        self.writer.start()

    def _committed(self, rec: dict) -> None:
        with self.cond:
            self.committed[rec["index"]] = rec
            self.cond.notify_all()

    def run_shard(self, shard: ShardPlan) -> dict:
        """Compute and commit one shard (as `extract` does); its manifest record and where.

        The engine is released once the shard's last batch is queued, so the next shard starts
        computing while this one is written, committed and recorded (as on one machine).
        """
        j = self.job
        with self.engine:
            self._ensure()
            batches = plan_batches(shard, j.batch_tokens)  # the engine runs one batch ahead
            stream = capture_batches(self.runner, ([shard.samples[i].input_ids for i in batch]
                                                   for batch in batches))
            with contextlib.closing(stream):
                for batch, caps in zip(batches, stream):
                    results = supervise_batch(self.runner, [shard.samples[i] for i in batch], caps,
                                              self.layout, j.draft_ids, j.k)
                    self.writer.put((shard, list(zip(batch, results))))
        with self.cond:
            while shard.index not in self.committed:
                if self.writer.error is not None:
                    raise RuntimeError("the writer thread failed") from self.writer.error
                self.cond.wait(0.5)
            return {"record": self.committed.pop(shard.index), **self.where()}

    def close(self) -> None:
        try:
            if self.writer is not None and self.writer.is_alive():
                self.writer.finish()
        finally:
            if self.runner is not None:
                self.runner.close()
                self.runner = None


class _Pool:
    """The driver's side: the actors, the queue of pending shards, failures and restarts."""

    def __init__(self, ray, own: bool, opts: RayOptions):
        self.ray = ray
        self.own = own  # we started (or connected) Ray, so we shut it down
        self.opts = opts
        self.actors: list = []
        self.where: dict[int, dict] = {}
        self.restarts = 0
        self.p: ExtractPlan | None = None

    # ---------------------------------------------------------------------- start-up

    def launch(self, p: ExtractPlan, factory) -> None:
        ray, opts = self.ray, self.opts
        self.p = p
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        gpus = int(ray.cluster_resources().get("GPU", 0))
        # On GPUs a worker's engine spans its tensor-parallel size; CPU workers hold no GPU.
        target = p.target
        tp = target.vllm.tensor_parallel_size if target.engine == "vllm" else 1
        if gpus and tp > gpus:
            raise UserError(f"--tensor-parallel-size {tp} needs {tp} GPUs per Ray worker; the cluster has {gpus}",
                            f"pass --tensor-parallel-size {gpus} or less, or add GPU nodes")
        wanted = opts.workers or gpus // tp or len(nodes) or 1
        if gpus and wanted * tp > gpus:
            raise UserError(f"--ray-workers {wanted} needs {wanted * tp} GPUs ({tp} per worker); the cluster has "
                            f"{gpus}", f"pass --ray-workers {gpus // tp} or fewer, or add GPU nodes")
        node_cpus = [n["Resources"].get("CPU", 0) for n in nodes if n["Resources"].get("CPU", 0) > 0] or [1]
        cpus = opts.cpus_per_worker or (1 if gpus else max(1, min(sum(node_cpus) // wanted, min(node_cpus))))
        count = min(wanted, len(p.pending))
        job = _Job(target.engine, target.model, target.dtype, p.longest, list(target.aux_layer_ids),
                   p.spec, str(Path(opts.worker_out or p.root).resolve()), p.draft_ids, p.spec.k,
                   p.run.batch_tokens, p.run.queue_batches, None if gpus else max(1, int(cpus)), factory,
                   check_sequences(p), target.engine_check, target.source)
        # The driver's engine-path choice (the CLI selects vLLM's V1 runner) reaches every worker,
        # also on nodes whose Ray was started without it.
        env = {k: os.environ[k] for k in V1_RUNNER_ENV if k in os.environ}
        remote = ray.remote(_ShardWorker).options(
            num_cpus=cpus, num_gpus=tp if gpus else 0, max_restarts=opts.max_restarts, max_task_retries=0,
            max_concurrency=IN_FLIGHT + 1, scheduling_strategy="SPREAD",  # + 1: close() or a probe
            runtime_env={"env_vars": env} if gpus and env else None)
        logger.info(f"starting {count} Ray worker{'s' if count > 1 else ''} ({cpus:g} CPU"
                    + (f", {tp} GPU" if gpus else "") + f" each) on {len(nodes)} node{'s' if len(nodes) > 1 else ''}")
        self.actors = [remote.remote(i, job) for i in range(count)]
        self._probe(p.root)

    def _probe(self, root: Path) -> None:
        token = uuid.uuid4().hex
        name = f".eagle-fast-probe-{token}"
        atomic_write_bytes(root / name, token.encode())
        try:
            replies = self._get([a.probe.remote(name, token) for a in self.actors], "start")
            for i, r in enumerate(replies):
                self.where[i] = r
                mine = root / f"{name}.w{i}"
                if r["ok"] and not (mine.exists() and mine.read_text() == f"{token}:{i}"):
                    r = {**r, "ok": False, "reason": f"the file it wrote is not in {root} on the driver"}
                if not r["ok"]:
                    raise UserError(f"--ray: worker {i} on node {r['node']} cannot see {root}: {r['reason']}",
                                    SHARED_FIX)
        finally:
            for q in root.glob(f"{name}*"):
                with contextlib.suppress(OSError):
                    q.unlink()

    def _get(self, refs: list, what: str) -> list:
        ray = self.ray
        try:
            return ray.get(refs, timeout=self.opts.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise UserError(f"--ray: the cluster did not {what} {len(self.actors)} workers within "
                            f"{self.opts.startup_timeout_s:.0f} s (not enough free CPUs/GPUs?)",
                            "pass fewer --ray-workers, free or add nodes (`ray status` shows them)") from None
        except ray.exceptions.RayTaskError as exc:
            raise (exc.cause if isinstance(exc.cause, BaseException) else RuntimeError(str(exc))) from exc
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"a Ray worker could not {what}: {_first_line(exc)} (is the same eagle-fast "
                               "installed on every node?)") from exc

    # ------------------------------------------------------------------------- the run

    def run(self, out: DatasetDir, on_shard=None) -> tuple[float, float, dict]:
        """Every pending shard, committed and recorded; (build, loop) seconds and run stats."""
        t_build = time.perf_counter()
        checks = []
        for i, w in enumerate(self._get([a.build.remote() for a in self.actors], "build the runners of")):
            checks.append(w.pop("engine_check"))
            self.where[i] = w
        build_seconds = time.perf_counter() - t_build
        progress = new_progress(out.plan)
        t_loop = time.perf_counter()
        try:
            self._loop(out, progress, on_shard)
        finally:
            progress.close()
        return build_seconds, time.perf_counter() - t_loop, {"engine_checks": checks, "ray_workers": len(self.actors),
                                                             "worker_restarts": self.restarts}

    def _loop(self, out: DatasetDir, progress, on_shard) -> None:
        ray, p = self.ray, out.plan
        n = len(self.actors)
        queue = deque(p.pending)
        ready = [True] * n  # false from a death until the restarted actor answers a ping
        load = [0] * n      # shards in flight per worker
        epoch = [0] * n     # deaths counted per worker: a death loses every shard in flight once
        attempts: dict[int, int] = {}
        flight: dict = {}   # shard task -> (worker, shard, epoch when sent)
        pings: dict = {}    # ping task -> (worker, when the death was seen)
        while queue or flight:
            for slot in range(IN_FLIGHT):  # every worker's first slot before anyone's second
                for w in range(n):
                    if ready[w] and load[w] <= slot and queue:
                        shard = queue.popleft()
                        flight[self.actors[w].run_shard.remote(shard)] = (w, shard, epoch[w])
                        load[w] += 1
            if not flight and not pings:
                raise RuntimeError(f"every Ray worker died ({len(queue)} shards left); finished shards are "
                                   "kept: re-run the same command to resume")
            [ref], _ = ray.wait(list(flight) + list(pings), num_returns=1)
            if ref in pings:
                self._pinged(ref, pings, ready, progress)
                continue
            w, shard, sent = flight.pop(ref)
            load[w] -= 1
            try:
                reply = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                attempts[shard.index] = attempts.get(shard.index, 0) + 1
                if attempts[shard.index] >= SHARD_ATTEMPTS:
                    raise RuntimeError(f"shard {shard.index} was lost with {attempts[shard.index]} workers "
                                       f"(last: {_first_line(exc)}); finished shards are kept") from exc
                queue.appendleft(shard)
                if sent == epoch[w]:
                    epoch[w] += 1
                    ready[w] = False
                    progress.note(self._death(w, shard, exc, epoch[w]))
                    if epoch[w] <= self.opts.max_restarts:
                        pings[self.actors[w].where.remote()] = (w, time.monotonic())
                continue
            except ray.exceptions.RayTaskError as exc:
                raise (exc.cause if isinstance(exc.cause, BaseException) else RuntimeError(str(exc))) from exc
            rec = reply["record"]
            for f in rec["files"]:
                reason = check_file_cheap(p.root, f)
                if reason is not None:
                    raise RuntimeError(f"worker {w} on node {reply['node']} committed shard {shard.index}, but "
                                       f"the driver sees: {reason}; {SHARED_FIX}")
            out.record_shard(rec)
            progress.update(rec["samples"], rec["tokens"], force=not queue and not flight)
            if on_shard is not None:
                on_shard(shard.index)

    def _death(self, w: int, shard: ShardPlan, exc: BaseException, deaths: int) -> str:
        """The line for worker `w`'s death (counted once however many shards it had in flight)."""
        was = self.where.get(w, {})
        msg = (f"worker {w} (node {was.get('node', '?')}, pid {was.get('pid', '?')}) died on shard "
               f"{shard.index}: {_first_line(exc)}; its shards go back to the queue")
        if deaths <= self.opts.max_restarts:
            self.restarts += 1
            return msg + f"; Ray restarts the worker (restart {deaths} of {self.opts.max_restarts})"
        return msg + f"; it has no restarts left ({self.opts.max_restarts})"

    def _pinged(self, ref, pings: dict, ready: list[bool], progress) -> None:
        """A restarting worker answered (it takes shards again) or not yet (ask again, up to
        the start-up timeout; then it is given up)."""
        w, since = pings.pop(ref)
        try:
            where = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as exc:
            if time.monotonic() - since > self.opts.startup_timeout_s:
                progress.note(f"worker {w} did not come back within {self.opts.startup_timeout_s:.0f} s "
                              f"({_first_line(exc)}); the run goes on without it")
                return
            time.sleep(0.2)  # tasks sent while Ray restarts an actor fail at once
            pings[self.actors[w].where.remote()] = (w, since)
            return
        self.where[w] = where
        ready[w] = True
        progress.note(f"worker {w} is back (node {where['node']}, pid {where['pid']})")

    # ------------------------------------------------------------------------ shut-down

    def close(self, graceful: bool = False) -> None:
        """Stop the actors (after closing their runners when `graceful`: a finished run, where no
        shard is in flight), shut Ray down if it is ours, remove what a killed worker left."""
        ray = self.ray
        if self.actors:
            if graceful:
                with contextlib.suppress(Exception):  # best effort: the actors are killed next anyway
                    closing = [a.close.remote() for a in self.actors]
                    ray.wait(closing, num_returns=len(closing), timeout=60)
            for a in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(a, no_restart=True)
            self.actors = []
        if self.own:
            ray.shutdown()
        if self.p is not None:
            clean_temps(self.p)  # what a killed worker left under a temp name


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return line if len(line) <= 200 else line[:197] + "..."
