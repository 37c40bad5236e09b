"""An extraction's settings, checked and resolved once into the plan every later stage runs.

`ExtractConfig` is `extract`'s settings as given (the CLI's arguments, the Python API's
dataclass). `resolve(cfg)` refuses a bad one with a UserError and returns the frozen
`config.ExtractPlan`: the target (`runners.factory.resolve_target`, shared with `serve`), the
layout, the draft vocabulary, the inputs read and tokenised, the shards, and the manifest a run
starts from (fresh, or an existing directory's complete shards, whose settings must be this
run's); for a run (not `--dry-run`) also the vLLM settings, `--head-in-worker` and the space on
`--out`. `extract(cfg)` is `resolve` then `run.run_plan`; `dry_run(cfg)` is `resolve` then
`disk.disk_plan`. Nothing after `resolve` checks a setting again.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eagle_fast import __version__
from eagle_fast.chat import ChatFormat
from eagle_fast.checkpoint import pad_token_id, special_token_ids
from eagle_fast.draft_types import (
    DEFAULT_DRAFT_LAYERS,
    DRAFT_TYPES,
    LAYER_CONVENTION,
    Record,
    capture_layers,
    describe_record,
    parse_aux_overrides,
    parse_names,
    reads_final_norm_id,
    record_layers,
    resolve_records,
    skipped_pairs,
    vllm_ids,
)
from eagle_fast.dtypes import SHORT_NAMES
from eagle_fast.errors import UserError
from eagle_fast.inputs import InputPlan, LazyTokenizer, ShardPlan, plan_inputs, plan_shards
from eagle_fast.mixing import DataSpec
from eagle_fast.pipeline.config import ExtractPlan, RunSettings, Summary
from eagle_fast.pipeline.disk import DiskPlan, check_space, disk_plan
from eagle_fast.pipeline.engine_setup import head_in_worker_settings
from eagle_fast.pipeline.run import run_plan
from eagle_fast.runners.engine_settings import VLLMSettings
from eagle_fast.runners.factory import (
    check_vllm_settings,
    choose_engine,
    resolve_checkpoint,
)
from eagle_fast.store import make_layout, spec_to_json
from eagle_fast.store.fp8 import check_aux_dtype
from eagle_fast.store.layouts import KINDS, LAYOUTS, Layout, LayoutSpec, validate_layout_kind
from eagle_fast.store.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    check_file_cheap,
    diff_settings,
    eagle_section,
    list_part_manifests,
    load_json,
    manifest_name,
    part_slice,
)
from eagle_fast.store.multi import MultiLayout
from eagle_fast.vocab import load_draft_vocab

logger = logging.getLogger(__name__)

# Formats whose trainer reads the draft vocabulary from the dataset directory, so --draft-vocab
# applies to them whatever they store (nemo: selected_token_ids; speculators: d2t/t2d .npy;
# specforge: its vocab mapping file).
TRAINER_VOCAB_LAYOUTS = ("nemo", "speculators", "specforge")


@dataclass
class ExtractConfig:
    """`eagle-fast extract`'s settings as given (see the CLI for each one's meaning)."""

    model: str
    data: str | DataSpec  # one file (as given), or the sources and their draw (`mixing`)
    out: str
    engine: str = "auto"
    aux_layers: str | list[str] | None = None  # "IDS" for every draft type, or "TYPE=IDS" items (repeated flag)
    draft_types: str | tuple[str, ...] = "eagle3"  # one or more of draft_types.DRAFT_TYPES
    draft_layers: int = DEFAULT_DRAFT_LAYERS  # the DFlash family's and DSpark's rules: the draft's layer count
    supervision: str | None = None
    k: int = 64
    keep_mass: float | None = None  # draft-topk: the fewest ids per token holding this mass, at most k
    draft_vocab: str | None = None
    max_len: int | None = None   # None: resolve_max_len's default for the model
    overlong: str = "truncate"
    batch_tokens: int = 16384
    dtype: str = "auto"       # bf16 | fp16 | fp32 | auto (the checkpoint's)
    out_dtype: str = "fp32"
    aux_dtype: str = "auto"   # stored hidden states: auto (the target dtype) | fp8 (store/fp8.py)
    shard: str | None = None
    shard_size: int = 256
    layout: str | tuple[str, ...] = "native"  # --format: one or more of native, nemo, speculators, specforge
    queue_batches: int = 2
    progress_tty: bool | None = None
    head_in_worker: bool = False  # vllm-cpu: the head runs in the engine's worker (engine_setup.py)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)  # engine settings (vllm engine only)
    chat: ChatFormat = field(default_factory=ChatFormat)  # how chat lines render and mask
    engine_check: bool = True  # vLLM: captures against the engine's own log-probs first (engine_setup.py)
    space_check: bool = True  # refuse up front when the pending bytes exceed --out's free space (disk.py)
    model_source: dict | None = None  # a Hub model's id, revision and commit (hub.ModelRef.describe)


def extract(cfg: ExtractConfig, runner_factory: Callable | None = None,
            on_shard: Callable[[int], None] | None = None, ray: Any = None) -> Summary:
    """Run (or resume) an extraction; returns the summary. Raises UserError for user mistakes.

    `runner_factory(engine, model, dtype, max_len)`: builds the runner (default: vLLM with
    `cfg.vllm`, or transformers); a custom one takes no `cfg.vllm`.
    `ray`: a `pipeline.distributed.RayOptions` to run the pending shards on Ray actors instead
    of in this process; the shards and the manifest (but for its `runs` statistics) come out the
    same either way, and either kind of run resumes the other's. `on_shard(index)` is called
    once each shard is computed (here) or committed (on Ray).
    """
    t_start = time.perf_counter()
    return run_plan(resolve(cfg, on_ray=ray is not None), runner_factory, on_shard, ray, t_start)


def dry_run(cfg: ExtractConfig) -> DiskPlan:
    """`extract --dry-run`: the plan of `cfg` (a resume: of what is still to write), from the
    model's config and tokenizer and the inputs; no engine, no weights, nothing written."""
    return disk_plan(resolve(cfg, dry_run=True))


