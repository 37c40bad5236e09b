"""Shared pieces of the runner tests: batches, the expected supervision, engine processes.

`reference_supervision` is what `forward_eagle3_supervision` must return: every head output
of full logits (transformers' own, in the runner tests) on the non-pad positions, from the
tests' float64 oracle (`_oracle.oracle_from_logits`).
"""

from __future__ import annotations

import torch
from _assert import assert_close, assert_ids_equal
from _oracle import oracle_from_logits

# Unequal lengths, right-padded to S = max: row 1 is full, row 2 is a single token.
LENGTHS = (9, 14, 1, 6)
PAD_ID = 7  # a real token id, so a runner that ignored the mask would get different numbers


def make_batch(
    lengths=LENGTHS, vocab: int = 1031, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `(input_ids [B, S], attention_mask [B, S])` with fresh random tokens."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.randint(10, vocab, (len(lengths), S), generator=g)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, PAD_ID))
    return ids, mask


def rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(input_ids, attention_mask)]


def draft_vocab(vocab: int = 1031, size: int = 257, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:size].sort().values


DRAFT_TOPK_FIELDS = ("draft_topk_ids", "draft_topk_logprobs", "draft_topk_tail")


def reference_supervision(
    logits: torch.Tensor, mask: torch.Tensor, *, k: int, draft_ids: torch.Tensor,
    draft_topk: bool = False,
) -> dict:
    """Every head output of full logits `[B, S, V]` at the non-pad positions, in float64: the
    full-vocab top-k with k, or (`draft_topk`) the draft top-k instead, as one call asks for."""
    out = oracle_from_logits(logits[mask.bool()], k=k, draft_ids=draft_ids).as_dict()
    drop = ("topk_ids", "topk_logprobs", "topk_tail") if draft_topk else DRAFT_TOPK_FIELDS
    return {name: t for name, t in out.items() if name not in drop}


def check_supervision(
    sup, ref: dict, mask: torch.Tensor, *, atol: float, rtol: float, name: str
) -> None:
    """`sup` equals `ref` on non-pad positions and is exactly zero / False on pad positions."""
    keep = mask.bool()
    for field, expected in ref.items():
        got = getattr(sup, field)
        assert got is not None, f"{name}: {field} missing"
        assert got.shape[:2] == mask.shape, f"{name}: {field} shape {tuple(got.shape)}"
        assert not got[~keep].any(), f"{name}: {field} is not zero at pad positions"
        if expected.dtype in (torch.int64, torch.bool):
            assert_ids_equal(got[keep], expected, name=f"{name}.{field}")
        else:
            assert_close(got[keep], expected, atol=atol, rtol=rtol, name=f"{name}.{field}")


def engine_processes() -> set[int]:
    """PIDs of this process's live descendants, minus multiprocessing's resource tracker
    (started once per interpreter by the first spawn and kept for its lifetime)."""
    import psutil

    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
            pids.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def zombie_children() -> set[int]:
    """PIDs of this process's direct children that exited but were never reaped."""
    import psutil

    pids = set()
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def wait_gone(pids: set[int], timeout_s: float = 15.0) -> set[int]:
    """The subset of `pids` still alive after waiting up to `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        alive = pids & engine_processes()
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)
