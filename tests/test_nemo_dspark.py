"""`extract --format nemo --draft-type dspark` read and trained on by NeMo AutoModel 0.7.0's own code, on CPU.

An 8-layer tiny Qwen3 target (NeMo registers its Qwen3 DSpark draft for Qwen3 targets). NeMo's
manifest reader, `CachedDSparkDataset` and its dataloader read the cache; the tensors equal NeMo's
own producer (`HFDSparkTargetModel.generate_batch` on the padded batch its ChatDataset makes) and
transformers' hidden states: id N - 1 is HF's last `hidden_states` entry, AFTER the final norm,
never the last layer's pre-norm output the capture holds; the shard and target_weights files hold
the header and tensor bytes NeMo's `write_shard` / `write_target_weights` write from the same
tensors (only each tensor's header keys are ordered differently). One
training step of NeMo's own draft class (`resolve_dspark_draft_spec`) and `DSparkTrainerModule`
(its loss) runs on the cache, with the draft built as its recipe builds it. Also: NeMo's layer
rule, `eagle-fast verify` (and a pre-norm writer it fails), the fp8 refusal, bf16 and a tied
target, and a crashed run that NeMo refuses until it resumes to the same bytes.
CPU limits: torch's FlexAttention has no backward on CPU ("FlexAttention does not support backward
on CPU"), so the step runs the draft's own SDPA mask branch (`create_dflash_sdpa_mask`); the
recipe's flex_attention backend gives the same loss here, checked in a no-grad forward, eagerly. NeMo's recipe module cannot be imported here (it needs
torchao), so its manifest check `_validate_cached_dspark_manifest` is run from its source.
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _pipeline import chat_lines, interrupted_after_first_shard, run_main, tree_digest, write_jsonl
from _trainers import extract_cli

from eagle_fast.draft_types import nemo_dspark_layers
from eagle_fast.inputs import load_tokenizer, plan_inputs
from eagle_fast.store.layouts import select_layers
from eagle_fast.store.nemo_dspark import NemoDSparkLayout

dspark_cache = pytest.importorskip("nemo_automodel.components.datasets.llm.dspark_cache",
                                   reason="nemo-automodel==0.7.0 is in requirements/cpu.lock")

N_LAYERS, K, MAX_LEN, V, H = 8, 3, 128, 1031, 64
IDS = [1, 4, 7]  # NeMo's rule for N = 8, K = 3; 7 = N - 1 is the final norm's output


def _spec(tied: bool):
    from eagle_fast.tiny import TinySpec

    return TinySpec(arch="qwen3", num_hidden_layers=N_LAYERS, hidden_size=H, head_dim=32, intermediate_size=160,
                    tie_word_embeddings=tied, seed=5)


@pytest.fixture(scope="module")
def target8(tiny_dir):
    """Untied 8-layer Qwen3, fp32."""
    from eagle_fast.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tiny_dir / "qwen3_8", _spec(tied=False))


@pytest.fixture(scope="module")
def cache(target8, tmp_path_factory):
    """(cache dir, plan) of `eagle-fast extract --format nemo --draft-type dspark --draft-layers 3`, fp32."""
    tmp = tmp_path_factory.mktemp("dspark")
    data = write_jsonl(tmp / "d.jsonl", chat_lines(5))  # 149, 59, 101, 119, 104 tokens: one cut, four padded
    out = tmp / "cache"
    extract_cli("--model", target8, "--data", data, "--out", out, "--dtype", "fp32", "--max-len", MAX_LEN,
                "--format", "nemo", "--draft-type", "dspark", "--draft-layers", K, "--shard-size", 2)
    plan = plan_inputs(data, load_tokenizer(str(target8)), V, max_len=MAX_LEN, overlong="truncate")
    return out, plan


def recipe_function(name: str):
    """A top-level function of NeMo's recipes/llm/train_dspark.py, compiled from its source (the module
    imports torchao, which is not installed)."""
    import nemo_automodel

    path = Path(nemo_automodel.__file__).parent / "recipes" / "llm" / "train_dspark.py"
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = {"torch": torch, "DTYPE_MAP": dspark_cache.DTYPE_MAP, "logger": logging.getLogger("train_dspark")}
    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), ns)  # noqa: S102 - NeMo's own code
    return ns[name]


def test_layer_rule_is_nemos():
    from nemo_automodel.components.speculative.dspark.registry import build_target_layer_ids

    for n in (2, 3, 5, 8, 28, 32, 36, 48, 61, 64):
        for k in (1, 2, 3, 4, 5, 7, 8, 12, 100):
            assert nemo_dspark_layers(n, k) == build_target_layer_ids(n, k), (n, k)
    assert nemo_dspark_layers(N_LAYERS, K) == IDS


def _hf_states(model, ids: list[int]):
    """(HF hidden_states, the last decoder layer's output before the final norm) for one sequence."""
    pre = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, i, o: pre.update(x=o[0] if isinstance(o, tuple)
                                                                                        else o))
    try:
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return hs, pre["x"]


