"""`--supervision draft-topk --keep-mass P`: a different k per token, stored ragged and read back.

What: the kept k is the smallest whose draft mass reaches P, capped by --k (against a float64
brute force on the head's own outputs, the same data extracted with a fixed k); the capped
tokens are counted and `inspect` reports them; the tail is the mass outside the kept ids; the
ragged fields on disk (uint8 lengths, 1-d ids and log-probs); `Eagle3Dataset.target_p` in every
mode, `nemo_inputs` and the collates equal the fixed-k reconstruction truncated the same way;
fixed-k datasets carry nothing new; bad P values are refused before any work.
"""

from __future__ import annotations

import math

import pytest
import torch
from _assert import assert_close
from _pipeline import manifest_core, mixed_jsonl, run_main, tree_digest
from safetensors import safe_open
from test_extract import cfg_for

from eagle_fast import extract
from eagle_fast.errors import UserError
from eagle_fast.files import read_safetensors_header
from eagle_fast.pipeline.inspect import inspect_text
from eagle_fast.pipeline.merge import merge
from eagle_fast.pipeline.verify import kl_reports, verify
from eagle_fast.store import make_layout, spec_from_manifest
from eagle_fast.store.dataset import Eagle3Dataset
from eagle_fast.store.fidelity import kl_check
from eagle_fast.store.layouts import length_dtype
from eagle_fast.store.manifest import read_manifest
from eagle_fast.store.sizes import field_sizes, tensor_bytes
from eagle_fast.supervision import (
    TAIL_MODES,
    dense_target_p,
    dense_target_p_ragged,
    keep_mass_lengths,
    sparse_target_p,
)
from eagle_fast.vocab import DraftVocab, save_draft_vocab

K = 8
DRAFT_IDS = torch.arange(5, 1031, 43)  # Vd = 24: the random tiny target's top 8 hold ~45 % of it


def _brute_force(logprobs: torch.Tensor, tail: torch.Tensor, p: float):
    """Per token, in float64, one id at a time: (k, capped, mass outside the kept ids)."""
    ks, capped, tails = [], [], []
    for row, t in zip(logprobs.double().exp().tolist(), tail.double().tolist()):
        mass, k = 0.0, len(row)
        for j, q in enumerate(row):
            mass += q
            if mass >= p:
                k = j + 1
                break
        ks.append(k)
        capped.append(mass < p)
        tails.append(t + math.fsum(row[k:]))
    return torch.tensor(ks), torch.tensor(capped), torch.tensor(tails, dtype=torch.float64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_llama):
    """The same data with a fixed k = 8, then with --keep-mass P, P the 40th percentile of the
    stored top-8 masses (so about 40 % of the tokens hit the cap and some of the rest keep fewer ids)."""
    tmp = tmp_path_factory.mktemp("keep_mass")
    data = mixed_jsonl(tmp / "d.jsonl", n_chat=5)
    vocab = str(save_draft_vocab(tmp / "v.pt", DraftVocab(DRAFT_IDS, 1031)))
    common = {"supervision": "draft-topk", "k": K, "draft_vocab": vocab, "out_dtype": "bf16"}
    extract(cfg_for(tiny_llama, data, tmp / "fixed", **common))
    fixed = Eagle3Dataset(tmp / "fixed")
    mass = torch.cat([fixed[i]["draft_topk_logprobs"].double().exp().sum(1) for i in range(len(fixed))])
    p = round(float(mass.quantile(0.4)), 4)
    summary = extract(cfg_for(tiny_llama, data, tmp / "ragged", keep_mass=p, **common))
    assert summary.complete and f"keep mass    {p}: mean k" in summary.text()
    return fixed, Eagle3Dataset(tmp / "ragged"), p, tmp


def _truncated(fixed: Eagle3Dataset, i: int, p: float):
    """Fixed-k sample `i` cut to the brute force's k per token: (lengths, ids, logprobs, tail)."""
    s = fixed[i]
    ks, _, tails = _brute_force(s["draft_topk_logprobs"], s["draft_topk_tail"], p)
    keep = torch.arange(K)[None, :] < ks[:, None]
    return ks, s["draft_topk_ids"][keep], s["draft_topk_logprobs"][keep], tails


