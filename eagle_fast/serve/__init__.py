"""`eagle-fast serve`: online EAGLE-3 supervision over NeMo AutoModel 0.7.0's remote-target protocol.

`wire` (NeMo's binary tensor format, written here) -> `protocol` (endpoints, response keys,
request checks) -> `batching` (the engine thread: waiting requests coalesce into one engine
call and one head pass) -> `app` (FastAPI + uvicorn, lifecycle). NeMo itself is never imported.
"""
