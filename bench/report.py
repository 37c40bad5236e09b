"""Turn bench/results/*.json into bench/RESULTS.md (tables) and bench/results/lm_head-*.png (plots).

What it does
    Reads every results file the benchmarks wrote (lm_head-cpu.json, lm_head-cuda.json,
    runner-cpu.json, pipeline-cpu.json; whichever exist) and writes:
      - bench/RESULTS.md: per file, where/when it was measured, the targets as PASS/FAIL, then
        tables (the target case, the vocabulary sweep per output mode, the runner, the pipeline);
      - bench/results/lm_head-<device>.png: time and peak extra memory vs vocabulary size, one
        line per provider, one column per output mode (matplotlib, Agg backend).

Design
    Pure post-processing: no benchmark is re-run, so `python bench/report.py` refreshes the
    page after results are added by hand (e.g. a GPU run's JSON from gpu_check.sh). Every ratio
    printed is between numbers from the same file, i.e. the same run.

Limits
    Without matplotlib the plots are skipped with a message (the GPU image may lack it); the
    Markdown is always written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAGE = HERE / "RESULTS.md"
# set by build(): where the page is written (image links are relative to it) and the results
_PAGE_DIR, _RESULTS_DIR = HERE, RESULTS

PROVIDER_ORDER = ("seed-fp32", "torch-native", "lm_head-torch", "lm_head-triton", "gemm-bf16")
MODE_ORDER = ("all", "lse+argmax", "topk64", "draft32k", "logits-bf16")


def fmt_s(t):
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def fmt_b(n):
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def _env_line(env: dict) -> str:
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


def _targets_md(lines: list) -> list[str]:
    if not lines:
        return []
    out = ["| result | target | measured |", "|---|---|---|"]
    for t in lines:
        out.append(f"| **{t['result']}** | {t['target']} | {t['detail']} |")
    return out + [""]


def _table(headers, rows) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def _providers(records):
    present = {r["provider"] for r in records}
    return [p for p in PROVIDER_ORDER if p in present]


def lm_head_section(d: dict) -> list[str]:
    env, recs = d["environment"], d["records"]
    dev = env.get("device")
    out = [f"## Head op (`eagle_fast.kernels.lm_head`), {dev.upper()}", "", _env_line(env), ""]
    out += ["Providers: " + "; ".join(f"`{k}` = {v}" for k, v in d.get("providers", {}).items()
                                      if k in _providers(recs)) + ".", ""]
    out += _targets_md(d.get("targets", []))
    # group by (shape, N, mode)
    cases = []
    for r in recs:
        key = (r["shape"], r["n_tokens"], r["mode"])
        if key not in cases:
            cases.append(key)
    provs = _providers(recs)

    def get(key, p):
        for r in recs:
            if (r["shape"], r["n_tokens"], r["mode"]) == key and r["provider"] == p:
                return r
        return None

    # Full detail for the cases the targets are stated on.
    target_keys = [tuple(k) for k in d.get("target_cases", []) if tuple(k) in cases]
    for key in target_keys:
        shape = next(r for r in recs if (r["shape"], r["n_tokens"], r["mode"]) == key)
        out.append(f"### {key[0]}: N={key[1]:,}, H={shape['hidden']}, V={shape['vocab']:,}, mode `{key[2]}`")
        out.append("")
        seed = get(key, "seed-fp32")
        seed_mem = (seed.get("peak_extra_bytes_subprocess") or seed["peak_extra_bytes"]) if seed else None
        rows = []
        for p in provs:
            r = get(key, p)
            if r is None:
                continue
            vs = (f"{r['median_s'] / seed['median_s']:.2f}x" if (seed and seed["median_s"] and r["median_s"]) else "-")
            mem = r.get("peak_extra_bytes_subprocess") or r["peak_extra_bytes"]
            memvs = f"{100 * mem / seed_mem:.0f}%" if (seed_mem and mem is not None) else "-"
            rows.append([f"`{p}`", fmt_s(r["median_s"]), f"x{r['n_timed']}", vs,
                         f"{r['tflops']:.3f}" if r["tflops"] else "-", fmt_b(mem), memvs,
                         fmt_b(mem / r["n_tokens"]) if mem is not None else "-",
                         fmt_b(r.get("resident_bytes") or None), r["status"]])
        out += _table(["provider", "median", "rounds", "time vs seed", "TFLOP/s", "peak extra",
                       "mem vs seed", "per token", "resident", "status"], rows)
    if any(r.get("peak_extra_bytes_subprocess") for r in recs):
        out += [("Peak extra memory of the target case: each provider in a fresh subprocess (inputs built, "
                "then one call; peak RSS above the RSS before the call). Elsewhere: the first call in the "
                "benchmark process, with malloc returning freed blocks to the OS."), ""]
    # Sweep: one table per mode, rows = shapes by V, cells = time (x seed) / memory.
    sweep = [k for k in cases if k[2] != "all"]
    modes = [m for m in MODE_ORDER if any(k[2] == m for k in sweep)]
    if sweep:
        out.append("### Vocabulary sweep")
        out.append("")
        out.append("Each cell: median time (ratio to `seed-fp32` in the same run) / peak extra memory.")
        out.append("")
    for m in modes:
        keys = sorted([k for k in sweep if k[2] == m], key=lambda k: (get(k, provs[0]) or {}).get("vocab", 0))
        rows = []
        for k in keys:
            any_r = next(r for r in recs if (r["shape"], r["n_tokens"], r["mode"]) == k)
            seed = get(k, "seed-fp32")
            cells = [f"{k[0]}", f"{any_r['vocab']:,}", f"{any_r['hidden']}", f"{k[1]}"]
            for p in provs:
                r = get(k, p)
                if r is None or r["median_s"] is None:
                    cells.append("-")
                    continue
                vs = f" ({r['median_s'] / seed['median_s']:.2f}x)" if seed and seed["median_s"] else ""
                cells.append(f"{fmt_s(r['median_s'])}{vs} / {fmt_b(r['peak_extra_bytes'])}")
            rows.append(cells)
        out.append(f"**mode `{m}`**")
        out.append("")
        out += _table(["shape", "V", "H", "N"] + [f"`{p}`" for p in provs], rows)
    if d.get("skipped"):
        out += [f"Skipped (time budget): {', '.join(d['skipped'])}", ""]
    png = _RESULTS_DIR / f"lm_head-{dev}.png"
    if png.exists():
        rel = os.path.relpath(png, _PAGE_DIR)
        out += [f"![time and memory vs vocabulary size, {dev}]({rel})", ""]
    return out


def runner_section(d: dict) -> list[str]:
    env, s = d["environment"], d["setup"]
    out = ["## Runner (`VLLMTargetRunner`) vs the seed's method", "", _env_line(env), "",
           (f"Tiny Qwen3 (random; H={s['spec']['hidden_size']}, {s['spec']['num_hidden_layers']} layers, "
           f"V={s['spec']['vocab_size']:,}, tied, bf16), B={s['batch']}, S={s['seq']}, right-padded: "
           f"{s['real_tokens']:,} real of {s['padded_tokens']:,} positions. Draft vocab {s['draft_vocab']:,}; "
           f"draft projection: {s['draft_projection']}. Engine start {s['engine_start_s']:.0f} s (not in any number "
           f"below). The seed's fp32 head copy holds {fmt_b(s['seed_resident_bytes'])} for the runner's lifetime "
           "(not counted in its per-call peak)."), ""]
    out += _targets_md(d.get("targets", []))
    by = {r["method"]: r for r in d["records"]}
    seed = by.get("seed-forward_eagle3")
    rows = []
    for r in d["records"]:
        engine_only = r["method"].startswith("capture")  # no head: not comparable work
        vs = (f"{r['tokens_per_s'] / seed['tokens_per_s']:.2f}x"
              if (seed and seed["tokens_per_s"] and r["tokens_per_s"] and not engine_only) else "-")
        mem = (f"{100 * r['peak_extra_bytes'] / seed['peak_extra_bytes']:.0f}%"
               if (seed and seed["peak_extra_bytes"] and r["peak_extra_bytes"] is not None and not engine_only)
               else "-")
        rows.append([f"`{r['method']}`", fmt_s(r["median_s"]), f"x{r['n_timed']}",
                     f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-", vs,
                     f"{100 * r['head_share']:.0f}%" if r["head_share"] is not None else "-",
                     fmt_b(r["peak_extra_bytes"]), mem, fmt_b(r.get("output_bytes")),
                     fmt_b(r.get("real_output_bytes")), r["status"]])
    out += _table(["method", "median", "rounds", "tokens/s", "vs seed", "head share", "peak extra",
                   "mem vs seed", "returned", "returned, non-pad", "status"], rows)
    if d.get("cross_check"):
        out += ["Cross-check on non-pad positions: " + ", ".join(
            f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in d["cross_check"].items()), ""]
    return out


def pipeline_section(d: dict) -> list[str]:
    env, s = d["environment"], d["setup"]
    out = ["## Pipeline (`eagle-fast extract`), vLLM vs HF engine", "", _env_line(env), "",
           (f"{s['model']}; {s['samples']} samples, {s['tokens']:,} tokens; supervision {s['supervision']}; "
           f"layout {s['layout']}. tokens/s = tokens / engine-loop time in steady state: engine start-up and "
           "shutdown are excluded (the pipeline's own figure is in the JSON as tokens_per_s_reported). Shares are "
           "of the engine loop; the writer is a separate thread, so shares may sum past 100 %."), ""]
    out += _targets_md(d.get("targets", []))
    rows = []
    for r in d["records"]:
        if r["status"] != "ok":
            rows.append([r["engine"], "-", "-", "-", "-", "-", "-", "-", r["status"][:120]])
            continue
        rows.append([r["engine"], f"{r['tokens_per_s']:.0f}", f"{r['loop_s']:.1f} s", f"{r['build_s']:.1f} s",
                     f"{100 * r['head_share']:.0f}%", f"{100 * r['engine_share']:.0f}%",
                     f"{100 * r['read_share']:.0f}%", f"{100 * r['write_share']:.0f}%", "ok"])
    out += _table(["engine", "tokens/s", "loop", "build", "head", "engine (capture)", "read", "write", "status"], rows)
    return out


def plot_lm_head(d: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib not installed; plot skipped", file=sys.stderr)
        return False
    # Sweep points: one shape per vocabulary (the widest H when two share a V, e.g. Qwen3-8B
    # and Qwen3-0.6B on GPU), at the sweep's N.
    recs = [r for r in d["records"] if r["mode"] != "all"]
    if not recs:
        return False
    n_sweep = min(r["n_tokens"] for r in recs)
    recs = [r for r in recs if r["n_tokens"] == n_sweep]
    widest = {}
    for r in recs:
        widest[r["vocab"]] = max(widest.get(r["vocab"], 0), r["hidden"])
    recs = [r for r in recs if r["hidden"] == widest[r["vocab"]]]
    modes = [m for m in MODE_ORDER if any(r["mode"] == m for r in recs)]
    provs = _providers(recs)
    fig, axes = plt.subplots(2, len(modes), figsize=(4.2 * len(modes), 7), squeeze=False)
    for j, m in enumerate(modes):
        for p in provs:
            pts = sorted((r["vocab"], r["median_s"], r["peak_extra_bytes"]) for r in recs
                         if r["mode"] == m and r["provider"] == p and r["median_s"])
            if not pts:
                continue
            v = [x[0] for x in pts]
            axes[0][j].plot(v, [x[1] * 1e3 for x in pts], marker="o", label=p)
            axes[1][j].plot(v, [(x[2] or 0) / 1e6 for x in pts], marker="o", label=p)
        axes[0][j].set_title(f"{m}")
        axes[0][j].set_yscale("log")
        axes[1][j].set_yscale("log")
        axes[0][j].set_ylabel("median time (ms)")
        axes[1][j].set_ylabel("peak extra memory (MB)")
        axes[1][j].set_xlabel("vocabulary size V")
        for ax in (axes[0][j], axes[1][j]):
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    env = d["environment"]
    hs = sorted({r["hidden"] for r in recs})
    fig.suptitle(f"lm_head providers, {env.get('device_name')} ({env.get('device')}), N={n_sweep}, "
                 f"H={'/'.join(map(str, hs))}, bf16 weights; {env.get('date', '')[:10]} {env.get('git_sha', '')[:12]}",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def cpu_ops_section(d: dict) -> list[str]:
    """The CPU building blocks the PyTorch head path rests on (bench_cpu_ops.py)."""
    g, r, t, c = d["gemm_tile"], d["reductions"], d["tile_sweep"], d["call_overhead"]
    out = ["## CPU building blocks of the PyTorch head (`bench_cpu_ops.py`)", "", _env_line(d["environment"]), ""]
    out += [("GEMM tile [1024 x 256] @ [256 x 1024] -> fp32 from bf16 operands "
            f"(bf16 math in hardware: {g.get('bf16_in_hardware')}):"), ""]
    out += _table(["variant", "median", "vs fp32", "max abs error vs float64"],
                  [[k, fmt_s(v), f"{g['speedup_vs_fp32'][k]:.2f}x", f"{g['max_abs_err_vs_fp64'][k]:.2g}"]
                   for k, v in g["seconds"].items()])
    out += _table(["pass over a [1024 x 1024] fp32 tile", "median", "G elements/s"],
                  [[f"`{k}`", fmt_s(v), f"{r['g_elements_per_s'][k]:.2f}"] for k, v in r["seconds"].items()])
    out += [(f"`lm_head(outputs=(\"draft\", \"argmax\"))`, N={t['rows']}, H=256, V=151,936, 32k draft ids, "
             f"by tile shape [R x C] (default {t['default']}):"), ""]
    out += _table(["tile", "median"], [[k, fmt_s(v)] for k, v in t["seconds"].items()])
    out += _table(["one call", "median", "per token"],
                  [[k, fmt_s(v), fmt_s(c["per_token_s"][k])] for k, v in c["seconds"].items()])
    if "fixed_s" in c:
        out += [f"Fixed cost of one call (the line through both points at N=0): {fmt_s(c['fixed_s'])}.", ""]
    return out


def build(results: Path = RESULTS, page: Path = PAGE) -> str:
    global _PAGE_DIR, _RESULTS_DIR
    _PAGE_DIR, _RESULTS_DIR = Path(page).resolve().parent, Path(results).resolve()
    out = ["# Benchmark results", "",
           ("Generated by `bench/report.py` from `bench/results/*.json`; do not edit by hand. How each number "
           "is measured: [bench/README.md](README.md) (next to this page in bench/). CPU numbers come from a shared 2-core machine: "
           "only ratios within one run are claims; absolute times are only meaningful from a GPU."), ""]
    files = {p.stem: p for p in sorted(results.glob("*.json"))}
    head_files = [files[k] for k in ("lm_head-cuda", "lm_head-cpu") if k in files]
    if "lm_head-cuda" not in files:
        out += ["## Head op, GPU", "", ("Not measured yet: no CUDA machine has run `bench/gpu_check.sh` "
                "(it writes `bench/results/lm_head-cuda.json`; then run `python bench/report.py`)."), ""]
    for p in head_files:
        d = json.loads(p.read_text())
        plot_lm_head(d, results / f"{p.stem}.png")
        out += lm_head_section(d)
    if "runner-cpu" in files:
        out += runner_section(json.loads(files["runner-cpu"].read_text()))
    if "pipeline-cpu" in files:
        out += pipeline_section(json.loads(files["pipeline-cpu"].read_text()))
    if "cpu_ops-cpu" in files:
        out += cpu_ops_section(json.loads(files["cpu_ops-cpu"].read_text()))
    text = "\n".join(out).rstrip() + "\n"
    page.write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--page", type=Path, default=PAGE)
    a = ap.parse_args(argv)
    build(a.results, a.page)
    print(f"wrote {a.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
