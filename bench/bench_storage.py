"""Storage benchmark: bytes per token of each storage option, and what each one loses.

What it does
    On the locally trained tiny target (`eagle_fast.tiny.build_trained_tiny`: a Qwen3-style
    model trained on the bundled chat data until its next-token distributions are peaked, cached
    like the demo model), it extracts the held-out conversations with `extract` (HF engine,
    fp32) once per storage option, reads every dataset back through `Eagle3Dataset`, and
    compares it with the fp32 dense draft distribution p of the same run:
      bytes/token     the dataset's files over its tokens (all fields), and the same layout's
                      bytes/token at Qwen3-8B shapes (`store/sizes.py`, from shapes)
      KL              KL(p || q) in nats over supervised positions, mean and p99, where q is the
                      stored target read back (`target_p`, the tail spread over the other ids)
      top-1           how often q's most likely draft id is p's
      mass kept       mean draft mass the stored top-k holds (1 - tail)
      fp8 aux         per-token relative error and cosine of the fp8 aux states against bf16
    for draft fp32 / bf16, draft-topk k in {8, 16, 32, 64, 128} (bf16 log-probs) and fp8 aux,
    recommends k (the smallest whose mean KL <= 0.01 nats with top-1 >= 99.5 %), extracts the
    compact preset (fp8 aux + draft-topk at that k) and checks the issue's goals: the preset
    <= 14 KB/token (1 KB = 1000 B) at Qwen3-8B shapes, 6x below bf16 draft.
    KL is the generalised one, sum p log(p/q) - sum p + sum q (>= 0 also when rounding leaves q
    unnormalised), with q as a trainer gets it: `Eagle3Dataset.target_p(i, "spread")`.

Limits
    A 1,923-token vocabulary with a 512-id draft vocabulary, ~3k held-out tokens: k / Vd is far
    larger here than at 32k, so the KL at a given k carries over to a real LM only as far as
    its distributions are as peaked as this one's (the training report's peakedness is kept in
    the JSON). The byte counts at Qwen3-8B shapes are computed, not measured on such a model.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _harness as H

NAME = "storage"  # results: storage-cpu.json

K_SWEEP = (8, 16, 32, 64, 128)
DRAFT_SIZE = 512
KL_MEAN_MAX, TOP1_MIN = 0.01, 0.995  # the recommendation rule
PRESET_MAX_BYTES = 14_000  # 14 KB, 1 KB = 1000 B as the issue (and storage_table.py) count
QWEN3_8B = {"hidden_size": 4096, "vocab_size": 151_936, "draft_size": 32_000}


def _options() -> dict[str, dict]:
    opts = {"draft-fp32": {"supervision": "draft", "out_dtype": "fp32"},
            "draft-bf16": {"supervision": "draft", "out_dtype": "bf16"},
            "fp8-draft-bf16": {"supervision": "draft", "out_dtype": "bf16", "aux_dtype": "fp8"}}
    for k in K_SWEEP:
        opts[f"draft-topk-k{k}"] = {"supervision": "draft-topk", "k": k, "out_dtype": "bf16"}
    return opts


def _held_out(work: Path) -> Path:
    from eagle_fast.tiny import TrainSpec, _data_path

    lines = [ln for ln in _data_path().read_text().splitlines() if ln.strip()]
    path = work / "held_out.jsonl"
    path.write_text("\n".join(lines[-TrainSpec().held_out:]) + "\n")
    return path


def _quantiles(x, q: float) -> float:
    import torch

    return float(torch.quantile(x.double(), q)) if x.numel() else float("nan")


def _compare(ref, got, loss_masks) -> dict:
    """KL(p || q), top-1 agreement and mass kept over supervised positions."""
    import torch

    kls, top1, kept = [], [], []
    for i in range(len(ref)):
        keep = loss_masks[i]
        p = ref.target_p(i)[keep].double()
        q = got.target_p(i, "spread")[keep].double()
        kls.append((torch.special.xlogy(p, p) - torch.special.xlogy(p, q) - p + q).sum(-1))
        top1.append(p.argmax(-1) == q.argmax(-1))
        raw = got.raw(i)
        if "draft_topk_tail" in raw:
            kept.append(1 - raw["draft_topk_tail"][keep].double())
    kl = torch.cat(kls)
    return {"positions": int(kl.numel()), "kl_mean": float(kl.mean()), "kl_p99": _quantiles(kl, 0.99),
            "kl_max": float(kl.max()), "top1": float(torch.cat(top1).double().mean()),
            "mass_kept": float(torch.cat(kept).mean()) if kept else 1.0}


def _aux_fidelity(ref, fp8, loss_masks) -> dict:
    import torch

    rel, cos, rel_bf16 = [], [], []
    for i in range(len(ref)):
        x = ref[i]["aux_hidden_states"].double()  # fp32 target: the exact states
        b = x.to(torch.bfloat16).double()
        q = fp8[i]["aux_hidden_states"].double()  # dequantised on read
        rel.append((q - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30))
        rel_bf16.append((b - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30))
        cos.append(torch.nn.functional.cosine_similarity(q, b, dim=-1))
    rel, cos, rel_bf16 = torch.cat(rel), torch.cat(cos), torch.cat(rel_bf16)
    return {"rel_err_vs_bf16_mean": float(rel.mean()), "rel_err_vs_bf16_p99": _quantiles(rel, 0.99),
            "cosine_vs_bf16_mean": float(cos.mean()), "cosine_vs_bf16_min": float(cos.min()),
            "bf16_rel_err_vs_fp32_mean": float(rel_bf16.mean()), "tokens": int(rel.numel())}


def _qwen3_bytes(opt: dict) -> float | None:
    """Bytes/token of this option's native layout at Qwen3-8B shapes (bf16 target), from shapes."""
    try:
        from eagle_fast.store import sizes
    except ImportError:
        return None
    return sizes.layout_bytes_per_token(
        "native", opt["supervision"], k=opt.get("k", 0), dtype="bf16", out_dtype=opt["out_dtype"],
        aux_dtype=opt.get("aux_dtype", "auto"), **QWEN3_8B)


