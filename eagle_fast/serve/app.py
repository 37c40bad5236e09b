"""`eagle-fast serve`: the HTTP server NeMo AutoModel's `RemoteEagle3TargetModel` trains against.

FastAPI routes on uvicorn. Bodies are NeMo's wire format (`serve.wire`); a `generate` is
checked (`serve.protocol`) and handed to the engine thread (`serve.batching.Batcher`), which
coalesces requests waiting together into one engine call; a `generate` response goes out in
chunks while the head still computes it (`serve.stream`). Errors are JSON
`{"error", "fix"}`: 400 for a body that is not a wire blob, 409/413/422 for a request the engine
cannot run, 500 when the engine fails before the response begins (the next request rebuilds it;
a failure after that closes the connection before the body's last chunk), 503 while it cannot
be built.

Lifecycle: the engine starts in the background and `/health` answers 200 once it is ready.
SIGTERM / Ctrl-C stop accepting, let in-flight requests finish, then stop the engine (its
processes, its capture directory). `exit_when_idle` stops the server once no request has come
for that many seconds. `init_nccl` answers "disabled": the data always travels in the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eagle_fast import __version__
from eagle_fast.dtypes import long_name
from eagle_fast.errors import UserError
from eagle_fast.pipeline.engine_setup import engine_check
from eagle_fast.runners.engine_settings import VLLMSettings
from eagle_fast.runners.factory import check_vllm_settings, default_runner_factory, resolve_target
from eagle_fast.serve import protocol as P
from eagle_fast.serve import wire
from eagle_fast.serve.batching import Batcher, Engine, EngineFailure, EngineUnavailable, TargetSpec
from eagle_fast.serve.stream import ResponseStream
from eagle_fast.supervision import TAIL_MODES

logger = logging.getLogger("eagle_fast.serve")
PROBS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class ServeConfig:
    """`eagle-fast serve` arguments as data (see the CLI for each one's meaning)."""

    model: str
    engine: str = "auto"
    dtype: str = "auto"
    aux_layers: str | None = None
    host: str = "127.0.0.1"
    port: int = 8001
    probs_dtype: str = "fp32"
    max_len: int | None = None
    max_batch_tokens: int = 65536
    exit_when_idle: float | None = None
    supervision: str = "draft"            # draft | draft-topk (target_probs rebuilt from the sparse target)
    k: int = 64                           # draft-topk: ids per token (with keep_mass: at most)
    keep_mass: float | None = None        # draft-topk: per token the fewest ids holding this draft mass
    tail: str = "spread"                  # draft-topk: spread | drop | renormalize (supervision.TAIL_MODES)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)  # engine settings (vllm engine only)
    engine_check: bool = True  # vLLM: captures against the engine's own log-probs before serving


# The engine check's rows when the server starts (it has no data): fixed pseudo-random token ids.
CHECK_ROWS, CHECK_ROW_TOKENS = 2, 128


def check_rows(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (CHECK_ROWS, CHECK_ROW_TOKENS), generator=g).tolist()


class TargetServer:
    """The resolved settings, the engine thread and the FastAPI app for one target.

    runner_factory(engine, model, dtype, max_len) builds the runner (default: the extraction's
    `default_runner_factory`, with `cfg.vllm`); the server sets its aux layers.
    """

    def __init__(self, cfg: ServeConfig, runner_factory: Callable | None = None):
        if cfg.probs_dtype not in PROBS_DTYPES:
            raise UserError(f"--probs-dtype {cfg.probs_dtype!r} is not one of fp32, bf16", "pick one of them")
        if cfg.max_batch_tokens < 1:
            raise UserError(f"--max-batch-tokens must be positive, got {cfg.max_batch_tokens}",
                            "pass e.g. --max-batch-tokens 65536")
        if cfg.exit_when_idle is not None and cfg.exit_when_idle <= 0:
            raise UserError(f"--exit-when-idle must be positive, got {cfg.exit_when_idle}",
                            "pass the seconds without requests after which the server exits")
        self.target = target_spec(cfg)
        resolved = resolve_target(cfg.model, engine=cfg.engine, dtype=cfg.dtype, aux_layers=cfg.aux_layers,
                                  max_len=cfg.max_len, vllm=cfg.vllm, engine_check=cfg.engine_check)
        self.cfg = cfg
        self.info = resolved.info
        self.aux_layer_ids = list(resolved.aux_layer_ids)
        self.dtype = resolved.dtype
        self.probs_dtype = PROBS_DTYPES[cfg.probs_dtype]
        self.max_len = resolved.max_len
        self.engine_name = resolved.engine
        positions = self.info.max_positions
        if self.engine_name == "vllm" and positions and self.max_len >= positions:
            raise UserError(f"--max-len {self.max_len}: vLLM needs one position beyond the longest row and this "
                            f"model has {positions}", f"pass --max-len {positions - 1}")
        check_vllm_settings(resolved.vllm, resolved.requested, self.engine_name, self.max_len)
        # The default factory builds vLLM with the user's settings. Its steps keep vLLM's default
        # size (chunked prefill on: a few thousand tokens, never the model's context), smaller
        # than --max-batch-tokens' default (65536), which would only grow them.
        factory = runner_factory or functools.partial(default_runner_factory, vllm=resolved.vllm)

        def build():
            runner = factory(self.engine_name, resolved.model, self.dtype, self.max_len)
            try:
                runner.set_aux_layers(self.aux_layer_ids)
                self.engine_check = engine_check(runner, self.engine_name, check_rows(self.info.vocab_size),
                                                 resolved.engine_check)
            except BaseException:
                runner.close()
                raise
            return runner

        self.engine_check: dict | None = None  # its figures once the engine is built
        self.engine = Engine(build)
        self.batcher = Batcher(self.engine, self.probs_dtype, cfg.max_batch_tokens, self.target)
        self.mapping: P.VocabMapping | None = None
        self.in_flight = 0
        self.last_activity = time.monotonic()
        self.uvicorn: uvicorn.Server | None = None
        self.app = self._make_app()

    # -- facts ------------------------------------------------------------------------------------
    def model_info(self) -> dict:
        """NeMo's four keys (`num_hidden_layers`, `hidden_size`, `vocab_size`, `aux_layer_ids`)
        plus what this server runs."""
        return {"num_hidden_layers": self.info.num_hidden_layers, "hidden_size": self.info.hidden_size,
                "vocab_size": self.info.vocab_size, "aux_layer_ids": list(self.aux_layer_ids),
                "engine": self.engine_name, "dtype": long_name(self.dtype),
                "probs_dtype": self.cfg.probs_dtype, "max_len": self.max_len,
                "max_batch_tokens": self.cfg.max_batch_tokens, "nccl": False,
                "supervision": self.target.kind,
                **({"k": self.target.k, "keep_mass": self.target.keep_mass, "tail": self.target.tail}
                   if self.target.kind == "draft-topk" else {}),
                "engine_check": self.engine_check, "server": f"eagle-fast {__version__}"}

    def health(self) -> tuple[int, dict]:
        ready = self.engine.runner is not None
        body = {"status": "ok" if ready else ("failed" if self.engine.error else "starting"),
                "engine": self.engine_name, **self.batcher.stats, "in_flight": self.in_flight}
        if self.engine.error:
            body["error"] = self.engine.error
        return (200 if ready else 503), body

    # -- the app ----------------------------------------------------------------------------------
    def _make_app(self) -> FastAPI:
        server = self

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            server.batcher.start()
            watchdog = asyncio.create_task(server._watch_idle()) if server.cfg.exit_when_idle else None
            try:
                yield
            finally:
                if watchdog is not None:
                    watchdog.cancel()
                await asyncio.to_thread(server.shutdown)

        app = FastAPI(title="eagle-fast serve", version=__version__, lifespan=lifespan,
                      docs_url=None, redoc_url=None, openapi_url=None)

        app.add_middleware(_TrackActivity, server=server)

        @app.exception_handler(UserError)
        async def user_error(_request, exc: UserError):
            status = exc.status if isinstance(exc, P.RequestError) else 400
            return JSONResponse({"error": exc.cause, "fix": exc.fix}, status_code=status)

        @app.exception_handler(EngineFailure)
        async def engine_failure(_request, exc: EngineFailure):
            return JSONResponse({"error": f"the engine failed: {exc}",
                                 "fix": "retry: the next request rebuilds the engine"}, status_code=500)

        @app.exception_handler(EngineUnavailable)
        async def engine_unavailable(_request, exc: EngineUnavailable):
            return JSONResponse({"error": str(exc), "fix": "see the server's log; it retries on every request"},
                                status_code=503)

        @app.get("/" + P.EP_HEALTH)
        async def health():
            status, body = server.health()
            return JSONResponse(body, status_code=status)

        @app.post("/" + P.EP_MODEL_INFO)
        async def model_info():
            return JSONResponse(server.model_info())

        @app.post("/" + P.EP_HEARTBEAT)
        async def heartbeat():
            return JSONResponse({"status": "ok"})

        @app.post("/" + P.EP_DISCONNECT)
        async def disconnect():
            return JSONResponse({"status": "ok"})

        @app.post("/" + P.EP_INIT_NCCL)
        async def init_nccl():
            return JSONResponse({"status": "disabled"})

        @app.post("/" + P.EP_SET_VOCAB_MAPPING)
        async def set_vocab_mapping(request: Request):
            tensors = wire.decode(await request.body())
            mapping = P.parse_vocab_mapping(tensors, server.info.vocab_size)
            if server.target.k > mapping.draft_ids.numel():
                raise P.RequestError(422, f"this server keeps up to --k {server.target.k} draft ids per token, more "
                                     f"than the draft vocabulary's {mapping.draft_ids.numel()} ids",
                                     f"restart the server with --k {mapping.draft_ids.numel()} or less, or send "
                                     "a larger draft vocabulary")
            if not (server.mapping is not None and torch.equal(mapping.selected_ids, server.mapping.selected_ids)
                    and torch.equal(mapping.selected_mask, server.mapping.selected_mask)):
                server.mapping = mapping  # an equal one keeps the old object: its requests still batch together
            return JSONResponse({"status": "ok", "draft_vocab_size": int(server.mapping.draft_ids.numel())})

        @app.post("/" + P.EP_INPUT_EMBEDDINGS)
        async def input_embeddings():
            weight = await asyncio.wrap_future(server.batcher.call(lambda r: r.input_embedding_weight()))
            return _stream({"weight": weight.detach().cpu()})

        @app.post("/" + P.EP_GENERATE)
        async def generate(request: Request):
            tensors = wire.decode(await request.body())
            req = P.parse_generate(tensors, server.mapping, vocab_size=server.info.vocab_size,
                                   max_len=server.max_len, max_batch_tokens=server.cfg.max_batch_tokens)
            stream = ResponseStream(asyncio.get_running_loop())
            # resolves once the engine has captured the rows; a failure until then is a 5xx
            await asyncio.wrap_future(server.batcher.generate(req, stream))
            # Chunked, not Content-Length: requests (NeMo's client) reads either in 10 KiB
            # pieces, and its chunked reader is the cheaper one, about 30 % less client CPU per
            # byte (`bench/bench_serve.py`, "wire"). A truncated body is an error either way.
            return StreamingResponse(stream.body(), media_type="application/octet-stream")

        return app

    async def _watch_idle(self) -> None:
        limit = float(self.cfg.exit_when_idle)
        while True:
            await asyncio.sleep(min(0.5, limit / 4))
            if self.engine.ready_at is None and self.engine.error is None:
                continue  # the first engine start is not idle time
            idle = time.monotonic() - max(self.last_activity, self.engine.ready_at or 0.0)
            if self.in_flight == 0 and idle > limit and self.uvicorn:
                logger.info(f"no request for {idle:.0f} s (--exit-when-idle {limit:g}); shutting down")
                self.uvicorn.should_exit = True
                return

    def shutdown(self) -> None:
        """Finish queued work, stop the engine thread, release the engine. Idempotent."""
        self.batcher.stop()
        self.engine.close()

    # -- running ----------------------------------------------------------------------------------
    def make_uvicorn(self, **overrides) -> uvicorn.Server:
        config = uvicorn.Config(self.app, host=self.cfg.host, port=self.cfg.port, access_log=False,
                                log_level="warning", lifespan="on", **overrides)
        self.uvicorn = _Uvicorn(config, self)
        return self.uvicorn

    def run(self) -> None:
        """Serve until SIGTERM / Ctrl-C (or idle), in this (main) thread."""
        server = self.make_uvicorn()
        logger.info(f"serving {self.cfg.model} on http://{self.cfg.host}:{self.cfg.port} (engine {self.engine_name}, "
                    f"aux layers {self.aux_layer_ids}, target_probs {self.cfg.probs_dtype}); /health answers "
                    "200 once the engine is ready")
        server.run()
        logger.info("stopped")


def target_spec(cfg: ServeConfig) -> TargetSpec:
    """What target_probs holds, from --supervision / --k / --keep-mass / --tail; UserError names a bad one."""
    if cfg.supervision not in ("draft", "draft-topk"):
        raise UserError(f"--supervision {cfg.supervision!r} cannot be served: NeMo's client trains on target_probs, "
                        "a draft distribution", "pass --supervision draft (the default) or draft-topk")
    if cfg.supervision == "draft":
        if cfg.keep_mass is not None:
            raise UserError(f"--keep-mass {cfg.keep_mass} needs the sparse draft target",
                            "add --supervision draft-topk (with --k, the most ids a token keeps)")
        return TargetSpec()
    if cfg.k < 1:
        raise UserError(f"--k {cfg.k}: a draft-topk target keeps at least one id per token", "pass e.g. --k 64")
    if cfg.keep_mass is not None and not (math.isfinite(cfg.keep_mass) and 0 < cfg.keep_mass < 1):
        raise UserError(f"--keep-mass {cfg.keep_mass} is not a share of the draft mass strictly between 0 and 1",
                        "pass e.g. --keep-mass 0.99")
    if cfg.tail not in TAIL_MODES:
        raise UserError(f"--tail {cfg.tail!r} is not one of {', '.join(TAIL_MODES)}", "pick one of them")
    return TargetSpec("draft-topk", cfg.k, cfg.keep_mass, cfg.tail)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM / Ctrl-C that drained cleanly exits with 0 (uvicorn
    re-raises the signal after its graceful shutdown, which ends the process with -15 / 130)."""

    def __init__(self, config: uvicorn.Config, target: TargetServer):
        super().__init__(config)
        self.target = target

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info(f"{signal.Signals(sig).name}: draining {self.target.in_flight} request(s) in flight, then "
                        "stopping the engine (again to force)")
        self.handle_exit(sig, frame)


class _TrackActivity:
    """ASGI middleware: counts POSTs in flight (response streaming included) and when the last
    one came, for --exit-when-idle. Pure ASGI, so streamed bodies pass through untouched."""

    def __init__(self, app, server: TargetServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        self.server.in_flight += 1
        self.server.last_activity = time.monotonic()
        try:
            return await self.app(scope, receive, send)
        finally:
            self.server.in_flight -= 1
            self.server.last_activity = time.monotonic()


def _stream(tensors: dict[str, torch.Tensor | None]) -> Response:
    """A wire-format response streamed from the tensors' own memory, with its Content-Length."""
    size = wire.encoded_size(tensors)

    async def body():
        for piece in wire.encode_chunks(tensors):
            yield piece

    return StreamingResponse(body(), media_type="application/octet-stream",
                             headers={"content-length": str(size)})


def keep_triton_out(engine: str) -> bool:
    """Keep Triton out of this process when it serves on a CPU with the transformers engine.
    Process-wide (`sys.modules`), so only the server's entry point calls it (the CLI's serve
    command, which owns its process), before the engine is built. Nothing there runs Triton
    (the CPU head is PyTorch), but torch._dynamo, which transformers imports, imports `triton`
    whenever the package is installed, and libtriton's code then stays resident: tens of MB of
    the server's peak memory (`bench/bench_serve.py`) for nothing. A None in sys.modules makes
    `import triton` raise ImportError and `importlib.util.find_spec("triton")` answer None, so
    torch and transformers treat it as absent. Not for vLLM, which imports Triton on every
    device, nor for CUDA (the head's kernel). Returns whether it did."""
    if engine != "hf" or torch.cuda.is_available() or "triton" in sys.modules:
        return False
    sys.modules["triton"] = None
    return True


__all__ = ["ServeConfig", "TargetServer", "keep_triton_out", "target_spec"]