def resolve(cfg: ExtractConfig, *, dry_run: bool = False, on_ray: bool = False) -> ExtractPlan:
    """Check every setting and resolve them against the model, the inputs and `--out`
    (`dry_run`: a plan only; the weights need not be there yet, and what only a run needs is
    not checked; `on_ray`: the pending shards go to Ray actors)."""
    formats, types = _check_settings(cfg)
    part = parse_shard(cfg.shard)
    overrides = parse_aux_overrides(cfg.aux_layers)
    found: list[tuple[Record, ...]] = []

    def capture(num_layers: int) -> tuple[int, ...]:  # the records need the model's layer count
        found.append(resolve_records(formats, types, num_layers, overrides, cfg.draft_layers))
        return capture_layers(found[-1])

    ckpt = resolve_checkpoint(cfg.model, dtype=cfg.dtype, aux_layers=capture, max_len=cfg.max_len,
                              require_weights=not dry_run)
    records, info = found[-1], ckpt.info
    for note in skipped_pairs(formats, types):
        logger.info(note)
    draft = load_draft_vocab(cfg.draft_vocab, info.vocab_size) if cfg.draft_vocab else None
    kinds = record_kinds(cfg.supervision, records, draft is not None)
    kind = kinds[0]
    head_formats = [r.fmt for r, k in zip(records, kinds) if k != "hidden"]
    if ("draft" in kinds or "draft-topk" in kinds) and draft is None and "native" in head_formats:
        raise UserError(f"--supervision {kind} needs a draft vocabulary",
                        "create one with `eagle-fast vocab --data FILE --model PATH --size 32000 --out "
                        "vocab.pt` and pass --draft-vocab vocab.pt")
    if "topk" in kinds and not 1 <= cfg.k <= (draft.size if (draft is not None and "nemo" in head_formats)
                                              else info.vocab_size):
        raise UserError(f"--k {cfg.k} is out of range for this vocabulary", "pass 1 <= k <= vocab size")
    if "draft-topk" in kinds and draft is not None and not 1 <= cfg.k <= draft.size:
        raise UserError(f"--k {cfg.k} is out of range for the draft vocabulary of {draft.size} ids "
                        f"({cfg.draft_vocab})", f"pass 1 <= k <= {draft.size}")
    if cfg.keep_mass is not None and "draft-topk" not in [k for r, k in zip(records, kinds) if r.fmt == "native"]:
        raise UserError(f"--keep-mass applies to --supervision draft-topk in the native format, not "
                        f"--supervision {kind} (--format {','.join(formats)})",
                        "add --supervision draft-topk --draft-vocab FILE, or drop --keep-mass")
    if draft is not None and not ({"draft", "draft-topk"} & set(kinds) or set(formats) & set(TRAINER_VOCAB_LAYOUTS)):
        raise UserError(f"--draft-vocab only applies to --supervision draft / draft-topk (or --format "
                        f"nemo, speculators, specforge), not {kind}",
                        "drop --draft-vocab, or use --supervision draft")
    target = choose_engine(ckpt, cfg.engine, cfg.vllm, cfg.engine_check, cfg.model_source)
    tok = LazyTokenizer(cfg.model)
    inputs = plan_inputs(cfg.data, tok, info.vocab_size, max_len=target.max_len, overlong=cfg.overlong,
                         chat=cfg.chat)
    data = DataSpec.of(cfg.data)
    longest = max(s.length for s in inputs.samples)
    if target.engine == "vllm" and info.max_positions and longest >= info.max_positions:
        raise UserError(f"a sample has {longest} tokens; vLLM needs one position beyond the longest prompt "
                        f"and this model has {info.max_positions}", f"pass --max-len {info.max_positions - 1}")
    shards = plan_shards(inputs.samples, cfg.shard_size)
    pad_id = pad_token_id(special_token_ids(info.config_token_ids, tok))
    common = {"hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
              "draft_size": draft.size if draft is not None else info.vocab_size, "dtype": target.dtype,
              "out_dtype": SHORT_NAMES[cfg.out_dtype], "max_len": target.max_len, "pad_token_id": int(pad_id),
              "aux_dtype": cfg.aux_dtype, "keep_mass": cfg.keep_mass or 0.0, "capture_ids": tuple(target.aux_layer_ids)}
    specs = [(r.subdir, LayoutSpec(layout=r.fmt, kind=k, k=cfg.k if k in ("topk", "draft-topk") else 0,
                                   num_aux=len(record_layers(r)), types=r.types, **common,
                                   num_layers=info.num_hidden_layers if reads_final_norm_id(r) else 0))
             for r, k in zip(records, kinds)]
    spec = specs[0][1] if len(specs) == 1 else replace(specs[0][1], layout="multi", parts=tuple(specs))
    layout = make_layout(spec)
    draft_ids = draft.ids if draft is not None else None
    settings = {
        "layout": ",".join(formats),
        "model": dict(info.identity),
        "data_sha256": inputs.data_sha256,
        "engine": target.engine,
        "dtype": target.dtype_name,
        "out_dtype": cfg.out_dtype if any(r.fmt == "native" and k != "hidden" for r, k in zip(records, kinds))
        else None,
        "aux_layer_ids": list(target.aux_layer_ids),
        "supervision": kind if len(records) == 1 else ",".join(kinds),
        "k": spec.k,
        "draft_vocab_sha256": hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest() if draft_ids is not None
        else None,
        "max_len": target.max_len,
        "overlong": cfg.overlong,
        "shard_size": cfg.shard_size,
    }
    if not plain_eagle3(records):  # absent for EAGLE-3 alone, so those manifests stay as they always were
        settings["records"] = [describe_record(r, info.num_hidden_layers) for r in records]
    if cfg.aux_dtype != "auto":  # absent for auto, so those manifests stay as they always were
        settings["aux_dtype"] = cfg.aux_dtype
    if cfg.keep_mass is not None:  # likewise absent for a fixed k
        settings["keep_mass"] = cfg.keep_mass
    if inputs.chats:  # how chat masks were made; absent without chat lines (nothing was masked)
        settings["masks"] = cfg.chat.describe(tok.get())
    quantization = cfg.vllm.merged().get("quantization") if target.engine == "vllm" else None
    if quantization:  # another target's outputs: never mixed on resume; absent when unquantized
        settings["quantization"] = quantization
    root = Path(cfg.out)
    manifest = _initial_manifest(target, data, inputs, shards, part, layout, settings, draft_ids, records)
    existing = _existing_manifest(root, part, settings, cfg.shard)
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
    pending = tuple(s for s in (shards[g] for g in part_slice(len(shards), part)) if s.index not in done)
    worker = None
    if not dry_run:  # what only a run needs: the engine's settings, the head's place, the space
        check_vllm_settings(target.vllm, target.requested, target.engine, longest, cfg.batch_tokens)
        if cfg.head_in_worker:
            if len(records) > 1:
                raise UserError(f"--head-in-worker cannot work here: this run writes {len(records)} records "
                                f"({', '.join(r.subdir for r in records)}), whose head fields differ",
                                "drop --head-in-worker, or extract one record at a time")
            worker = head_in_worker_settings(target.engine, layout, draft_ids, on_ray and bool(pending))
    plan = ExtractPlan(target=target, layout=layout, draft_ids=draft_ids, data=data, inputs=inputs,
                       shards=tuple(shards), part=part, pending=pending, root=root, manifest=manifest,
                       run=RunSettings(batch_tokens=cfg.batch_tokens, queue_batches=cfg.queue_batches,
                                       progress_tty=cfg.progress_tty, worker_supervision=worker))
    if not dry_run and cfg.space_check and pending:
        check_space(disk_plan(plan))  # the bytes still to write against --out's free space
    return plan