def run(args) -> dict:
    import torch

    from eagle_fast.demo import cache_dir
    from eagle_fast.store.dataset import Eagle3Dataset
    from eagle_fast.tiny import build_trained_tiny, trained_tiny_dir, training_report

    t_start = time.perf_counter()
    env = H.environment("cpu")
    model = build_trained_tiny(trained_tiny_dir(cache_dir()))
    report = training_report(model)
    work = Path(tempfile.mkdtemp(prefix="eagle_fast-bench-storage-"))
    records: dict[str, dict] = {}
    try:
        data = _held_out(work)
        vocab = work / "vocab.pt"
        from eagle_fast import cli

        if cli.main(["vocab", "--model", str(model), "--data", str(_all_data(work)), "--size",
                     str(DRAFT_SIZE), "--out", str(vocab)]) != 0:
            raise RuntimeError("eagle-fast vocab failed")
        opts = _options()
        for name, opt in opts.items():
            records[name] = _extract(model, data, vocab, work, name, opt)
        ref = Eagle3Dataset(work / "draft-fp32")
        masks = [ref.raw(i)["loss_mask"].bool() for i in range(len(ref))]
        for name in opts:
            if name != "draft-fp32":
                records[name].update(_compare(ref, Eagle3Dataset(work / name), masks))
        k = recommend(records)
        if k is not None:  # the compact preset itself, written and read back like the others
            name = f"preset-fp8-draft-topk-k{k}"
            opt = {"supervision": "draft-topk", "k": k, "out_dtype": "bf16", "aux_dtype": "fp8"}
            records[name] = _extract(model, data, vocab, work, name, opt)
            records[name].update(_compare(ref, Eagle3Dataset(work / name), masks))
        records["fp8-draft-bf16"]["aux"] = _aux_fidelity(ref, Eagle3Dataset(work / "fp8-draft-bf16",
                                                                             aux_dtype=torch.float32), masks)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"benchmark": "storage", "environment": env,
           "setup": {"model": f"trained tiny Qwen3 ({Path(model).name})", "draft_size": DRAFT_SIZE,
                     "vocab_size": 1923, "supervised_positions": records["draft-bf16"]["positions"],
                     "data": "held-out conversations of demo_chat.jsonl",
                     "training": {"seconds": report.get("seconds"), "steps": report["train"]["steps"],
                                  "held_out": report.get("held_out")},
                     "rule": f"recommended k: smallest with mean KL <= {KL_MEAN_MAX} and top-1 >= {TOP1_MIN}"},
           "recommended_k": recommend(records), "records": records, "wall_s": time.perf_counter() - t_start}
    for name, r in records.items():
        kl = (f"KL mean {r['kl_mean']:.2e} p99 {r['kl_p99']:.2e} top-1 {100 * r['top1']:.2f}% "
              f"mass kept {100 * r['mass_kept']:.2f}%") if "kl_mean" in r else ""
        q = r["qwen3_8b_bytes_per_token"]
        print(f"  {name:26s} {r['bytes_per_token']:6.0f} B/tok here, "
              f"{q / 1000 if q else float('nan'):6.1f} KB/tok at Qwen3-8B  {kl}", flush=True)
    aux = records["fp8-draft-bf16"]["aux"]
    print(f"  fp8 aux vs bf16: rel err mean {aux['rel_err_vs_bf16_mean']:.3%} p99 {aux['rel_err_vs_bf16_p99']:.3%}, "
          f"cosine mean {aux['cosine_vs_bf16_mean']:.6f} min {aux['cosine_vs_bf16_min']:.6f} "
          f"(bf16 itself vs fp32: {aux['bf16_rel_err_vs_fp32_mean']:.3%})", flush=True)
    return out