def test_nemo_reads_the_cache_and_it_equals_nemos_producer(cache, target8):
    from nemo_automodel.components.datasets.llm.offline_cache import (
        ensure_supervision_options_match,
    )
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    out, plan = cache
    m = dspark_cache.read_manifest(str(out))  # NeMo's reader: format_version 1, complete
    ours = m["eagle_fast"]
    assert m["complete"] is True and m["format_version"] == 1
    assert m["target_layer_ids"] == IDS == ours["draft_types"][0]["draft_types"][0]["layer_ids"]
    assert {k: m[k] for k in ("target_model_type", "target_vocab_size", "hidden_size", "num_hidden_layers",
                              "seq_length", "dtype", "num_samples", "shard_size", "target_hidden_dim",
                              "target_last_hidden_dim")} == {
        "target_model_type": "qwen3", "target_vocab_size": V, "hidden_size": H, "num_hidden_layers": N_LAYERS,
        "seq_length": MAX_LEN, "dtype": "fp32", "num_samples": 5, "shard_size": 2, "target_hidden_dim": K * H,
        "target_last_hidden_dim": H}
    ensure_supervision_options_match(m, {"mask_reasoning_content": False, "mask_generation_prompt": False},
                                     cache_name="DSpark", cache_dir=str(out), producer_name="x")
    cfg = AutoConfig.from_pretrained(str(target8))
    recipe_function("_validate_cached_dspark_manifest")(
        str(out), m, cfg, IDS, target_model=str(target8), target_model_type=cfg.model_type, seq_length=MAX_LEN,
        compute_dtype=torch.float32)

    ds = dspark_cache.CachedDSparkDataset(str(out))
    assert len(ds) == len(plan.samples) == 5
    hf = AutoModelForCausalLM.from_pretrained(str(target8), dtype=torch.float32)
    # NeMo's producer: its target wrapper on the batch its ChatDataset pads (pad id, attention 0)
    pad = load_tokenizer(str(target8)).pad_token_id
    ids = torch.full((5, MAX_LEN), pad, dtype=torch.long)
    attention, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, s in enumerate(plan.samples):
        ids[b, : s.length], attention[b, : s.length] = torch.tensor(s.input_ids), 1
        loss[b, : s.length] = torch.tensor(s.loss_mask)
    ref = dspark_cache.compute_batch_cache(HFDSparkTargetModel(hf, target_layer_ids=IDS).generate_batch(
        input_ids=ids, attention_mask=attention, loss_mask=loss), torch.float32)
    assert min(s.length for s in plan.samples) < MAX_LEN == max(s.length for s in plan.samples)  # padded and cut
    for i, s in enumerate(plan.samples):
        item, T = ds[i], s.length
        assert tuple(item) == dspark_cache.CACHE_KEYS
        assert item["input_ids"].dtype == item["loss_mask"].dtype == torch.int64
        assert item["target_hidden_states"].dtype == item["target_last_hidden_states"].dtype == torch.float32
        assert item["target_hidden_states"].shape == (MAX_LEN, K * H)
        assert_ids_equal(item["input_ids"], ref["input_ids"][i], name=f"input_ids[{i}]")  # pads included
        assert_ids_equal(item["loss_mask"], ref["loss_mask"][i], name=f"loss_mask[{i}]")
        for key in ("target_hidden_states", "target_last_hidden_states"):
            assert_close(item[key][:T], ref[key][i, :T], atol=1e-5, rtol=1e-5, name=f"{key}[{i}] vs NeMo's")
            assert not item[key][T:].any()  # padding: zeros (NeMo runs the model on pad tokens)
        hs, pre = _hf_states(hf, s.input_ids)
        want = torch.cat([hs[j + 1] if j < N_LAYERS - 1 else hs[-1] for j in IDS], dim=-1)[0]
        assert_close(item["target_hidden_states"][:T], want, atol=1e-5, rtol=1e-5, name=f"vs HF [{i}]")
        assert_close(item["target_last_hidden_states"][:T], hs[-1][0], atol=1e-5, rtol=1e-5, name=f"last [{i}]")
        assert_close(hs[-1][0], hf.model.norm(pre)[0], atol=1e-6, rtol=1e-6, name="HF's last entry is post-norm")
        slot = item["target_hidden_states"][:T].view(T, K, H)[:, K - 1]
        assert (slot - pre[0]).abs().max() > 0.1, "id N - 1 holds the pre-norm output; NeMo reads it post-norm"
    batch = next(iter(dspark_cache.build_cached_dspark_dataloader(cache_dir=str(out), batch_size=2, shuffle=False)))
    assert batch["target_hidden_states"].shape == (2, MAX_LEN, K * H)

    # the files NeMo's own writers make from the same tensors: the same header and the same bytes after it
    with torch.no_grad():
        nemo_dir = out.parent / "nemo-written"
        for rec in ours["shards"]:
            shard = load_file(str(out / rec["files"][0]["path"]))
            path = dspark_cache.write_shard(str(nemo_dir), int(rec["index"]), shard)
            assert_same_file(out / rec["files"][0]["path"], Path(path))
        path = dspark_cache.write_target_weights(str(nemo_dir), hf.get_input_embeddings(), hf.get_output_embeddings(),
                                                 torch.float32)
    assert_same_file(out / "target_weights.safetensors", Path(path))


