"""fp8 hidden states (`--aux-dtype fp8`): float8_e4m3fn with one fp32 scale per token.

`quantize(x [T, ...])` -> (q float8_e4m3fn [T, ...], scale fp32 [T]): scale_t = max(amax |x_t| /
448, 1e-12) over all of token t's values, q = x / scale saturated to ±448; `dequantize` is
q.float() * scale. This is hs_connectors 0.9.0's `quantize_tensor_to_fp8` bit for bit (the
layout speculators' FP8Transfer reads); its 1e-12 floor keeps an all-zero token finite (q = 0,
so it reads back as exact zeros). `error_bound` is the round-to-nearest bound of 3 mantissa
bits. `SCALE_NAMES` pairs every field that may be stored in fp8 with its scale field.
Limits: NeMo AutoModel's and SpecForge's readers cannot take fp8 (`check_aux_dtype` refuses it).
"""

from __future__ import annotations

import torch

from eagle_fast.errors import UserError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12                      # hs_connectors' floor
AUX_DTYPES = ("auto", "fp8")
# fp8 field -> its per-token fp32 scale (native: [T]; speculators: hs_connectors' [T, 1, 1])
SCALE_NAMES = {"aux_hidden_states": "aux_hidden_states_scale", "hidden": "hidden_scale",
               "hidden_states": "hidden_states_scales"}


def check_aux_dtype(layout: str, aux_dtype: str) -> None:
    """Raise a UserError for an --aux-dtype the layout (or this tool) cannot store."""
    if aux_dtype not in AUX_DTYPES:
        raise UserError(f"--aux-dtype {aux_dtype!r} is not one of {', '.join(AUX_DTYPES)}", "pick one of them")
    if layout == "nemo" and aux_dtype == "fp8":
        raise UserError(
            "--format nemo cannot store --aux-dtype fp8: NeMo AutoModel's caches are read as stored, "
            "without a scale (CachedEagle3Dataset's aux_hidden_states, CachedDSparkDataset's "
            "target_hidden_states and target_last_hidden_states), and its trainers feed them to the "
            "draft (its fc layer, the LM head) as they are (a float8 tensor fails there; dropping the "
            "scales would be wrong values)",
            "drop --aux-dtype fp8 for --format nemo, or use --format native or speculators for fp8",
        )
    if layout == "specforge" and aux_dtype == "fp8":
        raise UserError(
            "--format specforge cannot store --aux-dtype fp8: SpecForge 0.2.0 has no fp8 reader (its "
            "offline loader feeds the stored tensors to the draft as they are; gzip is its only compression)",
            "drop --aux-dtype fp8 for --format specforge, or use --format speculators or native for fp8",
        )


def stored_dtype(aux_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The on-disk dtype of hidden-state fields: fp8, or the target dtype for "auto"."""
    return FP8 if aux_dtype == "fp8" else dtype


def _per_token(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`scale` ([T] or [T, 1, ...]) shaped to broadcast over `like` [T, ...]."""
    return scale.reshape(like.shape[0], *([1] * (like.dim() - 1)))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, ...] (any float dtype) -> (float8_e4m3fn [T, ...], fp32 scale [T]), one scale per token."""
    x32 = x.float()
    amax = x32.abs().amax(dim=tuple(range(1, x32.dim())), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # saturate, whatever the cast does past 448
    return q, scale.reshape(x.shape[0])


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [T, ...] float8 times its per-token scale ([T] or [T, 1, ...]), in fp32, then cast to `dtype`."""
    return (q.float() * _per_token(scale.float(), q)).to(dtype)


def error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-element bound (float64) on |dequantize(quantize(x), dtype) - x|.

    Round to nearest with 3 mantissa bits errs by at most 2^-4 of a normal e4m3 value and by
    half the subnormal step (2^-10) below 2^-6, in units of the token's scale:
    2^-4 |x| + 2^-10 scale. Reading back in a narrower dtype adds its own rounding (eps / 2).
    """
    x64 = x.double().abs()
    bound = 2.0 ** -4 * x64 + 2.0 ** -10 * _per_token(scale.double(), x64)
    bound = bound * (1 + 2.0 ** -20)  # the fp32 division and product
    if dtype != torch.float32:
        bound = bound + torch.finfo(dtype).eps / 2 * (x64 + bound)
    return bound


def dequantize_sample(sample: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`sample` with every fp8 field dequantised to `dtype` and its scale field dropped; the other
    hidden-state fields (`SCALE_NAMES`) are cast to `dtype` when one is given."""
    out = {}
    for name, t in sample.items():
        if name in SCALE_NAMES.values():
            continue
        if name in SCALE_NAMES and t.dtype == FP8:
            t = dequantize(t, sample[SCALE_NAMES[name]], dtype or torch.float32)
        elif name in SCALE_NAMES and dtype is not None:
            t = t.to(dtype)
        out[name] = t
    return out
