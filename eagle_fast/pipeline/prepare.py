"""Prepare (or resume) an extraction: plan, layout and manifest, before any engine starts.

`prepare(cfg)` reads the model info and the inputs, plans the shards, builds the layout spec,
and either starts a manifest or checks the existing one: shards it lists as complete (size and
header checked) are kept, the rest are pending; any difference in settings is refused, naming
the keys. The helpers here write the manifest (atomically) and the layout's extra files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from eagle_fast import __version__
from eagle_fast.checkpoint import (
    ModelInfo,
    load_model_info,
    pad_token_id,
    resolve_dtype_name,
    special_token_ids,
)
from eagle_fast.dtypes import SHORT_NAMES
from eagle_fast.errors import UserError
from eagle_fast.files import atomic_write_json, temp_path_for
from eagle_fast.inputs import (
    InputPlan,
    LazyTokenizer,
    ShardPlan,
    plan_inputs,
    plan_shards,
    resolve_max_len,
)
from eagle_fast.mixing import DataSpec
from eagle_fast.pipeline.config import ExtractConfig, check_config, parse_shard, resolve_kind
from eagle_fast.runners.factory import check_vllm_dtype, parse_aux_layers, resolve_engine
from eagle_fast.store import make_layout, spec_to_json
from eagle_fast.store.layouts import Layout, LayoutSpec, validate_layout_kind
from eagle_fast.store.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    check_file_cheap,
    diff_settings,
    eagle_section,
    file_record,
    list_part_manifests,
    load_json,
    manifest_name,
    part_slice,
)
from eagle_fast.store.nemo import nemo_manifest_fields, write_target_embeddings
from eagle_fast.store.safetensors import write_safetensors
from eagle_fast.store.specforge import VOCAB_MAPPING, write_vocab_mapping
from eagle_fast.store.speculators import (
    vocab_file_names,
    write_speculators_arrow,
    write_speculators_vocab,
)
from eagle_fast.vocab import DraftVocab, load_draft_vocab

# Formats whose trainer reads the draft vocabulary from the dataset directory, so --draft-vocab
# applies to them whatever they store (nemo: selected_token_ids; speculators: d2t/t2d .npy;
# specforge: its vocab mapping file).
TRAINER_VOCAB_LAYOUTS = ("nemo", "speculators", "specforge")


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


def prepare(cfg: ExtractConfig, require_weights: bool = True) -> Prepared:
    """Validate everything, plan shards, and reconcile with an existing --out directory
    (`require_weights=False`: a plan only, the weights need not be there yet)."""

    cfg = replace(cfg, dtype=resolve_dtype_name(cfg.model, cfg.dtype))
    check_config(cfg)
    part = parse_shard(cfg.shard)
    info = load_model_info(cfg.model, require_weights)
    aux = parse_aux_layers(cfg.aux_layers, info.num_hidden_layers)
    if cfg.layout in ("speculators", "specforge"):
        aux = sorted(aux)  # both trainers' files hold the aux layers in ascending layer order
    dtype = SHORT_NAMES[cfg.dtype]
    out_dtype = SHORT_NAMES[cfg.out_dtype]
    draft = load_draft_vocab(cfg.draft_vocab, info.vocab_size) if cfg.draft_vocab else None
    kind = resolve_kind(cfg, draft is not None)
    validate_layout_kind(cfg.layout, kind)
    if kind in ("draft", "draft-topk") and draft is None and cfg.layout == "native":
        raise UserError(f"--supervision {kind} needs a draft vocabulary",
                        "create one with `eagle-fast vocab --data FILE --model PATH --size 32000 --out "
                        "vocab.pt` and pass --draft-vocab vocab.pt")
    if kind == "topk" and not 1 <= cfg.k <= (draft.size if (draft is not None and cfg.layout == "nemo")
                                             else info.vocab_size):
        raise UserError(f"--k {cfg.k} is out of range for this vocabulary", "pass 1 <= k <= vocab size")
    if kind == "draft-topk" and draft is not None and not 1 <= cfg.k <= draft.size:
        raise UserError(f"--k {cfg.k} is out of range for the draft vocabulary of {draft.size} ids "
                        f"({cfg.draft_vocab})", f"pass 1 <= k <= {draft.size}")
    if cfg.keep_mass is not None and (kind != "draft-topk" or cfg.layout != "native"):
        raise UserError(f"--keep-mass applies to --supervision draft-topk in the native format, not "
                        f"--supervision {kind} (--format {cfg.layout})",
                        "add --supervision draft-topk --draft-vocab FILE, or drop --keep-mass")
    cfg = replace(cfg, max_len=resolve_max_len(cfg.max_len, info.max_positions))
    if draft is not None and not (kind in ("draft", "draft-topk") or cfg.layout in TRAINER_VOCAB_LAYOUTS):
        raise UserError(f"--draft-vocab only applies to --supervision draft / draft-topk (or --format "
                        f"nemo, speculators, specforge), not {kind}",
                        "drop --draft-vocab, or use --supervision draft")
    engine = resolve_engine(cfg.engine, info)
    if engine == "vllm":
        check_vllm_dtype(info, dtype)
    tok = LazyTokenizer(cfg.model)
    plan = plan_inputs(cfg.data, tok, info.vocab_size, max_len=cfg.max_len, overlong=cfg.overlong, chat=cfg.chat)
    longest = max(s.length for s in plan.samples)
    if engine == "vllm" and info.max_positions and longest >= info.max_positions:
        raise UserError(f"a sample has {longest} tokens; vLLM needs one position beyond the longest prompt "
                        f"and this model has {info.max_positions}", f"pass --max-len {info.max_positions - 1}")
    shards = plan_shards(plan.samples, cfg.shard_size)
    pad_id = pad_token_id(special_token_ids(info.config_token_ids, tok))
    spec = LayoutSpec(
        layout=cfg.layout, kind=kind, k=cfg.k if kind in ("topk", "draft-topk") else 0, hidden_size=info.hidden_size,
        num_aux=3, vocab_size=info.vocab_size,
        draft_size=draft.size if draft is not None else info.vocab_size,
        dtype=dtype, out_dtype=out_dtype, max_len=cfg.max_len, pad_token_id=int(pad_id),
        aux_dtype=cfg.aux_dtype, keep_mass=cfg.keep_mass or 0.0,
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
    if cfg.aux_dtype != "auto":  # absent for auto, so those manifests stay as they always were
        settings["aux_dtype"] = cfg.aux_dtype
    if cfg.keep_mass is not None:  # likewise absent for a fixed k
        settings["keep_mass"] = cfg.keep_mass
    if plan.chats:  # how chat masks were made; absent without chat lines (nothing was masked)
        settings["masks"] = cfg.chat.describe(tok.get())
    quantization = cfg.vllm.merged().get("quantization") if engine == "vllm" else None
    if quantization:  # another target's outputs: never mixed on resume; absent when unquantized
        settings["quantization"] = quantization
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
            **({"hub": cfg.model_source} if cfg.model_source else {}),
        },
        "data": _data_block(cfg, plan),
        "aux_layer_ids": aux,
        "supervision": {"kind": kind, "k": spec.k, **({"keep_mass": spec.keep_mass} if spec.keep_mass else {}),
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


def _data_block(cfg: ExtractConfig, plan) -> dict:
    """The manifest's `data`: the file read and its counts; for several sources (or a draw,
    or renamed columns), each source with its weight, cap and rows read, drawn, skipped, taken."""
    spec = DataSpec.of(cfg.data)
    hub = spec.sources[0].hub if len(spec.sources) == 1 else None
    out = {"path": str(Path(spec.sources[0].path).resolve()) if len(spec.sources) == 1 else str(spec),
           "lines": plan.num_lines, "truncated": plan.truncated, "skipped": plan.skipped, "no_loss": plan.no_loss,
           **({"hub": hub} if hub else {})}
    if not spec.plain:
        out["sources"] = [{**s.describe(), **c} for s, c in zip(spec.sources, plan.sources)]
        out.update(max_samples=spec.max_samples, seed=spec.seed, columns=dict(spec.columns))
    return out


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


def clean_temps(p: Prepared) -> None:
    """Remove this node's leftovers of a killed run (temp files of pending shards only)."""
    names = [manifest_name(p.part)]
    for s in p.pending:
        names += p.layout.shard_paths(s)
    tmps = [temp_path_for(p.root / rel) for rel in names]
    tmps += [temp_path_for(p.root / rel, _part_tag(p)) for rel in _extra_file_names(p)]
    for tmp in tmps:
        if tmp.exists():
            tmp.unlink()


