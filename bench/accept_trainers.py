"""Train EAGLE-3 drafts with speculators 0.9.0's and SpecForge 0.2.0's own training code on our
datasets, and judge them by NeMo AutoModel's simulated accept length.

What it does
    speculators  `extract --format speculators` read by its ArrowDataset (hs_connectors' FP8Transfer
                 for --aux-dtype fp8), packed by its CollateFn with shift_batch; its
                 Eagle3DraftModel.from_training_args (eager attention; the verifier's embeddings, and
                 its lm_head is the verifier's head rows for the draft vocabulary, frozen: its
                 load_verifier_weights), its own loss (kl_div, eager) inside its forward; the
                 optimizer and scheduler built by its Trainer.setup_optimizer; the step is its
                 Trainer.train_epoch's (forward, backward, clip 1.0, optimizer step, scheduler step).
    SpecForge    `extract --format specforge` read by its offline reader, normaliser, collator and
                 FeatureDataLoader; its LlamaForCausalLMEagle3 draft (target embeddings, frozen);
                 its TargetHead on the target's tied head; one step is its TrainerCore.train_step
                 around Eagle3TrainStrategy.forward_loss, stepped by its BF16Optimizer (fp32 masters,
                 clipping, warm-up + cosine). On CPU its Triton KL loss is swapped for its own reference
                 loss (`specforge.core.loss._compute_loss`) and torch.compile is off, for the call only.
    Shared with the NeMo runs (accept.py): the draft's shape (one layer, the target's widths), the
    draft vocabulary, the steps, the peak learning rate and warm-up, gradient clipping at 1.0, the
    seed (init and the 8 samples of every step, drawn by the same generator as accept.train_draft),
    fp32 compute. Where their APIs do not allow NeMo's settings: AdamW betas stay at torch's
    (0.9, 0.999), not NeMo's (0.9, 0.95); both cosine schedules decay to 0, not to lr / 10; the TTT
    loss weights are theirs (speculators 1.0 per step, SpecForge 0.8^k unnormalised, NeMo 0.8^k
    normalised); speculators packs the 8 samples into one row (CollateFn's max_len set to their
    shifted total, so no padding row), SpecForge pads them.
    The controls `nemo_optim=True` (sources *-nemo-optim) put NeMo's betas and schedule on their
    optimizers (`nemo_optimizer_settings`), all else theirs: what is left between such a draft and
    NeMo's is their training step itself (model, loss, TTT weights), not their defaults.
    speculators-nemo-decay also sets its own `ttt_step_loss_decay` to NeMo's (accept.TTT_DECAY;
    NeMo normalises the weights to sum 1, speculators does not: a scale Adam does not see, but
    clipping does).

The measure (the same for every draft)
    NeMo's `simulated_accept_length(step_prefix_hits, step_valid)` on the held-out reference samples
    (accept.reference_samples: NeMo's frame, slot j holds aux[j], input x[j+1], the target's
    distribution for x[j+2]). Every draft here runs its own TTT forward over a held-out sample in that
    frame (all three frameworks align slot j the same way: speculators after shift_batch, SpecForge
    after TargetHead.preprocess) and yields, per TTT step k, its greedy draft-vocab id at every slot,
    teacher-forced as all three train. `prefix_counts` then counts as Eagle3TrainerModule.forward
    does: a hit at (j, k) when that id is argmax target_probs[j+k] and position_mask[j+k]; a chain
    stays valid while loss_mask[j+k'] holds for every k' <= k. `check_measure` runs this on a NeMo
    draft beside NeMo's own counters and requires them equal.

Limits
    A 1,923-token target and a 128-wide draft (bench_accept's). speculators' eager attention and
    SpecForge's sdpa path are their CPU paths, not their GPU defaults (flex attention, Triton loss).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import accept as A
import torch

from eagle_fast.checkpoint import indexed_view


def nemo_optimizer_settings(optimizer: torch.optim.Optimizer, t: A.DraftTrain):
    """NeMo's AdamW betas on one of their AdamW optimizers, and a scheduler for it that sets NeMo's
    learning rate at every step (`accept.lr_at`: warm-up, then cosine to lr / 10), to replace
    their own scheduler: stepped after each optimizer step, as theirs are."""
    for g in optimizer.param_groups:
        g["betas"] = A.ADAM_BETAS
        g["initial_lr"] = t.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: A.lr_at(step, t) / t.lr)


# ------------------------------------------------------------------------------- measure


def prefix_counts(preds: list[torch.Tensor], sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo's (step_prefix_hits, step_valid) [K] for one unpadded sample in NeMo's frame.

    preds[k]: int64 [T], the draft's greedy draft-vocab id at every slot on TTT step k."""
    tp, pm, lm = sample["target_probs"], sample["position_mask"].reshape(-1).bool(), sample["loss_mask"].bool()
    T = tp.shape[0]
    want = tp.argmax(dim=-1)
    hits, valid = [], []
    prefix_correct = prefix_valid = None
    for k, p in enumerate(preds):
        ahead = torch.zeros(T, dtype=torch.bool)
        target = torch.zeros(T, dtype=torch.int64)
        chain = torch.zeros(T, dtype=torch.bool)
        if k < T:
            ahead[: T - k] = pm[k:]
            target[: T - k] = want[k:]
            chain[: T - k] = lm[k:]
        correct = (p.reshape(-1)[:T] == target) & ahead
        prefix_correct = correct if prefix_correct is None else prefix_correct & correct
        prefix_valid = chain if prefix_valid is None else prefix_valid & chain
        hits.append(prefix_correct.sum())
        valid.append(prefix_valid.sum())
    return torch.stack(hits), torch.stack(valid)


