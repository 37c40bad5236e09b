"""On-disk layouts other tools read: NeMo AutoModel's EAGLE-3 offline cache, read by
NeMo's own `CachedEagle3Dataset` and checked field by field against NeMo's own producer path;
vLLM speculators' `hs_{i}.safetensors`; SpecForge's per-sample .ckpt files split across nodes and
merged; and the streaming safetensors writer under them. (The trainers' own readers and training
steps read them in test_speculators_train.py and test_specforge.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _pipeline import chat_lines, write_jsonl
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle_fast import ExtractConfig, extract
from eagle_fast.files import read_safetensors_header
from eagle_fast.inputs import load_tokenizer, plan_inputs
from eagle_fast.store.safetensors import SafetensorsWriter, write_safetensors
from eagle_fast.vocab import DraftVocab, save_draft_vocab

MAX_LEN = 64
AUX = [0, 1, 3]


# ------------------------------------------------------------------ safetensors writer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.bool])
def test_writer_rows_in_any_order_equal_safetensors_save(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(37, 5, generator=g) * 10).to(dtype)
    b = torch.randint(0, 1000, (11,), generator=g)
    w = SafetensorsWriter(tmp_path / "x.safetensors", {"a": (dtype, (37, 5)), "b": (torch.int64, (11,)),
                                                       "empty": (torch.float32, (0, 3))}, {"k": "v"})
    for start in (20, 0, 33, 7):  # out of order, uneven blocks
        stop = {20: 33, 0: 7, 33: 37, 7: 20}[start]
        w.write("a", start, a[start:stop])
    w.write("b", 0, b)
    assert not (tmp_path / "x.safetensors").exists()  # nothing under the final name before commit
    w.commit()
    got = load_file(str(tmp_path / "x.safetensors"))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and got["empty"].shape == (0, 3)
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as h:
        assert h.metadata() == {"k": "v"}
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert (8 + len(read_safetensors_header(tmp_path / "x.safetensors")[1])) % 8 == 0  # aligned like safetensors
    save_file({"a": a, "b": b}, str(tmp_path / "ref.safetensors"))
    assert torch.equal(load_file(str(tmp_path / "ref.safetensors"))["a"], got["a"])
    # same content -> same bytes
    write_safetensors(tmp_path / "y.safetensors", {"b": b, "a": a, "empty": torch.zeros(0, 3)}, {"k": "v"})
    assert (tmp_path / "y.safetensors").read_bytes() == raw


def test_writer_abort_leaves_nothing(tmp_path):
    w = SafetensorsWriter(tmp_path / "x.safetensors", {"a": (torch.float32, (4,))})
    w.write("a", 0, torch.ones(2))
    w.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="outside"):
        SafetensorsWriter(tmp_path / "y.safetensors", {"a": (torch.float32, (4,))}).write("a", 3, torch.ones(2))


# ---------------------------------------------------------------------------------- nemo


@pytest.fixture(scope="module")
def nemo_setup(tmp_path_factory, tiny_llama):
    pytest.importorskip("nemo_automodel")
    root = tmp_path_factory.mktemp("nemo")
    data = write_jsonl(root / "d.jsonl", chat_lines(9) + [json.dumps({"input_ids": list(range(5, 5 + MAX_LEN))})])
    ids = torch.arange(0, 1031, 3)  # a 344-token draft vocabulary
    vocab = save_draft_vocab(root / "v.pt", DraftVocab(ids, 1031))
    return root, data, vocab, ids


def _nemo_expected(model, data, draft_ids, topk=0):
    """NeMo AutoModel's own producer path: HFEagle3TargetModel.generate_batch on a right-padded
    batch (pad_token_id, as its ChatDataset pads), then precompute_eagle3._compute_batch_cache's
    steps (`_compute_target_distribution`, `compress_target_probs`) verbatim."""
    from nemo_automodel.components.datasets.llm.eagle3_cache import compress_target_probs
    from nemo_automodel.components.speculative.eagle.core import _compute_target_distribution
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(model))
    plan = plan_inputs(data, tok, 1031, max_len=MAX_LEN, overlong="truncate")
    B = len(plan.samples)
    input_ids = torch.full((B, MAX_LEN), tok.pad_token_id, dtype=torch.long)
    attention = torch.zeros(B, MAX_LEN, dtype=torch.long)
    loss = torch.zeros(B, MAX_LEN, dtype=torch.long)
    for b, s in enumerate(plan.samples):
        input_ids[b, : s.length] = torch.tensor(s.input_ids)
        attention[b, : s.length] = 1
        loss[b, : s.length] = torch.tensor(s.loss_mask)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    target = HFEagle3TargetModel(hf, aux_layer_ids=AUX)
    with torch.no_grad():
        batch = target.generate_batch(input_ids=input_ids, attention_mask=attention, loss_mask=loss)
    mask = torch.zeros(1031, dtype=torch.bool)
    mask[draft_ids] = True
    probs, position_mask = _compute_target_distribution(
        target_logits=batch.logits, selected_token_ids=draft_ids, selected_token_mask=mask,
        loss_mask=batch.loss_mask)
    expected = {
        "input_ids": batch.input_ids.long(), "attention_mask": batch.attention_mask.long(),
        "loss_mask": batch.loss_mask.long(), "aux_hidden_states": batch.aux_hidden_states.float(),
        "position_mask": position_mask.bool(),
    }
    if topk:
        values, indices = compress_target_probs(probs, topk)
        expected["target_probs_values"], expected["target_probs_indices"] = values, indices
    expected["target_probs"] = probs
    return plan, expected, hf


@pytest.mark.parametrize("topk", [0, 16])
def test_nemo_cache_read_by_nemo_matches_nemo_producer(nemo_setup, tiny_llama, topk):
    from nemo_automodel.components.datasets.llm.eagle3_cache import (
        CachedEagle3Dataset,
        build_cached_eagle3_dataloader,
        read_manifest,
        read_target_embeddings,
        reconstruct_target_probs,
    )
    from nemo_automodel.components.datasets.llm.offline_cache import (
        ensure_supervision_options_match,
    )

    root, data, vocab, draft_ids = nemo_setup
    out = root / f"out-{topk}"
    extract(ExtractConfig(model=str(tiny_llama), data=str(data), out=str(out), engine="hf", dtype="fp32",
                          max_len=MAX_LEN, shard_size=4, layout="nemo", supervision="topk" if topk else "draft",
                          k=topk or 64, draft_vocab=str(vocab), aux_layers="0,1,3", progress_tty=False))
    plan, exp, hf = _nemo_expected(tiny_llama, data, draft_ids, topk)

    m = read_manifest(str(out))  # NeMo's reader: format_version 2 and its fields
    assert m["draft_vocab_size"] == len(draft_ids) and m["selected_token_ids"] == draft_ids.tolist()
    assert m["target_vocab_size"] == 1031 and m["aux_hidden_dim"] == 3 * 128 and m["seq_length"] == MAX_LEN
    assert m["aux_layer_ids"] == AUX and m["num_samples"] == len(plan.samples) and m["shard_size"] == 4
    assert m["target_probs_topk"] == topk and m["dtype"] == "fp32"
    ensure_supervision_options_match(m, {"mask_reasoning_content": False, "mask_generation_prompt": False},
                                     cache_name="EAGLE-3", cache_dir=str(out), producer_name="x")
    assert_close(read_target_embeddings(str(out)), hf.get_input_embeddings().weight, atol=0, rtol=0,
                 name="target_embeddings")

    ds = CachedEagle3Dataset(str(out))
    assert len(ds) == len(plan.samples)
    keys = {"input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask", "target_probs"}
    for i, s in enumerate(plan.samples):
        item = ds[i]
        assert set(item) == keys
        L = s.length
        for name in ("input_ids", "attention_mask", "loss_mask", "position_mask"):
            assert item[name].dtype == exp[name].dtype, name
            assert_ids_equal(item[name], exp[name][i], name=f"{name}[{i}]")
        assert item["aux_hidden_states"].dtype == torch.float32
        assert_close(item["aux_hidden_states"][:L], exp["aux_hidden_states"][i, :L], atol=1e-5, rtol=1e-5,
                     name=f"aux[{i}]")
        assert not item["aux_hidden_states"][L:].any()  # padding: zeros (NeMo runs the model on pads)
        if topk:
            # what NeMo's reader reconstructs from NeMo's own compression of the same distribution
            want = reconstruct_target_probs(exp["target_probs_values"][i], exp["target_probs_indices"][i],
                                            len(draft_ids))
        else:
            want = exp["target_probs"][i]
        assert item["target_probs"].shape == (MAX_LEN, len(draft_ids))
        assert_close(item["target_probs"][: L - 1], want[: L - 1], atol=1e-6, rtol=1e-4, name=f"target_probs[{i}]")
        tail = item["target_probs"][L - 1:]
        if not topk:
            assert_close(tail, torch.full_like(tail, 1 / len(draft_ids)), atol=0, rtol=1e-6, name="tail")
    with safe_open(str(out / "shard-000000.safetensors"), framework="pt") as h:
        stored = set(h.keys())
    want_keys = keys - {"target_probs"} | ({"target_probs_values", "target_probs_indices"} if topk else
                                           {"target_probs"})
    assert stored == want_keys
    batch = next(iter(build_cached_eagle3_dataloader(cache_dir=str(out), batch_size=3, shuffle=False)))
    assert batch["aux_hidden_states"].shape == (3, MAX_LEN, 384)


# --------------------------------------------------------------------------- speculators


def test_speculators_layout(tmp_path, tiny_llama):
    from eagle_fast.runners.hf import HFTargetRunner

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(7))
    out = tmp_path / "out"
    extract(ExtractConfig(model=str(tiny_llama), data=str(data), out=str(out), engine="hf", dtype="fp32",
                          max_len=MAX_LEN, shard_size=3, layout="speculators", aux_layers="3,0,1",
                          progress_tty=False))
    tok = load_tokenizer(str(tiny_llama))
    plan = plan_inputs(data, tok, 1031, max_len=MAX_LEN, overlong="truncate")
    files = sorted(p.name for p in (out / "hidden_states").iterdir())
    assert files == sorted(f"hs_{i}.safetensors" for i in range(len(plan.samples)))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with HFTargetRunner.build(str(tiny_llama), dtype=torch.float32) as runner:
        runner.set_aux_layers([0, 1, 3])
        for i, s in enumerate(plan.samples):
            hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
            assert set(hs) >= {"hidden_states", "token_ids"}
            T = s.length
            assert hs["hidden_states"].shape == (T, 4, 128) and hs["hidden_states"].dtype == torch.float32
            assert hs["token_ids"].dtype == torch.int64 and hs["token_ids"].tolist() == s.input_ids
            assert hs["loss_mask"].tolist() == [bool(v) for v in s.loss_mask]
            # slots: aux layers in ascending order (HF hidden_states[i + 1]), then the final
            # hidden state BEFORE the final norm, as vLLM's extract_hidden_states stores them
            with torch.no_grad():
                ref = hf(torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states
            for slot, layer in enumerate([0, 1]):
                assert_close(hs["hidden_states"][:, slot], ref[layer + 1][0], atol=1e-5, rtol=1e-5, name="aux")
            aux, final = runner.capture([s.input_ids])[0]
            assert_close(hs["hidden_states"][:, 2], aux[:, 256:], atol=1e-5, rtol=1e-5, name="layer 3")
            assert_close(hs["hidden_states"][:, 3], final, atol=1e-5, rtol=1e-5, name="final pre-norm")
            # speculators' ArrowDataset split: [:, :-1] -> aux [T, 3H], [:, -1] -> verifier last hidden
            assert hs["hidden_states"][:, :-1].flatten(1).shape == (T, 384)
    datasets = pytest.importorskip("datasets")
    table = datasets.load_from_disk(str(out)).with_format("torch")
    assert len(table) == len(plan.samples)
    for i, s in enumerate(plan.samples):
        assert table[i]["input_ids"].tolist() == s.input_ids
        assert table[i]["loss_mask"].tolist() == s.loss_mask and int(table[i]["seq_len"]) == s.length


def test_layout_rejects_supervision_it_cannot_store(tmp_path, tiny_llama):
    from eagle_fast.errors import UserError

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    for layout, kind in [("nemo", "lse"), ("nemo", "hidden"), ("speculators", "topk"), ("specforge", "draft")]:
        with pytest.raises(UserError, match=f"--format {layout}"):
            extract(ExtractConfig(model=str(tiny_llama), data=str(data), out=str(tmp_path / "o"), engine="hf",
                                  layout=layout, supervision=kind))
    assert not (tmp_path / "o").exists()


def test_nemo_parts_merge_into_one_nemo_cache(nemo_setup, tiny_llama, tmp_path):
    from _pipeline import manifest_core, tree_digest
    from nemo_automodel.components.datasets.llm.eagle3_cache import CachedEagle3Dataset

    from eagle_fast.pipeline.merge import merge

    _, data, vocab, _ = nemo_setup

    def run(out, shard=None):
        extract(ExtractConfig(model=str(tiny_llama), data=str(data), out=str(out), engine="hf", dtype="fp32",
                              max_len=MAX_LEN, shard_size=4, layout="nemo", draft_vocab=str(vocab),
                              aux_layers="0,1,3", shard=shard, progress_tty=False))

    run(tmp_path / "single")
    for i in range(2):
        run(tmp_path / "parts", f"{i}/2")
    assert not (tmp_path / "parts" / "manifest.json").exists()  # NeMo cannot read a partial cache
    merge(str(tmp_path / "parts"))
    assert tree_digest(tmp_path / "parts", skip_manifest=True) == tree_digest(tmp_path / "single", skip_manifest=True)
    assert manifest_core(tmp_path / "parts") == manifest_core(tmp_path / "single")
    a, b = CachedEagle3Dataset(str(tmp_path / "parts")), CachedEagle3Dataset(str(tmp_path / "single"))
    assert len(a) == len(b) == 10
    assert all(torch.equal(a[i]["target_probs"], b[i]["target_probs"]) for i in range(10))


def test_speculators_parts_merge(tmp_path, tiny_llama):
    from _pipeline import manifest_core, tree_digest

    from eagle_fast.pipeline.merge import merge

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(5))

    def run(out, shard=None):
        extract(ExtractConfig(model=str(tiny_llama), data=str(data), out=str(out), engine="hf", dtype="fp32",
                              max_len=MAX_LEN, shard_size=2, layout="speculators", shard=shard, progress_tty=False))

    run(tmp_path / "single")
    for i in range(2):
        run(tmp_path / f"node{i}", f"{i}/2")
    merge(str(tmp_path / "merged"), [str(tmp_path / "node0"), str(tmp_path / "node1")])
    assert tree_digest(tmp_path / "merged") == {**tree_digest(tmp_path / "single"),
                                                "manifest.json": tree_digest(tmp_path / "merged")["manifest.json"]}
    assert manifest_core(tmp_path / "merged") == manifest_core(tmp_path / "single")


def test_specforge_parts_merge_with_their_vocab_mapping(tmp_path, tiny_llama):
    from _pipeline import manifest_core, tree_digest

    from eagle_fast.pipeline.merge import merge

    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(5))
    vocab = tmp_path / "vocab.safetensors"
    save_draft_vocab(vocab, DraftVocab(torch.arange(0, 1031, 3), 1031))

    def run(out, shard=None):
        extract(ExtractConfig(model=str(tiny_llama), data=str(data), out=str(out), engine="hf", dtype="bf16",
                              max_len=MAX_LEN, shard_size=2, layout="specforge", draft_vocab=str(vocab), shard=shard,
                              progress_tty=False))

    run(tmp_path / "single")
    for i in range(2):
        run(tmp_path / f"node{i}", f"{i}/2")
    merge(str(tmp_path / "merged"), [str(tmp_path / "node0"), str(tmp_path / "node1")])
    digest = tree_digest(tmp_path / "merged")
    assert digest == {**tree_digest(tmp_path / "single"), "manifest.json": digest["manifest.json"]}
    assert manifest_core(tmp_path / "merged") == manifest_core(tmp_path / "single")
    assert sorted(p.name for p in (tmp_path / "merged" / "rows_0-2000").iterdir()) == \
        sorted(f"data_{i}.ckpt" for i in range(5))
    assert "vocab_mapping.pt" in digest