def assert_same_file(ours: Path, theirs: Path) -> None:
    """Two safetensors files alike but for the order of each tensor's header keys (ours sorted;
    safetensors' save_file: dtype, shape, data_offsets): the same header JSON, length and data bytes."""
    a, b = ours.read_bytes(), theirs.read_bytes()
    n = int.from_bytes(a[:8], "little")
    assert a[:8] == b[:8] and len(a) == len(b), f"{ours.name}: header length or size differs from NeMo's"
    assert json.loads(a[8: 8 + n]) == json.loads(b[8: 8 + n]), f"{ours.name}: header differs from NeMo's"
    assert a[8 + n:] == b[8 + n:], f"{ours.name}: tensor bytes differ from NeMo's"


def _draft(target, cache_dir: Path, attention_backend: str):
    """NeMo's DSpark draft for `target`, built as recipes/llm/train_dspark.py builds a Qwen3-style one
    (tiny: one layer, small Markov head), its embeddings and head from the cache's target_weights."""
    from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule
    from nemo_automodel.components.speculative.dspark.registry import resolve_dspark_draft_spec
    from transformers import AutoConfig, Qwen3Config

    target_config = AutoConfig.from_pretrained(str(target))
    draft_config = target_config.to_dict()
    draft_config.update(architectures=["Qwen3DSparkModel"], num_hidden_layers=1, layer_types=["full_attention"],
                        max_window_layers=1, num_target_layers=N_LAYERS, target_layer_ids=IDS, block_size=4,
                        num_anchors=8, mask_token_id=3, markov_rank=16, markov_head_type="vanilla",
                        enable_confidence_head=True, confidence_head_with_markov=True, tie_word_embeddings=False)
    config = Qwen3Config.from_dict(draft_config)
    config._attn_implementation = attention_backend
    torch.manual_seed(0)
    draft = resolve_dspark_draft_spec(target_config.architectures).draft_cls(config)
    embed, head = dspark_cache.read_target_weight_modules(str(cache_dir))
    draft.initialize_embeddings_and_head(embed_tokens=embed, lm_head=head, freeze=True)
    return draft, DSparkTrainerModule(draft, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0)


