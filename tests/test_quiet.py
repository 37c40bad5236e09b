"""`eagle-fast` shows its own progress and results only; `-v` shows every library's output too.

The demo runs once, as `make demo` runs it (its own process, the vLLM engine where installed):
its stderr holds no Python warning, no C++ warning and no traceback, and its stdout no log line.
What comes back with -v is shown on a short script that emits each kind of filtered message, in
its own process and in a child process (as vLLM's engine processes do), with and without -v.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings

import pytest

from eagle_fast.cli import build_parser
from eagle_fast.quiet import (
    LINES,
    RECORDS,
    WARNINGS,
    QuietRecords,
    copy_quietly,
    quiet_cli,
    quiet_line,
)

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
for _name in ("PYTHONWARNINGS", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"):
    ENV.pop(_name, None)

# Each filtered message as the libraries print it (vLLM 0.32, torch 2.13, transformers 5.18).
RECORD_SAMPLES = [
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'."),
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup."),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings, optimizations ... ignored."),
    ("vllm.config.vllm", ("max_num_scheduled_tokens is set to 4096 based on the speculative decoding settings. "
                         "This may lead to suboptimal performance. Consider increasing max_num_batched_tokens ...")),
    ("vllm.utils.ompmultiprocessing", ("Selected CPU core number (2) should be greater than reserved CPU core "
                                      "number (2).")),
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD. For best performance, ..."),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD. For best performance, ..."),
    ("vllm.v1.worker.cpu_worker", "Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause ..."),
    ("vllm.v1.sample.logits_processor", "min_p and logit_bias parameters won't work with speculative decoding."),
    ("vllm.utils.torch_utils", "OMP_NUM_THREADS=2 is set; leaving Torch threads at 2 for serving. ..."),
    ("vllm.v1.attention.backends.utils", "KV connector cache layout LBNHC does not satisfy every supported set"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", ("Initializing KVConnectorBase_V1. This API is "
                                                         "experimental and subject to change in the future")),
    ("vllm.renderers.base", "Chat template warmup failed"),
    ("vllm.renderers.base", "Using None for EOS token id because tokenizer is not initialized"),
    ("transformers.utils.import_utils", ("`Qwen2VLImageProcessor` requires torchvision (not installed); falling "
                                        "back to `Qwen2VLImageProcessorPil` for backward compatibility.")),
]
# Real problems from the same loggers: never filtered.
KEPT_RECORDS = [
    ("vllm.v1.worker.cpu_worker", "Node 1 is not in available memory nodes [0]."),
    ("vllm.renderers.base", "Failed to render the chat template: Chat template warmup failed"),
    ("vllm.config.vllm", "Disabling Triton."),
    ("vllm.engine", "Triton is installed, but doesn't include CPU backend. Disabling Triton."),  # another logger
]
TRITON = "Triton is installed, but doesn't include CPU backend. Disabling Triton."
NUMA = ("[W1206 10:08:02.964772169 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory "
        "allocation on the NUMA nodes (0). Memory allocations will be strictly bound to these NUMA nodes. "
        "(function init_cpu_memory_env)")
BAR = "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 28.56it/s]"


def _record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)


def test_every_table_entry_has_a_reason_and_a_sample():
    for entry in (*WARNINGS, *RECORDS, *LINES):
        assert len(entry[-1]) > 10, entry
    for name, pattern, _ in RECORDS:
        assert any(n == name and re.match(pattern, m) for n, m in RECORD_SAMPLES), (name, pattern)


@pytest.mark.parametrize("name, message", RECORD_SAMPLES)
def test_named_records_are_dropped(name, message):
    assert not QuietRecords().filter(_record(name, message))


@pytest.mark.parametrize("name, message", KEPT_RECORDS)
def test_other_records_pass(name, message):
    assert QuietRecords().filter(_record(name, message))


@pytest.mark.parametrize("line, quiet", [
    (TRITON, True),
    (NUMA, True),
    (BAR, True),
    ("\r" + BAR.replace("100%", "  0%") + "\r" + BAR, True),  # a bar's updates on a terminal
    ("`Qwen2VLImageProcessor` requires torchvision (not installed); falling back to `X` ...", True),
    ("Traceback (most recent call last):", False),
    ("RuntimeError: " + TRITON, False),
    (NUMA.replace("NUMA binding: Using MEMBIND", "NUMA binding failed: no MEMBIND"), False),
    ("[W1206 10:08:02.9 utils.cpp:12] Warning: something else (function init_cpu_memory_env)", False),
    ("\r" + BAR + "\rout of memory", False),
    ("", False),
])
def test_stderr_lines(line, quiet):
    assert quiet_line(line.encode()) is quiet


def test_the_fd2_filter_shows_a_bar_as_it_moves_and_drops_a_named_one():
    """`copy_quietly` over a pipe, as the engine processes' stderr goes: another program's progress
    bar (carriage-return updates, faster than IDLE_S) shows each update as it comes, not when it
    stops; vLLM's loading bar, named in LINES, never shows; plain lines pass whole."""
    import select
    import threading

    src_r, src_w = os.pipe()
    out_r, out_w = os.pipe()
    t = threading.Thread(target=copy_quietly, args=(src_r, out_w), daemon=True)
    t.start()

    def read_now() -> bytes:
        got = b""
        while select.select([out_r], [], [], 0.1)[0]:
            got += os.read(out_r, 1 << 16)
        return got

    try:
        for pct in (10, 20):
            os.write(src_w, f"capturing graphs {pct}%\r".encode())
            assert read_now() == f"capturing graphs {pct}%\r".encode()  # within 0.1 s, not at the end
        os.write(src_w, b"Loading safetensors checkpoint shards: 50%\r")
        assert read_now() == b""
        os.write(src_w, b"Loading safetensors checkpoint shards: 100%\nengine died: out of memory\n")
        assert read_now() == b"engine died: out of memory\n"
    finally:
        os.close(src_w)
        t.join(timeout=5)
        os.close(src_r)
        os.close(out_w)
        os.close(out_r)


