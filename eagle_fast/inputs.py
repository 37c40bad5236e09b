"""Inputs: the rows of `--data` in, planned token sequences out (stage 1 of the data flow).

- Read and validate every drawn row (`records`); the first bad row stops the run with its
  file:row and the reason, before anything is written.
- Tokenise with the model's tokenizer, loaded only when a line needs it (input_ids lines do
  not). Chat messages go through the model's chat template (or `--chat-template`, with
  `--chat-template-kwargs`: a `chat.ChatFormat`); the loss mask covers the assistant's tokens
  as the full rendering shows them (`chat.encode_chat`). Samples longer than `max_len`
  (`resolve_max_len`) are truncated or skipped, and counted.
- Plan: kept samples, in file order, form the global sample index; shard g holds samples
  [g*S, (g+1)*S), so any split of nodes produces the same shards as one run. Within a shard,
  samples are sorted by length and packed into batches under a token budget, so batch
  composition (and every floating-point result) depends only on the shard's content.
Limits: every drawn row is tokenised up front (every node does it, so all agree on the sample
index). The rows are streamed (`mixing.Draw`; a .json array is parsed whole) and the plan
holds about 5 bytes a token (`SamplePlan`; tests/test_mixing.py measures it), so a
billion-token dataset plans in about 5 GB of memory: in memory, not on disk.
"""

from __future__ import annotations

import math
import os
from array import array
from dataclasses import dataclass
from pathlib import Path

from eagle_fast.chat import ChatFormat, ChatMaskError, encode_chat
from eagle_fast.errors import UserError, bad_line
from eagle_fast.mixing import DataSpec, draw
from eagle_fast.records import Record, at, record_of

# ------------------------------------------------------------------------------ tokenizers


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # noqa: BLE001 - any loader failure means "not a usable tokenizer here"
        raise UserError(
            f"cannot load a tokenizer from {model} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})",
            "pass --model a Hugging Face checkpoint directory that includes its tokenizer files",
        ) from None


# Files a checkpoint's tokenizer may consist of (model_identity hashes them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


class LazyTokenizer:
    """The checkpoint's tokenizer, loaded on first use: input_ids lines need none."""

    def __init__(self, model: str):
        self.model = model
        self._tok = None

    @property
    def shipped(self) -> bool:
        """Whether the checkpoint has tokenizer files at all."""
        return any((Path(self.model) / name).is_file() for name in TOKENIZER_FILES)

    def get(self, where: str | None = None):
        """The tokenizer; a failure names `where` ("file:line", the line that needs it) if given."""
        if self._tok is None:
            try:
                self._tok = load_tokenizer(self.model)
            except UserError as exc:
                if where is None:
                    raise
                raise UserError(
                    f"{where}: this line needs the model's tokenizer, and there is none: {exc.cause}",
                    f"add the tokenizer files (tokenizer.json, tokenizer_config.json) to {self.model}, "
                    "or give pre-tokenized input_ids lines",
                ) from None
        return self._tok