def _check_settings(cfg: ExtractConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The settings that need no model: their values alone (--dtype: `resolve_checkpoint`); returns
    the formats and the draft types asked for."""
    formats = parse_names(cfg.layout, LAYOUTS, "--format")
    types = parse_names(cfg.draft_types, DRAFT_TYPES, "--draft-type")
    for fmt in formats:
        check_aux_dtype(fmt, cfg.aux_dtype)
    if cfg.keep_mass is not None and not (math.isfinite(cfg.keep_mass) and 0 < cfg.keep_mass < 1):
        raise UserError(f"--keep-mass {cfg.keep_mass} is not a share of the draft mass strictly between 0 and 1",
                        "pass e.g. --keep-mass 0.99 (or leave it out to keep --k ids on every token)")
    if cfg.out_dtype not in SHORT_NAMES:
        raise UserError(f"--out-dtype {cfg.out_dtype!r} is not one of bf16, fp16, fp32", "pick one of them")
    if cfg.batch_tokens < 1:
        raise UserError(f"--batch-tokens must be positive, got {cfg.batch_tokens}", "pass e.g. --batch-tokens 16384")
    if cfg.shard_size < 1:
        raise UserError(f"--shard-size must be positive, got {cfg.shard_size}", "pass e.g. --shard-size 256")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory", "pass a new or existing directory")
    return formats, types


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


def record_kinds(supervision: str | None, records, have_draft: bool) -> list[str]:
    """Each record's --supervision kind. One record: as `resolve_kind` gives it (a kind its format
    cannot store is refused). Several: --supervision goes to the records whose format stores head
    fields (native, NeMo's EAGLE-3 cache); the others store hidden states as their trainers read them."""
    if len(records) == 1:
        r = records[0]
        kind = "hidden" if r.fmt == "nemo" and r.names == ("dspark",) and supervision is None else \
            resolve_kind(supervision, r.fmt, have_draft)
        validate_layout_kind(r.fmt, kind, r.names)
        return [kind]
    kinds = []
    for r in records:
        takes = r.fmt == "native" or (r.fmt == "nemo" and r.names == ("eagle3",))
        kind = resolve_kind(supervision if takes else None, r.fmt, have_draft)
        if r.fmt == "nemo" and r.names == ("dspark",):
            kind = "hidden"
        validate_layout_kind(r.fmt, kind, r.names)
        kinds.append(kind)
    if supervision is not None and supervision not in kinds:
        raise UserError(f"--supervision {supervision} applies to none of the records asked for "
                        f"({', '.join(r.subdir for r in records)})",
                        "drop --supervision, or add --format native")
    return kinds


def plain_eagle3(records) -> bool:
    """One record of EAGLE-3 alone: what every extraction before draft types wrote."""
    return len(records) == 1 and records[0].names == ("eagle3",)


def resolve_kind(supervision: str | None, layout: str, have_draft: bool) -> str:
    kind = supervision
    if kind is None:
        kind = {"nemo": "draft", "speculators": "hidden", "specforge": "hidden"}.get(layout) or ("draft" if have_draft else "topk")
    if kind not in KINDS:
        raise UserError(f"--supervision {kind!r} is not one of {', '.join(KINDS)}", "pick one of them")
    return kind


def _initial_manifest(target, data: DataSpec, inputs: InputPlan, shards: list[ShardPlan], part, layout: Layout,
                      settings: dict, draft_ids, records: tuple[Record, ...]) -> dict:
    spec, info = layout.spec, target.info
    out = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "layout": spec.layout,
        "settings": settings,
        "model": {
            "id": info.model_id,
            "architectures": info.architectures,
            "num_hidden_layers": info.num_hidden_layers,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
            **({"hub": target.source} if target.source else {}),
        },
        "data": _data_block(data, inputs),
        "aux_layer_ids": list(target.aux_layer_ids) if len(records) > 1 else list(record_layers(records[0])),
        "capture": {"layer_ids": list(target.aux_layer_ids), "vllm_layer_ids": vllm_ids(target.aux_layer_ids),
                    "final": "the last layer's output before the final norm (vLLM id "
                             f"{info.num_hidden_layers})", "convention": LAYER_CONVENTION},
        "draft_types": [describe_record(r, info.num_hidden_layers) for r in records],
        "supervision": {"kind": spec.kind, "k": spec.k, **({"keep_mass": spec.keep_mass} if spec.keep_mass else {}),
                        "draft_vocab_size": int(draft_ids.numel()) if draft_ids is not None else None,
                        "draft_vocab_file": "draft_vocab.safetensors" if draft_ids is not None else None},
        "layout_spec": spec_to_json(spec),
        "fields": layout.fields(),
        "dtypes": {name: f["dtype"] for name, f in layout.fields().items()},
        "num_samples": len(inputs.samples),
        "num_tokens": inputs.tokens,
        "num_shards": len(shards),
        "shard_size": settings["shard_size"],
        "shard_samples": [len(s.samples) for s in shards],
        "shard_tokens": [s.tokens for s in shards],
        "part": {"index": part[0], "count": part[1]} if part else None,
        "complete": False,
        "shards": [],
        "extra_files": [],
        "runs": [],
    }
    if isinstance(layout, MultiLayout):  # each record's own manifest is made from its entry (store/multi.py)
        out["parts"] = [_part_entry(r, d, part_layout, draft_ids, info.num_hidden_layers)
                        for r, (d, part_layout) in zip(records, layout.parts)]
    return out


