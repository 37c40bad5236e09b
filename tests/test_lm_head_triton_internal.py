"""Kernel-internal tests of the Triton head (kernels/lm_head_triton.py and its _triton_* modules).

What: the interpreter switch (per launch, leaves triton untouched), the RNE rounding that
replaces the interpreter's truncating casts, the int64 top-k keys, the exact re-run of rows
whose first-pass top-k may be incomplete, row chunking under a small scratch budget, and
block configs. All on CPU through the interpreter (small shapes); one `gpu` test at a
moderate size compares the compiled kernel with the float64 oracle on CUDA.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl
from _assert import assert_close, assert_ids_equal
from _oracle import lm_head_oracle
from eagle_fast.kernels import _triton_aot as aot
from eagle_fast.kernels import _triton_config as cfgs
from eagle_fast.kernels import _triton_jit as jit
from eagle_fast.kernels import _triton_merge as merge
from eagle_fast.kernels import _triton_norm as norm
from eagle_fast.kernels import lm_head
from eagle_fast.kernels._triton_interpret import run_kernel
from eagle_fast.kernels._triton_jit import pack_key, round_rne
from triton.runtime.jit import JITFunction

lm = importlib.import_module("eagle_fast.kernels.lm_head_triton")

ALL = ("logits", "logprobs", "lse", "argmax", "topk", "draft")


@triton.jit
def _round_kernel(X_ptr, Y_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X_ptr + offs, mask=offs < n, other=0.0)
    if INTERPRET:
        x = round_rne(x, Y_ptr.dtype.element_ty)
    tl.store(Y_ptr + offs, x.to(Y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _pack_kernel(X_ptr, Out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X_ptr + offs, mask=offs < n, other=float("-inf"))
    tl.store(Out_ptr + offs, pack_key(x, offs), mask=offs < n)


def _interp(kernel, *args, **kwargs):
    run_kernel(kernel, (1,), True, *args, **kwargs)


def _rounding_probe(dtype) -> torch.Tensor:
    """fp32 values around every rounding hazard of `dtype`: exact ties (to even, both
    parities), just above / below ties, subnormals, overflow, signed zeros."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(2000, generator=g) * 10.0 ** torch.randint(-8, 6, (2000,), generator=g)]
    lo = torch.randn(500, generator=g).to(dtype).float()  # representable values
    bits = lo.view(torch.int32)
    drop = 16 if dtype == torch.bfloat16 else 13
    half = 1 << (drop - 1)
    for delta in (half, half - 1, half + 1, -half):  # ties and their neighbours
        parts.append((bits + delta).view(torch.float32))
    if dtype == torch.float16:
        parts.append(torch.tensor([6e-8, 2.98e-8, 2.99e-8, 8.9e-8, 1e-6, 6.1e-5, 65504.0, 65519.0,
                                   65520.0, 1e6, -1e6, -3e-8]))  # fmt: skip
    parts.append(torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38]))
    x = torch.cat(parts)
    return x[torch.isfinite(x)]


# ------------------------------------------------------------------------------- interpreter