def accept_from(predict, samples: list[dict]) -> dict:
    """NeMo's simulated accept length of a draft given as `predict(sample) -> [K x int64 [T]]`."""
    from nemo_automodel.components.speculative.eagle.core import simulated_accept_length

    hits = valid = None
    for s in samples:
        h, v = prefix_counts(predict(s), s)
        hits, valid = (h, v) if hits is None else (hits + h, valid + v)
    return {"accept_length": float(simulated_accept_length(hits, valid)),
            "step_accept": [round(float(h) / max(float(v), 1.0), 5) for h, v in zip(hits, valid)],
            "step_prefix_hits": hits.tolist(), "step_valid": valid.tolist()}


@contextlib.contextmanager
def _captured_logits(module):
    """Every `module.compute_logits` output while inside, in call order (one per TTT step)."""
    seen: list[torch.Tensor] = []
    original = module.compute_logits
    with mock.patch.object(module, "compute_logits", lambda h: seen.append(original(h)) or seen[-1]):
        yield seen


@torch.no_grad()
def nemo_predict(trainer, sample: dict) -> list[torch.Tensor]:
    """A NeMo Eagle3TrainerModule's per-step greedy ids on one sample (its own TTT forward)."""
    with _captured_logits(trainer.draft_model) as seen:
        trainer(**A._step_inputs([sample]))
    return [x[0].argmax(dim=-1) for x in seen]


def check_measure(trainer, samples: list[dict]) -> dict:
    """prefix_counts over `nemo_predict` against NeMo's own counters (accept.evaluate): equal or raise."""
    ours = accept_from(lambda s: nemo_predict(trainer, s), samples)
    nemo = A.evaluate(trainer, samples)
    theirs = [round(x, 5) for x in nemo["step_accept"]]
    if ours["step_accept"] != theirs or abs(ours["accept_length"] - nemo["accept_length"]) > 1e-9:
        raise AssertionError(f"the accept-length mapping disagrees with NeMo's counters: {ours} vs {nemo}")
    return {"nemo_accept_length": nemo["accept_length"], "mapped_accept_length": ours["accept_length"],
            "step_prefix_hits": ours["step_prefix_hits"], "step_valid": ours["step_valid"], "equal": True}


def batches(n_samples: int, t: A.DraftTrain):
    """The sample indices of every step, drawn as accept.train_draft draws them."""
    gen = torch.Generator().manual_seed(t.seed)
    order: list[int] = []
    for _ in range(t.steps):
        if len(order) < t.batch_size:
            order += torch.randperm(n_samples, generator=gen).tolist()
        batch, order = order[: t.batch_size], order[t.batch_size:]
        yield batch


