"""NeMo AutoModel 0.7's DSpark offline cache (its datasets/llm/dspark_cache.CachedDSparkDataset reads it).

shard-{g:06d}.safetensors with fixed `shard_size` samples (the last may hold fewer), exactly
NeMo's CACHE_KEYS, every field padded to `seq_length` (= --max-len), unshifted, as its
precompute_dspark writes them (its write_shard's header, as JSON, and tensor bytes):
input_ids int64 [n, S] (pad_token_id after the sample), loss_mask int64 [n, S] (0 after it),
target_hidden_states [n, S, K H] and target_last_hidden_states [n, S, H] in the target dtype
(zeros after it). No attention_mask: NeMo's cache stores none (each sample's length is in our
manifest's shard records). Plus target_weights.safetensors ({"embed_tokens.weight",
"lm_head.weight"} [V, H] in the target dtype, both even when tied) and NeMo's manifest.json
(format_version 1, `build_cache_manifest`'s fields, `complete`) with ours under "eagle_fast".

Layer ids are NeMo's, which are eagle_fast's (id i = decoder layer i's output, HF
`hidden_states[i + 1]`), but for one: id N - 1 (N decoder layers) is the final norm's OUTPUT
(post-norm), as NeMo's `HFDSparkTargetModel` captures it (dspark/target.py), not the last layer's
output before the norm that every other eagle_fast format stores for it. So that slot of
target_hidden_states is the run's `hidden_normed`, like target_last_hidden_states; every other id
is taken from the capture. The manifest's target_layer_ids are the type's ids as they are.
Limits: padded positions hold zeros where NeMo would have run the model on pad tokens (its
draft attends only to context before a block's anchor, and its loss masks labels past the
sample); train_split is None and shuffle_seed 0 (line order); no fp8 (`fp8.check_aux_dtype`
refuses it); the embedding id -1 is never written (eagle_fast's ids start at 0).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from eagle_fast.dtypes import long_name, short_name
from eagle_fast.errors import UserError
from eagle_fast.files import read_json
from eagle_fast.head import TargetHead, read_input_embedding
from eagle_fast.store.layouts import select_layers
from eagle_fast.store.manifest import file_record
from eagle_fast.store.nemo import StackedShardLayout
from eagle_fast.store.safetensors import write_safetensors

DSPARK_FORMAT_VERSION = 1  # nemo_automodel.components.datasets.llm.dspark_cache._FORMAT_VERSION
TARGET_WEIGHTS = "target_weights.safetensors"  # dspark_cache._TARGET_WEIGHTS_NAME


class NemoDSparkLayout(StackedShardLayout):
    """NeMo AutoModel's DSpark cache (see the module doc); `spec.num_layers` is the target's N."""

    name = "nemo-dspark"

    def __init__(self, spec):
        super().__init__(spec)
        self._model_types: dict[str, str] = {}

    def head_outputs(self):
        return None  # NeMo's trainer applies the target's LM head to target_last_hidden_states

    def final_states(self) -> set[str]:
        return {"post"}

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """target_hidden_states' layers, in order (NeMo's ids; N - 1: the final norm's output)."""
        return self.spec.types[0].layer_ids if self.spec.types else tuple(self.spec.capture_ids)

    def sample_fields(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Field -> (dtype, per-sample shape), in NeMo's CACHE_KEYS order; all padded to seq_length."""
        s = self.spec
        S = s.max_len
        return {"input_ids": (torch.int64, (S,)), "loss_mask": (torch.int64, (S,)),
                "target_hidden_states": (s.dtype, (S, len(self.layer_ids) * s.hidden_size)),
                "target_last_hidden_states": (s.dtype, (S, s.hidden_size))}

    def fields(self):
        return {n: {"dtype": long_name(d), "shape": list(shape)} for n, (d, shape) in self.sample_fields().items()}

    def encode(self, sample, result):
        s = self.spec
        S, H, T = s.max_len, s.hidden_size, sample.length
        if T > S:
            raise ValueError(f"sample {sample.index} has {T} tokens > seq_length {S}")
        if s.num_layers < 1:
            raise ValueError("the NeMo DSpark layout needs the target's layer count (LayoutSpec.num_layers)")
        last = s.num_layers - 1
        ids = torch.full((S,), s.pad_token_id, dtype=torch.int64)
        ids[:T] = result["input_ids"].to(torch.int64)
        loss = torch.zeros(S, dtype=torch.int64)
        loss[:T] = result["loss_mask"].to(torch.int64)
        post = result["hidden_normed"].to(s.dtype)
        layers = self.layer_ids
        hidden = torch.zeros(S, len(layers), H, dtype=s.dtype)
        captured = [i for i in layers if i != last]  # id N - 1 is post-norm: never the captured slot
        if captured:
            aux = select_layers(result["aux_hidden_states"], s.capture_ids, captured, H).reshape(T, len(captured), H)
            slots = [j for j, i in enumerate(layers) if i != last]
            hidden[:T, slots] = aux.to(s.dtype)
        if last in layers:
            hidden[:T, layers.index(last)] = post
        final = torch.zeros(S, H, dtype=s.dtype)
        final[:T] = post
        return {"input_ids": ids, "loss_mask": loss, "target_hidden_states": hidden.reshape(S, -1),
                "target_last_hidden_states": final}

    def shard_extras(self, shard):
        # NeMo's cache has no attention mask: each sample's length, for verify and `DraftDataset`.
        return {"lengths": [s.length for s in shard.samples]}

    def sidecar_names(self, ctx):
        return super().sidecar_names(ctx) + [TARGET_WEIGHTS]

    def write_sidecars(self, root, have, ctx):
        out = super().write_sidecars(root, have, ctx)
        if TARGET_WEIGHTS not in have:
            out.append(write_target_weights(root, ctx.model_dir, self.spec.dtype, tag=ctx.tag))
        return out

    def manifest_body(self, m, ctx):
        s = self.spec
        if ctx.model_dir not in self._model_types:
            self._model_types[ctx.model_dir] = target_model_type(ctx.model_dir)
        template = (m["settings"].get("masks") or {}).get("template_sha256")
        body = {
            "format_version": DSPARK_FORMAT_VERSION,
            # dspark_cache.build_cache_manifest's fields
            "target_model": ctx.model_id,
            "target_model_type": self._model_types[ctx.model_dir],
            "target_vocab_size": s.vocab_size,
            "hidden_size": s.hidden_size,
            "num_hidden_layers": s.num_layers,
            "seq_length": s.max_len,
            "dtype": short_name(s.dtype),
            "num_samples": m["num_samples"],
            "shard_size": m["shard_size"],
            "target_hidden_dim": s.hidden_size * len(self.layer_ids),
            "target_last_hidden_dim": s.hidden_size,
            "target_layer_ids": list(self.layer_ids),
            "train_data_path": m["data"]["path"],
            "train_split": None,
            "shuffle_seed": 0,  # no shuffling: sample i is line-order sample i (NeMo shuffles with a seed)
            "mask_reasoning_content": False,
            "mask_generation_prompt": False,
            # NeMo's tokenizer_chat_template_sha256: of the template rendered with ("" for none)
            "chat_template_sha256": template or hashlib.sha256(b"").hexdigest(),
            # NeMo's reader refuses false; ours is rewritten after each shard, true once all are on disk
            "complete": bool(m["complete"]),
        }
        body["eagle_fast"] = m
        return body


def write_target_weights(root: Path, model_dir: str, dtype: torch.dtype, tag: str = "") -> dict:
    """NeMo's target_weights.safetensors: the input embedding and the LM head [V, H] in `dtype`
    (the cache dtype, as its write_target_weights casts them); both keys even when tied."""
    embed = read_input_embedding(model_dir)
    head = TargetHead.from_pretrained(model_dir).lm_head_weight
    path = write_safetensors(root / TARGET_WEIGHTS, {"embed_tokens.weight": embed.to(dtype).contiguous(),
                                                     "lm_head.weight": head.to(dtype).contiguous()}, tag=tag)
    return file_record(path, root)


def target_model_type(model_dir: str) -> str:
    """config.json's model_type, as NeMo's read_target_model_type gives it ("" when it has none)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"NeMo's DSpark manifest records the target's model_type, and {path} is not there",
                        "make the target checkpoint available at that path (as for extract) and re-run")
    return str(read_json(path, "fix the checkpoint's config.json").get("model_type") or "")
