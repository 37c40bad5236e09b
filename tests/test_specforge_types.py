"""One `extract --format specforge` capture for EAGLE-3, DFlash, Domino and DSpark, read and trained
on by SpecForge 0.2.0's own code, on CPU.

An 8-layer target and `--draft-type eagle3,dflash,domino,dspark --draft-layers 3` give one file per
sample holding every type's keys. For each type SpecForge's algorithm registry gives the offline
reader, normaliser and collator (its FeatureDataLoader loads the record), its own assembly
(`build_model_bundle`: draft config, draft model, the frozen target embeddings / LM head, the
training wrapper) and its step strategy, which runs one step. Also: eagle_fast's rules against
SpecForge's (layer ids, keys, final state, refusals), the stored states against HF's own, with an
off-by-one layer and the pre-norm state as negative controls, and a crashed run resumed to the same
bytes.
SpecForge's CPU limits, in the test only: sdpa attention (its default flex_attention compiles);
EAGLE-3's Triton loss swapped for its reference loss, torch.compile off, and its TargetHead cast to
fp32 again (`TargetHead.from_pretrained` casts to bf16 whatever model.torch_dtype says).
"""

from __future__ import annotations

import importlib
import json
import zipfile
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from _assert import assert_close
from _pipeline import chat_lines, resumes_to_the_same_bytes, run_main, write_jsonl
from _trainers import DRAFT_SIZE, V, draft_vocab, extract_cli

from eagle_fast.checkpoint import indexed_view
from eagle_fast.draft_types import READERS, REFUSED, default_layers, dflash_layers
from eagle_fast.inputs import load_tokenizer, plan_inputs
from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

pytest.importorskip("specforge", reason="specforge==0.2.0 is in requirements/cpu.lock")

N_LAYERS = 8
K = 3            # --draft-layers: distinct ids at N = 8 ([1, 3, 5]), apart from EAGLE-3's [1, 3, 4]
MAX_LEN = 48
H = 128
TYPES = ("eagle3", "dflash", "domino", "dspark")
DFLASH_FAMILY = ("dflash", "domino", "dspark")
TOL = {"atol": 1e-5, "rtol": 1e-5}
MASK_ID = V - 1  # an id the tokenizer never emits (its BPE has 600)
# Draft configs as a SpecForge user writes them, naming no target_layer_ids: SpecForge picks its own
# default. DFlash's is generated from the target (its TargetDerivedDraftDefaults); the others need one.
_SHAPE = {"hidden_size": H, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "intermediate_size": 256, "vocab_size": V, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}
_QWEN3_DRAFT = {**_SHAPE, "model_type": "qwen3", "num_hidden_layers": K, "num_target_layers": N_LAYERS,
                "block_size": 4, "layer_types": ["full_attention"] * K}
DRAFT_CONFIGS = {
    "eagle3": {**_SHAPE, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
               "draft_vocab_size": DRAFT_SIZE},
    "domino": {**_QWEN3_DRAFT, "architectures": ["DominoDraftModel"],
               "dflash_config": {"emb_dim": 32, "gru_hidden_dim": 32}},
    "dspark": {**_QWEN3_DRAFT, "architectures": ["DSparkDraftModel"],  # its Markov and confidence heads on
               "dflash_config": {"markov_rank": 8, "confidence_head_alpha": 1.0}},
}


@pytest.fixture(scope="module")
def target8(tiny_dir):
    """Untied Qwen3, 8 layers (untied: SpecForge's loaders read lm_head.weight by default)."""
    spec = TinySpec(arch="qwen3", num_hidden_layers=N_LAYERS, tie_word_embeddings=False, seed=8)
    return build_tiny_checkpoint(tiny_dir / "qwen3_8_layers", spec)


@pytest.fixture(scope="module")
def sf(target8, tmp_path_factory):
    """The fp32 dataset of every SpecForge type, its plan and manifest."""
    tmp = tmp_path_factory.mktemp("sf_types")
    data = write_jsonl(tmp / "d.jsonl", chat_lines(4))
    draft_vocab(tmp / "vocab.safetensors")
    out = tmp / "sf"
    extract_cli("--model", target8, "--data", data, "--out", out, "--dtype", "fp32", "--max-len", MAX_LEN,
                "--format", "specforge", "--draft-type", ",".join(TYPES), "--draft-layers", K,
                "--draft-vocab", tmp / "vocab.safetensors", "--shard-size", 2)
    plan = plan_inputs(data, load_tokenizer(str(target8)), V, max_len=MAX_LEN, overlong="truncate")
    manifest = json.loads((out / "manifest.json").read_text())
    # SpecForge's TargetHead reads a checkpoint only through its *.index.json
    return SimpleNamespace(out=out, plan=plan, manifest=manifest, target=indexed_view(target8, tmp / "target"))


