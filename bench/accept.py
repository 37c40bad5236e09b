"""Train EAGLE-3 drafts with NeMo AutoModel 0.7.0's own components, one per supervision source.

The pieces `bench_accept.py` and `tests/test_accept.py` share:
  sources     every source yields the same samples, unpadded, in the frame NeMo's
              `Eagle3TrainerModule.forward` takes (input_ids, loss_mask, aux_hidden_states,
              target_probs [T, Vd] fp32, position_mask [T, 1]):
                reference_samples   NeMo's HFEagle3TargetModel.generate_batch on the fp32 target,
                                    then NeMo's `_compute_target_distribution` (full logits)
                native_samples      an eagle_fast native dataset, `Eagle3Dataset.nemo_inputs`
                nemo_cache_samples  an eagle_fast `--format nemo` cache, read by NeMo's
                                    `CachedEagle3Dataset`
                served_samples      `eagle-fast serve` through NeMo's `RemoteEagle3TargetModel`
                runner_samples      an eagle_fast runner in process: NeMo's drop-in wrapper
                                    (full logits) or the fast path (no full logits)
  train_draft NeMo's `LlamaEagle3DraftModel` (the registry's draft for Qwen3), built, seeded from
              the target's embeddings and given the vocabulary mapping exactly as NeMo's
              train_eagle3 recipe does, wrapped in its `Eagle3TrainerModule` (soft CE, TTT
              unroll), trained with AdamW; the seed fixes the init and the batch order.
  evaluate    held-out loss, accuracy and NeMo's `simulated_accept_length`, always on the
              reference supervision, so every draft is judged against the real target.
The data split is the trained tiny target's (`tiny.TrainSpec.held_out`): drafts train on the
conversations the target trained on and are judged on the ones neither saw.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DRAFT_SIZE = 512  # bench_storage's draft vocabulary: its recommended k (64) was measured at this size
PAD = 0


@dataclass(frozen=True)
class DraftTrain:
    steps: int = 400
    batch_size: int = 8
    lr: float = 3e-3          # peak; linear warm-up, then cosine decay to lr / 10
    warmup: int = 20
    ttt_steps: int = 3        # accept length is then at most 1 + ttt_steps
    seed: int = 0             # draft init and batch order

    def asdict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------- data


def split_lines(held_out: int | None = None) -> tuple[list[str], list[str]]:
    """The bundled chat lines the trained tiny target was fit on, and its held-out ones."""
    from eagle_fast.tiny import TrainSpec, _data_path

    n = TrainSpec().held_out if held_out is None else held_out
    lines = [ln for ln in _data_path().read_text().splitlines() if ln.strip()]
    return lines[:-n], lines[-n:]


def write_jsonl(lines: list[str], path: Path) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def plan(model_dir: str | Path, data: Path) -> list:
    """The tokenised samples of `data`, as `eagle-fast extract` plans them (same ids, same loss mask)."""
    from transformers import AutoConfig

    from eagle_fast.inputs import load_tokenizer, plan_inputs, resolve_max_len

    cfg = AutoConfig.from_pretrained(model_dir)
    max_len = resolve_max_len(None, cfg.max_position_embeddings)  # extract's default
    return plan_inputs(data, load_tokenizer(str(model_dir)), cfg.vocab_size, max_len=max_len,
                       overlong="truncate").samples


def prompts(model_dir: str | Path, lines: list[str]) -> list[list[int]]:
    """Token ids of each conversation up to its first user turn, with the generation prompt."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for raw in lines:
        msgs = json.loads(raw)["messages"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        text = tok.apply_chat_template(msgs[: first_user + 1], tokenize=False, add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def vocab_tensors(vocab_file: Path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo's (selected_token_ids, selected_token_mask) from an `eagle-fast vocab` file."""
    from eagle_fast.vocab import load_draft_vocab

    v = load_draft_vocab(vocab_file, vocab_size)
    return v.ids.clone(), v.t2d()


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    T = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (T - len(r)) for r in rows], dtype=torch.int64)


def _unbatch(batch, lengths: list[int]) -> list[dict]:
    """Per-sample slices of a NeMo Eagle3TargetBatch-like record holding target_probs/position_mask."""
    out = []
    for i, T in enumerate(lengths):
        out.append({"input_ids": batch["input_ids"][i, :T].to(torch.int64).cpu(),
                    "loss_mask": batch["loss_mask"][i, :T].to(torch.int64).cpu(),
                    "aux_hidden_states": batch["aux_hidden_states"][i, :T].float().cpu(),
                    "target_probs": batch["target_probs"][i, :T].float().cpu(),
                    "position_mask": batch["position_mask"][i, :T].bool().cpu()})
    return out


# ------------------------------------------------------------------------------- sources


def load_target(model_dir: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


@torch.no_grad()
def reference_samples(target, samples: list, ids: torch.Tensor, mask: torch.Tensor,
                      batch_size: int = 8) -> list[dict]:
    """NeMo's in-process supervision: HFEagle3TargetModel's full logits, projected by its
    `_compute_target_distribution` (what the live trainer does with them)."""
    from nemo_automodel.components.speculative.eagle.core import _compute_target_distribution
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel

    from eagle_fast.runners.factory import default_aux_layers

    # The tiny target is too shallow for NeMo's default [1, L/2-1, L-4]; both sides take
    # eagle_fast's default for it, which is NeMo's wherever that fits.
    backend = HFEagle3TargetModel(target, aux_layer_ids=default_aux_layers(target.config.num_hidden_layers))
    out: list[dict] = []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i: i + batch_size]
        lengths = [s.length for s in chunk]
        input_ids = _pad([s.input_ids for s in chunk], PAD)
        attention = _pad([[1] * s.length for s in chunk], 0)
        loss = _pad([s.loss_mask for s in chunk], 0)
        b = backend.generate_batch(input_ids=input_ids, attention_mask=attention, loss_mask=loss)
        probs, pos = _compute_target_distribution(b.logits, ids, mask, b.loss_mask)
        out += _unbatch({"input_ids": b.input_ids, "loss_mask": b.loss_mask,
                         "aux_hidden_states": b.aux_hidden_states, "target_probs": probs,
                         "position_mask": pos}, lengths)
    return out


@torch.no_grad()
def runner_samples(runner, samples: list, ids: torch.Tensor, mask: torch.Tensor, fast: bool,
                   batch_size: int = 8) -> list[dict]:
    """In process with an eagle_fast runner: as NeMo's drop-in (`RunnerEagle3TargetModel`
    around it, full logits, NeMo's projection) or, `fast`, through the fast path
    `forward_eagle3_supervision(("draft",))` + `Supervision.to_nemo_batch` (no full logits)."""
    from nemo_automodel.components.speculative.eagle.core import _compute_target_distribution
    from nemo_automodel.components.speculative.eagle.target_runner import RunnerEagle3TargetModel

    from eagle_fast.runners.factory import default_aux_layers

    # NeMo's wrapper sets the runner's aux layers, for the fast path too
    backend = RunnerEagle3TargetModel(runner, aux_layer_ids=default_aux_layers(runner.num_layers))
    out: list[dict] = []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i: i + batch_size]
        input_ids = _pad([s.input_ids for s in chunk], PAD)
        attention = _pad([[1] * s.length for s in chunk], 0)
        loss = _pad([s.loss_mask for s in chunk], 0)
        if fast:
            b = runner.forward_eagle3_supervision(input_ids, attention, outputs=("draft",),
                                                  draft_ids=ids).to_nemo_batch(input_ids, loss)
            probs, pos = b.target_probs, b.position_mask
        else:
            b = backend.generate_batch(input_ids, attention, loss)
            probs, pos = _compute_target_distribution(b.logits, ids, mask, b.loss_mask)
        out += _unbatch({"input_ids": b.input_ids, "loss_mask": b.loss_mask,
                         "aux_hidden_states": b.aux_hidden_states, "target_probs": probs,
                         "position_mask": pos}, [s.length for s in chunk])
    return out


