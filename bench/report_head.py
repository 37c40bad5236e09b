"""The head's pages of bench/RESULTS.md: the head op per device, its floor table, its plot, and
the CPU building blocks of the PyTorch head (bench_cpu_ops.py).

Limits: without matplotlib the plot is skipped with a message (a GPU image may lack it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from report_text import (
    PHASES,
    env_line,
    fmt_bytes,
    fmt_s,
    phases_source,
    section_head,
    table,
    targets_md,
)

PROVIDER_ORDER = ("seed-fp32", "torch-native", "lm_head-torch", "lm_head-triton", "lm_head-triton-before",
                  "lm_head-triton-persistent", "gemm-floor", "gemm-fp32out")
MODE_ORDER = ("all", "lse+argmax", "topk64", "draft32k", "draft-topk64", "logits-bf16")


def providers_present(records):
    present = {r["provider"] for r in records}
    return [p for p in PROVIDER_ORDER if p in present]


def lm_head_section(d: dict, png_link: str | None = None) -> list[str]:
    """One head results file: targets, the target cases in full, the floor table, the sweep."""
    env, recs = d["environment"], d["records"]
    dev = env.get("device")
    out = [f"## Head op (`eagle_fast.kernels.lm_head`), {dev.upper()}", "", env_line(env), ""]
    out += ["Providers: " + "; ".join(f"`{k}` = {v}" for k, v in d.get("providers", {}).items()
                                      if k in providers_present(recs)) + ".", ""]
    out += targets_md(d.get("targets", []))
    # group by (shape, N, mode)
    cases = []
    for r in recs:
        key = (r["shape"], r["n_tokens"], r["mode"])
        if key not in cases:
            cases.append(key)
    provs = providers_present(recs)

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
                         f"{r['tflops']:.3f}" if r["tflops"] else "-", fmt_bytes(mem), memvs,
                         fmt_bytes(mem / r["n_tokens"]) if mem is not None else "-",
                         fmt_bytes(r.get("resident_bytes") or None), r["status"]])
        out += table(["provider", "median", "rounds", "time vs seed", "TFLOP/s", "peak extra",
                       "mem vs seed", "per token", "resident", "status"], rows)
    if any(r.get("peak_extra_bytes_subprocess") for r in recs):
        out += [("Peak extra memory of the target case: each provider in a fresh subprocess (inputs built, "
                "then one call; peak RSS above the RSS before the call). Elsewhere: the first call in the "
                "benchmark process, with malloc returning freed blocks to the OS."), ""]
    out += floor_table(cases, get)
    # Sweep: one table per mode, rows = shapes by V, cells = time (x seed) / memory.
    sweep = [k for k in cases if k[2] != "all" and get(k, "seed-fp32") is not None]
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
                cells.append(f"{fmt_s(r['median_s'])}{vs} / {fmt_bytes(r['peak_extra_bytes'])}")
            rows.append(cells)
        out.append(f"**mode `{m}`**")
        out.append("")
        out += table(["shape", "V", "H", "N"] + [f"`{p}`" for p in provs], rows)
    if d.get("skipped"):
        out += [f"Skipped (time budget): {', '.join(d['skipped'])}", ""]
    if png_link:
        out += [f"![time and memory vs vocabulary size, {dev}]({png_link})", ""]
    return out


def floor_table(cases, get) -> list[str]:
    """Each head against the bare GEMM of its case (`gemm-floor`), with the PyTorch head's
    time by phase as shares of one call."""
    rows, kinds, how = [], set(), None
    for key in cases:
        floor = get(key, "gemm-floor")
        if floor is None or not floor["median_s"]:
            continue
        kinds.add(floor.get("floor_kind", "-"))
        beside = get(key, "gemm-fp32out")
        beside_s = fmt_s(beside["median_s"]) if beside and beside["median_s"] else "-"
        for p in ("lm_head-torch", "lm_head-triton", "lm_head-triton-before"):
            r = get(key, p)
            if r is None or not r["median_s"]:
                continue
            ph = r.get("phases_s") or {}
            how = how or (phases_source(r) if ph else None)
            shares = [f"{100 * ph[q] / ph['total']:.0f}%" if ph.get("total") else "-" for q in PHASES]
            rows.append([key[0], f"{key[1]:,}", str(r["hidden"]), f"{r['vocab']:,}", f"`{key[2]}`", f"`{p}`",
                         fmt_s(floor["median_s"]), beside_s, fmt_s(r["median_s"]),
                         f"{r['median_s'] / floor['median_s']:.2f}x", *shares])
    if not rows:
        return []
    out = ["### Against the floor: the bare GEMM of each shape", "",
           (f"`gemm-floor` is {'; '.join(sorted(kinds))}, operands prepared outside the call (`bench/_floor.py`, "
            "which takes the cheapest GEMM PyTorch offers for the shape: bf16 output on AVX512-BF16/AMX; a file "
            "whose floor is MKL's fp32-output GEMM predates that); `fp32-out` is the fp32-output GEMM beside a "
            "bf16-output floor. "
            f"Phases are shares of one more call of the PyTorch head under {how or 'a profiler'}; `other` is the "
            "rest of the call."), ""]
    out += table(["shape", "N", "H", "V", "mode", "head", "floor", "fp32-out", "head time", "vs floor",
                   *PHASES], rows)
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
    provs = providers_present(recs)
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
    out = ["## CPU building blocks of the PyTorch head (`bench_cpu_ops.py`)", "", env_line(d["environment"]), ""]
    out += [("GEMM tile [1024 x 256] @ [256 x 1024] -> fp32 from bf16 operands "
            f"(bf16 math in hardware: {g.get('bf16_in_hardware')}):"), ""]
    out += table(["variant", "median", "vs fp32", "max abs error vs float64"],
                  [[k, fmt_s(v), f"{g['speedup_vs_fp32'][k]:.2f}x", f"{g['max_abs_err_vs_fp64'][k]:.2g}"]
                   for k, v in g["seconds"].items()])
    out += table(["pass over a [1024 x 1024] fp32 tile", "median", "G elements/s"],
                  [[f"`{k}`", fmt_s(v), f"{r['g_elements_per_s'][k]:.2f}"] for k, v in r["seconds"].items()])
    out += [(f"`lm_head(outputs=(\"draft\", \"argmax\"))`, N={t['rows']}, H=256, V=151,936, 32k draft ids, "
             f"by tile shape [R x C] (default {t['default']}):"), ""]
    out += table(["tile", "median"], [[k, fmt_s(v)] for k, v in t["seconds"].items()])
    out += table(["one call", "median", "per token"],
                  [[k, fmt_s(v), fmt_s(c["per_token_s"][k])] for k, v in c["seconds"].items()])
    if "fixed_s" in c:
        out += [f"Fixed cost of one call (the line through both points at N=0): {fmt_s(c['fixed_s'])}.", ""]
    gp = d.get("group_parallel")
    if gp:
        out += [(f"`supervise` over {gp['tokens']} tokens in 128-token head groups, {gp['threads']} torch threads: "
                 "one group at a time on every thread, or one group per thread at once (what it does on a CPU):"), ""]
        names = list(next(iter(gp["seconds"].values())))
        out += table(["machine", *names, "speedup"],
                      [[where, *(fmt_s(t[n]) for n in names), f"{gp['speedup'][where]:.2f}x"]
                       for where, t in gp["seconds"].items()])
    return out


def floors_section(d: dict) -> list[str]:
    """The CPU head's floor (bench_floors.py): every GEMM of the shape and the head, as multiples of
    the fastest GEMM, with what the screen recomputed."""
    names = list(d["cases"][0]["vs_floor"]) if d.get("cases") else []
    out = section_head("The CPU head's floor (`bench_floors.py`)", d,
                       ("`lm_head((\"draft\", \"argmax\"))` against every GEMM PyTorch offers for the shape, side by "
                        "side; each cell is the median time as a multiple of the fastest GEMM (the floor). `head` "
                        "runs the compiled AMX walk where it runs (" + str(d.get("compiled_walk", "not in this run"))
                        + "), `head-screen` and `head-exact` the PyTorch path; `two-gemms` is the least the "
                        "PyTorch path's bytes can cost here."))
    out += table(["shape", "N", "H", "V", "draft", "floor", *names],
                 [[c["shape"], c["N"], c["H"], c["V"], c["draft"], f"{c['floor']} {fmt_s(c['median_s'][c['floor']])}",
                   *(f"{c['vs_floor'][n]:.2f}x" for n in names)] for c in d["cases"]])
    out += table(["shape", "pairs recomputed per row", "exact tiles", "same bytes as the exact walk"],
                 [[c["shape"], f"{c['screen']['pairs_per_row']:.2f}", c["screen"]["exact_tiles"], c["same_bytes"]]
                  for c in d["cases"]])
    apart = [(c["shape"], c["compiled_vs_exact"]) for c in d["cases"] if c.get("compiled_vs_exact")]
    if apart:
        out += table(["shape", "compiled walk vs exact walk: draft log-probs, max abs", "argmax agreeing"],
                     [[shape, f"{a['draft_logprobs_max_abs']:.2g}", f"{100 * a['argmax_agree']:.3f} %"]
                      for shape, a in apart])
    return out
