"""The runner an extraction computes with: built, aux layers set, the head placed, and its
captures checked against the engine before the first batch.

`build_runner` starts the engine (`head_in_worker_settings` / `enable_worker_supervision` put the
head in vLLM's worker where asked and where it pays). `engine_check` is the check every vLLM run
makes, here and on each Ray worker: log-probs rebuilt from the captured final hidden state of a
few sequences of the run's first shard (`check_sequences`) against vLLM's own prompt log-probs
from the same engine call. A difference past the tolerance stops the run before anything is
stored: the data would be wrong for the engine that serves the draft (a wrong layer in the final
slot, a pre/post-norm mix-up, a head rule missed). The figures go into the manifest's run record.
Limits: the transformers engine needs no check (its captures are its own forward); with
--head-in-worker the final state stays in the worker, so the check is skipped and says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eagle_fast.errors import UserError
from eagle_fast.pipeline.config import ExtractPlan
from eagle_fast.store.layouts import Layout

CHECK_SEQUENCES = 4  # of the run's first shard
CHECK_TOKENS = 256  # of each: the check costs one prefill of at most 1,024 tokens
CHECK_LOGPROBS = 5  # vLLM's top ids per position, plus the prompt token
# |ours - vLLM's| <= ABS_TOL + REL_TOL[dtype] * max |logit|: fp32 heads agree to ~1e-6; a 16-bit
# engine rounds its logits (2^-9 relative for bf16), so 16x that rounding, relative to the logits.
ABS_TOL = 1e-3
REL_TOL = {torch.float32: 0.0, torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}


def check_sequences(p: ExtractPlan) -> list[list[int]]:
    """The token prefixes the engine check runs: the first samples of the first pending shard."""
    if not p.pending:
        return []
    return [s.input_ids[:CHECK_TOKENS] for s in p.pending[0].samples[:CHECK_SEQUENCES] if s.length >= 2]


def engine_check(runner, engine: str, sequences: list[list[int]], enabled: bool = True,
                 head_in_worker: bool = False) -> dict:
    """Compare the runner's captures with its engine on `sequences`; the figures, or why it was
    skipped. Raises UserError when the capture disagrees with the engine past the tolerance."""
    if not enabled:
        return {"skipped": "--no-engine-check"}
    if engine != "vllm":
        return {"skipped": f"the {engine} engine: its captures are its own forward pass"}
    if head_in_worker:
        return {"skipped": "--head-in-worker: the final hidden state stays in the engine's worker"}
    check = getattr(runner, "check_against_engine", None)
    if not callable(check) or not sequences:
        return {"skipped": f"{type(runner).__name__} cannot be checked" if sequences else "no sequence"}
    t0 = time.perf_counter()
    fig = dict(check(sequences, CHECK_LOGPROBS))
    dtype = getattr(runner, "dtype", torch.float32)
    tol = ABS_TOL + REL_TOL.get(dtype, 2.0**-5) * fig.pop("max_abs_logit", 0.0)
    fig.update(sequences=len(sequences), tokens=sum(map(len, sequences)), tolerance=tol,
               seconds=round(time.perf_counter() - t0, 3))
    if not fig["max_abs_err"] <= tol:  # NaN fails too
        spec = getattr(getattr(runner, "head", None), "spec", None)
        raise UserError(
            f"engine check: the log-probs rebuilt from the captured final hidden state differ from vLLM's own "
            f"prompt log-probs by up to {fig['max_abs_err']:.4g} (tolerance {tol:.2g}) over {fig['positions']} "
            f"positions of {len(sequences)} sequences (top-1 agreement {100 * fig['top1_agreement']:.1f} %), "
            f"so the data would not match the engine that serves the draft; the capture or the head is "
            f"wrong for this model: the final slot not the last layer's pre-norm output, a pre/post-norm "
            f"mix-up, or a head rule missed (the head applies {spec})",
            "report it with the model's config.json; nothing was stored. --no-engine-check stores the data "
            "anyway, for a model whose difference you have found to be the engine's own")
    return fig


def build_runner(factory: Callable, engine: str, model: str, dtype: torch.dtype, max_len: int,
                 aux_layer_ids: list[int], worker_supervision: dict | None = None):
    """The engine's runner with its aux layers set (the vLLM engine starts here), dtype checked;
    with `worker_supervision` (`head_in_worker_settings`) the head runs in the engine's worker."""
    runner = factory(engine, model, dtype, max_len)
    try:
        if worker_supervision is not None:
            enable_worker_supervision(runner, worker_supervision, aux_layer_ids)
        set_capture_layers(runner, aux_layer_ids)
        if getattr(runner, "dtype", dtype) != dtype:
            raise RuntimeError(f"the engine runs in {runner.dtype}, the extraction asked for {dtype}")
        mml = getattr(runner, "max_model_len", None)
        if mml is not None and max_len > int(mml):
            raise UserError(f"the longest sample has {max_len} tokens but the engine allows {mml}",
                            f"pass --max-len {mml} or less")
    except BaseException:
        runner.close()
        raise
    return runner


