"""The engine check's rule (`pipeline.engine_setup.engine_check`), on runners that report given
figures: the tolerance by dtype (a fixed 1e-3 in fp32; relative to the largest logit in 16 bits),
NaN never passing, the skips and their reasons, and which sequences it runs. The real engine's
check (a dropped head rule, a final slot one layer early) is in test_e2e_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle_fast.errors import UserError
from eagle_fast.inputs import SamplePlan, ShardPlan
from eagle_fast.pipeline.engine_setup import (
    CHECK_SEQUENCES,
    CHECK_TOKENS,
    check_sequences,
    engine_check,
)


class Reporting:
    """A runner whose check reports `err` with `logit` as its largest |logit|."""

    def __init__(self, err: float, logit: float = 20.0, dtype=torch.float32):
        self.err, self.logit, self.dtype, self.calls = err, logit, dtype, []
        self.head = SimpleNamespace(spec="HeadSpec(norm='rms')")

    def check_against_engine(self, sequences, num_logprobs):
        self.calls.append((len(sequences), num_logprobs))
        return {"top1_agreement": 1.0, "max_abs_err": self.err, "positions": 7, "max_abs_logit": self.logit}


SEQS = [[1, 2, 3], [4, 5]]


@pytest.mark.parametrize("dtype, logit, err, ok", [
    (torch.float32, 20.0, 9e-4, True), (torch.float32, 20.0, 2e-3, False),
    (torch.bfloat16, 20.0, 0.6, True), (torch.bfloat16, 20.0, 0.7, False),
    (torch.bfloat16, 1.0, 0.2, False), (torch.float16, 20.0, 0.07, True), (torch.float16, 20.0, 0.1, False),
    (torch.float32, 20.0, float("nan"), False),
])
def test_tolerance_by_dtype(dtype, logit, err, ok):
    runner = Reporting(err, logit, dtype)
    if ok:
        fig = engine_check(runner, "vllm", SEQS)
        assert fig["max_abs_err"] == err and fig["sequences"] == 2 and fig["tokens"] == 5
        assert "max_abs_logit" not in fig and fig["tolerance"] >= err
    else:
        with pytest.raises(UserError, match=r"engine check: .* differ from vLLM's own prompt log-probs") as e:
            engine_check(runner, "vllm", SEQS)
        assert "HeadSpec(norm='rms')" in e.value.cause and "nothing was stored" in e.value.fix
    assert runner.calls == [(2, 5)]


def test_skips_say_why_and_run_nothing():
    runner = Reporting(1.0)
    assert engine_check(runner, "vllm", SEQS, enabled=False) == {"skipped": "--no-engine-check"}
    assert "hf engine" in engine_check(runner, "hf", SEQS)["skipped"]
    assert "--head-in-worker" in engine_check(runner, "vllm", SEQS, head_in_worker=True)["skipped"]
    assert "cannot be checked" in engine_check(object(), "vllm", SEQS)["skipped"]
    assert runner.calls == []


def test_check_sequences_are_the_first_shards_first_samples():
    samples = [SamplePlan(i, i + 1, list(range(n)), [1] * n) for i, n in enumerate([600, 1, 30, 40, 50, 60])]
    p = SimpleNamespace(pending=[ShardPlan(3, samples), ShardPlan(4, samples[:1])])
    seqs = check_sequences(p)
    assert seqs == [list(range(CHECK_TOKENS)), list(range(30)), list(range(40))]  # a 1-token sample has no position
    assert len(seqs) <= CHECK_SEQUENCES and check_sequences(SimpleNamespace(pending=[])) == []


def test_the_engine_diff_runs_in_row_blocks_with_the_same_figures():
    """`captures.diff_against_engine` bounds the head's fp32 rows per call (a real vocabulary's
    [T, V] would take GBs); any block size gives the figures of one whole call (up to rounding)."""
    from eagle_fast.head import HeadSpec, TargetHead
    from eagle_fast.runners.captures import diff_against_engine

    torch.manual_seed(0)
    V, H, T = 300, 32, 23
    head = TargetHead(torch.randn(V, H), torch.rand(H) + 0.5, HeadSpec(norm="rms", eps=1e-6))
    final = torch.randn(T, H)
    full = head.compute(final, ("logprobs",)).logprobs
    lps = [None] + [{int(i): float(full[t - 1, i]) + (0.01 if t == 7 else 0.0) for i in full[t - 1].topk(5).indices}
                    for t in range(1, T)]
    whole = diff_against_engine(head, [lps], [(None, final)])
    assert whole["positions"] == T - 1 and whole["top1_agreement"] == 1.0
    assert abs(whole["max_abs_err"] - 0.01) < 1e-5
    for rows in (1, 5, 22):  # the same figures, up to the GEMM's rounding for another row count
        part = diff_against_engine(head, [lps], [(None, final)], max_bytes=4 * V * rows)
        assert (part["positions"], part["top1_agreement"]) == (whole["positions"], whole["top1_agreement"])
        for key in ("max_abs_err", "max_abs_logit"):
            assert part[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
