"""Draft types and what each trainer reads for them: the layers, the final state, the teacher.

One capture (a set of decoder layers plus the final pre-norm state) feeds every draft type the
trainers in the lock train; this module says, per draft type and `--format`, which layers that
trainer's own default rule picks, whether it reads the final hidden state and before or after the
final norm, and who refuses what (with the reason, read from their code).

Layer ids, everywhere in eagle_fast: id i is the OUTPUT of 0-based decoder layer i, i.e. HF
`hidden_states[i + 1]` (SpecForge's, NeMo AutoModel's and ModelOpt's convention). vLLM's capture
ids and speculators' `--target-layer-ids` count one higher (`vllm_ids`): their id 0 is the
embeddings and id N (N decoder layers) the last layer's output before the final norm.

Rules, as their code has them (N decoder layers, K the draft's layer count, `--draft-layers`):
- EAGLE-3, P-EAGLE: [1, N//2 - 1, N - 4] (SpecForge, NeMo, ModelOpt; speculators' [2, N//2, N-3]
  in its ids: the same layers).
- DFlash, DFlash 2, Domino (SpecForge `build_target_layer_ids`, NeMo's DFlash, ModelOpt):
  round(1 + i (N - 4) / (K - 1)) for i < K, spread over 1..N-3; [N//2] for K = 1.
- DSpark: SpecForge the DFlash rule; NeMo AutoModel `dspark/registry.build_target_layer_ids`:
  round(1 + i (N - 2) / (K - 1)), deduplicated, in [1, N - 1], where id N - 1 is the final norm's
  output (post-norm), not the last layer's.
- speculators 0.9.0, every type: its `resolve_target_layer_ids` default, the EAGLE-3 layers; its
  reader takes every stored layer (`hs[:, :-1]`) and the final slot (`hs[:, -1]`), pre-norm; MTP
  reads the final slot alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle_fast.errors import UserError

DRAFT_TYPES = ("eagle3", "peagle", "dflash", "dflash2", "domino", "dspark", "mtp", "xpress")
FORMATS = ("native", "nemo", "speculators", "specforge")
DEFAULT_DRAFT_LAYERS = 5  # z-lab's DFlash drafts of Qwen3-8B read 5 target layers ([1, 9, 17, 25, 33])
FINAL_STATES = ("none", "pre", "post")
LAYER_CONVENTION = ("layer_ids: id i is the output of 0-based decoder layer i (HF hidden_states[i + 1]; SpecForge, "
                    "NeMo AutoModel); vllm_layer_ids: vLLM's capture ids and speculators' --target-layer-ids, i + 1")


@dataclass(frozen=True)
class Reader:
    """What one trainer reads for one draft type from one `--format`."""

    trainer: str        # who reads it
    reader: str         # its reader (class or function), as named in its code
    rule: str           # the layer rule: eagle3 | dflash | nemo-dspark | none
    final: str          # the final hidden state it reads: none | pre (before the norm) | post (after)


_SPECULATORS = "vLLM speculators 0.9.0"
_SPECFORGE = "SpecForge 0.2.0"
_NEMO = "NeMo AutoModel 0.7.0"
_NATIVE = "eagle_fast.DraftDataset"
_ARROW = "speculators.train.data.ArrowDataset"
_SF_EAGLE3 = "specforge.algorithms.eagle3.data.build_offline_reader"
_SF_DFLASH = "specforge.algorithms.common.dflash_family_data.build_offline_reader"
_SF_DSPARK = "specforge.algorithms.common.dflash_family_data.build_dspark_offline_reader"

# (format, draft type) -> what its trainer reads. The native reader is ours: it stores the fused
# head's draft-vocabulary output (the teacher at capture time) per --supervision, so no type
# needs the final state there but MTP, whose input it is.
READERS: dict[tuple[str, str], Reader] = {
    ("native", "eagle3"): Reader("eagle_fast", _NATIVE, "eagle3", "none"),
    ("native", "peagle"): Reader("eagle_fast", _NATIVE, "eagle3", "none"),
    ("native", "dflash"): Reader("eagle_fast", _NATIVE, "dflash", "none"),
    ("native", "dflash2"): Reader("eagle_fast", _NATIVE, "dflash", "none"),
    ("native", "domino"): Reader("eagle_fast", _NATIVE, "dflash", "none"),
    ("native", "dspark"): Reader("eagle_fast", _NATIVE, "dflash", "none"),
    ("native", "mtp"): Reader("eagle_fast", _NATIVE, "none", "pre"),
    ("native", "xpress"): Reader("eagle_fast", _NATIVE, "eagle3", "none"),
    ("nemo", "eagle3"): Reader(_NEMO, "nemo_automodel...eagle3_cache.CachedEagle3Dataset", "eagle3", "none"),
    ("nemo", "dspark"): Reader(_NEMO, "nemo_automodel...dspark_cache.CachedDSparkDataset", "nemo-dspark", "post"),
    ("specforge", "eagle3"): Reader(_SPECFORGE, _SF_EAGLE3, "eagle3", "post"),
    ("specforge", "dflash"): Reader(_SPECFORGE, _SF_DFLASH, "dflash", "none"),
    ("specforge", "domino"): Reader(_SPECFORGE, _SF_DFLASH, "dflash", "none"),
    ("specforge", "dspark"): Reader(_SPECFORGE, _SF_DSPARK, "dflash", "post"),
    **{("speculators", t): Reader(_SPECULATORS, _ARROW, "none" if t == "mtp" else "eagle3", "pre")
       for t in ("eagle3", "peagle", "dflash", "dflash2", "dspark", "mtp", "xpress")},
}

# (format, draft type) pairs no trainer reads from files, with the reason from its code.
REFUSED = {
    ("nemo", "peagle"): "NeMo AutoModel 0.7.0 trains P-EAGLE live and colocated only: its recipe rejects "
                        "an offline cache for it (recipes/llm/train_eagle3.py, _validate_peagle_gates)",
    ("specforge", "peagle"): "SpecForge 0.2.0 reads P-EAGLE only from its streaming path "
                             "(algorithms/peagle/providers.py); it has no file layout for it",
    ("speculators", "domino"): "vLLM speculators 0.9.0 has no Domino draft (speculators/models)",
    ("specforge", "dflash2"): "SpecForge 0.2.0 has no DFlash 2 draft (specforge/algorithms)",
    ("specforge", "mtp"): "SpecForge 0.2.0 has no MTP draft (specforge/algorithms)",
    ("specforge", "xpress"): "SpecForge 0.2.0 has no XPress draft (specforge/algorithms)",
    **{("nemo", t): f"NeMo AutoModel 0.7.0 trains {t} online only (components/speculative/dflash/target.py "
                    "runs the target every step); it has no offline cache for it"
       for t in ("dflash", "dflash2", "domino")},
    ("nemo", "mtp"): "NeMo AutoModel 0.7.0's MTP is a loss of full-model fine-tuning (components/loss/mtp.py), "
                     "not a draft trained from target states",
    ("nemo", "xpress"): "NeMo AutoModel 0.7.0 has no XPress draft",
}
# Where each type can go instead, for the refusals' fixes.
_ALTERNATIVES = {t: [f for f in FORMATS if (f, t) in READERS] for t in DRAFT_TYPES}


def reader_of(fmt: str, draft_type: str) -> Reader:
    """The reader of `draft_type` in `--format fmt`; a UserError naming why when none reads it."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}", "pick one of them")
    if draft_type not in DRAFT_TYPES:
        raise UserError(f"--draft-type {draft_type!r} is not one of {', '.join(DRAFT_TYPES)}", "pick one of them")
    if (fmt, draft_type) in READERS:
        return READERS[(fmt, draft_type)]
    others = [f for f in _ALTERNATIVES[draft_type] if f != fmt]
    raise UserError(f"--format {fmt} cannot hold --draft-type {draft_type}: {REFUSED[(fmt, draft_type)]}",
                    f"use --format {' or '.join(others)} for {draft_type}, or drop it from --draft-type")