def _extract(model, data, vocab, work: Path, name: str, opt: dict) -> dict:
    from eagle_fast import ExtractConfig, extract

    cfg = ExtractConfig(model=str(model), data=str(data), out=str(work / name), engine="hf", dtype="fp32",
                        draft_vocab=str(vocab), progress_tty=False, **opt)
    t0 = time.perf_counter()
    s = extract(cfg)
    files = sum(f.stat().st_size for f in (work / name).rglob("*.safetensors"))
    return {"option": opt, "seconds": time.perf_counter() - t0, "tokens": s.tokens,
            "bytes_per_token": files / s.tokens, "qwen3_8b_bytes_per_token": _qwen3_bytes(opt)}


def recommend(records: dict) -> int | None:
    """The smallest swept k whose mean KL <= KL_MEAN_MAX with top-1 >= TOP1_MIN, else None."""
    for k in K_SWEEP:
        r = records.get(f"draft-topk-k{k}")
        if r and "kl_mean" in r and r["kl_mean"] <= KL_MEAN_MAX and r["top1"] >= TOP1_MIN:
            return k
    return None


def _all_data(work: Path) -> Path:
    """All of the bundled chat data: what the draft vocabulary is counted on, as in training."""
    from eagle_fast.tiny import _data_path

    path = work / "all.jsonl"
    shutil.copyfile(_data_path(), path)
    return path


def verdicts(results: dict) -> H.Verdicts:
    records, v = results["records"], H.Verdicts()
    recommended = recommend(records)
    base = records.get("draft-bf16", {}).get("qwen3_8b_bytes_per_token")
    if recommended is None or base is None:
        v.check("storage: compact preset <= 14 KB/token at Qwen3-8B shapes", None,
                "no k met the rule" if recommended is None else "store/sizes.py is missing")
        return v
    r = records.get(f"preset-fp8-draft-topk-k{recommended}") or records[f"draft-topk-k{recommended}"]
    preset = _qwen3_bytes({"supervision": "draft-topk", "k": recommended, "out_dtype": "bf16", "aux_dtype": "fp8"})
    v.check(f"storage: compact preset (fp8 aux + draft-topk k={recommended}) <= 14 KB/token at Qwen3-8B shapes",
            preset <= PRESET_MAX_BYTES,
            f"{preset / 1000:.1f} KB vs bf16 draft {base / 1000:.1f} KB ({base / preset:.1f}x smaller); "
            f"KL mean {r['kl_mean']:.2e}, p99 {r['kl_p99']:.2e}, top-1 {100 * r['top1']:.2f}% on the trained tiny target")
    v.check("storage: compact preset >= 6x below bf16 draft at Qwen3-8B shapes", base / preset >= 6.0,
            f"{base / preset:.2f}x")
    return v


def errors(results: dict) -> list[str]:
    kl = results["records"]["draft-bf16"]["kl_mean"]
    return [] if not math.isnan(kl) else ["draft-bf16 read back: mean KL against fp32 is NaN"]


def summary(results: dict) -> str:
    return f"recommended k: {results['recommended_k']}"


test_storage = H.pytest_case(__name__)

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
