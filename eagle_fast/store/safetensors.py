"""safetensors files written block by block, and cached read handles.

`SafetensorsWriter` fixes a file's layout up front (header, offsets, preallocated size) and
then takes rows in any order through `os.pwrite`, so memory is bounded by one batch rather
than one shard; the bytes depend only on the specs and the data. `write_safetensors` writes a
dict of tensors the same way; `open_safetensors` keeps one read handle per file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle_fast.dtypes import SAFETENSORS_CODES
from eagle_fast.files import fsync_dir, temp_path_for

# ------------------------------------------------------------------ safetensors writing


class SafetensorsWriter:
    """A safetensors file whose layout is fixed up front and filled block by block.

    The header (tensor names, dtypes, shapes, offsets) is written first and the file is
    preallocated; `write(name, row, tensor)` then places rows with `os.pwrite`, in any order.
    This bounds memory by one batch instead of one shard and lets length-bucketed batches
    land in sample order. The bytes depend only on the specs and the data: tensors are laid
    out in name order, the JSON header has sorted keys and is space-padded to 8-byte
    alignment (as safetensors itself does). `commit()` fsyncs and renames the temp file
    into place; `abort()` removes it. `late` tensors (1-d, their length known only at commit,
    e.g. the ragged draft top-k) are given to `commit` whole and laid out after the others.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        tag: str = "",
        late: dict[str, tuple[torch.dtype, int]] | None = None,
    ):
        self.path = Path(path)
        self.tmp = temp_path_for(self.path, tag)
        self._layout: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        header, offset = self._place(specs, 0, self._layout)
        self._fixed_header = dict(header)
        self._metadata = {str(k): str(v) for k, v in sorted(metadata.items())} if metadata else None
        # `late`: 1-d tensors (name -> (dtype, most elements)) whose length is known at commit
        # only; they follow the others, and the header is sized for their largest length, so
        # the rows written before stay where they are (the header is space-padded to it).
        self._late = dict(late or {})
        self._fixed_end = offset
        if self._late:
            header.update(self._place({n: (d, (most,)) for n, (d, most) in self._late.items()}, offset, {})[0])
        raw = self._header_bytes(header)
        self._data_start = 8 + len(raw)
        self.total_bytes = self._data_start + offset
        self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(self._fd, self.total_bytes)
        except BaseException:
            self.abort()
            raise

    @staticmethod
    def _place(specs, offset: int, layout: dict) -> tuple[dict[str, Any], int]:
        """Header entries for `specs` laid out in name order from `offset`; fills `layout`."""
        header: dict[str, Any] = {}
        for name in sorted(specs):
            dtype, shape = specs[name]
            shape = tuple(int(s) for s in shape)
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            row_bytes = nbytes // shape[0] if shape and shape[0] else 0
            header[name] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            layout[name] = (offset, row_bytes, dtype, shape)
            offset += nbytes
        return header, offset

    def _header_bytes(self, header: dict[str, Any]) -> bytes:
        if self._metadata:
            header["__metadata__"] = self._metadata
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        return raw + b" " * ((-(8 + len(raw))) % 8)

    def write(self, name: str, row: int, tensor: torch.Tensor) -> None:
        """Write `tensor` (rows of `name`'s trailing shape) starting at row `row`."""
        begin, row_bytes, dtype, shape = self._layout[name]
        t = tensor.detach()
        if t.dtype != dtype:
            t = t.to(dtype)
        if tuple(t.shape[1:]) != shape[1:]:
            raise ValueError(f"{name}: rows of shape {tuple(t.shape[1:])}, expected {shape[1:]}")
        if row < 0 or row + t.shape[0] > shape[0]:
            raise ValueError(f"{name}: rows [{row}, {row + t.shape[0]}) outside [0, {shape[0]})")
        if t.numel() == 0:
            return
        buf = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        try:
            os.pwrite(self._fd, buf, self._data_start + begin + row * row_bytes)
        except OSError as exc:  # named: a full disk's error says which file it was writing
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def commit(self, late: dict[str, torch.Tensor] | None = None) -> Path:
        """Fsync and rename into place; `late` gives the late tensors (1-d), all of them."""
        if set(late or {}) != set(self._late):
            raise ValueError(f"commit needs the late tensors {sorted(self._late)}, got {sorted(late or {})}")
        try:
            return self._commit(late)
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def _commit(self, late: dict[str, torch.Tensor] | None) -> Path:
        if self._late:
            tensors = {n: late[n].detach().reshape(-1).to(self._late[n][0]) for n in self._late}
            for n, t in tensors.items():
                if t.numel() > self._late[n][1]:
                    raise ValueError(f"{n}: {t.numel()} elements, more than the {self._late[n][1]} reserved")
            layout: dict = {}
            header, end = self._place({n: (t.dtype, (t.numel(),)) for n, t in tensors.items()},
                                      self._fixed_end, layout)
            header.update(self._fixed_header)
            raw = self._header_bytes(header)
            if 8 + len(raw) > self._data_start:
                raise RuntimeError("the late tensors' header outgrew its reserved space")
            raw += b" " * (self._data_start - 8 - len(raw))
            os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
            for n, t in tensors.items():
                if t.numel():
                    os.pwrite(self._fd, t.cpu().contiguous().view(torch.uint8).numpy(), self._data_start + layout[n][0])
            os.ftruncate(self._fd, self._data_start + end)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None, tag: str = "") -> Path:
    """Atomically write whole tensors (deterministic bytes, see SafetensorsWriter)."""
    w = SafetensorsWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, metadata, tag)
    try:
        for k, v in tensors.items():
            if v.dim() == 0:
                raise ValueError(f"{k}: 0-d tensors are not supported")
            w.write(k, 0, v)
        return w.commit()
    except BaseException:
        w.abort()
        raise


def open_safetensors(path: Path, handles: dict | None):
    """A `safe_open` handle on `path`, kept in (and reused from) `handles` when given."""
    key = str(path)
    if handles is not None and key in handles:
        return handles[key]
    h = safe_open(key, framework="pt")
    if handles is not None:
        handles[key] = h
    return h