def tokenize_record(rec: Record, tok, path: str, chat: ChatFormat | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one record; `tok` is a tokenizer or a LazyTokenizer."""
    if rec.kind == "input_ids":
        ids = list(rec.value)
        return ids, list(rec.loss_mask) if rec.loss_mask is not None else [1] * len(ids)
    if isinstance(tok, LazyTokenizer):
        tok = tok.get("{}:{}".format(*at(rec, path)))
    if rec.kind == "text":
        ids = list(tok(rec.value)["input_ids"])
        return ids, [1] * len(ids)
    chat = chat or ChatFormat()
    if not chat.template_for(tok):
        raise UserError(
            "{}:{}: ".format(*at(rec, path)) + "chat messages need a chat template, and this tokenizer has none",
            "add a chat_template to the model's tokenizer_config.json, pass --chat-template FILE, "
            "or give text/input_ids lines",
        )
    try:
        return encode_chat(tok, rec.value, chat, rec.tools)
    except ChatMaskError as exc:
        raise bad_line(*at(rec, path), f"cannot mask this chat: {exc}",
                       exc.fix or "fix or drop the line, or pass a --chat-template that renders each assistant "
                       "turn once, in order") from None
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error is a problem with this line's data
        raise bad_line(*at(rec, path), f"the chat template failed ({type(exc).__name__}: "
                   f"{str(exc).splitlines()[0][:160]})", "check the message roles and order") from None


class SamplePlan:
    """One input sample after tokenisation. `index` is its global position in the dataset. Held
    compact (int32 ids, uint8 mask: 5 bytes a token, not a Python list's ~40), so the plan of a
    large dataset fits; `input_ids` / `loss_mask` are lists made on each access."""

    __slots__ = ("_ids", "_mask", "index", "line", "source", "source_line")

    def __init__(self, index: int, line: int, input_ids, loss_mask, source_line: int | None = None,
                 source: int = 0):
        self.index, self.line, self.source_line, self.source = index, line, source_line, source
        self._ids = array("i", input_ids)
        self._mask = array("B", loss_mask)

    @property
    def input_ids(self) -> list[int]:
        return self._ids.tolist()

    @property
    def loss_mask(self) -> list[int]:
        return self._mask.tolist()

    @property
    def length(self) -> int:
        return len(self._ids)

    def __eq__(self, other) -> bool:
        return isinstance(other, SamplePlan) and all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    def __repr__(self) -> str:
        return (f"SamplePlan(index={self.index}, line={self.line}, length={self.length}, "
                f"source_line={self.source_line}, source={self.source})")

    def __reduce__(self):  # pickles (Ray) as the compact arrays
        return (SamplePlan, (self.index, self.line, self._ids, self._mask, self.source_line, self.source))


@dataclass
class ShardPlan:
    index: int
    samples: list[SamplePlan]

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)


@dataclass
class InputPlan:
    samples: list[SamplePlan]
    num_lines: int
    data_sha256: str
    truncated: int = 0
    skipped: int = 0
    no_loss: int = 0
    chats: int = 0  # lines rendered through the chat template (their masks follow `chat.MASK_RULE`)
    tokens_read: int = 0  # every line's tokens before --max-len (skipped lines included)
    sources: list[dict] | None = None  # per --data: rows, available, wanted, drawn, skipped, taken (`mixing`)

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)


def plan_inputs(path: str | os.PathLike | DataSpec, tok, vocab_size: int, *, max_len: int, overlong: str,
                chat: ChatFormat | None = None) -> InputPlan:
    """Read, validate and tokenise the whole file; apply the over-long policy. `chat`: how chat
    lines render and mask (default: the tokenizer's template, no extra kwargs)."""
    if max_len < 2:
        raise UserError(f"--max-len must be at least 2, got {max_len}", "pass e.g. --max-len 2048")
    if overlong not in ("truncate", "skip"):
        raise UserError(f"--overlong must be truncate or skip, got {overlong!r}", "pick one of the two")
    spec = DataSpec.of(path)
    drawn = draw(spec)
    plan = InputPlan([], drawn.rows_read, drawn.digest, sources=[{**c, "skipped": 0, "taken": 0} for c in drawn.counts])
    for rec in (record_of(item, spec.columns) for item in drawn):  # streamed: only the samples are held
        ids, mask = tokenize_record(rec, tok, str(spec), chat)
        plan.chats += rec.kind == "messages"
        if not ids:
            raise bad_line(*at(rec, str(spec)), "tokenises to zero tokens", "drop the line or give it content")
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise bad_line(*at(rec, str(spec)), f"token id {bad[0]} is outside the model's vocabulary "
                       f"[0, {vocab_size})", "tokenise with this model's tokenizer")
        plan.tokens_read += len(ids)
        if len(ids) > max_len:
            if overlong == "skip":
                plan.skipped += 1
                plan.sources[rec.source]["skipped"] += 1
                continue
            ids, mask = ids[:max_len], mask[:max_len]
            plan.truncated += 1
        if not any(mask):
            plan.no_loss += 1
        plan.samples.append(SamplePlan(len(plan.samples), rec.line, ids, mask, rec.source_line, rec.source))
        plan.sources[rec.source]["taken"] += 1
    if not plan.samples:
        raise UserError(
            f"no sample of {path} fits --max-len {max_len} (all {plan.skipped} skipped)",
            "raise --max-len or use --overlong truncate",
        )
    return plan


def plan_shards(samples: list[SamplePlan], shard_size: int) -> list[ShardPlan]:
    return [ShardPlan(g, samples[g * shard_size: (g + 1) * shard_size])
            for g in range(math.ceil(len(samples) / shard_size))]


def plan_batches(shard: ShardPlan, batch_tokens: int) -> list[list[int]]:
    """Local sample indices per batch: longest first, packed under `batch_tokens` tokens.

    A sample longer than the budget gets a batch of its own. Depends only on the shard.
    """
    order = sorted(range(len(shard.samples)), key=lambda i: (-shard.samples[i].length, i))
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = shard.samples[i].length
        if cur and used + n > batch_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


DEFAULT_MAX_LEN = 2048


def resolve_max_len(max_len: int | None, max_positions: int | None) -> int:
    """The longest sample to keep: `max_len` checked against the model, or the default.

    The default is min(DEFAULT_MAX_LEN, max_positions - 1): vLLM generates one token past the
    prompt, so default_runner_factory sizes its engine max_model_len = longest + 1, and that
    must fit the model. An explicit value may take every position (the hf engine runs it;
    `pipeline.plan.resolve` refuses a vLLM run whose longest sample does).
    """
    if max_len is None:
        return min(DEFAULT_MAX_LEN, int(max_positions) - 1) if max_positions else DEFAULT_MAX_LEN
    if max_positions and max_len > int(max_positions):
        raise UserError(f"--max-len {max_len} exceeds the model's max_position_embeddings {max_positions}",
                        f"pass --max-len {max_positions} or less, or leave it out (default "
                        f"{resolve_max_len(None, max_positions)} for this model)")
    return max_len