@pytest.fixture(scope="module")
def hf_ref(target8, sf):
    """sample index -> HF's hidden_states (last entry after the final norm), the state before the
    final norm (the norm's input) and the logits, fp32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target8), dtype=torch.float32)
    pre_norm = {}
    hf.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.update(x=args[0]))
    out = {}
    with torch.no_grad():
        for s in sf.plan.samples:
            r = hf(torch.tensor([s.input_ids]), output_hidden_states=True)
            out[s.index] = SimpleNamespace(states=r.hidden_states, pre_norm=pre_norm["x"], logits=r.logits)
    return out


def _record(sf, index):
    return torch.load(str(sf.out / "rows_0-2000" / f"data_{index}.ckpt"), weights_only=True, mmap=True)


def _registry():
    from specforge.algorithms.builtin import builtin_algorithm_registry

    return builtin_algorithm_registry()


def _layers_of(manifest, draft_type):
    return next(t["layer_ids"] for t in manifest["layout_spec"]["types"] if t["draft_type"] == draft_type)


def test_readers_and_refusals_are_specforges():
    registry = _registry()
    offline = {name for name in registry.names if registry.resolve(name).providers.offline}
    assert {t for (fmt, t) in READERS if fmt == "specforge"} == offline == set(TYPES)
    assert registry.resolve("peagle").providers.offline == ()  # streaming only, as REFUSED says
    assert "streaming" in REFUSED[("specforge", "peagle")]
    for t in TYPES:
        reader = READERS[("specforge", t)]
        provider = registry.resolve(t).providers.offline_for("text")
        module, name = reader.reader.rsplit(".", 1)
        build = provider.build_reader
        assert getattr(importlib.import_module(module), name) is (build.func if isinstance(build, partial) else build)
        # the final state SpecForge's own capture stores for the type (its LogitsProcessor input: post-norm)
        stores_final = provider.capture_layout.last_hidden_feature is not None
        assert reader.final == ("post" if stores_final else "none"), t
        assert reader.rule == ("eagle3" if t == "eagle3" else "dflash"), t


@pytest.mark.parametrize("num_layers,draft_layers",
                         [(8, 1), (8, 2), (8, 3), (8, 5), (28, 5), (32, 4), (36, 5), (40, 6), (61, 7), (64, 5)])
def test_dflash_family_layers_are_specforges(num_layers, draft_layers):
    from specforge.modeling.draft.dflash import DFlashDraftModel, build_target_layer_ids
    from specforge.modeling.draft.domino import DominoDraftModel
    from specforge.modeling.draft.dspark import DSparkDraftModel
    from transformers import Qwen3Config

    theirs = build_target_layer_ids(num_layers, draft_layers)
    assert dflash_layers(num_layers, draft_layers) == theirs
    # each draft class's own default (DSpark and Domino inherit DFlash's __init__), K = its layer count
    for cls, extra in ((DFlashDraftModel, {}), (DominoDraftModel, {"emb_dim": 8, "gru_hidden_dim": 8}),
                       (DSparkDraftModel, {})):
        config = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             intermediate_size=32, vocab_size=64, num_hidden_layers=draft_layers,
                             num_target_layers=num_layers, block_size=4, dflash_config=dict(extra),
                             layer_types=["full_attention"] * draft_layers)
        draft = cls(config)
        assert list(draft.target_layer_ids) == theirs, cls.__name__
        t = cls.__name__.removesuffix("DraftModel").lower()
        assert default_layers(READERS[("specforge", t)], num_layers, draft_layers) == theirs


def test_one_record_holds_every_types_keys(sf):
    from specforge.algorithms.model_providers import resolve_eagle_capture_layers
    from specforge.modeling.draft.dflash import build_target_layer_ids

    registry = _registry()
    assert not [p for p in sf.out.iterdir() if p.is_dir() and p.name != "rows_0-2000"]  # one dataset, in --out
    files = sorted((sf.out / "rows_0-2000").glob("*.ckpt"))
    assert [f.name for f in files] == sorted(f"data_{s.index}.ckpt" for s in sf.plan.samples)
    cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    eagle_ids = resolve_eagle_capture_layers(cfg, {}, SimpleNamespace(num_hidden_layers=N_LAYERS))
    assert _layers_of(sf.manifest, "eagle3") == eagle_ids == [1, 3, 4]
    for t in DFLASH_FAMILY:
        assert _layers_of(sf.manifest, t) == build_target_layer_ids(N_LAYERS, K) == [1, 3, 5]
    # the keys SpecForge's own capture writes for each type, and those its readers load
    written = {k for t in TYPES for k in registry.resolve(t).providers.offline_for("text").capture_layout.output_names}
    for s in sf.plan.samples:
        d = _record(sf, s.index)
        assert set(d) == written
        for t in TYPES:
            reader = registry.resolve(t).providers.offline_for("text").build_reader(
                str(sf.out), run_id="t", ttt_length=1, max_len=MAX_LEN)
            assert set(reader.feature_keys) <= set(d), t
        T = s.length
        assert d["input_ids"].tolist() == s.input_ids and d["loss_mask"].tolist() == s.loss_mask
        assert d["aux_hidden_state"].shape == d["hidden_states"].shape == (1, T, K * H)
        assert d["hidden_state"].shape == (1, T, H) and d["hidden_state"].dtype == torch.float32
        # the final state, post-norm for EAGLE-3 and DSpark alike, is stored once
        final = d["hidden_state"].untyped_storage()
        assert d["target_last_hidden_states"].untyped_storage().data_ptr() == final.data_ptr()
        with zipfile.ZipFile(sf.out / "rows_0-2000" / f"data_{s.index}.ckpt") as z:
            storages = [n for n in z.namelist() if "/data/" in n and not n.endswith("serialization_id")]
        assert len(storages) == len(d) - 1


def test_states_are_hfs_layers_and_final_norm_output(sf, hf_ref):
    from specforge.modeling.draft.dflash import extract_context_feature

    for s in sf.plan.samples:
        d, ref = _record(sf, s.index), hf_ref[s.index]
        for key, t in (("aux_hidden_state", "eagle3"), ("hidden_states", "dflash")):
            ids = _layers_of(sf.manifest, t)
            blocks = d[key].reshape(1, s.length, len(ids), H)
            for j, i in enumerate(ids):  # layer id i = HF hidden_states[i + 1]
                assert_close(blocks[:, :, j], ref.states[i + 1], **TOL, name=f"{key} layer {i}")
                for wrong in (i, i + 2):  # an off-by-one id fails the same check
                    with pytest.raises(AssertionError):
                        assert_close(blocks[:, :, j], ref.states[wrong], **TOL, name="off by one")
        # SpecForge's own gather (spec_generate's) over HF's states with its draft's layers
        want = extract_context_feature(ref.states, _layers_of(sf.manifest, "dspark"))
        assert_close(d["hidden_states"], want, **TOL, name="hidden_states vs extract_context_feature")
        for key in ("hidden_state", "target_last_hidden_states"):
            assert_close(d[key], ref.states[-1], **TOL, name=f"{key} (HF's last entry, after the norm)")
            with pytest.raises(AssertionError):  # the last layer's output before the norm fails it
                assert_close(d[key], ref.pre_norm, **TOL, name=f"{key} vs pre-norm")


def _specforge_run(sf, name, tmp_path):
    """SpecForge's own pieces for `name` on the dataset: (registration, bundle, loader, strategy)."""
    from specforge.config.schema import Config, DataConfig, ModelConfig, TrainingConfig
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.assembly import build_model_bundle

    model = {"target_model_path": str(sf.target), "torch_dtype": "float32", "mask_token_id": MASK_ID}
    if name in DRAFT_CONFIGS:
        (tmp_path / "draft.json").write_text(json.dumps(DRAFT_CONFIGS[name]))
        model["draft_model_config"] = str(tmp_path / "draft.json")
    else:  # DFlash: the draft config SpecForge generates from the target, --draft-layers' K layers
        model.update(draft_num_hidden_layers=K, draft_block_size=4)
    if name == "eagle3":
        model["vocab_mapping_path"] = str(sf.out / "vocab_mapping.pt")
    ttt = 3 if name == "eagle3" else 1
    cfg = Config(model=ModelConfig(**model), data=DataConfig(hidden_states_path=str(sf.out), max_length=MAX_LEN),
                 training=TrainingConfig(strategy=name, attention_backend="sdpa", batch_size=2, ttt_length=ttt))
    algorithm = _registry().resolve(name)
    torch.manual_seed(0)
    bundle = build_model_bundle(cfg, algorithm=algorithm)
    if bundle.target_head is not None:  # EAGLE-3's: from_pretrained left it in bf16; fp32, as the data
        bundle.target_head.float().load_weights(str(sf.target))
    offline = algorithm.providers.offline_for("text")
    refs = offline.build_reader(str(sf.out), run_id=name, ttt_length=ttt, max_len=MAX_LEN).read()
    loader = FeatureDataLoader(LocalFeatureStore(name), refs=refs, batch_size=2, collate_fn=offline.build_collator(),
                               per_sample_transform=offline.build_normalizer(MAX_LEN, ttt_length=ttt),
                               drop_last=False, strategy=name)
    strategy = algorithm.providers.step.build(bundle.model, target_head=bundle.target_head,
                                              **dict(bundle.strategy_kwargs.options))
    return bundle, loader, strategy


