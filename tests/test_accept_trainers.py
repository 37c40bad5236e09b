"""The accept length bench_accept gives a speculators- or SpecForge-trained draft is NeMo's own.

bench/accept_trainers.py judges every draft from its per-step greedy ids, counted as NeMo
AutoModel's Eagle3TrainerModule counts prefix hits (`prefix_counts`). On a NeMo draft, where both
apply, the mapping must reproduce NeMo's counters exactly, on samples with a gappy loss mask and
targets outside the draft vocabulary; ids one slot off must not.
"""

from __future__ import annotations

import pytest
import torch
from _bench import load_bench

pytest.importorskip("nemo_automodel", reason="NeMo AutoModel is in requirements/cpu.lock")

DRAFT = 97
TTT = 3


@pytest.fixture(scope="module")
def nemo(tiny_llama):
    """A NeMo draft in its trainer module, and samples whose targets it half-hits."""
    A = load_bench("accept")
    T = load_bench("accept_trainers")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(cfg.vocab_size, generator=g)[:DRAFT].sort().values
    mask = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    mask[ids] = True
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    trainer = A.build_trainer(tiny_llama, ids, mask, emb, ttt_steps=TTT, seed=0).eval()
    samples = []
    for n in (5, 23, 41):
        s = {"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g),
             "loss_mask": (torch.rand(n, generator=g) > 0.2).to(torch.int64),
             "aux_hidden_states": torch.randn(n, 3 * cfg.hidden_size, generator=g),
             "target_probs": torch.softmax(torch.randn(n, DRAFT, generator=g), -1),
             "position_mask": (torch.rand(n, 1, generator=g) > 0.2)}
        s["loss_mask"][-1] = 0
        s["position_mask"][-1] = False
        s["target_probs"][-1] = 0
        # half the targets are the draft's own step-0 choice, so there are hits to count
        own = T.nemo_predict(trainer, s)[0]
        hit = torch.rand(n, generator=g) > 0.5
        s["target_probs"][hit] = torch.nn.functional.one_hot(own[hit], DRAFT).float()
        samples.append(s)
    return T, trainer, samples


def test_mapped_accept_length_is_nemos(nemo):
    T, trainer, samples = nemo
    check = T.check_measure(trainer, samples)
    assert check["equal"] and check["step_prefix_hits"][0] > 0
    assert check["step_valid"][0] > check["step_valid"][-1]  # the gaps end chains


def test_ids_one_slot_off_are_told_apart(nemo):
    T, trainer, samples = nemo
    right = T.accept_from(lambda s: T.nemo_predict(trainer, s), samples)
    off = T.accept_from(lambda s: [torch.roll(p, 1) for p in T.nemo_predict(trainer, s)], samples)
    assert off["step_prefix_hits"][0] < right["step_prefix_hits"][0]
