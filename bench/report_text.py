"""The pieces every section of bench/RESULTS.md is made of: times, bytes, tables, provenance.

Pure formatting of what the results JSONs hold; imports nothing but the standard library, so
the report runs on a GPU image that has torch alone (bench/gpu_check.sh, step 4).
"""

from __future__ import annotations

# The PyTorch head's phases (its profiler spans, then the rest of the call): `_floor.PHASES`,
# spelled out because importing `_floor` would import torch and the package into the report.
PHASES = ("norm", "upcast", "gemm", "merge", "exp", "copy-out", "other")


def fmt_s(t):
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def fmt_bytes(n):
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def env_line(env: dict) -> str:
    """Where and when a results file was measured: device (and ISA), threads, load, date, git, versions."""
    v = env.get("versions", {})
    vers = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    dev = env.get("device_name", env.get("device"))
    if env.get("device") == "cpu":
        dev = f"{dev}, {env.get('cpu_isa', 'ISA not recorded')}"
    threads = f", {env['cpu_threads']} threads" if env.get("device") == "cpu" else ""
    load = (f", load average {env['load_average_start']:.1f} at the start"
            if env.get("device") == "cpu" and env.get("load_average_start") is not None else "")
    return (f"Measured on **{dev}** ({env.get('device')}{threads}{load}), {env.get('date')}, "
            f"git `{env.get('git_sha')}`; {vers}; python {env.get('python')}.")


def targets_md(lines: list) -> list[str]:
    if not lines:
        return []
    out = ["| result | target | measured |", "|---|---|---|"]
    for t in lines:
        out.append(f"| **{t['result']}** | {t['target']} | {t['detail']} |")
    return out + [""]


def table(headers, rows) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def phases_source(rec: dict) -> str:
    """How a record's phases were taken: the head's `torch.profiler` spans (`_floor.phases`), or,
    in results written before those spans existed, the head's former phase clock."""
    if rec.get("phases_by") == "torch.profiler":
        return "`torch.profiler` over the head's `record_function` spans, outside the timed rounds"
    return "the head's former phase clock: these results predate its `torch.profiler` spans"


def section_head(title: str, d: dict, intro: str) -> list[str]:
    """A section's opening: its title, where and when it was measured, what was run, its targets."""
    return [f"## {title}", "", env_line(d["environment"]), "", intro, "", *targets_md(d.get("targets", []))]