def test_quiet_cli_leaves_no_state(monkeypatch):
    for name in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.delenv(name, raising=False)
    before = (dict(os.environ), list(warnings.filters), {n: list(logging.getLogger(n).filters) for n, *_ in RECORDS})
    with quiet_cli(verbose=False, model_bars=False):
        assert "VLLM_LOGGING_CONFIG_PATH" in os.environ and "reduce_op" in os.environ["PYTHONWARNINGS"]
        assert not logging.getLogger("vllm.renderers.base").filter(_record("vllm.renderers.base",
                                                                          "Chat template warmup failed"))
    assert (dict(os.environ), list(warnings.filters),
            {n: list(logging.getLogger(n).filters) for n, *_ in RECORDS}) == before


@pytest.mark.parametrize("argv, verbose", [
    (["demo"], False), (["-v", "demo"], True), (["demo", "-v"], True), (["merge", "d", "--verbose"], True),
])
def test_verbose_before_or_after_the_command(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


# What the libraries print, in this process and in a child (vLLM's engine processes are
# children that inherit fd 2 and the environment); a real problem among them each time.
PROBE = r"""
import logging, os, subprocess, sys, warnings
from eagle_fast.quiet import quiet_cli

CHILD = '''
import logging, os, warnings
import vllm.triton_utils  # the real import-time Triton line, before vLLM's logging is set up
warnings.warn_explicit("`torch.distributed.reduce_op` is deprecated, please use ReduceOp", FutureWarning,
                       "dispatcher.py", 138, module="vllm.triton_utils.dispatcher")
warnings.warn("child: a real problem")
os.write(2, NUMA.encode() + b"\\n" + BAR.encode() + b"\\n")
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # as each engine process does
logging.getLogger("vllm.renderers.base").warning("Chat template warmup failed")
logging.getLogger("vllm.v1.worker.cpu_worker").warning("child: Node 1 is not in available memory nodes [0].")
'''
with quiet_cli(sys.argv[1] == "-v", model_bars=False):
    warnings.warn_explicit("`torch.distributed.reduce_op` is deprecated, please use ReduceOp", FutureWarning,
                           "dispatcher.py", 138, module="vllm.triton_utils.dispatcher")
    warnings.warn("parent: a real problem")
    logging.getLogger("vllm.renderers.base").warning("Using None for EOS token id because tokenizer is not "
                                                     "initialized")
    logging.getLogger("vllm.v1.worker.cpu_worker").warning("parent: Node 1 is not in available memory nodes")
    subprocess.run([sys.executable, "-c", f"NUMA = {NUMA!r}; BAR = {BAR!r}" + CHILD], check=True)
print("probe done", file=sys.stderr)
"""
FILTERED = ("Triton is installed", "reduce_op", "MEMBIND", "Loading safetensors", "Chat template warmup",
            "Using None for EOS")
KEPT = ("parent: a real problem", "child: a real problem", "parent: Node 1", "child: Node 1", "probe done")


@pytest.mark.parametrize("flag", ["", "-v"])
def test_filtered_messages_come_back_with_verbose(flag):
    pytest.importorskip("vllm")
    script = f"NUMA = {NUMA!r}; BAR = {BAR!r}\n" + PROBE
    res = subprocess.run([sys.executable, "-c", script, flag], capture_output=True, text=True, env=ENV,
                         timeout=300, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    for needle in KEPT:
        assert needle in out, (needle, out)
    for needle in FILTERED:
        assert (needle in out) is (flag == "-v"), (needle, out)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`eagle-fast demo` once, in its own process as `make demo` runs it, on a fresh cache."""
    root = tmp_path_factory.mktemp("quiet_demo")
    res = subprocess.run([sys.executable, "-m", "eagle_fast", "demo", "--out", str(root / "ds"),
                          "--cache", str(root / "cache")], capture_output=True, text=True, env=ENV,
                         timeout=1200, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def test_demo_shows_its_own_output_only(demo):
    err = demo.stderr
    assert "Warning:" not in err and "Traceback" not in err, err
    assert not re.search(r"^\S+:\d+: \w*Warning: ", err, re.MULTILINE), err  # the warnings module's format
    assert not re.search(r"^(\(\w+ pid=\d+\) )?WARNING \d\d-\d\d ", err, re.MULTILINE), err  # vLLM's own format
    for needle in FILTERED:
        assert needle not in err, (needle, err)
    assert "eagle-fast: [4/4]" in err and "verify: PASS" in demo.stdout
    # vLLM's log lines ("(EngineCore pid=...) INFO ...") stay off stdout, where the results go
    assert not re.search(r"^\(\w+ pid=\d+\)|^(INFO|WARNING) \d", demo.stdout, re.MULTILINE), demo.stdout
