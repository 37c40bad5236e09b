"""The processes a benchmark starts and watches: a free port, a child Python with the offline
environment, waiting for a server's /health, and a process's CPU seconds and memory from /proc.

Linux only (/proc). Used by bench_serve.py, serve_wire.py and bench_accept.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "NEMO_EAGLE_ENABLE_NCCL": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], **kw) -> subprocess.Popen:
    """`python ARGS` with the offline environment (no hub, no NCCL: one CPU machine)."""
    return subprocess.Popen([sys.executable, *args], env={**os.environ, **OFFLINE_ENV}, **kw)


def stop(proc: subprocess.Popen, wait: float = 60) -> None:
    """Terminate `proc`, and kill it if it has not exited after `wait` seconds."""
    proc.terminate()
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Return once `url`/health answers 200; raise if `proc` exits first or `timeout` passes."""
    import requests

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server {url} not healthy after {timeout} s")


def proc_kib(pid, key: str) -> int:
    """A /proc/PID/status field in KiB (VmRSS, VmHWM) of process `pid` ("self": this one)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def cpu_seconds(pid) -> float:
    """User + system CPU seconds of process `pid` ("self": this one), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reset_hwm(pid: int) -> None:
    """Reset process `pid`'s peak RSS (VmHWM) to its current RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