# --------------------------------------------------------------------------- speculators


def speculators_dataset(data_dir: Path, fp8: bool):
    """speculators' ArrowDataset over an `extract --format speculators` directory, in fp32."""
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    transfer = FP8Transfer(data_dir / "hidden_states", dequantize_dtype=torch.float32) if fp8 else None
    return ArrowDataset(max_len=1 << 20, datapath=str(data_dir), transfer=transfer, on_missing="raise",
                        hidden_states_dtype=torch.float32)


def speculators_draft(model_dir: Path, data_dir: Path, aux_layers: list[int], draft_size: int, t: A.DraftTrain):
    """Eagle3DraftModel as speculators' trainer builds it, the vocabulary found by its CLI."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config, parse_vocab_mappings

    found = argparse.Namespace(d2t_path=None, t2d_path=None, data_path=str(data_dir), draft_vocab_size=draft_size,
                               token_freq_path=None, verifier_name_or_path=str(model_dir), trust_remote_code=False)
    d2t, t2d, size = parse_vocab_mappings(found)
    if d2t is None or size != draft_size:
        raise RuntimeError(f"speculators found no d2t-{draft_size}.npy / t2d-{draft_size}.npy in {data_dir}")
    layer_config = create_transformer_layer_config(str(model_dir), 1, "llama", None, None, [])
    torch.manual_seed(t.seed)
    model = Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(model_dir), draft_vocab_size=size,
        norm_before_residual=False, ttt_steps=t.ttt_steps, draft_attn_impl="eager",
        target_layer_ids=[i + 1 for i in aux_layers])
    return model.to(torch.float32)


def train_speculators(model_dir: Path, data_dir: Path, aux_layers: list[int], draft_size: int, t: A.DraftTrain,
                      fp8: bool = False, ref: list[dict] | None = None, nemo_optim: bool = False,
                      ttt_decay: float = 1.0):
    """Train a speculators draft on `data_dir` with its own step; returns (model, loss of every step).
    `nemo_optim`: NeMo's betas and schedule on its optimizer (`nemo_optimizer_settings`);
    `ttt_decay`: its ttt_step_loss_decay (step k of the TTT unroll weighs ttt_decay^k)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    ds = speculators_dataset(data_dir, fp8)
    if ref is not None:  # the Arrow rows are the reference's samples, in order
        for i, s in enumerate(ref):
            if not torch.equal(torch.as_tensor(ds.data[i]["input_ids"]).to(torch.int64)[1:], s["input_ids"][:-1]):
                raise AssertionError(f"speculators row {i} is not the reference's sample {i}")
    model = speculators_draft(model_dir, data_dir, aux_layers, draft_size, t)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(ttt_steps=t.ttt_steps, ttt_step_loss_decay=ttt_decay,
                                                          loss_fn="kl_div", loss_implementation="eager")
    hidden = model.config.transformer_layer_config.hidden_size

    def collate(items):
        total = sum(int(x["input_ids"].shape[0]) - 1 for x in items)
        return CollateFn(total, hidden, num_target_layers=len(aux_layers), dtype=torch.float32,
                         preprocess=shift_batch)(items)

    losses = speculators_steps(model, speculators_optimizer(model, t, nemo_optim), ds, t, collate, train_kwargs)
    return model, losses


def speculators_optimizer(model, t: A.DraftTrain, nemo_optim: bool = False) -> SimpleNamespace:
    """speculators' Trainer's own optimizer and scheduler for `model` (`.optimizers`, `.schedulers`);
    its __init__ also sets up a checkpointer and moves batches to a CUDA rank, which a CPU run cannot
    take. `nemo_optim`: NeMo's betas and schedule instead (`nemo_optimizer_settings`)."""
    from speculators.train.trainer import Trainer, TrainerConfig

    config = TrainerConfig(lr=t.lr, num_epochs=1, save_path="", weight_decay=0.0, scheduler_type="cosine",
                           scheduler_warmup_steps=t.warmup, max_steps=t.steps, hidden_states_dtype=torch.float32)
    opt = SimpleNamespace(model=model, config=config, resume_from_checkpoint=False, train_loader=[])
    Trainer.setup_optimizer(opt)
    if nemo_optim:
        opt.schedulers = [nemo_optimizer_settings(o, t) for o in opt.optimizers]
    return opt


