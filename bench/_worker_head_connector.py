"""The head in the engine's worker: a prototype connector for `bench_head_in_worker.py`.

`WorkerHeadConnector` is eagle_fast's hidden-states connector with one change: before a request's
capture is written, the writer thread applies the target's head (final norm + LM head,
`TargetHead.compute`) to the capture's final slot, and the file holds the aux slots and the
head's supervision instead of the final hidden state:
    aux_hidden_states [T, n_aux, H] (target dtype), token_ids [T] int64,
    sup.<field> for every head output (draft_topk_ids, draft_topk_logprobs, ... or
    draft_logprobs, lse, argmax, ...), in `out_dtype` where the field is a log-prob.

Configuration rides in `kv_connector_extra_config["eagle_fast_head"]`:
    {"model": checkpoint dir, "outputs": [head output names], "k": int,
     "draft_ids": [ids] or None, "out_dtype": "bfloat16" | "float32"}
The head loads once per worker, on the first write (`TargetHead.from_pretrained`, the same
tensors the consumer's head reads). Each writer thread runs it on one thread
(`one_thread_here`), so the writer pool's threads do not each start an OpenMP team over the
cores the engine's forward uses. The final slot is the capture's last (vLLM capture ids in
ascending order end with num_hidden_layers).

It lives in bench/ because it is a measurement, not a product path: vLLM loads it by module
name in the worker processes, so the benchmark puts bench/ on their PYTHONPATH. CPU write path
only (the parent's host-memory branch); on CUDA the parent's submission would write it unchanged.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from eagle_fast.files import FAILED_SUFFIX
from eagle_fast.runners.connector import EagleFastHiddenStatesConnector

__all__ = ["WorkerHeadConnector"]


class WorkerHeadConnector(EagleFastHiddenStatesConnector):
    """eagle_fast's connector with the head applied in the writer threads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_cfg = self._kv_transfer_config.get_from_extra_config("eagle_fast_head", None)
        self._head = None
        self._draft_ids = None
        self._head_lock = threading.Lock()

    def _load_head(self):
        from eagle_fast.head import TargetHead

        with self._head_lock:
            if self._head is None:
                cfg = self._head_cfg
                ids = cfg.get("draft_ids")
                self._draft_ids = None if ids is None else torch.tensor(ids, dtype=torch.long)
                self._head = TargetHead.from_pretrained(cfg["model"])
        return self._head

    def _supervision(self, final: torch.Tensor) -> dict[str, torch.Tensor]:
        from eagle_fast.kernels import one_thread_here

        head = self._load_head()
        one_thread_here()
        cfg = self._head_cfg
        out = head.compute(final, tuple(cfg["outputs"]), k=int(cfg.get("k", 0)),
                           draft_ids=self._draft_ids, out_dtype=getattr(torch, cfg["out_dtype"]))
        return {f"sup.{name}": value.contiguous() for name, value in out.as_dict().items()}

    def _write_tensors(self, tensors: dict, event, filename: str, lock_fd: int | None) -> None:
        if self._head_cfg is not None:
            try:
                hs = tensors.pop("hidden_states")
                tensors = {"aux_hidden_states": hs[:, :-1].contiguous(), **tensors,
                           **self._supervision(hs[:, -1])}
            except BaseException as exc:  # the reader must see the failure, and the lock released
                with contextlib.suppress(OSError), open(filename + FAILED_SUFFIX, "w") as f:
                    f.write(f"head in worker: {type(exc).__name__}: {exc}")
                if lock_fd is not None:
                    os.close(lock_fd)
                raise
        EagleFastHiddenStatesConnector._write_tensors(tensors, event, filename, lock_fd)
