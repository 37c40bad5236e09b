"""Captures -> supervision: the one path from final hidden states to what a draft trains on.

`supervise(head, finals, outputs, ...)` runs the target head over the rows' final pre-norm
hidden states in planned groups and hands each group's results to a destination:
  - `PaddedFields(B, S)`: `[B, S, ...]` fields with zeros at pad positions, for
    `forward_eagle3_supervision` (the result is a `Supervision`);
  - `RowFields()`: one `[T_i, ...]` tensor per row and field, for the extraction pipeline.
Both go through the same planner (`plan_supervision_groups`) and the same memory bound: a
group's staged results never add more than `STAGING_BYTES` to the size of the fields being
filled. A destination that keeps nothing (the server's `StreamedFields`, `keeps = False`)
bounds each group by its own `staging_bytes` instead. On a CPU, groups run one per torch
thread at once (`group_workers`), each on a single thread and put in order, so up to that
many groups' staged results exist together (the plan itself does not depend on the thread
count). PaddedFields copies each group into its
fields (so the head returns fp32 and the copy rounds to out_dtype once); RowFields keeps the head's outputs as they are (the head rounds),
which stages nothing, so only `GROUP_TOKENS` bounds its groups.

Limits: a group is one head call, and the CPU GEMM may round a row differently for another
group size; a given batch always gets the same groups.
"""

from __future__ import annotations

import collections
import contextvars
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np
import torch

from eagle_fast.dtypes import NUMPY_TWINS
from eagle_fast.kernels import (
    LSE_OUTPUTS,
    OUT_DTYPE_FIELDS,
    OUTPUT_NAMES,
    HeadOutput,
    one_thread_here,
    per_thread_counts_available,
)

# Head outputs `lm_head` knows, plus "hidden" (the final pre-norm hidden state itself).
SUPERVISION_OUTPUTS = (*OUTPUT_NAMES, "hidden")
# Group sizing (see `plan_supervision_groups`). Each head call also streams the whole weight
# (a fixed cost per call: `bench/bench_cpu_ops.py`, "call-overhead"), so groups are as large as
# the staging bound allows, up to GROUP_TOKENS, and never smaller than MIN_TOKENS.
STAGING_BYTES = 16 << 20
GROUP_TOKENS = 8192
MIN_TOKENS = 16


