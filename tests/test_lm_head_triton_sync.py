"""The Triton head's call path never waits on the device: no host synchronisation per call.

How, without a GPU: `NoHostSync`, a TorchDispatchMode, sees every aten op that `lm_head`'s
host code issues and fails on each one that reads device memory back to the host on CUDA:
`_local_scalar_dense` (item, int, float, bool of a tensor), `nonzero`, `masked_select`,
`unique`, boolean-mask indexing, `equal`; `Tensor.tolist` / `numpy`, which can bypass the
dispatcher on CPU, are patched too. The kernels run outside the guard (the wrapped
`run_kernel` lifts it for each launch): triton's interpreter reads CPU tensors on the host, as
a GPU launch never does. The same host code runs for CUDA tensors (`_Head.run`), so a
`.tolist()`, `.nonzero()` or `int(tensor)` reintroduced into the CUDA call path fails here.
Not seen: an explicit copy to the CPU (`.cpu()`, `.to("cpu")`), which is a plain copy here.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _assert import assert_ids_equal
from _oracle import lm_head_oracle
from eagle_fast.kernels import lm_head
from torch.utils._python_dispatch import TorchDispatchMode

lm = importlib.import_module("eagle_fast.kernels.lm_head_triton")
norm = importlib.import_module("eagle_fast.kernels._triton_norm")

_SYNCING = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::equal",
    "aten::is_nonzero",
}


class NoHostSync(TorchDispatchMode):
    """Fails on every op that synchronises a CUDA device with the host, unless suspended."""

    def __init__(self):
        super().__init__()
        self.suspended = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.suspended:
            name = func._schema.name
            bool_index = name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
            )
            if (
                name in _SYNCING
                or bool_index
                or (name == "aten::repeat_interleave" and kwargs.get("output_size") is None)
            ):
                raise AssertionError(f"host synchronisation in the call path: {func}")
        return func(*args, **kwargs)


@pytest.fixture
def no_host_sync(monkeypatch):
    guard = NoHostSync()

    def refuse(name):
        real = getattr(torch.Tensor, name)

        def method(self, *a, **kw):
            if guard.suspended == 0 and guard_on:
                raise AssertionError(f"host synchronisation in the call path: Tensor.{name}")
            return real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, method)

    guard_on = False
    for name in ("tolist", "numpy"):
        refuse(name)
    for module in (lm, norm):
        real_run = module.run_kernel

        def run(*a, _real=real_run, **kw):
            guard.suspended += 1
            try:
                return _real(*a, **kw)
            finally:
                guard.suspended -= 1

        monkeypatch.setattr(module, "run_kernel", run)

    class Guard:
        def __enter__(self):
            nonlocal guard_on
            guard_on = True
            guard.__enter__()

        def __exit__(self, *exc):
            nonlocal guard_on
            guard_on = False
            return guard.__exit__(*exc)

    return Guard


def _inputs(gen, N=24, H=64, V=1700, Vd=600):
    hidden = torch.randn(N, H, generator=gen).bfloat16()
    weight = (torch.randn(V, H, generator=gen) * 0.5).bfloat16()
    norm_weight = torch.rand(H, generator=gen).bfloat16() + 0.5
    draft = torch.randperm(V, generator=gen)[:Vd].sort().values
    return hidden, weight, norm_weight, draft


def test_the_guard_catches_syncs(no_host_sync):
    """Negative control: what the guard exists to catch does fail under it."""
    t = torch.arange(5)
    for sync in (lambda: int(t.sum()), lambda: t.nonzero(), lambda: t.tolist(),
                 lambda: bool((t > 2).any()), lambda: t[t > 2]):  # fmt: skip
        with pytest.raises(AssertionError, match="host synchronisation"), no_host_sync():
            sync()


@pytest.mark.parametrize(
    "outputs, k",
    [
        (("argmax",), 0),
        (("lse", "argmax"), 0),
        (("draft", "argmax"), 0),
        (("draft", "lse", "argmax", "logprobs"), 0),
        (("draft_topk",), 8),  # 600 draft ids in 2 tiles: the first pass is exact
        (("topk", "draft"), 8),  # 8 candidates per tile: exact too
    ],
    ids=lambda x: "+".join(x) if isinstance(x, tuple) else f"k{x}",
)
def test_a_call_with_known_draft_ids_never_syncs(outputs, k, no_host_sync):
    gen = torch.Generator().manual_seed(7)
    hidden, weight, norm_weight, draft = _inputs(gen)
    kw = {"outputs": outputs, "k": k, "draft_ids": draft, "impl": "triton"}
    lm_head(hidden, weight, norm_weight, **kw)  # checks draft_ids (a sync, once per tensor)
    with no_host_sync():
        out = lm_head(hidden, weight, norm_weight, **kw)
    oracle = lm_head_oracle(hidden, weight, norm_weight, k=k, draft_ids=draft)
    assert_ids_equal(out.argmax, oracle.argmax, name="argmax")


def test_changed_draft_ids_are_checked_again():
    gen = torch.Generator().manual_seed(8)
    hidden, weight, norm_weight, draft = _inputs(gen)
    kw = {"outputs": ("draft",), "draft_ids": draft, "impl": "triton"}
    lm_head(hidden, weight, norm_weight, **kw)
    draft[3] = draft[2]  # in place: the cached check must not vouch for it
    with pytest.raises(ValueError, match="strictly increasing"):
        lm_head(hidden, weight, norm_weight, **kw)


@pytest.mark.parametrize("outputs", [("topk",), ("draft_topk",)], ids="+".join)
def test_the_exact_topk_rerun_never_syncs(outputs, no_host_sync, monkeypatch):
    """2 candidates per tile in the first pass and crowded rows: the re-run runs, sized from
    host integers alone, and the top-k comes out exact."""
    monkeypatch.setattr(lm, "_TOPK_ROUNDS", 2)
    reruns = []
    real_redo = lm._Head._redo_topk
    def spy(self, r0, sat, *args):
        reruns.append(sat.clone())
        return real_redo(self, r0, sat, *args)

    monkeypatch.setattr(lm._Head, "_redo_topk", spy)
    gen = torch.Generator().manual_seed(9)
    hidden, weight, norm_weight, draft = _inputs(gen, Vd=1200)
    hidden[:4] = weight[draft[:8]].float().sum(0).bfloat16()  # rows aimed at 8 adjacent draft ids
    kw = {"outputs": outputs, "k": 6, "draft_ids": draft, "impl": "triton"}
    lm_head(hidden, weight, norm_weight, **kw)
    with no_host_sync():
        out = lm_head(hidden, weight, norm_weight, **kw)
    assert any(bool(sat.any()) for sat in reruns), "no crowded tile: the re-run computed nothing"
    oracle = lm_head_oracle(hidden, weight, norm_weight, k=6, draft_ids=draft)
    prefix = outputs[0]
    assert_ids_equal(getattr(out, prefix + "_ids"), getattr(oracle, prefix + "_ids"), name="ids")
