"""What the pipeline needs to know about a target checkpoint, without loading its weights.

`load_model_info` reads config.json (architectures, sizes, positions, special token ids) and
pins the checkpoint by content hashes (`model_identity`: config, safetensors headers, tokenizer
files), which resume and merge compare. `resolve_dtype_name` turns `--dtype auto` into the
checkpoint's dtype.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_fast.dtypes import parse_dtype, short_name
from eagle_fast.errors import UserError
from eagle_fast.files import read_json, read_safetensors_header
from eagle_fast.inputs import TOKENIZER_FILES, LazyTokenizer

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
    config: dict = field(default_factory=dict, repr=False)  # config.json as read, for the engine checks


def text_config_dict(cfg: dict) -> dict:
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


def load_model_info(model: str, require_weights: bool = True) -> ModelInfo:
    """The checkpoint's facts from config.json (and its identity hashes); `require_weights=False`
    for a plan made before the weights are downloaded (`extract --dry-run`)."""
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
    cfg = read_json(cfg_path, "fix the checkpoint's config.json (it must be the model's Hugging Face config)")
    text = text_config_dict(cfg)
    try:
        layers, hidden, vocab = (int(_config_value(root, text, key)) for key in ("num_hidden_layers", "hidden_size",
                                                                                 "vocab_size"))
    except (KeyError, TypeError, ValueError):
        raise UserError(
            f"{cfg_path} lacks num_hidden_layers / hidden_size / vocab_size",
            "pass a decoder-only language-model checkpoint",
        ) from None
    if require_weights and not any(root.glob("*.safetensors")):
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
        config=cfg,
    )


def _config_value(root: Path, text: dict, key: str):
    """`text[key]`, else what the family's transformers config computes for it (Nemotron-H's config.json
    has no num_hidden_layers: its config class counts `layers_block_type`)."""
    if key in text:
        return text[key]
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(root))
    except (OSError, ValueError, KeyError):
        raise KeyError(key) from None
    get = getattr(config, "get_text_config", None)
    value = getattr(get(decoder=True) if callable(get) else config, key, None)
    if value is None:
        raise KeyError(key)
    return value


def _config_ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


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


def resolve_dtype_name(model: str, dtype: str) -> str:
    """`auto` -> the checkpoint's dtype from config.json (bf16 when it says nothing usable)."""
    if dtype != "auto":
        return dtype
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "bf16"  # load_model_info reports the real problem
    text = text_config_dict(cfg)
    name = str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "")
    try:
        return short_name(parse_dtype(name))
    except ValueError:
        return "bf16"


INDEX_NAME = "model.safetensors.index.json"


def weight_files(model_path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (headers only, no data)."""
    index = model_path / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_path / fname for name, fname in weight_map.items()}
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"TargetHead: no {INDEX_NAME} and no *.safetensors in {model_path}")
    return {name: f for f in files for name in read_safetensors_header(f)[0] if name != "__metadata__"}


def indexed_view(model_path: str | Path, out: str | Path) -> Path:
    """`out`: symlinks to the checkpoint's files plus a `model.safetensors.index.json` mapping
    every tensor to its file (`weight_files`), for loaders that read a checkpoint only through
    its index (SpecForge's `TargetHead`; a single-file checkpoint ships none). Returns `out`."""
    model_path, out = Path(model_path), Path(out)
    weight_map = {name: f.name for name, f in weight_files(model_path).items()}
    out.mkdir(parents=True, exist_ok=True)
    for p in model_path.iterdir():
        if not p.name.startswith(".") and not (out / p.name).exists():
            (out / p.name).symlink_to(p.resolve())
    index = out / INDEX_NAME
    if not index.exists():  # a linked index already maps every tensor
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out