def test_kept_k_is_the_smallest_reaching_p_and_the_tail_is_the_rest(pair):
    fixed, ragged, p, _ = pair
    all_k = []
    for i in range(len(fixed)):
        ks, ids, lps, tails = _truncated(fixed, i, p)
        s = ragged[i]
        assert torch.equal(s["draft_topk_lengths"], ks), f"[{i}] kept k"
        assert torch.equal(s["draft_topk_ids"], ids) and torch.equal(s["draft_topk_logprobs"], lps), f"[{i}]"
        # the tail: the head's tail outside the top 8 plus the dropped probabilities, once rounded to fp32
        assert_close(s["draft_topk_tail"].double(), tails, atol=0, rtol=2**-23, name=f"tail [{i}]")
        all_k.append(ks)
    all_k = torch.cat(all_k)
    assert 1 < len(set(all_k.tolist())), "the test data should keep a different k on different tokens"


def test_cap_count_in_inspect_and_the_summary(pair, tiny_llama):
    fixed, ragged, p, tmp = pair
    capped = torch.cat([_brute_force(fixed[i]["draft_topk_logprobs"], fixed[i]["draft_topk_tail"], p)[1]
                        for i in range(len(fixed))])
    lengths = torch.cat([ragged[i]["draft_topk_lengths"] for i in range(len(ragged))])
    n = int(capped.sum())
    assert 0 < n < capped.numel()
    assert bool((lengths[capped] == K).all())
    text = inspect_text(str(tmp / "ragged"))
    assert f"keep mass   {p}" in text, text
    assert f"mean k {lengths.double().mean():.2f} of at most {K}" in text, text
    assert f"{n:,} of {capped.numel():,} tokens hit the cap ({100 * n / capped.numel():.1f} %)" in text, text
    summary = extract(cfg_for(tiny_llama, tmp / "d.jsonl", tmp / "ragged", supervision="draft-topk", k=K,
                              draft_vocab=str(tmp / "v.pt"), out_dtype="bf16", keep_mass=p))  # nothing to do
    assert f"keep mass    {p}: mean k {lengths.double().mean():.2f} of at most {K}; {n:,} of" in summary.text()
    kept_bytes = float(lengths.double().mean()) * (1 + 2)  # uint8 ids, bf16 log-probs
    assert f"the kept ids and log-probs take {kept_bytes:,.1f} bytes/token here" in text, text
    assert "keep mass" not in inspect_text(str(tmp / "fixed"))


def test_ragged_fields_on_disk(pair):
    *_, p, tmp = pair
    h = safe_open(str(tmp / "ragged" / "shard-000000.safetensors"), "pt")
    assert h.get_slice("draft_topk_lengths").get_dtype() == "U8"
    assert h.get_slice("draft_topk_ids").get_dtype() == "U8"  # Vd = 24
    assert len(h.get_slice("draft_topk_ids").get_shape()) == 1
    lengths, offsets = h.get_tensor("draft_topk_lengths"), h.get_tensor("draft_topk_offsets")
    assert int(offsets[-1]) == int(lengths.long().sum()) == h.get_slice("draft_topk_logprobs").get_shape()[0]
    m = read_manifest(tmp / "ragged")
    sizes = field_sizes(make_layout(spec_from_manifest(m)))
    for rec in m["shards"]:  # every byte of the data section counted, the kept ids by their count
        path = tmp / "ragged" / rec["files"][0]["path"]
        _, raw = read_safetensors_header(path)
        with safe_open(str(path), "pt") as f:
            kept = int(f.get_tensor("draft_topk_lengths").long().sum())
        assert path.stat().st_size - 8 - len(raw) == tensor_bytes(sizes, rec["tokens"], rec["samples"], kept=kept)
    assert m["layout_spec"]["keep_mass"] == p and m["supervision"]["keep_mass"] == p
    assert m["settings"]["keep_mass"] == p
    ok, reports, _ = verify(str(tmp / "ragged"), samples=2)
    names = {r.name for r in reports}
    assert ok and {"draft_topk_lengths", "draft_topk_ids", "draft_topk_logprobs"} <= names
    assert {f"kl {mode}" for mode in TAIL_MODES} <= names  # the KL bound from the stored tail, checked