def vllm_ids(layer_ids) -> list[int]:
    """eagle_fast layer ids (decoder-layer outputs) as vLLM capture / speculators ids (one higher)."""
    return [int(i) + 1 for i in layer_ids]


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high decoder layers (NeMo AutoModel's recipe when it fits)."""
    nemo = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(nemo)) == 3 and all(0 <= c < num_layers for c in nemo):
        return nemo
    if num_layers < 3:
        raise UserError(f"the model has {num_layers} decoder layers; EAGLE-3 needs 3 distinct aux layers",
                        "use a model with at least 3 layers")
    return [0, num_layers // 2, num_layers - 1]


def dflash_layers(num_layers: int, draft_layers: int) -> list[int]:
    """SpecForge's (and NeMo's, ModelOpt's) DFlash rule: K ids spread over 1..N-3 (Python's round)."""
    if draft_layers == 1:
        return [num_layers // 2]
    span = num_layers - 4
    return [round(1 + i * span / (draft_layers - 1)) for i in range(draft_layers)]


def nemo_dspark_layers(num_layers: int, draft_layers: int) -> list[int]:
    """NeMo AutoModel's DSpark rule: K ids spread over [1, N - 1], deduplicated (id N - 1: post-norm)."""
    last = num_layers - 1
    k = max(1, min(draft_layers, num_layers - 1))
    if k == 1:
        return [last]
    step = (last - 1) / (k - 1)
    return sorted({round(1 + i * step) for i in range(k)})


def default_layers(reader: Reader, num_layers: int, draft_layers: int) -> list[int]:
    """The layers `reader`'s trainer picks by default for a target of `num_layers` layers."""
    if reader.rule == "none":
        return []
    if reader.rule == "eagle3":
        return eagle3_layers(num_layers)
    ids = dflash_layers(num_layers, draft_layers) if reader.rule == "dflash" else \
        nemo_dspark_layers(num_layers, draft_layers)
    return ids


def check_layers(ids: list[int], num_layers: int, what: str) -> list[int]:
    """`ids` distinct and in [0, num_layers); a UserError naming `what` (the flag or rule) otherwise."""
    if len(set(ids)) != len(ids):
        raise UserError(f"{what} gives layer ids {ids} with repeats (a {num_layers}-layer model)",
                        "pass distinct ids with --aux-layers, or fewer --draft-layers")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise UserError(f"{what}: layer id {bad[0]} is out of range for a {num_layers}-layer model",
                        f"use decoder-layer ids in [0, {num_layers - 1}] (id i is the output of decoder layer i, "
                        "HF hidden_states[i + 1], vLLM / speculators id i + 1)")
    return ids


def parse_layer_list(text: str, flag: str = "--aux-layers") -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a comma-separated list of integers",
                        "pass e.g. --aux-layers 1,15,28 (or TYPE=1,9,17,25,33 for one draft type)") from None


def parse_aux_overrides(values) -> dict[str | None, list[int]]:
    """`--aux-layers` as given (None, one string, or the repeated flag's list) -> {draft type or None
    (every type): ids}. Each value is `IDS` or `TYPE=IDS`."""
    if values is None:
        return {}
    out: dict[str | None, list[int]] = {}
    for value in [values] if isinstance(values, str) else list(values):
        name, sep, ids = value.partition("=")
        key = name.strip() if sep else None
        if key is not None and key not in DRAFT_TYPES:
            raise UserError(f"--aux-layers {value!r}: {key!r} is not a draft type ({', '.join(DRAFT_TYPES)})",
                            "pass IDS, or TYPE=IDS for one draft type")
        if key in out:
            raise UserError(f"--aux-layers is given twice for {key or 'every draft type'}", "pass it once")
        out[key] = parse_layer_list(ids if sep else value)
        if not out[key]:
            raise UserError(f"--aux-layers {value!r} names no layer", "pass e.g. --aux-layers 1,15,28")
    return out


def parse_names(text, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """A comma-separated list of names (or a sequence of them), each in `allowed`, in order, without repeats."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if not items:
        raise UserError(f"{flag} names nothing", f"pass one or more of {', '.join(allowed)}")
    for t in items:
        if t not in allowed:
            raise UserError(f"{flag} {t!r} is not one of {', '.join(allowed)}", "pick from them")
    if len(set(items)) != len(items):
        raise UserError(f"{flag} repeats a name ({text})", "name each once")
    return tuple(items)


# ------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class TypeLayers:
    """One draft type as one record holds it: its layers (eagle_fast ids, in stored order) and the
    final state its reader takes."""

    draft_type: str
    layer_ids: tuple[int, ...]
    final: str  # none | pre | post


@dataclass(frozen=True)
class Record:
    """One dataset directory of one `--format`, serving one or more draft types (`subdir`: where it
    lies under --out; "" for --out itself, when it is the only one)."""

    fmt: str
    types: tuple[TypeLayers, ...]
    subdir: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.draft_type for t in self.types)

    def layers_of(self, draft_type: str) -> tuple[int, ...]:
        return next(t.layer_ids for t in self.types if t.draft_type == draft_type)


def type_layers(fmt: str, draft_type: str, num_layers: int, overrides: dict, draft_layers: int,
                keep_order: bool) -> TypeLayers:
    """`draft_type` in `--format fmt`: its layers (--aux-layers for it, else for every type, else its
    trainer's rule) and final state. Trainers' files hold layers ascending; the native format keeps
    the order given (`keep_order`) when it holds one type."""
    reader = reader_of(fmt, draft_type)
    if reader.rule == "none":  # MTP reads the final state alone
        return TypeLayers(draft_type, (), reader.final)
    given = overrides.get(draft_type, overrides.get(None))
    what = (f"--aux-layers {','.join(map(str, given))}" if given is not None else
            f"{reader.trainer}'s {draft_type} rule ({num_layers} layers, --draft-layers {draft_layers})")
    ids = check_layers(list(given) if given is not None else default_layers(reader, num_layers, draft_layers),
                       num_layers, what)
    if not (keep_order and fmt == "native"):
        ids = sorted(ids)
    return TypeLayers(draft_type, tuple(ids), reader.final)


def group_records(fmt: str, types: list[TypeLayers]) -> list[list[TypeLayers]]:
    """The records one format needs for `types`: the native format stores one record (the union of
    the layers) for all; speculators' reader takes every stored layer, so one record per layer set
    (MTP, which reads the final slot alone, joins any); SpecForge's reader loads named keys, so one
    record holds EAGLE-3's keys beside the DFlash family's, whose types share `hidden_states` only
    with the same layers; NeMo's caches hold one type each."""
    if fmt == "native":
        return [types]
    if fmt == "nemo":
        return [[t] for t in types]
    groups: list[list[TypeLayers]] = []
    loose = []
    for t in types:
        if (fmt == "speculators" and not t.layer_ids) or (fmt == "specforge" and t.draft_type == "eagle3"):
            loose.append(t)
            continue
        for g in groups:
            if g[0].layer_ids == t.layer_ids:
                g.append(t)
                break
        else:
            groups.append([t])
    if not groups:
        return [loose]
    groups[0][0:0] = loose
    return groups


def resolve_records(formats: tuple[str, ...], draft_types: tuple[str, ...], num_layers: int,
                    overrides: dict, draft_layers: int = DEFAULT_DRAFT_LAYERS) -> tuple[Record, ...]:
    """Every (format, draft type) asked for that a trainer reads, as the records that hold them (a pair
    none reads is left out, `skipped_pairs`; a format that holds none of the types, or a type that
    no format asked for holds, is refused with the reason). One record lies in --out itself,
    several each in a subdirectory named for its format (and its types, where one format needs
    several)."""
    if draft_layers < 1:
        raise UserError(f"--draft-layers must be positive, got {draft_layers}", "pass e.g. --draft-layers 5")
    unused = [k for k in overrides if k is not None and k not in draft_types]
    if unused:
        raise UserError(f"--aux-layers names {unused[0]}, which --draft-type does not ask for",
                        f"add {unused[0]} to --draft-type, or drop its --aux-layers")
    keep_order = len(draft_types) == 1
    for t in draft_types:  # every type needs a format that holds it
        if not any((fmt, t) in READERS for fmt in formats):
            reader_of(formats[0], t)  # refused, with the reason and the formats that hold it
    by_format = []
    for fmt in formats:
        held = [t for t in draft_types if (fmt, t) in READERS]
        if not held:
            reader_of(fmt, draft_types[0])  # refused likewise
        types = [type_layers(fmt, t, num_layers, overrides, draft_layers, keep_order) for t in held]
        by_format.append((fmt, group_records(fmt, types)))
    count = sum(len(groups) for _, groups in by_format)
    records = []
    for fmt, groups in by_format:
        for g in groups:
            subdir = "" if count == 1 else fmt if len(groups) == 1 else f"{fmt}-{'+'.join(t.draft_type for t in g)}"
            records.append(Record(fmt, tuple(g), subdir))
    return tuple(records)


def skipped_pairs(formats, draft_types) -> list[str]:
    """The (format, type) pairs `resolve_records` leaves out, each with the reason."""
    return [f"--format {f} holds no {t}: {REFUSED[(f, t)]}" for f in formats for t in draft_types
            if (f, t) not in READERS]


def capture_layers(records: tuple[Record, ...]) -> tuple[int, ...]:
    """The layers one prefill captures for `records`: a lone record's own (in its order), else the
    sorted union."""
    if len(records) == 1 and len(records[0].types) == 1:
        return records[0].types[0].layer_ids
    return tuple(sorted({i for r in records for t in r.types for i in t.layer_ids}))


def record_layers(r: Record) -> tuple[int, ...]:
    """The layers of a record's main hidden-state field (the manifest's `aux_layer_ids`): the native
    record's every type's (union, in capture order, sorted when it holds several types), speculators'
    one set, SpecForge's EAGLE-3 keys' (else the DFlash family's), a NeMo cache's type's."""
    if r.fmt == "native":
        if len(r.types) == 1:
            return r.types[0].layer_ids
        return tuple(sorted({i for t in r.types for i in t.layer_ids}))
    if r.fmt == "specforge" and "eagle3" in r.names:
        return r.layers_of("eagle3")
    return next((t.layer_ids for t in r.types if t.layer_ids), ())


def reads_final_norm_id(r: Record) -> bool:
    """The record's reader takes layer id N - 1 as the final norm's output (NeMo's DSpark cache), so
    its layout must know N."""
    return r.fmt == "nemo" and r.names == ("dspark",)


def describe_record(r: Record, num_layers: int) -> dict:
    """A record as the manifest names it: where, which format, and each type's layers in both
    conventions (eagle_fast's decoder-layer outputs; vLLM's capture ids and speculators' one higher),
    the final state it reads and its trainer's reader; NeMo's DSpark cache holds the final norm's
    output at id N - 1 (`post_norm_ids`)."""
    def one(t):
        out = {"draft_type": t.draft_type, "layer_ids": list(t.layer_ids), "vllm_layer_ids": vllm_ids(t.layer_ids),
               "final": t.final, "reader": reader_of(r.fmt, t.draft_type).reader}
        if reader_of(r.fmt, t.draft_type).rule == "nemo-dspark" and num_layers - 1 in t.layer_ids:
            out["post_norm_ids"] = [num_layers - 1]
        return out

    return {"dir": r.subdir, "format": r.fmt, "draft_types": [one(t) for t in r.types]}