def native_samples(directory: Path, tail: str = "spread") -> list[dict]:
    from eagle_fast.store.dataset import Eagle3Dataset

    ds = Eagle3Dataset(directory, aux_dtype=torch.float32)
    return [ds.nemo_inputs(i, tail) for i in range(len(ds))]


def nemo_cache_samples(directory: Path) -> list[dict]:
    """Samples as NeMo's own cache reader gives them, cut to their real length."""
    from nemo_automodel.components.datasets.llm.eagle3_cache import CachedEagle3Dataset

    ds = CachedEagle3Dataset(str(directory))
    out = []
    for i in range(len(ds)):
        s = ds[i]
        T = int(s["attention_mask"].sum())
        out += _unbatch({k: v.unsqueeze(0) for k, v in s.items()}, [T])
    return out


def nemo_cache_embeddings(directory: Path) -> torch.Tensor:
    """The target embeddings NeMo's recipe seeds the draft with on the cached path."""
    from nemo_automodel.components.datasets.llm.eagle3_cache import read_target_embeddings

    return read_target_embeddings(str(directory))


def served_samples(url: str, samples: list, ids: torch.Tensor, mask: torch.Tensor,
                   batch_size: int = 8) -> list[dict]:
    """`eagle-fast serve` at `url`, through NeMo's own remote-target client."""
    from nemo_automodel.components.speculative.eagle.remote.client import RemoteEagle3TargetModel

    client = RemoteEagle3TargetModel([url], device="cpu")
    client.set_vocab_mapping(ids, mask)
    out: list[dict] = []
    try:
        for i in range(0, len(samples), batch_size):
            chunk = samples[i: i + batch_size]
            b = client.generate_batch(_pad([s.input_ids for s in chunk], PAD),
                                      _pad([[1] * s.length for s in chunk], 0),
                                      _pad([s.loss_mask for s in chunk], 0))
            out += _unbatch({"input_ids": b.input_ids, "loss_mask": b.loss_mask,
                             "aux_hidden_states": b.aux_hidden_states, "target_probs": b.target_probs,
                             "position_mask": b.position_mask}, [s.length for s in chunk])
    finally:
        close = getattr(client, "close", None)
        if close is not None:
            close()
    return out


