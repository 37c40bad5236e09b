"""`eagle-fast regenerate --ray`: chunks of rows on Ray actors, one vLLM engine each.

The driver (this process) reads the rows, ships each pending chunk to a worker, and takes the
results back in chunk order, so it alone writes `OUT.part` and the sidecar, exactly as a
single-process run does (`regenerate._commit_chunk`). Rows travel in the task, so the workers
need no shared storage. A chunk's output depends only on its rows and the settings
(`turns.run_chunk`), so the file equals one process's wherever each chunk ran. Each worker
keeps two chunks in flight (one generating, the next queued on the actor).
Limits: a worker that dies stops the run (finished chunks are kept; re-run to resume).
"""

from __future__ import annotations

import logging
import os
from collections import deque

import torch

from eagle_fast.inputs import load_tokenizer
from eagle_fast.loop.engine import generation_kwargs
from eagle_fast.loop.turns import chunk_outputs
from eagle_fast.pipeline.distributed import RayOptions, import_ray, init_ray
from eagle_fast.runners import generation
from eagle_fast.runners.engine_settings import V1_RUNNER_ENV

logger = logging.getLogger(__name__)
IN_FLIGHT = 2


class RegenWorker:
    """A Ray actor: one engine, chunks in, TurnOutputs out."""

    def __init__(self, cfg, threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.tok = load_tokenizer(cfg.model)
        self.llm = generation.start(generation_kwargs(cfg.model, cfg.dtype, cfg.vllm))
        self.max_len = generation.max_model_len(self.llm)

    def run(self, rows):
        return chunk_outputs(self.llm, self.tok, self.cfg, rows, self.max_len)

    def close(self) -> None:
        generation.stop(self.llm)


def ray_chunks(cfg, chunks: list, opts: RayOptions):
    """Each chunk's outputs in order, computed on Ray workers (a generator)."""
    ray = import_ray()
    own = not ray.is_initialized()
    if own:
        init_ray(ray, opts)
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        tp = cfg.vllm.tensor_parallel_size
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        wanted = max(1, min(opts.workers or (gpus // tp if gpus else len(nodes)) or 1, len(chunks) or 1))
        node_cpus = [n["Resources"].get("CPU", 0) for n in nodes if n["Resources"].get("CPU", 0) > 0] or [1]
        cpus = opts.cpus_per_worker or (1 if gpus else max(1, min(sum(node_cpus) // wanted, min(node_cpus))))
        env = {k: os.environ[k] for k in (*V1_RUNNER_ENV, "TORCHDYNAMO_DISABLE", "VLLM_CPU_KVCACHE_SPACE",
                                                    "TOKENIZERS_PARALLELISM")
               if k in os.environ}
        remote = ray.remote(RegenWorker).options(num_cpus=cpus, num_gpus=tp if gpus else 0, max_restarts=0,
                                                 max_concurrency=1, scheduling_strategy="SPREAD",
                                                 runtime_env={"env_vars": env} if env else None)
        logger.info(f"starting {wanted} Ray worker{'s' if wanted > 1 else ''} for regenerate ({cpus:g} CPU"
                    + (f", {tp} GPU" if gpus else "") + " each)")
        actors = [remote.remote(cfg, None if gpus else max(1, int(cpus))) for _ in range(wanted)]
        try:
            yield from _ordered(ray, actors, chunks)
        finally:
            for a in actors:
                try:
                    ray.get(a.close.remote(), timeout=120)
                except Exception:  # noqa: BLE001 -- best effort; the actor is killed next
                    logger.warning("a regenerate worker did not stop cleanly")
                ray.kill(a)
    finally:
        if own:
            ray.shutdown()


def _ordered(ray, actors: list, chunks: list):
    """Dispatch chunks to the least-loaded actor, up to IN_FLIGHT each; yield in chunk order."""
    todo = deque(range(len(chunks)))
    running: dict = {}   # ref -> (chunk, actor index)
    load = [0] * len(actors)
    done: dict[int, list] = {}
    nxt = 0
    while nxt < len(chunks):
        while todo and min(load) < IN_FLIGHT:
            i = load.index(min(load))
            c = todo.popleft()
            running[actors[i].run.remote(chunks[c])] = (c, i)
            load[i] += 1
        ready, _ = ray.wait(list(running), num_returns=1)
        for ref in ready:
            c, i = running.pop(ref)
            load[i] -= 1
            done[c] = ray.get(ref)
        while nxt in done:
            yield done.pop(nxt)
            nxt += 1
