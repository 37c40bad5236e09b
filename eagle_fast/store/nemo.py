"""NeMo AutoModel 0.7's EAGLE-3 offline cache (its datasets/llm/eagle3_cache.py reads it).

shard-{g:06d}.safetensors with fixed `shard_size` samples, every field padded to
`seq_length`: input_ids/attention_mask/loss_mask int64 [n, S], aux_hidden_states [n, S, 3H],
position_mask bool [n, S, 1], and target_probs [n, S, Vd] (or target_probs_values [n, S, k] +
target_probs_indices int32 with --supervision topk). input_ids, loss_mask, target_probs and
position_mask are shifted left by one with zero fill, as NeMo's HFEagle3TargetModel does;
aux_hidden_states and attention_mask are not. Plus target_embeddings.safetensors and NeMo's
manifest.json (format_version 2) with ours under "eagle_fast".
Limits: padded positions hold zeros for the aux states and a uniform target_probs where NeMo
would have run the model on pad tokens; its loss masks them out either way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle_fast.dtypes import long_name, short_name
from eagle_fast.head import read_input_embedding
from eagle_fast.inputs import ShardPlan
from eagle_fast.store.layouts import Layout, LayoutSpec, ShardSink, select_layers, shard_file_name
from eagle_fast.store.manifest import file_record
from eagle_fast.store.safetensors import SafetensorsWriter, open_safetensors, write_safetensors
from eagle_fast.supervision import shift_left

NEMO_FORMAT_VERSION = 2  # nemo_automodel.components.datasets.llm.eagle3_cache._FORMAT_VERSION


# -------------------------------------------------------------------------------- nemo


def trainer_frame(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
                  target_p: torch.Tensor, argmax_in_draft: torch.Tensor) -> dict[str, torch.Tensor]:
    """One unshifted sample (length T) in the frame NeMo's `Eagle3TrainerModule.forward` trains on.

    As NeMo's HFEagle3TargetModel + `_compute_target_distribution` build it: input_ids, loss_mask,
    target_probs and position_mask are shifted left by one with zero fill (row t describes
    position t+1), aux_hidden_states is not; position_mask = the full-vocabulary argmax is in the
    draft vocabulary and the shifted loss mask is set. Returns int64 input_ids / loss_mask, the
    aux states as given, fp32 target_probs [T, Vd] and bool position_mask [T, 1].
    """
    loss = shift_left(loss_mask.to(torch.int64), dim=0)
    return {"input_ids": shift_left(input_ids.to(torch.int64), dim=0), "loss_mask": loss,
            "aux_hidden_states": aux_hidden_states, "target_probs": shift_left(target_p.float(), dim=0),
            "position_mask": (shift_left(argmax_in_draft.bool(), dim=0) & loss.bool()).unsqueeze(-1)}


class StackedShardLayout(Layout):
    """A layout whose shards are NeMo's stacked cache files (`StackedShardSink`): one file a shard,
    each field a [samples, ...] tensor; NeMo's EAGLE-3 and DSpark caches alike."""

    def shard_paths(self, shard):
        return [shard_file_name(shard.index)]

    def open_shard(self, root, shard):
        return StackedShardSink(self, root, shard)

    def read_sample(self, root, shard_record, local_index, handles=None):
        h = open_safetensors(root / shard_record["files"][0]["path"], handles)
        return {name: h.get_slice(name)[local_index] for name in self.sample_fields()}