@pytest.mark.parametrize("mode", TAIL_MODES)
def test_target_p_equals_the_fixed_k_truncated_the_same_way(pair, mode):
    fixed, ragged, p, tmp = pair
    opened = Eagle3Dataset(tmp / "ragged", target_p=mode)
    for i in range(len(fixed)):
        ks, ids, lps, tails = _truncated(fixed, i, p)
        rows, start = [], 0
        for k, tail in zip(ks.tolist(), tails.float()):  # the fixed-k rule, one token at a time
            rows.append(dense_target_p(ids[None, start:start + k], lps[None, start:start + k], tail[None],
                                       len(DRAFT_IDS), mode))
            start += k
        expected = torch.cat(rows)
        got = opened[i]["target_p"]
        assert torch.equal(got, ragged.target_p(i, mode))
        assert_close(got, expected, atol=0, rtol=1e-6 if mode == "renormalize" else 0, name=f"{mode} [{i}]")
        got_nemo = ragged.nemo_inputs(i, mode)["target_probs"]
        assert_close(got_nemo[:-1], expected[1:], atol=0, rtol=1e-6 if mode == "renormalize" else 0,
                     name=f"nemo {mode} [{i}]")


@pytest.mark.parametrize("mode", TAIL_MODES)
def test_what_serve_sends_is_what_the_dataset_reads_back(pair, mode):
    """`serve --supervision draft-topk [--keep-mass P]` sends `sparse_target_p` of the head's top-k:
    bit for bit the target_p of the dataset extract writes from that top-k."""
    fixed, ragged, p, _ = pair
    for i in range(len(fixed)):
        s = fixed.raw(i)
        top = (s["draft_topk_ids"], s["draft_topk_logprobs"], s["draft_topk_tail"], len(DRAFT_IDS))
        assert torch.equal(sparse_target_p(*top, p, mode), ragged.target_p(i, mode)), f"keep-mass {mode} [{i}]"
        assert torch.equal(sparse_target_p(*top, None, mode), fixed.target_p(i, mode)), f"fixed k {mode} [{i}]"


def test_collates_keep_the_ragged_rows(pair):
    _, ragged, _, _ = pair
    batch = ragged.collate([ragged[0], ragged[1]])
    lengths = batch["draft_topk_lengths"]
    assert lengths.shape == batch["attention_mask"].shape and int(lengths[~batch["attention_mask"]].sum()) == 0
    rebuilt = dense_target_p_ragged(lengths.reshape(-1), batch["draft_topk_ids"], batch["draft_topk_logprobs"],
                                    batch["draft_topk_tail"].reshape(-1), len(DRAFT_IDS), "drop")
    for b in range(2):
        n = ragged.length(b)
        assert torch.equal(rebuilt.reshape(2, -1, len(DRAFT_IDS))[b, :n], ragged.target_p(b, "drop"))
    nemo = ragged.nemo_collate([ragged.nemo_inputs(0), ragged.nemo_inputs(1)])
    assert nemo["target_probs"].shape == (2, lengths.shape[1], len(DRAFT_IDS))


def test_fixed_k_datasets_carry_nothing_new(pair):
    fixed, _, _, tmp = pair
    m = read_manifest(tmp / "fixed")
    assert "keep_mass" not in m["layout_spec"] and "keep_mass" not in m["supervision"]
    assert "keep_mass" not in m["settings"]
    h = safe_open(str(tmp / "fixed" / "shard-000000.safetensors"), "pt")
    assert not {"draft_topk_lengths", "draft_topk_offsets"} & set(h.keys())
    assert h.get_slice("draft_topk_ids").get_shape()[1] == K
    assert fixed[0]["draft_topk_ids"].shape[1] == K