@dataclass
class Supervision:
    """What `forward_eagle3_supervision` returns: aux hidden states plus the requested head outputs.

    Shapes are `[B, S, ...]`, unshifted (position t describes the distribution after token t).
    Pad positions (attention_mask == 0) are zero (False for bools) in every field.

    aux_hidden_states  [B, S, 3H]  target dtype, the three aux layers concatenated
    attention_mask     [B, S]      as given
    head               the head's outputs, a `HeadOutput` with leading dims [B, S] (its docstring
                       gives each field's shape and dtype; out_dtype defaults to the target dtype
                       here). Each of its fields is also read here: `sup.lse` is `sup.head.lse`.
    hidden             [B, S, H]   target dtype, final hidden BEFORE the final norm, when requested
    """

    aux_hidden_states: torch.Tensor
    attention_mask: torch.Tensor
    head: HeadOutput
    hidden: torch.Tensor | None = None

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The filled fields by name, the head's among them."""
        out = {"aux_hidden_states": self.aux_hidden_states, "attention_mask": self.attention_mask,
               **self.head.as_dict()}
        if self.hidden is not None:
            out["hidden"] = self.hidden
        return out

    def target_probs(self, tail: str = "spread", draft_size: int | None = None) -> torch.Tensor:
        """EAGLE-3's `target_p` over the draft vocabulary, fp32 `[B, S, Vd]`, UNSHIFTED.

        From "draft" as computed; from "draft_topk" rebuilt by `dense_target_p` (`tail`, and
        `draft_size` = Vd, which the sparse fields do not carry)."""
        mask = self.attention_mask.unsqueeze(-1).to(torch.float32)
        if self.draft_logprobs is not None:
            return self.draft_logprobs.float().exp() * mask
        if self.draft_topk_ids is not None and draft_size is not None:
            return dense_target_p(self.draft_topk_ids, self.draft_topk_logprobs,
                                  self.draft_topk_tail, draft_size, tail) * mask
        raise ValueError("target_probs needs outputs=('draft',), or ('draft_topk',) and draft_size")

    def to_nemo_batch(self, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """NeMo AutoModel's precomputed-supervision `Eagle3TargetBatch` (draft vocab only).

        Same shift as NeMo's `generate_batch` + `_compute_target_distribution`: `target_probs`,
        `position_mask` (argmax in draft AND loss mask), `input_ids` and `loss_mask` are shifted
        left by one with a zero tail; `aux_hidden_states` and `attention_mask` stay aligned.
        Needs `outputs` to include "draft". Imports nemo_automodel lazily.
        """
        from nemo_automodel.components.speculative.eagle.target import Eagle3TargetBatch

        if self.argmax_in_draft is None:
            raise ValueError("to_nemo_batch needs outputs=('draft',) and draft_ids")
        probs = self.target_probs()
        position_mask = (
            shift_left(self.argmax_in_draft) & shift_left(loss_mask.to(probs.device)).bool()
        )
        return Eagle3TargetBatch(
            aux_hidden_states=self.aux_hidden_states,
            input_ids=shift_left(input_ids),
            attention_mask=self.attention_mask,
            loss_mask=shift_left(loss_mask),
            target_probs=shift_left(probs),
            position_mask=position_mask.unsqueeze(-1),
        )


def _head_field(name: str) -> property:
    return property(lambda self: getattr(self.head, name), doc=f"`head.{name}` (see `HeadOutput`)")


for _field in fields(HeadOutput):  # sup.lse, sup.argmax, ...: the head's fields, read through
    setattr(Supervision, _field.name, _head_field(_field.name))

TAIL_MODES = ("spread", "drop", "renormalize")


def dense_target_p(
    ids: torch.Tensor, logprobs: torch.Tensor, tail: torch.Tensor, draft_size: int, mode: str = "spread"
) -> torch.Tensor:
    """The dense draft distribution fp32 `[..., Vd]` rebuilt from the sparse draft target.

    ids `[..., k]` (indices into the draft vocabulary), logprobs `[..., k]` (over the draft
    vocabulary), tail `[...]` (the draft mass outside them). `mode`:
      "spread"       the tail spread evenly over the Vd - k other ids (sums to 1 up to the
                     rounding of the stored log-probs);
      "drop"         zero outside the top-k (sums to 1 - tail, as stored);
      "renormalize"  zero outside the top-k, the top-k scaled to sum to 1.
    """
    if mode not in TAIL_MODES:
        raise ValueError(f"tail mode must be one of {TAIL_MODES}, got {mode!r}")
    k = ids.shape[-1]
    if not 1 <= k <= draft_size:
        raise ValueError(f"draft_size {draft_size} must be >= k = {k} (the stored top-k width)")
    p = logprobs.float().exp()
    if mode == "renormalize":
        p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if mode == "spread" and draft_size > k:
        fill = (tail.float() / (draft_size - k)).unsqueeze(-1)
    else:
        fill = torch.zeros(*ids.shape[:-1], 1, device=ids.device)
    out = fill.expand(*ids.shape[:-1], draft_size).contiguous()
    return out.scatter_(-1, ids.long(), p)


def keep_mass_lengths(logprobs: torch.Tensor, tail: torch.Tensor, keep_mass: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token, the smallest k whose draft mass reaches `keep_mass`, capped by K.

    logprobs `[T, K]` in descending order (the head's draft top-k), tail `[T]` (the draft mass
    outside them). Returns lengths int64 `[T]` (1..K), the new tail float32 `[T]` (the mass
    outside the kept ids) and capped bool `[T]` (the K ids hold less than `keep_mass`).
    In float64 on the given (stored) log-probs: kept mass = cumsum(exp(logprobs)); the new tail
    = tail + the dropped probabilities summed smallest first (never 1 - kept mass, which
    cancels to noise when the kept ids hold almost all the mass)."""
    p = logprobs.double().exp()
    reached = p.cumsum(-1) >= keep_mass
    capped = ~reached[:, -1] if p.shape[-1] else torch.ones(p.shape[0], dtype=torch.bool)
    lengths = torch.where(capped, p.shape[-1], reached.int().argmax(-1) + 1).long()
    suffix = torch.cat((p.flip(-1).cumsum(-1).flip(-1), p.new_zeros(p.shape[0], 1)), -1)
    new_tail = tail.double() + suffix.gather(-1, lengths[:, None]).squeeze(-1)
    return lengths, new_tail.float(), capped


def dense_target_p_ragged(lengths: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, tail: torch.Tensor,
                          draft_size: int, mode: str = "spread") -> torch.Tensor:
    """`dense_target_p` for a different k per token: fp32 `[T, Vd]`.

    lengths `[T]` (k_t), ids and logprobs `[sum k_t]` (token by token, each token's kept ids in
    order), tail `[T]` (the draft mass outside each token's kept ids). Each row equals
    `dense_target_p` of that token's k_t ids alone, in every mode; a token of length 0 (a pad
    row) gets its tail spread ("spread") or zeros."""
    if mode not in TAIL_MODES:
        raise ValueError(f"tail mode must be one of {TAIL_MODES}, got {mode!r}")
    lengths = lengths.long()
    T = lengths.shape[0]
    if int(lengths.sum()) != ids.shape[0] or ids.shape != logprobs.shape:
        raise ValueError(f"ragged draft top-k: lengths sum to {int(lengths.sum())}, ids hold "
                         f"{tuple(ids.shape)}, logprobs {tuple(logprobs.shape)}")
    if T and int(lengths.max()) > draft_size:
        raise ValueError(f"draft_size {draft_size} must be >= k = {int(lengths.max())} (the longest stored row)")
    rows = torch.repeat_interleave(torch.arange(T, device=ids.device), lengths)
    p = logprobs.float().exp()
    if mode == "renormalize":
        mass = torch.zeros(T, device=ids.device).index_add_(0, rows, p)
        p = p / mass.clamp_min(torch.finfo(torch.float32).tiny)[rows]
    if mode == "spread":
        others = (draft_size - lengths).clamp_min(1).float()
        fill = torch.where(lengths < draft_size, tail.float() / others, 0.0)
    else:
        fill = torch.zeros(T, device=ids.device)
    out = fill[:, None].expand(T, draft_size).contiguous()
    out[rows, ids.long()] = p
    return out


def sparse_target_p(ids: torch.Tensor, logprobs: torch.Tensor, tail: torch.Tensor, draft_size: int,
                    keep_mass: float | None = None, mode: str = "spread") -> torch.Tensor:
    """The dense draft distribution fp32 `[T, Vd]` that a draft-topk dataset rebuilds to, from the
    head's draft top-k (ids / logprobs `[T, K]`, tail `[T]`): with `keep_mass` each token keeps
    its `keep_mass_lengths` ids, as the native layout stores them and `Eagle3Dataset.target_p`
    reads them back; without, all K. `eagle-fast serve --supervision draft-topk` sends this."""
    if not keep_mass:
        return dense_target_p(ids, logprobs, tail, draft_size, mode)
    lengths, kept_tail, _ = keep_mass_lengths(logprobs, tail, keep_mass)
    keep = torch.arange(ids.shape[-1], device=ids.device)[None, :] < lengths[:, None].to(ids.device)
    return dense_target_p_ragged(lengths.to(ids.device), ids[keep], logprobs[keep], kept_tail.to(ids.device),
                                 draft_size, mode)


def shift_left(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """NeMo's `_shift_left_with_zero`: `t` one step left along `dim` (the sequence: 1 for
    `[B, S, ...]`, 0 for one sample), a zero at the end; row t then describes position t+1."""
    before = (slice(None),) * (dim % t.dim())
    return torch.cat((t[(*before, slice(1, None))], torch.zeros_like(t[(*before, slice(None, 1))])), dim=dim)


# -- destinations ------------------------------------------------------------------------------
class PaddedFields:
    """`[B, S, ...]` fields (lazily zeroed pages, `zeros`), filled row piece by row piece."""

    copies = True
    keeps = True  # the fields stay: groups may grow by what they will hold anyway

    def __init__(self, B: int, S: int, device, out_dtype: torch.dtype):
        self.shape, self.device, self.out_dtype = (B, S), device, out_dtype
        self.fields: dict[str, torch.Tensor] = {}

    def put(self, pieces: list[tuple[int, int, int]], values: dict[str, torch.Tensor]) -> None:
        start = 0
        for b, a, c in pieces:
            for name, value in values.items():
                if name not in self.fields:
                    dtype = self.out_dtype if name in OUT_DTYPE_FIELDS else value.dtype
                    self.fields[name] = zeros((*self.shape, *value.shape[1:]), dtype, self.device)
                self.fields[name][b, a:c] = value[start : start + c - a]
            start += c - a


class RowFields:
    """One `[T_i, ...]` tensor per row and field: views of the head's own outputs (a row that
    spans groups is joined once, when asked for)."""

    copies = False
    keeps = True

    def __init__(self, n_rows: int):
        self._parts: list[dict[str, list[torch.Tensor]]] = [{} for _ in range(n_rows)]

    def put(self, pieces: list[tuple[int, int, int]], values: dict[str, torch.Tensor]) -> None:
        start = 0
        for b, a, c in pieces:
            for name, value in values.items():
                self._parts[b].setdefault(name, []).append(value[start : start + c - a])
            start += c - a

    def rows(self) -> list[dict[str, torch.Tensor]]:
        return [{name: parts[0] if len(parts) == 1 else torch.cat(parts) for name, parts in row.items()}
                for row in self._parts]


# -- the one path ------------------------------------------------------------------------------
def supervise(
    head,
    finals: list[torch.Tensor | None],
    outputs: Sequence[str],
    into,
    *,
    draft_ids: torch.Tensor | None = None,
    k: int = 0,
    out_dtype: torch.dtype,
    impl: str = "auto",
) -> None:
    """Run `head` (a `TargetHead`) over every row's final pre-norm hidden `finals[i]` `[T_i, H]`
    and put the `outputs` ("hidden" = the final hidden itself) into `into`: `PaddedFields`,
    `RowFields`, or any destination with their `copies`, `keeps` and `put` (and, where `keeps`
    is False, `staging_bytes`).

    Rows go through the head in groups planned by `plan_supervision_groups` (pieces of rows);
    `finals` entries are dropped (set to None) once their last group has run, so the inputs
    do not add to the peak next to the outputs being filled. Outputs in `OUT_DTYPE_FIELDS`
    come in `out_dtype`; the head computes in fp32 and rounds once either way.
    """
    head_outputs = tuple(o for o in outputs if o != "hidden")
    with_hidden = "hidden" in outputs
    k = k if {"topk", "draft_topk"} & set(head_outputs) else 0
    # A copying destination rounds while it copies, so the head returns fp32 and no 16-bit
    # transient of the group sits next to the fp32 one. Not with a top-k, whose log-probs the
    # head rounds from float64 (fp32 first would round twice).
    rounds_itself = {"topk", "draft_topk"} & set(head_outputs)
    # The compiled CPU walk rounds once from fp32 and keeps no fp32 copy: asking it for out_dtype
    # gives the copy's bits with half the staging (and the group plan changes nothing it returns:
    # its bytes per token do not depend on the other rows of a call).
    rounds_itself = rounds_itself or (into.copies and head.rounds_once(head_outputs, k, impl))
    head_dtype = torch.float32 if into.copies and not rounds_itself else out_dtype
    lens = [f.shape[0] for f in finals]
    staged, kept = bytes_per_token(head, head_outputs, with_hidden, draft_ids, k, head_dtype, out_dtype)
    groups = plan_supervision_groups(
        lens, staged if into.copies else 0, kept if into.keeps else 0,
        STAGING_BYTES if into.keeps else into.staging_bytes,
        max_tokens=GROUP_TOKENS, min_tokens=MIN_TOKENS,
    )  # fmt: skip
    last_use = {b: g for g, pieces in enumerate(groups) for b, _, _ in pieces}

    def group_input(g: int) -> torch.Tensor:
        parts = [finals[b][a:c] for b, a, c in groups[g]]
        final = torch.cat(parts) if len(parts) > 1 else parts[0]
        for b, _, _ in groups[g]:
            if last_use[b] == g:
                finals[b] = None
        return final

    def compute(final: torch.Tensor) -> dict[str, torch.Tensor]:
        values = head.compute(
            final, head_outputs, k=k, draft_ids=draft_ids, out_dtype=head_dtype, impl=impl
        ).as_dict()
        if with_hidden:
            values["hidden"] = final
        return values

    workers = group_workers(finals, len(groups), impl)
    if workers == 1:
        for g, pieces in enumerate(groups):
            into.put(pieces, compute(group_input(g)))
        return
    # CPU: `workers` groups at once, each on one thread, put in order. The head's tile loop is
    # many small ops, and one OpenMP team over the whole CPU waits at every op's barrier, the
    # more so when another process takes a core (the server's client, a data loader):
    # `bench/bench_cpu_ops.py` "group-parallel". Only the pool's own threads go single-threaded
    # (`one_thread_here`: per-thread counts, not `torch.set_num_threads`, which is process-wide),
    # so the caller's and every other thread's count stay theirs. The window holds `workers`
    # groups' results at most.
    # Each group runs in a copy of the caller's context, so what the caller scoped for its own
    # calls (`kernels._torch_screen.switched` / `counting`) holds in the pool's threads too.
    def submit(pool, g):
        return pool.submit(contextvars.copy_context().run, compute, group_input(g))

    with ThreadPoolExecutor(workers, thread_name_prefix="eagle-fast-head", initializer=one_thread_here) as pool:
        pending = collections.deque(submit(pool, g) for g in range(workers))
        for g, pieces in enumerate(groups):
            values = pending.popleft().result()
            into.put(pieces, values)
            del values
            if g + workers < len(groups):
                pending.append(submit(pool, g + workers))


def group_workers(finals: Sequence[torch.Tensor | None], n_groups: int, impl: str) -> int:
    """How many head groups `supervise` computes at once: the calling thread's torch thread
    count on a CPU (one thread each), 1 on CUDA, for the Triton interpreter, for a single group
    (which keeps all the caller's threads), or where a pool thread's count cannot be set for
    that thread alone (`per_thread_counts_available`)."""
    first = next((f for f in finals if f is not None), None)
    if (first is None or first.device.type != "cpu" or impl not in ("auto", "torch") or n_groups < 2
            or not per_thread_counts_available()):
        return 1
    return max(1, min(torch.get_num_threads(), n_groups))


def bytes_per_token(
    head, head_outputs, with_hidden: bool, draft_ids, k: int, head_dtype, out_dtype
) -> tuple[int, int]:
    """(staged, kept): bytes per token of one head call's results (plus its fp32 activation)
    while they are copied, and of the fields they end up in."""
    h_el, o_el = head_dtype.itemsize, out_dtype.itemsize
    V = head.vocab_size
    widths = {"argmax": (8, 8)}  # name -> (staged, kept) bytes per token
    if LSE_OUTPUTS & set(head_outputs):
        widths["lse"] = (4, 4)
    if "logits" in head_outputs:
        widths["logits"] = (h_el * V, o_el * V)
    if "logprobs" in head_outputs:
        widths["logprobs"] = (h_el * V, o_el * V)
    if "topk" in head_outputs:
        widths["topk"] = ((8 + h_el) * k + 4, (8 + o_el) * k + 4)
    if "draft" in head_outputs and draft_ids is not None:
        widths["draft"] = (h_el * draft_ids.numel() + 1, o_el * draft_ids.numel() + 1)
    if "draft_topk" in head_outputs:
        widths["draft_topk"] = ((8 + h_el) * k + 5, (8 + o_el) * k + 5)
    hidden_bytes = head.hidden_size * head.dtype.itemsize
    if with_hidden:
        widths["hidden"] = (0, hidden_bytes)  # the capture itself, already resident
    staged = sum(w for w, _ in widths.values()) + 4 * head.hidden_size + hidden_bytes
    kept = sum(w for _, w in widths.values())
    return staged, kept


def plan_supervision_groups(
    lens: Sequence[int],
    staged_per_token: int,
    kept_per_token: int,
    budget_bytes: int,
    *,
    max_tokens: int,
    min_tokens: int = 1,
) -> list[list[tuple[int, int, int]]]:
    """Head-call groups: lists of `(row, start, end)` token pieces that cover every row's
    `lens[row]` tokens once, in row-major order (a row may span groups).

    While a group of s tokens is copied into the fields, memory holds the fields written so
    far, the group's staged results (s * staged_per_token) and its new field pages. Sizing
    every group by s * staged_per_token <= budget_bytes + kept_per_token * after, where `after`
    counts the tokens of the groups that follow, keeps that sum within budget_bytes of the
    fields' final size at every step. Groups are planned from the last one backwards, so they
    shrink towards the end and the first group takes what is left; sizes are clamped to
    [min_tokens, max_tokens] (a first group smaller than the second shares its tokens).
    staged_per_token 0 (nothing staged: the fields are the head's outputs) gives groups of
    max_tokens.
    """
    total = int(sum(lens))
    if staged_per_token < 0 or kept_per_token < 0 or budget_bytes < 0:
        raise ValueError("plan_supervision_groups: bytes per token and budget must be >= 0")
    if max_tokens < 1 or not 1 <= min_tokens <= max_tokens:
        raise ValueError("plan_supervision_groups: need 1 <= min_tokens <= max_tokens")
    sizes: list[int] = []
    after = 0
    while after < total:
        if staged_per_token:
            s = (budget_bytes + kept_per_token * after) // staged_per_token
        else:
            s = max_tokens
        s = min(max(s, min_tokens), max_tokens, total - after)
        sizes.append(s)
        after += s
    sizes.reverse()
    if len(sizes) > 1 and sizes[0] < sizes[1]:
        # The first group took what was left, maybe a sliver: a whole call for it (the weight is
        # streamed per call), and tiny calls round differently (the CPU fp32 GEMM's per-row
        # result depends on the row count below ~16). Sharing the first two groups' tokens
        # evenly keeps both within the second group's bound, which the first one's exceeds.
        pair = sizes[0] + sizes[1]
        sizes[0], sizes[1] = pair - pair // 2, pair // 2
    groups: list[list[tuple[int, int, int]]] = []
    row, pos = 0, 0
    for s in sizes:
        pieces = []
        while s:
            while pos == lens[row]:
                row, pos = row + 1, 0
            take = min(s, lens[row] - pos)
            pieces.append((row, pos, pos + take))
            pos += take
            s -= take
        groups.append(pieces)
    return groups


_LAZY_ZEROS_MIN_BYTES = 1 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """`torch.zeros(shape)`, but on CPU without writing the zeros.

    `torch.zeros` allocates and then memsets every byte: for a [8, 1024, 151936] fp32 logits
    buffer that is 5 GB written (and resident) before the head writes it again, pad rows
    included. numpy's zeros uses calloc, whose large blocks are fresh pages that the kernel
    zero-fills on first touch, so pages nobody writes (pad rows) cost nothing and never become
    resident, and the rest are written once. Small buffers and other devices use torch.zeros.
    """
    device = torch.device(device)
    numel = math.prod(int(n) for n in shape)
    twin = NUMPY_TWINS.get(dtype)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or twin is None or nbytes < _LAZY_ZEROS_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    out = torch.from_numpy(np.zeros(tuple(int(n) for n in shape), dtype=twin))
    return out.view(dtype) if out.dtype != dtype else out
