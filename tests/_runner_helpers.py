"""Shared pieces of the runner tests (issue 4): batches, the supervision oracle, engine processes.

`reference_supervision` is the oracle for `forward_eagle3_supervision`: every head output
computed in float64 from full logits (transformers' own, in the runner tests), on the non-pad
positions only.
"""

from __future__ import annotations

import torch
from _assert import assert_close, assert_ids_equal

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


def reference_supervision(
    logits: torch.Tensor, mask: torch.Tensor, *, k: int, draft_ids: torch.Tensor
) -> dict:
    """Every head output from full logits `[B, S, V]` at the non-pad positions, in float64."""
    x = logits[mask.bool()].double()
    lse = torch.logsumexp(x, dim=-1)
    logprobs = x - lse[:, None]
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    draft = torch.log_softmax(x[:, draft_ids], dim=-1)
    in_draft = torch.zeros(x.shape[-1], dtype=torch.bool)
    in_draft[draft_ids] = True
    argmax = x.argmax(dim=-1)
    return {
        "logits": x,
        "lse": lse,
        "argmax": argmax,
        "logprobs": logprobs,
        "topk_ids": top_ids,
        "topk_logprobs": top_vals,
        "topk_tail": 1 - top_vals.exp().sum(-1),
        "draft_logprobs": draft,
        "argmax_in_draft": in_draft[argmax],
    }


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
