"""The head benchmark's goals as PASS/FAIL lines, from its records.

CPU: the PyTorch head within 1.1x of the faster of the seed's path and plain torch, at most 25 %
of the seed's peak extra memory (each measured in a fresh process), and within the floor goals
of the bare GEMM, the cheapest PyTorch offers (`shapes.floor_goal`). GPU: the Triton head within 1.1x (1.25x for top-k) of
the bare GEMM, 10x the seed's path, and no N x V buffer. `smoke` judges the tiny shapes with
both sets, so the GPU code runs on a CPU; its numbers mean nothing.
"""

from __future__ import annotations

import _floor
import _harness as H
import shapes
from shapes import HeadShape


def _find(records, shape_name, n_tokens, mode, provider):
    for r in records:
        if (r["shape"], r["n_tokens"], r["mode"], r["provider"]) == (shape_name, n_tokens, mode, provider):
            return r
    return None


def evaluate_targets(records: list, device: str, smoke: bool = False) -> H.Verdicts:
    """The issue's targets as PASS/FAIL lines. `smoke` runs both checks on the smoke shapes
    (numbers meaningless) so the GPU verdict code is exercised on a CPU."""
    v = H.Verdicts()
    if smoke:
        s = shapes.SMOKE[0]
        _cpu_targets(v, records, s, "all", tag="smoke, meaningless: ")
        _gpu_targets(v, records, s, ("lse+argmax", "draft32k", "topk64"), tag="smoke, meaningless: ")
    elif device == "cpu":
        _cpu_targets(v, records, *shapes.TARGETS["cpu"])
        _floor_targets(v, records)
    else:
        _gpu_targets(v, records, *shapes.TARGETS["cuda"])
    return v


def _cpu_targets(v: H.Verdicts, records, shape: HeadShape, mode: str, tag: str = "") -> None:
    p1, p2, p3 = (_find(records, shape.name, shape.n_tokens, mode, p)
                  for p in ("seed-fp32", "torch-native", "lm_head-torch"))
    where = f"{tag}N={shape.n_tokens} H={shape.hidden} V={shape.vocab} {mode}"
    if not (p1 and p3 and p1["median_s"] and p3["median_s"]):
        v.check(f"CPU time ({where})", None, "not measured")
        v.check(f"CPU memory ({where})", None, "not measured")
        return
    base_name, base = min(((n, r) for n, r in (("seed-fp32", p1), ("torch-native", p2))
                           if r and r["median_s"]), key=lambda nr: nr[1]["median_s"])
    ratio = p3["median_s"] / base["median_s"]
    v.check(f"CPU time ({where}): lm_head-torch <= 1.1x the faster of providers 1 and 2",
            ratio <= 1.1, f"{H.fmt_s(p3['median_s'])} vs {base_name} {H.fmt_s(base['median_s'])}"
            f" = {ratio:.2f}x")
    sub = p1.get("peak_extra_bytes_subprocess") and p3.get("peak_extra_bytes_subprocess")
    m1 = p1["peak_extra_bytes_subprocess"] if sub else p1["peak_extra_bytes"]
    m3 = p3["peak_extra_bytes_subprocess"] if sub else p3["peak_extra_bytes"]
    how = "each in a fresh subprocess" if sub else "in-process, first call"
    if m1 and m3 is not None:
        mr = m3 / m1
        v.check(f"CPU memory ({where}): lm_head-torch peak extra <= 25% of provider 1",
                mr <= 0.25, f"{H.fmt_bytes(m3)} vs {H.fmt_bytes(m1)} = {100 * mr:.1f}% ({how})")
    else:
        v.check(f"CPU memory ({where})", None, "not measured")


def _floor_targets(v: H.Verdicts, records) -> None:
    """The head's ("draft", "argmax") call against the bare GEMM of its shape (CPU)."""
    for shape in shapes.FLOOR_SHAPES:
        bound = shapes.floor_goal(shape, _floor.floor_isa())
        head = _find(records, shape.name, shape.n_tokens, "draft32k", "lm_head-torch")
        floor = _find(records, shape.name, shape.n_tokens, "draft32k", "gemm-floor")
        where = f"N={shape.n_tokens} H={shape.hidden} V={shape.vocab} draft32k+argmax"
        if not (head and floor and head["median_s"] and floor["median_s"]):
            v.check(f"CPU head vs floor ({where})", None, "not measured")
            continue
        ph = head.get("phases_s") or {}
        outside = ", ".join(f"{p} {100 * ph[p] / ph['total']:.0f}%" for p in _floor.PHASES
                            if p != "gemm" and ph.get(p) and ph.get("total"))
        v.check(f"CPU head vs floor ({where}): lm_head-torch <= {bound}x the bare GEMM",
                head["vs_floor"] <= bound,
                f"{H.fmt_s(head['median_s'])} vs {H.fmt_s(floor['median_s'])} "
                f"({floor['floor_kind']}) = {head['vs_floor']:.2f}x{_beside(records, shape)}; by phase: gemm "
                f"{100 * ph.get('gemm', 0) / ph.get('total', 1):.0f}%, {outside}")