def _part_entry(r: Record, subdir: str, layout: Layout, draft_ids, num_layers: int) -> dict:
    """What a record's own manifest holds that differs from --out's."""
    spec = layout.spec
    return {"dir": subdir, "layout": spec.layout, "layout_spec": spec_to_json(spec), "fields": layout.fields(),
            "dtypes": {name: f["dtype"] for name, f in layout.fields().items()},
            "aux_layer_ids": list(record_layers(r)),
            "draft_types": [describe_record(replace(r, subdir=""), num_layers)],
            "supervision": {"kind": spec.kind, "k": spec.k, **({"keep_mass": spec.keep_mass} if spec.keep_mass else {}),
                            "draft_vocab_size": int(draft_ids.numel()) if draft_ids is not None else None,
                            "draft_vocab_file": "draft_vocab.safetensors" if draft_ids is not None else None}}


def _data_block(spec: DataSpec, inputs: InputPlan) -> dict:
    """The manifest's `data`: the file read and its counts; for several sources (or a draw,
    or renamed columns), each source with its weight, cap and rows read, drawn, skipped, taken."""
    hub = spec.sources[0].hub if len(spec.sources) == 1 else None
    out = {"path": str(Path(spec.sources[0].path).resolve()) if len(spec.sources) == 1 else str(spec),
           "lines": inputs.num_lines, "truncated": inputs.truncated, "skipped": inputs.skipped,
           "no_loss": inputs.no_loss, **({"hub": hub} if hub else {})}
    if not spec.plain:
        out["sources"] = [{**s.describe(), **c} for s, c in zip(spec.sources, inputs.sources)]
        out.update(max_samples=spec.max_samples, seed=spec.seed, columns=dict(spec.columns))
    return out


def _existing_manifest(root: Path, part, settings: dict, shard: str | None) -> dict | None:
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
        if "masks" in settings and "masks" not in ours.get("settings", {}):
            raise UserError(
                f"{root} was made by an older eagle-fast, whose chat loss masks came from renderings of "
                "each conversation's prefixes: on templates that render a turn differently once later "
                "turns exist (Qwen3's think blocks, reasoning dropped from history) they mark the wrong "
                "tokens, and resuming would mix them with this version's masks",
                f"extract into a new --out directory (or delete {root}) to rebuild every shard with masks "
                "from the full rendering")
        # Settings absent from manifests at their default, shown by name in the diff.
        defaults = {"aux_dtype": "auto", "quantization": None, "keep_mass": None, "masks": None}
        diffs = diff_settings({**defaults, **ours.get("settings", {})}, {**defaults, **settings})
        if diffs:
            raise UserError(
                f"{root} already holds a dataset made with different settings ({'; '.join(diffs[:4])}"
                + (f"; +{len(diffs) - 4} more" if len(diffs) > 4 else "") + ")", fix)
        any_ours = True
        if q == path:
            found = ours
        elif q == merged and part is not None:
            raise UserError(f"{root} already holds a merged dataset (manifest.json); --shard {shard} "
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