@pytest.mark.parametrize("name", TYPES)
def test_specforge_reads_and_trains_one_step(sf, hf_ref, name, tmp_path, monkeypatch):
    dynamo = torch._dynamo.config.patch(disable=name == "eagle3")  # EAGLE-3's target step is compiled
    if name == "eagle3":  # and its KL loss a Triton kernel (torch's patch: monkeypatch's undo would hide the entry)
        import specforge.algorithms.eagle3.model as eagle3_model
        from specforge.core.loss import _compute_loss

        monkeypatch.setattr(eagle3_model, "LogSoftmaxLoss", SimpleNamespace(apply=_compute_loss))
    bundle, loader, strategy = _specforge_run(sf, name, tmp_path)
    batches = list(loader)
    assert sum(b.tensors["input_ids"].shape[0] for b in batches) == len(sf.plan.samples)
    draft = bundle.draft_model
    if name != "eagle3":
        assert list(draft.target_layer_ids) == _layers_of(sf.manifest, name)  # its default, our record's
        assert draft.fc.in_features == batches[0].tensors["hidden_states"].shape[-1]
    # the teacher it builds from the stored final state: its frozen LM head alone gives HF's logits
    head = bundle.target_head if name == "eagle3" else bundle.model.lm_head
    final_key = {"eagle3": "target", "dspark": "target_last_hidden_states"}.get(name)
    batch = batches[0]
    for b, ids in enumerate(batch.tensors["input_ids"] if final_key else ()):
        sample = next(x for x in sf.plan.samples if ids[: x.length].tolist() == x.input_ids)
        with torch.no_grad():
            got = head(batch.tensors[final_key][b : b + 1, : sample.length])
        assert_close(got, hf_ref[sample.index].logits, atol=1e-4, rtol=1e-4, name=f"{name} teacher logits")
        with pytest.raises(AssertionError):  # from the state before the norm it would not
            assert_close(head(hf_ref[sample.index].pre_norm), hf_ref[sample.index].logits, atol=1e-4, rtol=1e-4,
                         name="pre-norm teacher")
    torch.manual_seed(0)
    with dynamo:
        step = strategy.forward_loss(batch)
        loss = float(step.loss.detach())
        assert torch.isfinite(step.loss) and loss > 0, loss
        draft.zero_grad()
        step.loss.backward()
    trainable = {n: p for n, p in draft.named_parameters() if p.requires_grad}
    no_grad = [n for n, p in trainable.items() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert trainable and not no_grad, f"{name}: no gradient reaches {no_grad}"
    assert not any(p.requires_grad for p in head.parameters())  # the target's pieces stay frozen
    if name == "dspark":  # the teacher-fed terms ran (lm_head(target_last_hidden_states): TV / L1, confidence)
        assert "teacher_agreement" in step.ratio_metrics and "l1_loss" in step.ratio_metrics
        l1, den = step.ratio_metrics["l1_loss"]
        assert float(l1) > 0 and float(den) > 0


def test_refusals_name_specforge_and_write_nothing(tmp_path, target8, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    base = ("extract", "--model", target8, "--data", data, "--engine", "hf", "--format", "specforge")
    code, _, err = run_main(capsys, *base, "--out", tmp_path / "fp8", "--draft-type", ",".join(TYPES),
                            "--aux-dtype", "fp8")
    assert code != 0 and "SpecForge" in err and "fp8" in err
    assert not (tmp_path / "fp8").exists()
    for types in ("peagle", "eagle3,dflash,peagle"):
        out = tmp_path / types.replace(",", "_")
        code, _, err = run_main(capsys, *base, "--out", out, "--draft-type", types)
        assert code != 0 and REFUSED[("specforge", "peagle")] in err, err
        assert not out.exists()


def test_crashed_multi_type_run_resumes_to_the_same_bytes(tmp_path, target8):
    from eagle_fast import ExtractConfig

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(5))

    def cfg(out):
        return ExtractConfig(model=str(target8), data=str(data), out=str(out), engine="hf", dtype="bf16",
                             max_len=32, shard_size=2, layout="specforge", draft_types=TYPES, draft_layers=K,
                             progress_tty=False)

    run = resumes_to_the_same_bytes(cfg, tmp_path)
    d = torch.load(str(run / "rows_0-2000" / "data_0.ckpt"), weights_only=True, mmap=True)
    assert {"aux_hidden_state", "hidden_states", "target_last_hidden_states"} <= set(d)
    assert d["hidden_states"].dtype == d["target_last_hidden_states"].dtype == torch.bfloat16
