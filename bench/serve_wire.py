"""The "wire" cost: CPU seconds per response body, client and server, by framing and piece size.

A bare uvicorn app with our server's malloc settings answers a body of zero bytes with a
Content-Length or chunked, in pieces of a given size; the client reads it with requests (NeMo's
client's HTTP library, `resp.content`). The variants are interleaved round by round and each
side's CPU seconds (user + system, all threads, from /proc) are kept. Run as a script, this
file is that app: `python bench/serve_wire.py PORT BYTES`. Used by bench_serve.py.
"""

from __future__ import annotations

import statistics
import sys

from _procs import cpu_seconds, free_port, spawn, wait_up

WIRE_VARIANTS = {  # name: (framing, bytes per piece the app yields)
    "length-1MiB": ("length", 1 << 20), "chunked-1MiB": ("chunked", 1 << 20), "chunked-128KiB": ("chunked", 128 << 10)}


def wire_server_main(port: int, nbytes: int) -> None:
    """A bare uvicorn app with our server's malloc settings: POST /{framing}/{piece} answers
    `nbytes` zero bytes in pieces of `piece` bytes, with a Content-Length ("length") or chunked
    (uvicorn frames each piece, joining it with its size line into a new bytes object); GET
    /health for `wait_up`."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from eagle_fast.memory import return_freed_memory

    return_freed_memory()
    zeros = memoryview(bytes(max(piece for _, piece in WIRE_VARIANTS.values())))
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/{framing}/{piece}")
    async def send(framing: str, piece: int):
        async def body():
            for start in range(0, nbytes, piece):
                yield zeros[: min(piece, nbytes - start)]

        headers = {"content-length": str(nbytes)} if framing == "length" else None
        return StreamingResponse(body(), headers=headers)

    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).run()


def wire_cost(nbytes: int, rounds: int = 15) -> dict:
    """CPU seconds per body of `nbytes`, by framing and piece size (`WIRE_VARIANTS`): the client's
    (this process, requests' `resp.content`, as NeMo's client reads) and the server's (the app's
    process); the variants interleaved `rounds` times, the median of each."""
    import requests

    port = free_port()
    server = spawn([__file__, str(port), str(nbytes)])
    try:
        wait_up(f"http://127.0.0.1:{port}", server, timeout=60)
        session = requests.Session()
        session.trust_env = False
        cpu = {name: {"client_cpu_s": [], "server_cpu_s": []} for name in WIRE_VARIANTS}
        for _ in range(rounds):
            for name, (framing, piece) in WIRE_VARIANTS.items():
                c0, s0 = cpu_seconds("self"), cpu_seconds(server.pid)
                got = len(session.post(f"http://127.0.0.1:{port}/{framing}/{piece}", timeout=120).content)
                cpu[name]["client_cpu_s"].append(cpu_seconds("self") - c0)
                cpu[name]["server_cpu_s"].append(cpu_seconds(server.pid) - s0)
                assert got == nbytes, (name, got)
    finally:
        server.terminate()
        server.wait(30)
    return {"bytes": nbytes, "rounds": rounds,
            "variants": {name: {"framing": framing, "piece_bytes": piece, **cpu[name],
                                **{f"median_{k}": statistics.median(v) for k, v in cpu[name].items()}}
                         for name, (framing, piece) in WIRE_VARIANTS.items()}}


if __name__ == "__main__":
    wire_server_main(int(sys.argv[1]), int(sys.argv[2]))
