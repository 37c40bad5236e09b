"""NaN logits in the head: ids stay real ids, both paths agree, NaN shows where it belongs.

What: a NaN weight row (whole, or a few of its entries), a whole NaN vocabulary tile, and
a NaN hidden state, through the Triton kernel (in the interpreter: tiles 512 wide, V=1100
gives 3, the last one ragged) and the PyTorch path. The rule both follow: a NaN logit ranks
as +inf (lowest id first), so argmax, top-k and draft ids are in range (a GPU would
otherwise index out of bounds, a device-side assert), the draft mapping does not crash, and
the row's lse is NaN. Rows without a NaN logit keep their clean outputs.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from eagle_fast.kernels import lm_head
from test_lm_head import make_inputs, random_draft

N, H, V = 6, 64, 1100
MODES = {
    "lse": (("lse",), {}),
    "draft": (("draft",), {"draft": True}),
    "topk": (("topk",), {"k": 4}),
    "draft_topk": (("draft_topk",), {"k": 4, "draft": True}),
}


def _poisoned(case: str, gen):
    """(hidden, weight, norm_weight, draft_ids, nan_rows [N] bool, expected argmax [N]) with the
    NaN placed as `case` says; draft_ids hold the poisoned ids."""
    hidden, weight, norm_weight = make_inputs(gen, N, H, V, torch.bfloat16)
    bad = torch.tensor([V - 3])
    if case == "weight_row":
        weight[bad] = float("nan")
    elif case == "weight_row_part":
        weight[bad, 5:9] = float("nan")
    elif case == "weight_last_tile":  # every id of the last 512-wide tile
        bad = torch.arange(1024, V)
        weight[bad] = float("nan")
    draft = random_draft(gen, V, 300)
    if case == "hidden_row":  # row 1's logits are all NaN: argmax id 0
        hidden[1, 3] = float("nan")
        draft = torch.unique(torch.cat([draft, torch.tensor([0])]))
        nan_rows = torch.arange(N) == 1
        want = torch.where(nan_rows, 0, -1)
    else:
        draft = torch.unique(torch.cat([draft, bad]))
        nan_rows = torch.ones(N, dtype=torch.bool)
        want = torch.full((N,), int(bad[0]))
    return hidden, weight, norm_weight, draft, nan_rows, want


def _run(mode, impl, hidden, weight, norm_weight, draft):
    outputs, kw = MODES[mode]
    kw = dict(kw)
    if kw.pop("draft", False):
        kw["draft_ids"] = draft
    return lm_head(hidden, weight, norm_weight, outputs=outputs, impl=impl, **kw)


def _ids(out):
    return out.topk_ids if out.topk_ids is not None else out.draft_topk_ids


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "case", ["weight_row", "weight_row_part", "weight_last_tile", "hidden_row"]
)
def test_nan_logits_give_real_ids_and_both_paths_agree(case, mode, request):
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    hidden, weight, norm_weight, draft, nan_rows, want = _poisoned(case, gen)
    outs = {
        impl: _run(mode, impl, hidden, weight, norm_weight, draft) for impl in ("torch", "triton")
    }
    for impl, out in outs.items():
        assert bool(((out.argmax >= 0) & (out.argmax < V)).all()), f"{impl}: argmax {out.argmax}"
        ids = _ids(out)
        if ids is not None:
            bound = draft.numel() if mode == "draft_topk" else V
            assert bool(((ids >= 0) & (ids < bound)).all()), f"{impl}: top-k ids {ids}"
        # a NaN logit ranks as +inf, lowest id first
        got = out.argmax[nan_rows]
        assert torch.equal(got, want[nan_rows]), f"{impl}: argmax of NaN rows {got}"
        if out.lse is not None:
            assert bool(out.lse[nan_rows].isnan().all()), f"{impl}: lse {out.lse}"
            assert bool(out.lse[~nan_rows].isfinite().all()), f"{impl}: lse {out.lse}"
        if out.argmax_in_draft is not None:
            assert bool(out.argmax_in_draft[nan_rows].all()), f"{impl}: {out.argmax_in_draft}"
    ref, tri = outs["torch"], outs["triton"]
    assert torch.equal(tri.argmax, ref.argmax), f"argmax: triton {tri.argmax} torch {ref.argmax}"
    if _ids(ref) is not None:
        assert torch.equal(_ids(tri), _ids(ref)), f"ids: triton {_ids(tri)} torch {_ids(ref)}"
    if ref.argmax_in_draft is not None:
        assert torch.equal(tri.argmax_in_draft, ref.argmax_in_draft)


def test_rows_without_nan_keep_their_outputs(request):
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    hidden, weight, norm_weight, draft, nan_rows, _ = _poisoned("hidden_row", gen)
    clean_hidden = hidden.clone()
    clean_hidden[nan_rows] = 1.0
    for mode in ("lse", "topk"):
        got = _run(mode, "triton", hidden, weight, norm_weight, draft)
        clean = _run(mode, "triton", clean_hidden, weight, norm_weight, draft)
        ok = ~nan_rows
        assert torch.equal(got.argmax[ok], clean.argmax[ok])
        assert torch.equal(got.lse[ok], clean.lse[ok])
        if mode == "topk":
            assert torch.equal(got.topk_ids[ok], clean.topk_ids[ok])
            assert torch.equal(got.topk_logprobs[ok], clean.topk_logprobs[ok])