def check_aligned(ref: list[dict], got: list[dict], name: str) -> None:
    """Every source must hold the reference's samples, in order (ids and loss mask equal)."""
    if len(ref) != len(got):
        raise AssertionError(f"{name}: {len(got)} samples, the reference has {len(ref)}")
    for i, (a, b) in enumerate(zip(ref, got)):
        for key in ("input_ids", "loss_mask"):
            if not torch.equal(a[key], b[key]):
                raise AssertionError(f"{name}: sample {i} differs from the reference in {key}")


# --------------------------------------------------------------------------------- draft


def build_trainer(model_dir: str | Path, ids: torch.Tensor, mask: torch.Tensor, embeddings: torch.Tensor,
                  ttt_steps: int, seed: int):
    """NeMo's draft + trainer module, built as recipes/llm/train_eagle3.py builds them (CPU, fp32)."""
    from nemo_automodel.components.speculative.eagle.core import Eagle3TrainerModule
    from nemo_automodel.components.speculative.eagle.registry import resolve_eagle3_draft_spec
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(model_dir)
    spec = resolve_eagle3_draft_spec(list(base.architectures))
    cfg = base.to_dict()
    cfg.update(draft_vocab_size=int(ids.numel()), target_hidden_size=base.hidden_size,
               architectures=["LlamaEagle3DraftModel"], tie_word_embeddings=False, attn_implementation="eager",
               fc_norm=False, norm_output=False, parallel_drafting=False)
    torch.manual_seed(seed)
    draft = spec.draft_cls(type(base).from_dict(cfg)).to(dtype=torch.float32)
    draft.copy_embeddings_from_target(torch.nn.Embedding.from_pretrained(embeddings.float()))
    draft.set_vocab_mapping(ids)
    draft.freeze_embeddings()
    return Eagle3TrainerModule(draft, selected_token_ids=ids, selected_token_mask=mask, ttt_steps=ttt_steps)


