"""The Triton head as it was before issue 29, frozen: the "old" kernel `gpu_check.sh` times.

Issue 29 reworked the kernel from what static analysis of its sm_90 binaries showed (draft
tiles first with an argmax-only epilogue elsewhere, no host synchronisation, a one-pass draft
normalisation), and no GPU has timed either version. Its item 5 asks the first GPU run to
time the old and the new kernels side by side. The device machine receives the working tree
without git history, so the old kernel travels as this copy of `kernels/lm_head_triton.py` and
the `_triton_*` modules it imports, byte for byte as of commit a42d676^ (the parent of "Triton
head: draft tiles first"), with two changes: `._common` (unchanged since) is imported from
`eagle_fast.kernels`, and ruff re-sorted that import block.

Use: `from triton_before.lm_head_triton import lm_head_triton` with bench/ on sys.path, called
with a `HeadRequest` that `eagle_fast.kernels` built (bench/lm_head_cases.py's
"lm_head-triton-before" provider). Differences from the old call path that remain: the
public `lm_head`'s draft-id check is now cached per tensor (the old path re-read the ids to
the host on every call), so the old kernel's timing here is, if anything, flattering.
Not a product path and never edited: fixes go to `kernels/`; tests/test_triton_before.py only
checks that it still imports and agrees with the current kernel through the interpreter.
"""
