"""One `generate` response, sent while the engine thread still computes it.

A response is NeMo's wire blob of `SUPERVISION_KEYS`, sent with chunked transfer encoding
(`app.py` says why). Its size is known from the request's shapes (`size`, checked against what
was sent before the last chunk goes out), and its largest entry, `target_probs [B, S, Vd]`, is
row-major: the engine hands over each head group's rows as soon as they are computed and
the event loop sends them, so the transfer overlaps the rest of the head pass and a response
never exists whole in the server (about one head group per torch thread in flight, instead
of B * S * Vd probabilities).

`ResponseStream` is the hand-over. The engine thread calls `begin(aux, shape)`, then `send`
(tensor rows) / `send_zeros` (the slots no token follows) in body order, then
`finish(tail)` with the entries after `target_probs`; or `fail(exc)`. The event loop iterates
`body()`. Pushes go through `loop.call_soon_threadsafe`, so the engine never waits for the
network (no back-pressure: a slow client holds at most its own response).

Limits: once the body has started, a failure can no longer become an HTTP status: `body()`
raises, the server closes the connection without the body's last chunk, and the client gets an
error for that request (NeMo's client: requests' ChunkedEncodingError), never partial data.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from eagle_fast.serve import wire

_END = object()
_ZEROS = bytes(wire.CHUNK_BYTES)


class ResponseStream:
    """The body of one response, pushed by the engine thread, pulled by the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.size: int | None = None  # the body's bytes, set by `begin`
        self.closed = False  # the body ended (sent, failed or abandoned): pushes are dropped

    # -- the engine thread ------------------------------------------------------------------------
    def _push(self, item) -> None:
        if not self.closed:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def begin(self, aux: torch.Tensor, probs_shape: tuple[int, ...], probs_dtype: torch.dtype,
              tail: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        """The body's size, then its first pieces after the magic (which `body` sends): the aux
        entry whole and the target_probs header. `tail` gives the (dtype, shape) of each entry
        after target_probs, for the size."""
        entries = {"aux_hidden_states": (aux.dtype, tuple(aux.shape)), "target_probs": (probs_dtype, probs_shape),
                   **tail}
        self.size = 4 + sum(wire.entry_bytes(key, dtype, shape) for key, (dtype, shape) in entries.items())
        self._push(wire.entry_header("aux_hidden_states", *entries["aux_hidden_states"]))
        self._push(aux)
        self._push(wire.entry_header("target_probs", probs_dtype, probs_shape))

    def send(self, rows: torch.Tensor) -> None:
        """The next target_probs rows (a contiguous tensor, kept alive until sent)."""
        self._push(rows)

    def send_zeros(self, nbytes: int) -> None:
        self._push(nbytes)

    def finish(self, tail: dict[str, torch.Tensor]) -> None:
        """The entries after target_probs, whole, then the end of the body."""
        for key, t in tail.items():
            self._push(wire.entry_header(key, t.dtype, tuple(t.shape)))
            self._push(t)
        self._push(_END)

    def fail(self, exc: BaseException) -> None:
        self._push(exc)

    # -- the event loop ---------------------------------------------------------------------------
    async def body(self) -> AsyncIterator[bytes | memoryview]:
        """The wire blob, piece by piece as the engine pushes it; raises the engine's failure."""
        sent = 4
        try:
            yield wire.MAGIC.to_bytes(4, "little")
            while True:
                item = await self._queue.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, int):  # zero bytes
                    for start in range(0, item, len(_ZEROS)):
                        piece = memoryview(_ZEROS)[: min(len(_ZEROS), item - start)]
                        sent += len(piece)
                        yield piece
                    continue
                raw = item if isinstance(item, bytes) else wire.raw_bytes(item)
                for start in range(0, len(raw), wire.CHUNK_BYTES):
                    piece = raw[start:start + wire.CHUNK_BYTES]
                    sent += len(piece)
                    yield piece
                raw = piece = item = None  # the rows are sent: their memory may go while we wait
            if sent != self.size:
                raise RuntimeError(f"response body is {sent} bytes, its shapes make {self.size}")
        finally:
            self.closed = True