@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
def test_keep_mass_lengths_against_the_brute_force(temperature, p):
    g = torch.Generator().manual_seed(int(temperature * 100 + p * 1000))
    logits = torch.randn(257, 311, generator=g, dtype=torch.float64) / temperature
    logprobs = logits.log_softmax(-1).sort(-1, descending=True).values
    lp, tail = logprobs[:, :K].to(torch.bfloat16), logprobs[:, K:].exp().sum(-1).float()
    lengths, new_tail, capped = keep_mass_lengths(lp, tail, p)
    ks, want_capped, want_tail = _brute_force(lp, tail, p)
    assert torch.equal(lengths, ks) and torch.equal(capped, want_capped)
    assert_close(new_tail.double(), want_tail, atol=0, rtol=2**-23, name="tail")


@pytest.mark.parametrize("k, dtype", [(16, torch.uint8), (255, torch.uint8), (256, torch.int16),
                                      (32767, torch.int16), (32768, torch.int32)])
def test_lengths_use_the_smallest_type_that_holds_k(k, dtype):
    assert length_dtype(k) == dtype and torch.iinfo(dtype).max >= k


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"keep_mass": 0.0}, "--keep-mass 0.0 is not a share of the draft mass strictly between 0 and 1"),
        ({"keep_mass": 1.0}, "--keep-mass 1.0 is not a share"),
        ({"keep_mass": -0.5}, "--keep-mass -0.5 is not a share"),
        ({"keep_mass": float("nan")}, "--keep-mass nan is not a share"),
        ({"keep_mass": 0.9, "supervision": "draft"}, "--keep-mass applies to --supervision draft-topk"),
        ({"keep_mass": 0.9, "supervision": "topk"}, "--keep-mass applies to --supervision draft-topk"),
    ],
)
def test_bad_keep_mass_is_refused_before_any_work(tmp_path, tiny_llama, kw, match):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=2)
    vocab = str(save_draft_vocab(tmp_path / "v.pt", DraftVocab(DRAFT_IDS, 1031)))
    args = {"supervision": "draft-topk", "k": K, "draft_vocab": vocab, **kw}
    if args["supervision"] == "topk":
        args.pop("draft_vocab")
    with pytest.raises(UserError, match=match):
        extract(cfg_for(tiny_llama, data, tmp_path / "o", **args))
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_cli_refuses_keep_mass_out_of_range(tmp_path, tiny_llama, capsys):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=2)
    code, _, err = run_main(capsys, "extract", "--model", tiny_llama, "--data", data, "--out", tmp_path / "o",
                            "--engine", "hf", "--supervision", "draft-topk", "--keep-mass", "1.5")
    assert code != 0 and "--keep-mass 1.5 is not a share" in err


@pytest.fixture(scope="module")
def dense(pair, tiny_llama):
    """The same data with the dense draft distribution (fp32): the truth the bounds hold against."""
    _, _, _, tmp = pair
    vocab = str(tmp / "v.pt")
    extract(cfg_for(tiny_llama, tmp / "d.jsonl", tmp / "dense", supervision="draft", draft_vocab=vocab,
                    out_dtype="fp32"))
    return Eagle3Dataset(tmp / "dense")


@pytest.mark.parametrize("mode", TAIL_MODES)
def test_kl_within_the_bound_from_the_stored_tail(pair, dense, mode):
    fixed, ragged, _, _ = pair
    for ds, name in ((ragged, "keep-mass"), (fixed, "fixed k")):
        for i in range(len(ds)):
            s, p = ds[i], dense.target_p(i)
            if "draft_topk_lengths" in s:
                sparse = (s["draft_topk_lengths"], s["draft_topk_ids"], s["draft_topk_logprobs"])
            else:
                sparse = (torch.full((p.shape[0],), K), s["draft_topk_ids"].reshape(-1),
                          s["draft_topk_logprobs"].reshape(-1))
            # tail_tol: verify's fp32 tolerance (the dense and sparse head calls round apart)
            kl, bound, allowance = kl_check(p, *sparse, s["draft_topk_tail"], len(DRAFT_IDS), mode, 2e-3)
            assert bool((bound > 0.05).all()) and bool((allowance < bound / 4).all()), f"{name} [{i}]"
            over = kl - bound - allowance
            assert bool((over <= 0).all()), f"{mode} {name} [{i}]: KL beyond its bound by {float(over.max())}"
            if mode != "spread":  # equalities: a shifted target (another token's p) must break them
                assert bool(((kl - bound).abs() <= allowance).all()), f"{mode} {name} [{i}]"
                wrong = kl_check(p.roll(1, 0), *sparse, s["draft_topk_tail"], len(DRAFT_IDS), mode, 1.0)[0]
                assert float(((wrong - bound).abs() > allowance).double().mean()) > 0.5, f"{mode} control [{i}]"


