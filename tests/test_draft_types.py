"""Every draft type from one capture: the layer rules, the records, one prefill, and the checks.

The trainers' own readers and training steps are in test_speculators_types.py,
test_specforge_types.py and test_nemo_dspark.py; here: `draft_types`' rules and records, and one
extraction of several formats and types on an 8-layer tiny Llama (transformers engine, fp32),
whose capture runs each sample once, whose records hold transformers' own hidden states of each
type's layers (before or after the final norm, as each reader takes them), and which resumes,
splits and merges, verifies and inspects as an EAGLE-3 extraction does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _assert import assert_close
from _pipeline import (
    HELD_DRIVER,
    assert_same_records,
    chat_lines,
    interrupted_after_first_shard,
    killed_and_resumed,
    run_main,
    write_jsonl,
)
from _trainers import draft_vocab
from safetensors.torch import load_file

from eagle_fast import DraftDataset, ExtractConfig, extract
from eagle_fast.draft_types import (
    DRAFT_TYPES,
    READERS,
    dflash_layers,
    eagle3_layers,
    nemo_dspark_layers,
    resolve_records,
)
from eagle_fast.errors import UserError
from eagle_fast.inputs import load_tokenizer, plan_inputs
from eagle_fast.pipeline.merge import merge
from eagle_fast.runners.factory import default_runner_factory
from eagle_fast.store.fp8 import dequantize, error_bound
from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

N_LAYERS = 8
FORMATS = "native,nemo,specforge,speculators"  # every layout
TYPES = "eagle3,dflash,dspark,mtp"
RECORDS = ["native", "nemo-eagle3", "nemo-dspark", "specforge", "speculators"]
MAX_LEN = 64
K = 5  # --draft-layers: DFlash's rule gives [1, 2, 3, 4, 5] at 8 layers


# ------------------------------------------------------------------------------ rules


def test_rules_give_the_trainers_published_layers():
    # z-lab's DFlash drafts of Qwen3-8B (36 layers) read [1, 9, 17, 25, 33]; EAGLE-3's low/mid/high
    assert dflash_layers(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_layers(36, 1) == [18]
    assert eagle3_layers(36) == [1, 17, 32]
    assert nemo_dspark_layers(36, 5)[-1] == 35  # NeMo's DSpark reaches the last layer (its post-norm state)


def test_records_share_a_file_where_the_format_allows():
    def records(formats, types, **kw):
        return resolve_records(tuple(formats.split(",")), tuple(types.split(",")), 36, kw.pop("overrides", {}),
                               kw.pop("k", 5))

    (sf,) = records("specforge", "eagle3,dflash,domino,dspark")  # one record: its reader loads named keys
    assert sf.subdir == "" and sf.layers_of("eagle3") == (1, 17, 32) and sf.layers_of("dspark") == (1, 9, 17, 25, 33)
    (sp,) = records("speculators", "eagle3,dflash,mtp")  # speculators' one rule for every type
    assert {t.layer_ids for t in sp.types} == {(1, 17, 32), ()}
    two = records("speculators", "eagle3,dflash", overrides={"dflash": [1, 9, 17, 25, 33]})
    assert [r.subdir for r in two] == ["speculators-eagle3", "speculators-dflash"]  # its reader takes every layer
    mixed = records("nemo,specforge", "eagle3,dflash")  # NeMo holds no DFlash: that pair is left out
    assert [(r.subdir, r.names) for r in mixed] == [("nemo", ("eagle3",)), ("specforge", ("eagle3", "dflash"))]
    with pytest.raises(UserError) as e:
        records("nemo", "dflash")
    assert "online only" in e.value.cause and "specforge" in e.value.fix
    with pytest.raises(UserError, match="streaming"):
        records("specforge", "peagle")
    with pytest.raises(UserError, match="not ask for"):
        records("native", "eagle3", overrides={"dflash": [1, 2]})
    with pytest.raises(UserError, match="out of range"):
        records("native", "dflash", overrides={None: [1, 36]})


def test_every_type_is_held_by_some_format():
    assert all(("native", t) in READERS for t in DRAFT_TYPES)  # ours stores any layer set


# ------------------------------------------------------------------------------ one capture


class CountingRunner:
    """A runner that counts the sequences (and tokens) each engine call is given."""

    def __init__(self, runner, seen: list):
        self._runner, self.seen = runner, seen

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def capture(self, seqs):
        self.seen.extend(len(s) for s in seqs)
        return self._runner.capture(seqs)

    def capture_stream(self, batches, depth=1):
        def counted():
            for seqs in batches:
                self.seen.extend(len(s) for s in seqs)
                yield seqs
        return self._runner.capture_stream(counted(), depth)


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny8"), TinySpec(arch="llama", num_hidden_layers=N_LAYERS,
                                                                           tie_word_embeddings=False, seed=3))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dt")
    draft_vocab(root / "vocab.safetensors")
    return write_jsonl(root / "d.jsonl", chat_lines(9, start=40)), root / "vocab.safetensors"


def cfg(model, inputs, out, **kw) -> ExtractConfig:
    data, vocab = inputs
    base = {"model": str(model), "data": str(data), "out": str(out), "engine": "hf", "dtype": "fp32",
            "max_len": MAX_LEN, "shard_size": 4, "batch_tokens": 160, "draft_vocab": str(vocab),
            "layout": FORMATS, "draft_types": TYPES, "draft_layers": K, "progress_tty": False}
    return ExtractConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def one_run(tiny8, inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "ds"
    seen: list[int] = []
    s = extract(cfg(tiny8, inputs, out), runner_factory=lambda *a: CountingRunner(default_runner_factory(*a), seen))
    return out, s, seen


@pytest.fixture(scope="module")
def hf_states(tiny8, inputs):
    """sample index -> (HF hidden_states tuple, the last layer's output before the final norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny8), dtype=torch.float32)
    plan = plan_inputs(inputs[0], load_tokenizer(str(tiny8)), 1031, max_len=MAX_LEN, overlong="truncate")
    out = {}
    pre: dict = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: pre.update(h=o[0] if isinstance(o, tuple)
                                                                                     else o))
    for s in plan.samples:
        with torch.no_grad():
            hs = model(torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states
        out[s.index] = ([h[0] for h in hs], pre["h"][0])
    hook.remove()
    return out


def layers(hs, ids) -> torch.Tensor:
    """HF's states of eagle_fast ids `ids` (id i: hidden_states[i + 1]), concatenated: [T, n H]."""
    return torch.cat([hs[i + 1] for i in ids], dim=-1)


def test_one_prefill_serves_every_record(one_run, inputs, tiny8):
    out, _, seen = one_run
    plan = plan_inputs(inputs[0], load_tokenizer(str(tiny8)), 1031, max_len=MAX_LEN, overlong="truncate")
    assert sorted(seen) == sorted(x.length for x in plan.samples), "each sample is prefilled exactly once"
    m = json.loads((out / "manifest.json").read_text())
    assert m["layout"] == "multi" and [p["dir"] for p in m["parts"]] == RECORDS
    # NeMo's DSpark rule reaches id 7 = N - 1 (its post-norm state; the capture's final slot)
    assert m["capture"]["layer_ids"] == [1, 2, 3, 4, 5, 6, 7] and m["capture"]["vllm_layer_ids"] == [2, 3, 4, 5, 6, 7, 8]
    sf = next(r for r in m["draft_types"] if r["format"] == "specforge")
    assert [(t["draft_type"], t["layer_ids"], t["vllm_layer_ids"]) for t in sf["draft_types"]] == [
        ("eagle3", [1, 3, 4], [2, 4, 5]), ("dflash", [1, 2, 3, 4, 5], [2, 3, 4, 5, 6]),
        ("dspark", [1, 2, 3, 4, 5], [2, 3, 4, 5, 6])]  # specforge holds no MTP
    for d in RECORDS:  # each record: a dataset of its own
        sub = json.loads((out / d / "manifest.json").read_text())
        inner = sub.get("eagle_fast", sub)
        assert inner["layout"] == d.split("-")[0] and inner["complete"] and len(inner["shards"]) == m["num_shards"]
    # the trainers' own readers take their records of this one capture
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from speculators.train.data import ArrowDataset

    registry = builtin_algorithm_registry()
    for t in ("eagle3", "dflash"):
        refs = registry.resolve(t).providers.offline_for("text").build_reader(
            str(out / "specforge"), run_id="t", ttt_length=1, max_len=MAX_LEN).read()
        assert len(refs) == len(plan.samples), t
    arrow = ArrowDataset(max_len=MAX_LEN, datapath=str(out / "speculators"), on_missing="raise",
                         hidden_states_dtype=torch.float32)
    assert len(arrow) == len(plan.samples) and arrow[0]["hidden_states"].shape[-1] == 3 * 128


def test_each_record_holds_transformers_states_of_its_layers(one_run, hf_states):
    out = one_run[0]
    native = {t: DraftDataset(out / "native", draft_type=t) for t in ("eagle3", "dflash", "mtp")}
    for i in range(len(native["eagle3"])):
        plan = native["eagle3"].sample_plan(i)
        hs, pre = hf_states[plan.index]
        close = {"atol": 1e-5, "rtol": 1e-5}
        assert_close(native["eagle3"][i]["aux_hidden_states"], layers(hs, [1, 3, 4]), **close, name="native eagle3")
        assert_close(native["dflash"][i]["aux_hidden_states"], layers(hs, [1, 2, 3, 4, 5]), **close, name="dflash")
        # MTP's input: the last layer's output before the norm (HF's last entry is after it)
        assert_close(native["mtp"][i]["hidden"], pre, **close, name="native mtp (pre-norm)")
        assert not torch.allclose(pre, hs[-1], atol=1e-3), "the final norm changes the state: the test can tell"
        sf = torch.load(str(out / "specforge" / "rows_0-2000" / f"data_{plan.index}.ckpt"), weights_only=True)
        assert_close(sf["aux_hidden_state"][0], layers(hs, [1, 3, 4]), **close, name="specforge eagle3")
        assert_close(sf["hidden_states"][0], layers(hs, [1, 2, 3, 4, 5]), **close, name="specforge dflash")
        assert_close(sf["hidden_state"][0], hs[-1], **close, name="specforge final (post-norm)")
        sp = load_file(str(out / "speculators" / "hidden_states" / f"hs_{plan.index}.safetensors"))["hidden_states"]
        assert sp.shape[1] == 4  # eagle3, dflash (speculators' rule: the same 3 layers) and mtp share it
        assert_close(sp[:, :3].flatten(1), layers(hs, [1, 3, 4]), **close, name="speculators layers")
        assert_close(sp[:, 3], pre, **close, name="speculators final slot (pre-norm)")
        # NeMo's DSpark cache: its rule's ids [1, 2, 4, 6, 7], id 7 (= N - 1) the final norm's output
        nd = DraftDataset(out / "nemo-dspark").raw(i)
        T = len(plan.input_ids)
        want = torch.cat([layers(hs, [1, 2, 4, 6]), hs[-1]], dim=-1)
        assert_close(nd["target_hidden_states"][:T], want, **close, name="nemo dspark layers")
        assert_close(nd["target_last_hidden_states"][:T], hs[-1], **close, name="nemo dspark final (post-norm)")
        # an off-by-one layer would not pass: the neighbouring layers differ
        assert not torch.allclose(layers(hs, [1, 3, 4]), layers(hs, [2, 4, 5]), atol=1e-3)


def test_dry_run_gives_bytes_per_type_and_per_record(tiny8, inputs, tmp_path, capsys):
    data = inputs[0]
    code, text, _ = run_main(capsys, "extract", "--model", tiny8, "--data", data, "--out", tmp_path / "o", "--engine",
                             "hf", "--dtype", "fp32", "--format", "specforge", "--draft-type", "eagle3,dflash,dspark",
                             "--draft-layers", str(K), "--dry-run")
    assert code == 0 and not (tmp_path / "o").exists()
    row = {line.split(":", 2)[1].strip(): int(line.rsplit(":", 1)[1].replace(",", "").split()[0])
           for line in text.splitlines() if line.startswith("  per token, ")}
    H = 128
    assert row["eagle3 alone"] == 16 + 4 * (3 * H + H)  # ids, mask; aux, final (fp32)
    assert row["dflash alone"] == 16 + 4 * 5 * H
    assert row["dspark alone"] == 16 + 4 * 6 * H
    assert row["eagle3+dflash+dspark"] == 16 + 4 * (3 * H + H + 5 * H)  # the final state is stored once


def test_interrupted_split_and_merged_runs_give_one_runs_bytes(one_run, tiny8, inputs, tmp_path):
    ref = one_run[0]

    interrupted_after_first_shard(cfg(tiny8, inputs, tmp_path / "resumed"))
    again = extract(cfg(tiny8, inputs, tmp_path / "resumed"))
    assert again.complete and again.run_samples < again.samples
    for i in range(2):
        extract(cfg(tiny8, inputs, tmp_path / f"node{i}", shard=f"{i}/2"))
    merge(str(tmp_path / "merged"), [str(tmp_path / f"node{i}") for i in range(2)])
    for got in (tmp_path / "resumed", tmp_path / "merged"):
        assert_same_records(got, ref)


def test_verify_and_inspect_take_every_record(one_run, capsys):
    out = one_run[0]
    code, text, _ = run_main(capsys, "verify", out, "--samples", "2")
    assert code == 0, text
    assert [line for line in text.splitlines() if line.startswith("verify:")] == ["verify: PASS"] * len(RECORDS)
    code, text, _ = run_main(capsys, "inspect", out)
    assert code == 0 and f"{len(RECORDS)} records from one capture" in text and "specforge/ (specforge): eagle3 [1, 3, 4]" in text
    code, text, _ = run_main(capsys, "inspect", out, "--show-mask", "0")
    assert code == 0 and "[[" in text
    with pytest.raises(UserError, match=f"{len(RECORDS)} records"):
        DraftDataset(out)
    with pytest.raises(UserError, match="holds draft types"):
        DraftDataset(out / "native", draft_type="domino")


def test_a_run_killed_mid_way_resumes_to_the_same_records(tiny8, inputs, tmp_path):
    data, vocab = inputs
    script = tmp_path / "held.py"
    script.write_text(HELD_DRIVER)

    def argv(mode, out):
        return [sys.executable, str(script), mode, "extract", "--model", str(tiny8), "--data", str(data), "--out",
                str(out), "--engine", "hf", "--dtype", "fp32", "--max-len", str(MAX_LEN), "--shard-size", "3",
                "--batch-tokens", "120", "--draft-vocab", str(vocab), "--format", FORMATS, "--draft-type", TYPES,
                "--draft-layers", str(K)]

    ref = subprocess.run(argv("fast", tmp_path / "ref"), check=False, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "killed"
    killed_and_resumed(argv, out)
    assert_same_records(out, tmp_path / "ref")
    assert not [p for p in out.rglob(".*")], "temp files left"


def test_fp8_goes_to_every_record_a_trainer_reads_it_in(one_run, tiny8, inputs, tmp_path, capsys):
    data = inputs[0]
    code, _, err = run_main(capsys, "extract", "--model", tiny8, "--data", data, "--out", tmp_path / "no", "--engine",
                            "hf", "--format", "native,specforge", "--draft-type", "eagle3,dflash", "--aux-dtype", "fp8")
    assert code == 2 and "SpecForge 0.2.0 has no fp8 reader" in err and not (tmp_path / "no").exists()
    out = tmp_path / "fp8"
    extract(cfg(tiny8, inputs, out, layout="native,speculators", aux_dtype="fp8"))
    ref = DraftDataset(one_run[0] / "native", draft_type="dflash")
    got = DraftDataset(out / "native", draft_type="dflash")
    for i in range(len(ref)):
        raw = got.raw(i)
        assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn
        want = ref[i]["aux_hidden_states"]
        err8 = (got[i]["aux_hidden_states"].double() - want.double()).abs()
        # the record stores the union [1, 2, 3, 4, 5] (the dflash layers here), one scale per token over it
        assert bool((err8 <= error_bound(want, raw["aux_hidden_states_scale"])).all()), "fp8 beyond its bound"
        eagle3 = DraftDataset(out / "native", draft_type="eagle3")[i]["aux_hidden_states"]
        assert torch.equal(eagle3, got[i]["aux_hidden_states"].reshape(len(want), 5, -1)[:, [0, 2, 3]].flatten(1))
    sp = load_file(str(out / "speculators" / "hidden_states" / "hs_0.safetensors"))
    assert sp["hidden_states"].dtype == torch.float8_e4m3fn and sp["hidden_states_scales"].shape[1:] == (1, 1)
    assert dequantize(sp["hidden_states"], sp["hidden_states_scales"]).shape[1] == 4
