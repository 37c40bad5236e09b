"""The tests' oracle is the package's reference (`eagle_fast.kernels.reference`), in float64.

`lm_head_oracle` takes `lm_head`'s own keyword arguments, so a test hands both the same `**kw`:
the ones that only choose what `lm_head` returns (outputs, out_dtype, impl) are dropped, since
the reference computes every output. `same_dtype=True` gives the yardstick of the tolerance
rule: the reference with its GEMM in the weight dtype, as plain PyTorch runs it.
`oracle_from_logits` is the reference's reduction, for logits from elsewhere (transformers').
"""

from __future__ import annotations

import torch
from eagle_fast.kernels.reference import lm_head_reference
from eagle_fast.kernels.reference import reduce_logits as oracle_from_logits

__all__ = ["lm_head_oracle", "oracle_from_logits"]


def lm_head_oracle(hidden, weight, norm_weight=None, *, same_dtype: bool = False,
                   outputs=None, out_dtype=None, impl=None, **kw):
    """`lm_head_reference(hidden, weight, norm_weight, **kw)` in float64, or in the weight dtype
    when `same_dtype`; `outputs`, `out_dtype` and `impl` are lm_head's and ignored here."""
    dtype = weight.dtype if same_dtype else torch.float64
    return lm_head_reference(hidden, weight, norm_weight, dtype=dtype, **kw)