def test_verify_holds_fixed_k_to_the_bound_and_fails_a_wrong_tail(pair, dense):
    fixed, ragged, _, tmp = pair
    ok, reports, _ = verify(str(tmp / "fixed"), samples=2)
    kl = {r.name: r for r in reports if r.kind == "kl"}
    assert ok and set(kl) == {f"kl {mode}" for mode in TAIL_MODES}
    assert all(0 < r.value <= 1 for r in kl.values())
    # negative control: the same samples with their stored tail halved break every bound
    for ds in (fixed, ragged):
        stored = [{**ds.raw(i), "draft_topk_tail": ds.raw(i)["draft_topk_tail"] / 2} for i in range(2)]
        wrong = kl_reports(stored, lambda i: dense.raw(i)["draft_logprobs"], ds.spec, 2e-3)
        assert not any(r.ok for r in wrong), [(r.name, r.value) for r in wrong]


def test_nodes_merge_to_the_single_run_and_another_p_is_not_mixed_in(pair, tiny_llama):
    *_, p, tmp = pair
    common = {"supervision": "draft-topk", "k": K, "draft_vocab": str(tmp / "v.pt"), "out_dtype": "bf16",
              "keep_mass": p}
    for i in range(2):
        extract(cfg_for(tiny_llama, tmp / "d.jsonl", tmp / "shared", shard=f"{i}/2", **common))
    merge(str(tmp / "shared"))
    assert tree_digest(tmp / "shared", skip_manifest=True) == tree_digest(tmp / "ragged", skip_manifest=True)
    assert manifest_core(tmp / "shared") == manifest_core(tmp / "ragged")
    with pytest.raises(UserError, match="different settings.*keep_mass"):
        extract(cfg_for(tiny_llama, tmp / "d.jsonl", tmp / "ragged", **{**common, "keep_mass": 0.5}))
    with pytest.raises(UserError, match="different settings.*keep_mass"):
        extract(cfg_for(tiny_llama, tmp / "d.jsonl", tmp / "ragged", **{**common, "keep_mass": None}))


@pytest.mark.parametrize("n", [0, 1, 37, 40])
def test_late_tensors_land_after_the_rows_written_before(tmp_path, n):
    """The writer's late tensors (the ragged fields' home): any length up to the reserve reads back."""
    from eagle_fast.store.safetensors import SafetensorsWriter

    rows = torch.randn(5, 3)
    late = torch.randint(0, 200, (n,), dtype=torch.int16)
    w = SafetensorsWriter(tmp_path / "f.safetensors", {"rows": (torch.float32, (5, 3))}, {"m": "1"},
                          late={"late": (torch.int16, 40)})
    w.write("rows", 0, rows)
    with pytest.raises(ValueError, match="commit needs the late tensors"):
        w.commit()
    path = w.commit({"late": late})
    with safe_open(str(path), "pt") as h:
        assert torch.equal(h.get_tensor("rows"), rows) and torch.equal(h.get_tensor("late"), late)
        assert h.metadata() == {"m": "1"}
    w = SafetensorsWriter(tmp_path / "g.safetensors", {"rows": (torch.float32, (5, 3))}, late={"late": (torch.int16, 4)})
    with pytest.raises(ValueError, match="more than the 4 reserved"):
        w.commit({"late": torch.zeros(5, dtype=torch.int16)})
    w.abort()
