"""The system pages of bench/RESULTS.md: the runner against the seed's method, the extract
pipeline per engine, serving against in-process and NeMo's server, and Ray's workers.
"""

from __future__ import annotations

from report_text import PHASES, fmt_bytes, fmt_s, phases_source, section_head, table


def runner_section(d: dict) -> list[str]:
    s = d["setup"]
    out = section_head("Runner (`VLLMTargetRunner`) vs the seed's method", d,
                       (f"Tiny Qwen3 (random; H={s['spec']['hidden_size']}, {s['spec']['num_hidden_layers']} layers, "
                        f"V={s['spec']['vocab_size']:,}, tied, bf16), B={s['batch']}, S={s['seq']}, right-padded: "
                        f"{s['real_tokens']:,} real of {s['padded_tokens']:,} positions. Draft vocab {s['draft_vocab']:,}; "
                        f"draft projection: {s['draft_projection']}. Engine start {s['engine_start_s']:.0f} s (not in any number "
                        f"below). The seed's fp32 head copy holds {fmt_bytes(s['seed_resident_bytes'])} for the runner's lifetime "
                        "(not counted in its per-call peak)."))
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
                     fmt_bytes(r["peak_extra_bytes"]), mem, fmt_bytes(r.get("output_bytes")),
                     fmt_bytes(r.get("real_output_bytes")), r["status"]])
    out += table(["method", "median", "rounds", "tokens/s", "vs seed", "head share", "head vs floor",
                   "peak extra", "mem vs seed", "returned", "returned, non-pad", "status"], rows)
    floor = by.get("gemm-floor")
    if floor:
        out += [(f"`gemm-floor`: {floor.get('floor_kind', '-')} on the {s['real_tokens']:,} non-pad tokens "
                 "(`bench/_floor.py`); head time = call minus the engine's capture of the same rows."), ""]
    sup = by.get("forward_eagle3_supervision") or {}
    ph = sup.get("phases_s") or {}
    if ph.get("total"):
        out += [f"`forward_eagle3_supervision` by phase (one more call under {phases_source(sup)}; `other` is "
                "the capture, the aux scatter and the copies into the [B, S] fields): "
                + ", ".join(f"{p} {100 * ph[p] / ph['total']:.0f}%" for p in PHASES if p in ph) + ".", ""]
    if d.get("cross_check"):
        out += ["Cross-check on non-pad positions: " + ", ".join(
            f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in d["cross_check"].items()), ""]
    return out


def pipeline_section(d: dict) -> list[str]:
    s = d["setup"]
    out = section_head("Pipeline (`eagle-fast extract`), vLLM vs HF engine", d,
                       (f"{s['model']}; {s['samples']} samples, {s['tokens']:,} tokens; supervision {s['supervision']}; "
                        f"layout {s['layout']}. tokens/s = tokens / engine-loop time in steady state: engine start-up and "
                        "shutdown are excluded (the pipeline's own figure is in the JSON as tokens_per_s_reported). Shares are "
                        "of the engine loop; the writer is a separate thread, so shares may sum past 100 %."))
    rows, compact = [], []
    for r in d["records"]:
        name = r["engine"] + (f" ({r['variant']})" if r.get("variant") else "")
        if r.get("variant"):
            compact.append([r["variant"], f"{r['tokens_per_s']:.0f}" if r["status"] == "ok" else "-",
                            " / ".join(f"{x:.2f}" for x in r.get("loop_s_runs", [])) + " s",
                            fmt_bytes(r.get("bytes_on_disk")), "ok" if r["status"] == "ok" else r["status"][:120]])
            continue
        if r["status"] != "ok":
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", r["status"][:120]])
            continue
        rows.append([name, f"{r['tokens_per_s']:.0f}", f"{r['loop_s']:.1f} s", f"{r['build_s']:.1f} s",
                     f"{100 * r['head_share']:.0f}%", f"{100 * r['engine_share']:.0f}%",
                     f"{100 * r['read_share']:.0f}%", f"{100 * r['write_share']:.0f}%", "ok"])
    out += table(["engine", "tokens/s", "loop", "build", "head", "engine (capture)", "read", "write", "status"], rows)
    if compact:
        out += ["", ("Compact storage options against bf16 draft (HF engine, one process, round-robin after a "
                     "warm-up round; tokens/s from the fastest loop):"), ""]
        out += table(["option", "tokens/s", "loop times", "on disk", "status"], compact)
    return out


