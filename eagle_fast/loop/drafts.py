"""Does an EAGLE-3 draft fit its target? Checked from config.json and the safetensors headers
(plus the small `d2t` tensor) before any engine starts, as vLLM 0.32 would build the draft.

Layouts: the EAGLE-3 HF layout (`LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM` /
`Eagle3Qwen3ForCausalLM`; `midlayer.*` or `layers.0.*`, `fc`, `d2t`, `t2d`) and speculators'
(`speculators_model_type: eagle3`; the layer config under `transformer_layer_config`, of
model_type llama or qwen3). Both are first turned into the config vLLM builds the draft from
(`vllm_draft_config`), then checked against the target:
- the target hidden size the draft expects (`target_hidden_size`, else `hidden_size`);
- `fc`: [draft hidden, n_aux x target hidden], n_aux as vLLM counts it from the config;
- the aux taps (`eagle_aux_hidden_state_layer_ids`, else vLLM's default (2, L//2, L-3)) in vLLM's
  ids (0: the embeddings, i + 1: the output of decoder layer i), distinct, in [0, L], one per
  `fc` slice;
- `vocab_size` equal to the target's; `lm_head` [draft vocab, hidden] (absent: the target's head,
  so the full vocabulary); `embed_tokens` (absent: the target's, so the target's width); with a
  smaller draft vocabulary, `d2t` present and every i + d2t[i] a target id;
- no more decoder layers in the config than the weights hold (vLLM would run the rest unloaded).
Limits: weights in .bin files are not looked into (their shapes go unchecked).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from eagle_fast.checkpoint import ModelInfo, load_model_info, weight_files
from eagle_fast.errors import UserError
from eagle_fast.files import read_json, read_safetensors_header

LLAMA_HEADS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
QWEN3_HEADS = ("Eagle3Qwen3ForCausalLM",)
SPECULATORS_HEADS = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}
NEMO_TRAINING_ARCH = "LlamaEagle3DraftModel"
_ANY_DRAFT = "pass an EAGLE-3 draft: the HF layout (LlamaForCausalLMEagle3) or speculators' eagle3 layout"


@dataclass(frozen=True)
class DraftFit:
    """What was checked, for the report."""

    layout: str                  # "eagle3-hf" or "speculators"
    architecture: str            # the vLLM class it loads as
    hidden_size: int
    num_layers: int
    aux_layer_ids: list[int]     # vLLM's ids the target is tapped at
    aux_ids_from: str            # "config" or "vLLM's default"
    vocab_size: int
    draft_vocab_size: int
    weights_checked: bool
    extra: dict[str, Any] = field(default_factory=dict)  # per method: DFlash's mask token and causality, ...

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def vllm_draft_config(draft: str | Path) -> tuple[str, str, dict[str, Any]]:
    """(layout, vLLM architecture, the config vLLM builds the draft from) of a draft directory."""
    path = Path(draft) / "config.json"
    if not path.is_file():
        raise UserError(f"--draft {draft} has no config.json", _ANY_DRAFT)
    cfg = read_json(path, _ANY_DRAFT)
    kind = cfg.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise UserError(f"--draft {draft} is a speculators {kind!r} draft; accept measures EAGLE-3 drafts",
                            _ANY_DRAFT)
        layer = dict(cfg.get("transformer_layer_config") or {})
        head = SPECULATORS_HEADS.get(layer.get("model_type", "llama"))
        if head is None:
            raise UserError(f"--draft {draft}: transformer_layer_config has model_type {layer.get('model_type')!r}, "
                            f"vLLM builds EAGLE-3 layers of {' or '.join(SPECULATORS_HEADS)} only",
                            "train the draft with a llama or qwen3 layer")
        # vLLM's update_eagle3: these keys move from the top level into the layer config
        layer["draft_vocab_size"] = cfg.get("draft_vocab_size")
        for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            if cfg.get(key) is not None:
                layer[key] = cfg[key]
        return "speculators", head, layer
    arch = (cfg.get("architectures") or [None])[0]
    if arch in LLAMA_HEADS + QWEN3_HEADS:
        return "eagle3-hf", arch, cfg
    if arch == NEMO_TRAINING_ARCH:
        export = Path(draft) / "vllm_export"
        raise UserError(f"--draft {draft} is NeMo AutoModel's training checkpoint ({arch}), which vLLM does not load",
                        f"pass --draft {export}" if (export / "config.json").is_file() else
                        "export it with NeMo's serve_vllm.resolve_draft_artifacts and pass its vllm_export/ directory")
    raise UserError(f"--draft {draft} is not an EAGLE-3 draft (architectures {cfg.get('architectures')})", _ANY_DRAFT)


def weight_shapes(draft: str | Path) -> dict[str, tuple[Path, list[int]]] | None:
    """name -> (its safetensors file, its shape), from the headers; None without safetensors."""
    try:
        files = weight_files(Path(draft))
        headers = {f: read_safetensors_header(f)[0] for f in set(files.values())}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"--draft {draft}: its weights are unreadable ({type(exc).__name__}: {exc})",
                        "re-save the draft") from None
    return {name: (f, list(headers[f][name]["shape"])) for name, f in files.items()}


def num_aux(arch: str, cfg: dict[str, Any]) -> int:
    """How many aux states vLLM sizes `fc` for (llama_eagle3.py / qwen3_eagle3.py, vLLM 0.32)."""
    eagle = cfg.get("eagle_config") or {}
    if arch in QWEN3_HEADS:
        n = cfg.get("num_aux_layers") or cfg.get("num_aux_hidden_states")
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    else:
        n = cfg.get("num_aux_hidden_states")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return int(n) if n else (len(ids) if ids else 3)


def aux_layer_ids(cfg: dict[str, Any], target_layers: int) -> tuple[list[int], str]:
    """The target layers vLLM taps (its ids) and where they come from (gpu_model_runner.py)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(i) for i in ids], "config"
    return [2, target_layers // 2, target_layers - 3], "vLLM's default"


def check_draft(draft: str | Path, model: str | Path) -> DraftFit:
    """Refuse (UserError) a draft vLLM could not run on this target, naming the mismatch."""
    target = load_model_info(str(model))
    layout, arch, cfg = vllm_draft_config(draft)
    where = f"--draft {draft}"
    for_target = f"train or export a draft for {model}"
    try:
        hidden = int(cfg["hidden_size"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: its config has no hidden_size and vocab_size", _ANY_DRAFT) from None
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    if target_hidden != target.hidden_size:
        key = "target_hidden_size" if cfg.get("target_hidden_size") else "hidden_size"
        raise UserError(f"{where} is built for a target of hidden size {target_hidden} (its {key}), but "
                        f"{model} has hidden size {target.hidden_size}", for_target)
    if vocab != target.vocab_size:
        raise UserError(f"{where} has vocab_size {vocab}, but {model} has {target.vocab_size} (vLLM scatters the "
                        "draft's logits into the target's vocabulary)", for_target)
    if draft_vocab > target.vocab_size:
        raise UserError(f"{where}: draft_vocab_size {draft_vocab} exceeds the target's vocabulary "
                        f"({target.vocab_size})", for_target)
    n_aux = num_aux(arch, cfg)
    ids, ids_from = aux_layer_ids(cfg, target.num_hidden_layers)
    bad = [i for i in ids if not 0 <= i <= target.num_hidden_layers]
    if bad:
        raise UserError(f"{where}: aux layer id{'s' if len(bad) > 1 else ''} {bad} ({ids_from}: {ids}) out of range: "
                        f"{model} has {target.num_hidden_layers} layers, so vLLM's ids run from 0 (the embeddings) to "
                        f"{target.num_hidden_layers} (the last layer's output)",
                        "set eagle_aux_hidden_state_layer_ids in the draft's config.json to the layers it was "
                        "trained on (vLLM's ids: i + 1 for the output of decoder layer i)")
    if len(set(ids)) != n_aux:
        raise UserError(f"{where}: vLLM taps {len(set(ids))} distinct target layers ({ids_from}: {ids}) but sizes "
                        f"fc for {n_aux} aux states",
                        "set eagle_aux_hidden_state_layer_ids (and num_aux_hidden_states) in the draft's config.json "
                        "to the layers it was trained on")
    shapes = weight_shapes(draft)
    if shapes is None:
        if not list(Path(draft).glob("*.bin")):
            raise UserError(f"{where} holds no weights (*.safetensors or *.bin)", _ANY_DRAFT)
        return DraftFit(layout, arch, hidden, int(cfg.get("num_hidden_layers", 1)), ids, ids_from, vocab,
                        draft_vocab, weights_checked=False)
    layers = check_weights(where, shapes, cfg, hidden, n_aux, target, draft_vocab)
    return DraftFit(layout, arch, hidden, layers, ids, ids_from, vocab, draft_vocab, weights_checked=True)


def check_weights(where: str, shapes: dict[str, tuple[Path, list[int]]], cfg: dict[str, Any], hidden: int, n_aux: int,
                  target: ModelInfo, draft_vocab: int) -> int:
    """The shape checks of `check_draft`; returns the number of decoder layers the weights hold."""
    def shape(name: str) -> list[int] | None:
        return shapes[name][1] if name in shapes else None

    fc = shape("fc.weight")
    if fc is None:
        prefixed = "model.fc.weight" in shapes
        raise UserError(f"{where}: its weights have no fc.weight" + (" (its names carry a `model.` prefix)"
                                                                     if prefixed else ""),
                        "export the draft for vLLM (NeMo: serve_vllm.resolve_draft_artifacts; speculators: its "
                        "save_pretrained)")
    fc_in = n_aux * target.hidden_size
    if fc != [hidden, fc_in]:
        raise UserError(f"{where}: fc.weight is {fc}, but vLLM builds it as [{hidden}, {fc_in}] ({n_aux} aux states "
                        f"x target hidden {target.hidden_size} in, the draft's hidden {hidden} out)",
                        "set hidden_size, num_aux_hidden_states and eagle_aux_hidden_state_layer_ids in the draft's "
                        "config.json to what its fc was trained with, or train a draft for this target")
    head = shape("lm_head.weight")
    if head is None and draft_vocab != target.vocab_size:
        raise UserError(f"{where} has no lm_head.weight, so it would use the target's head ({target.vocab_size} ids), "
                        f"but its draft_vocab_size is {draft_vocab}", "save the draft with its lm_head")
    check_head_and_embeddings(where, shapes, target, hidden, draft_vocab)
    layers = held_layers(shapes)
    configured = int(cfg.get("num_hidden_layers", 1))
    if configured > len(layers):
        raise UserError(f"{where}: its config says num_hidden_layers {configured}, but its weights hold "
                        f"{len(layers)} decoder layer{'s' if len(layers) != 1 else ''}; vLLM would run the others "
                        "with weights never loaded", f"set num_hidden_layers to {len(layers)} in the draft's config.json")
    return configured


def check_head_and_embeddings(where: str, shapes: dict[str, tuple[Path, list[int]]], target: ModelInfo, hidden: int,
                              draft_vocab: int) -> None:
    """What every vLLM draft (EAGLE-3, DFlash, DSpark) holds alike: an lm_head (when saved) of
    [draft_vocab, hidden], embed_tokens (when saved) of [target vocab, hidden] or else the target's
    width, and d2t for a compressed vocabulary."""
    head = shapes.get("lm_head.weight", (None, None))[1]
    if head is not None and list(head) != [draft_vocab, hidden]:
        raise UserError(f"{where}: lm_head.weight is {head}, the config says [{draft_vocab}, {hidden}] "
                        "(draft_vocab_size x hidden_size)", "fix draft_vocab_size in the draft's config.json")
    embed = shapes.get("embed_tokens.weight", (None, None))[1]
    if embed is not None and list(embed) != [target.vocab_size, hidden]:
        raise UserError(f"{where}: embed_tokens.weight is {embed}, expected [{target.vocab_size}, {hidden}]",
                        "save the draft with the target's embeddings, or without embed_tokens")
    if embed is None and hidden != target.hidden_size:
        raise UserError(f"{where} has no embed_tokens.weight, so it shares the target's embeddings (width "
                        f"{target.hidden_size}), but its hidden size is {hidden}", "save the draft with its embed_tokens")
    if draft_vocab != target.vocab_size:
        check_d2t(where, shapes, draft_vocab, target.vocab_size)


def held_layers(shapes: dict[str, tuple[Path, list[int]]]) -> set[int]:
    """The decoder layers a draft's weights hold (`midlayer.` is speculators' one-layer EAGLE-3 name)."""
    layers = {0} if any(n.startswith("midlayer.") for n in shapes) else set()
    return layers | {int(n.split(".")[1]) for n in shapes if n.startswith("layers.") and n.split(".")[1].isdigit()}


def check_d2t(where: str, shapes: dict[str, tuple[Path, list[int]]], draft_vocab: int, target_vocab: int) -> None:
    """A compressed vocabulary needs d2t (offsets: draft id i is target id i + d2t[i]) into the target's."""
    if "d2t" not in shapes:
        raise UserError(f"{where}: draft_vocab_size {draft_vocab} is smaller than the target's {target_vocab}, but "
                        "its weights have no d2t (vLLM would read draft id i as target id i)",
                        "save the draft with its d2t mapping")
    path, shape = shapes["d2t"]
    if shape != [draft_vocab]:
        raise UserError(f"{where}: d2t has shape {shape}, the config's draft_vocab_size is {draft_vocab}",
                        "fix draft_vocab_size in the draft's config.json")
    with safe_open(str(path), framework="np") as f:
        offsets = f.get_tensor("d2t")
    if offsets.dtype.kind not in "iu":
        raise UserError(f"{where}: d2t is {offsets.dtype}, not integer offsets", "save d2t as int64")
    ids = np.arange(draft_vocab, dtype=np.int64) + offsets.astype(np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= target_vocab))
    if bad.size:
        i = int(bad[0])
        raise UserError(f"{where}: d2t maps draft id {i} to target id {int(ids[i])} ({bad.size} draft ids fall "
                        f"outside the target's vocabulary of {target_vocab})",
                        "pass the draft trained for this target's tokenizer")

