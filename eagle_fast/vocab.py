"""Draft vocabulary: the most frequent loss-masked target tokens, stored as d2t / t2d.

EAGLE-3 drafts over a subset of the target vocabulary. We count token ids over the
supervised (loss-masked) positions of a dataset, exactly as SpecForge, vLLM speculators and
NeMo AutoModel do, and keep the `size` most frequent (ties to the lower id). The tokenizer's
bos / eos / pad / unk ids (config.json's, for a checkpoint without tokenizer files) are
always kept, as NeMo AutoModel's `build_eagle3_token_mapping` does (the draft must be able
to emit end-of-turn). If fewer distinct tokens were seen, the
lowest unseen ids fill the rest. The kept ids are sorted ascending, then stored as

  d2t  int64 [Vd]  offset form: target_id = draft_id + d2t[draft_id]   (vLLM, SpecForge)
  t2d  bool  [V]   t2d[target_id] = True iff the token is in the draft  (SGLang, SpecForge)

in one file that every consumer reads:
  *.pt           torch.save({"d2t", "t2d", "selected_token_ids", "target_vocab_size"}):
                 SpecForge's `vocab_mapping` file (d2t/t2d) and NeMo AutoModel's
                 `selected_token_ids_path` cache (selected_token_ids/target_vocab_size).
  *.safetensors  the same four tensors (target_vocab_size as a 1-element int64).
`load_draft_ids` reads these, NeMo's own cache file, or any safetensors/pt file holding
d2t (e.g. a trained draft checkpoint), and returns the sorted target ids.

Limits: frequencies are over the given data only; `size >= V` keeps the whole vocabulary
(d2t all zeros, t2d all True), which stores nothing smaller than full logits.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle_fast.chat import ChatFormat
from eagle_fast.checkpoint import load_model_info, special_token_ids
from eagle_fast.errors import UserError
from eagle_fast.files import atomic_write_bytes
from eagle_fast.inputs import LazyTokenizer, plan_inputs, resolve_max_len
from eagle_fast.store.safetensors import write_safetensors


@dataclass
class DraftVocab:
    ids: torch.Tensor           # int64 [Vd], strictly increasing target ids
    target_vocab_size: int      # V
    coverage: float | None = None   # share of counted tokens the draft covers
    counted_tokens: int = 0

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(self.size, dtype=torch.int64)

    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask


def count_tokens(pairs: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """int64 [V] counts of token ids at loss-masked positions of (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in pairs:
        t = torch.tensor(ids, dtype=torch.int64)[torch.tensor(mask, dtype=torch.bool)]
        t = t[(t >= 0) & (t < vocab_size)]
        if t.numel():
            counts += torch.bincount(t, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, size: int, special_ids: Iterable[int | None] = ()) -> DraftVocab:
    """Keep specials, then the most frequent ids (ties -> lower id), then lowest unseen ids."""
    vocab_size = int(counts.numel())
    if size <= 0:
        raise UserError(f"--size must be positive, got {size}", "pass e.g. --size 32000")
    total = int(counts.sum())
    if size >= vocab_size:
        ids = torch.arange(vocab_size, dtype=torch.int64)
        return DraftVocab(ids, vocab_size, 1.0 if total else None, total)
    chosen: list[int] = []
    seen: set[int] = set()
    for tid in special_ids:
        if tid is not None and 0 <= int(tid) < vocab_size and int(tid) not in seen:
            chosen.append(int(tid))
            seen.add(int(tid))
    order = torch.argsort(counts, descending=True, stable=True).tolist()
    for tid in order:
        if len(chosen) >= size or counts[tid] == 0:
            break
        if tid not in seen:
            chosen.append(tid)
            seen.add(tid)
    tid = 0
    while len(chosen) < size:
        if tid not in seen:
            chosen.append(tid)
            seen.add(tid)
        tid += 1
    ids = torch.tensor(sorted(chosen[:size]), dtype=torch.int64)
    coverage = float(counts[ids].sum()) / total if total else None
    return DraftVocab(ids, vocab_size, coverage, total)


def save_draft_vocab(path: str | os.PathLike, vocab: DraftVocab) -> Path:
    """Write d2t / t2d (+ NeMo's selected_token_ids / target_vocab_size) atomically."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        "d2t": vocab.d2t(),
        "t2d": vocab.t2d(),
        "selected_token_ids": vocab.ids.clone(),
    }
    if p.suffix == ".safetensors":

        tensors["target_vocab_size"] = torch.tensor([vocab.target_vocab_size], dtype=torch.int64)
        write_safetensors(p, tensors)
    else:
        buf = io.BytesIO()
        torch.save({**tensors, "target_vocab_size": int(vocab.target_vocab_size)}, buf)
        atomic_write_bytes(p, buf.getvalue())
    return p


def _ids_from_mapping(data: dict, path: Path, vocab_size: int | None) -> torch.Tensor:
    if "d2t" in data:
        d2t = torch.as_tensor(data["d2t"]).to(torch.int64).reshape(-1)
        ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
    elif "selected_token_ids" in data:
        ids = torch.as_tensor(data["selected_token_ids"]).to(torch.int64).reshape(-1)
    elif "t2d" in data:
        ids = torch.nonzero(torch.as_tensor(data["t2d"]).reshape(-1).bool()).reshape(-1)
    else:
        raise UserError(
            f"{path} holds no draft vocabulary (keys: {', '.join(sorted(map(str, data))) or 'none'})",
            "pass a file written by `eagle-fast vocab`, SpecForge (d2t/t2d) or NeMo AutoModel "
            "(selected_token_ids)",
        )
    ids = torch.sort(ids).values
    if ids.numel() == 0:
        raise UserError(f"{path}: the draft vocabulary is empty", "rebuild it with `eagle-fast vocab`")
    if ids.numel() > 1 and bool((ids[1:] == ids[:-1]).any()):
        raise UserError(f"{path}: the draft vocabulary repeats token ids", "rebuild it with `eagle-fast vocab`")
    if int(ids[0]) < 0 or (vocab_size is not None and int(ids[-1]) >= vocab_size):
        raise UserError(
            f"{path}: draft token ids span [{int(ids[0])}, {int(ids[-1])}], outside the target "
            f"vocabulary [0, {vocab_size})",
            "build the draft vocabulary for this model with `eagle-fast vocab --model ...`",
        )
    if "t2d" in data and vocab_size is not None:
        t2d = torch.as_tensor(data["t2d"]).reshape(-1).bool()
        if t2d.numel() != vocab_size:
            raise UserError(
                f"{path}: t2d has {t2d.numel()} entries but the target vocabulary has {vocab_size}",
                "build the draft vocabulary for this model with `eagle-fast vocab --model ...`",
            )
        if not torch.equal(torch.nonzero(t2d).reshape(-1), ids):
            raise UserError(f"{path}: d2t and t2d disagree", "rebuild it with `eagle-fast vocab`")
    tv = data.get("target_vocab_size")
    if tv is not None and vocab_size is not None:
        tv = int(torch.as_tensor(tv).reshape(-1)[0])
        if tv != vocab_size:
            raise UserError(
                f"{path} was built for a {tv}-token vocabulary; this model has {vocab_size}",
                "build the draft vocabulary for this model with `eagle-fast vocab --model ...`",
            )
    return ids


def load_draft_vocab(path: str | os.PathLike, vocab_size: int | None = None) -> DraftVocab:
    """Read a draft vocabulary file (see module doc) and validate it against `vocab_size`."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"draft vocabulary file {p} not found", "create it with `eagle-fast vocab ... --out FILE`")
    try:
        if p.suffix == ".safetensors":

            data = dict(load_file(str(p)))
        else:
            data = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - an unreadable or foreign file is the user's to replace
        raise UserError(
            f"cannot read draft vocabulary {p} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})",
            "pass a .pt or .safetensors file written by `eagle-fast vocab`",
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{p} does not hold a dict of tensors", "pass a file written by `eagle-fast vocab`")
    ids = _ids_from_mapping(data, p, vocab_size)
    return DraftVocab(ids, vocab_size if vocab_size is not None else int(ids[-1]) + 1)


def build_vocab(model: str, data: str, size: int, out: str, *, max_len: int | None = None,
                overlong: str = "truncate", chat: ChatFormat | None = None, log=print) -> DraftVocab:
    """`eagle-fast vocab`: tokenise `data` the way `extract` does, count, select, save."""

    info = load_model_info(model)
    tok = LazyTokenizer(model)
    plan = plan_inputs(data, tok, info.vocab_size, max_len=resolve_max_len(max_len, info.max_positions),
                       overlong=overlong, chat=chat)
    counts = count_tokens(((s.input_ids, s.loss_mask) for s in plan.samples), info.vocab_size)
    specials = [t for ids in special_token_ids(info.config_token_ids, tok).values() for t in ids]
    vocab = select_draft_vocab(counts, size, specials)
    save_draft_vocab(out, vocab)
    cov = "n/a" if vocab.coverage is None else f"{100 * vocab.coverage:.2f}%"
    log(
        f"draft vocabulary: {vocab.size} of {info.vocab_size} target tokens; covers {cov} of "
        f"{vocab.counted_tokens:,} supervised tokens in {len(plan.samples)} samples -> {out}"
    )
    return vocab