def ray_section(d: dict) -> list[str]:
    """`extract --ray` with 1 and 2 workers against the plain path (bench_ray.py), and what to
    expect on N GPUs."""
    s = d["setup"]
    out = section_head("Ray (`eagle-fast extract --ray`), 1 and 2 workers vs the plain path", d,
                       (f"{s['model']}, {s['engine']} engine; {s['samples']} samples, {s['tokens']:,} tokens in shards of "
                        f"{s['shard_size']}; supervision {s['supervision']}; local Ray with {s['local_ray']}. Each command runs "
                        "in a fresh process; tokens/s = tokens / engine-loop time from the manifest's `runs` record (it starts "
                        "once every runner is built: Ray start-up and builds are in `build` and the wall time)."))
    rows = []
    for r in d["records"]:
        if r["status"] != "ok":
            rows.append([r["mode"], str(r["batch_tokens"]), "-", "-", "-", "-", r["status"][:120]])
            continue
        rows.append([r["mode"], str(r["batch_tokens"]), f"{r['tokens_per_s']:.0f}", f"{r['loop_s']:.2f} s",
                     f"{r['build_s']:.1f} s", f"{r['process_wall_s']:.1f} s", "ok"])
    out += table(["mode", "batch tokens", "tokens/s", "loop", "build", "wall", "status"], rows)
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
    s = d["setup"]
    out = section_head("Serving (`eagle-fast serve`) vs in-process and NeMo's server", d,
                       (f"{s['model']}; requests of B={s['request_batch']} x S={s['request_seq']} (right-padded), "
                        f"{s['requests_per_client_per_round']} per client per round, {s['rounds']} interleaved rounds; "
                        f"draft vocab {s['draft_vocab']:,}. Ours: {s['ours']}. NeMo: {s['nemo']}. Clients are NeMo's "
                        "`RemoteEagle3TargetModel`, each in its own process. Peak RSS is the server process's VmHWM over "
                        "the round (reset before it); above idle = peak minus the RSS before the round. CPU / request is "
                        "user + system time of the client processes (in-process: the trainer computing its own) and of "
                        "the server process, over the round, per request."))
    rows = []
    for r in d["records"]:
        util = r.get("engine_utilisation")
        per_call = r.get("requests_per_engine_call")
        rows.append([f"`{r['provider']}`", f"{r['median_tokens_per_s']:.0f}" if r["median_tokens_per_s"] else "-",
                     ", ".join(f"{x:.0f}" for x in r["tokens_per_s"]), fmt_bytes(r.get("max_peak_rss_bytes")),
                     fmt_bytes(r.get("peak_above_idle_bytes")),
                     ", ".join(f"{100 * x:.0f}%" for x in util) if util else "-",
                     ", ".join(f"{x:.1f}" for x in per_call) if per_call else "-",
                     _median_s(r.get("client_cpu_s_per_request")), _median_s(r.get("server_cpu_s_per_request"))])
    out += table(["provider", "tokens/s (median)", "per round", "peak server RSS", "above idle",
                   "our engine busy", "requests per engine call", "client CPU / request",
                   "server CPU / request"], rows)
    m = d.get("memory", {})
    if m.get("first_fifth_median"):
        out += [(f"Server RSS over {s['memory_requests']} requests of 10 bucketed shapes: median "
                 f"{fmt_bytes(m['first_fifth_median'])} in the first fifth, {fmt_bytes(m['last_fifth_median'])} in the "
                 f"last, max {fmt_bytes(m['max'])}."), ""]
    if d.get("cross_check"):
        out += ["Cross-check: " + ", ".join(
            f"{k} = {v:.3g}" if isinstance(v, float) else f"{k} = {v}" for k, v in d["cross_check"].items()), ""]
    w = d.get("wire")
    if w and "variants" in w:
        out += [(f"Wire: CPU seconds per response of {fmt_bytes(w['bytes'])} from a bare uvicorn app with the server's "
                 f"malloc settings, read by `requests` as NeMo's client reads it; median of {w['rounds']} "
                 "interleaved (ours sends chunks of `wire.CHUNK_BYTES`)."), ""]
        out += table(["framing, piece", "client CPU", "server CPU", "both"],
                      [[f"`{name}`", f"{v['median_client_cpu_s']:.2f} s", f"{v['median_server_cpu_s']:.2f} s",
                        f"{v['median_client_cpu_s'] + v['median_server_cpu_s']:.2f} s"]
                       for name, v in w["variants"].items()])
    elif w:  # results written before the server's CPU was measured
        med = w["median_s"]
        out += [(f"Wire: the CPU requests (NeMo's client's HTTP library) spends reading one response's "
                 f"{fmt_bytes(w['bytes'])} from a bare uvicorn app, median of {len(w['client_cpu_s']['length'])} "
                 f"interleaved: {med['length']:.2f} s with a Content-Length, {med['chunked']:.2f} s chunked "
                 f"({med['chunked'] / med['length']:.2f}x; ours sends chunks)."), ""]
    return out