def test_interpreter_launch_leaves_triton_untouched():
    if not isinstance(lm.lm_head_fwd_kernel, JITFunction):
        pytest.skip("TRITON_INTERPRET=1 at import: triton built interpreter kernels itself")
    call_before = JITFunction.__call__
    full_before = tl.core.full
    x = torch.randn(37)
    y = torch.empty(37, dtype=torch.bfloat16)
    _interp(_round_kernel, x, y, 37, BLOCK=64, INTERPRET=True)
    assert JITFunction.__call__ is call_before
    assert tl.core.full is full_before
    assert isinstance(lm.lm_head_fwd_kernel, JITFunction)  # still compilable ahead of time
    assert isinstance(norm.rms_norm_kernel, JITFunction)
    with pytest.raises(RuntimeError, match="outside of the scope of a kernel"):
        jit.tanh(torch.zeros(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_round_rne_matches_torch_cast(dtype):
    """Under the interpreter, stores to 16-bit round to nearest-even exactly like torch."""
    x = _rounding_probe(dtype)
    y = torch.empty(x.numel(), dtype=dtype)
    block = triton.next_power_of_2(x.numel())
    _interp(_round_kernel, x, y, x.numel(), BLOCK=block, INTERPRET=True)
    want = x.to(dtype)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (torch.isnan(y) & torch.isnan(want))
    bad = (~same).nonzero().flatten()[:5].tolist()
    assert bool(same.all()), (
        f"{int((~same).sum())} differ, e.g. {[(x[i].item(), y[i].item(), want[i].item()) for i in bad]}"
    )


def test_interpreter_cast_truncates_without_the_fix():
    """The reason for round_rne: the bare interpreter cast does not round (a test that
    would start failing if triton fixed it, so the workaround can go)."""
    x = _rounding_probe(torch.bfloat16)
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    _interp(
        _round_kernel, x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()), INTERPRET=False
    )
    assert not torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_pack_key_orders_by_value_then_lower_id():
    vals = torch.tensor([3.0, -1.0, 3.0, 0.0, -0.0, float("inf"), -2.5, -1.0, 1e-30, -1e-30, 3.0])
    keys = torch.empty(vals.numel(), dtype=torch.int64)
    _interp(_pack_kernel, vals, keys, vals.numel(), BLOCK=16)
    order = torch.sort(keys, descending=True).indices
    want = torch.sort(vals, descending=True, stable=True).indices  # equal values: lower id
    assert_ids_equal(order, want, name="key order")
    assert len(set(keys.tolist())) == vals.numel(), "keys must be unique"
    got_vals, got_ids = merge.unpack_keys(keys)
    assert_ids_equal(got_ids, torch.arange(vals.numel()), name="decoded ids")
    assert torch.equal(got_vals.abs(), vals.abs())  # -0.0 packs as +0.0 (they tie)


def test_pack_key_marks_minus_inf_as_empty():
    vals = torch.tensor([float("-inf"), 1.0])
    keys = torch.empty(2, dtype=torch.int64)
    _interp(_pack_kernel, vals, keys, 2, BLOCK=16)
    assert keys[0].item() == jit.KEY_NONE and keys[1].item() > keys[0].item()


# --------------------------------------------------------------------------- head behaviour


def _int_logit_inputs(logits: torch.Tensor, dtype=torch.bfloat16):
    """hidden one-hot rows and a weight whose column j holds row j's logits: the head then
    computes exactly `logits` (small integers: exact in every dtype and summation order)."""
    N, V = logits.shape
    H = max(16, N)
    hidden = torch.zeros(N, H)
    hidden[torch.arange(N), torch.arange(N)] = 1.0
    weight = torch.zeros(V, H)
    weight[:, :N] = logits.t()
    return hidden.to(dtype), weight.to(dtype)


def test_topk_rows_with_crowded_tiles_are_recomputed_exactly(monkeypatch):
    """Keep 2 candidates per tile in the first pass; rows whose top-6 crowd one vocab tile
    must be detected and re-run, and every row must come out exactly right."""
    monkeypatch.setattr(lm, "_TOPK_ROUNDS", 2)
    redo_rows = []
    real_redo = lm._Head._redo_topk

    def spy(self, r0, sat, *args):
        redo_rows.extend((sat.any(1).nonzero().squeeze(1) + r0).tolist())
        return real_redo(self, r0, sat, *args)

    monkeypatch.setattr(lm._Head, "_redo_topk", spy)
    g = torch.Generator().manual_seed(1)
    N, V, k = 20, 1100, 6  # interpreter tiles: 512 wide, 3 of them
    logits = torch.randint(-40, 20, (N, V), generator=g).float()
    crowded = [0, 3, 7, 19]
    for r in crowded:  # top-6 (with ties) inside one tile
        t0 = 512 * (r % 3)
        logits[r, t0 + 5 : t0 + 11] = torch.tensor([30.0, 30.0, 29.0, 31.0, 29.0, 30.0])
    hidden, weight = _int_logit_inputs(logits)
    draft = torch.arange(0, V, 5)
    out = lm_head(hidden, weight, None, norm="none", outputs=ALL, k=k, draft_ids=draft,
                  impl="triton")  # fmt: skip
    assert set(crowded) <= set(redo_rows)
    oracle = lm_head_oracle(hidden, weight, None, norm="none", k=k, draft_ids=draft)
    assert_ids_equal(out.topk_ids, oracle.topk_ids, name="topk_ids")
    assert_ids_equal(out.argmax, oracle.argmax, name="argmax")
    assert_close(out.topk_logprobs, oracle.topk_logprobs, atol=1e-5, rtol=1e-6, name="topk_lp")
    assert_close(out.topk_tail, oracle.topk_tail, atol=1e-7, rtol=1e-5, name="topk_tail")
    assert_close(out.lse, oracle.lse, atol=1e-5, rtol=1e-6, name="lse")


def test_argmax_ties_across_tiles_go_to_the_lower_id():
    V = 1600  # 4 interpreter tiles
    logits = torch.zeros(3, V)
    logits[0, [1500, 700, 900]] = 5.0  # tiles 2, 1, 1 -> 700
    logits[1, [513, 1, 1599]] = 5.0  # tiles 1, 0, 3 -> 1
    logits[2, :] = 2.0  # everything ties -> 0
    hidden, weight = _int_logit_inputs(logits)
    out = lm_head(hidden, weight, None, norm="none", outputs=("topk",), k=3, impl="triton")
    assert out.argmax.tolist() == [700, 1, 0]
    assert out.topk_ids.tolist() == [[700, 900, 1500], [1, 513, 1599], [0, 1, 2]]


@pytest.mark.parametrize("outputs", [("draft", "argmax"), ("draft_topk",), ("draft", "lse")], ids="+".join)
def test_argmax_ties_go_to_the_lower_target_id_in_the_draft_first_walk(outputs):
    """The draft ids fill the first tiles, so a tile's position no longer orders its ids: a
    tie between a draft id and a lower non-draft id (walked later) must still give the lower
    target id, as must ties inside the last, mixed draft tile and at the ragged end."""
    V = 1700  # the 550 draft ids 601, 603, .., 1699 fill positions 0-549; 4 tiles of 512
    draft = torch.arange(601, V, 2)
    logits = torch.zeros(5, V)
    logits[0, [1601, 7, 900]] = 5.0  # draft 1601 (tile 0) vs non-draft 7 (tile 1) -> 7
    logits[1, [1699, 1697, 600]] = 5.0  # last draft id, a draft id, a non-draft id -> 600
    logits[2, :] = -3.0  # everything ties -> 0
    logits[3, [1699, 1698]] = 4.0  # a draft id, the walk's last position (ragged tile) -> 1698
    logits[4, [603, 605]] = 2.0  # two draft ids in tile 0 -> 603
    hidden, weight = _int_logit_inputs(logits)
    out = lm_head(hidden, weight, None, norm="none", outputs=outputs, k=3, draft_ids=draft,
                  impl="triton")  # fmt: skip
    assert out.argmax.tolist() == [7, 600, 0, 1698, 603]
    assert out.argmax_in_draft.tolist() == [False, False, False, False, True]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_chunks_under_a_tiny_scratch_budget(monkeypatch, out_dtype):
    """_SCRATCH_BYTES=1 forces one BLOCK_N row block per launch (3 chunks for 40 rows),
    with fp32 staging of logprobs / draft and top-k re-runs spanning chunks."""
    g = torch.Generator().manual_seed(2)
    N, H, V, k = 40, 64, 700, 12
    hidden = torch.randn(N, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) * 0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    draft = torch.arange(3, V, 4)
    kw = {"outputs": ALL, "k": k, "draft_ids": draft, "out_dtype": out_dtype, "softcap": 20.0}
    whole = lm_head(hidden, weight, nw, impl="triton", **kw)
    monkeypatch.setattr(lm, "_SCRATCH_BYTES", 1)
    chunked = lm_head(hidden, weight, nw, impl="triton", **kw)
    for name, t in whole.as_dict().items():
        c = getattr(chunked, name)
        if t.is_floating_point():  # ulp noise: the interpreter's BLAS dot depends on row position
            assert_close(c, t, atol=1e-5, rtol=1e-5, name=name)
        else:
            assert_ids_equal(c, t, name=name)
    oracle = lm_head_oracle(hidden, weight, nw, k=k, draft_ids=draft, softcap=20.0)
    tol = 1e-4 if out_dtype == torch.float32 else 2e-2
    for name in ("lse", "logprobs", "draft_logprobs", "topk_logprobs"):
        assert_close(getattr(chunked, name), getattr(oracle, name), atol=tol, rtol=tol, name=name)


def test_default_configs_fit_hopper_shared_memory():
    seen = set()
    for _, v in aot.aot_variants():
        cfg = cfgs.default_config(v, 8192, 151_936, 4096, interpret=False)
        w_bytes = 4 if v.weight == "fp32" else 2
        smem = (cfg.BLOCK_N + cfg.BLOCK_V) * cfg.BLOCK_H * w_bytes * cfg.num_stages
        assert smem <= 227 * 1024, (v, cfg)
        seen.add(cfg)
    assert len(seen) == 4  # big tile, heavy-epilogue tile, both [N, V] stores with draft, fp32


# ----------------------------------------------------------------------------------- GPU


def cuda_case(seed: int, draft_step: int):
    """bf16 inputs on CUDA at a ragged shape (N=300, H=1024, V=32,003), k=64, every
    `draft_step`-th id a draft id: `(hidden, weight, norm_weight, draft, k)`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    N, H, V, k = 300, 1024, 32_003, 64
    hidden = (torch.randn(N, H, device="cuda", generator=g) * 3).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * (4 / H**0.5)).bfloat16()
    nw = (1 + 0.2 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    return hidden, weight, nw, torch.arange(0, V, draft_step, device="cuda"), k


@pytest.mark.gpu
@pytest.mark.parametrize("outputs", [("lse", "argmax"), ("topk", "draft"), ALL], ids="+".join)
def test_compiled_kernel_matches_oracle_on_cuda(outputs):
    hidden, weight, nw, draft, k = cuda_case(5, 7)
    out = lm_head(hidden, weight, nw, outputs=outputs, k=k, draft_ids=draft, impl="triton")
    oracle = lm_head_oracle(hidden, weight, nw, k=k, draft_ids=draft)
    assert_close(out.lse, oracle.lse, atol=1e-4, rtol=1e-5, name="lse")
    best = oracle.logits.gather(1, out.argmax[:, None]).squeeze(1)
    assert_close(best, oracle.logits.amax(1), atol=1e-3, rtol=0, name="logit at argmax")
    if "topk" in outputs:
        got = oracle.logits.gather(1, out.topk_ids)
        want = oracle.logits.gather(1, oracle.topk_ids)
        assert_close(got, want, atol=1e-3, rtol=0, name="logits at topk ids")
        assert_close(out.topk_tail, oracle.topk_tail, atol=1e-4, rtol=1e-3, name="topk_tail")
    if "draft" in outputs:
        assert_close(out.draft_logprobs, oracle.draft_logprobs, atol=1e-3, rtol=1e-5, name="draft")
    if "logits" in outputs:
        assert_close(out.logits, oracle.logits, atol=1e-3, rtol=1e-5, name="logits")


def _language_snapshot() -> dict:
    objs = {"tl": tl, "tl.core": tl.core, "tl.math": tl.math, "tl.tensor": tl.tensor}
    return {(name, attr): value for name, obj in objs.items() for attr, value in vars(obj).items()}


def test_full_head_launch_restores_triton_language():
    # A real head launch reaches tl.max / tl.sum (triton.language.standard) and our own jit
    # helpers; every patch the interpreter made must be undone, or later compilations in the
    # same process (the AOT test) fail with "Unsupported function referenced: _new_reduce".
    from eagle_fast.kernels import lm_head

    before = _language_snapshot()
    hidden, weight, nw = torch.randn(5, 64), torch.randn(300, 64), torch.rand(64) + 0.5
    lm_head(hidden, weight, nw, outputs=("lse", "argmax", "topk", "draft"), k=3,
            draft_ids=torch.arange(0, 300, 7), impl="triton")  # fmt: skip
    lm_head(hidden, weight, nw, outputs=("draft_topk", "draft"), k=3,
            draft_ids=torch.arange(0, 300, 7), impl="triton")  # fmt: skip
    after = _language_snapshot()
    changed = sorted(key for key in before.keys() | after.keys() if after.get(key) is not before.get(key))
    assert not changed, f"triton.language left patched: {changed[:10]}"