def _beside(records, shape) -> str:
    """", fp32-out GEMM ...": the fp32-output GEMM beside a bf16-output floor, where measured."""
    fp32out = _find(records, shape.name, shape.n_tokens, "draft32k", "gemm-fp32out")
    if not (fp32out and fp32out["median_s"]):
        return ""
    return f" (fp32-out GEMM beside it: {H.fmt_s(fp32out['median_s'])}, {fp32out['floor_kind']})"


def _gpu_targets(v: H.Verdicts, records, shape: HeadShape, modes, tag: str = "") -> None:
    nv2 = 2 * shape.n_tokens * shape.vocab
    for mode in modes:
        tri = _find(records, shape.name, shape.n_tokens, mode, "lm_head-triton")
        gemm = _find(records, shape.name, shape.n_tokens, mode, "gemm-floor")
        seed = _find(records, shape.name, shape.n_tokens, mode, "seed-fp32")
        where = f"{tag}N={shape.n_tokens} H={shape.hidden} V={shape.vocab} {mode}"
        if not (tri and tri["median_s"]):
            v.check(f"GPU ({where})", None, "lm_head-triton not measured")
            continue
        if tri["status"].startswith("error"):
            v.check(f"GPU ({where})", False, tri["status"])
            continue
        bound = 1.25 if mode == "topk64" else 1.10  # the GPU goals, raised from 1.3x / 1.15x
        if gemm and gemm["median_s"]:
            r = tri["median_s"] / gemm["median_s"]
            v.check(f"GPU time ({where}): triton <= {bound}x bare GEMM", r <= bound,
                    f"{H.fmt_s(tri['median_s'])} vs {H.fmt_s(gemm['median_s'])} = {r:.2f}x "
                    f"({tri['tflops']:.1f} vs {gemm['tflops']:.1f} TFLOP/s)")
        else:
            v.check(f"GPU time ({where})", None, "bare GEMM not measured")
        old = _find(records, shape.name, shape.n_tokens, mode, "lm_head-triton-before")
        if old and old["median_s"] and not old["status"].startswith("error"):
            r = tri["median_s"] / old["median_s"]
            v.check(f"GPU ({where}): issue 29's kernel no slower than the one before it", r <= 1.0,
                    f"{H.fmt_s(tri['median_s'])} vs {H.fmt_s(old['median_s'])} = {r:.2f}x")
        pers = _find(records, shape.name, shape.n_tokens, mode, "lm_head-triton-persistent")
        if pers and pers["median_s"] and not pers["status"].startswith("error"):
            r = pers["median_s"] / tri["median_s"]  # no goal yet: which kernel to make the default
            v.check(f"GPU ({where}): persistent TMA-fed kernel / tiled kernel", None,
                    f"{H.fmt_s(pers['median_s'])} vs {H.fmt_s(tri['median_s'])} = {r:.2f}x")
        if seed and seed["median_s"]:
            s = seed["median_s"] / tri["median_s"]
            v.check(f"GPU speed-up ({where}): triton >= 10x provider 1", s >= 10,
                    f"{H.fmt_s(seed['median_s'])} / {H.fmt_s(tri['median_s'])} = {s:.1f}x")
        if tri["peak_extra_bytes"] is not None:
            scratch = tri["peak_extra_bytes"] - (tri["output_bytes"] or 0)
            v.check(f"GPU memory ({where}): no N x V buffer (scratch <= 25% of N*V*2 B)",
                    scratch <= 0.25 * nv2,
                    f"peak extra {H.fmt_bytes(tri['peak_extra_bytes'])} = outputs "
                    f"{H.fmt_bytes(tri['output_bytes'])} + scratch {H.fmt_bytes(scratch)}; "
                    f"N*V*2 = {H.fmt_bytes(nv2)}")
