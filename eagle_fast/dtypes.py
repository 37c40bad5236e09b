"""The one dtype table: names users and files use, safetensors codes, numpy twins.

Short names ("fp32", "bf16", "fp16") are what the CLI takes and manifests store; long names
("float32", ...) are what Hugging Face configs and safetensors headers say. Every stage
parses and prints dtypes through here, so a name means the same everywhere.
"""

from __future__ import annotations

import torch

# The dtypes a target runs in, by their short names (CLI, manifests).
SHORT_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Every name `parse_dtype` accepts: the short ones, torch's own and the config aliases.
_ALIASES = {**SHORT_NAMES, "float32": torch.float32, "float": torch.float32,
            "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
# safetensors header codes
SAFETENSORS_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}
# numpy dtypes with torch's memory layout (bf16 through its 16-bit pattern)
NUMPY_TWINS = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "uint16",
               torch.int64: "int64", torch.int32: "int32", torch.bool: "bool"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A target dtype from a short name, a long name ("bfloat16", "torch.bfloat16") or itself."""
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        dtype = _ALIASES.get(str(name).replace("torch.", ""))
        if dtype is None:
            raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_ALIASES)}")
    if dtype not in SHORT_NAMES.values():
        raise ValueError(f"unsupported target dtype {dtype}; use float32, float16 or bfloat16")
    return dtype


def short_name(dtype: torch.dtype) -> str:
    """"fp32" | "bf16" | "fp16"."""
    return next(k for k, v in SHORT_NAMES.items() if v == dtype)


def long_name(dtype: torch.dtype) -> str:
    """torch's name without the prefix: "float32", "bfloat16", "int64", ..."""
    return str(dtype).replace("torch.", "")
