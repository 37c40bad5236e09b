"""A vLLM engine that dies: the line that says why, the fix, and what it leaves behind.

vLLM reports a dead engine to the caller as "Engine core initialization failed. See root cause
above" or `EngineDeadError`; the cause is only in the engine processes' log, a traceback of a
hundred lines or more. The `eagle-fast` command holds those tracebacks back from the terminal
(quiet.py, unless -v) in the file ENGINE_LOG_ENV names; `engine_died` reads the root cause from it
(`root_cause`: the first exception that is not vLLM's own wrapper) into a `UserError` whose fix
says how to go on. A dead engine's processes never unlink the shared memory they created (vLLM's
message queues, hundreds of MiB in /dev/shm, until the parent exits); `release_orphaned_shm`
unlinks what appeared since the engine started and no live process maps any more.
Limits: without the held log (a library caller, or -v) the error says where the traceback is; a
segment created by another program in the same window and unmapped at that moment would be taken.
"""

from __future__ import annotations

import logging
import os
import re
from multiprocessing import resource_tracker
from pathlib import Path

from eagle_fast.errors import UserError

logger = logging.getLogger(__name__)

ENGINE_LOG_ENV = "EAGLE_FAST_ENGINE_LOG"  # set by the CLI: where the engine's tracebacks are held
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "psm_"  # multiprocessing.shared_memory's names
# An exception line of a Python traceback: `Type: message` or a bare `Type`.
_EXCEPTION_LINE = re.compile(r"^(?P<type>(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))"
                             r"(?::\s*(?P<message>.*))?$")
# vLLM's own wrappers around the real failure, never the cause themselves.
_WRAPPERS = ("EngineDeadError", "Worker failed with error", "Engine core initialization failed",
             "EngineCore encountered", "WorkerProc")


class EngineDied(UserError):
    """The vLLM engine's processes died; `cause` holds the root cause when it could be read."""


def root_cause(text: str) -> str | None:
    """The first exception line in a log of tracebacks that is not one of vLLM's wrappers, as
    `Type: message` (a bare assert: the line that failed), or None when there is none."""
    for line in text.splitlines():
        m = _EXCEPTION_LINE.match(line.strip())
        if m is None or any(w in line for w in _WRAPPERS):
            continue
        return line.strip()
    return None


def take_held_root_cause() -> str | None:
    """`root_cause` of the tracebacks the CLI held back (ENGINE_LOG_ENV), or None; the file is emptied,
    so what the CLI finds there at exit came after."""
    path = os.environ.get(ENGINE_LOG_ENV)
    if not path:
        return None
    try:
        text = Path(path).read_text(errors="replace")
        Path(path).write_text("")
    except OSError:
        return None
    return root_cause(text)


def engine_died(exc: BaseException, version: str, stage: str) -> EngineDied:
    """The UserError for a vLLM engine that died at `stage` ("start-up", "a run")."""
    cause = take_held_root_cause()
    said = f": {cause}" if cause else " (its traceback above, or with -v, names the cause)"
    return EngineDied(
        f"the vLLM engine (vllm {version}) died during {stage}{said}",
        "change the vLLM setting it names through --engine-args and re-run the same command: it resumes where "
        "it stopped; a changed checkpoint or the transformers engine (--engine hf) is another run, so give it a "
        "new --out once shards were written (-v shows the engine's whole traceback)")


def shm_names() -> set[str]:
    """The shared-memory segments in /dev/shm now (multiprocessing's `psm_` names)."""
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def mapped_shm(names: set[str]) -> set[str]:
    """Which of `names` some live process maps (its /proc/PID/maps names the segment)."""
    found: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        found |= {n for n in names if f"/dev/shm/{n}" in text}
    return found


def release_orphaned_shm(before: set[str]) -> list[str]:
    """Unlink the segments that appeared since `before` (taken as the engine started) and no live
    process maps, and take them off multiprocessing's resource tracker, which would otherwise warn
    of them as leaked at exit. Returns their names."""
    new = shm_names() - before
    orphans = sorted(new - mapped_shm(new))
    for name in orphans:
        try:
            (SHM_DIR / name).unlink()
        except OSError:
            continue
        try:
            resource_tracker.unregister(f"/{name}", "shared_memory")
        except Exception:
            logger.debug("resource tracker: cannot unregister %s", name, exc_info=True)
    if orphans:
        logger.debug("removed the dead engine's shared memory %s", orphans)
    return orphans
