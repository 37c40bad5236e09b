"""The user's loop around extraction: `regenerate` (the chats' assistant turns rewritten by the
target, through one vLLM engine) and `accept` (a trained draft's acceptance, as vLLM's own
speculative decoding counts it). Both read every input form `extract` reads (`rows`), render
prompts with the same `ChatFormat`, and take `extract`'s vLLM engine settings (`engine`).
"""