def test_nemo_dspark_trains_a_step_on_the_cache(cache, target8):
    out, _ = cache
    batch = next(iter(dspark_cache.build_cached_dspark_dataloader(cache_dir=str(out), batch_size=2, shuffle=False)))

    def forward(module):  # the recipe's _forward_batch on a cached batch
        torch.manual_seed(11)  # the anchors it samples
        return module(input_ids=batch["input_ids"], target_hidden_states=batch["target_hidden_states"].float(),
                      loss_mask=batch["loss_mask"], target_last_hidden_states=batch["target_last_hidden_states"].float())

    draft, trainer = _draft(target8, out, "sdpa")
    step = forward(trainer)
    assert torch.isfinite(step.loss) and step.loss > 0 and step.ce_loss > 0 and step.l1_loss > 0
    step.loss.backward()
    grads = {n: p.grad for n, p in draft.named_parameters() if p.requires_grad}
    for part in ("fc.", "layers.0.self_attn.q_proj.", "markov_head.", "confidence_head."):
        assert any(n.startswith(part) and g is not None and bool(g.abs().sum() > 0) for n, g in grads.items()), part
    assert draft.embed_tokens.weight.grad is None and draft.lm_head.weight.grad is None  # frozen, as the recipe has them
    # the recipe's backend: FlexAttention (no backward on CPU) gives the same loss, run eagerly (torch's
    # reference; transformers' torch.compile of it takes over a minute on this CPU)
    # (torch's own patch: monkeypatch's undo deletes the entry, which hides it from every later test)
    with torch._dynamo.config.patch(disable=True):
        flex_draft, flex = _draft(target8, out, "flex_attention")
        assert flex_draft.config._attn_implementation == "flex_attention"
        with torch.no_grad():
            assert_close(forward(flex).loss, step.loss.detach(), atol=1e-5, rtol=1e-5, name="flex vs sdpa loss")


def test_verify_passes_and_fails_a_prenorm_writer(cache, target8, tmp_path, capsys, monkeypatch):
    out, _ = cache
    code, stdout, _ = run_main(capsys, "verify", out, "--samples", "5")
    assert code == 0 and "verify: PASS" in stdout and "target_hidden_states" in stdout

    real = NemoDSparkLayout.encode

    def prenorm(self, sample, result):  # a writer that stores the capture's id N - 1 (before the norm)
        enc = real(self, sample, result)
        T, pre = sample.length, select_layers(result["aux_hidden_states"], self.spec.capture_ids, [N_LAYERS - 1], H)
        enc["target_hidden_states"].view(MAX_LEN, K, H)[:T, K - 1] = pre.to(enc["target_hidden_states"].dtype)
        return enc

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    monkeypatch.setattr(NemoDSparkLayout, "encode", prenorm)
    extract_cli("--model", target8, "--data", data, "--out", tmp_path / "bad", "--dtype", "fp32", "--max-len", MAX_LEN,
                "--format", "nemo", "--draft-type", "dspark", "--draft-layers", K)
    monkeypatch.setattr(NemoDSparkLayout, "encode", real)
    capsys.readouterr()  # extract's summary
    code, stdout, _ = run_main(capsys, "verify", tmp_path / "bad", "--samples", "2")
    assert code != 0 and "FAIL" in stdout
    assert next(line for line in stdout.splitlines() if line.strip().startswith("target_hidden_states")).endswith("FAIL")


def test_one_capture_writes_it_beside_eagle3s_cache(cache, target8, tmp_path):
    """--draft-type dspark,eagle3: NeMo's two caches, one subdirectory each, from one capture (layers
    1, 3, 4, 7); the DSpark one byte for byte the cache extracted alone."""
    from nemo_automodel.components.datasets.llm.eagle3_cache import CachedEagle3Dataset

    out, _ = cache
    extract_cli("--model", target8, "--data", out.parent / "d.jsonl", "--out", tmp_path / "both", "--dtype", "fp32",
                "--max-len", MAX_LEN, "--format", "nemo", "--draft-type", "dspark,eagle3", "--draft-layers", K,
                "--shard-size", 2)
    m = dspark_cache.read_manifest(str(tmp_path / "both" / "nemo-dspark"))
    assert m["target_layer_ids"] == IDS and m["eagle_fast"]["capture"]["layer_ids"] == [1, 3, 4, 7]
    assert len(dspark_cache.CachedDSparkDataset(str(tmp_path / "both" / "nemo-dspark"))) == 5
    assert len(CachedEagle3Dataset(str(tmp_path / "both" / "nemo-eagle3"))) == 5
    assert tree_digest(tmp_path / "both" / "nemo-dspark", skip_manifest=True) == tree_digest(out, skip_manifest=True)


