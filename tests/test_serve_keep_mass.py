"""`eagle-fast serve --supervision draft-topk [--keep-mass P]` through NeMo AutoModel 0.7.0's own
remote-target client (loopback only).

- target_probs is the sparse draft target rebuilt dense, per token the fewest draft ids holding
  P of NeMo's own in-process draft distribution (at most k), the rest of the mass per tail
  mode: checked against a float64 oracle built from NeMo's `compute_supervision` alone.
- Settings the server cannot serve are refused at start with the flag and the fix named; a
  draft vocabulary smaller than k is refused with a 422 and the server keeps serving.
"""

from __future__ import annotations

import pytest
import torch
from _assert import assert_close, assert_ids_equal

pytest.importorskip("requests")
pytest.importorskip("nemo_automodel.components.speculative.eagle.remote.client",
                    reason="nemo-automodel==0.7.0 (installed --no-deps, plus datasets and pillow) is not importable")
from nemo_automodel.components.speculative.eagle.remote import wire as nemo_wire
from test_serve import Running, _batch, _mapping, _post

from eagle_fast.errors import UserError
from eagle_fast.serve.app import ServeConfig, target_spec


def _oracle(p: torch.Tensor, k: int, keep_mass: float, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [N, Vd] of the true draft distribution -> (the rebuilt rows, float64; kept ids per
    row; whether the row hit the cap)."""
    p = p.double()
    out = torch.zeros_like(p)
    kept = torch.zeros(p.shape[0], dtype=torch.long)
    capped = torch.zeros(p.shape[0], dtype=torch.bool)
    for i, row in enumerate(p):
        v, order = row.sort(descending=True)
        c = v[:k].cumsum(0)
        capped[i] = c[-1] < keep_mass
        n = k if capped[i] else int((c < keep_mass).sum()) + 1
        ids = order[:n]
        kept[i] = n
        tail = row.sum() - row[ids].sum()
        if mode == "spread":
            out[i] = tail / (row.numel() - n)
        out[i, ids] = row[ids] / row[ids].sum() if mode == "renormalize" else row[ids]
    return out, kept, capped


@pytest.mark.parametrize("mode", ["spread", "drop", "renormalize"])
def test_nemo_client_gets_the_keep_mass_rebuild_of_nemos_own_distribution(tiny_llama, nemo_reference, mode):
    k, keep_mass = 90, 0.3  # the random target is flat: its tokens need 89-92 ids for 0.3, so some hit the cap
    running = Running(tiny_llama, supervision="draft-topk", k=k, keep_mass=keep_mass, tail=mode)
    try:
        client = running.client()
        info = client.model_info()
        assert (info["supervision"], info["k"], info["keep_mass"], info["tail"]) == ("draft-topk", k, keep_mass, mode)
        selected, mask = _mapping(seed=7, size=400)  # unsorted: columns follow the client's order
        client.set_vocab_mapping(selected, mask)
        ids, am, lm = _batch(seed=31)
        got = client.generate_batch(ids, am, lm)
        ref = nemo_reference(selected, mask, ids, am, lm)
        client.close()
    finally:
        running.stop()
    followed = torch.cat((am.bool()[:, 1:], torch.zeros_like(am.bool()[:, :1])), dim=1)
    want, kept, capped = _oracle(ref["target_probs"][followed], k, keep_mass, mode)
    assert (kept < k).any() and capped.any() and not capped.all(), \
        f"the test needs rows of different k and capped ones: kept {kept.tolist()}, capped {capped.tolist()}"
    assert got.target_probs.dtype == torch.float32
    assert_close(got.target_probs[followed].double(), want, atol=1e-6, rtol=1e-4, name=f"target_probs ({mode})")
    assert not got.target_probs[~followed].any(), "target_probs not zero where no token follows"
    assert_ids_equal(got.position_mask, ref["position_mask"], name="position_mask")
    assert_close(got.aux_hidden_states[am.bool()], ref["aux_hidden_states"][am.bool()], atol=1e-5, rtol=1e-4,
                 name="aux")


def test_k_above_the_draft_vocabulary_is_a_422_and_the_server_keeps_serving(tiny_llama):
    running = Running(tiny_llama, supervision="draft-topk", k=64)
    try:
        selected, mask = _mapping(seed=2, size=40)
        r = _post(running.url, "set_vocab_mapping",
                  nemo_wire.encode_to_bytes({"selected_token_ids": selected, "selected_token_mask": mask}))
        assert r.status_code == 422 and "--k 64" in r.json()["error"] and "40 ids" in r.json()["error"], r.text
        assert "--k 40 or less" in r.json()["fix"]
        client = running.client()
        selected, mask = _mapping(seed=2, size=100)
        client.set_vocab_mapping(selected, mask)
        ids, am, lm = _batch(seed=3, lengths=(5, 3))
        assert client.generate_batch(ids, am, lm).target_probs.shape == (2, 5, 100)
        client.close()
    finally:
        running.stop()


@pytest.mark.parametrize(("kw", "match"), [
    ({"supervision": "topk"}, "--supervision 'topk' cannot be served"),
    ({"keep_mass": 0.9}, "--keep-mass 0.9 needs the sparse draft target"),
    ({"supervision": "draft-topk", "keep_mass": 1.0}, "--keep-mass 1.0 is not a share"),
    ({"supervision": "draft-topk", "keep_mass": float("nan")}, "--keep-mass nan is not a share"),
    ({"supervision": "draft-topk", "k": 0}, "--k 0"),
    ({"supervision": "draft-topk", "tail": "clip"}, "--tail 'clip' is not one of"),
])
def test_settings_serve_cannot_honour_are_refused_naming_the_flag_and_the_fix(kw, match):
    with pytest.raises(UserError, match=match) as err:
        target_spec(ServeConfig(model="unused", **kw))
    assert err.value.fix