class NemoLayout(StackedShardLayout):
    name = "nemo"

    def head_outputs(self):
        # target_probs and the position mask: the draft softmax and the full-vocab argmax.
        # NeMo stores no logsumexp, so the head computes none (no exp of non-draft logits).
        return ("draft", "argmax")

    def head_fields(self):
        return ("draft_logprobs", "argmax_in_draft")

    def head_out_dtype(self) -> torch.dtype:
        # NeMo takes the softmax in fp32, then casts target_probs to the cache dtype.
        return torch.float32

    @property
    def compressed(self) -> bool:
        # NeMo's `is_compressed`: a positive k below the draft width.
        return self.spec.kind == "topk" and 0 < self.spec.k < self.spec.draft_size

    def sample_fields(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Field -> (dtype, per-sample shape): every field is padded to seq_length = max_len."""
        s = self.spec
        S = s.max_len
        out = {
            "input_ids": (torch.int64, (S,)),
            "attention_mask": (torch.int64, (S,)),
            "loss_mask": (torch.int64, (S,)),
            "aux_hidden_states": (s.dtype, (S, s.num_aux * s.hidden_size)),
            "position_mask": (torch.bool, (S, 1)),
        }
        if self.compressed:
            out["target_probs_values"] = (s.dtype, (S, s.k))
            out["target_probs_indices"] = (torch.int32, (S, s.k))
        else:
            out["target_probs"] = (s.dtype, (S, s.draft_size))
        return out

    def fields(self):
        return {n: {"dtype": long_name(d), "shape": list(shape)} for n, (d, shape) in self.sample_fields().items()}

    def encode(self, sample, result):
        s = self.spec
        S = s.max_len
        T = sample.length
        if T > S:
            raise ValueError(f"sample {sample.index} has {T} tokens > seq_length {S}")
        ids = torch.full((S,), s.pad_token_id, dtype=torch.int64)
        ids[:T] = result["input_ids"].to(torch.int64)
        loss = torch.zeros(S, dtype=torch.int64)
        loss[:T] = result["loss_mask"].to(torch.int64)
        attn = torch.zeros(S, dtype=torch.int64)
        attn[:T] = 1
        aux = torch.zeros(S, s.num_aux * s.hidden_size, dtype=s.dtype)
        layers = s.types[0].layer_ids if s.types else s.capture_ids
        aux[:T] = select_layers(result["aux_hidden_states"], s.capture_ids, layers, s.hidden_size).to(s.dtype)
        # Row t of the shifted fields describes position t+1 (NeMo's shifted target frame).
        # Where no real position t+1 exists, NeMo's zero-filled logits give a uniform
        # distribution; its padded positions are masked out of the loss anyway.
        probs = torch.full((S, s.draft_size), 1.0 / s.draft_size, dtype=torch.float32)
        draft_lp = result["draft_logprobs"].to(torch.float32)
        probs[: T - 1] = torch.softmax(draft_lp[1:T], dim=-1) if T > 1 else probs[:0]
        in_draft = torch.zeros(S, dtype=torch.bool)
        in_draft[:T] = result["argmax_in_draft"].to(torch.bool)
        shifted_loss = shift_left(loss, dim=0)
        out = {
            "input_ids": shift_left(ids, dim=0),
            "attention_mask": attn,
            "loss_mask": shifted_loss,
            "aux_hidden_states": aux,
            "position_mask": (shift_left(in_draft, dim=0) & shifted_loss.bool()).unsqueeze(-1),
        }
        if self.compressed:
            # nemo_automodel eagle3_cache.compress_target_probs, for one sequence.
            values, indices = torch.topk(probs, s.k, dim=-1)
            values = values / values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
            out["target_probs_values"] = values.to(s.dtype)
            out["target_probs_indices"] = indices.to(torch.int32)
        else:
            out["target_probs"] = probs.to(s.dtype)
        return out

    def shard_extras(self, shard):
        # NeMo's shifted input_ids drop each sample's first token; keep it for verify.
        return {"first_tokens": [s.input_ids[0] for s in shard.samples]}

    def sidecar_names(self, ctx):
        return super().sidecar_names(ctx) + [EMBEDDINGS]

    def write_sidecars(self, root, have, ctx):
        out = super().write_sidecars(root, have, ctx)
        if EMBEDDINGS not in have:
            out.append(write_target_embeddings(root, ctx.model_dir, tag=ctx.tag))
        return out

    def manifest_body(self, m, ctx):
        body = nemo_manifest_fields(self.spec, model_id=ctx.model_id, data_path=m["data"]["path"],
                                    num_samples=m["num_samples"], shard_size=m["shard_size"],
                                    aux_layer_ids=list(m["aux_layer_ids"]),
                                    draft_ids=None if ctx.draft_ids is None else ctx.draft_ids.tolist())
        body["eagle_fast"] = m
        return body


class StackedShardSink(ShardSink):
    """One shard file of NeMo's caches: every field `sample_fields()` names, a fixed shape per sample
    (padded to seq_length), stacked on a leading sample axis; no __metadata__, so the header holds
    what NeMo's write_shard (safetensors' save_file) stores, each tensor's keys sorted."""

    def __init__(self, layout, root: Path, shard: ShardPlan):
        super().__init__(root)
        n = len(shard.samples)
        self.names = list(layout.sample_fields())
        specs = {name: (d, (n, *shape)) for name, (d, shape) in layout.sample_fields().items()}
        self.writer = SafetensorsWriter(root / shard_file_name(shard.index), specs)

    def write(self, local_index, encoded):
        for name in self.names:
            self.writer.write(name, local_index, encoded[name].unsqueeze(0))

    def commit(self):
        return [file_record(self.writer.commit(), self.root)]

    def abort(self):
        self.writer.abort()


def nemo_manifest_fields(spec: LayoutSpec, *, model_id: str, data_path: str, num_samples: int,
                         shard_size: int, aux_layer_ids: list[int],
                         draft_ids: list[int] | None) -> dict:
    """The top-level manifest NeMo AutoModel's precompute_eagle3 writes (format_version 2)."""
    selected = list(range(spec.vocab_size)) if draft_ids is None else list(draft_ids)
    return {
        "format_version": NEMO_FORMAT_VERSION,
        "target_model": model_id,
        "target_vocab_size": spec.vocab_size,
        "draft_vocab_size": len(selected),
        "seq_length": spec.max_len,
        "dtype": short_name(spec.dtype),
        "num_samples": num_samples,
        "shard_size": shard_size,
        "target_probs_topk": spec.k if spec.kind == "topk" else 0,
        "aux_hidden_dim": spec.hidden_size * spec.num_aux,
        "aux_layer_ids": list(aux_layer_ids),
        "selected_token_ids": selected,
        "input_data": data_path,
        "split": None,
        # No shuffling: sample i is line-order sample i. NeMo records an int seed here.
        "shuffle_seed": 0,
        # Assistant masks come from the template's {% generation %} blocks (or the rendered
        # assistant spans), as NeMo's defaults compute them.
        "mask_reasoning_content": False,
        "mask_generation_prompt": False,
    }


EMBEDDINGS = "target_embeddings.safetensors"


def write_target_embeddings(root: Path, model_dir: str, tag: str = "") -> dict:
    """NeMo's target_embeddings.safetensors: {"weight": fp32 [V, H]} (input embeddings)."""
    weight = read_input_embedding(model_dir)
    path = write_safetensors(root / EMBEDDINGS,
                             {"weight": weight.to(torch.float32).contiguous()}, tag=tag)
    return file_record(path, root)
