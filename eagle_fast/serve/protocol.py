"""NeMo AutoModel 0.7.0's remote-target protocol (`eagle/remote/protocol.py`): endpoints, the
response keys, and the checks every request passes before it reaches the engine.

A request that fails a check raises `RequestError(status, cause, fix)`: the app answers it as
a 4xx JSON body `{"error": cause, "fix": fix}` and keeps serving. A request that passes is
one the engine can run: right-padded rows of in-vocabulary ids within the length and token
limits, against a vocabulary mapping that has been set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_fast.errors import UserError

EP_GENERATE, EP_SET_VOCAB_MAPPING, EP_MODEL_INFO = "generate", "set_vocab_mapping", "model_info"
EP_INPUT_EMBEDDINGS, EP_INIT_NCCL, EP_HEARTBEAT = "input_embeddings", "init_nccl", "heartbeat"
EP_DISCONNECT, EP_HEALTH = "disconnect", "health"
# The response's keys, in the order NeMo's server sends them and its client reads them.
SUPERVISION_KEYS = ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask")
GENERATE_KEYS = ("input_ids", "attention_mask", "loss_mask")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class RequestError(UserError):
    """A request the server refuses: HTTP `status`, `cause` and `fix` go back as JSON."""

    def __init__(self, status: int, cause: str, fix: str | None = None):
        super().__init__(cause, fix)
        self.status = status

    def body(self) -> dict:
        return {"error": self.cause, "fix": self.fix}


@dataclass(frozen=True)
class VocabMapping:
    """The draft vocabulary as NeMo sends it, plus the sorted ids the head takes.

    selected_ids [Vd] int64 in the client's order (target_probs columns follow it);
    selected_mask [V] bool (position_mask = selected_mask[argmax] & loss mask, as NeMo does);
    draft_ids [Vd] strictly increasing; columns [Vd]: where each client column sits in
    draft_ids' order, or None when the client's order is already sorted.
    """

    selected_ids: torch.Tensor
    selected_mask: torch.Tensor
    draft_ids: torch.Tensor
    columns: torch.Tensor | None


@dataclass
class GenerateRequest:
    """One validated `generate` body: `[B, S]` tensors, the unpadded rows and their lengths."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rows: list[list[int]]
    lengths: list[int]
    mapping: VocabMapping

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def _need(tensors: dict, key: str, endpoint: str) -> torch.Tensor:
    t = tensors.get(key)
    if t is None:
        raise RequestError(422, f"/{endpoint}: {key!r} is missing (got keys {sorted(tensors)})",
                           f"send {', '.join(repr(k) for k in tensors_needed(endpoint))}")
    return t


def tensors_needed(endpoint: str) -> tuple[str, ...]:
    return GENERATE_KEYS if endpoint == EP_GENERATE else ("selected_token_ids", "selected_token_mask")


def _check_only(tensors: dict, endpoint: str) -> None:
    extra = sorted(set(tensors) - set(tensors_needed(endpoint)))
    if extra:
        raise RequestError(422, f"/{endpoint}: unsupported key(s) {extra} (packing metadata and "
                           "other extras are not served)", f"send only {list(tensors_needed(endpoint))}")


def parse_vocab_mapping(tensors: dict, vocab_size: int) -> VocabMapping:
    """`set_vocab_mapping` body -> VocabMapping, or RequestError(422) naming what is wrong."""
    _check_only(tensors, EP_SET_VOCAB_MAPPING)
    ids = _need(tensors, "selected_token_ids", EP_SET_VOCAB_MAPPING)
    mask = _need(tensors, "selected_token_mask", EP_SET_VOCAB_MAPPING)
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in _INT_DTYPES:
        raise RequestError(422, f"selected_token_ids must be a non-empty 1-D integer tensor, got "
                           f"{ids.dtype} of shape {list(ids.shape)}", "send the draft's target ids [Vd] int64")
    ids = ids.long()
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise RequestError(422, f"selected_token_ids hold ids outside the target vocabulary [0, "
                           f"{vocab_size}): min {lo}, max {hi}", "build the draft vocabulary for this target")
    draft_ids, order = ids.sort()
    if bool((draft_ids[1:] == draft_ids[:-1]).any()):
        raise RequestError(422, "selected_token_ids has repeated ids", "send each target id once")
    if mask.dim() != 1 or mask.numel() != vocab_size or not (mask.dtype == torch.bool or mask.dtype
                                                             in _INT_DTYPES):
        raise RequestError(422, f"selected_token_mask must be a 1-D bool tensor of the target's "
                           f"vocabulary size {vocab_size}, got {mask.dtype} of shape {list(mask.shape)}",
                           "send a [V] bool mask, True at the draft's target ids")
    columns = None if bool((order == torch.arange(order.numel())).all()) else order.argsort()
    return VocabMapping(ids, mask.bool(), draft_ids, columns)