def test_fp8_is_refused_naming_nemo(tmp_path, target8, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    code, _, err = run_main(capsys, "extract", "--model", target8, "--data", data, "--out", tmp_path / "o",
                            "--engine", "hf", "--format", "nemo", "--draft-type", "dspark", "--aux-dtype", "fp8")
    assert code == 2 and "--format nemo cannot store --aux-dtype fp8" in err and "CachedDSparkDataset" in err
    assert not (tmp_path / "o").exists()


def test_bf16_tied_target_and_a_crashed_run(tmp_path, tiny_dir):
    """bf16 on a tied target (target_weights: the embedding under both keys); a run killed after its
    first shard leaves a cache NeMo refuses, and resumes to the bytes of an uninterrupted run."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle_fast import ExtractConfig, extract
    from eagle_fast.tiny import build_tiny_checkpoint

    tied = build_tiny_checkpoint(tiny_dir / "qwen3_8_tied", _spec(tied=True))
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(5))

    def cfg(out):
        return ExtractConfig(model=str(tied), data=str(data), out=str(out), engine="hf", dtype="bf16", max_len=64,
                             shard_size=2, layout="nemo", draft_types="dspark", draft_layers=K, progress_tty=False)

    extract(cfg(tmp_path / "ref"))

    m = interrupted_after_first_shard(cfg(tmp_path / "run"))
    assert m["complete"] is False and not m["eagle_fast"]["complete"]
    with pytest.raises(ValueError, match="marked incomplete"):  # what NeMo's recipe reads first
        dspark_cache.read_manifest(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="declares 5 samples"):  # its dataset counts the shards before the flag
        dspark_cache.CachedDSparkDataset(str(tmp_path / "run"))
    again = extract(cfg(tmp_path / "run"))
    assert again.complete and again.run_samples < again.samples
    assert tree_digest(tmp_path / "run", skip_manifest=True) == tree_digest(tmp_path / "ref", skip_manifest=True)

    m = dspark_cache.read_manifest(str(tmp_path / "run"))
    assert m["dtype"] == "bf16" and m["seq_length"] == 64
    with pytest.raises(ValueError, match="CPU cached training requires fp32"):  # NeMo's own rule, on CPU
        recipe_function("_validate_cached_dspark_manifest")(
            str(tmp_path / "run"), m, AutoModelForCausalLM.from_pretrained(str(tied)).config, IDS,
            target_model=str(tied), target_model_type="qwen3", seq_length=64, compute_dtype=torch.float32)
    weights = load_file(str(tmp_path / "run" / "target_weights.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.bfloat16)
    assert weights["embed_tokens.weight"].dtype == weights["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["embed_tokens.weight"], hf.get_input_embeddings().weight)
    assert torch.equal(weights["lm_head.weight"], hf.get_output_embeddings().weight)
    ds = dspark_cache.CachedDSparkDataset(str(tmp_path / "run"))
    item = ds[1]
    T = int(m["eagle_fast"]["shards"][0]["lengths"][1])
    with torch.no_grad():
        hs = hf(item["input_ids"][None, :T], output_hidden_states=True).hidden_states
    assert item["target_last_hidden_states"].dtype == torch.bfloat16
    assert_close(item["target_last_hidden_states"][:T], hs[-1][0], atol=2e-2, rtol=2e-2, name="bf16 post-norm")
    assert_close(item["target_hidden_states"][:T].view(T, K, H)[:, 0], hs[2][0], atol=2e-2, rtol=2e-2, name="layer 1")