def speculators_steps(model, opt: SimpleNamespace, ds, t: A.DraftTrain, collate, train_kwargs: dict) -> list[float]:
    """speculators' Trainer.train_epoch step, on CPU, over `batches(len(ds), t)` of `ds`'s rows
    (`collate(items)` -> the model's batch); the loss of every step. `model` is left in eval mode."""
    losses = []
    model.train()
    torch.set_flush_denormal(True)
    try:
        for batch_ids in batches(len(ds), t):
            _, loss, _ = model(**collate([ds[i] for i in batch_ids]), **train_kwargs)
            for o in opt.optimizers:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in opt.optimizers:
                o.step()
            for s in opt.schedulers:
                s.step()
            losses.append(round(float(loss.detach()), 5))
    finally:
        torch.set_flush_denormal(False)
    model.eval()
    return losses


def save_speculators_draft(model, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A speculators Eagle3DraftModel saved as its trainer's checkpointer saves an epoch (its own
    save_pretrained, the weights in `dtype`, config.json's dtype patched to match): the
    `speculators_model_type: eagle3` layout vLLM loads (`eagle-fast accept --draft out_dir`)."""
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype

    out = Path(out_dir)
    model.save_pretrained(out, state_dict=convert_float_dtype(model.state_dict(), dtype))
    patch_config_dtype(out / "config.json", dtype)
    return out


@torch.no_grad()
def speculators_predict(model, sample: dict) -> list[torch.Tensor]:
    """Its Eagle3DraftModel.forward without targets: the greedy draft ids of every TTT step."""
    T = sample["input_ids"].shape[0]
    tokens = model(hidden_states=sample["aux_hidden_states"][None].float(), input_ids=sample["input_ids"][None],
                   document_ids=torch.zeros(1, T, dtype=torch.long),
                   position_ids=torch.arange(1, T + 1)[None],  # shift_batch's positions start at 1
                   ttt_steps=model.config.speculators_config.proposal_methods[0].speculative_tokens)
    return [x[0] for x in tokens]


# ----------------------------------------------------------------------------- SpecForge


@contextlib.contextmanager
def specforge_on_cpu():
    """SpecForge's CPU limits, for the call only: its KL loss is a Triton kernel (its own
    reference loss instead) and its target step is under torch.compile (off)."""
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core.loss import _compute_loss

    with mock.patch.object(eagle3_model, "LogSoftmaxLoss", SimpleNamespace(apply=_compute_loss)), \
            mock.patch.object(torch._dynamo.config, "disable", True):
        yield


def specforge_draft(target_dir: Path, vocab_mapping: Path, draft_size: int, seed: int):
    """SpecForge's LlamaForCausalLMEagle3 at the target's widths, its embeddings, frozen."""
    from specforge.modeling.auto import AutoDraftModel
    from transformers import AutoConfig, LlamaConfig

    base = AutoConfig.from_pretrained(target_dir)
    config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=base.hidden_size,
                         num_attention_heads=base.num_attention_heads, num_key_value_heads=base.num_key_value_heads,
                         head_dim=base.head_dim, intermediate_size=base.intermediate_size, num_hidden_layers=1,
                         vocab_size=base.vocab_size, draft_vocab_size=draft_size,
                         max_position_embeddings=base.max_position_embeddings, rms_norm_eps=base.rms_norm_eps,
                         rope_parameters=dict(base.rope_parameters))
    torch.manual_seed(seed)
    draft = AutoDraftModel.from_config(config, attention_backend="sdpa", torch_dtype=torch.float32)
    draft.load_embedding(str(target_dir), embedding_key="model.embed_tokens.weight")
    draft.load_vocab_mapping(str(vocab_mapping))
    draft.freeze_embedding()
    return draft


def specforge_head(target_dir: Path):
    from specforge.modeling.target.target_head import TargetHead

    head = TargetHead(str(target_dir))
    head.load_weights(str(target_dir), lm_head_key="model.embed_tokens.weight")  # the tiny target is tied
    head.freeze_weights()
    return head.float().eval()


class _CPUBackend:
    """The two calls SpecForge's TrainerCore makes of a backend, on one CPU process."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def backward(self, loss, *, is_boundary=True):
        loss.backward()

    def step(self):
        return self.optimizer.step()


