"""Launch a @triton.jit kernel compiled, or in triton's interpreter for CPU tensors.

Design: triton chooses interpreter or compiler once, when @triton.jit runs (TRITON_INTERPRET
at import), for our kernels and for triton.language's own jit functions (tl.sum, tl.max).
`run_kernel` chooses per launch instead: it runs an InterpretedFunction of the kernel's
Python function and, for that launch only, lets `JITFunction.__call__` (otherwise "Cannot
call @triton.jit'd outside of the scope of a kernel") run each callee interpreted. The
JITFunction objects stay as they are, for the compiler and the AOT path.
Limits: one interpreted launch at a time per process (the interpreter patches
triton.language while it runs); relies on triton's private `_patch_lang`, and falls back to
its plain, slower per-call patching where that is missing.
"""

from __future__ import annotations

import functools
import threading

from triton.language import standard
from triton.runtime.jit import JITFunction

_INTERP_LOCK = threading.Lock()
_INTERP_SCOPES: dict = {}  # id(module globals) -> language patch scope, during one launch


@functools.cache
def _interpreter():
    # triton.runtime.interpreter imports numpy, which triton does not declare; triton
    # itself imports it only when interpreting, and so do we: compiled launches on a GPU
    # need no numpy.
    from triton.runtime import interpreter

    return interpreter


@functools.cache
def _interpreted(fn):
    return _interpreter().InterpretedFunction(fn)


def _call_interpreted(self, *args, **kwargs):
    # Stands in for JITFunction.__call__ while a kernel is interpreted: runs the callee
    # interpreted. InterpretedFunction.__call__ would re-patch triton.language on every call
    # of tl.sum / tl.max (~6 ms each); patch once per callee module per launch instead
    # (restored by run_kernel).
    interp = _interpreted(self.fn)
    rewrite = getattr(interp, "rewrite", None)
    patch = getattr(_interpreter(), "_patch_lang", None)
    if rewrite is None or patch is None:  # other triton internals: the plain slow path
        return interp(*args, **kwargs)
    key = id(self.fn.__globals__)
    if key not in _INTERP_SCOPES:
        _INTERP_SCOPES[key] = patch(self.fn)
    return rewrite()(*args, **kwargs)


def _prepatch_interpreter(kernel) -> None:
    # The modules whose jit functions the launch will call: the kernel's, those of the jit
    # helpers it imports, and triton.language.standard (tl.max, tl.sum, ...).
    patch = getattr(_interpreter(), "_patch_lang", None)
    if patch is None:  # other triton internals: InterpretedFunction patches per call itself
        return
    fn = getattr(kernel, "fn", kernel)
    helpers = [v.fn for v in fn.__globals__.values() if isinstance(v, JITFunction)]
    for f in (fn, *helpers, standard.max.fn):
        key = id(f.__globals__)
        if key not in _INTERP_SCOPES:
            _INTERP_SCOPES[key] = patch(f)


def run_kernel(kernel, grid, interpret: bool, *args, **kwargs):
    """Launch `kernel[grid](*args, **kwargs)`, compiled, or in triton's interpreter when
    `interpret` (num_warps / num_stages are dropped there)."""
    if not interpret:
        kernel[grid](*args, **kwargs)
        return
    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    interpreted = _interpreter().InterpretedFunction
    fn = kernel if isinstance(kernel, interpreted) else _interpreted(kernel.fn)
    with _INTERP_LOCK:  # the interpreter patches triton.language while it runs
        saved = JITFunction.__call__
        JITFunction.__call__ = _call_interpreted
        try:
            # Patch the language for every module the launch reaches BEFORE the launch: the
            # launch's own patch then nests inside ours and is undone first, and ours (undone
            # in the finally) restores the true originals. Patched lazily inside the launch
            # instead, our scopes would record the launch's patched attributes as "originals"
            # and leave triton.language patched afterwards, breaking every later compilation
            # in the process.
            _prepatch_interpreter(kernel)
            fn[grid](*args, **kwargs)
        finally:
            JITFunction.__call__ = saved
            for scope in reversed(list(_INTERP_SCOPES.values())):
                if scope is not None:
                    scope.restore()
            _INTERP_SCOPES.clear()
