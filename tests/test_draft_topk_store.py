"""`--supervision draft-topk` on disk: the sparse draft target written, read back and rebuilt.

What: the native shard's fields and their on-disk dtypes (ids in the smallest integer type that
holds the draft vocabulary); `Eagle3Dataset.target_p` rebuilt from the sparse fields against the
dense draft distribution the head computes for the same samples, within the loss the stored
form documents (the top-k exact up to out_dtype rounding; everything else bounded by the tail);
`verify` passing on it; and the refusals (no draft vocabulary, k beyond it, formats that
cannot store it).
"""

from __future__ import annotations

import pytest
import torch
from _assert import assert_close
from _pipeline import mixed_jsonl
from safetensors import safe_open
from test_extract import cfg_for

from eagle_fast import extract
from eagle_fast.errors import UserError
from eagle_fast.pipeline.verify import verify
from eagle_fast.store.dataset import Eagle3Dataset
from eagle_fast.store.layouts import draft_index_dtype
from eagle_fast.supervision import dense_target_p
from eagle_fast.vocab import DraftVocab, save_draft_vocab


def _vocab(tmp_path, ids):
    return str(save_draft_vocab(tmp_path / "v.pt", DraftVocab(ids, 1031)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_llama):
    """The same data extracted twice: dense draft (fp32) and draft-topk k=16 (bf16 log-probs)."""
    tmp = tmp_path_factory.mktemp("dtopk")
    data = mixed_jsonl(tmp / "d.jsonl", n_chat=5)
    vocab = _vocab(tmp, torch.arange(2, 1031, 3))  # Vd = 343: int16 ids
    dense = extract(cfg_for(tiny_llama, data, tmp / "dense", supervision="draft", draft_vocab=vocab,
                            out_dtype="fp32"))
    sparse = extract(cfg_for(tiny_llama, data, tmp / "sparse", supervision="draft-topk", k=16,
                             draft_vocab=vocab, out_dtype="bf16"))
    assert dense.complete and sparse.complete
    return tmp / "dense", tmp / "sparse", sparse, dense


def test_fields_and_disk_dtypes(pair):
    _, sparse_dir, sparse, dense = pair
    h = safe_open(str(sparse_dir / "shard-000000.safetensors"), "pt")
    names = set(h.keys())
    assert {"draft_topk_ids", "draft_topk_logprobs", "draft_topk_tail", "argmax_in_draft", "argmax"} <= names
    assert not names & {"lse", "draft_logprobs", "topk_ids"}
    assert h.get_slice("draft_topk_ids").get_dtype() == "I16"
    assert h.get_slice("draft_topk_logprobs").get_dtype() == "BF16"
    assert h.get_slice("draft_topk_tail").get_dtype() == "F32"
    assert sparse.bytes < dense.bytes
    t = h.get_slice("argmax").get_shape()[0]
    sparse_sup = sum(h.get_tensor(n).nbytes for n in ("draft_topk_ids", "draft_topk_logprobs", "draft_topk_tail"))
    assert sparse_sup == t * (16 * 2 + 16 * 2 + 4)  # vs 343 x 4 bytes of dense fp32 log-probs
    ds = Eagle3Dataset(sparse_dir)
    s = ds[0]
    assert s["draft_topk_ids"].dtype == torch.int64 and s["draft_topk_ids"].shape[1] == 16
    assert int(s["draft_topk_ids"].max()) < 343


@pytest.mark.parametrize("size,dtype", [(2, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                        (32768, torch.int16), (32769, torch.int32)])
def test_index_dtype_is_the_smallest_that_holds_the_draft_vocab(size, dtype):
    assert draft_index_dtype(size) == dtype
    assert torch.iinfo(dtype).max >= size - 1


@pytest.mark.parametrize("mode", ["spread", "drop", "renormalize"])
def test_target_p_rebuilt_within_the_documented_loss(pair, mode):
    dense_dir, sparse_dir, _, _ = pair
    dense, sparse = Eagle3Dataset(dense_dir), Eagle3Dataset(sparse_dir, target_p=mode)
    assert len(dense) == len(sparse)
    for i in range(len(dense)):
        p = dense.target_p(i)  # exp(draft_logprobs), the head's dense distribution
        s = sparse[i]
        q = s["target_p"]
        assert q.shape == p.shape and q.dtype == torch.float32
        assert torch.equal(q, sparse.target_p(i, mode))
        ids, tail = s["draft_topk_ids"], s["draft_topk_tail"].double()
        # the top-k: the head's own probabilities, their log-probs rounded once to bf16, so
        # each is off by a factor within exp(+-|log p| x 2^-8) (half a bf16 ulp of log p)
        top_p, top_q = p.gather(1, ids).double(), q.gather(1, ids).double()
        if mode == "renormalize":
            top_q = top_q * (s["draft_topk_logprobs"].double().exp().sum(1))[:, None]
        rel = torch.expm1(top_p.log().abs() * 2**-8) * 1.01
        assert bool(((top_q - top_p).abs() <= top_p * rel + 1e-9).all()), (
            f"{mode} [{i}]: top-k probabilities beyond bf16 log-prob rounding")
        rnd = (top_p * rel).sum(1) + 1e-6  # that rounding's effect on a row's mass
        # they are the k most likely draft ids: none outside holds more than the k-th
        kth = top_p.min(1).values
        outside = p.double().scatter(1, ids, 0.0)
        assert bool((outside.max(1).values <= kth * (1 + 1e-5) + 1e-9).all()), f"[{i}] not the top-k"
        assert_close(tail, outside.sum(1), atol=1e-6, rtol=1e-3, name=f"tail [{i}]")
        # mass and L1 loss, per position
        l1 = (q.double() - p.double()).abs().sum(1)
        mass = q.double().sum(1)
        if mode == "drop":
            assert bool(((mass - (1 - tail)).abs() <= rnd).all()), f"[{i}] drop mass"
            assert bool((l1 <= tail + rnd).all()), f"[{i}] drop L1 {float((l1 - tail).max())}"
        else:
            bound = 1e-6 if mode == "renormalize" else rnd  # spread: the top-k's own rounding
            assert bool(((mass - 1).abs() <= bound).all()), f"[{i}] {mode} mass"
            assert bool((l1 <= 2 * tail + 2 * rnd).all()), f"[{i}] {mode} L1 beyond 2 x tail"


def test_dense_target_p_rebuild_rules():
    ids = torch.tensor([[2, 0]])
    lp = torch.tensor([[0.5, 0.25]]).log()
    tail = torch.tensor([0.25])
    assert torch.allclose(dense_target_p(ids, lp, tail, 4, "spread"), torch.tensor([[0.25, 0.125, 0.5, 0.125]]))
    assert torch.allclose(dense_target_p(ids, lp, tail, 4, "drop"), torch.tensor([[0.25, 0.0, 0.5, 0.0]]))
    assert torch.allclose(dense_target_p(ids, lp, tail, 4, "renormalize"),
                          torch.tensor([[1 / 3, 0.0, 2 / 3, 0.0]]))
    with pytest.raises(ValueError, match="tail mode"):
        dense_target_p(ids, lp, tail, 4, "smear")
    with pytest.raises(ValueError, match="draft_size 1 must be >= k = 2"):
        dense_target_p(ids, lp, tail, 1)


def test_verify_passes_on_draft_topk(pair):
    _, sparse_dir, _, _ = pair
    ok, reports, _ = verify(str(sparse_dir), samples=3)
    names = {r.name for r in reports}
    assert ok and {"draft_topk_ids", "draft_topk_logprobs", "draft_topk_tail"} <= names


def test_target_p_refused_without_a_draft_distribution(tmp_path, tiny_llama):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=2)
    extract(cfg_for(tiny_llama, data, tmp_path / "o", supervision="topk", k=4))
    with pytest.raises(UserError, match="no draft distribution"):
        Eagle3Dataset(tmp_path / "o").target_p(0)
    with pytest.raises(ValueError, match="target_p must be None or one of"):
        Eagle3Dataset(tmp_path / "o", target_p="smear")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({}, "--supervision draft-topk needs a draft vocabulary"),
        ({"k": 500, "vocab": True}, r"--k 500 is out of range for the draft vocabulary of 343 ids"),
        ({"layout": "speculators", "vocab": True}, "--format speculators stores hidden states only"),
        ({"layout": "nemo", "vocab": True}, "--format nemo stores NeMo's draft-vocab target_probs"),
    ],
)
def test_refusals_before_any_work(tmp_path, tiny_llama, kw, match):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=2)
    vocab = _vocab(tmp_path, torch.arange(2, 1031, 3)) if kw.pop("vocab", False) else None
    with pytest.raises(UserError, match=match):
        extract(cfg_for(tiny_llama, data, tmp_path / "o", supervision="draft-topk", draft_vocab=vocab, **kw))
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