ADAM_BETAS = (0.9, 0.95)  # train_draft's AdamW (NeMo's train_eagle3 recipe)
TTT_DECAY = 0.8  # Eagle3TrainerModule weighs TTT step i by 0.8**i (then divides by their sum)


def lr_at(step: int, t: DraftTrain) -> float:
    """train_draft's learning rate at `step`: linear warm-up, then cosine decay to lr / 10."""
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    frac = (step - t.warmup) / max(t.steps - t.warmup, 1)
    return t.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def _step_inputs(samples: list[dict]) -> dict[str, torch.Tensor]:
    from eagle_fast.store.dataset import Eagle3Dataset

    b = Eagle3Dataset.nemo_collate(samples)  # right-padded; padded rows zero and unsupervised
    out = {k: b[k] for k in ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states",
                             "target_probs", "position_mask")}
    # Probabilities below fp32's smallest normal (exp of a log-prob under -87) are flushed to zero
    # for every source alike: they weigh nothing in the loss, but denormal arithmetic in the
    # soft-CE backward made a step up to 15x slower here (set_flush_denormal reaches only the
    # calling thread, not torch's worker threads).
    tp = out["target_probs"]
    out["target_probs"] = tp.masked_fill(tp < torch.finfo(torch.float32).tiny, 0.0)
    return out


def train_draft(model_dir, ids, mask, embeddings, samples: list[dict], t: DraftTrain):
    """Train one draft on `samples`; returns (trainer module, loss of every step)."""
    trainer = build_trainer(model_dir, ids, mask, embeddings, t.ttt_steps, t.seed)
    params = [p for p in trainer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=ADAM_BETAS, weight_decay=0.0)
    gen = torch.Generator().manual_seed(t.seed)
    order: list[int] = []
    losses = []
    trainer.train()
    torch.set_flush_denormal(True)  # Adam's early second moments are denormals (cf. tiny._train)
    try:
        for step in range(t.steps):
            if len(order) < t.batch_size:
                order += torch.randperm(len(samples), generator=gen).tolist()
            batch, order = order[: t.batch_size], order[t.batch_size:]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, t)
            metrics = trainer(**_step_inputs([samples[i] for i in batch]))
            opt.zero_grad(set_to_none=True)
            metrics.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(round(float(metrics.loss.detach()), 5))
    finally:
        torch.set_flush_denormal(False)
    trainer.eval()
    return trainer, losses


@torch.no_grad()
def evaluate(trainer, samples: list[dict], batch_size: int = 8) -> dict:
    """Held-out soft-CE loss (mean over supervised positions, TTT-weighted as in training),
    top-1 accuracy and NeMo's simulated accept length, on `samples` (the reference's)."""
    from nemo_automodel.components.speculative.eagle.core import simulated_accept_length

    loss_sum = valid = correct = 0.0
    hits = steps = None
    for i in range(0, len(samples), batch_size):
        m = trainer(**_step_inputs(samples[i: i + batch_size]))
        n = float(m.valid_tokens)
        loss_sum += float(m.loss) * n
        valid += n
        correct += float(m.accuracy) * n
        hits = m.step_prefix_hits if hits is None else hits + m.step_prefix_hits
        steps = m.step_valid if steps is None else steps + m.step_valid
    return {"loss": loss_sum / max(valid, 1.0), "accuracy": correct / max(valid, 1.0),
            "accept_length": float(simulated_accept_length(hits, steps)),
            "step_accept": [round(float(h) / max(float(s), 1.0), 5) for h, s in zip(hits, steps)],
            "supervised": int(valid)}
