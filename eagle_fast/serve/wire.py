"""NeMo AutoModel 0.7.0's binary tensor format (`eagle/remote/wire.py`), written here from its spec.

Little-endian: magic `0x4E4D4554` ("NMET", uint32), then per entry: key length (uint32), the
UTF-8 key, flags (uint8, bit 0 = None); unless None: dtype code (uint8, `CODES`), ndim (uint8),
ndim x int64 shape, nbytes (uint64), the raw contiguous bytes.

`encoded_size` + `encode_chunks` stream a response without copying tensor data (header bytes,
then memoryviews of each tensor's own storage); `entry_header`, `entry_bytes` and `raw_bytes` let
a producer send an entry whose data does not exist yet as a whole (`serve/stream.py`); `encode`
joins them for small bodies; `decode` checks everything a client can get wrong and raises
`WireError` naming it.
Limits: CPU tensors only, as NeMo's encoder; no alignment padding (the format has none).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

import torch

from eagle_fast.errors import UserError
from eagle_fast.memory import MMAP_THRESHOLD

MAGIC = 0x4E4D4554
# NeMo's dtype codes (wire.py `_DTYPE_TABLE`), in its order
CODES: dict[int, torch.dtype] = {
    0: torch.float32, 1: torch.float64, 2: torch.float16, 3: torch.bfloat16, 4: torch.int64,
    5: torch.int32, 6: torch.int16, 7: torch.int8, 8: torch.uint8, 9: torch.bool,
}
CODE_OF = {dtype: code for code, dtype in CODES.items()}
_U32, _U8, _I64, _U64 = struct.Struct("<I"), struct.Struct("<B"), struct.Struct("<q"), struct.Struct("<Q")
_NONE = 0x01
# Streamed response pieces: bounds the server's copies of a body in flight (uvicorn joins each
# chunk with its framing, and the transport buffers what the socket does not take at once). Half
# the server's pinned mmap threshold, so each join reuses heap memory instead of paying an mmap,
# its page faults and an munmap: 1 MiB pieces cost the server more CPU per response
# (`bench/bench_serve.py`, "wire").
CHUNK_BYTES = MMAP_THRESHOLD // 2


class WireError(UserError):
    """A body that is not a valid wire blob (the cause says where it breaks)."""


def entry_header(key: str, dtype: torch.dtype | None, shape: tuple[int, ...] = ()) -> bytes:
    """One entry's bytes before its data (dtype None: a None entry, which has no data)."""
    name = key.encode("utf-8")
    head = _U32.pack(len(name)) + name
    if dtype is None:
        return head + _U8.pack(_NONE)
    code = CODE_OF.get(dtype)
    if code is None:
        raise TypeError(f"wire format: unsupported dtype {dtype} for {key!r}")
    nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
    dims = b"".join(_I64.pack(int(d)) for d in shape)
    return head + _U8.pack(0) + _U8.pack(code) + _U8.pack(len(shape)) + dims + _U64.pack(nbytes)


def _entry_header(key: str, tensor: torch.Tensor | None) -> bytes:
    if tensor is not None and tensor.device.type != "cpu":
        raise ValueError(f"wire format: {key!r} is on {tensor.device}; move it to the CPU first")
    return entry_header(key, None if tensor is None else tensor.dtype, () if tensor is None else tensor.shape)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview of its own (contiguous) storage."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def entry_bytes(key: str, dtype: torch.dtype | None, shape: tuple[int, ...] = ()) -> int:
    """One entry's encoded size: its header plus its data."""
    data = 0 if dtype is None else math.prod(int(d) for d in shape) * dtype.itemsize
    return len(entry_header(key, dtype, shape)) + data


def encoded_size(tensors: dict[str, torch.Tensor | None]) -> int:
    return _U32.size + sum(entry_bytes(key, None if t is None else t.dtype, () if t is None else tuple(t.shape))
                           for key, t in tensors.items())


def encode_chunks(tensors: dict[str, torch.Tensor | None], chunk_bytes: int = CHUNK_BYTES
                  ) -> Iterator[bytes | memoryview]:
    """The encoded blob in pieces: headers as bytes, tensor data as views of the tensors' memory
    (no copy), split at `chunk_bytes`. The tensors must stay alive until the pieces are sent."""
    yield _U32.pack(MAGIC)
    for key, t in tensors.items():
        yield _entry_header(key, t)
        if t is None:
            continue
        raw = raw_bytes(t)
        for start in range(0, len(raw), chunk_bytes):
            yield raw[start:start + chunk_bytes]


def encode(tensors: dict[str, torch.Tensor | None]) -> bytes:
    """The whole blob as bytes (one copy of the data: for small bodies and clients)."""
    return b"".join(bytes(piece) for piece in encode_chunks(tensors))


def decode(raw: bytes | bytearray | memoryview) -> dict[str, torch.Tensor | None]:
    """Blob -> {key: CPU tensor or None}. Each tensor owns a copy of its bytes (so it outlives
    the body and is writable). Raises WireError for a bad magic, a truncated entry, an unknown
    dtype code, nbytes that disagree with the shape, or a repeated key."""
    mv = memoryview(raw).cast("B")
    pos = 0

    def take(n: int, what: str) -> memoryview:
        nonlocal pos
        if pos + n > len(mv):
            raise WireError(f"body is truncated: {what} needs {n} bytes at offset {pos}, "
                            f"the body has {len(mv)}", _FIX)
        piece = mv[pos:pos + n]
        pos += n
        return piece

    if len(mv) < _U32.size or _U32.unpack(take(_U32.size, "the magic"))[0] != MAGIC:
        raise WireError("body is not in NeMo's wire format (no 0x4E4D4554 'NMET' magic at the start)",
                        _FIX)
    out: dict[str, torch.Tensor | None] = {}
    while pos < len(mv):
        key_len = _U32.unpack(take(_U32.size, "a key length"))[0]
        try:
            key = bytes(take(key_len, "a key")).decode("utf-8")
        except UnicodeDecodeError:
            raise WireError(f"a key at offset {pos - key_len} is not UTF-8", _FIX) from None
        if key in out:
            raise WireError(f"key {key!r} appears twice", _FIX)
        flags = take(1, f"{key!r}'s flags")[0]
        if flags & _NONE:
            out[key] = None
            continue
        code = take(1, f"{key!r}'s dtype code")[0]
        dtype = CODES.get(code)
        if dtype is None:
            raise WireError(f"{key!r} has unknown dtype code {code} (known: {sorted(CODES)})", _FIX)
        ndim = take(1, f"{key!r}'s rank")[0]
        shape = [_I64.unpack(take(_I64.size, f"{key!r}'s shape"))[0] for _ in range(ndim)]
        if any(d < 0 for d in shape):
            raise WireError(f"{key!r} has a negative dimension in shape {shape}", _FIX)
        nbytes = _U64.unpack(take(_U64.size, f"{key!r}'s byte count"))[0]
        want = dtype.itemsize
        for d in shape:
            want *= d
        if nbytes != want:
            raise WireError(f"{key!r}: {nbytes} data bytes for shape {shape} of {dtype} (needs {want})",
                            _FIX)
        data = bytearray(take(nbytes, f"{key!r}'s data"))
        flat = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        out[key] = flat.view(dtype).reshape(shape)
    return out


_FIX = "send the body NeMo's RemoteEagle3TargetModel sends (nemo_automodel ...eagle.remote.wire.encode)"