def head_in_worker_settings(engine: str, layout: Layout, draft_ids: torch.Tensor | None,
                            on_ray: bool = False) -> dict:
    """`set_worker_supervision`'s arguments for a run that asks for `--head-in-worker`; a
    UserError names what rules it out: another engine, Ray (`on_ray`), or a layout that stores
    the final hidden state or no head output. The bytes rule is `enable_worker_supervision`'s."""
    kind = layout.spec.kind
    problem = (f"the {engine} engine runs no vLLM worker" if engine != "vllm" else
               "Ray workers build their runners without it" if on_ray else
               f"--supervision {kind} stores the final hidden state itself" if layout.final_states()
               else f"--supervision {kind} runs no head" if layout.head_outputs() is None else None)
    if problem:
        raise UserError(f"--head-in-worker cannot work here: {problem}",
                        "drop --head-in-worker (head_in_worker=False): the file path runs the head here")
    ids = None
    if {"draft", "draft_topk"} & set(layout.head_outputs()):
        ids = draft_ids if draft_ids is not None else torch.arange(layout.spec.vocab_size)
    return {"outputs": layout.head_outputs(), "k": layout.spec.k, "draft_ids": ids,
            "out_dtype": layout.head_out_dtype(), "fields": layout.head_fields()}


def set_capture_layers(runner, layer_ids: list[int]) -> None:
    """The layers a runner captures, any number (`RunnerBase.set_capture_layers`); a runner with NeMo's
    surface alone takes them through `set_aux_layers` (EAGLE-3's three)."""
    setter = getattr(runner, "set_capture_layers", None)
    (setter or runner.set_aux_layers)(list(layer_ids))


def enable_worker_supervision(runner, settings: dict, aux_layer_ids: list[int]) -> None:
    """Ask `runner` (before its engine starts) for supervision from the engine's worker, where it
    stages fewer bytes per token than the file path; else a UserError with the numbers."""
    if not callable(getattr(runner, "set_worker_supervision", None)):
        raise UserError(f"--head-in-worker: the runner {type(runner).__name__} cannot run the head in its worker",
                        "drop --head-in-worker, or use eagle_fast's VLLMTargetRunner")
    runner.set_worker_supervision(**settings)
    file_b, worker_b = runner.worker_staging(aux_layer_ids)
    if worker_b >= file_b:
        runner.set_worker_supervision(None)
        last = runner.num_layers - 1
        why = (f"aux layer {last} is the last layer, whose capture is the final hidden state itself, so "
               "the worker keeps nothing back" if last in aux_layer_ids else "the supervision asked for is "
               f"not smaller than the final hidden state it replaces (H={runner.hidden_size})")
        raise UserError(f"--head-in-worker would stage {worker_b:,} bytes per token against the file "
                        f"path's {file_b:,}: {why}",
                        "drop --head-in-worker here (it pays for draft-topk, topk and lse when no aux "
                        "layer is the last one)")


