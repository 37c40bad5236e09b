"""Keep-mass fidelity benchmark: `--keep-mass P` on targets as flat as a real LLM's.

What it does
    On the locally trained tiny target (`tiny.build_trained_tiny`, Qwen3-style, V=1,923, draft
    vocabulary 512) at its own sharpness and at temperature-flattened variants of it, it extracts
    the same training split with `--supervision draft-topk --k CAP --keep-mass P` for every P in
    {0.9, 0.95, 0.99, 0.999}, with a fixed `--k 64`, and dense `--supervision draft` in bf16 (the
    yardstick), and reports per variant and setting:
      - bytes per token at Qwen3-8B shapes (`store/sizes.py`; a ragged k at its mean stored k);
      - KL between the true draft distribution and each tail mode's rebuild (mean, p99) with the
        bound `store/fidelity.py` derives from the stored tail, on the supervised positions;
      - the share of tokens whose CAP ids hold less than P (they hit the cap);
      - NeMo's `simulated_accept_length` of a draft trained on it (`accept.py`: NeMo AutoModel's
        own draft, trainer and soft CE, tail mode spread), judged on the variant's held-out
        full-logits supervision, paired by seed against dense bf16.
    A variant is a real checkpoint: the trained one with its final RMSNorm weight scaled by 1/T
    (the head is tied to the embeddings, so the head weight is left alone), which divides every
    logit by T while the aux hidden states stay bit for bit; extraction runs on it unchanged.

Which temperatures
    The flattest variant is calibrated to NeMo AutoModel's own measurement on Qwen3-8B: top-64
    of the draft distribution keeps ~0.92 of the mass (KL ~1.3), the figure behind its top-k
    cache compression being off by default (NeMo AutoModel 0.7.0,
    `components/speculative/precompute_eagle3.py`, `--target-probs-topk` help; docs:
    https://docs.nvidia.com/nemo/automodel/v0.7/nemo-automodel/nemo_automodel/components/speculative/precompute_eagle3.md).
    T is found by bisection on the base target's logits (mean top-64 draft mass = ANCHORS) and
    every variant's per-token entropy (full vocabulary, nats: mean, p10/p50/p90) is measured on
    its own checkpoint and recorded, to set beside published per-token entropies of chat LLMs.

Limits
    A 512-id draft vocabulary: the mean k a P needs here is not a 32k vocabulary's, so bytes per
    token at Qwen3-8B shapes take this target's mean k; the flattening is a temperature, one way
    to be flat (a real LLM's tail has its own shape). Accept lengths are this tiny target's; what
    carries over is the comparison between settings on one variant.
    Sizes: EAGLE_FAST_BENCH_KEEP_MASS_STEPS (150 draft steps), _SEEDS (2; 0: no drafts, entropy,
    bytes and KL only), _CAP (256, --k of the
    keep-mass runs), _ANCHORS (top-64 masses of the flattened variants: "0.955,0.92"), _OWN (1: the
    target at its own sharpness too), _WORK (a directory that keeps the extractions; a rerun with the
    same one extracts nothing again).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _harness as H
import accept as A
import torch

NAME = "keep_mass"  # results: keep_mass-cpu.json

STEPS = int(os.environ.get("EAGLE_FAST_BENCH_KEEP_MASS_STEPS", "150"))
SEEDS = tuple(range(int(os.environ.get("EAGLE_FAST_BENCH_KEEP_MASS_SEEDS", "2"))))
CAP = int(os.environ.get("EAGLE_FAST_BENCH_KEEP_MASS_CAP", "256"))
ANCHORS = tuple(float(x) for x in os.environ.get("EAGLE_FAST_BENCH_KEEP_MASS_ANCHORS", "0.955,0.92").split(",") if x)
OWN = os.environ.get("EAGLE_FAST_BENCH_KEEP_MASS_OWN", "1") != "0"  # the target at its own sharpness too
WORK = os.environ.get("EAGLE_FAST_BENCH_KEEP_MASS_WORK")  # keep the extractions here (a rerun reuses them)
KEEP = (0.9, 0.95, 0.99, 0.999)
K_FIXED = 64
GOAL_P, GOAL_LOSS = 0.99, 0.02  # at P=0.99 on the flattest variant: <= 2 % accept length lost vs dense bf16
MODES = ("spread", "drop", "renormalize")
NEMO_ANCHOR = {"top64_mass": 0.92, "kl": 1.3, "target": "Qwen3-8B",
               "source": "NeMo AutoModel 0.7.0 components/speculative/precompute_eagle3.py, --target-probs-topk help",
               "url": "https://docs.nvidia.com/nemo/automodel/v0.7/nemo-automodel/nemo_automodel/"
                      "components/speculative/precompute_eagle3.md"}
QWEN3_8B = {"hidden_size": 4096, "vocab_size": 151_936, "draft_size": 32_000}
BF16 = {"dtype": "bf16", "out_dtype": "bf16"}


def settings() -> dict[str, dict]:
    """name -> extract options; `truth` is the dense fp32 output of the same bf16 forward (the KL's p)."""
    return {"dense-bf16": {**BF16, "supervision": "draft"},
            "truth": {"dtype": "bf16", "out_dtype": "fp32", "supervision": "draft"},
            f"k{K_FIXED}": {**BF16, "supervision": "draft-topk", "k": K_FIXED},
            **{f"P{p}": {**BF16, "supervision": "draft-topk", "k": CAP, "keep_mass": p} for p in KEEP}}


def qwen3_bytes(opt: dict, mean_k: float | None = None) -> float:
    """Bytes per token at Qwen3-8B shapes; a --keep-mass setting's kept fields at `mean_k` ids."""
    from eagle_fast.store import make_layout, sizes
    from eagle_fast.store.layouts import LayoutSpec

    if "keep_mass" not in opt:
        return float(sizes.layout_bytes_per_token("native", opt["supervision"], k=opt.get("k", 0), dtype="bf16",
                                                  out_dtype=opt["out_dtype"], **QWEN3_8B))
    from eagle_fast.dtypes import SHORT_NAMES

    spec = LayoutSpec(layout="native", kind="draft-topk", k=opt["k"], hidden_size=QWEN3_8B["hidden_size"], num_aux=3,
                      vocab_size=QWEN3_8B["vocab_size"], draft_size=QWEN3_8B["draft_size"], dtype=SHORT_NAMES["bf16"],
                      out_dtype=SHORT_NAMES[opt["out_dtype"]], max_len=4096, keep_mass=opt["keep_mass"])
    return float(sum(sizes.bytes_per_token(make_layout(spec), mean_k=mean_k).values()))


# ------------------------------------------------------------------------------ variants


@torch.no_grad()
def supervised_logits(target, plan: list) -> torch.Tensor:
    """The target's fp32 logits [N, V] at every supervised position (row t where token t+1 is in the loss)."""
    out = []
    for s in plan:
        rows = torch.nonzero(torch.tensor(s.loss_mask[1:], dtype=torch.bool)).flatten()
        if rows.numel():
            out.append(target(torch.tensor([s.input_ids])).logits[0, rows].float())
    return torch.cat(out)


def top_mass(logits: torch.Tensor, ids: torch.Tensor, T: float, k: int = K_FIXED) -> float:
    """Mean over rows of the top-k mass of the draft distribution (softmax over the draft ids) at temperature T."""
    return float(torch.softmax(logits[:, ids] / T, -1).topk(k, -1).values.sum(-1).mean())


def calibrate(logits: torch.Tensor, ids: torch.Tensor, mass: float) -> float:
    """The temperature at which the mean top-64 draft mass is `mass` (bisection; mass falls as T grows)."""
    lo, hi = 1.0, 16.0
    if top_mass(logits, ids, lo) <= mass:
        return 1.0
    for _ in range(24):  # 16 / 2^24: far finer than the anchor's two digits
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if top_mass(logits, ids, mid) > mass else (lo, mid)
    return round((lo + hi) / 2, 4)


def flattened_checkpoint(model: Path, T: float, out: Path) -> Path:
    """A copy of `model` whose logits are divided by T: its final norm weight scaled by 1/T."""
    from safetensors.torch import load_file, save_file

    if (out / "config.json").exists():  # made by an earlier run in the same work directory
        return out
    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    found = False
    for f in model.glob("*.safetensors"):
        tensors = load_file(f)
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"] = tensors["model.norm.weight"] / T
            found = True
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    if not found:
        raise RuntimeError(f"{model} has no model.norm.weight to scale")
    return out


def entropy_stats(logits: torch.Tensor, ids: torch.Tensor) -> dict:
    """Per-token entropy of the full distribution (nats) and top-64 draft mass."""
    lp = torch.log_softmax(logits.double(), -1)
    h = -(lp.exp() * lp).sum(-1)
    q = torch.quantile(h, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"entropy_mean": float(h.mean()), "entropy_p10": q[0], "entropy_p50": q[1], "entropy_p90": q[2],
            "top1_mass_mean": float(lp.exp().max(-1).values.mean()),
            "draft_top64_mass_mean": float(torch.softmax(logits[:, ids].double(), -1).topk(K_FIXED, -1).values.sum(-1).mean()),
            "positions": int(h.numel())}


# ------------------------------------------------------------------------------- fidelity


def fidelity(truth: Path, sparse: Path) -> dict:
    """KL of each tail mode's rebuild against the true draft distribution on the supervised
    rows (mean, p99, share within the stored-tail bound), mean stored k and tokens at the cap."""
    from eagle_fast.store.dataset import Eagle3Dataset
    from eagle_fast.store.fidelity import kl_check

    dt, ds = Eagle3Dataset(truth), Eagle3Dataset(sparse)
    kl = {m: [] for m in MODES}
    bound = {m: [] for m in MODES}
    within = {m: 0 for m in MODES}
    lengths_all = []
    for i in range(len(ds)):
        p = dt.raw(i)["draft_logprobs"].double().exp()
        s = ds.raw(i)
        if "draft_topk_lengths" in s:
            lengths, ids, lps = s["draft_topk_lengths"].long(), s["draft_topk_ids"], s["draft_topk_logprobs"]
        else:
            k = s["draft_topk_ids"].shape[-1]
            lengths = torch.full((p.shape[0],), k, dtype=torch.long)
            ids, lps = s["draft_topk_ids"].reshape(-1), s["draft_topk_logprobs"].reshape(-1)
        lengths_all.append(lengths)
        rows = torch.nonzero(s["loss_mask"][1:].bool()).flatten()
        for m in MODES:
            # tail_tol=inf: the truth is a separate extraction, so the stored tail is not checked
            # against it here (verify does that on recomputed samples); this measures the KL.
            v, b, a = kl_check(p, lengths, ids, lps, s["draft_topk_tail"], ds.spec.draft_size, m, float("inf"))
            kl[m].append(v[rows])
            bound[m].append(b[rows])
            within[m] += int((v[rows] <= b[rows] + a[rows]).sum())
    lengths = torch.cat(lengths_all).double()
    cap = ds.spec.k
    out = {"mean_k": float(lengths.mean()), "k_p50": float(lengths.median()), "k_max": int(lengths.max()),
           "cap": cap, "capped_share": None, "kl": {}}
    if ds.spec.keep_mass:
        _, capped, n = ds.keep_mass_stats()
        out["capped_share"] = capped / max(n, 1)
    for m in MODES:
        v, b = torch.cat(kl[m]), torch.cat(bound[m])
        out["kl"][m] = {"mean": float(v.mean()), "p99": float(torch.quantile(v, 0.99)),
                        "bound_mean": float(b.mean()), "within_bound": within[m] / max(v.numel(), 1)}
    out["supervised_positions"] = int(torch.cat(kl["spread"]).numel())
    return out


# ----------------------------------------------------------------------------------- run


def _extract(model: Path, data: Path, vocab: Path, out: Path, opt: dict, max_len: int) -> dict:
    from eagle_fast import ExtractConfig, extract

    cfg = ExtractConfig(model=str(model), data=str(data), out=str(out), engine="hf", draft_vocab=str(vocab),
                        max_len=max_len, progress_tty=False, **opt)
    t0 = time.perf_counter()
    s = extract(cfg)
    files = sum(f.stat().st_size for f in out.rglob("*.safetensors") if f.name != "target_embeddings.safetensors")
    return {"option": opt, "extract_s": time.perf_counter() - t0, "tokens": s.tokens, "bytes_per_token": files / s.tokens}


def _variant(name, T, model, work, data, vocab, ids, mask, train_plan, held_plan, emb) -> dict:
    ckpt = model if T == 1.0 else flattened_checkpoint(model, T, work / f"model-{name}")
    target = A.load_target(ckpt)
    rec = {"temperature": T, **entropy_stats(supervised_logits(target, train_plan), ids), "settings": {}}
    held_ref = A.reference_samples(target, held_plan, ids, mask)
    del target
    print(f"variant {name}: T={T}, entropy mean {rec['entropy_mean']:.3f} (p10/p50/p90 {rec['entropy_p10']:.3f}/"
          f"{rec['entropy_p50']:.3f}/{rec['entropy_p90']:.3f}) nats, top-64 draft mass {rec['draft_top64_mass_mean']:.4f}",
          flush=True)
    max_len = max(s.length for s in train_plan)
    dirs = {}
    for sname, opt in settings().items():
        dirs[sname] = work / f"{name}-{sname}"
        r = _extract(ckpt, data, vocab, dirs[sname], opt, max_len)
        if opt["supervision"] == "draft-topk":
            r.update(fidelity(dirs["truth"], dirs[sname]))
        r["qwen3_8b_bytes_per_token"] = qwen3_bytes(opt, r.get("mean_k") if "keep_mass" in opt else None)
        rec["settings"][sname] = r
    for sname, r in rec["settings"].items():
        if sname == "truth" or not SEEDS:  # no seeds: entropy, bytes and KL only
            continue
        samples = A.native_samples(dirs[sname])
        runs = []
        for seed in SEEDS:
            t0 = time.perf_counter()
            trainer, losses = A.train_draft(ckpt, ids, mask, emb, samples, A.DraftTrain(steps=STEPS, seed=seed))
            ev = A.evaluate(trainer, held_ref)
            runs.append({"seed": seed, "train_s": time.perf_counter() - t0, "final_loss": losses[-1], **ev})
            kl = r.get("kl", {}).get("spread", {}).get("mean")
            print(f"  {name:5s} {sname:10s} seed {seed}: accept length {ev['accept_length']:.4f}, held-out loss "
                  f"{ev['loss']:.4f}" + (f", KL(spread) {kl:.2e}, mean k {r['mean_k']:.1f}" if kl is not None else "")
                  + f" ({runs[-1]['train_s']:.0f} s)", flush=True)
        r["runs"] = runs
        r["accept_length_mean"] = statistics.fmean(x["accept_length"] for x in runs)
        r["accept_length_spread"] = max(x["accept_length"] for x in runs) - min(x["accept_length"] for x in runs)
        del samples
    if not WORK:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    return rec


def run(args) -> dict:
    from eagle_fast import cli
    from eagle_fast.demo import cache_dir
    from eagle_fast.tiny import build_trained_tiny, trained_tiny_dir

    t_start = time.perf_counter()
    env = H.environment("cpu")
    model = build_trained_tiny(trained_tiny_dir(cache_dir()))
    work = Path(WORK) if WORK else Path(tempfile.mkdtemp(prefix="eagle_fast-bench-keep-mass-"))
    variants: dict[str, dict] = {}
    try:
        train_lines, held_lines = A.split_lines()
        data = A.write_jsonl(train_lines, work / "train.jsonl")
        held = A.write_jsonl(held_lines, work / "held.jsonl")
        vocab = work / "vocab.pt"
        if not vocab.exists() and cli.main(["vocab", "--model", str(model), "--data", str(data), "--size", str(A.DRAFT_SIZE),
                     "--out", str(vocab)]) != 0:
            raise RuntimeError("eagle-fast vocab failed")
        target = A.load_target(model)
        ids, mask = A.vocab_tensors(vocab, target.config.vocab_size)
        train_plan, held_plan = A.plan(model, data), A.plan(model, held)
        emb = target.get_input_embeddings().weight.detach().clone()
        base = supervised_logits(target, train_plan)
        del target
        # flattest first: the goal's variant is in the partial results should the run be cut short
        temps = {**{f"top64-{m}": calibrate(base, ids, m) for m in sorted(ANCHORS)}, **({"own": 1.0} if OWN else {})}
        del base
        for name, T in temps.items():
            variants[name] = _variant(name, T, model, work, data, vocab, ids, mask, train_plan, held_plan, emb)
            variants[name]["calibrated_to_top64_mass"] = None if T == 1.0 else float(name.split("-")[1])
            H.write_json(args.json, {"benchmark": NAME, "environment": env, "partial": True, "variants": variants})
    finally:
        if not WORK:
            shutil.rmtree(work, ignore_errors=True)
    return {"benchmark": NAME, "environment": env,
            "setup": {"model": f"trained tiny Qwen3 ({Path(model).name})", "vocab_size": 1923, "draft_size": A.DRAFT_SIZE,
                      "keep_mass": list(KEEP), "cap_k": CAP, "fixed_k": K_FIXED, "steps": STEPS, "seeds": list(SEEDS),
                      "train": A.DraftTrain(steps=STEPS).asdict(), "train_samples": len(train_plan),
                      "held_out_samples": len(held_plan), "tail_mode_trained": "spread", "anchor": NEMO_ANCHOR,
                      "qwen3_8b_shapes": QWEN3_8B, "threads": torch.get_num_threads(),
                      "entropy_note": "per-token entropy of the full 1,923-token distribution, nats, at the "
                                      "supervised positions of the training split"},
            "variants": variants, "wall_s": time.perf_counter() - t_start}


def paired_loss(rec: dict, name: str, base: str = "dense-bf16") -> float:
    """Accept length lost against `base`, seed by seed (same init, same batches), as a share of base's."""
    a, b = rec["settings"][name]["runs"], rec["settings"][base]["runs"]
    return statistics.fmean((y["accept_length"] - x["accept_length"]) / y["accept_length"] for x, y in zip(a, b))


def flattest(results: dict) -> str:
    return max(results["variants"], key=lambda n: results["variants"][n]["temperature"])


def _goal(v: H.Verdicts, name: str, rec: dict) -> None:
    s = rec["settings"]
    goal = f"P{GOAL_P}"
    target = (f"keep-mass: P={GOAL_P} on the flattest variant ({name}, T={rec['temperature']}, top-64 draft mass "
              f"{rec['draft_top64_mass_mean']:.3f}) loses <= {100 * GOAL_LOSS:.0f}% accept length against dense bf16")
    if "runs" not in s["dense-bf16"]:
        v.check(target, None, "no drafts trained (EAGLE_FAST_BENCH_KEEP_MASS_SEEDS=0)")
        return
    loss = paired_loss(rec, goal)
    v.check(target, loss <= GOAL_LOSS,
            f"{s[goal]['accept_length_mean']:.4f} vs {s['dense-bf16']['accept_length_mean']:.4f} = {100 * loss:+.2f}% "
            f"lost (paired over {len(s[goal]['runs'])} seeds; dense's seed spread {s['dense-bf16']['accept_length_spread']:.4f}); "
            f"k=64 {100 * paired_loss(rec, f'k{K_FIXED}'):+.2f}%; bytes/token at Qwen3-8B: P{GOAL_P} "
            f"{s[goal]['qwen3_8b_bytes_per_token'] / 1000:.1f} KB (mean k {s[goal]['mean_k']:.1f}), k=64 "
            f"{s[f'k{K_FIXED}']['qwen3_8b_bytes_per_token'] / 1000:.1f} KB, dense bf16 "
            f"{s['dense-bf16']['qwen3_8b_bytes_per_token'] / 1000:.1f} KB")


def verdicts(results: dict) -> H.Verdicts:
    v = H.Verdicts()
    name = flattest(results)
    _goal(v, name, results["variants"][name])
    for vname, r in results["variants"].items():
        worst = max(1.0 - r["settings"][f"P{p}"]["kl"]["spread"]["within_bound"] for p in KEEP)
        v.check(f"keep-mass: every supervised token's KL within the stored-tail bound ({vname}, all P, all modes)",
                all(r["settings"][f"P{p}"]["kl"][m]["within_bound"] == 1.0 for p in KEEP for m in MODES),
                f"worst share outside (spread): {100 * worst:.3f}%")
    return v


def errors(results: dict) -> list[str]:
    out = []
    for vname, r in results["variants"].items():
        d = r["settings"]["dense-bf16"].get("accept_length_mean")
        if d is not None and d <= 1.0:
            out.append(f"{vname}: the dense bf16 draft accepts nothing (accept length {d:.4f})")
    return out


def summary(results: dict) -> str:
    lines = []
    for vname, r in results["variants"].items():
        lines.append(f"{vname} (T={r['temperature']}): entropy mean {r['entropy_mean']:.2f} nats, "
                     f"top-64 mass {r['draft_top64_mass_mean']:.3f}")
        for sname, s in r["settings"].items():
            if sname == "truth":
                continue
            kl = s.get("kl", {}).get("spread")
            capped = s.get("capped_share")
            accept = s.get("accept_length_mean")
            lines.append(f"  {sname:10s} {s['qwen3_8b_bytes_per_token'] / 1000:7.1f} KB/token  accept "
                         + (f"{accept:.4f}" if accept is not None else "-") + (f"  KL mean {kl['mean']:.2e} p99 {kl['p99']:.2e}  mean k "
                                                             f"{s['mean_k']:.1f}" if kl else "")
                         + (f"  capped {100 * capped:.1f}%" if capped is not None else ""))
    return "\n".join(lines)


test_keep_mass = H.pytest_case(__name__)

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