def write_manifest(p: Prepared) -> None:
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


def _extra_file_names(p: Prepared) -> list[str]:
    """The sidecar files this directory gets (`write_extra_files`)."""
    names = ["draft_vocab.safetensors", "target_embeddings.safetensors"]
    if p.draft_ids is not None and p.layout.name == "speculators":
        names += list(vocab_file_names(int(p.draft_ids.numel())))
    if p.draft_ids is not None and p.layout.name == "specforge":
        names.append(VOCAB_MAPPING)
    return names


def write_extra_files(p: Prepared) -> None:
    """Sidecar files written once per directory: the draft vocabulary (ours, and in the trainer's
    own format for speculators and SpecForge), NeMo's embeddings."""

    have = {f["path"] for f in p.manifest.get("extra_files", [])
            if check_file_cheap(p.root, f) is None}
    extra = [f for f in p.manifest.get("extra_files", []) if f["path"] in have]
    tag = _part_tag(p)
    v = DraftVocab(p.draft_ids, p.info.vocab_size) if p.draft_ids is not None else None
    if v is not None and "draft_vocab.safetensors" not in have:
        path = write_safetensors(p.root / "draft_vocab.safetensors", {
            "d2t": v.d2t(), "t2d": v.t2d(), "selected_token_ids": v.ids.clone(),
            "target_vocab_size": torch.tensor([v.target_vocab_size], dtype=torch.int64)}, tag=tag)
        extra.append(file_record(path, p.root))
    if v is not None and p.layout.name == "speculators" and not set(vocab_file_names(v.size)) <= have:
        extra = [f for f in extra if f["path"] not in vocab_file_names(v.size)]
        extra += write_speculators_vocab(p.root, v.d2t(), v.t2d(), tag=tag)
    if v is not None and p.layout.name == "specforge" and VOCAB_MAPPING not in have:
        extra.append(write_vocab_mapping(p.root, v.d2t(), v.t2d(), tag=tag))
    if p.layout.name == "nemo" and "target_embeddings.safetensors" not in have:
        extra.append(write_target_embeddings(p.root, p.cfg.model, tag=tag))
    p.manifest["extra_files"] = sorted(extra, key=lambda f: f["path"])


def finalize(p: Prepared) -> None:
    """Layout extras once the whole dataset (not a part) is complete."""
    if p.layout.name == "speculators" and p.part is None and p.manifest["complete"]:
        write_speculators_arrow(p.root, [(s.input_ids, s.loss_mask) for s in p.plan.samples])
