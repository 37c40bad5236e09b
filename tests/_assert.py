"""Assertion helpers whose failure messages say what went wrong, where, and by how much.

`assert_close` compares in float64 on the actual tensor's device (GPU-sized outputs are not
copied to the host) and reports the mismatch count, the first mismatching indices with both
values, the max abs / rel error, and NaN / inf presence on each side. `assert_ids_equal` does
the same for integer and bool tensors (ids, masks).
"""

from __future__ import annotations

import torch

_SHOW = 5  # mismatches listed in a failure message


def _where(mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in idx) for idx in mask.nonzero()[:_SHOW]]


def _nonfinite(name: str, t: torch.Tensor) -> str:
    n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"{name}: {n_nan} NaN, {n_inf} inf"


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, name: str
) -> None:
    """Elementwise |actual - expected| <= atol + rtol * |expected|, else AssertionError.

    NaN never passes (not even NaN vs NaN); an infinity passes only against the same infinity.
    Shapes must match exactly (no broadcasting); dtypes may differ (both go to float64).
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(a.device, torch.float64)
    diff = (a - e).abs()
    same_inf = torch.isinf(e) & (a == e)
    ok = (diff <= atol + rtol * e.abs()) | same_inf
    if bool(ok.all()):
        return
    bad = ~ok
    finite = torch.isfinite(diff) & ~same_inf
    max_abs = float(diff[finite].max()) if bool(finite.any()) else float("nan")
    rel = diff / e.abs().clamp_min(1e-300)
    max_rel = float(rel[finite].max()) if bool(finite.any()) else float("nan")
    first = ", ".join(f"{i}: {float(a[i]):.8g} vs {float(e[i]):.8g}" for i in _where(bad))
    raise AssertionError(
        f"{name}: {int(bad.sum())} / {bad.numel()} elements differ beyond atol={atol:.3g} + "
        f"rtol={rtol:.3g} * |expected|; max abs err {max_abs:.4g}, max rel err {max_rel:.4g}; "
        f"{_nonfinite('actual', a)}; {_nonfinite('expected', e)}; "
        f"first (actual vs expected): {first}"
    )


def assert_ids_equal(actual: torch.Tensor, expected: torch.Tensor, *, name: str) -> None:
    """Exact equality of integer / bool tensors (same shape), else AssertionError."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    a = actual.detach().to(torch.int64)
    e = expected.detach().to(a.device, torch.int64)
    bad = a != e
    if not bool(bad.any()):
        return
    first = ", ".join(f"{i}: {int(a[i])} vs {int(e[i])}" for i in _where(bad))
    raise AssertionError(
        f"{name}: {int(bad.sum())} / {bad.numel()} entries differ; "
        f"first (actual vs expected): {first}"
    )