def parse_generate(tensors: dict, mapping: VocabMapping | None, *, vocab_size: int, max_len: int,
                   max_batch_tokens: int) -> GenerateRequest:
    """`generate` body -> GenerateRequest, or RequestError (409 no mapping yet, 413 over a limit,
    422 a wrong key, dtype, rank, shape, padding or id)."""
    _check_only(tensors, EP_GENERATE)
    ids, attn, loss = (_need(tensors, k, EP_GENERATE) for k in GENERATE_KEYS)
    if mapping is None:
        raise RequestError(409, "generate before set_vocab_mapping: the server does not know the draft "
                           "vocabulary yet", "call set_vocab_mapping(selected_token_ids, selected_token_mask) first")
    for name, t in zip(GENERATE_KEYS, (ids, attn, loss)):
        if t.dim() != 2:
            raise RequestError(422, f"{name} must be [B, S] (rank 2), got shape {list(t.shape)}",
                               "send right-padded [batch, sequence] tensors")
        if tuple(t.shape) != tuple(ids.shape):
            raise RequestError(422, f"{name} shape {list(t.shape)} != input_ids shape {list(ids.shape)}",
                               "send input_ids, attention_mask and loss_mask of one [B, S] shape")
    B, S = ids.shape
    if B == 0 or S == 0:
        raise RequestError(422, f"input_ids is empty (shape {[B, S]})", "send at least one token")
    if ids.dtype not in _INT_DTYPES:
        raise RequestError(422, f"input_ids must be an integer tensor, got {ids.dtype}",
                           "send token ids as int64")
    if attn.dtype not in _INT_DTYPES + (torch.bool,):
        raise RequestError(422, f"attention_mask must be an integer or bool tensor, got {attn.dtype}",
                           "send a 0/1 int64 mask")
    if loss.is_complex():
        raise RequestError(422, f"loss_mask must be a real tensor, got {loss.dtype}", "send a 0/1 mask")
    if B * S > max_batch_tokens:
        raise RequestError(413, f"batch of {B} x {S} = {B * S:,} tokens is over the server's budget of "
                           f"{max_batch_tokens:,}", "send smaller batches, or restart the server with a "
                           "larger --max-batch-tokens")
    keep = attn.long()
    if bool(((keep != 0) & (keep != 1)).any()):
        raise RequestError(422, "attention_mask holds values other than 0 and 1", "send a 0/1 mask")
    lengths = keep.sum(dim=1)
    expect = torch.arange(S)[None, :] < lengths[:, None]
    bad = (keep.bool() != expect).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise RequestError(422, f"attention_mask rows {bad[:8]} are not right-padded (ones then zeros)",
                           "pad on the right; left or inner padding is not supported")
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise RequestError(422, f"rows {empty[:8]} have no tokens (attention_mask all zero)",
                           "drop empty rows")
    longest = int(lengths.max())
    if longest > max_len:
        raise RequestError(413, f"a row has {longest} tokens, over the server's --max-len {max_len}",
                           "send shorter rows, or restart the server with a larger --max-len")
    real = ids.long()[keep.bool()]
    lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= vocab_size:
        raise RequestError(422, f"input_ids hold ids outside the target vocabulary [0, {vocab_size}): "
                           f"min {lo}, max {hi}", "tokenize with the target's tokenizer")
    lens = lengths.tolist()
    rows = [row[:n].tolist() for row, n in zip(ids.long(), lens)]
    return GenerateRequest(ids, attn, loss, rows, lens, mapping)