def train_specforge(model_dir: Path, data_dir: Path, work: Path, draft_size: int, t: A.DraftTrain,
                    ref: list[dict] | None = None, nemo_optim: bool = False):
    """Train a SpecForge draft on `data_dir` with its own step; returns (OnlineEagle3Model, losses).
    `nemo_optim`: NeMo's betas and schedule on its optimizer (`nemo_optimizer_settings`)."""
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.algorithms.eagle3.data import (
        build_offline_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy

    max_len = 1 << 20
    refs = build_offline_reader(str(data_dir), run_id="accept", ttt_length=t.ttt_steps, max_len=max_len).read()
    by_index = {int(Path(r.feature_store_uri).stem.split("_")[-1]): r for r in refs}  # data_{i}.ckpt
    target_dir = indexed_view(Path(model_dir), work / "specforge-target")
    draft = specforge_draft(target_dir, data_dir / "vocab_mapping.pt", draft_size, t.seed)
    model = eagle3_model.OnlineEagle3Model(draft, length=t.ttt_steps, attention_backend="sdpa")
    optimizer = BF16Optimizer(draft, lr=t.lr, weight_decay=0.0, max_grad_norm=1.0, total_steps=t.steps,
                              warmup_ratio=t.warmup / t.steps)
    if nemo_optim:
        optimizer.scheduler = nemo_optimizer_settings(optimizer.optimizer, t)
    core = TrainerCore(Eagle3TrainStrategy(model, target_head=specforge_head(target_dir)), _CPUBackend(optimizer))
    collate, normalise = build_offline_collator(), build_offline_normalizer(max_len)
    losses = []
    model.train()
    torch.set_flush_denormal(True)
    try:
        with specforge_on_cpu():
            for step, batch_ids in enumerate(batches(len(by_index), t)):
                loader = FeatureDataLoader(LocalFeatureStore("accept"), refs=[by_index[i] for i in batch_ids],
                                           batch_size=len(batch_ids), collate_fn=collate,
                                           per_sample_transform=normalise, drop_last=False)
                (batch,) = list(loader)
                for key in ("hidden_state", "target"):  # stored bf16; fp32 compute, as every run here
                    batch.tensors[key] = batch.tensors[key].float()
                if ref is not None and step == 0:
                    _check_specforge_batch(batch, [ref[i] for i in batch_ids])
                out = core.train_step(batch)
                losses.append(round(float(out.loss), 5))  # StepResult: the step's loss, a float
    finally:
        torch.set_flush_denormal(False)
    model.eval()
    return model, losses


def _check_specforge_batch(batch, ref: list[dict]) -> None:
    for b, s in enumerate(ref):
        T = s["input_ids"].shape[0]
        got = batch.tensors["input_ids"][b, 1:T]
        if not torch.equal(got.to(torch.int64), s["input_ids"][: T - 1]):
            raise AssertionError(f"SpecForge's batch row {b} is not the reference's sample")


@torch.no_grad()
def specforge_predict(model, sample: dict) -> list[torch.Tensor]:
    """Its OnlineEagle3Model.forward (TTT, sdpa) over one sample in NeMo's frame (which is its
    frame after TargetHead.preprocess), the draft's logits of every step captured."""
    T = sample["input_ids"].shape[0]
    vocab = model.draft_model.t2d.shape[0]
    with specforge_on_cpu(), _captured_logits(model.draft_model) as seen:
        model(input_ids=sample["input_ids"][None], attention_mask=torch.ones(1, T, dtype=torch.long),
              target=torch.zeros(1, T, vocab), loss_mask=torch.ones(1, T, 1, dtype=torch.long),
              hidden_states=sample["aux_hidden_states"][None].float())
    return [x[0].argmax(dim=-1) for x in seen]
