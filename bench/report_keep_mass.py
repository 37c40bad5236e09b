"""The keep-mass section of bench/RESULTS.md (bench_keep_mass.py): per temperature variant of the
trained tiny target, its per-token entropy, then per setting (dense bf16, fixed k=64, --keep-mass
P) bytes per token at Qwen3-8B shapes, mean stored k, tokens at the cap, KL per tail mode and the
accept length of a draft trained on it against dense bf16.
"""

from __future__ import annotations

from report_text import section_head, table

MODES = ("spread", "drop", "renormalize")


def _paired_loss(rec: dict, name: str, base: str = "dense-bf16") -> float | None:
    a, b = rec["settings"][name].get("runs"), rec["settings"][base].get("runs")
    if not a or not b:
        return None
    return sum((y["accept_length"] - x["accept_length"]) / y["accept_length"] for x, y in zip(a, b)) / len(a)


def _variant_rows(rec: dict) -> list[list[str]]:
    rows = []
    for name, s in rec["settings"].items():
        if name == "truth":
            continue
        kl = s.get("kl")
        loss = _paired_loss(rec, name) if name != "dense-bf16" else None
        capped = s.get("capped_share")
        rows.append([name, f"{s['qwen3_8b_bytes_per_token'] / 1000:.1f} KB",
                     f"{s['mean_k']:.1f}" if "mean_k" in s else "all",
                     f"{100 * capped:.1f} %" if capped is not None else "-",
                     *([f"{kl[m]['mean']:.2e} / {kl[m]['p99']:.2e}" for m in MODES] if kl else ["0 (reference)", "-", "-"]),
                     f"{s['accept_length_mean']:.4f}" if "accept_length_mean" in s else "-",
                     "yardstick" if name == "dense-bf16" else (f"{100 * loss:+.2f} %" if loss is not None else "-")])
    return rows


def section(d: dict) -> list[str]:
    """The keep-mass fidelity section, from keep_mass-cpu.json."""
    s = d.get("setup", {})
    a = s.get("anchor", {})
    intro = (f"`bench/bench_keep_mass.py`: {s.get('model', 'the trained tiny target')}, vocabulary "
             f"{s.get('vocab_size', '-')}, draft vocabulary {s.get('draft_size', '-')}, flattened by dividing its "
             f"logits by T (its final-norm weight scaled by 1/T, a real checkpoint). The flattest T is calibrated so "
             f"top-64 keeps {a.get('top64_mass', 0.92)} of the draft mass, NeMo AutoModel's own figure for "
             f"{a.get('target', 'Qwen3-8B')} ([{a.get('source', 'NeMo AutoModel')}]({a.get('url', '')})). "
             f"`--keep-mass P` runs with `--k {s.get('cap_k', '-')}` as the cap. Bytes per token at Qwen3-8B shapes "
             f"(H 4,096, draft vocabulary 32,000; a ragged k at its mean stored k here). KL(true || rebuilt) in nats "
             f"on the supervised positions, mean / p99, per tail mode (drop: the generalised KL; renormalize: "
             f"KL(rebuilt || true)). Accept length: NeMo's `simulated_accept_length` on the held-out split of a "
             f"draft trained {s.get('steps', '-')} steps on each, mean over the variant's seeds, its loss "
             f"against dense bf16 paired by seed.")
    out = section_head("Keep-mass: a stated share of the draft mass on every token", d, intro)
    if d.get("partial"):
        out += ["Partial results: the run stopped before every variant was measured.", ""]
    for name, rec in d.get("variants", {}).items():
        out += [(f"**{name}** (T = {rec['temperature']}): per-token entropy mean {rec['entropy_mean']:.2f} nats "
                 f"(p10 / p50 / p90 {rec['entropy_p10']:.2f} / {rec['entropy_p50']:.2f} / {rec['entropy_p90']:.2f}), "
                 f"top-64 draft mass {rec['draft_top64_mass_mean']:.3f}, top-1 {rec['top1_mass_mean']:.3f}; "
                 f"drafts: {len(rec['settings']['dense-bf16'].get('runs', []))} seed(s) per setting."), ""]
        out += table(["setting", "bytes/token (Qwen3-8B)", "mean k", "at the cap",
                      *[f"KL {m} mean / p99" for m in MODES], "accept length", "vs dense bf16"], _variant_rows(rec))
    return out
